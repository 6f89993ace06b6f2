"""Asynchronous, quantized averaging of a flat fp32 pseudo-gradient across workers, with byte accounting.

With M workers and D data-parallel ranks per worker, the flat vector is padded to a multiple of D * M * align
(zeros), rank `dp` of every worker takes shard `dp`, and the M ranks holding the same shard run:

1. encode the shard's M chunks, `all_to_all` them (chunk j goes to worker j),
2. decode what arrived and sum it in fp32 (worker order, so every worker computes the same bits), divide by M,
3. encode that averaged chunk again and all-gather the encoded chunks (an `all_to_all` that sends the same payload
   to every worker); every rank decodes all of them.

Quantized values are therefore never summed in low precision, and every worker ends with the same bytes. Each
`all_to_all` of payloads is sent as point-to-point messages, receives posted first (`exchange_point_to_point`), so
both directions of a link carry their payloads at once.

`pattern="all_gather"` replaces steps 1-3 by one all-gather of every worker's encoded shard (an `all_to_all` that
sends the same payload to every worker); each rank decodes all of them and sums them in fp32 in worker order. The
average is then quantized once instead of twice (the requantization of step 3 has no error feedback), at
`(M - 1) x encoded shard` bytes per rank instead of `2 (M - 1) x encoded chunk`: the same bytes for M = 2, M / 2 times
more beyond. With `sign`, whose requantization loses a third of the energy, that halves its loss cost (BENCHMARKS.md,
compression). With `entropy_coding`, every encoded payload that crosses workers is deflated when that makes it
shorter (zlib level 1, in 1 MiB pieces that a thread pool compresses in parallel, each piece's length in front),
after an exchange of the payload lengths (M int64 per all_to_all); a payload whose length equals the encoded size
arrived raw. Decoding sees the same bytes either way, so the result is bitwise the same. Then the D ranks of a worker all-gather their averaged
shards over the fast intra-worker link. All of it runs in one background thread per engine, in launch order, so
training continues while it is in flight.

With a `LowRankCompressor` (see `lowrank.py`) a launch averages twice, `[P ++ rest]` then `[Q]`, each as above, and
returns the low-rank approximation. With a layout and D > 1 each matrix is factored by one rank of the worker and
each rank averages its own `[P ++ rest]` and `[Q]` (`lowrank_split.py`): no rank gathers the fragment. With a `CompressionPolicy` (see `adaptive.py`) the job first broadcasts the
decision of the outer group's first rank (`[rank, codec index]`, two int64) over the outer group, then from the
worker's first data-parallel rank over the fast link, so every rank of every worker uses the same setting.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor

import torch
import torch.distributed as dist

from ..compression.adaptive import CompressionPolicy, Observation
from ..compression.codecs import COMPRESSIONS, Codec, check_output_vector, coding_pool
from ..compression.lowrank import LowRankCompressor
from ..layout.buffers import BufferPool
from ..layout.shard import ShardLayout
from ..layout.topology import Topology
from ..settings.config import EXCHANGE_PATTERNS
from .lowrank_split import SplitLowRank
from .payloads import LENGTH_BYTES, deflate_payload, inflate_payload
from .pending import ExchangeResult, PendingExchange, SerialWorker
from .pipelined import pipeline_pieces, pipelined_reduce_scatter
from .transport import OuterGroup, ProcessGroupTransport, ScheduleTag, check_in_step

# What crosses workers, and in which collectives. Workers check at start that they agree on it; bump it whenever an
# exchange changes its collectives or payload layout. 2: the all-gather is an all_to_all, optional entropy coding.
# 3: an engine's exchange among a fixed group starts with its schedule tag (`ScheduleTag`). 4: low rank with D > 1
# data-parallel ranks averages each rank's own matrices' factors and share of the rest (`lowrank_split.py`).
# 5: payloads travel as point-to-point messages, receives posted first (`exchange_point_to_point`).
# 6: a long `reduce_scatter` shard travels in K pieces, both phases pipelined (`exchange/pipelined.py`).
WIRE_FORMAT = 6


class OuterExchange:
    """Averages flat fp32 vectors across workers (see module docstring).

    Args:
        topology: the rank's groups; only `outer_group` and `data_parallel_sync_group` are used.
        codec: encodes what crosses workers.
        keep_residual: return what the first encode dropped (error feedback needs it).
        pattern: `"reduce_scatter"` (encode chunks, average, re-encode, all-gather) or `"all_gather"` (all-gather
            every worker's encoded vector, one quantization); see the module docstring.
        entropy_coding: deflate each encoded payload before it crosses workers, when that is shorter.
        clip_factor: robust aggregation; when > 0, a contribution whose norm exceeds `clip_factor` x the lower median
            of all workers' norms is scaled down to that bound before it is encoded (every worker learns which were,
            `ExchangeResult.outliers`).
        timeout_seconds: how long `PendingExchange.wait` waits before raising `OuterSyncError`.
        delay_seconds: a callable returning seconds to sleep before each exchange (tests and benchmarks use it to
            emulate a slow link and to prove that nothing reads a buffer before its exchange finished).
    """

    def __init__(
        self,
        topology: Topology,
        codec: Codec,
        timeout_seconds: float = 1800.0,
        keep_residual: bool = False,
        clip_factor: float = 0.0,
        entropy_coding: bool = False,
        pattern: str = "reduce_scatter",
    ):
        if pattern not in EXCHANGE_PATTERNS:
            raise ValueError(f"exchange_pattern must be one of {', '.join(EXCHANGE_PATTERNS)}; got {pattern!r}.")
        self.topology = topology
        self.pattern = pattern
        self.codec = codec
        self.keep_residual = keep_residual
        self.entropy_coding = entropy_coding
        self.clip_factor = clip_factor
        self.timeout_seconds = timeout_seconds
        self.delay_seconds: Callable[[], float] | None = None
        self.inline_when_blocking = True
        self._worker: SerialWorker | None = None
        self._coding_pool: ThreadPoolExecutor | None = None
        # Payloads received and sent, and the fp32 sum of a `reduce_scatter` chunk: a few buffers of the longest kept
        # between rounds (fresh pages cost several times the writes, `buffers.py`); the lock: an inline exchange and
        # the background thread may take buffers at once.
        self._scratch = BufferPool(limit=6, dtype=torch.uint8)
        self._scratch_lock = threading.Lock()
        # Adaptive compression: the policy, how to build another codec by name, the link throughput (configured, or
        # measured by the previous exchange) and the log of choices.
        self.policy: CompressionPolicy | None = None
        self.codec_factory: Callable[[str], Codec] | None = None
        self.assumed_link_bytes_per_second: float | None = None
        self.link_bytes_per_second: float | None = None
        # With entropy coding: bytes sent / `wire_bytes` of the last exchange with each codec, by codec name.
        self.coded_share: dict[str, float] = {}
        self.choices: list[dict] = []

    def launch(
        self,
        vector: torch.Tensor,
        description: str,
        blocking: bool = False,
        compressor: LowRankCompressor | None = None,
        context: dict | None = None,
        layout: ShardLayout | None = None,
        outer: OuterGroup | None = None,
        out: torch.Tensor | None = None,
        schedule: ScheduleTag | None = None,
    ) -> PendingExchange:
        """Start averaging `vector`; with `compressor`, average its low-rank approximation instead.

        `context` tells an adaptive policy about the launch: `step`, `fragment`, `step_seconds`, `overlap_steps`.
        `layout`: `vector` is this rank's owned share of a fragment (`shard.py`), and so is the average returned. Without
        it, `vector` is the same on every data-parallel rank of the worker, which split its averaging between them.
        `outer`: average over these workers instead of the topology's outer group.
        `out`: a contiguous fp32 CPU tensor of `vector`'s length that the average is written into and returned as
        (None: a fresh tensor). Decoding straight into memory already in use is several times cheaper than into a
        fresh model-sized vector (`buffers.py`).
        `schedule`: where this worker's schedule launches the exchange. Among a fixed group (no `outer`) the workers
        first all-gather it (24 bytes per worker, counted in `sent`) and every worker raises `WorkersOutOfStepError`
        if any differs, before a payload is sent: a mismatched pairing would average different rounds silently.
        """
        vector = vector.detach().to(torch.float32).contiguous()
        check_output_vector(out, vector.numel(), "The average is written")
        parts = (self, vector, compressor, context or {}, layout, outer, out, schedule)
        job = functools.partial(self.learn, _ExchangeJob(*parts))
        if blocking and self.inline_when_blocking:
            return PendingExchange.run_inline(job, description, self.timeout_seconds)
        if self._worker is None:
            self._worker = SerialWorker("diloco-outer-sync")
        return PendingExchange(self._worker.submit(job), description, self.timeout_seconds)

    def learn(self, job: Callable[[], ExchangeResult]) -> ExchangeResult:
        """Run one exchange on this thread and keep what it measured for the next launches' choices (on the
        exchange's serial thread, so the next launch decides with it, as the order of launches says)."""
        result = job()
        if result.choice is not None:
            self.choices.append(result.choice)
        if result.coded_share is not None:
            name, share = result.coded_share
            self.coded_share[name] = share
        if result.link_bytes_per_second is not None:
            self.link_bytes_per_second = result.link_bytes_per_second
        return result

    def close(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
            self._worker = None
        if self._coding_pool is not None:
            self._coding_pool.shutdown(wait=False)
            self._coding_pool = None

    def coding_pool(self) -> Executor:
        """Threads that encode, decode, deflate and inflate the pieces of long vectors and payloads in parallel."""
        if self._coding_pool is None:
            self._coding_pool = coding_pool(min(8, os.cpu_count() or 1))
        return self._coding_pool

    def wire_bytes(
        self, numel: int, codec: Codec | None = None, shards: int | None = None, workers: int | None = None
    ) -> int:
        """Cross-worker bytes one rank sends to average a vector of `numel` elements split between `shards` ranks of
        the worker (by default all of its data-parallel ranks; 1 for a rank's own share): the formula `_ExchangeJob`
        counts.

        With `entropy_coding` this is the most it sends: every payload raw, plus the lengths. An adaptive policy plans
        with it times `coded_share[codec]`, the share deflate left of the last exchange with that codec.
        """
        codec = codec or self.codec
        shards = self.topology.data_parallel_size if shards is None else shards
        workers = workers or self._workers()
        chunk_numel = _padded_length(numel, self.granularity(codec, shards, workers)) // (shards * workers)
        lengths = LENGTH_BYTES if self.entropy_coding else 0
        if self.pattern == "all_gather":
            return (workers - 1) * (codec.encoded_nbytes(chunk_numel * workers) + lengths)
        return 2 * (workers - 1) * (codec.encoded_nbytes(chunk_numel) + lengths)

    def codec_named(self, name: str) -> Codec:
        if name == self.codec.name:
            return self.codec
        if self.codec_factory is None:
            raise ValueError(f"This exchange has no codec factory to build compression={name!r}.")
        return self.codec_factory(name)

    def _workers(self) -> int:
        return self.topology.num_workers

    def scratch(self, nbytes: int) -> torch.Tensor:
        """`nbytes` uninitialised bytes for an exchange's own use, reused once nothing refers to them any more."""
        with self._scratch_lock:
            return self._scratch.take(nbytes)

    def send_buffer(self, outgoing: list[torch.Tensor]) -> torch.Tensor:
        """The uint8 payloads one `all_to_all_single` sends, one after another: a single payload as it is."""
        if len(outgoing) == 1:
            return outgoing[0].contiguous()
        send = self.scratch(sum(p.numel() for p in outgoing))
        torch.cat(outgoing, out=send)
        return send

    def granularity(self, codec: Codec | None = None, shards: int | None = None, workers: int | None = None) -> int:
        """What a vector split between `shards` ranks of the worker (all of them by default) is padded to a multiple
        of: every rank's chunk for each of the `workers` (the topology's by default) is a whole number of codec
        blocks."""
        shards = self.topology.data_parallel_size if shards is None else shards
        return shards * (workers or self._workers()) * (codec or self.codec).align


def clip_outliers(
    norms: torch.Tensor, rank: int, factor: float, names: tuple[str, ...] = ()
) -> tuple[float, tuple[tuple[str, float], ...]]:
    """What robust aggregation does with the members' norms (-1: a member that joined during the round, whose zeros
    are no contribution and must not pull the median down: two joiners beside two contributors would make it 0): the
    factor `rank`'s contribution is scaled by (1.0: kept as it is) and every contribution over `factor` x the lower
    median of the contributors' norms, as (name, norm / that median), the same on every member. A non-finite norm
    clips nothing (the round is skipped everywhere), nor does a median of 0 (no scale to compare with: a worker that
    moved nothing, e.g. every inner step skipped by a GradScaler, must not zero the others)."""
    contributed = norms[norms >= 0]
    if not bool(torch.isfinite(norms).all()) or contributed.numel() == 0:
        return 1.0, ()
    median = float(contributed.median())  # the lower median: with two contributors, the smaller norm
    if median <= 0:
        return 1.0, ()
    bound = factor * median
    outliers = tuple(
        (names[member] if member < len(names) else f"worker {member}", float(value) / median)
        for member, value in enumerate(norms.tolist())
        if value > bound
    )
    mine = float(norms[rank])
    return (bound / mine if mine > bound else 1.0), outliers


class _ExchangeJob:
    """One launch's work on the exchange's thread: weigh or count the contributors (elastic), clip an outlier,
    average (plain, or the two low-rank passes under a policy's choice), and return the `ExchangeResult` with the
    bytes it sent across workers (`sent`) and inside the worker (`intra`). What it learns for later launches (the
    link's measured rate, the entropy coder's share, the policy's record) it returns in that result too, and
    `OuterExchange.learn` keeps it: the job reads its exchange's settings and buffers, and writes nothing into it."""

    def __init__(
        self,
        exchange: OuterExchange,
        vector: torch.Tensor,
        compressor: LowRankCompressor | None = None,
        context: dict | None = None,
        layout: ShardLayout | None = None,
        outer: OuterGroup | None = None,
        out: torch.Tensor | None = None,
        schedule: ScheduleTag | None = None,
    ):
        self.exchange = exchange
        self.out = out
        self.schedule = schedule
        topology = exchange.topology
        self.outer = outer or OuterGroup(topology.outer_group, topology.worker_index, topology.num_workers)
        self.transport = self.outer.transport()
        self.counts_contributors = outer is not None
        self.contributors = self.outer.size
        self.scale, self.fastest_step_seconds = 1.0, None
        self.vector = vector
        self.compressor = compressor
        self.context = context or {}
        self.layout = layout
        # With a layout and D > 1, the vector is this rank's share of a fragment split between the worker's ranks.
        self.owned = layout is not None and exchange.topology.data_parallel_size > 1
        self.sent = self.intra = 0
        self.link_seconds = 0.0
        self.averaged_bound = self.averaged_sent = 0  # cross-worker averaging: `wire_bytes` and what was sent
        self.outliers: tuple[tuple[str, float], ...] = ()

    def __call__(self) -> ExchangeResult:
        ex = self.exchange
        started = time.perf_counter()
        if ex.delay_seconds is not None:
            time.sleep(ex.delay_seconds())
        self.link_seconds = time.perf_counter() - started
        if self.schedule is not None and not self.counts_contributors:
            self.sent += check_in_step(self.transport, self.schedule)
        if not self.outer.contributes:
            self.vector = torch.zeros_like(self.vector)
        if self.counts_contributors and self.outer.weight is not None:
            self._weigh_contributions()
        elif self.counts_contributors:
            self.contributors = self._count_contributors()
        clipped, self.outliers = self._clip_outlier() if ex.clip_factor > 0 else (False, ())
        if self.compressor is None:
            average, residual = self._average(self.vector, ex.codec, split=not self.owned, out=self.out)
            return self._result(self._into_out(average), residual, clipped)
        choice = self._decide() if ex.policy is not None else None
        codec = ex.codec_named(choice["compression"]) if choice else ex.codec
        rank = choice["rank"] if choice else None
        if self.owned:
            average_of_all, residual = self._low_rank_by_owners(codec, rank)
        else:
            average_of_all, residual = self._low_rank_whole(codec, rank)
        self.compressor.compression = codec.name
        result = self._result(self._into_out(average_of_all), residual, clipped, choice)
        return dataclasses.replace(result, **_measured(self, codec.name if ex.entropy_coding else None))

    def _low_rank_whole(self, codec: Codec, rank: int | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Low rank of a vector every data-parallel rank holds whole: each averages 1/D of P and Q."""
        assert self.compressor is not None
        # With data-parallel ranks inside a worker, each rank only knows the quantization residual of its own shard;
        # dropping it keeps every rank's low-rank error feedback identical (the rank-r truncation is still kept).
        keep_dropped = self.exchange.topology.data_parallel_size == 1

        def average(vector: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
            averaged, dropped = self._average(vector, codec, split=True)
            return averaged, dropped if keep_dropped else None

        result = self.compressor.run(self.vector, average, rank=rank)
        return result.average, result.residual

    def _low_rank_by_owners(self, codec: Codec, rank: int | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Low rank of this rank's share of a fragment split between the worker's ranks: each matrix is factored by
        the rank that owns it and every averaged vector is this rank's own (`lowrank_split.py`)."""
        assert self.compressor is not None and self.layout is not None
        topo = self.exchange.topology
        split = SplitLowRank(self.compressor, self.layout, topo.dp_index, topo.data_parallel_sync_group)
        try:
            result = split.run(self.vector, lambda vector: self._average(vector, codec, split=False), rank)
        finally:
            self.intra += split.intra
        return result.average, result.residual

    def _result(
        self, average: torch.Tensor, residual: torch.Tensor | None, clipped: bool, choice: dict | None = None
    ) -> ExchangeResult:
        return ExchangeResult(
            average,
            residual,
            self.sent,
            self.intra,
            clipped,
            outliers=self.outliers,
            choice=choice,
            contributors=self._counted(),
            scale=self.scale,
            fastest_step_seconds=self.fastest_step_seconds,
        )

    def _into_out(self, average: torch.Tensor) -> torch.Tensor:
        """The average in `out`, where the path that made it did not already write it there."""
        if self.out is None:
            return average
        if average.data_ptr() != self.out.data_ptr():
            self.out.copy_(average)
        return self.out

    def _counted(self) -> int | None:
        return self.contributors if self.counts_contributors else None

    def _count_contributors(self) -> int:
        """How many of the round's workers contribute (one int64 all-reduced over the round's group)."""
        outer = self.outer
        if self.transport.alone:
            return int(outer.contributes)
        count = torch.tensor([int(outer.contributes)], dtype=torch.int64)
        self.transport.sum(count)
        self.sent += (outer.size - 1) * count.nbytes
        return int(count)

    def _weigh_contributions(self) -> None:
        """`round_policy: balanced` under elastic membership: one all-gather of (contributes, steps, step time) per
        member, 24 bytes each, in place of the contributor count. This worker's Δ is scaled by C w_m / Σ w (a new
        tensor: a retry sends the same Δ again), so the plain sum over C contributors is Σ w_m Δm / Σ w."""
        outer = self.outer
        weight = float(outer.weight) if outer.contributes else 0.0
        mine = torch.tensor([float(outer.contributes), weight, outer.step_seconds], dtype=torch.float64)
        everyone = self.transport.gather_rows(mine)
        self.sent += (everyone.shape[0] - 1) * mine.nbytes
        contributes, weights, seconds = everyone.unbind(dim=1)
        self.contributors = int(contributes.sum())
        total = float(weights.sum())
        measured = seconds[seconds > 0]
        self.fastest_step_seconds = float(measured.min()) if measured.numel() else 0.0
        if weight > 0 and total > 0:
            self.scale = self.contributors * weight / total
            if self.scale != 1.0:
                self.vector = self.vector * self.scale

    def _clip_outlier(self) -> tuple[bool, tuple[tuple[str, float], ...]]:
        """Robust aggregation (`clip_outliers`): one all-gather of the members' norms, 4 bytes each; whether this
        contribution was scaled down, and every member's that was. Under `round_policy: balanced` each contribution
        was scaled by s = M w / Σ w for the w inner steps it covers: its norm over s² is its norm per inner step (up to
        a factor the same for every member), so a worker that trained more steps is not taken for an outlier."""
        outer = self.outer
        if self.transport.alone:
            return False, ()
        balance = self.scale if outer.weight is not None else float(self.context.get("balance", 1.0))
        contributing = outer.contributes and balance > 0
        norm = (self._norm() / balance**2 if contributing else torch.tensor(-1.0)).reshape(1)
        norms = self.transport.gather_rows(norm).reshape(-1)
        self.sent += (outer.size - 1) * norm.nbytes
        scale, outliers = clip_outliers(norms, outer.rank, self.exchange.clip_factor, outer.names)
        if scale == 1.0:
            return False, outliers
        self.vector = self.vector * scale
        return True, outliers

    def _norm(self) -> torch.Tensor:
        """The norm of this worker's whole contribution (its data-parallel ranks' shares combined, in rank order)."""
        topo = self.exchange.topology
        if not self.owned or topo.data_parallel_sync_group is None:
            return self.vector.norm()
        squared = self.vector.double().pow(2).sum().reshape(1)
        parts = [torch.zeros_like(squared) for _ in range(topo.data_parallel_size)]
        dist.all_gather(parts, squared, group=topo.data_parallel_sync_group)
        self.intra += (topo.data_parallel_size - 1) * squared.nbytes
        return sum(parts).sqrt().float()

    def _average(
        self, vector: torch.Tensor, codec: Codec, split: bool, out: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Average one flat vector (see the module docstring); adds its bytes to `sent` / `intra`. With `split` the
        vector is the same on every data-parallel rank: each averages 1/D of it and they all-gather the results.
        `out`: where the average may be decoded to when this rank averages the whole vector unpadded."""
        ex, topo = self.exchange, self.exchange.topology
        numel = vector.numel()
        shards, index = (topo.data_parallel_size, topo.dp_index) if split else (1, 0)
        padded_numel = _padded_length(numel, ex.granularity(codec, shards, self.outer.size))
        padded = vector
        if padded_numel > numel:
            padded = torch.empty(padded_numel, dtype=torch.float32)
            padded[:numel].copy_(vector)
            padded[numel:].zero_()
        my_shard = padded.chunk(shards)[index]
        into = out if out is not None and my_shard.numel() == numel else None
        if self.transport.alone:
            averaged_shard, residual, sent = my_shard.clone() if into is None else into.copy_(my_shard), None, 0
        else:
            started = time.perf_counter()
            averaged_shard, residual, sent = self._average_across_workers(my_shard, codec, into)
            self.link_seconds += time.perf_counter() - started
            self.averaged_bound += ex.wire_bytes(numel, codec, shards, self.outer.size)
            self.averaged_sent += sent
        full, intra = gather_inside_worker(topo, averaged_shard) if split else (averaged_shard, 0)
        self.sent, self.intra = self.sent + sent, self.intra + intra
        if residual is not None:
            # Only this rank encodes its shard, so only that part of the residual ever matters here.
            padded_residual = torch.zeros_like(padded)
            padded_residual.chunk(shards)[index].copy_(residual)
            residual = padded_residual[:numel]
        return full[:numel], residual

    def _decide(self) -> dict:
        choice, sent, intra = decide_compression(self.exchange, self.compressor, self.context)
        self.sent, self.intra = self.sent + sent, self.intra + intra
        return choice

    def _average_across_workers(
        self, shard: torch.Tensor, codec: Codec, out: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        """The average of `shard` over the workers (in `out` when given), what encoding it dropped, bytes sent."""
        workers, divisor = self.outer.size, max(1, self.contributors)
        if self.exchange.pattern == "all_gather":
            return self._gather_contributions(shard, codec, out)
        pool = self.exchange.coding_pool()
        chunks = shard.chunk(workers)
        chunk_numel = chunks[0].numel()
        pieces = 1 if self.exchange.entropy_coding else pipeline_pieces(chunk_numel, codec.align)
        if pieces > 1:
            keep = self.exchange.keep_residual
            return pipelined_reduce_scatter(
                list(chunks), pieces, codec, self.transport, divisor, pool,
                lambda encoded: self._dropped(shard, encoded, codec) if keep else None,
                self.exchange.scratch, out,
            )  # fmt: skip
        encoded = [codec.encode(chunk, pool) for chunk in chunks]
        residual = self._dropped(shard, encoded, codec) if self.exchange.keep_residual else None
        received, sent = self._all_to_all(encoded, codec.encoded_nbytes(chunk_numel))
        summed = self.exchange.scratch(4 * chunk_numel).view(torch.float32)
        average = codec.decode_sum(received, chunk_numel, pool, summed).div_(divisor)
        # The all_gather of the averaged chunks, as an all_to_all that sends the same payload to every worker.
        gathered, sent_back = self._all_to_all(
            [codec.encode(average, pool)] * workers, codec.encoded_nbytes(chunk_numel)
        )
        return self._decoded(gathered, codec, shard.numel(), out), residual, sent + sent_back

    def _gather_contributions(
        self, shard: torch.Tensor, codec: Codec, out: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        """`pattern="all_gather"`: every worker's encoded shard to every worker, decoded and summed in worker order."""
        numel, workers, pool = shard.numel(), self.outer.size, self.exchange.coding_pool()
        encoded = codec.encode(shard, pool)
        residual = self._dropped(shard, [encoded], codec) if self.exchange.keep_residual else None
        received, sent = self._all_to_all([encoded] * workers, codec.encoded_nbytes(numel))
        return codec.decode_sum(received, numel, pool, out).div_(max(1, self.contributors)), residual, sent

    def _decoded(
        self, payloads: list[torch.Tensor], codec: Codec, numel: int, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The payloads of consecutive equal parts of a vector of `numel` values, decoded into one fp32 vector
        (`out`, or a fresh one)."""
        decoded = torch.empty(numel, dtype=torch.float32) if out is None else out
        for part, payload in zip(decoded.chunk(len(payloads)), payloads):
            codec.decode(payload, part.numel(), out=part, pool=self.exchange.coding_pool())
        return decoded

    def _dropped(self, shard: torch.Tensor, encoded: list[torch.Tensor], codec: Codec) -> torch.Tensor:
        """What encoding the shard's consecutive equal parts as `encoded` dropped: shard - decoded, in fp32."""
        decoded = self._decoded(encoded, codec, shard.numel())
        return torch.sub(shard, decoded, out=decoded)  # exactly overlapping: each value read before it is written

    def _all_to_all(self, payloads: list[torch.Tensor], nbytes: int) -> tuple[list[torch.Tensor], int]:
        """Send `payloads[j]` (uint8, `nbytes` each) to worker j; returns what every worker sent here and the bytes sent."""
        outer, coding = self.outer, self.exchange.entropy_coding
        me = outer.rank
        pool = self.exchange.coding_pool()
        sizes = arriving = [p.numel() for p in payloads]
        sent = 0
        if coding:
            outgoing = {id(p): p for j, p in enumerate(payloads) if j != me}
            # A payload sent to every worker is packed once.
            deflated = {key: deflate_payload(p, pool) for key, p in outgoing.items()}
            payloads = [p if j == me else deflated[id(p)] for j, p in enumerate(payloads)]
            sizes = [p.numel() for p in payloads]
            incoming = self.transport.exchange_lengths(torch.tensor(sizes, dtype=torch.int64))
            arriving, sent = incoming.tolist(), (outer.size - 1) * LENGTH_BYTES
        # Nothing is sent to this worker itself: its own payload is used where it is, and what crosses workers
        # travels through reused buffers instead of a fresh concatenation.
        sizes, arriving = _without(sizes, me), _without(arriving, me)
        received = self.exchange.scratch(sum(arriving))
        send = self.exchange.send_buffer([p for j, p in enumerate(payloads) if j != me])
        self.transport.exchange(send.split(sizes), received.split(arriving))
        sent += sum(sizes)
        parts = list(received.split(arriving))
        parts[me] = payloads[me]
        if coding:
            parts = [inflate_payload(part, nbytes, worker, pool) for worker, part in enumerate(parts)]
        return parts, sent


def gather_inside_worker(topo: Topology, shard: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Each data-parallel rank's averaged shard to every rank of the worker: the whole vector, and the bytes sent."""
    if topo.data_parallel_size == 1 or topo.data_parallel_sync_group is None:
        return shard, 0
    gathered = torch.empty(topo.data_parallel_size * shard.numel(), dtype=shard.dtype)
    dist.all_gather(list(gathered.chunk(topo.data_parallel_size)), shard, group=topo.data_parallel_sync_group)
    return gathered, (topo.data_parallel_size - 1) * shard.numel() * shard.element_size()


def _measured(job: _ExchangeJob, coded: str | None) -> dict:
    """What a low-rank job measured for later choices: the link's rate, and the entropy coder's share of the bytes
    `wire_bytes` gives for the codec named `coded` (None: no entropy coding)."""
    return {
        "link_bytes_per_second": job.sent / job.link_seconds if job.sent > 0 and job.link_seconds > 0 else None,
        "coded_share": (coded, job.averaged_sent / job.averaged_bound) if coded and job.averaged_bound > 0 else None,
    }


def decide_compression(ex: OuterExchange, compressor: LowRankCompressor, context: dict) -> tuple[dict, int, int]:
    """The policy's choice on the outer group's first rank, broadcast so that every rank uses the same one, and the
    bytes the broadcasts sent from this rank across workers and inside its worker."""
    topo = ex.topology
    sent = intra = 0
    observation = Observation(
        step=int(context.get("step", 0)),
        rank=compressor.rank,
        compression=compressor.compression,
        link_bytes_per_second=ex.assumed_link_bytes_per_second or ex.link_bytes_per_second,
        step_seconds=context.get("step_seconds"),
        overlap_steps=int(context.get("overlap_steps", 0)),
        captured_energy=compressor.captured_energy,
        bytes_of=lambda rank, name: round(
            ex.coded_share.get(name, 1.0)
            * sum(ex.wire_bytes(n, ex.codec_named(name)) for n in compressor.vector_lengths(rank))
        ),
    )
    choice = ex.policy.choose(observation)
    decision = torch.tensor([choice.rank, COMPRESSIONS.index(choice.compression)], dtype=torch.int64)
    decider = topo.layout.rank_at(0, 0, topo.stage_index)
    across = ProcessGroupTransport(topo.outer_group, topo.worker_index, topo.num_workers)
    if not across.alone:
        across.broadcast(decision, root=0)  # the outer group's first rank: worker 0's
        sent += (topo.num_workers - 1) * decision.nbytes if topo.worker_index == 0 else 0
    if topo.data_parallel_size > 1 and topo.data_parallel_sync_group is not None:
        root = topo.layout.rank_at(topo.worker_index, 0, topo.stage_index)
        dist.broadcast(decision, src=root, group=topo.data_parallel_sync_group)
        intra += (topo.data_parallel_size - 1) * decision.nbytes if topo.rank == root else 0
    rank, name = int(decision[0]), COMPRESSIONS[int(decision[1])]
    reason = choice.reason if topo.rank == decider else f"decided by rank {decider}"
    record = {
        "step": observation.step,
        "fragment": context.get("fragment"),
        "rank": rank,
        "compression": name,
        "reason": reason,
    }
    return record, sent, intra


def _without(sizes: list[int], me: int) -> list[int]:
    """`sizes` with this worker's own entry 0 (nothing is sent to oneself)."""
    return [0 if j == me else size for j, size in enumerate(sizes)]


def _padded_length(numel: int, granularity: int) -> int:
    return max(1, -(-numel // granularity)) * granularity
