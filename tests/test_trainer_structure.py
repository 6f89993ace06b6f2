"""How `DiLoCoTrainer`'s mixins share data: through one explicit state object (`trainer.diloco_run`, a
`TrainerRunState`), never through attributes that one mixin sets on the trainer and another reads.

The modules are parsed, not imported: fast, and no process group.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRAINER = ROOT / "hf_diloco" / "integrations" / "trainer"
ASSEMBLY = TRAINER / "diloco_trainer.py"
ASSEMBLED = ("DiLoCoTrainer", "PipelinedDiLoCoTrainer")
SHARED_STATE = "diloco_run"

Units = dict[str, tuple[ast.AST, bool]]  # "module:Class" -> (node, whether `self` there is the trainer)


def mixin_classes() -> dict[str, ast.ClassDef]:
    """The classes `DiLoCoTrainer` and its pipelined form are assembled from (themselves included), by
    `module:Class`, found from the bases named in `diloco_trainer.py` and the relative imports that bring them."""
    tree = ast.parse(ASSEMBLY.read_text())
    source_of = {
        alias.asname or alias.name: TRAINER / f"{node.module}.py"
        for node in tree.body
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module
        for alias in node.names
    }
    assembled = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name in ASSEMBLED]
    wanted = {name: ASSEMBLY for name in ASSEMBLED}
    wanted |= {
        base.id: source_of[base.id]
        for cls in assembled
        for base in cls.bases
        if isinstance(base, ast.Name) and base.id in source_of
    }
    classes = {}
    for name, path in wanted.items():
        node = next(n for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef) and n.name == name)
        classes[f"{path.stem}:{name}"] = node
    return classes


def trainer_units() -> Units:
    """Every mixin class, and every other top-level class or function of the trainer's modules (callbacks that
    hold the trainer, helpers), each a unit of its own."""
    mixins = mixin_classes()
    units: Units = {key: (node, True) for key, node in mixins.items()}
    for path in sorted(TRAINER.glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            name = getattr(node, "name", None)
            key = f"{path.stem}:{name}"
            if name is not None and key not in mixins and isinstance(node, (ast.ClassDef, ast.FunctionDef)):
                units[key] = (node, False)
    return units


def _is_self(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id == "self"


def _targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        return list(node.targets)
    if isinstance(node, (ast.AnnAssign, ast.AugAssign)):
        return [node.target]
    return []


def writes_and_reads(node: ast.AST, self_is_trainer: bool) -> tuple[set[str], set[str]]:
    """Attributes of the trainer that `node` sets (on `self`, or as class-level defaults in a mixin's body) and
    reads (`self.x` in a mixin; `<other object>.x` anywhere, e.g. a callback's `self._trainer.x`)."""
    writes: set[str] = set()
    if self_is_trainer and isinstance(node, ast.ClassDef):
        for statement in node.body:
            writes |= {t.id for t in _targets(statement) if isinstance(t, ast.Name)}
    reads: set[str] = set()
    for child in ast.walk(node):
        for target in _targets(child):
            if isinstance(target, ast.Attribute) and _is_self(target.value) and self_is_trainer:
                writes.add(target.attr)
        if isinstance(child, ast.Attribute) and isinstance(child.ctx, ast.Load):
            if _is_self(child.value) and not self_is_trainer:
                continue  # the unit's own attribute (a callback's `self._trainer`)
            reads.add(child.attr)
    return writes, reads


def the_trainers_own_names() -> set[str]:
    """What `transformers.Trainer` itself defines or sets on `self`: the mixins override and follow those (e.g.
    `_globalstep_last_logged` when logging inside the worker), which is the Trainer's contract, not theirs."""
    spec = importlib.util.find_spec("transformers")
    source = Path(spec.submodule_search_locations[0]) / "trainer.py"
    trainer = next(
        n for n in ast.parse(source.read_text()).body if isinstance(n, ast.ClassDef) and n.name == "Trainer"
    )
    names = {getattr(node, "name", None) for node in trainer.body} - {None}
    names |= writes_and_reads(trainer, self_is_trainer=True)[0]
    return names


def coupled_attributes(units: Units, allowed: set[str]) -> dict[str, list[str]]:
    """Attributes some mixin sets on the trainer that more than one unit sets or reads, with those units."""
    seen = {key: writes_and_reads(node, self_is_trainer) for key, (node, self_is_trainer) in units.items()}
    written = {name for key, (writes, _) in seen.items() if units[key][1] for name in writes}
    coupled = {}
    for name in sorted(written - allowed):
        users = sorted(key for key, (writes, reads) in seen.items() if name in writes | reads)
        if len(users) > 1:
            coupled[name] = users
    return coupled


def test_the_mixins_share_data_only_through_the_run_state():
    """An attribute that one mixin sets on the trainer and another reads (or sets) couples them in secret; what
    they share lives in `trainer.diloco_run` (`run_state.py`), each field saying who writes it and when."""
    units = trainer_units()
    mixins = [key for key, (_, is_mixin) in units.items() if is_mixin]
    assert len(mixins) >= 9, mixins  # the seven concerns, the pipeline stages and the assembled classes
    assert "engine_lifecycle:EngineStepCallback" in units
    coupled = coupled_attributes(units, the_trainers_own_names() | {SHARED_STATE})
    assert not coupled, "\n".join(f"{name}: set or read by {', '.join(users)}" for name, users in coupled.items())


def test_the_check_sees_an_attribute_passed_between_mixins():
    """The check itself can fail: a flag set by one mixin and read by another's callback, or by the other mixin."""
    source = ast.parse(
        "class Writer:\n"
        "    _flag = False\n"
        "    def start(self):\n"
        "        self._flag = True\n"
        "        self.diloco_run.engine = 1\n"
        "class Reader:\n"
        "    def show(self):\n"
        "        return self._flag, self.diloco_run.engine, self.args\n"
        "class Callback:\n"
        "    def on_step(self):\n"
        "        self._own = self._trainer._flag\n"
    )
    writer, reader, callback = source.body
    units: Units = {"w:Writer": (writer, True), "r:Reader": (reader, True), "c:Callback": (callback, False)}
    assert coupled_attributes(units, {SHARED_STATE, "args"}) == {"_flag": ["c:Callback", "r:Reader", "w:Writer"]}
    assert coupled_attributes({"w:Writer": (writer, True)}, {SHARED_STATE}) == {}
