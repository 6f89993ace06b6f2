"""The benchmark harness is a package: every module runs as `python -m benchmarks.<name>` with a `main(argv)` and a
`--help`, imports no private name of hf_diloco or of another benchmark, and edits no import path."""

from __future__ import annotations

import ast
import importlib
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import benchmarks

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "benchmarks"
MODULES = sorted(
    info.name
    for info in pkgutil.iter_modules(benchmarks.__path__)
    if info.name not in ("common", "netns", "over_seeds", "store_counts")  # helpers, not benchmarks
)


def _private_imports(path: Path) -> set[tuple[str, str, str]]:
    """(module, imported from, name) of every `from hf_diloco... / benchmarks... import _name` in `path`."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in ("hf_diloco", "benchmarks"):
            found |= {(path.stem, node.module, alias.name) for alias in node.names if alias.name.startswith("_")}
        if isinstance(node, ast.Import):
            found |= {(path.stem, alias.name, "") for alias in node.names if "._" in alias.name}
    return found


def test_the_harness_is_in_the_package_and_scripts_holds_the_main_job():
    assert {"comm", "quality", "wan", "overhead", "eager_estimate", "entropy_coding", "fragment_sizes"} <= set(MODULES)
    assert {"seed_table", "pipeline_families"} <= set(MODULES)
    assert not list((ROOT / "scripts").glob("bench_*.py"))
    assert not (ROOT / "scripts" / "netns.py").exists() and not (ROOT / "scripts" / "pipeline_families.py").exists()


def test_no_module_imports_a_private_name_or_edits_the_import_path():
    import_path = "sys." + "path"  # spelled apart so that a repository-wide grep for it finds only real edits
    private = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        assert import_path not in path.read_text(), f"{path.relative_to(ROOT)} edits {import_path}"
        private |= _private_imports(path)
    assert not private, f"private imports: {sorted(private)}"


@pytest.mark.parametrize("name", MODULES)
def test_every_module_has_a_main_with_help(name, capsys):
    module = importlib.import_module(f"benchmarks.{name}")
    with pytest.raises(SystemExit) as exit_info:
        module.main(["--help"])
    assert exit_info.value.code == 0
    assert "usage:" in capsys.readouterr().out


@pytest.mark.timeout(120)
def test_runs_as_a_module_from_the_repository_root():
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.fragment_sizes", "--num_fragments", "2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "| bench model (benchmarks.comm) |" in result.stdout
