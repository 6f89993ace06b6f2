"""`hf-diloco configs [NAME]`: list the configs shipped with the package, or print one (to start your own from);
`hf-diloco configs --fields` prints the table of every DiLoCo field (the documentation's configuration reference,
docs/reference/configuration.md, is built with it)."""

from __future__ import annotations

import argparse
import dataclasses
import re
import textwrap
from collections.abc import Sequence

from ..core.settings.config import DiLoCoConfig
from ..job.config_file import shipped_config_names, shipped_config_text


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
            print(_listing_entry(name, _summary(shipped_config_text(name))))
    return 0


def diloco_fields_table() -> str:
    """The markdown table of the `DiLoCoConfig` fields (name, default, meaning) of the configuration reference."""
    rows = ["| field | default | meaning |", "|---|---|---|"]
    for f in dataclasses.fields(DiLoCoConfig):
        choices = f.metadata.get("choices")
        meaning = f.metadata.get("help", "") + (f" One of: {', '.join(choices)}." if choices else "")
        rows.append(f"| `{f.name}` | `{f.default}` | {meaning} |")
    return "\n".join(rows)


def _summary(text: str) -> str:
    """The first sentence of a config's opening comment, however many lines it spans (never cut mid-sentence)."""
    words = []
    for line in text.splitlines():
        if not line.startswith("#") or line.startswith("#  "):  # the comment ends, or a command line starts
            break
        words.append(line.lstrip("#").strip())
    paragraph = " ".join(words)
    end = re.search(
        r"(?<!\bal)\.(?=\s+[A-Z0-9]|$)", paragraph
    )  # a full stop before a capital or digit; "et al." is none
    sentence = paragraph[: end.start()] if end else paragraph.rstrip(":")
    return sentence + "."


def _listing_entry(name: str, summary: str, width: int = 119) -> str:
    """`name` then its summary, wrapped under the summary's column."""
    return textwrap.fill(summary, width, initial_indent=f"{name:20s} ", subsequent_indent=" " * 21)
