"""MkDocs hooks of the documentation site (mkdocs.yml, `hooks:`): what a page holds that is generated at build time,
so that nothing is written by hand twice.

- `<!-- diloco-fields -->`: the table of `DiLoCoConfig`'s fields, from the dataclass and its `help` metadata (what
  `hf-diloco configs --fields` prints).
- `<!-- api-reference -->`: one mkdocstrings block per public name of `hf_diloco` (its `__all__`), at the module it
  lives in, so a name moved between modules needs no edit here.
- `<!-- figures-table -->`: every named figure of docs/figures.json with its value and source.
- `{{ NAME }}`: the named figure NAME of docs/figures.json (generated from benchmarks/results by
  `python -m benchmarks.figures`); an unknown name stops the build.
- `<!-- include: PATH -->`: a markdown file of the repository outside docs/ (BENCHMARKS.md), its title left out.
- A link to a repository file that the site publishes as a page (`../../BENCHMARKS.md#bytes`) points at that page.
"""

from __future__ import annotations

import importlib
import json
import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
FIGURES = DOCS / "figures.json"
# Repository files that are pages of the site, under another path: links to them are pointed at the page.
PUBLISHED_AS = {ROOT / "BENCHMARKS.md": DOCS / "benchmarks.md", ROOT / "docs" / "design.md": DOCS / "design.md"}
PLACEHOLDER = re.compile(r"\{\{ ([a-z0-9_]+) \}\}")
INCLUDE = re.compile(r"^<!-- include: (\S+) -->$", re.M)
LINK = re.compile(r"\]\(([^)#\s]+\.md)(#[^)\s]*)?\)")
IMAGE = re.compile(r"\]\(((?![a-z]+://)[^)#\s]+\.png)()\)")  # a local image: rebased like a page link


def figures() -> dict[str, dict]:
    return json.loads(FIGURES.read_text())


def fields_table() -> str:
    from hf_diloco.cli.configs import diloco_fields_table

    return diloco_fields_table()


def api_reference() -> str:
    """A `::: module.Name` block per name of `hf_diloco.__all__`, from the package's lazy export table."""
    package = importlib.import_module("hf_diloco")
    blocks = []
    for name in package.__all__:
        if name in package._LAZY:
            module, attr = package._LAZY[name]
            path = f"hf_diloco.{module}.{attr}"
        else:
            path = f"{getattr(package, name).__module__}.{name}"
        blocks.append(f"::: {path}")
    return "\n\n".join(blocks)


def figures_table() -> str:
    rows = ["| name | value | source |", "|---|---|---|"]
    for name, figure in figures().items():
        rows.append(f"| `{name}` | {figure['text']} | {figure['source']} |")
    return "\n".join(rows)


def include(match: re.Match, page: Path) -> str:
    """The file's text without its title, its relative links and images rewritten from its folder to the including
    page's."""
    included = ROOT / match.group(1)
    text = included.read_text()
    text = text.split("\n", 1)[1] if text.startswith("# ") else text

    def rebase(link: re.Match) -> str:
        target = os.path.relpath((included.parent / link.group(1)).resolve(), page.parent)
        return f"]({target}{link.group(2) or ''})"

    return IMAGE.sub(rebase, LINK.sub(rebase, text))


def substitute_figure(match: re.Match, known: dict[str, dict], page: str) -> str:
    if match.group(1) not in known:
        raise ValueError(f"{page} quotes the figure {{{{ {match.group(1)} }}}}, which docs/figures.json does not hold")
    return known[match.group(1)]["text"]


def repoint_links(markdown: str, source: Path) -> str:
    """Links written for the repository (to BENCHMARKS.md, which the site shows as benchmarks.md) find the page."""

    def repoint(match: re.Match) -> str:
        target = (source.parent / match.group(1)).resolve()
        if target not in PUBLISHED_AS or PUBLISHED_AS[target] == target:
            return match.group(0)
        relative = os.path.relpath(PUBLISHED_AS[target], source.parent)
        return f"]({relative}{match.group(2) or ''})"

    return LINK.sub(repoint, markdown)


def on_page_markdown(markdown: str, page, config, files) -> str:
    source = Path(page.file.abs_src_path)
    markdown = INCLUDE.sub(lambda match: include(match, source), markdown)
    if "<!-- diloco-fields -->" in markdown:
        markdown = markdown.replace("<!-- diloco-fields -->", fields_table())
    if "<!-- api-reference -->" in markdown:
        markdown = markdown.replace("<!-- api-reference -->", api_reference())
    if "<!-- figures-table -->" in markdown:
        markdown = markdown.replace("<!-- figures-table -->", figures_table())
    known = figures()
    markdown = PLACEHOLDER.sub(lambda match: substitute_figure(match, known, page.file.src_path), markdown)
    return repoint_links(markdown, source)
