"""What an engine counts (`EngineStats`) and what it tells observers after every round (`RoundRecord`).

Observers are how benchmarks and monitoring see inside the engine without patching it: `engine.add_observer(fn)` for
one engine, `register_round_observer(fn)` for every engine of the process (like torch's
`register_optimizer_step_post_hook`). Both return a handle whose `remove()` detaches the observer.
"""

from __future__ import annotations

import dataclasses
import re
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import torch
from torch.utils.hooks import RemovableHandle

_FRAGMENT_KEY = re.compile(r"fragment(\d+)_(syncs|bytes_sent)")


@dataclass(eq=False)
class EngineStats(Mapping):
    """The engine's counters, logged by `DiLoCo.metrics()` as `diloco/<key>`.

    Reads like the dict it is saved as: `stats["bytes_sent"]`, `stats.get(key, 0)`, `dict(stats)`, `stats.items()`.
    Optional entries are keys only once they hold a value: `lowrank_rank` and `compression_bits` with low-rank
    compression, `eager_estimate_weight` once the fitted eager estimate has been fitted, and with more than one
    fragment `fragment{p}_syncs` / `fragment{p}_bytes_sent` once fragment p has synced.

    Attributes:
        outer_steps: rounds whose average was applied to θg by an outer optimizer step.
        final_syncs: fragments' tails that `close()` synced (a plain average, no outer step).
        final_sync_bytes: cross-worker bytes of those tail syncs (included in `bytes_sent`).
        max_sync_bytes: the largest single exchange, in cross-worker bytes.
        bytes_sent: every byte this rank handed to the network across workers for the outer sync.
        bytes_sent_intra_worker: bytes of the collectives inside the worker (data-parallel ranks): all-gathers of
            updated parameters (in their dtype) and of low-rank pseudo-gradients, and the small agreements on each
            round.
        outer_state_bytes: bytes of everything the engine holds on this rank beyond the model and the inner optimizer
            (θg, outer optimizer state, eager's trajectory and its state, residuals, low-rank warm starts, buffers of
            exchanges in flight, the reused pseudo-gradient and average buffers), after the last `step()`; with D data-parallel
            ranks per worker about 1/D of D = 1's. Before a fragment's first round only its θg is held: that round
            allocates the outer momentum, the reused buffers and any residual, so the figure rises during the first
            round and then stays (plain DiLoCo: from 4 to 16 bytes per parameter at the first round, a 4x step
            between two logs).
        sync_wait_seconds: time the training loop waited for exchanges.
        skipped_nonfinite: rounds skipped on every worker because their average was not finite.
        skipped_divergent: rounds skipped on every worker by the divergence guard.
        inner_state_resets: parameters whose non-finite inner optimizer state was dropped.
        clipped_contributions: exchanges in which robust aggregation scaled this rank's contribution down.
        clipped_workers: every worker whose contribution robust aggregation scaled down in this process's run, by
            name (`worker <index>`, or the elastic site's name), with the number of exchanges; not a logged metric
            (the run summary and the model card name them).
        pseudo_grad_norm: norm of the last pseudo-gradient this worker sent.
        workers_in_round, membership_joins, membership_drops, exchange_retries, heals, heal_bytes, heal_seconds:
            elastic membership only (`elastic.py`): the workers in the last exchange's group, the rises and falls of
            that number over the run, exchanges retried after a failure, times this worker healed from a live peer
            and what that cost it.
        store_rounds, store_sites_in_round, store_late_contributions, store_wait_seconds, store_bytes_up,
            store_bytes_down: through a store only (`store/rounds.py`): the rounds applied, the sites whose
            contributions the last one applied, contributions applied a round or more late, the time this site's
            leader waited for rounds to be decided, and the bytes this rank wrote to and read from the store.
    """

    outer_steps: int = 0
    final_syncs: int = 0
    final_sync_bytes: int = 0
    max_sync_bytes: int = 0
    bytes_sent: int = 0
    bytes_sent_intra_worker: int = 0
    outer_state_bytes: int = 0
    sync_wait_seconds: float = 0.0
    skipped_nonfinite: int = 0
    skipped_divergent: int = 0
    inner_state_resets: int = 0
    clipped_contributions: int = 0
    pseudo_grad_norm: float = 0.0
    lowrank_rank: int | None = None
    compression_bits: int | None = None
    eager_estimate_weight: float | None = None
    workers_in_round: int | None = None
    membership_joins: int | None = None
    membership_drops: int | None = None
    exchange_retries: int | None = None
    heals: int | None = None
    heal_bytes: int | None = None
    heal_seconds: float | None = None
    store_rounds: int | None = None
    store_sites_in_round: int | None = None
    store_late_contributions: int | None = None
    store_wait_seconds: float | None = None
    store_bytes_up: int | None = None
    store_bytes_down: int | None = None
    fragment_syncs: dict[int, int] = field(default_factory=dict)
    fragment_bytes_sent: dict[int, int] = field(default_factory=dict)
    clipped_workers: dict[str, int] = field(default_factory=dict)

    def book_exchange(self, fragment: int, bytes_sent: int, bytes_intra: int, per_fragment: bool) -> None:
        """Count one finished exchange of `fragment` (per-fragment counters only when there are several)."""
        self.bytes_sent += bytes_sent
        self.max_sync_bytes = max(self.max_sync_bytes, bytes_sent)
        self.bytes_sent_intra_worker += bytes_intra
        if per_fragment:
            self.fragment_syncs[fragment] = self.fragment_syncs.get(fragment, 0) + 1
            self.fragment_bytes_sent[fragment] = self.fragment_bytes_sent.get(fragment, 0) + bytes_sent

    def __getitem__(self, key: str) -> float:
        match = _FRAGMENT_KEY.fullmatch(key)
        if match:
            return self._per_fragment(match.group(2))[int(match.group(1))]
        value = getattr(self, key, None) if key in _SCALARS else None
        if value is None:
            raise KeyError(key)
        return value

    def __iter__(self) -> Iterator[str]:
        yield from (name for name in _SCALARS if getattr(self, name) is not None)
        for fragment in sorted(self.fragment_syncs):
            yield f"fragment{fragment}_syncs"
            yield f"fragment{fragment}_bytes_sent"

    def __len__(self) -> int:
        return sum(1 for _ in self)

    @classmethod
    def from_dict(cls, saved: Mapping[str, float]) -> EngineStats:
        """Rebuild from `dict(stats)` as a checkpoint holds it (keys it does not know, e.g. of a later version, are
        ignored; keys an older version did not write keep their defaults)."""
        stats = cls()
        for key, value in saved.items():
            match = _FRAGMENT_KEY.fullmatch(key)
            if match:
                stats._per_fragment(match.group(2))[int(match.group(1))] = value
            elif key in _SCALARS:
                setattr(stats, key, value)
        return stats

    def _per_fragment(self, kind: str) -> dict[int, int]:
        return self.fragment_syncs if kind == "syncs" else self.fragment_bytes_sent


# The counters `DiLoCo.metrics()` logs: every field but the records kept per fragment or per worker (a dict each).
_SCALARS = [f.name for f in dataclasses.fields(EngineStats) if f.default_factory is dataclasses.MISSING]


@dataclass(frozen=True)
class RoundRecord:
    """What this worker saw of one completed round; every observer gets one after each round (tails included).

    The tensors are the engine's own (flat fp32, in the fragment's piece order): read them, clone what you keep.

    Attributes:
        fragment: the fragment the round synced.
        step: the inner step at which the round completed (its average applied, or the round rejected).
        sent: this worker's pseudo-gradient as it entered the exchange (error feedback included); None for an exchange
            restored from a checkpoint in streaming mode, which does not store it.
        average: the average over workers (identical on every worker); None when the round was rejected.
        rejected: None, `"nonfinite"` or `"divergent"` (see `DivergenceGuard`).
        bytes_sent: cross-worker bytes this rank sent for the round.
        final: the round is `close()`'s sync of a fragment's tail (a plain average, no outer step).
        estimate: `overlap="eager"` only: the update Δ~ this worker applied to its own trajectory right after this
            round completed (at the launch of the fragment's next round: this round's average, minus the estimate of
            it applied a round earlier, plus the estimate of the round just launched); None otherwise.
        piece_sizes: values per piece of the fragment that `sent` / `average` hold, to split them by parameter
            (`DiLoCo.fragment_pieces()` names the pieces); with D > 1 data-parallel ranks per worker a record holds this
            rank's share of the fragment, its part of each piece (possibly none).
        workers: M, the number of workers.
    """

    fragment: int
    step: int
    sent: torch.Tensor | None
    average: torch.Tensor | None
    rejected: str | None
    bytes_sent: int
    final: bool
    piece_sizes: tuple[int, ...]
    workers: int
    estimate: torch.Tensor | None = None


RoundObserver = Callable[[RoundRecord], None]
_process_observers: OrderedDict[int, RoundObserver] = OrderedDict()


def register_round_observer(observer: RoundObserver) -> RemovableHandle:
    """Call `observer(record)` after every round of every engine in this process; `handle.remove()` stops it."""
    handle = RemovableHandle(_process_observers)
    _process_observers[handle.id] = observer
    return handle


class Observers:
    """One engine's observers, called after the process-wide ones."""

    def __init__(self) -> None:
        self._own: OrderedDict[int, RoundObserver] = OrderedDict()

    def add(self, observer: RoundObserver) -> RemovableHandle:
        handle = RemovableHandle(self._own)
        self._own[handle.id] = observer
        return handle

    def publish(self, record: RoundRecord) -> None:
        for observer in [*_process_observers.values(), *self._own.values()]:
            observer(record)
