"""Averaging a flat fp32 vector across workers: the job, its byte accounting and timeouts (`exchange.py`), the
transport it talks to and its process-group implementation (`transport.py`), a long `reduce_scatter` in pipelined
pieces (`pipelined.py`), entropy coding of payloads (`payloads.py`), and low rank split between a worker's ranks
(`lowrank_split.py`).

Floor 3: may import `layout`, `compression` and `settings`.
"""

from .. import names_of_modules  # noqa: E402

# `hf_diloco.core.exchange` was once a module of its own: its names stay importable from here, loaded on first use.
__getattr__ = names_of_modules(__name__, ("exchange", "pending", "transport", "payloads"))
