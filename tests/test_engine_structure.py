"""How the engine is put together: small classes, a pure-torch core that never imports upward, one place that tells
the overlap modes apart, and a design document whose references to tests are real."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORE = ROOT / "hf_diloco" / "core"
GLUE = ("transformers", "accelerate", "peft", "datasets", "huggingface_hub", "hf_diloco")
# Config dataclasses may be long (one field each).
LONG_ALLOWED = {"DiLoCoConfig"}


def _core_modules() -> list[Path]:
    return sorted(CORE.glob("*.py"))


def class_lengths(folder: Path) -> dict[str, int]:
    """Lines of every class under `folder` (decorators included), by `path:Class`, config dataclasses left out."""
    lengths = {}
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.name not in LONG_ALLOWED:
                start = min([node.lineno] + [d.lineno for d in node.decorator_list])
                lengths[f"{path.relative_to(folder)}:{node.name}"] = node.end_lineno - start + 1
    return lengths


def test_no_class_of_the_package_is_longer_than_300_lines():
    """The engine, the integrations (the Trainer glue is one mixin per concern) and everything else."""
    lengths = class_lengths(ROOT / "hf_diloco")
    assert any(name.startswith("core/") for name in lengths) and any(
        name.startswith("integrations/") for name in lengths
    )
    assert max(lengths.values()) <= 300, sorted(lengths.items(), key=lambda item: -item[1])[:3]


def test_core_is_pure_torch_and_never_imports_upward():
    for path in sorted(CORE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert node.level <= 1, f"{path.name}:{node.lineno} imports from above hf_diloco/core"
                assert node.level == 1 or not (node.module or "").startswith(GLUE), f"{path.name}:{node.lineno}"
            if isinstance(node, ast.Import):
                assert not any(alias.name.startswith(GLUE) for alias in node.names), f"{path.name}:{node.lineno}"


ROOMS = {"cli", "configs", "core", "integrations", "job", "metrics", "model_cards", "parallel", "publish"}


def test_the_top_of_the_package_holds_only_its_rooms_and_its_public_face():
    """Every module lives in a room named for its concern; `hf_diloco/__init__.py` names what users import."""
    package = ROOT / "hf_diloco"
    modules = {path.name for path in package.glob("*.py")}
    assert modules == {"__init__.py", "__main__.py"}, modules
    rooms = {path.name for path in package.iterdir() if path.is_dir() and path.name != "__pycache__"}
    assert rooms <= ROOMS, rooms - ROOMS


def test_the_engine_needs_nothing_the_front_ends_or_the_job_hold():
    """`parallel/` and `core/` never import the front-ends, the job, the publishing or the commands."""
    above = ("integrations", "job", "publish", "cli")
    for room in ("core", "parallel"):
        for path in sorted((ROOT / "hf_diloco" / room).rglob("*.py")):
            package = path.relative_to(ROOT).parent.parts
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.level:
                    target = package[: len(package) - node.level + 1] + tuple((node.module or "").split("."))
                    assert target[1:2] not in [(name,) for name in above], f"{path}:{node.lineno} imports {target}"
                if isinstance(node, ast.ImportFrom) and not node.level and node.module:
                    assert not node.module.startswith(tuple(f"hf_diloco.{name}" for name in above)), path


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports anywhere in its text (at the top, in functions, for type checking
    only): `from .x import y` counts as importing `x.y` when that is a module, else `x`."""
    paths = {_module_name(path): path for path in (ROOT / "hf_diloco").rglob("*.py")}
    graph = {}
    for name, path in paths.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                above = package[: len(package) - node.level + 1] if node.level else []
                base = ".".join(above + ([node.module] if node.module else []))
                for alias in node.names:
                    imported.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in paths else base)
            elif isinstance(node, ast.Import):
                imported |= {alias.name for alias in node.names}
        graph[name] = {module for module in imported if module in paths and module not in (name, "hf_diloco")}
    return graph


def test_no_module_of_the_package_imports_itself_through_others():
    """No import circle, counting imports for type checking: each part of the engine serialises itself, and the
    engine composes them (`core/checkpoint.py` and `core/elastic.py` take parts, never the engine's class)."""
    graph = import_graph()
    assert "hf_diloco.core.checkpoint" in graph["hf_diloco.core.diloco"]  # the graph sees relative imports
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            raise AssertionError("import circle: " + " -> ".join(path[path.index(module) :] + [module]))
        if module not in done:
            for imported in sorted(graph[module]):
                visit(imported, path + [module])
            done.add(module)

    for module in sorted(graph):
        visit(module, [])


def test_overlap_modes_are_told_apart_in_one_place():
    """`config.overlap` is read to pick the mode's class (`make_overlap`) and nowhere else in the engine."""
    readers = []
    for path in _core_modules():
        if path.name == "config.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "overlap" and _is_config(node.value):
                readers.append(f"{path.name}:{node.lineno}")
    assert readers == ["overlap.py:" + str(_line_of("overlap.py", "return modes[config.overlap]"))], readers


def _is_config(node: ast.expr) -> bool:
    """`config` or `<anything>.config`."""
    return (isinstance(node, ast.Name) and node.id == "config") or (
        isinstance(node, ast.Attribute) and node.attr == "config"
    )


def _line_of(name: str, text: str) -> int:
    return next(i for i, line in enumerate((CORE / name).read_text().splitlines(), 1) if text in line)


def test_design_document_names_tests_that_exist():
    design = (ROOT / "docs" / "design.md").read_text()
    references = re.findall(r"(tests/[\w/]+\.py)::(\w+)", design)
    assert len(references) >= 15
    for file, name in references:
        tree = ast.parse((ROOT / file).read_text())
        names = {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}
        assert name in names, f"docs/design.md names {file}::{name}, which does not exist"
    for number in range(1, 8):
        assert f"\n{number}. " in design, f"invariant {number} is not in docs/design.md"


def test_nothing_points_at_a_design_document_outside_the_repository():
    outside = "DESIGN" + ".md"  # the starting contract, which is not in the repository
    for folder in ("hf_diloco", "scripts", "tests"):
        for path in (ROOT / folder).rglob("*.py"):
            assert outside not in path.read_text(), f"{path.relative_to(ROOT)} cites {outside}; cite docs/design.md"


def test_benchmarks_observe_the_engine_instead_of_patching_it():
    harness = [*(ROOT / "scripts").rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py")]
    assert any("register_round_observer" in path.read_text() for path in harness)
    for path in harness:
        text = path.read_text()
        assert not re.search(r"DiLoCo\._\w+\s*(,|=)", text), f"{path.name} patches a private engine method"
        assert "engine._" not in text, f"{path.name} reads private engine state"
