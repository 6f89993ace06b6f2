"""The DiLoCo engine, pure torch: it never imports transformers, accelerate, torchft or the glue above it.

The engine (`diloco.py`, `DiLoCo`) stands on rooms, each a concern, each importing only the rooms on the floors below
it (`tests/test_engine_structure.py` holds the order and the purity):

| floor | room | what it holds |
|---|---|---|
| 0 | `layout/` | the rank grid and its groups, the fragment partition, each rank's share, buffers, devices |
| 1 | `compression/` | codecs, low rank (PowerSGD), the adaptive policy: what a vector becomes on the wire |
| 2 | `settings/` | `DiLoCoConfig`, resume checks, the scaling laws' rules, the sync projection, the outer lr schedule |
| 3 | `exchange/` | averaging a vector across workers: the job, its transport, the pipelined pieces, low rank split |
| 4 | `rounds/` | a fragment's state, the overlap rules, completing a round, the round policy, stats, checkpoints |
| 5 | `membership/` | who takes part: start-up agreement, elastic membership and its background exchange |
| 5 | `store/` | rounds through an object store: contributions, manifests, quorum and grace, snapshots, signing |
"""

# The rooms, lowest floor first; a room imports only rooms of lower floors (rooms on one floor not each other).
FLOORS: tuple[tuple[str, ...], ...] = (
    ("layout",),
    ("compression",),
    ("settings",),
    ("exchange",),
    ("rounds",),
    ("membership", "store"),
)


# The engine's modules were once one flat room; their old paths (`hf_diloco.core.config`, `hf_diloco.core.projection`,
# ...) keep working for code written against them: each is the module of its room, imported on first use.
MOVED = {
    "topology": "layout.topology", "shard": "layout.shard", "fragments": "layout.fragments",
    "buffers": "layout.buffers", "devices": "layout.devices", "codecs": "compression.codecs",
    "lowrank": "compression.lowrank", "adaptive": "compression.adaptive", "config": "settings.config",
    "settings_check": "settings.settings_check", "scaling_rules": "settings.scaling_rules",
    "projection": "settings.projection", "outer_schedule": "settings.outer_schedule",
    "pipelined_exchange": "exchange.pipelined", "lowrank_split": "exchange.lowrank_split",
    "fragment": "rounds.fragment", "overlap": "rounds.overlap", "round_policy": "rounds.round_policy",
    "stats": "rounds.stats", "checkpoint": "rounds.checkpoint", "elastic": "membership.elastic",
    "elastic_background": "membership.elastic_background", "agreement": "membership.agreement",
}  # fmt: skip


def names_of_modules(package: str, modules: tuple[str, ...]):
    """A package's `__getattr__` (PEP 562) that finds a name in its `modules`, imported on first use: what a room
    whose name was once a module's (`exchange`, `rounds`, `membership`) answers for that module's names."""
    import importlib

    def __getattr__(name: str):
        for module in modules:
            found = getattr(importlib.import_module(f"{package}.{module}"), name, None)
            if found is not None:
                return found
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__


def _install_moved_paths() -> None:
    import importlib
    import importlib.abc
    import importlib.util
    import sys

    class MovedPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, name, path=None, target=None):
            old = name.removeprefix(__name__ + ".")
            return importlib.util.spec_from_loader(name, self) if old != name and old in MOVED else None

        def create_module(self, spec):
            return importlib.import_module(f"{__name__}.{MOVED[spec.name.rsplit('.', 1)[1]]}")

        def exec_module(self, module):
            return None

    if not any(type(finder).__name__ == "MovedPaths" for finder in sys.meta_path):
        sys.meta_path.append(MovedPaths())


_install_moved_paths()
