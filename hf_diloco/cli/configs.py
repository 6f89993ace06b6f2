"""`hf-diloco configs [NAME]`: list the configs shipped with the package, or print one (to start your own from);
`hf-diloco configs --fields` prints the table of every DiLoCo field (README's configuration reference)."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence

from ..core.config import DiLoCoConfig
from ..job_config import shipped_config_names, shipped_config_text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hf-diloco configs",
        description="List the shipped configs (usable as hf-diloco pretrain --config NAME), or print one: "
        "hf-diloco configs tiny_diloco > my_run.yaml.",
    )
    parser.add_argument("name", nargs="?", help="the shipped config to print")
    parser.add_argument(
        "--fields", action="store_true", help="print every DiLoCo field (default and meaning) as a markdown table"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.fields:
        print(diloco_fields_table())
    elif args.name is not None:
        print(shipped_config_text(args.name), end="")
    else:
        for name in shipped_config_names():
            print(f"{name:20s} {_summary(shipped_config_text(name))}")
    return 0


def diloco_fields_table() -> str:
    """The markdown table of the `DiLoCoConfig` fields (name, default, meaning) that README.md's reference holds."""
    rows = ["| field | default | meaning |", "|---|---|---|"]
    for f in dataclasses.fields(DiLoCoConfig):
        choices = f.metadata.get("choices")
        meaning = f.metadata.get("help", "") + (f" One of: {', '.join(choices)}." if choices else "")
        rows.append(f"| `{f.name}` | `{f.default}` | {meaning} |")
    return "\n".join(rows)


def _summary(text: str) -> str:
    """The first comment line of a config."""
    first = next((line for line in text.splitlines() if line.startswith("#")), "# ")
    return first.lstrip("# ").strip()
