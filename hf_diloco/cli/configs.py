"""`hf-diloco configs [NAME]`: list the configs shipped with the package, or print one (to start your own from)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from .config_file import shipped_config_names, shipped_config_text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hf-diloco configs",
        description="List the shipped configs (usable as hf-diloco pretrain --config NAME), or print one: "
        "hf-diloco configs tiny_diloco > my_run.yaml.",
    )
    parser.add_argument("name", nargs="?", help="the shipped config to print")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.name is not None:
        print(shipped_config_text(args.name), end="")
        return 0
    for name in shipped_config_names():
        print(f"{name:20s} {_summary(shipped_config_text(name))}")
    return 0


def _summary(text: str) -> str:
    """The first comment line of a config."""
    first = next((line for line in text.splitlines() if line.startswith("#")), "# ")
    return first.lstrip("# ").strip()
