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
    return sorted(CORE.rglob("*.py"))


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


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in `path`, relative ones resolved against its package."""
    package = list(path.relative_to(ROOT).parent.parts)
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            found.append((node.lineno, ".".join(base + ([node.module] if node.module else []))))
        elif isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
    return found


def test_core_is_pure_torch_and_never_imports_upward():
    """Nothing in `hf_diloco/core` imports the glue above it, transformers, accelerate, torchft or any other
    third-party package beyond torch (a store library, a Lighthouse: they live in `hf_diloco.backends`)."""
    third_party = (*GLUE, "torchft", "obstore", "fsspec", "s3fs", "boto3", "moto")
    for path in _core_modules():
        for line, module in _imports(path):
            where = f"{path.relative_to(ROOT)}:{line} imports {module}"
            if module.startswith("hf_diloco"):
                assert module.startswith("hf_diloco.core"), where
            else:
                assert not module.startswith(third_party), where


def _room_of(module: str) -> str | None:
    """The room of the core a module lives in (None: the engine at the top of the core, or outside it)."""
    parts = module.split(".")
    return parts[2] if len(parts) > 3 and parts[:2] == ["hf_diloco", "core"] else None


def test_every_room_of_the_core_imports_only_rooms_below_it():
    """`hf_diloco.core.FLOORS` orders the rooms; an import from a room to one of the same or a higher floor (an arrow
    up, or the start of a circle between rooms) fails here, naming the line."""
    from hf_diloco.core import FLOORS

    floor = {room: level for level, rooms in enumerate(FLOORS) for room in rooms}
    rooms = {path.name for path in CORE.iterdir() if path.is_dir() and path.name != "__pycache__"}
    assert rooms == set(floor), f"rooms on disk {sorted(rooms)} against FLOORS {sorted(floor)}"
    loose = {path.name for path in CORE.glob("*.py")}
    assert loose == {"__init__.py", "diloco.py"}, loose  # the engine stands on the rooms
    for path in _core_modules():
        mine = _room_of(_module_name(path) + (".__init__" if path.name == "__init__.py" else ""))
        for line, module in _imports(path):
            theirs = _room_of(module if module.count(".") > 2 else module + ".x")
            if mine is None or theirs is None or theirs == mine:
                if mine is not None and module.startswith("hf_diloco.core.diloco"):
                    raise AssertionError(f"{path.relative_to(ROOT)}:{line}: a room imports the engine ({module})")
                continue
            assert floor[theirs] < floor[mine], (
                f"{path.relative_to(ROOT)}:{line}: room {mine} (floor {floor[mine]}) imports {module} of room "
                f"{theirs} (floor {floor[theirs]})"
            )


def test_every_room_is_small_and_says_what_it_holds():
    """Each room of the core is at most ~2,000 lines and opens with an `__init__` that says what it holds and what it
    may import."""
    for room in sorted(path for path in CORE.iterdir() if path.is_dir() and path.name != "__pycache__"):
        lines = sum(len(path.read_text().splitlines()) for path in room.rglob("*.py"))
        assert lines <= 2100, f"core/{room.name} holds {lines} lines"
        doc = ast.get_docstring(ast.parse((room / "__init__.py").read_text())) or ""
        assert "Floor" in doc and len(doc) > 80, f"core/{room.name}/__init__.py does not say what it holds"


ROOMS = {"backends", "cli", "configs", "core", "integrations", "job", "metrics", "model_cards", "parallel", "publish"}


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
    engine composes them (`core/rounds/checkpoint.py` and `core/membership/elastic.py` take parts, never the engine's class)."""
    graph = import_graph()
    assert "hf_diloco.core.rounds.checkpoint" in graph["hf_diloco.core.diloco"]  # the graph sees relative imports
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
    path = next(CORE.rglob(name))
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


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


def test_the_exchange_reaches_other_workers_only_through_its_transport():
    """Across workers the exchange sends, receives and agrees through a `Transport` (`core/exchange/transport.py`);
    its own torch.distributed calls stay inside the worker (the data-parallel group of its ranks)."""
    for name in ("exchange.py", "pipelined.py", "payloads.py", "pending.py"):
        path = CORE / "exchange" / name
        source = path.read_text()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                owner = node.func.value
                if isinstance(owner, ast.Name) and owner.id == "dist":
                    group = next((k.value for k in node.keywords if k.arg == "group"), None)
                    text = ast.get_source_segment(source, group) if group is not None else ""
                    assert "data_parallel_sync_group" in text, (
                        f"{name}:{node.lineno} dist.{node.func.attr} across workers"
                    )


def test_the_engine_s_old_module_paths_still_import_the_same_modules():
    """Code written when the core was one flat room (`hf_diloco.core.config`, `hf_diloco.core.projection`,
    `hf_diloco.core.stats.register_round_observer`, `from hf_diloco.core.exchange import OuterExchange`) still runs."""
    import importlib

    from hf_diloco.core import MOVED

    for old, new in MOVED.items():
        assert importlib.import_module(f"hf_diloco.core.{old}") is importlib.import_module(f"hf_diloco.core.{new}")
    from hf_diloco.core.stats import register_round_observer  # noqa: F401

    from hf_diloco.core.exchange import OuterExchange, deflate_payload
    from hf_diloco.core.exchange.exchange import OuterExchange as moved
    from hf_diloco.core.exchange.payloads import deflate_payload as moved_deflate
    from hf_diloco.core.membership import Membership, RoundView  # noqa: F401
    from hf_diloco.core.rounds import DivergenceGuard, finite_and_scale  # noqa: F401

    assert OuterExchange is moved and deflate_payload is moved_deflate
