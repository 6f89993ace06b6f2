"""Adaptive gradient compression: a pluggable policy that picks the low-rank rank and the bit width of each sync.

Source: DiLoCoX (arXiv 2506.21263), adaptive gradient compression. The policy is asked once per outer sync, at the
start of the exchange job; the outer group's first rank decides and broadcasts its choice (see `exchange.py`), so
every worker uses the same setting. Write your own by subclassing `CompressionPolicy` and assigning it to
`engine.exchange.policy`.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .codecs import CODEC_BITS, CODEC_ERROR, CODECS, COMPRESSIONS


@dataclass
class Observation:
    """What a policy sees when it chooses the setting of one outer sync.

    Args:
        step: inner step at which the fragment was launched.
        rank: rank used by the previous sync of this fragment (0: it was sent dense, without factorisation).
        compression: codec used by the previous sync of this fragment.
        link_bytes_per_second: measured (or configured) cross-worker throughput; None when not known yet.
        step_seconds: measured compute time of one inner step; None when not known yet.
        overlap_steps: inner steps of compute that this exchange overlaps (0 when it blocks training).
        captured_energy: entry k-1 is the share of the pseudo-gradient's energy ||M||^2 that the best rank-k part
            of the previous round's approximation captured (k = 1..rank); None when not known yet.
        bytes_of: `bytes_of(rank, compression)`, the wire bytes this rank would send for one sync at that setting
            (with entropy coding: the raw size times the share deflate left of the last exchange with that codec).
    """

    step: int
    rank: int
    compression: str
    link_bytes_per_second: float | None
    step_seconds: float | None
    overlap_steps: int
    captured_energy: Sequence[float] | None
    bytes_of: Callable[[int, str], int]


@dataclass(frozen=True)
class Choice:
    rank: int
    compression: str
    reason: str = ""


class CompressionPolicy(abc.ABC):
    """Chooses `(rank, compression)` for the next outer sync; must only use what the observation holds."""

    @abc.abstractmethod
    def choose(self, observation: Observation) -> Choice: ...


class WindowEnergyPolicy(CompressionPolicy):
    """The default policy: the most accurate setting whose exchange hides behind the compute it overlaps.

    1. Rank ceiling from the spectrum (rank shrinks as the energy concentrates). With f(k) the share of the
       pseudo-gradient's energy captured by the top k ranks of the previous round: if the current rank r captures
       at least `energy_threshold` (f(r) >= X), the ceiling is the smallest candidate rank k with f(k) >= X;
       otherwise the rank is too small for the spectrum and the ceiling is the next candidate rank above r.
       Candidate ranks are `max_rank, max_rank / 2, ...` down to `min_rank`. Without a spectrum: the current rank.
    2. Candidates: every candidate rank up to the ceiling, with every codec from `compressions` (fewest bits first);
       with `dense`, also every codec at rank 0, the whole pseudo-gradient without factorisation (its estimated error
       is the codec's alone, so it wins whenever it fits: on small matrices or flat spectra low rank only loses).
       Without a spectrum yet (a low rank's error is unknown), or while the largest rank captures less than
       `energy_threshold` of the energy (the spectrum is too flat for low rank), only the dense candidates remain.
       Dense rounds measure the spectrum too (locally), so the policy returns to low rank when the energy
       concentrates.
    3. Time budget: `window = step_seconds * overlap_steps`; a candidate fits when
       `bytes_of(rank, compression) / link_bytes_per_second <= window`.
    4. Among the candidates that fit, take the one with the smallest estimated error
       `(1 - f(rank)) + CODEC_ERROR[compression]` (f(k) = f(r) above the current rank r, where nothing is known;
       f(k) = k / max_rank without a spectrum),
       ties broken by the larger rank, then fewer bytes. When none fits, take the candidate with the fewest bytes. When the link
       throughput or the step time is not known yet, keep the current codec and take the ceiling rank.

    Args:
        max_rank: the largest rank (`lowrank_rank`).
        min_rank: the smallest rank (`lowrank_min_rank`).
        compressions: codecs the policy may use.
        energy_threshold: X, the share of the energy the chosen rank should capture.
        dense: also consider sending without factorisation (rank 0).
    """

    def __init__(
        self,
        max_rank: int,
        min_rank: int,
        compressions: Sequence[str],
        energy_threshold: float = 0.9,
        dense: bool = False,
    ):
        if not 1 <= min_rank <= max_rank:
            raise ValueError(f"lowrank_min_rank must be in [1, lowrank_rank={max_rank}], got {min_rank}.")
        unknown = [c for c in compressions if c not in CODECS]
        if unknown or not compressions:
            raise ValueError(f"compression must be one of {', '.join(COMPRESSIONS)}; got {list(compressions)!r}.")
        self.ranks = _rank_ladder(max_rank, min_rank)
        self.compressions = sorted(compressions, key=lambda c: (CODEC_BITS[c], CODEC_ERROR[c]))
        self.energy_threshold = energy_threshold
        self.dense = dense

    def choose(self, observation: Observation) -> Choice:
        ceiling, why_rank = self._rank_ceiling(observation)
        link, step = observation.link_bytes_per_second, observation.step_seconds
        if link is None or step is None:
            return Choice(ceiling, observation.compression, f"{why_rank}; no throughput measurement yet")
        window = step * observation.overlap_steps
        ranks = [r for r in self.ranks if r <= ceiling] + ([0] if self.dense else [])
        if self.dense and not observation.captured_energy:
            ranks, why_rank = [0], "no spectrum yet: dense only"
        elif self.dense and self._largest_rank_misses_too_much(observation):
            ranks, why_rank = [0], f"rank {self.ranks[0]} captures less than {self.energy_threshold:.0%}: dense only"
        candidates = [(r, c) for r in ranks for c in self.compressions]
        timed = [(observation.bytes_of(r, c) / link if link > 0 else float("inf"), r, c) for r, c in candidates]
        fitting = [item for item in timed if item[0] <= window]
        if not fitting:
            seconds, rank, codec = min(timed, key=lambda item: (item[0], -_fullness(item[1]), CODEC_ERROR[item[2]]))
            return Choice(rank, codec, f"{why_rank}; nothing fits {window:.3g}s, fastest takes {seconds:.3g}s")
        seconds, rank, codec = min(
            fitting, key=lambda item: (self._error(observation, item[1], item[2]), -_fullness(item[1]), item[0])
        )
        what = "dense" if rank == 0 else f"rank {rank}"
        return Choice(rank, codec, f"{why_rank}; {what} {codec} takes {seconds:.3g}s, fits the {window:.3g}s window")

    def _rank_ceiling(self, observation: Observation) -> tuple[int, str]:
        # After a dense sync (rank 0) the ceiling search starts from the largest rank.
        energy, current = observation.captured_energy, observation.rank or self.ranks[0]
        if not energy:
            return self._snap(current), "no spectrum yet"
        captured = energy[min(current, len(energy)) - 1]
        threshold = self.energy_threshold
        if captured >= threshold:
            for rank in sorted(self.ranks):
                if rank <= len(energy) and energy[rank - 1] >= threshold:
                    return rank, f"rank {rank} captures {energy[rank - 1]:.1%} >= {threshold:.0%} of the energy"
            return self._snap(current), f"rank {current} captures {captured:.1%}"
        larger = [r for r in sorted(self.ranks) if r > current]
        rank = larger[0] if larger else self.ranks[0]
        return rank, f"rank {current} captures only {captured:.1%} < {threshold:.0%} of the energy"

    def _largest_rank_misses_too_much(self, observation: Observation) -> bool:
        """The spectrum is too flat for low rank: the largest rank captured less than the threshold when last used."""
        energy, largest = observation.captured_energy, self.ranks[0]
        return bool(energy) and len(energy) >= largest and energy[largest - 1] < self.energy_threshold

    def _snap(self, rank: int) -> int:
        """The largest candidate rank not above `rank` (the smallest candidate if all are above)."""
        below = [r for r in self.ranks if r <= rank]
        return max(below) if below else min(self.ranks)

    def _error(self, observation: Observation, rank: int, codec: str) -> float:
        if rank == 0:
            return CODEC_ERROR[codec]
        energy = observation.captured_energy
        # Without a spectrum, assume a flat one: a rank captures its share of the largest rank.
        captured = energy[min(rank, len(energy)) - 1] if energy else rank / self.ranks[0]
        return (1.0 - captured) + CODEC_ERROR[codec]


def _fullness(rank: int) -> float:
    """Order of ranks by how much they keep: rank 0 (dense) keeps everything."""
    return float("inf") if rank == 0 else rank


def policy_compressions(floor: str) -> list[str]:
    """Codecs an adaptive run may use when `compression=floor`: `floor`, then every codec the registry marks as an
    adaptive step (fp4 < fp8 < bf16 < none) with more bits than it, fewest bits first."""
    above = [name for name, codec in CODECS.items() if codec.adaptive_step and codec.bits > CODECS[floor].bits]
    return [floor, *sorted(above, key=CODEC_BITS.__getitem__)]


def _rank_ladder(max_rank: int, min_rank: int) -> list[int]:
    ranks, rank = [], max_rank
    while rank > min_rank:
        ranks.append(rank)
        rank //= 2
    ranks.append(min_rank)
    return sorted(set(ranks), reverse=True)
