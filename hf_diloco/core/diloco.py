"""The DiLoCo engine: the schedule of fragment-wise outer syncs around any model and inner optimizer.

Sources: DiLoCo (Douillard et al. 2023, arXiv 2311.08105), Streaming DiLoCo (Douillard et al. 2025,
arXiv 2501.18512), DiLoCoX (arXiv 2506.21263, one-step delay) and Eager updates (Kale et al. 2025,
arXiv 2502.12996). Where each part lives: the schedule in `fragments.py`, a fragment's state in `fragment.py`, the
update rule of each overlap mode in `overlap.py`, completing a round (guards, observers) in `rounds.py`, the
exchange in `exchange.py`, the start-up checks in `agreement.py`; docs/design.md explains the whole.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .compression.adaptive import WindowEnergyPolicy, policy_compressions
from .compression.codecs import CODEC_BITS, make_codec
from .compression.lowrank import LowRankCompressor
from .exchange.exchange import OuterExchange
from .exchange.lowrank_split import assign_owners
from .layout.buffers import BufferPool
from .layout.devices import local_device
from .layout.fragments import Piece, find_block_stack, partition_fragments
from .layout.shard import ReplicatedValues, ShardedValues, Worker, is_sharded
from .layout.topology import Topology
from .membership.agreement import (
    broadcast_initial_parameters,
    check_topology_matches,
    check_workers_agree,
    describe_pieces,
    model_settings,
)
from .membership.elastic import ElasticRounds
from .membership.membership import Membership
from .rounds import checkpoint
from .rounds.fixed import FixedGroupRounds
from .rounds.fragment import Fragment, InFlight, outer_state_bytes
from .rounds.overlap import Overlap, make_overlap
from .rounds.round_policy import RoundClock, make_round_policy
from .rounds.rounds import DivergenceGuard, RoundKeeper
from .rounds.stats import EngineStats, Observers, RoundRecord
from .settings.config import DiLoCoConfig, refuse_unsupported
from .settings.outer_schedule import learning_rate_now, scheduled
from .settings.secret import job_secret
from .store.objects import ObjectStore
from .store.rounds import StoreRounds
from .store.sealing import JobKeys


class DiLoCo:
    """DiLoCo outer loop around any model and inner optimizer.

    Call `step()` after every inner optimizer step (t counts them from 1) and `close()` at the end. Fragment p is
    launched after step t when `t % H == ((p + 1) * H // P) % H`: its pseudo-gradient Δm (where its round started
    minus θm, this worker's parameters) is averaged over the workers and applied to θg, the fp32 global copy, by the
    outer optimizer (Nesterov SGD by default, one per fragment). When and how is the overlap mode's rule, written as
    the docstring of its class in `overlap.py`: `Streaming` (τ-step overlap; P = 1, τ = 0 is plain DiLoCo), `Delayed`
    (one round later) or `Eager` (own contribution at once, the others a round later).

    `close()` applies what is in flight at once, then syncs each fragment's tail (steps since its last launch) by a
    plain average, θg <- θg - avg (no outer step), so θg holds every inner step; θm <- θg. The tail also carries every
    error-feedback residual not yet sent.

    With `lowrank_rank` > 0 the exchange averages a PowerSGD approximation of Δm (`lowrank.py`), and with
    `adaptive_compression` a policy picks rank and codec per sync (`adaptive.py`; assign another `CompressionPolicy`
    to `engine.exchange.policy`). Rounds whose average is not finite, or far larger than the recent ones, are skipped
    on every worker alike (`rounds.py`). `add_observer` sees every round. With `round_policy: balanced` each worker's
    steps per round follow its measured speed and the average is weighted by steps (`round_policy.py`); read
    `outer_rounds` and `global_step` for where the run stands.

    Args:
        model: the model this worker trains (its trainable parameters are synced).
        inner_optimizer: the inner optimizer (its state is saved with the engine's; None: nothing to save).
        config: the DiLoCo settings.
        topology: this rank's process groups; by default every rank of the default group is one worker.
        num_blocks: the length of the whole block stack when `model` holds part of it (a pipeline stage).
        extra_fingerprint: any text every rank must agree on besides the DiLoCo settings and the model (e.g. the
            training schedule, tokenizer and data hashes); compared at start-up.
        membership: elastic workers (`elastic.py`): every exchange runs among the workers present, found by this
            backend (e.g. `TorchftMembership`), instead of a fixed group. This process is one worker (or one of its
            D DDP ranks, `topology` being theirs); a worker behind the others takes their state during construction:
            read `inner_step` afterwards to know where training continues.
    """

    def __init__(
        self,
        model: nn.Module,
        inner_optimizer: torch.optim.Optimizer | None,
        config: DiLoCoConfig,
        topology: Topology | None = None,
        num_blocks: int | None = None,
        extra_fingerprint: str = "",
        membership: Membership | None = None,
        store: ObjectStore | None = None,
    ):
        self.config, self.model, self.inner_optimizer = config, model, inner_optimizer
        config.outer_schedule()  # a decaying outer schedule without its length is refused before any work
        check_store_given(config, store, membership)
        self.tokens_per_step = 1.0  # what a contribution's weight counts through a store (the glue sets tokens)
        if membership is not None or store is not None:
            check_elastic_supported(config, topology, membership)
            topology = topology or Topology.single_process()
        self.topology = topology or Topology.from_default_group(
            config.pipeline_stages, config.data_parallel_per_worker, config.sync_timeout_seconds
        )
        check_topology_matches(self.topology, config)
        params = {name: p for name, p in model.named_parameters() if p.requires_grad}
        self.sharded_model = is_sharded(params, self.topology)
        shapes = {name: tuple(p.shape) for name, p in params.items()}
        block_stack = find_block_stack(model)
        pieces = partition_fragments(shapes, config.num_fragments, config.fragment_pattern, block_stack, num_blocks)
        check_workers_agree(
            self.topology,
            config.fingerprint(),
            describe_pieces(pieces, params) + (";sharded by FSDP" if self.sharded_model else ""),
            model_settings(model),
            extra_fingerprint,
            config.sync_timeout_seconds,
        )
        broadcast_initial_parameters(self.topology, params, self.sharded_model)
        self.inner_step = 0
        self.stats = EngineStats()
        self.exchange = _make_exchange(self.topology, config)
        self.worker = Worker(self.topology, self._count_intra_worker_bytes)
        self.guard = DivergenceGuard(config.divergence_factor, config.max_skipped_rounds, config.first_round_factor)
        self._observers = Observers()
        self.rounds = RoundKeeper(
            self.stats,
            self.guard,
            inner_optimizer,
            self._observers,
            lambda: self.inner_step,
            self.topology.num_workers,
            per_fragment_stats=config.num_fragments > 1,
            worker=self.worker,
            residual_decay=config.error_feedback_decay,
        )
        self.overlap = make_overlap(config, self.rounds, self.topology.num_workers)
        # Every fragment's sent vector and average may be held for a round (delayed, eager), and a pair is being made.
        self.buffers = BufferPool(limit=2 * config.num_fragments + 2)
        sharded, granularity = self.model if self.sharded_model else None, self.exchange.granularity()
        values = [_fragment_values(part, params, sharded, granularity, self.worker) for part in pieces]
        self.fragments = [
            _make_fragment(config, index, part, params, values[index], self.buffers, self.overlap)
            for index, part in enumerate(pieces)
        ]
        if config.lowrank_rank:
            self.stats.lowrank_rank, self.stats.compression_bits = config.lowrank_rank, CODEC_BITS[config.compression]
        self.clock = RoundClock()  # each inner step's compute time and the engine's; read by the round policy
        self.round_policy = make_round_policy(config, self.topology, elastic=membership is not None)
        self._closed = False
        self.fixed_group = FixedGroupRounds(self)
        self.elastic = None if membership is None else ElasticRounds(self, membership)
        if self.elastic is not None:
            self.elastic.join()
        self.store = None if store is None else StoreRounds(self, store, job_secret())
        if self.store is not None:
            self.store.join()
        self._count_outer_state()

    # ----------------------------------------------------------------------------------------------- the loop

    def step(self) -> None:
        """Advance the schedule by one completed inner optimizer step."""
        if self._closed:
            raise _step_after_close(self.inner_step)
        if self.elastic is not None:
            self.elastic.check_can_train()
        self.clock.step_begins()
        self.inner_step += 1
        if self.elastic is not None:  # an exchange running behind the inner steps completes first, when due
            self.elastic.background.finish_due(self.inner_step)
        flights = [fragment.flight for fragment in self.fragments]
        if self.store is not None:
            self.store.apply_due(self.inner_step)
        self.overlap.apply_due(self.fragments, self.inner_step)
        launches = self.round_policy.launches(self.inner_step)
        for index in launches:
            self._launch(self.fragments[index])
        round_ended = self.round_policy.end_round_if_due(self.inner_step, self.clock)
        if launches or round_ended or _flights_changed(self.fragments, flights):  # what the outer state holds moved
            self._count_outer_state()
        self.clock.step_ends(round_ended)

    @property
    def job_finished(self) -> bool:
        """Through a store (`exchange: store`): the job's final round was applied (the first site to finish ended
        the job); stop training and call `close()`. Always False otherwise."""
        return self.store is not None and self.store.finished

    @property
    def outer_rounds(self) -> int:
        """Completed outer rounds, equal on every worker (`while engine.outer_rounds < R: ...` ends at a round)."""
        return self.round_policy.outer_rounds(self.inner_step)

    @property
    def global_step(self) -> int:
        """The run's position in the fastest worker's steps (`inner_step` under `steps`; `round_policy.py`)."""
        return self.round_policy.global_step(self.inner_step)

    def close(self) -> None:
        """Apply everything still in flight (in launch order), then sync the steps no round has covered yet.

        A fragment trained for k > 0 steps since its last launch (the tail of a run whose length is not a multiple of
        its schedule, e.g. fragment 0 of Streaming DiLoCo, last launched H - H/P steps before the end) sends that
        tail's pseudo-gradient once more, blocking, and θg_p takes the plain average (θg_p <- θg_p - mean_m Δm, no
        outer step: the outer momentum would extrapolate a partial round). Without it the final θg, which is what gets
        evaluated and saved, would drop up to H - H/P steps of training. Every worker has the same step count, so
        every worker syncs the same fragments. Afterwards θm <- θg on every worker.

        Error feedback loses nothing here either: with outer lr 1 and no momentum, θg minus the workers' mean residual
        still held then equals θ0 minus the mean of every pseudo-gradient they produced (a test).
        """
        self._closed = True
        if self.store is not None:
            self.store.close()
            self.overlap.after_close(self.fragments)
            self.exchange.close()
            self._count_outer_state()
            return
        scales = self.round_policy.tail_scales(self.inner_step)  # by fragment index
        tails = [fragment for fragment in self.fragments if scales[fragment.index] is not None]
        for index, delta in self.overlap.close(self.fragments, tails).items():
            self._sync_tail(self.fragments[index], delta, scales[index])
        self.overlap.after_close(self.fragments)
        self.exchange.close()
        if self.elastic is not None:
            self.elastic.close()
        self._count_outer_state()

    def add_observer(self, observer: Callable[[RoundRecord], None]) -> RemovableHandle:
        """Call `observer(record)` after every round of this engine (see `RoundRecord`); `handle.remove()` stops it.
        `hf_diloco.core.rounds.stats.register_round_observer` does the same for every engine of the process."""
        return self._observers.add(observer)

    # ----------------------------------------------------------------------------------------------- reading it

    def fragment_names(self) -> list[list[str]]:
        """Parameter names per fragment (with `balanced`, a matrix cut by rows is named in every fragment)."""
        return [fragment.names() for fragment in self.fragments]

    def fragment_pieces(self) -> list[list[Piece]]:
        """Per fragment, the (name, start row, stop row) pieces it syncs, in the order of its flat buffer."""
        return [list(fragment.pieces) for fragment in self.fragments]

    def global_parameters(self) -> dict[str, torch.Tensor]:
        """fp32 θg by parameter name, whole (views of the flat per-fragment buffers; a copy for a parameter cut by rows).

        With D > 1 data-parallel ranks per worker each rank holds 1/D of θg, so this gathers it inside the worker (its
        fast link, never across workers): every rank of the worker must call it at the same point.
        """
        return whole_parameters(self.fragments)

    @contextlib.contextmanager
    def global_weights(self) -> Iterator[nn.Module]:
        """Temporarily load θg into the model (to evaluate or save the global model); the local weights come back.

        With D > 1 data-parallel ranks per worker, entering and leaving are collectives inside the worker (replicated
        ranks all-gather their shares of θg): every rank of the worker enters and leaves at the same point. A model
        sharded with FSDP then holds θg in its shards; gather a full state dict inside the context to save it.
        """
        saved = [fragment.local() for fragment in self.fragments]
        try:
            self.load_global_weights()
            yield self.model
        finally:
            for fragment, values in zip(self.fragments, saved):
                fragment.write_local(values)

    def load_global_weights(self) -> None:
        """Write θg into the model for good (after `close()`, say: the model then is the global model).

        With D > 1 data-parallel ranks per worker this is a collective inside the worker (replicated ranks all-gather
        their shares; a model sharded with FSDP gets θg in its shards): every rank of the worker calls it at the same
        point.
        """
        for fragment in self.fragments:
            fragment.write_local(fragment.theta_g)

    def metrics(self) -> dict[str, float]:
        """`diloco/*` scalars for logging, from local state only (no collective) and from what the syncs already read
        (no read of the model): `local_global_drift` is ||θm - θg|| / ||θg|| measured at each fragment's last launch
        (0 before any), with D > 1 data-parallel ranks per worker that of this rank's share."""
        logs = {f"diloco/{key}": float(value) for key, value in self.stats.items()}
        logs.update(fragment_metrics(self.config, self.fragments, self.inner_step))
        return {**logs, **self.round_policy.metrics(self.inner_step, self.clock)}

    # ----------------------------------------------------------------------------------------------- checkpoints

    def state_dict(self) -> dict:
        """Everything needed to continue bitwise: waits for in-flight exchanges but does not apply them."""
        if self.store is not None:
            self.store.drain()  # uploaded and settled: the store holds the rounds, a resume joins from it
        state = checkpoint.engine_state(self._checkpointed_parts(), self.inner_step, self.stats)
        return state if self.elastic is None else self.elastic.with_progress(state)

    def load_state_dict(self, state: dict) -> None:
        """Restore a `state_dict()`, also an older layout's (under membership whoever is ahead wins: `resume`)."""
        self.inner_step, self.stats = checkpoint.load_engine_state(self._checkpointed_parts(), state)
        self.rounds.stats = self.stats
        if self.elastic is not None:  # live peers, or another site's newer checkpoint, may be ahead of this one
            self.elastic.resume(state)
        if self.store is not None:  # the store's θg and outer state are the job's; this rank keeps its own θm
            self.store.resume()
        self._count_outer_state()

    def _checkpointed_parts(self) -> checkpoint.CheckpointedParts:
        topology, policy = self.topology, self.round_policy
        shard = checkpoint.shard_description(topology.dp_index, topology.data_parallel_size, self.sharded_model)
        parts = (self.config, self.fragments, self.rounds, self.overlap.saves_sent, self.inner_optimizer, self.guard)
        return checkpoint.CheckpointedParts(*parts, round_policy=policy, shard=shard)

    # ----------------------------------------------------------------------------------------------- internals

    def _launch(self, fragment: Fragment) -> None:
        start = self.overlap.round_start(fragment)
        moved = fragment.moved_from(start)
        moved_squared = fragment.record_drift(moved, start)
        delta = fragment.with_residual(moved)
        self.stats.pseudo_grad_norm = _norm(delta, moved_squared if fragment.residual is None else None)
        (self.elastic or self.store or self.fixed_group).launch(fragment, delta)

    def _sync_tail(self, fragment: Fragment, delta: torch.Tensor, scale: float = 1.0) -> None:
        if self.elastic is not None:
            self.elastic.tail(fragment, delta)
        else:
            self.fixed_group.tail(fragment, delta, scale)

    def _count_intra_worker_bytes(self, sent: int) -> None:
        self.stats.bytes_sent_intra_worker += sent

    def _count_outer_state(self) -> None:
        # An exchange's residual, and its average where no buffer of the pool holds it.
        residuals = 1 if self.config.error_feedback or self.config.lowrank_rank else 0
        averages = 0 if self.fragments and self.fragments[0].uses_buffers else 1
        self.stats.outer_state_bytes = outer_state_bytes(self.fragments, residuals + averages, self.buffers.tensors())


def _fragment_values(
    pieces: list[Piece],
    params: dict[str, nn.Parameter],
    model: nn.Module | None,
    granularity: int,
    worker: Worker,
) -> ReplicatedValues | ShardedValues:
    """How a fragment reads and writes its parameters: in FSDP shards of `model` when given, else replicated."""
    if model is not None:
        return ShardedValues(pieces, params, model, worker)
    return ReplicatedValues(pieces, params, granularity, worker)


def _make_fragment(
    config: DiLoCoConfig,
    index: int,
    pieces: list[Piece],
    params: dict[str, nn.Parameter],
    values: ReplicatedValues | ShardedValues,
    buffers: BufferPool,
    overlap: Overlap,
) -> Fragment:
    device = local_device(config.global_copy_device, params.values())  # "cuda": this process's own GPU
    make_optimizer = functools.partial(outer_optimizer, config)
    fragment = Fragment(index, pieces, params, device, make_optimizer, values, buffers=buffers)
    if config.lowrank_rank:  # the initial Q is seeded by the fragment index, the same on every worker
        fragment.compressor = LowRankCompressor(
            fragment.shapes,
            config.lowrank_rank,
            seed=index,
            track_energy=config.adaptive_compression,
            compression=config.compression,
        )
        if values.worker.size > 1:  # each matrix is factored by one data-parallel rank, which keeps its warm start
            assign_owners(fragment.compressor, values.layout, values.worker.index)
    overlap.prepare(fragment, make_optimizer)
    return fragment


def outer_optimizer(config: DiLoCoConfig, tensor: torch.Tensor) -> torch.optim.Optimizer:
    """One fragment's outer optimizer: SGD with the configured (Nesterov) momentum, and the outer learning rate's
    schedule where one is set (`outer_schedule.py`)."""
    momentum = config.outer_momentum
    nesterov = config.outer_nesterov and momentum > 0
    optimizer = torch.optim.SGD([tensor], lr=config.outer_lr, momentum=momentum, nesterov=nesterov)
    scheduled(optimizer, config.outer_schedule(), config.outer_lr)
    return optimizer


def fragment_metrics(config: DiLoCoConfig, fragments: Sequence[Fragment], inner_step: int) -> dict[str, float]:
    """The drift, the inner step and, with an outer schedule, the rate fragment 0's next outer step uses."""
    logs = {"diloco/local_global_drift": relative_drift(fragments), "diloco/inner_step": float(inner_step)}
    if config.outer_schedule() is not None:
        logs["diloco/outer_lr"] = learning_rate_now(fragments[0].outer_optimizer, fragments[0].theta_g)
    return logs


def whole_parameters(fragments: Sequence[Fragment]) -> dict[str, torch.Tensor]:
    """Each fragment's whole θg by parameter name (a parameter cut by rows into pieces is concatenated)."""
    rows: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for fragment in fragments:
        for piece, values in fragment.unflatten(fragment.whole(fragment.theta_g)):
            rows.setdefault(piece.name, []).append((piece.start, values))
    return {
        name: parts[0][1] if len(parts) == 1 else torch.cat([v for _, v in sorted(parts, key=lambda p: p[0])])
        for name, parts in rows.items()
    }


def relative_drift(fragments: Sequence[Fragment]) -> float:
    """||θm - θg|| / ||θg|| over the fragments, each as measured at its last launch (`Fragment.record_drift`)."""
    measured = [fragment.drift for fragment in fragments if fragment.drift is not None]
    squared_diff = sum(difference for difference, _ in measured)
    squared_norm = sum(norm for _, norm in measured)
    return (squared_diff / squared_norm) ** 0.5 if squared_norm > 0 else 0.0


def _norm(delta: torch.Tensor, squared: float | None) -> float:
    """||delta||, from its squared norm where that is known already (the drift's ||moved||², when delta is `moved`)."""
    return math.sqrt(squared) if squared is not None else float(delta.norm())


def _flights_changed(fragments: Sequence[Fragment], before: list[InFlight | None]) -> bool:
    """Whether an exchange was applied or launched since `before`: only then does the outer state change between
    steps (counting it reads every held tensor, which a step between rounds should not pay for)."""
    return any(fragment.flight is not flight for fragment, flight in zip(fragments, before))


def _step_after_close(inner_step: int) -> RuntimeError:
    return RuntimeError(
        f"DiLoCo.step() after close() (at inner step {inner_step}): close() ran the final syncs and the exchange is "
        "shut down, so this step would not be synced. Call close() once, after the last step; to train further build "
        "a new DiLoCo (resuming from its state_dict or a checkpoint)."
    )


def check_store_given(
    config: DiLoCoConfig, store: ObjectStore | None, membership: Membership | None, opening: bool = False
) -> None:
    """`exchange: store` and a store go together, and a store job has no membership (the store decides rounds);
    `opening`: the store is opened later from `store_url` (check the rest before any work)."""
    if config.exchange == "store" and store is None and not opening:
        raise ValueError(
            f"exchange 'store' needs the store: DiLoCo(..., store=hf_diloco.open_store({config.store_url!r})) "
            "(DiLoCoTrainer, DiLoCoPlugin and hf-diloco pretrain open it from store_url themselves)."
        )
    if config.exchange == "store":
        JobKeys(job_secret(), insecure=config.insecure_no_secret)  # no secret: refused now, before any work
    if config.exchange == "store" and not config.site:
        raise ValueError(
            "exchange 'store' needs site: this site's name, unique in the job (e.g. its host name): --site NAME, or "
            "site: in the config's diloco: section of each site."
        )
    if store is not None and config.exchange != "store":
        raise ValueError("a store was given but exchange is 'process_group': set exchange: store and store_url.")
    if store is not None and membership is not None:
        raise ValueError("exchange 'store' takes no membership: the store decides who contributed to each round.")


def check_elastic_supported(
    config: DiLoCoConfig, topology: Topology | None, membership: Membership | None = None
) -> None:
    """Refuse, before anything starts, what elastic membership does not run (docs/design.md says why). A site is one
    process, or the S x D ranks (pipeline stages, data-parallel ranks: DDP or FSDP2) of a `topology` of one worker."""
    refused = one_site_refusals(config, topology)
    ranks = config.data_parallel_per_worker * config.pipeline_stages
    if membership is None:  # a store job: the store decides rounds, the sites need nothing more of each other
        refuse_unsupported("A store job runs sites of one process or of one worker's ranks", refused,
                           "launch each site on its own")  # fmt: skip
        return
    site_size = getattr(membership, "site_size", 1)
    if site_size != ranks:
        refused.append(
            f"a membership of site_size {site_size} for {ranks} rank(s) per site (give TorchftMembership "
            f"site_size={ranks} and this rank's site_rank)"
        )
    if ranks > 1 and config.round_policy != "steps":
        refused.append(f"round_policy {config.round_policy} on a site of {ranks} ranks (use round_policy steps)")
    if config.lowrank_rank or config.adaptive_compression:
        refused.append("low-rank or adaptive compression")
    refuse_unsupported(
        "Elastic membership runs among sites of one process or of one worker's ranks",
        refused,
        "run without elastic membership",
    )


def one_site_refusals(config: DiLoCoConfig, topology: Topology | None) -> list[str]:
    """What makes a launch more or less than one site (of one process, or of one worker's S x D ranks)."""
    refused = []
    dp, ranks = config.data_parallel_per_worker, config.data_parallel_per_worker * config.pipeline_stages
    if topology is not None and topology.num_workers > 1:
        refused.append(
            f"a fixed topology of {topology.num_workers} workers (one launch is one site: pipeline_stages x "
            "data_parallel_per_worker must be its number of processes)"
        )
    if ranks > 1 and (topology is None or topology.layout.worker_size != ranks):
        refused.append(
            f"{ranks} ranks per site without the site's topology (pass Topology.from_default_group("
            f"{config.pipeline_stages}, {dp}) over the site's {ranks} ranks)"
        )
    return refused


def _make_exchange(topology: Topology, config: DiLoCoConfig) -> OuterExchange:
    """The outer exchange, with the adaptive compression policy when `adaptive_compression` is on."""
    exchange = OuterExchange(
        topology,
        make_codec(
            config.compression, config.compression_block_size, config.compression_scale_dtype, config.topk_density
        ),
        config.sync_timeout_seconds,
        keep_residual=config.error_feedback,
        clip_factor=config.robust_clip_factor,
        entropy_coding=config.entropy_coding,
        pattern=config.exchange_pattern,
    )
    if config.adaptive_compression:
        exchange.policy = WindowEnergyPolicy(
            config.lowrank_rank,
            config.lowrank_min_rank,
            policy_compressions(config.compression),
            config.adaptive_energy_threshold,
            dense=config.adaptive_dense,
        )
        exchange.codec_factory = functools.partial(
            make_codec, block_size=config.compression_block_size, scale_dtype=config.compression_scale_dtype
        )
        exchange.assumed_link_bytes_per_second = config.adaptive_link_bytes_per_second or None
    return exchange
