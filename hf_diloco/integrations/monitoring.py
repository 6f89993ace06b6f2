"""Locally measured training metrics that the engine cannot see on its own (no collective, no transformers)."""

from __future__ import annotations

import time
from collections.abc import Callable


class ComputeUtilization:
    """
    Share of wall-clock time a rank spends computing inner steps (forward, backward, inner optimizer step), excluding
    the time it waits for outer syncs inside those steps.

    `value()` is `(time inside inner steps - outer-sync wait inside them) / wall time since start`: 1.0 means the
    exchanges were fully hidden and nothing else (data loading, evaluation, saving) took time; a blocking sync over a
    slow link, or waiting for a late exchange, lowers it.

    Args:
        wait_seconds (`Callable[[], float]`): the engine's running total of outer-sync wait (`stats["sync_wait_seconds"]`).
    """

    def __init__(self, wait_seconds: Callable[[], float]):
        self._wait_seconds = wait_seconds
        self._started = time.perf_counter()
        self._busy = 0.0
        self._step_started: float | None = None
        self._wait_at_step_start = 0.0

    def step_begin(self) -> None:
        """Mark the start of an inner step; repeated calls before `step_end` (micro-batches) keep the first."""
        if self._step_started is None:
            self._step_started = time.perf_counter()
            self._wait_at_step_start = self._wait_seconds()

    def step_end(self) -> None:
        """Mark the end of an inner step (after the engine's step, so its sync wait is known)."""
        if self._step_started is None:
            return
        waited = self._wait_seconds() - self._wait_at_step_start
        self._busy += max(0.0, time.perf_counter() - self._step_started - waited)
        self._step_started = None

    def value(self) -> float:
        wall = time.perf_counter() - self._started
        return min(1.0, self._busy / wall) if wall > 0 else 0.0
