"""The outer learning rate over a run: constant (the default), or cosine / linear decay to a final fraction, with an
optional linear warmup, per fragment.

Round k of a fragment is its k-th applied outer step (0-based; a rejected round steps nothing and does not count), the
same on every worker since every worker applies and rejects the same rounds. With R rounds in the run
(`outer_lr_total_rounds`), W warmup rounds and final fraction f, the outer step of round k uses `outer_lr` x

    k < W:       (k + 1) / (W + 1)                               (never 0: a warmup round still moves θg)
    constant:    1
    linear:      1 - (1 - f) p
    cosine:      f + (1 - f) (1 + cos(pi p)) / 2,    p = min(1, (k - W) / max(1, R - W - 1))

so the last round (k = R - 1) runs at f x `outer_lr` (where at least two rounds follow the warmup; a single one runs
at `outer_lr`), and rounds past R stay there. The count lives in the outer optimizer's state of the fragment
(`state["outer_round"]`, a plain int), so checkpoints, resume and an elastic heal carry it with the outer momentum;
with the constant schedule and no warmup nothing is added and the optimizer is plain `torch.optim.SGD` as before.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

OUTER_LR_SCHEDULES = ("constant", "cosine", "linear")
ROUND_KEY = "outer_round"


@dataclass(frozen=True)
class OuterLrSchedule:
    """The factor on `outer_lr` at each of a fragment's rounds (see the module docstring)."""

    kind: str
    total_rounds: int
    warmup_rounds: int = 0
    final_fraction: float = 0.0

    def factor(self, round_index: int) -> float:
        if round_index < self.warmup_rounds:
            return (round_index + 1) / (self.warmup_rounds + 1)
        if self.kind == "constant":
            return 1.0
        span = max(1, self.total_rounds - self.warmup_rounds - 1)
        progress = min(1.0, (round_index - self.warmup_rounds) / span)
        if self.kind == "linear":
            return 1.0 - (1.0 - self.final_fraction) * progress
        return self.final_fraction + (1.0 - self.final_fraction) * (1.0 + math.cos(math.pi * progress)) / 2.0

    def set_learning_rate(self, optimizer: torch.optim.Optimizer, tensor: torch.Tensor, base_lr: float) -> float:
        """Set the learning rate of `optimizer` (over `tensor` alone) for its next step, and count that step."""
        state = optimizer.state[tensor]
        round_index = int(state.get(ROUND_KEY, 0))
        learning_rate = base_lr * self.factor(round_index)
        optimizer.param_groups[0]["lr"] = learning_rate
        state[ROUND_KEY] = round_index + 1
        return learning_rate


def scheduled(optimizer: torch.optim.Optimizer, schedule: OuterLrSchedule | None, base_lr: float) -> None:
    """Attach `schedule` to an outer optimizer (`fragment.optimizer_step` applies it before every step)."""
    if schedule is not None:
        optimizer.outer_lr_schedule = (schedule, base_lr)  # type: ignore[attr-defined]


def before_step(optimizer: torch.optim.Optimizer, tensor: torch.Tensor) -> None:
    """The scheduled learning rate of this step, where the optimizer has a schedule."""
    attached = getattr(optimizer, "outer_lr_schedule", None)
    if attached is not None:
        schedule, base_lr = attached
        schedule.set_learning_rate(optimizer, tensor, base_lr)


def learning_rate_now(optimizer: torch.optim.Optimizer, tensor: torch.Tensor) -> float:
    """The learning rate the optimizer's next step will use (for logging)."""
    attached = getattr(optimizer, "outer_lr_schedule", None)
    if attached is None:
        return float(optimizer.param_groups[0]["lr"])
    schedule, base_lr = attached
    return base_lr * schedule.factor(int(optimizer.state[tensor].get(ROUND_KEY, 0)))
