"""Who takes part: the start-up agreement and initial broadcast (`agreement.py`), the `Membership` protocol
(`membership.py`), the engine's rules under elastic membership (`elastic.py`) and its exchange behind the inner steps
(`elastic_background.py`). Backends live outside the core (`hf_diloco.backends`).

Floor 5: may import every room below it.
"""


def __getattr__(name: str):
    # `hf_diloco.core.membership` was once a module of its own: its names stay importable from here, loaded on first use.
    import importlib

    for module in ("membership",):
        found = getattr(importlib.import_module(f"{__name__}.{module}"), name, None)
        if found is not None:
            return found
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
