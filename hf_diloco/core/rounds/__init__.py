"""A round's life: one fragment's state (`fragment.py`), the rule of each overlap mode (`overlap.py`), completing a
round with its guards and observers (`rounds.py`), when a worker's round ends (`round_policy.py`), the stats record
(`stats.py`) and what a checkpoint and a heal carry (`checkpoint.py`).

Floor 4: may import `layout`, `compression`, `settings` and `exchange`.
"""

from .. import names_of_modules  # noqa: E402

# `hf_diloco.core.rounds` was once a module of its own: its names stay importable from here, loaded on first use.
__getattr__ = names_of_modules(__name__, ("rounds",))
