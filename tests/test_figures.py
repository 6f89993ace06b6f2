"""One number, one place: every figure the README and the documentation site quote is a named figure computed from the
stored results (benchmarks/figures.py -> docs/figures.json), or is itself in a stored result, or is a quantity the
project defines rather than measures (DEFINITIONS, each with what defines it). BENCHMARKS.md, the record of every
measurement next to its command, is where other figures are written once; pages link to it."""

from __future__ import annotations

import json
import re
from pathlib import Path

from benchmarks import figures

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
# The pages a user reads, in the repository and on the site; docs/design.md is the engine's specification (its
# quantities are definitions: bytes per parameter, the rules' constants).
PAGES = [ROOT / "README.md", *sorted(path for path in DOCS.rglob("*.md") if path.name != "design.md")]

NUMBER = r"[+\-−]?\d[\d,]*(?:\.\d+)?"
UNIT = r"(?:%|x(?!\w)| ?(?:ms|s|min|h|minutes|seconds|hours|kB|MB|GB|MiB|GiB|Mbit/s|Gbit/s)(?![\w/])| tests\b)"
FIGURE = re.compile(rf"(?<![\w.]){NUMBER}(?:-{NUMBER})?{UNIT}|± ?\d+(?:\.\d+)?")

# Quantities that are settings, defaults or formats of this project or of its dependencies, not measurements.
DEFINITIONS = {
    "1 Gbit/s": "the link speed the project is made for (a description of the use case)",
    "1000 Mbit/s": "a link rate the benchmarks emulate (a setting)",
    "1800 s": "the default of sync_timeout_seconds and of transformers' ddp_timeout",
    "300 s": "the defaults of min_workers_timeout and store_timeout_seconds",
    "600 s": "torchft's default quorum_timeout",
    "60 s": "the default of membership_sync_timeout; the Lighthouse's --join_timeout_ms 60000 in the commands",
    "10 s": "the interval at which a worker asks a restarted Lighthouse for its next group again (torchft)",
    "5 s": "the Lighthouse's default --heartbeat_timeout_ms; 5 s / 2 s: the timeouts a page warns against",
    "2 s": "the heartbeat timeout a page warns against",
    "1 MiB": "the size of the pieces entropy coding deflates in parallel (a constant of the exchange)",
    "32 MB": "glibc's largest mmap threshold (malloc's documented constant)",
    "141x": "the topk codec's format: 4096 fp32 values in 116 bytes (arithmetic, not a measurement)",
    "5 minutes": "the time bound scripts/gpu_check.py is written to stay under",
}


def prose(markdown: str) -> str:
    """What a reader reads as text: code blocks and spans, link targets, comments and placeholders left out."""
    for pattern in (r"```.*?```", r"`[^`]*`", r"\]\([^)]*\)", r"<!--.*?-->", r"\{\{ [a-z0-9_]+ \}\}"):
        markdown = re.sub(pattern, " ", markdown, flags=re.S)
    return markdown


def stored_results_text() -> str:
    return "\n".join(
        path.read_text() for path in (ROOT / "benchmarks" / "results").rglob("*") if path.suffix in (".md", ".json")
    )


def test_the_named_figures_are_what_the_stored_results_give():
    assert json.loads((DOCS / "figures.json").read_text()) == figures.compute(), (
        "docs/figures.json is stale: run python -m benchmarks.figures"
    )


def test_every_figure_placeholder_names_a_figure():
    known = set(json.loads((DOCS / "figures.json").read_text()))
    for page in PAGES:
        named = set(re.findall(r"\{\{ ([a-z0-9_]+) \}\}", page.read_text()))
        assert named <= known, (
            f"{page.relative_to(ROOT)} names figures docs/figures.json does not hold: {named - known}"
        )


def unsourced(markdown: str) -> list[str]:
    """The figures of `markdown`'s prose that are neither named figures, nor in a stored result, nor definitions."""
    named = [figure["text"] for figure in json.loads((DOCS / "figures.json").read_text()).values()]
    results = stored_results_text()
    found = []
    for match in FIGURE.finditer(prose(markdown)):
        token = match.group(0)
        if any(token in text for text in named) or token.removesuffix(" tests") in named or token in DEFINITIONS:
            continue
        if not re.search(rf"(?<![\d.]){re.escape(token)}(?!\d)", results):
            found.append(token)
    return found


def test_readme_and_docs_quote_only_figures_the_stored_results_hold():
    quoted = {str(page.relative_to(ROOT)): unsourced(page.read_text()) for page in PAGES}
    assert {page: figures for page, figures in quoted.items() if figures} == {}, (
        "figures quoted without a source: name them in benchmarks/figures.py (computed from benchmarks/results) and "
        "quote {{ name }} in docs pages (its text in README.md), or link to where BENCHMARKS.md writes them"
    )


def test_the_checker_finds_an_unsourced_figure():
    """The checker's own probe: a test count and a loss gap nobody measured are caught; a named figure, a figure in
    code and a definition are not."""
    text = "About 940 tests; -6.43% ± 9.97 of loss; `sign_link` sends 3713x fewer bytes in `12.5 s`; timeout 1800 s."
    assert [match.group(0) for match in FIGURE.finditer(prose(text))] == [
        "940 tests",
        "-6.43%",
        "± 9.97",
        "3713x",
        "1800 s",
    ]
    assert unsourced(text) == ["940 tests", "-6.43%", "± 9.97"]
