"""The overlap modes: when a fragment's average is applied and how this worker's parameters θm follow.

Notation for fragment p: θg the fp32 global copy (identical on every worker), θm this worker's parameters, OuterOpt
the outer optimizer (Nesterov SGD by default), avg the fp32 mean over workers of what they sent, M the workers, H the
inner steps, P the fragments, τ `sync_delay`, α `merge_alpha`. Fragment p is launched after inner step t when
`t % H == ((p + 1) * H // P) % H` (see `fragments.py`). Every mode sends Δm plus the error-feedback residual when
`error_feedback` is on. A rejected round (non-finite or divergent average, see `rounds.py`) leaves θg and OuterOpt as
they were on every worker. The engine picks one class at construction (`make_overlap`); each one's docstring is its
exact rule.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from collections.abc import Sequence

import torch

from ..settings.config import DiLoCoConfig
from .fragment import Fragment, InFlight, OptimizerFactory, Trajectory
from .rounds import RoundKeeper
from .stats import RoundRecord


class Overlap(abc.ABC):
    """How a fragment's exchange overlaps training. Subclasses write their update rule as their docstring.

    Args:
        config: the run's settings.
        rounds: completes rounds (wait, book, guard, outer step) and publishes them to the observers.
        workers: M.
    """

    # Whether a checkpoint keeps this worker's last pseudo-gradient with the exchange in flight.
    saves_sent = False

    def __init__(self, config: DiLoCoConfig, rounds: RoundKeeper, workers: int):
        self.config = config
        self.rounds = rounds
        self.workers = workers

    @property
    def blocking(self) -> bool:
        """The exchange must finish before training continues (it runs inline, on the training thread)."""
        return False

    @property
    def apply_delay(self) -> int:
        """Inner steps from an exchange's launch to its apply (a round, unless the mode says otherwise)."""
        return self.config.inner_steps

    @property
    def overlap_steps(self) -> int:
        """Inner steps of compute an exchange hides behind (what an adaptive policy may fill)."""
        return self.config.inner_steps // self.config.num_fragments

    def round_start(self, fragment: Fragment) -> torch.Tensor:
        """Where this worker's round of the fragment started (Δm is measured from here)."""
        return fragment.theta_g

    def prepare(self, fragment: Fragment, make_optimizer: OptimizerFactory) -> None:
        """Give the fragment what this mode keeps per fragment (nothing by default)."""
        return None

    def apply_due(self, fragments: Sequence[Fragment], step: int) -> None:
        """Apply the exchanges due after inner step `step` (before that step's launches)."""
        return None

    @abc.abstractmethod
    def launched(self, fragment: Fragment, flight: InFlight) -> None:
        """The fragment's exchange `flight` was just launched."""

    @abc.abstractmethod
    def close(self, fragments: Sequence[Fragment], tails: Sequence[Fragment]) -> dict[int, torch.Tensor]:
        """Apply everything in flight at once; returns the pseudo-gradient of each fragment in `tails` (the steps
        since its last launch, with the residuals still unsent) for `close()`'s plain-average sync."""

    def after_close(self, fragments: Sequence[Fragment]) -> None:
        """After the tails are synced and θm = θg everywhere (nothing by default)."""
        return None


class Streaming(Overlap):
    """`overlap="streaming"` (Streaming DiLoCo, Douillard et al. 2025, arXiv 2501.18512; P = 1 and τ = 0 is DiLoCo):

        launch at t:      send Δm = θg - θm(t).
        apply at t + τ:   θg <- OuterOpt(θg, avg);   θm <- θg if τ = 0, else θm <- α·θm + (1 - α)·θg.

    With τ = 0 the exchange blocks and is applied at once. A rejected round sets θm <- θg.
    """

    @property
    def blocking(self) -> bool:
        return self.config.sync_delay == 0

    @property
    def apply_delay(self) -> int:
        return self.config.sync_delay

    @property
    def overlap_steps(self) -> int:
        return self.config.sync_delay

    def launched(self, fragment: Fragment, flight: InFlight) -> None:
        fragment.flight = flight
        if self.config.sync_delay == 0:
            self._apply(fragment, merge=False)

    def apply_due(self, fragments: Sequence[Fragment], step: int) -> None:
        for fragment in in_flight_order(fragments):
            if fragment.flight.apply_at == step:
                self._apply(fragment, merge=True)

    def close(self, fragments: Sequence[Fragment], tails: Sequence[Fragment]) -> dict[int, torch.Tensor]:
        for fragment in in_flight_order(fragments):
            self._apply(fragment, merge=False)
        return {fragment.index: fragment.pseudo_gradient(fragment.theta_g) for fragment in tails}

    def _apply(self, fragment: Fragment, merge: bool) -> None:
        flight, fragment.flight = fragment.flight, None
        record = self.rounds.apply(fragment, flight)
        if record.average is None or not merge or self.config.sync_delay == 0:
            fragment.write_local(fragment.theta_g)
        else:
            fragment.merge_local(self.config.merge_alpha)
        self.rounds.publish(record)


class _AppliedOneRoundLater(Overlap):
    """A round's exchange is applied at the fragment's next launch, a whole round of compute later."""

    saves_sent = True

    def launched(self, fragment: Fragment, flight: InFlight) -> None:
        previous, fragment.flight = fragment.flight, flight
        record = self.rounds.apply(fragment, previous) if previous is not None else None
        estimate = self._follow(fragment, flight, previous, record)
        if record is not None:
            self.rounds.publish(dataclasses.replace(record, estimate=estimate))

    @abc.abstractmethod
    def _follow(
        self, fragment: Fragment, flight: InFlight, previous: InFlight | None, record: RoundRecord | None
    ) -> torch.Tensor | None:
        """Set θm after a launch (and the previous round's apply, if any); returns eager's Δ~."""

    def close(self, fragments: Sequence[Fragment], tails: Sequence[Fragment]) -> dict[int, torch.Tensor]:
        # How far θm moved since its round started, measured before the drain resets θm. The drain brings the last
        # round's residual while the one before it is still unsent: both are kept, and a tail carries them.
        moved = {fragment.index: fragment.moved_from(self.round_start(fragment)) for fragment in tails}
        unsent = [fragment.residual for fragment in fragments]
        for fragment in in_flight_order(fragments):
            flight, fragment.flight = fragment.flight, None
            record = self.rounds.apply(fragment, flight)
            fragment.write_local(fragment.theta_g)
            self.rounds.publish(record)
        for fragment, before in zip(fragments, unsent):
            fragment.residual = _sum_of_residuals(before, fragment.residual)
        return {fragment.index: fragment.with_residual(moved[fragment.index]) for fragment in tails}


class Delayed(_AppliedOneRoundLater):
    """`overlap="delayed"` (DiLoCoX one-step delay, arXiv 2506.21263): a round's average is applied one round later,
    hidden by that round's compute:

        launch of round r at t:   send Δm^r = θg - θm(t);   then wait for round r-1:
                                  θg <- OuterOpt(θg, avg^{r-1});   θm <- θg.

    Each round starts from a global model that lacks the previous round's update (hence its loss penalty; prefer
    `eager` for long delays).
    """

    def _follow(
        self, fragment: Fragment, flight: InFlight, previous: InFlight | None, record: RoundRecord | None
    ) -> None:
        fragment.write_local(fragment.theta_g)


class Eager(_AppliedOneRoundLater):
    """`overlap="eager"` (Kale et al. 2025, arXiv 2502.12996): own contribution fresh, the others one round stale,
    corrected a round later. Each worker runs its own trajectory a_m (its start point of every round) with its own
    outer optimizer state OuterOpt_m (same settings as OuterOpt), fed Δ~ every round:

        launch of round r at t:   send Δm^r = a_m - θm(t);   wait for round r-1 and apply the true average to θg,
                                  θg <- OuterOpt(θg, avg^{r-1});
                                  Δ~ = avg^{r-1} - w^{r-1}·Δm^{r-1} + w^r·Δm^r;
                                  θm <- a_m <- OuterOpt_m(a_m, Δ~).

    The estimate w^r·Δm^r of round r's average is applied at once and swapped for the true average a round later, so
    summed over rounds a_m receives every worker's contribution exactly once. θg, which is evaluated and saved, only
    ever sees true averages and is identical on every worker; a_m is per worker. In the first round, and after a
    round rejected on every worker, a_m and OuterOpt_m restart from θg and its state, and Δ~ = Δm^r / M. A worker
    whose own Δ~ is not finite restarts from θg too (its round will be rejected everywhere) and does not step.

    `eager_estimate="own_share"` (Kale et al.): w = 1/M, so Δ~ = avg^{r-1} + (Δm^r - Δm^{r-1}) / M.
    `eager_estimate="fitted"`: one w per parameter (row piece), w^r = <Δm^{r-1}, avg^{r-1}> / <Δm^{r-1}, Δm^{r-1}>
    over its values, clipped to [1/M, 1] (`fitted_estimate_weight`): the least-squares share of the last average this
    worker's own pseudo-gradient explains (1/M in a first or restarted round). Workers that start a round together
    move alike, so w is near 1 when they agree and 1/M when they do not; the correction makes any w lose nothing over
    the rounds; per parameter, the estimate does not depend on how parameters are grouped into fragments or stages.
    """

    def __init__(self, config: DiLoCoConfig, rounds: RoundKeeper, workers: int):
        super().__init__(config, rounds, workers)
        self._fitted = config.eager_estimate == "fitted"

    def round_start(self, fragment: Fragment) -> torch.Tensor:
        return fragment.trajectory.values

    def prepare(self, fragment: Fragment, make_optimizer: OptimizerFactory) -> None:
        fragment.trajectory = Trajectory(fragment.theta_g, make_optimizer)

    def after_close(self, fragments: Sequence[Fragment]) -> None:
        for fragment in fragments:  # θm = θg now; training after close() starts from there
            fragment.trajectory.restart_from(fragment)

    def _follow(
        self, fragment: Fragment, flight: InFlight, previous: InFlight | None, record: RoundRecord | None
    ) -> torch.Tensor:
        average = None if record is None else record.average
        estimate, flight.weights = self._estimate(fragment, flight.sent, previous, average)
        finite = self.rounds.worker.all(bool(torch.isfinite(estimate).all()))
        if average is None or not finite:
            fragment.trajectory.restart_from(fragment)
        if finite:
            fragment.trajectory.step(estimate)
        fragment.write_local(fragment.trajectory.values)
        return estimate

    def _estimate(
        self, fragment: Fragment, delta: torch.Tensor, previous: InFlight | None, average: torch.Tensor | None
    ) -> tuple[torch.Tensor, list[float] | None]:
        """Δ~ and w^r per piece (None: 1/M for all)."""
        if average is None:
            return delta / self.workers, None
        if not self._fitted:
            return average + (delta - previous.sent) / self.workers, None
        sizes = fragment.owned_sizes
        own_pieces = previous.sent.split(sizes)
        products = [
            [float(torch.dot(own, mean)), float(torch.dot(own, own))]
            for own, mean in zip(own_pieces, average.split(sizes))
        ]
        # Each data-parallel rank holds part of a piece: the dot products are summed over the worker.
        summed = self.rounds.worker.sum([value for pair in products for value in pair])
        weights = [fitted_weight(fit, energy, self.workers) for fit, energy in zip(summed[::2], summed[1::2])]
        applied = previous.weights or [1.0 / self.workers] * len(weights)
        estimate = average.clone()
        for out, sent, fresh, before, now in zip(
            estimate.split(sizes), own_pieces, delta.split(sizes), applied, weights
        ):
            out.add_(sent, alpha=-before).add_(fresh, alpha=now)
        whole = fragment.sizes
        self.rounds.stats.eager_estimate_weight = sum(w * n for w, n in zip(weights, whole)) / max(1, sum(whole))
        return estimate, weights


def make_overlap(config: DiLoCoConfig, rounds: RoundKeeper, workers: int) -> Overlap:
    """The overlap mode `config.overlap` names."""
    modes = {"streaming": Streaming, "delayed": Delayed, "eager": Eager}
    return modes[config.overlap](config, rounds, workers)


def in_flight_order(fragments: Sequence[Fragment]) -> list[Fragment]:
    """The fragments with an exchange in flight, in the order their exchanges are applied."""
    return sorted((f for f in fragments if f.flight is not None), key=lambda f: (f.flight.apply_at, f.index))


def fitted_estimate_weight(own: torch.Tensor, average: torch.Tensor, workers: int) -> float:
    """The w in [1/M, 1] minimising ||average - w·own||: how much of a round's average this worker's own
    pseudo-gradient explains (about (1 + (M - 1)·c) / M when the workers' pseudo-gradients have cosine c)."""
    return fitted_weight(float(torch.dot(own, average)), float(torch.dot(own, own)), workers)


def fitted_weight(product: float, energy: float, workers: int) -> float:
    """`fitted_estimate_weight` from <own, average> and <own, own>."""
    fit = product / energy if energy > 0 else 0.0
    return min(1.0, max(1.0 / workers, fit)) if math.isfinite(fit) else 1.0 / workers


def _sum_of_residuals(first: torch.Tensor | None, second: torch.Tensor | None) -> torch.Tensor | None:
    if first is None or second is None:
        return second if first is None else first
    return first + second
