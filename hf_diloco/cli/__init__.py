"""The `hf-diloco` command: `hf-diloco COMMAND [ARGS]`; `hf-diloco COMMAND --help` lists a command's flags."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from .refusals import exit_status_of

COMMANDS = {
    "pretrain": "Pretrain a causal LM from a YAML config (the main job; launch it with torchrun or accelerate).",
    "launch": "torchrun for pretrain on several processes, where a refused input ends with its message and exit 2.",
    "push": "Upload a saved model folder to the Hugging Face Hub (weights, tokenizer, card; no checkpoints).",
    "plot": "Plot the loss, bytes sent and sync wait of one or more runs as PNG files.",
    "configs": "List the configs shipped with the package, or print one to start your own from.",
    "plan": "Plan a run from the model, the sites and their link: a ready YAML and a table of what to expect.",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hf-diloco",
        description="Pretrain Hugging Face causal LMs across machines on slow links with DiLoCo, Streaming DiLoCo "
        "and DiLoCoX.",
        epilog="Example: hf-diloco pretrain --config tiny_diloco (one process); several processes: torchrun "
        "--nproc_per_node 2 -m hf_diloco pretrain --config tiny_diloco --use_cpu.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, summary in COMMANDS.items():
        # Each command parses its own flags (and prints its own --help).
        commands.add_parser(name, help=summary, add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run `hf-diloco COMMAND ARGS`; returns the exit status."""
    arguments = list(sys.argv[1:] if argv is None else argv)
    known, rest = build_parser().parse_known_args(arguments[:1])
    module = importlib.import_module(f"{__name__}.{known.command}")
    return exit_status_of(lambda: module.main([*rest, *arguments[1:]]))


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("hf_diloco")
    except metadata.PackageNotFoundError:
        return "unknown"
