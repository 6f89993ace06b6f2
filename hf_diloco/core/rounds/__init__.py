"""A round's life: one fragment's state (`fragment.py`), the rule of each overlap mode (`overlap.py`), completing a
round with its guards and observers (`rounds.py`), when a worker's round ends (`round_policy.py`), the stats record
(`stats.py`) and what a checkpoint and a heal carry (`checkpoint.py`).

Floor 4: may import `layout`, `compression`, `settings` and `exchange`.
"""


def __getattr__(name: str):
    # `hf_diloco.core.rounds` was once a module of its own: its names stay importable from here, loaded on first use.
    import importlib

    for module in ("rounds",):
        found = getattr(importlib.import_module(f"{__name__}.{module}"), name, None)
        if found is not None:
            return found
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
