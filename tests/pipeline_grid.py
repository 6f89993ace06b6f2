"""Pipelined runs and their references: the same training on 2 processes, on 4 processes and in the test process."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tests.dist_utils import run_on_processes


def run_grid(
    on_two: Callable, on_four: Callable, in_process: Callable[[], Any], out: str, two_timeout: float = 300.0
) -> tuple[list, list, Any]:
    """`on_two(rank, world, out)` on 2 processes, `on_four` on 4, then `in_process()` here on one thread.

    The spawned processes use one thread each; tiny models also run faster on one thread here.
    """
    two = run_on_processes(on_two, 2, out, timeout_seconds=two_timeout)
    four = run_on_processes(on_four, 4, out, timeout_seconds=300)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return two, four, in_process()
    finally:
        torch.set_num_threads(threads)
