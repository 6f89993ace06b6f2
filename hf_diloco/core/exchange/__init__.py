"""Averaging a flat fp32 vector across workers: the job, its byte accounting and timeouts (`exchange.py`), the
transport it talks to and its process-group implementation (`transport.py`), a long `reduce_scatter` in pipelined
pieces (`pipelined.py`), entropy coding of payloads (`payloads.py`), and low rank split between a worker's ranks
(`lowrank_split.py`).

Floor 3: may import `layout`, `compression` and `settings`.
"""


def __getattr__(name: str):
    # `hf_diloco.core.exchange` was once a module of its own: its names stay importable from here, loaded on first use.
    import importlib

    for module in (
        "exchange",
        "pending",
        "transport",
        "payloads",
    ):
        found = getattr(importlib.import_module(f"{__name__}.{module}"), name, None)
        if found is not None:
            return found
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
