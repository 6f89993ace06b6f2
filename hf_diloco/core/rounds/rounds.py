"""Completing an outer round: wait for its exchange, count its bytes, reject an average that must not be applied,
take the outer step, and tell the observers.

Every worker decodes the same bytes, so every worker holds the same average and takes the same decision: a rejected
round leaves θg and the outer optimizer as they were on every worker alike (invariant 1 of docs/design.md holds
through rejections). With D data-parallel ranks per worker each rank holds 1/D of the average; the ranks combine
whether theirs is finite and its largest absolute value (a maximum: exact in any order), so they decide alike too.

- A non-finite average (some worker produced NaN/inf) is rejected; this worker also drops the inner optimizer state
  of the fragment's parameters that is itself non-finite (Adam moments poisoned by the NaN would keep producing it).
- `DivergenceGuard`: a finite average whose largest absolute value exceeds `divergence_factor` times the median of
  that of the fragment's last applied rounds is rejected (a diverged worker's absurd update, e.g. 5e8 where the
  recent rounds moved by ~1e-2, would otherwise be applied and the run would finish with a dead model).
- A fragment's round without a history (its first, or the first after rounds at learning rate 0) is rejected when
  its average's largest absolute value exceeds `first_round_factor` times θg's own: one worker's garbage weights
  before the first exchange (e.g. every weight 30 where θg's largest is 1) would otherwise become θg everywhere.
- Outer updates that grew at least 1.5x in each of a fragment's last 4 rounds are warned about (once): a blow-up
  that stays under `divergence_factor` x the median.
- `max_skipped_rounds` rejections of one fragment in a row stop the run with `TrainingDivergedError`, on every
  worker at the same round, once the observers have seen that round.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..compression.codecs import CODEC_BITS
from ..exchange.pending import ExchangeResult
from ..layout.shard import Worker
from .fragment import Fragment, InFlight
from .stats import EngineStats, Observers, RoundRecord

logger = logging.getLogger(__name__)


class TrainingDivergedError(RuntimeError):
    """Too many outer rounds of one fragment in a row were rejected (non-finite or divergent averages)."""


@dataclass
class DivergenceGuard:
    """Rejects an average far larger than the fragment's recent ones, and stops a run that keeps being rejected.

    The scale of an average is its largest absolute value: exact on every machine (a maximum does not depend on the
    order of a reduction), so every worker compares the same number and decides alike. The history is the scales of
    the fragment's last `HISTORY` applied rounds (zeros left out: a first round at learning rate 0 moves nothing);
    without a history nothing is rejected.

    With the default factor 100 a healthy run never comes close: round scales follow the inner learning rate, which
    changes by a few times over a warm-up, not by 100 between five rounds. A schedule that raises the learning rate
    more than `factor` times at once (warm restarts from ~0) needs a larger factor, or 0 to turn the guard off.

    Args:
        factor: `divergence_factor` (0: off).
        max_skipped: `max_skipped_rounds` (0: never stop).
    """

    HISTORY = 5
    # A warning when each of the last HISTORY applied rounds was at least GROWTH times larger than the one before
    # (1.5^4 = 5x in four rounds): a blow-up still under `factor` x the median. A linear learning-rate warm-up grows
    # less than 1.5x per round from its third round on.
    GROWTH = 1.5

    factor: float
    max_skipped: int
    absolute_factor: float = 0.0
    scales: dict[int, list[float]] = field(default_factory=dict)
    skipped_in_a_row: dict[int, int] = field(default_factory=dict)
    last_rejection: dict[int, tuple[int, str]] = field(default_factory=dict, compare=False)
    warned_growth: set[int] = field(default_factory=set, compare=False)

    def bounds_by_theta_scale(self, fragment: int) -> bool:
        """Whether `judge` needs θg's scale for `fragment`: a round without a history under `absolute_factor` (the
        same answer on every rank, so the verdict's collective keeps its shape)."""
        return bool(self.absolute_factor) and not self.scales.get(fragment)

    def judge(self, fragment: int, finite: bool, scale: float, theta_scale: float = 0.0) -> tuple[str | None, str]:
        """(`None`, "") to apply an average (`finite`, largest absolute value `scale`), else (`"nonfinite"` or
        `"divergent"`, why). `theta_scale`: θg's own largest absolute value, the bound of a round without a history
        (`absolute_factor`; 0: θg all zeros, no bound)."""
        if not finite:
            return "nonfinite", "its average is not finite (a worker produced NaN/inf)"
        recent = self.scales.get(fragment)
        if not recent and self.absolute_factor and theta_scale > 0 and scale > self.absolute_factor * theta_scale:
            return "divergent", (
                f"its average's largest value {scale:.3g} is {scale / theta_scale:.3g} x θg's own largest value "
                f"{theta_scale:.3g}, with no earlier round to compare with (first_round_factor="
                f"{self.absolute_factor:g}; a worker's weights were likely garbage before the first exchange)"
            )
        if not self.factor or not recent:
            return None, ""
        typical = statistics.median(recent)
        if scale > self.factor * typical:
            return "divergent", (
                f"its average's largest value {scale:.3g} is {scale / typical:.3g} x the median {typical:.3g} of its "
                f"last {len(recent)} applied rounds (divergence_factor={self.factor:g})"
            )
        return None, ""

    def applied(self, fragment: int, scale: float) -> None:
        self.skipped_in_a_row[fragment] = 0
        if scale > 0:
            self.scales[fragment] = [*self.scales.get(fragment, []), scale][-self.HISTORY :]
            self._warn_if_growing(fragment)

    def _warn_if_growing(self, fragment: int) -> None:
        recent = self.scales[fragment]
        growing = len(recent) == self.HISTORY and all(b >= self.GROWTH * a for a, b in zip(recent, recent[1:]))
        if not growing or fragment in self.warned_growth:
            return
        self.warned_growth.add(fragment)
        logger.warning(
            "The outer updates of fragment %d grew at least %gx in each of its last %d rounds (largest values %s): "
            "training may be diverging. Check the loss; lower the inner or outer learning rate if it rises.",
            fragment,
            self.GROWTH,
            self.HISTORY - 1,
            ", ".join(f"{value:.3g}" for value in recent),
        )

    def rejected(self, fragment: int, step: int, why: str) -> None:
        skipped = self.skipped_in_a_row[fragment] = self.skipped_in_a_row.get(fragment, 0) + 1
        self.last_rejection[fragment] = (step, why)
        logger.warning(
            "Skipped the outer round of fragment %d at inner step %d on every worker: %s. θg stays as it was and "
            "this worker restarts the fragment from it (%d in a row).",
            fragment,
            step,
            why,
            skipped,
        )

    def stop_if_diverged(self, fragment: int) -> None:
        """Raise `TrainingDivergedError` once `max_skipped` rounds of the fragment in a row were rejected."""
        skipped = self.skipped_in_a_row.get(fragment, 0)
        if not self.max_skipped or skipped < self.max_skipped:
            return
        step, why = self.last_rejection[fragment]
        raise TrainingDivergedError(
            f"{skipped} outer rounds of fragment {fragment} in a row were skipped, the last at inner step {step}: "
            f"{why}. Training has diverged. Resume from an earlier checkpoint with a lower learning rate (inner or "
            "outer); if the run is healthy and its updates legitimately grow this fast, raise divergence_factor (0 "
            "turns the guard off) or max_skipped_rounds (0 never stops)."
        )

    def state_dict(self) -> dict:
        return {
            "scales": dict(self.scales),
            "skipped_in_a_row": dict(self.skipped_in_a_row),
            "last_rejection": dict(self.last_rejection),
        }

    def load_state_dict(self, state: dict | None) -> None:
        """Restore; a checkpoint written without a guard (older versions) starts with an empty history."""
        state = state or {}
        self.scales = {int(k): list(v) for k, v in state.get("scales", {}).items()}
        self.skipped_in_a_row = {int(k): int(v) for k, v in state.get("skipped_in_a_row", {}).items()}
        self.last_rejection = {int(k): (int(v[0]), str(v[1])) for k, v in state.get("last_rejection", {}).items()}


def finite_and_scale(values: torch.Tensor) -> tuple[bool, float]:
    """Whether every value is finite, and the largest absolute value (0.0 when some value is not, or there is none).

    One pass and no temporary as long as the values: a NaN makes both extremes NaN, an inf shows in one of them, and
    the largest absolute value is the larger of the maximum and minus the minimum.
    """
    if not values.numel():
        return True, 0.0
    low, high = (float(extreme) for extreme in torch.aminmax(values))
    finite = math.isfinite(low) and math.isfinite(high)
    return finite, max(high, -low) if finite else 0.0


class RoundKeeper:
    """Completes the rounds of every fragment of one engine (see the module docstring).

    Args:
        stats: the engine's counters.
        guard: decides which averages are applied.
        inner_optimizer: its non-finite state is dropped after a non-finite round (None: nothing to drop).
        observers: told about every completed round.
        clock: the engine's current inner step.
        workers: M.
        per_fragment_stats: keep `fragment{p}_*` counters (more than one fragment).
        worker: the data-parallel ranks of this worker, which decide every round together.
        residual_decay: `error_feedback_decay`, β: the kept residual is β times what the exchange did not send.
    """

    def __init__(
        self,
        stats: EngineStats,
        guard: DivergenceGuard,
        inner_optimizer: torch.optim.Optimizer | None,
        observers: Observers,
        clock: Callable[[], int],
        workers: int,
        per_fragment_stats: bool,
        worker: Worker,
        residual_decay: float = 1.0,
    ):
        self.stats = stats
        self.guard = guard
        self.inner_optimizer = inner_optimizer
        self.observers = observers
        self.clock = clock
        self.workers = workers
        self.per_fragment_stats = per_fragment_stats
        self.worker = worker
        self.residual_decay = residual_decay

    def apply(self, fragment: Fragment, flight: InFlight) -> RoundRecord:
        """Wait for the round's exchange and take the outer step on θg unless the average is rejected."""
        record = self._collect(fragment, flight, final=False)
        if record.average is not None:
            fragment.outer_step(record.average)
            self.stats.outer_steps += 1
        return record

    def apply_tail(self, fragment: Fragment, flight: InFlight) -> RoundRecord:
        """`close()`'s sync of a tail: θg <- θg - avg (no outer step: momentum would extrapolate a partial round)."""
        bytes_before = self.stats.bytes_sent
        record = self._collect(fragment, flight, final=True)
        self.stats.final_sync_bytes += self.stats.bytes_sent - bytes_before
        if record.average is not None:
            fragment.theta_g -= record.average
            self.stats.final_syncs += 1
        return record

    def wait(self, flight: InFlight) -> ExchangeResult:
        """The exchange's result, counting the time waited."""
        started = time.perf_counter()
        result = flight.pending.wait()
        self.stats.sync_wait_seconds += time.perf_counter() - started
        return result

    def publish(self, record: RoundRecord) -> None:
        """Tell the observers about a completed round; then stop the run if its fragment keeps being rejected."""
        self.observers.publish(record)
        if record.rejected is not None:
            self.guard.stop_if_diverged(record.fragment)

    def _collect(self, fragment: Fragment, flight: InFlight, final: bool) -> RoundRecord:
        result = self.wait(flight)
        self.stats.book_exchange(
            fragment.index, result.bytes_sent, result.bytes_sent_intra_worker, self.per_fragment_stats
        )
        fragment.residual = result.residual
        if result.residual is not None and flight.scale not in (0.0, 1.0):
            fragment.residual.div_(flight.scale)  # in place: a residual is as long as the fragment
        if result.residual is not None and self.residual_decay != 1.0:
            # Kept decayed (β e), so the next pseudo-gradient and a checkpoint take it as it is.
            fragment.residual.mul_(self.residual_decay)
        if result.choice is not None:
            self.stats.lowrank_rank = result.choice["rank"]
            self.stats.compression_bits = CODEC_BITS[result.choice["compression"]]
        self.stats.clipped_contributions += int(result.clipped)
        if result.outliers:
            self._name_outliers(fragment, result.outliers)
        average = result.average.to(fragment.device)
        # θg is read for its scale only where the bound uses it: one pass over θg per sync saved once rounds have a
        # history.
        theta_g = fragment.theta_g if self.guard.bounds_by_theta_scale(fragment.index) else None
        finite, scale, theta_scale = self._verdict(average, theta_g)
        rejected, why = self.guard.judge(fragment.index, finite, scale, theta_scale)
        if rejected is None:
            if not final:
                self.guard.applied(fragment.index, scale)
        else:
            self._reject(fragment, rejected, why)
            average = None
        return RoundRecord(
            fragment=fragment.index,
            step=self.clock(),
            sent=flight.sent,
            average=average,
            rejected=rejected,
            bytes_sent=result.bytes_sent,
            final=final,
            piece_sizes=fragment.owned_sizes,
            workers=self.workers,
        )

    def _name_outliers(self, fragment: Fragment, outliers: tuple[tuple[str, float], ...]) -> None:
        """Name each worker robust aggregation scaled down (every worker sees the same), and count it."""
        for name, _ in outliers:
            self.stats.clipped_workers[name] = self.stats.clipped_workers.get(name, 0) + 1
        logger.warning(
            "robust aggregation scaled down the pseudo-gradient of %s in the exchange of fragment %d at inner step %d: "
            "its norm was %s the lower median of the contributors' norms, above robust_clip_factor (0 turns this "
            "defence off)",
            ", ".join(name for name, _ in outliers),
            fragment.index,
            self.clock(),
            ", ".join(f"{ratio:.4g} x" for _, ratio in outliers),
        )

    def _verdict(self, average: torch.Tensor, theta_g: torch.Tensor | None) -> tuple[bool, float, float]:
        """Whether the whole average is finite, its largest absolute value and θg's (0.0 without `theta_g`), over the
        worker's ranks (one pass over each, no model-sized temporaries)."""
        finite, scale = finite_and_scale(average)
        theta_scale = finite_and_scale(theta_g)[1] if theta_g is not None else 0.0
        nonfinite, scale, theta_scale = self.worker.max([0.0 if finite else 1.0, scale, theta_scale])
        return nonfinite == 0.0, scale, theta_scale

    def _reject(self, fragment: Fragment, reason: str, why: str) -> None:
        fragment.residual = None
        if reason == "nonfinite":
            self.stats.skipped_nonfinite += 1
            self.stats.inner_state_resets += fragment.reset_nonfinite_inner_state(self.inner_optimizer, self.worker)
        else:
            self.stats.skipped_divergent += 1
        self.guard.rejected(fragment.index, self.clock(), why)
