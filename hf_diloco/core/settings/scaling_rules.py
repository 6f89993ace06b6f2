"""Hyperparameters from the DiLoCo scaling laws (Charles et al. 2025, arXiv 2503.09799), each with its source.

The paper fits, over models of 35 M - 2.4 B parameters and M = 1, 2, 4, 8 workers at H = 30, a joint power law
f(N, M) = A * N^alpha * M^beta per hyperparameter (its Table 10, recommended in its section 6.4):

- inner learning rate gamma = 22256 * N^-0.8827 * M^0.2929 (AdamW, beta = (0.9, 0.99), 1000 warmup steps, cosine
  decay to 5 % of the peak: its section 3);
- global batch B = 0.00709 * N^0.4695 * M^0.3399. The text calls B a number of tokens, but the fitted values
  (180-364 at 2.4 B) only match its Figure 4's axis (2^15 - 2^21 tokens) as sequences of 2048 tokens: B is read
  here as sequences of 2048 tokens and given in tokens and in sequences of the run's block size;
- the outer learning rate has no formula: its Figure 7 shows the best eta independent of N from 335 M on and rising
  with M: about 0.4 for M = 1, 0.6 for M = 2 and 4, 0.8 for M = 8 (read from the figure's grid); Figure 8 shows it
  rising with H, with no fit;
- outer momentum: Nesterov 0.9 in every sweep.

Outside the fitted ranges (N, M, H) every value is an extrapolation, and `ScalingLawSettings.warnings` says which.
Pure Python: the planner and the main job's `auto` values use it before any model exists.
"""

from __future__ import annotations

import dataclasses
import math

PAPER = "DiLoCo scaling laws (Charles et al. 2025, arXiv 2503.09799)"
FITTED_PARAMETERS = (35e6, 2.4e9)
FITTED_WORKERS = (1, 8)
FITTED_INNER_STEPS = 30
# Sequences of this many tokens are the unit of the fitted global batch (see the module docstring).
PAPER_SEQUENCE_LENGTH = 2048
PAPER_WARMUP_STEPS = 1000
# Read from the grid of Figure 7 (best outer learning rate by M at N >= 335 M).
OUTER_LR_BY_WORKERS = {1: 0.4, 2: 0.6, 4: 0.6, 8: 0.8}
OUTER_MOMENTUM = 0.9


@dataclasses.dataclass(frozen=True)
class Setting:
    """One hyperparameter: its value and where it comes from."""

    value: float
    source: str


@dataclasses.dataclass(frozen=True)
class ScalingLawSettings:
    """
    What the scaling laws give for N parameters on M workers (see `scaling_law_settings`).

    Attributes:
        inner_learning_rate, outer_learning_rate, outer_momentum (`Setting`): the optimizers' values.
        global_batch_tokens (`Setting`): tokens per inner step over all workers.
        global_batch_sequences (`Setting`): the same in sequences of the run's `block_size`.
        warmup_steps (`Setting`): inner warmup steps.
        warnings (`tuple[str, ...]`): each way the inputs lie outside the fitted range (an extrapolation).
    """

    inner_learning_rate: Setting
    global_batch_tokens: Setting
    global_batch_sequences: Setting
    warmup_steps: Setting
    outer_learning_rate: Setting
    outer_momentum: Setting
    warnings: tuple[str, ...]

    def settings(self) -> dict[str, Setting]:
        """Every hyperparameter by name."""
        return {
            field.name: getattr(self, field.name) for field in dataclasses.fields(self) if field.name != "warnings"
        }


def inner_learning_rate(num_parameters: float, num_workers: int) -> float:
    """gamma = 22256 * N^-0.8827 * M^0.2929 (Table 10, joint fit)."""
    return 22256.0 * num_parameters**-0.8827 * num_workers**0.2929


def global_batch_paper_sequences(num_parameters: float, num_workers: int) -> float:
    """B = 0.00709 * N^0.4695 * M^0.3399 (Table 10, joint fit), in sequences of 2048 tokens."""
    return 0.00709 * num_parameters**0.4695 * num_workers**0.3399


def outer_learning_rate(num_workers: int) -> float:
    """The best outer learning rate of Figure 7 for M workers; between its grid points, linear in log2 M; beyond
    its last point (M = 8) the last value."""
    grid = sorted(OUTER_LR_BY_WORKERS.items())
    if num_workers <= grid[0][0]:
        return grid[0][1]
    for (low_m, low_lr), (high_m, high_lr) in zip(grid, grid[1:]):
        if num_workers <= high_m:
            share = (math.log2(num_workers) - math.log2(low_m)) / (math.log2(high_m) - math.log2(low_m))
            return low_lr + share * (high_lr - low_lr)
    return grid[-1][1]


def scaling_law_settings(
    num_parameters: float,
    num_workers: int,
    inner_steps: int = FITTED_INNER_STEPS,
    block_size: int = PAPER_SEQUENCE_LENGTH,
    total_steps: int | None = None,
) -> ScalingLawSettings:
    """
    The scaling laws' hyperparameters for a run.

    Args:
        num_parameters (`float`): N, the model's parameters (embeddings included, as in the paper's counts).
        num_workers (`int`): M, the DiLoCo workers.
        inner_steps (`int`, *optional*): H; the fits are at H = 30 (the outer learning rate rises with H).
        block_size (`int`, *optional*): the run's sequence length, for the batch in sequences.
        total_steps (`int`, *optional*): the run's inner steps; the warmup is at most a tenth of them.

    Raises:
        `ValueError`: N, M, H or the block size not positive.
    """
    for name, value in (("num_parameters", num_parameters), ("num_workers", num_workers),
                        ("inner_steps", inner_steps), ("block_size", block_size)):  # fmt: skip
        if not value > 0:
            raise ValueError(f"{name} must be > 0 for the scaling-law settings, got {value!r}.")
    joint = f"{PAPER}, Table 10 joint fit, N={num_parameters:.3g}, M={num_workers}"
    gamma = inner_learning_rate(num_parameters, num_workers)
    tokens = global_batch_paper_sequences(num_parameters, num_workers) * PAPER_SEQUENCE_LENGTH
    warmup = PAPER_WARMUP_STEPS
    warmup_source = f"{PAPER}, section 3 (1000 steps)"
    if total_steps and warmup > total_steps // 10:
        warmup = total_steps // 10
        warmup_source += f", cut to a tenth of this run's {total_steps} steps"
    return ScalingLawSettings(
        inner_learning_rate=Setting(gamma, f"gamma = 22256 N^-0.8827 M^0.2929 ({joint})"),
        global_batch_tokens=Setting(
            tokens, f"B = 0.00709 N^0.4695 M^0.3399 sequences of 2048 tokens ({joint}; B read as sequences)"
        ),
        global_batch_sequences=Setting(tokens / block_size, f"the batch in tokens / block_size {block_size}"),
        warmup_steps=Setting(float(warmup), warmup_source),
        outer_learning_rate=Setting(
            outer_learning_rate(num_workers), f"{PAPER}, Figure 7 (best outer lr by M at N >= 335 M, H = 30)"
        ),
        outer_momentum=Setting(OUTER_MOMENTUM, f"{PAPER}, section 3 (Nesterov 0.9 in every sweep)"),
        warnings=_extrapolations(num_parameters, num_workers, inner_steps),
    )


def _extrapolations(num_parameters: float, num_workers: int, inner_steps: int) -> tuple[str, ...]:
    warnings = []
    low, high = FITTED_PARAMETERS
    if not low <= num_parameters <= high:
        warnings.append(
            f"N={num_parameters:.3g} parameters is outside the fitted range {low:.3g}-{high:.3g}: every rule is an "
            "extrapolation; sweep the inner learning rate around it."
        )
    if not FITTED_WORKERS[0] <= num_workers <= FITTED_WORKERS[1]:
        warnings.append(f"M={num_workers} workers is outside the fitted M = 1-8: the rules are an extrapolation.")
    if inner_steps != FITTED_INNER_STEPS:
        warnings.append(
            f"H={inner_steps}: the fits are at H = 30, and the best outer learning rate rises with H (Figure 8, no "
            "fit): the outer lr given is H = 30's."
        )
    return tuple(warnings)
