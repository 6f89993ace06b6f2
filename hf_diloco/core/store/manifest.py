"""One round's decision, and the rule that closes a round.

A round R of fragment F applies the contributions its manifest lists: each a site's pseudo-gradient trained from
round `base` of F (the θg it started from), with its tokens. A contribution from the round just before (base R - 1)
is fresh; one from an earlier round arrived late (a slow or paused site) and is `staleness` = R - 1 - base rounds
old. Its weight is its tokens divided by 1 + staleness, normalised over the round:

    avg_R = Σ_i w_i Δ_i,   w_i = (t_i / (1 + s_i)) / Σ_j (t_j / (1 + s_j))

Dividing a late update by its staleness is the staleness-aware rule of asynchronous SGD (Zhang, Gupta, Lian and Liu,
"Staleness-aware Async-SGD for Distributed Deep Learning", IJCAI 2016, arXiv 1511.05950: the learning rate of a
gradient τ steps old divided by τ), applied here to a pseudo-gradient s rounds old; weighing by tokens is Decoupled
DiLoCo's (arXiv 2604.21428). A contribution older than `max_staleness` rounds is not applied. Every site applies the
manifest's weights as written, so they are the same floats everywhere.

A round closes (its manifest is written, create-if-absent) once contributions of `quorum` sites are in and the grace
window has passed since (`ClosingRule`), or at the hard deadline with whatever is in.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

MIN_GRACE_SECONDS = 0.5


@dataclass(frozen=True)
class Contribution:
    """A site's pseudo-gradient of one fragment as its record states it.

    Attributes:
        site: the site's name; `incarnation`: its process's (a restarted site's contributions are told apart).
        base: the round of the fragment it was trained from.
        tokens: the tokens it trained (inner steps x tokens per step).
        record: the SHA-256 of its record object, which lists every share (hash and segments): a round pins it.
        final: a tail of the job's end (`close()`), applied by the final round only.
        norm: the norm of the whole pseudo-gradient (all the site's shares), for robust clipping.
    """

    site: str
    incarnation: str
    base: int
    tokens: float
    record: str
    final: bool = False
    norm: float = 0.0

    @property
    def ident(self) -> tuple[str, str, int]:
        return (self.site, self.incarnation, self.base)

    def as_dict(self) -> dict:
        return {
            "site": self.site, "incarnation": self.incarnation, "base": self.base, "tokens": self.tokens,
            "record": self.record, "final": self.final, "norm": self.norm,
        }  # fmt: skip

    @classmethod
    def from_dict(cls, entry: dict) -> Contribution:
        return cls(
            str(entry["site"]), str(entry["incarnation"]), int(entry["base"]), float(entry["tokens"]),
            str(entry.get("record", "")), bool(entry.get("final", False)), float(entry.get("norm", 0.0)),
        )  # fmt: skip


@dataclass(frozen=True)
class Entry:
    """A contribution as a round applies it: `weight` x Δ, the weight its share of the tokens (by staleness) times
    `clip` (< 1: robust clipping scaled it down to `robust_clip_factor` x the round's lower median norm)."""

    contribution: Contribution
    staleness: int
    weight: float
    clip: float = 1.0


@dataclass(frozen=True)
class Manifest:
    """What round `round` of `fragment` applies (the final round: `final`, after regular round `round` - 1).

    Attributes:
        closed_by: the site that wrote it; `quorum_met`: whether it closed with `quorum` sites in (else at the
            deadline); `waited_seconds`: how long the closer waited for it.
    """

    fragment: int
    round: int
    closed_by: str
    entries: tuple[Entry, ...]
    final: bool = False
    quorum_met: bool = True
    waited_seconds: float = 0.0

    @property
    def sites(self) -> list[str]:
        return sorted({entry.contribution.site for entry in self.entries})

    @property
    def late(self) -> int:
        return sum(1 for entry in self.entries if entry.staleness > 0)

    def header(self) -> dict:
        return {
            "kind": "final" if self.final else "manifest", "fragment": self.fragment, "round": self.round,
            "closed_by": self.closed_by, "quorum_met": self.quorum_met, "waited_seconds": round(self.waited_seconds, 3),
            "entries": [
                {**entry.contribution.as_dict(), "staleness": entry.staleness, "weight": entry.weight,
                 "clip": entry.clip}  # fmt: skip
                for entry in self.entries
            ],
        }  # fmt: skip

    @classmethod
    def from_header(cls, header: dict) -> Manifest:
        entries = tuple(
            Entry(Contribution.from_dict(entry), int(entry["staleness"]), float(entry["weight"]), float(entry["clip"]))
            for entry in header["entries"]
        )
        return cls(
            int(header["fragment"]), int(header["round"]), str(header["closed_by"]), entries,
            final=header["kind"] == "final", quorum_met=bool(header["quorum_met"]),
            waited_seconds=float(header["waited_seconds"]),
        )  # fmt: skip


def weigh(
    contributions: Iterable[Contribution], round_: int, max_staleness: int, clip_factor: float = 0.0
) -> tuple[Entry, ...]:
    """The entries of round `round_`: each contribution at most `max_staleness` rounds old, weighted by
    tokens / (1 + staleness), in a fixed order; with `clip_factor` > 0 and several contributions, one whose norm is
    over `clip_factor` x the lower median of their norms is scaled down to that bound (robust clipping, as a fixed
    group's exchange does it)."""
    kept = []
    for contribution in contributions:
        staleness = round_ - 1 - contribution.base
        if 0 <= staleness <= max_staleness and contribution.tokens > 0:
            kept.append((contribution, staleness, contribution.tokens / (1 + staleness)))
    kept.sort(key=lambda item: item[0].ident)  # first: the total's rounding then depends on the set, not on arrivals
    total = sum(raw for _, _, raw in kept)
    norms = sorted(contribution.norm for contribution, _, _ in kept)
    bound = clip_factor * norms[(len(norms) - 1) // 2] if clip_factor > 0 and len(norms) > 1 else 0.0
    entries = []
    for contribution, staleness, raw in kept:
        clip = bound / contribution.norm if 0 < bound < contribution.norm else 1.0
        entries.append(Entry(contribution, staleness, raw / total * clip, clip))
    return tuple(entries)


@dataclass
class ClosingRule:
    """When the site waiting for a round closes it.

    Args:
        quorum: contributions of this many sites close the round once the grace window has passed.
        grace_seconds: the window after the quorum, for the sites a little behind; with `adaptive`, the most the
            window may be.
        deadline_seconds: the round closes with whatever is in after this long, quorum or not.
        adaptive: the window follows how late the other sites' contributions came after the quorum in the last
            rounds (1.5 x their 90th percentile, at least `MIN_GRACE_SECONDS`), as Decoupled DiLoCo adapts its grace
            window to the observed arrival times (arXiv 2604.21428).
    """

    quorum: int
    grace_seconds: float
    deadline_seconds: float
    adaptive: bool = False
    lateness: deque = field(default_factory=lambda: deque(maxlen=16))

    def grace(self) -> float:
        if not self.adaptive or len(self.lateness) < 2:
            return self.grace_seconds
        p90 = statistics.quantiles(self.lateness, n=10)[-1] if len(self.lateness) > 2 else max(self.lateness)
        return min(self.grace_seconds, max(MIN_GRACE_SECONDS, 1.5 * p90))

    def due(self, sites_in: int, quorum_seconds: float | None, waited_seconds: float) -> bool:
        """Whether to close now: `sites_in` sites have contributed, the quorum was reached `quorum_seconds` ago
        (None: not yet), the closer has waited `waited_seconds` for this round."""
        if sites_in == 0:
            return False
        if waited_seconds >= self.deadline_seconds:
            return True
        return quorum_seconds is not None and quorum_seconds >= self.grace()

    def observe(self, seconds_after_quorum: float) -> None:
        """A contribution came this long after the quorum (before the round closed)."""
        self.lateness.append(max(0.0, seconds_after_quorum))
