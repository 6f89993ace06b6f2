"""Where things are: the rank grid and its process groups (`topology.py`), the partition of a model into fragments
and pieces and the schedule's offsets (`fragments.py`), which share of a fragment each data-parallel rank owns and
how it reads and writes it (`shard.py`), reused buffers (`buffers.py`) and devices (`devices.py`).

Floor 0: imports no other room of the core.
"""
