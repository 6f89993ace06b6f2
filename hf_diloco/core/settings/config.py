"""`DiLoCoConfig`: every knob of the DiLoCo family, with help text, validation, YAML and environment loading.

Defaults follow the papers: H = 100 inner steps, outer Nesterov SGD with lr 0.7 and momentum 0.9
(DiLoCo, Douillard et al. 2023, arXiv 2311.08105), strided fragments and alpha = 0.5 merging
(Streaming DiLoCo, Douillard et al. 2025, arXiv 2501.18512).

Where a run's values come from: `DiLoCoConfig.from_yaml` (a YAML file), and `DiLoCoConfig.layered_fields`, which
stacks keyword arguments > `DILOCO_*` environment variables > a YAML file > the defaults and records the source of
each value (what `DiLoCoPlugin` uses). Both refuse a key or variable that names no field, suggesting the closest one;
`check_known_keys` does the same for any other mapping the package reads.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import math
import typing
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..compression.codecs import COMPRESSIONS, check_topk_density
from .outer_schedule import OUTER_LR_SCHEDULES, OuterLrSchedule

ENV_PREFIX = "DILOCO_"
FRAGMENT_PATTERNS = ("strided", "sequential", "balanced")
OVERLAP_MODES = ("streaming", "delayed", "eager")
ROUND_POLICIES = ("steps", "balanced")
EAGER_ESTIMATES = ("own_share", "fitted")
EXCHANGE_PATTERNS = ("reduce_scatter", "all_gather")
SCALE_DTYPES = ("fp32", "bf16")
PIPELINE_SCHEDULES = ("1f1b", "gpipe")
EXCHANGES = ("process_group", "store")
# Where the sites of an elastic job may differ (each names itself and its address): left out of the fingerprint.
MEMBERSHIP_FIELDS = (
    "lighthouse",
    "site",
    "site_host",
    "min_workers",
    "start_workers",
    "min_workers_timeout",
    "membership_sync_timeout",
)
# Where the sites of a store job may differ: how each reaches the store and how long it waits for it.
STORE_LOCAL_FIELDS = ("store_url", "store_timeout_seconds")


# Settings each node may choose for itself (where theta_g lives, how long it waits for peers, its site's membership).
LOCAL_ONLY_FIELDS = frozenset({"global_copy_device", "sync_timeout_seconds", *MEMBERSHIP_FIELDS, *STORE_LOCAL_FIELDS})


def refuse_unsupported(what_runs: str, refused: list[str], way_out: str) -> None:
    """One ValueError naming every setting in `refused` that `what_runs` does not run with, and the way out."""
    if refused:
        raise ValueError(
            f"{what_runs}; not supported: " + "; ".join(refused) + f". Change these settings, or {way_out}."
        )


@dataclass
class DiLoCoConfig:
    """
    Configuration of the DiLoCo outer loop.

    Outer loop:
        inner_steps (`int`): H, inner optimizer steps between two syncs of the same fragment.
        outer_lr (`float`): learning rate of the outer SGD applied to the averaged pseudo-gradient.
        outer_momentum (`float`): momentum of the outer SGD.
        outer_nesterov (`bool`): Nesterov momentum for the outer SGD.
        outer_lr_schedule (`str`): `constant`, `cosine` or `linear`: the outer learning rate over the run's rounds,
            per fragment, decaying to `outer_lr_final_fraction` x `outer_lr` at the last round (`outer_schedule.py`).
        outer_lr_warmup_rounds (`int`): rounds of linear warmup of the outer learning rate (0: none).
        outer_lr_final_fraction (`float`): the decayed schedules' factor at the last round.
        outer_lr_total_rounds (`int`): R, the rounds the schedule spans; 0: the front-ends take the run's
            max_steps / inner_steps (the engine alone needs it set).
        round_policy (`str`): `steps` (every worker runs H inner steps per round) or `balanced` (each worker as many
            as its measured speed allows, the fastest H, so that all reach the exchange together; the average is
            weighted by the steps each trained: `round_policy.py`).

    Streaming (fragments and overlap):
        num_fragments (`int`): P, fragments of the block stack synced one at a time, every H/P steps.
        fragment_pattern (`str`): `strided` (block i -> fragment i mod P), `sequential` (contiguous runs) or
            `balanced` (every fragment 1/P of the model: matrices outside the stack cut into P row pieces, each
            block to the smallest fragment so far).
        sync_delay (`int`): tau, inner steps between launching a fragment's exchange and applying it.
        merge_alpha (`float`): alpha in `local <- alpha * local + (1 - alpha) * global` when tau > 0.
        overlap (`str`): `streaming` (tau-step overlap), `delayed` (one-round delay) or `eager`.
        eager_estimate (`str`): what `eager` applies for the round until its average arrives: `own_share` (Kale et
            al.: this worker's pseudo-gradient / M) or `fitted` (w x this worker's pseudo-gradient, w fitted on the
            last round that arrived).

    Compression:
        compression (`str`): codec for the exchanged pseudo-gradient.
        compression_block_size (`int`): elements per absmax scale block.
        compression_scale_dtype (`str`): dtype of the per-block scales.
        topk_density (`float`): with `compression: topk`, the share of each 4096-value chunk sent (its largest).
        error_feedback (`bool`): add what quantization dropped to the next pseudo-gradient.
        error_feedback_decay (`float`): β in (0, 1], what the kept residual is multiplied by before it is added.
        entropy_coding (`bool`): deflate the encoded payload before it crosses workers (lossless, fewer bytes).
        exchange_pattern (`str`): `reduce_scatter` (quantize, average, requantize, all-gather) or `all_gather`
            (every worker's quantized vector to every worker: one quantization, same bytes for 2 workers).

    Low-rank and adaptive compression (DiLoCoX):
        lowrank_rank (`int`): PowerSGD rank of the 2-D pseudo-gradients (0 = off); the largest rank when adaptive.
        lowrank_min_rank (`int`): the smallest rank the adaptive policy may pick.
        adaptive_compression (`bool`): let a policy pick rank and codec each sync (`compression` is the fewest bits).
        adaptive_energy_threshold (`float`): share of the pseudo-gradient's energy the chosen rank should capture.
        adaptive_link_bytes_per_second (`float`): assumed cross-worker throughput (0 = measure it).
        adaptive_dense (`bool`): the policy may also send a fragment without factorisation.

    Topology:
        pipeline_stages (`int`): pipeline stages inside one worker.
        data_parallel_per_worker (`int`): data-parallel replicas inside one worker (GPUs per node).
        pipeline_schedule (`str`): micro-batch schedule of the pipeline, `1f1b` or `gpipe`.
        pipeline_microbatches (`int`): micro-batches each batch is split into for the pipeline.

    Robustness:
        robust_clip_factor (`float`): clip a worker's pseudo-gradient norm to this multiple of the lower median norm
            (on by default; 0 = off).
        divergence_factor (`float`): skip a round whose average's norm exceeds this multiple of the median norm of the
            fragment's last applied rounds (0 = off).
        first_round_factor (`float`): skip a round without a history (a fragment's first) whose average's largest
            absolute value exceeds this multiple of theta_g's own (0 = off).
        max_skipped_rounds (`int`): stop with an error when this many rounds of one fragment in a row are skipped
            (non-finite or divergent averages; 0 = never stop).

    Runtime:
        global_copy_device (`str`): where the fp32 global copy and outer optimizer state live.
        sync_timeout_seconds (`float`): how long any collective of the engine may wait for a peer before it fails.
    """

    inner_steps: int = field(default=100, metadata={"help": "H: inner optimizer steps per outer round."})
    outer_lr: float = field(default=0.7, metadata={"help": "Learning rate of the outer (Nesterov) SGD."})
    outer_momentum: float = field(default=0.9, metadata={"help": "Momentum of the outer SGD."})
    outer_nesterov: bool = field(default=True, metadata={"help": "Use Nesterov momentum in the outer SGD."})
    outer_lr_schedule: str = field(
        default="constant",
        metadata={
            "help": "The outer learning rate over the run, per fragment: constant, or cosine / linear decay to "
            "outer_lr_final_fraction x outer_lr at the last round."
        },
    )
    outer_lr_warmup_rounds: int = field(
        default=0, metadata={"help": "Outer rounds of linear warmup of the outer learning rate (0: none)."}
    )
    outer_lr_final_fraction: float = field(
        default=0.1, metadata={"help": "Cosine / linear outer schedule: the factor on outer_lr at the last round."}
    )
    outer_lr_total_rounds: int = field(
        default=0,
        metadata={
            "help": "Rounds the outer schedule spans; 0: max_steps / inner_steps of the run (the Trainer, the main "
            "job and a plugin given max_steps fill it in)."
        },
    )
    round_policy: str = field(
        default="steps",
        metadata={
            "help": "steps: every worker runs inner_steps per round; balanced: each worker's steps per round follow "
            "its measured speed (the fastest runs inner_steps) so no site waits for a slower one, and the average is "
            "weighted by the steps each worker trained.",
            "choices": list(ROUND_POLICIES),
        },
    )
    num_fragments: int = field(
        default=1, metadata={"help": "P: fragments of the block stack, synced one every H/P steps. 1 = DiLoCo."}
    )
    fragment_pattern: str = field(
        default="strided",
        metadata={
            "help": "How blocks map to fragments: strided (block i -> i mod P), sequential (contiguous runs) or "
            "balanced (every fragment 1/P of the model: embeddings and an untied head cut into P row pieces, each "
            "block to the smallest fragment so far).",
            "choices": list(FRAGMENT_PATTERNS),
        },
    )
    sync_delay: int = field(
        default=0, metadata={"help": "tau: inner steps between a fragment's launch and its apply (< H/P)."}
    )
    merge_alpha: float = field(
        default=0.5, metadata={"help": "alpha: weight of the local parameters when merging with tau > 0."}
    )
    overlap: str = field(
        default="streaming",
        metadata={"help": "Overlap mode of the outer sync.", "choices": list(OVERLAP_MODES)},
    )
    eager_estimate: str = field(
        default="own_share",
        metadata={
            "help": "What overlap=eager applies for a round until its average arrives a round later (then the "
            "difference is corrected): own_share (Kale et al.: this worker's pseudo-gradient / M) or fitted (w x this "
            "worker's pseudo-gradient, w in [1/M, 1] the least-squares fit of the last average that arrived on this "
            "worker's own pseudo-gradient of that round: how much of the average its own progress explains).",
            "choices": list(EAGER_ESTIMATES),
        },
    )
    compression: str = field(
        default="none",
        metadata={"help": "Codec of the exchanged pseudo-gradient.", "choices": list(COMPRESSIONS)},
    )
    compression_block_size: int = field(
        default=128,
        metadata={"help": "Elements per scale block of the quantizing codecs (even; a multiple of 8 for sign)."},
    )
    compression_scale_dtype: str = field(
        default="fp32",
        metadata={"help": "dtype of the per-block scales.", "choices": list(SCALE_DTYPES)},
    )
    topk_density: float = field(
        default=1 / 64,
        metadata={
            "help": "With compression topk: the share of values sent, the largest of every 4096-value chunk (rounded "
            "to a multiple of 4 per chunk); needs error_feedback: true and exchange_pattern: all_gather."
        },
    )
    error_feedback: bool = field(
        default=False, metadata={"help": "Carry the quantization residual into the next pseudo-gradient."}
    )
    error_feedback_decay: float = field(
        default=1.0,
        metadata={
            "help": "beta in (0, 1]: with error_feedback, the kept residual is multiplied by beta before it is added "
            "to the next pseudo-gradient (SparseLoCo: e <- beta e + delta; send Q(e); e <- e - Q(e)). 1 keeps all of "
            "it."
        },
    )
    entropy_coding: bool = field(
        default=False,
        metadata={
            "help": "Deflate (zlib level 1) each encoded payload before it crosses workers and send it when that is "
            "shorter. Lossless: the same bits arrive. fp4 pseudo-gradients shrink by about 15 percent; deflate runs "
            "~25 MB/s per core, in up to 8 threads."
        },
    )
    exchange_pattern: str = field(
        default="reduce_scatter",
        metadata={
            "help": "How workers average: reduce_scatter (quantized chunks to their owners, averaged, requantized, "
            "all-gathered: 2(M-1)/M of a payload per rank) or all_gather (every worker's quantized vector to every "
            "worker, summed in fp32: one quantization instead of two, (M-1) payloads per rank, the same bytes for "
            "M=2).",
            "choices": list(EXCHANGE_PATTERNS),
        },
    )
    lowrank_rank: int = field(
        default=0,
        metadata={
            "help": "PowerSGD rank of the 2-D pseudo-gradients before quantization, with error feedback (0 = off). "
            "With adaptive_compression, the largest rank."
        },
    )
    lowrank_min_rank: int = field(
        default=1, metadata={"help": "Smallest rank adaptive_compression may pick (<= lowrank_rank)."}
    )
    adaptive_compression: bool = field(
        default=False,
        metadata={
            "help": "Pick rank and codec each sync: the most accurate setting whose exchange fits the compute it "
            "overlaps; the rank shrinks as the energy concentrates. `compression` is the fewest bits allowed."
        },
    )
    adaptive_energy_threshold: float = field(
        default=0.9, metadata={"help": "Share of the pseudo-gradient energy the adaptive rank should capture."}
    )
    adaptive_link_bytes_per_second: float = field(
        default=0.0,
        metadata={"help": "Cross-worker throughput the adaptive policy assumes (0 = measure it on each exchange)."},
    )
    adaptive_dense: bool = field(
        default=False,
        metadata={
            "help": "Let the adaptive policy also send a fragment without low-rank factorisation (rank 0): the most "
            "accurate choice whenever it fits the window; what small or full-rank matrices need."
        },
    )
    pipeline_stages: int = field(default=1, metadata={"help": "Pipeline stages inside one worker."})
    data_parallel_per_worker: int = field(
        default=1, metadata={"help": "Data-parallel replicas inside one worker (e.g. GPUs per node)."}
    )
    pipeline_schedule: str = field(
        default="1f1b",
        metadata={"help": "Micro-batch schedule when pipeline_stages > 1.", "choices": list(PIPELINE_SCHEDULES)},
    )
    pipeline_microbatches: int = field(
        default=2,
        metadata={"help": "Micro-batches per batch when pipeline_stages > 1 (1f1b needs >= pipeline_stages)."},
    )
    robust_clip_factor: float = field(
        default=5.0,
        metadata={
            "help": "Robust aggregation, on by default: scale down a worker's pseudo-gradient whose norm exceeds this "
            "factor times the lower median norm of the contributing workers (with two, the smaller; a worker that "
            "joined during the round is left out), and name it. 0 = off."
        },
    )
    divergence_factor: float = field(
        default=100.0,
        metadata={
            "help": "Divergence guard: skip (on every worker alike) a round whose averaged pseudo-gradient has a norm "
            "above this factor times the median norm of the fragment's last 5 applied rounds, and warn. 0 = off."
        },
    )
    first_round_factor: float = field(
        default=10.0,
        metadata={
            "help": "Divergence guard for a round without a history (a fragment's first): skip it when its averaged "
            "pseudo-gradient's largest absolute value exceeds this factor times theta_g's own largest absolute "
            "value (one worker's garbage weights before the first exchange). 0 = off."
        },
    )
    max_skipped_rounds: int = field(
        default=3,
        metadata={
            "help": "Stop with an error when this many rounds of one fragment in a row were skipped (non-finite or "
            "divergent averages). 0 = never stop."
        },
    )
    global_copy_device: str = field(
        default="cpu",
        metadata={
            "help": "Device of the fp32 global copy and outer optimizer state (`cuda` without an index: this "
            "process's own GPU, the one its parameters are on)."
        },
    )
    sync_timeout_seconds: float = field(
        default=1800.0,
        metadata={
            "help": "Seconds any collective of the engine (start-up check, initial broadcast, outer exchanges, the "
            "final syncs of close()) may wait for a peer before it fails with an error naming the point and the peers."
        },
    )

    # Elastic membership (torchft): with `lighthouse` set, every exchange runs among the sites present at that moment.
    lighthouse: str = field(
        default="",
        metadata={
            "help": "The torchft Lighthouse's address, http://host:port: run elastic, each site launched on its own "
            "(one process, or one worker's pipeline_stages x data_parallel_per_worker ranks). Empty: a fixed "
            "membership (every process of the launch)."
        },
    )
    site: str = field(default="", metadata={"help": "This site's name, unique in the elastic job (its replica id)."})
    site_host: str = field(
        default="",
        metadata={
            "help": "The address the other sites reach this one at, where its servers listen (empty: 127.0.0.1, "
            "this machine only)."
        },
    )
    min_workers: int = field(default=1, metadata={"help": "Elastic: the fewest sites an exchange runs with."})
    start_workers: int = field(default=1, metadata={"help": "Elastic: the sites the first exchange waits for."})
    min_workers_timeout: float = field(
        default=300.0, metadata={"help": "Elastic: seconds to wait for min_workers / start_workers sites."}
    )
    membership_sync_timeout: float = field(
        default=60.0,
        metadata={"help": "Elastic: seconds one exchange or heal may wait for a site before dropping it."},
    )

    # The exchange through an object store: sites that share no network, only a bucket (core/store/).
    exchange: str = field(
        default="process_group",
        metadata={
            "help": "How the sites exchange: 'process_group' (torch.distributed collectives among workers that reach "
            "each other) or 'store' (through an object store every site can read and write: store_url; no open port, "
            "no Lighthouse, rounds closed by quorum within a grace window)."
        },
    )
    store_url: str = field(
        default="",
        metadata={
            "help": "exchange 'store': where the job's objects live, e.g. file:///shared/job, s3://bucket/prefix "
            "(AWS_ENDPOINT_URL for R2, MinIO or any S3-compatible server), hf://buckets/owner/name/prefix, gs://, "
            "az://. Credentials come from each store's usual environment variables, never from a flag."
        },
    )
    quorum: int = field(
        default=1,
        metadata={"help": "exchange 'store': contributions of this many sites close a round once grace_seconds pass."},
    )
    grace_seconds: float = field(
        default=10.0,
        metadata={
            "help": "exchange 'store': how long a round stays open after its quorum for the sites a little behind "
            "(with adaptive_grace: the most it may stay open)."
        },
    )
    adaptive_grace: bool = field(
        default=False,
        metadata={
            "help": "exchange 'store': the grace window follows how late the other sites came in the last rounds "
            "(1.5 x their 90th percentile), at most grace_seconds."
        },
    )
    round_deadline_seconds: float = field(
        default=600.0,
        metadata={"help": "exchange 'store': a round closes with whatever is in after this long, quorum or not."},
    )
    max_staleness: int = field(
        default=2,
        metadata={
            "help": "exchange 'store': a contribution that missed its round enters a later one, weighted by "
            "tokens / (1 + rounds late), up to this many rounds late."
        },
    )
    snapshot_every: int = field(
        default=10,
        metadata={
            "help": "exchange 'store': every this many rounds the site that closed the round writes theta_g and the "
            "outer state, from which a late or restarted site joins."
        },
    )
    store_timeout_seconds: float = field(
        default=300.0,
        metadata={
            "help": "exchange 'store': how long one store request may keep failing (retried with backoff) before "
            "the run stops with an error naming the store."
        },
    )
    insecure_no_secret: bool = field(
        default=False,
        metadata={
            "help": "Run sites (exchange: store, or lighthouse) without the job's secret (HF_DILOCO_JOB_SECRET_FILE / "
            "HF_DILOCO_JOB_SECRET): store objects and peers are then not authenticated, and whoever reaches the "
            "Lighthouse and a site can join. Only for a store or network nobody else can reach."
        },
    )

    def __post_init__(self) -> None:
        self.validate_diloco()

    def _check_topk(self) -> None:
        """`topk` drops most of each pseudo-gradient: it needs the residual carried over, and one encode only."""
        if not self.error_feedback:
            raise ValueError(
                "compression 'topk' needs error_feedback: true (the values it does not send are carried into the "
                "next round instead of being lost)."
            )
        if self.exchange_pattern != "all_gather":
            raise ValueError(
                "compression 'topk' needs exchange_pattern: all_gather (reduce_scatter would sparsify the average "
                "again, dropping values no worker keeps)."
            )
        if self.lowrank_rank or self.adaptive_compression:
            raise ValueError("compression 'topk' cannot be combined with lowrank_rank or adaptive_compression.")

    def outer_schedule(self) -> OuterLrSchedule | None:
        """The outer learning rate's schedule; None when it is `outer_lr` throughout (constant, no warmup)."""
        if self.outer_lr_schedule == "constant" and not self.outer_lr_warmup_rounds:
            return None
        if self.outer_lr_schedule != "constant" and not self.outer_lr_total_rounds:
            raise ValueError(
                f"outer_lr_schedule '{self.outer_lr_schedule}' needs outer_lr_total_rounds, the rounds it decays "
                "over: set it (max_steps / inner_steps of your run), or pass max_steps to the front-end (the "
                "Trainer, hf-diloco pretrain and DiLoCoPlugin.prepare(..., max_steps=...) fill it in)."
            )
        return OuterLrSchedule(
            self.outer_lr_schedule,
            self.outer_lr_total_rounds,
            self.outer_lr_warmup_rounds,
            self.outer_lr_final_fraction,
        )

    def with_outer_schedule_length(self, total_steps: int) -> DiLoCoConfig:
        """This config with `outer_lr_total_rounds` taken from a run of `total_steps` inner steps where a decaying
        schedule leaves it at 0 (and the run's length is known)."""
        if self.outer_lr_schedule == "constant" or self.outer_lr_total_rounds or total_steps <= 0:
            return self
        return dataclasses.replace(self, outer_lr_total_rounds=max(1, total_steps // self.inner_steps))

    def validate_diloco(self) -> None:
        """Raise `ValueError` naming the first invalid field."""
        _check_int("inner_steps", self.inner_steps, minimum=1)
        _check_int("num_fragments", self.num_fragments, minimum=1)
        _check_int("sync_delay", self.sync_delay, minimum=0)
        _check_int("compression_block_size", self.compression_block_size, minimum=2)
        _check_int("lowrank_rank", self.lowrank_rank, minimum=0)
        _check_int("lowrank_min_rank", self.lowrank_min_rank, minimum=1)
        _check_float("adaptive_energy_threshold", self.adaptive_energy_threshold, low=0.0, high=1.0, low_open=True)
        _check_float("adaptive_link_bytes_per_second", self.adaptive_link_bytes_per_second, low=0.0)
        for name in ("outer_nesterov", "error_feedback", "entropy_coding", "adaptive_compression", "adaptive_dense"):
            _check_bool(name, getattr(self, name))
        if self.lowrank_rank and self.lowrank_min_rank > self.lowrank_rank:
            raise ValueError(
                f"lowrank_min_rank ({self.lowrank_min_rank}) must be <= lowrank_rank ({self.lowrank_rank})."
            )
        if self.adaptive_dense and not self.adaptive_compression:
            raise ValueError(
                "adaptive_dense only applies with adaptive_compression: true (it widens the policy's choices)."
            )
        if self.adaptive_compression and not self.lowrank_rank:
            raise ValueError("adaptive_compression needs lowrank_rank >= 1 (the largest rank the policy may pick).")
        _check_int("pipeline_stages", self.pipeline_stages, minimum=1)
        _check_int("data_parallel_per_worker", self.data_parallel_per_worker, minimum=1)
        _check_int("pipeline_microbatches", self.pipeline_microbatches, minimum=1)
        _check_choice("pipeline_schedule", self.pipeline_schedule, PIPELINE_SCHEDULES)
        _check_choice("round_policy", self.round_policy, ROUND_POLICIES)
        if (
            self.pipeline_stages > 1
            and self.pipeline_schedule == "1f1b"
            and self.pipeline_microbatches < self.pipeline_stages
        ):
            raise ValueError(
                f"pipeline_microbatches ({self.pipeline_microbatches}) must be >= pipeline_stages "
                f"({self.pipeline_stages}) with pipeline_schedule='1f1b'; raise it or use 'gpipe'."
            )
        _check_float("outer_lr", self.outer_lr, low=0.0)
        _check_choice("outer_lr_schedule", self.outer_lr_schedule, OUTER_LR_SCHEDULES)
        _check_int("outer_lr_warmup_rounds", self.outer_lr_warmup_rounds, minimum=0)
        _check_int("outer_lr_total_rounds", self.outer_lr_total_rounds, minimum=0)
        _check_float("outer_lr_final_fraction", self.outer_lr_final_fraction, low=0.0, high=1.0)
        _check_float("outer_momentum", self.outer_momentum, low=0.0, high=1.0, high_open=True)
        _check_float("error_feedback_decay", self.error_feedback_decay, low=0.0, high=1.0, low_open=True)
        _check_float("merge_alpha", self.merge_alpha, low=0.0, high=1.0)
        _check_float("sync_timeout_seconds", self.sync_timeout_seconds, low=0.0, low_open=True)
        _check_float("robust_clip_factor", self.robust_clip_factor, low=0.0)
        _check_float("divergence_factor", self.divergence_factor, low=0.0)
        _check_float("first_round_factor", self.first_round_factor, low=0.0)
        if 0 < self.divergence_factor <= 1:
            raise ValueError(
                f"divergence_factor must be 0 (off) or > 1, got {self.divergence_factor}: at or below 1 a healthy "
                "round no larger than the recent ones could be skipped."
            )
        _check_int("max_skipped_rounds", self.max_skipped_rounds, minimum=0)
        if 0 < self.robust_clip_factor < 1:
            raise ValueError(
                f"robust_clip_factor must be 0 (off) or >= 1, got {self.robust_clip_factor}: below 1 even the median "
                "worker would be scaled down."
            )
        _check_choice("fragment_pattern", self.fragment_pattern, FRAGMENT_PATTERNS)
        _check_choice("overlap", self.overlap, OVERLAP_MODES)
        _check_choice("eager_estimate", self.eager_estimate, EAGER_ESTIMATES)
        if self.eager_estimate != "own_share" and self.overlap != "eager":
            raise ValueError(
                f"eager_estimate='{self.eager_estimate}' only applies with overlap='eager' (got overlap="
                f"'{self.overlap}'); set overlap: eager or leave eager_estimate at own_share."
            )
        _check_choice("compression", self.compression, COMPRESSIONS)
        _check_choice("exchange_pattern", self.exchange_pattern, EXCHANGE_PATTERNS)
        _check_choice("compression_scale_dtype", self.compression_scale_dtype, SCALE_DTYPES)
        if self.compression_block_size % 2:
            raise ValueError(
                f"compression_block_size must be even (fp4 packs two values per byte), got {self.compression_block_size}."
            )
        check_topk_density(self.topk_density)
        if self.compression == "topk":
            self._check_topk()
        if self.compression == "sign" and self.compression_block_size % 8:
            raise ValueError(
                "compression_block_size must be a multiple of 8 with compression 'sign' (eight values per byte), "
                f"got {self.compression_block_size}."
            )
        if self.inner_steps % self.num_fragments:
            raise ValueError(
                f"inner_steps ({self.inner_steps}) must be divisible by num_fragments ({self.num_fragments}): "
                "one fragment is synced every inner_steps / num_fragments steps."
            )
        if self.overlap == "streaming" and self.sync_delay >= self.inner_steps // self.num_fragments:
            raise ValueError(
                f"sync_delay ({self.sync_delay}) must be smaller than inner_steps / num_fragments "
                f"({self.inner_steps // self.num_fragments}) so a fragment's exchange is applied before the next "
                "fragment is launched."
            )
        if self.overlap in ("delayed", "eager") and self.sync_delay != 0:
            raise ValueError(
                f"sync_delay must be 0 with overlap='{self.overlap}': that mode applies each exchange one whole round "
                "later by itself."
            )
        if self.round_policy == "balanced":
            self._check_balanced()
        if not str(self.global_copy_device):
            raise ValueError("global_copy_device must name a device, e.g. 'cpu'.")
        self._validate_membership()
        self._validate_store()

    def _validate_store(self) -> None:
        _check_choice("exchange", self.exchange, EXCHANGES)
        _check_int("quorum", self.quorum, minimum=1)
        _check_int("max_staleness", self.max_staleness, minimum=0)
        _check_int("snapshot_every", self.snapshot_every, minimum=1)
        for name in ("grace_seconds", "round_deadline_seconds", "store_timeout_seconds"):
            _check_float(name, getattr(self, name), low=0.0, low_open=name != "grace_seconds")
        for name in ("adaptive_grace", "insecure_no_secret"):
            _check_bool(name, getattr(self, name))
        if not isinstance(self.store_url, str):
            raise ValueError(f"store_url must be a string, got {self.store_url!r}.")
        if self.exchange != "store":
            if self.store_url:
                raise ValueError(f"store_url ({self.store_url}) needs exchange: store; set it, or drop store_url.")
            return
        if not self.store_url or "://" not in self.store_url:
            raise ValueError(
                "exchange 'store' needs store_url: where the job's objects live, e.g. file:///shared/job, "
                f"s3://bucket/prefix or hf://buckets/owner/name/prefix (got {self.store_url!r})."
            )
        if self.lighthouse:
            raise ValueError("exchange 'store' needs no Lighthouse: drop lighthouse (the store decides each round).")
        refused = []
        if self.overlap != "streaming":
            refused.append(f"overlap '{self.overlap}' (its estimate assumes every worker in every round)")
        if self.round_policy != "steps":
            refused.append(f"round_policy '{self.round_policy}' (a store round never waits for a slow site anyway)")
        if self.lowrank_rank or self.adaptive_compression:
            refused.append("low-rank or adaptive compression (they need every worker in every factor's average)")
        if self.entropy_coding:  # a share's length is checked against its codec's before it is read
            refused.append("entropy_coding (a share is stored as its codec encodes it, never deflated)")
        refuse_unsupported(
            "exchange 'store' runs streaming rounds of any codec", refused, "use exchange: process_group"
        )

    def _check_balanced(self) -> None:
        refused = []
        if self.overlap != "streaming":
            refused.append(f"overlap '{self.overlap}' (its estimate and delay assume rounds of equal length)")
        if self.lowrank_rank or self.adaptive_compression:
            refused.append("low-rank or adaptive compression")
        refuse_unsupported(
            "round_policy 'balanced' runs with overlap 'streaming'",
            refused,
            "use round_policy: steps",
        )

    def _validate_membership(self) -> None:
        for name in ("lighthouse", "site", "site_host"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"{name} must be a string, got {getattr(self, name)!r}.")
        _check_int("min_workers", self.min_workers, minimum=1)
        _check_int("start_workers", self.start_workers, minimum=1)
        _check_float("min_workers_timeout", self.min_workers_timeout, low=0.0, low_open=True)
        _check_float("membership_sync_timeout", self.membership_sync_timeout, low=0.0, low_open=True)
        if not self.lighthouse:
            if self.site and self.exchange != "store":
                raise ValueError(
                    f"site ({self.site!r}) needs lighthouse (elastic sites) or exchange: store (sites through an object "
                    "store); set one, or drop site."
                )
            return
        if not self.lighthouse.startswith(("http://", "https://")) or "://" == self.lighthouse[-3:]:
            raise ValueError(
                f"lighthouse must be the Lighthouse's address, http://host:port; got {self.lighthouse!r}."
            )
        if not self.site.strip():
            raise ValueError(
                f"site must name this site (unique in the job, e.g. its host name) when lighthouse is set "
                f"({self.lighthouse})."
            )

    def diloco_dict(self) -> dict[str, Any]:
        """The DiLoCo fields only (also on subclasses that add many more fields)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(DiLoCoConfig)}

    def shared_settings(self) -> dict[str, Any]:
        """The fields every worker must agree on (everything but local runtime knobs), by name: what a checkpoint and
        a heal state store, so that a difference is named field by field (`settings_check`)."""
        return {k: v for k, v in self.diloco_dict().items() if k not in LOCAL_ONLY_FIELDS}

    def fingerprint(self) -> str:
        """A hash of `shared_settings`."""
        # Fields added after checkpoints were first written are hashed only when set away from their default, so an
        # older checkpoint (or worker) with the same settings keeps its fingerprint.
        added_later = {
            "entropy_coding": False,
            "exchange_pattern": "reduce_scatter",
            "adaptive_dense": False,
            "eager_estimate": "own_share",
            "divergence_factor": 100.0,
            "max_skipped_rounds": 3,
            "first_round_factor": 10.0,
            "topk_density": 1 / 64,
            "error_feedback_decay": 1.0,
            "round_policy": "steps",
            "outer_lr_schedule": "constant",
            "outer_lr_warmup_rounds": 0,
            "outer_lr_final_fraction": 0.1,
            "outer_lr_total_rounds": 0,
            "exchange": "process_group",
            "quorum": 1,
            "grace_seconds": 10.0,
            "adaptive_grace": False,
            "round_deadline_seconds": 600.0,
            "max_staleness": 2,
            "snapshot_every": 10,
            "insecure_no_secret": False,
        }
        shared = {k: v for k, v in self.shared_settings().items() if not (k in added_later and v == added_later[k])}
        return hashlib.sha256(json.dumps(shared, sort_keys=True).encode()).hexdigest()[:16]

    def short_run_warning(self, total_inner_steps: int) -> str | None:
        """A warning when the outer momentum remembers more outer rounds than half of the run has, else None.

        The outer momentum's memory is about 1 / (1 - outer_momentum) rounds (10 at the paper's 0.9). In a run with
        only a few outer rounds the early, large pseudo-gradients then keep pushing theta_g long after the inner
        learning rate has decayed; BENCHMARKS.md measures this on a small model (loss parity).
        """
        rounds = total_inner_steps // self.inner_steps
        memory = round(1.0 / (1.0 - self.outer_momentum), 6)  # 1 / (1 - 0.9) is 10.000000000000002
        if self.outer_momentum == 0 or rounds >= 2 * memory:
            return None
        return (
            f"outer_momentum={self.outer_momentum:g} remembers about {memory:.0f} outer rounds, but this run has only "
            f"{rounds} ({total_inner_steps} inner steps / inner_steps={self.inner_steps}). Short runs like this reached "
            "a lower loss with outer_momentum <= 0.5 (outer_lr 0.7-1.0) in BENCHMARKS.md (loss parity); the paper's "
            "0.9 suits runs of many more rounds."
        )

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides: Any) -> DiLoCoConfig:
        """Load the DiLoCo fields from a YAML file (its `diloco:` section if it has one, else the whole flat mapping).

        Raises:
            `ValueError`: the file is not a readable YAML mapping, a key names no field (the message names the key,
                the file and the closest field), or a value is invalid.
        """
        values = yaml_fields(path)
        values.update(overrides)
        return cls(**values)

    @classmethod
    def layered_fields(
        cls,
        arguments: Mapping[str, Any],
        environ: Mapping[str, str],
        yaml_file: str | Path | None = None,
    ) -> tuple[dict[str, Any], dict[str, str]]:
        """Every DiLoCo field's value from the first layer that sets it, and where it came from.

        Precedence: `arguments` (keyword arguments) > `DILOCO_<FIELD>` variables of `environ` > `yaml_file` > the
        field's default. Values are not validated here (validate the assembled config).

        Returns:
            `(values, sources)`: both keyed by field name; a source is `"argument"`, the variable's name, the YAML
            path or `"default"`.

        Raises:
            TypeError: an argument names no field.
            ValueError: a `DILOCO_*` variable names no field or does not parse as its field's type, or the YAML names
                no field (each message names the closest valid name).
        """
        fields = dataclasses.fields(DiLoCoConfig)
        unknown = set(arguments) - {f.name for f in fields}
        if unknown:
            names = [f.name for f in fields]
            raise TypeError(
                f"Unknown DiLoCo field(s): {_with_suggestions(sorted(unknown), names)}. The fields: {names}."
            )
        layers = [
            (arguments, lambda name: "argument"),
            (env_fields(environ), env_name),
            (yaml_fields(yaml_file) if yaml_file is not None else {}, lambda name: str(yaml_file)),
        ]
        values, sources = {}, {}
        for f in fields:
            values[f.name], sources[f.name] = f.default, "default"
            for layer, describe in layers:
                if f.name in layer:
                    values[f.name], sources[f.name] = layer[f.name], describe(f.name)
                    break
        return values, sources


def diloco_defaults() -> dict[str, Any]:
    """Each DiLoCo field's default (a field added after a state was written holds it there)."""
    return {f.name: f.default for f in dataclasses.fields(DiLoCoConfig) if f.default is not dataclasses.MISSING}


def diloco_field_names() -> list[str]:
    return [f.name for f in dataclasses.fields(DiLoCoConfig)]


def check_known_keys(given: Iterable[str], valid: Collection[str], where: str) -> None:
    """Raise `ValueError` when `given` holds a key not in `valid`, naming each such key, `where` it was found (e.g.
    `"configs/run.yaml (section diloco:)"`) and the closest valid key. Use it for every mapping a user writes."""
    unknown = [key for key in given if key not in valid]
    if unknown:
        raise ValueError(
            f"Unknown key(s) in {where}: {_with_suggestions(unknown, valid)}. Valid keys: {', '.join(valid)}."
        )


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key written twice in one mapping (PyYAML keeps the last one silently), so a
    second `inner_steps:` line or a second `training:` section is an error naming both lines. Keys brought in by a
    merge (`<<: *base`) may be overridden, as YAML intends."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        first_line: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                seen = first_line.get(key)
            except TypeError:  # an unhashable key: PyYAML's own check reports it
                continue
            if seen is not None:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"the key {key!r} is written twice (first at line {seen}); the second would silently replace "
                    "the first. Keep one",
                    key_node.start_mark,
                )
            first_line[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def load_yaml_strictly(text: str) -> Any:
    """`yaml.safe_load` that refuses duplicate keys (see `_StrictLoader`); raises `yaml.YAMLError`."""
    return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 -- a SafeLoader subclass


def describe_yaml_error(error: yaml.YAMLError, source: str) -> str:
    """`source is not valid YAML at line L, column C: problem. Fix the file and rerun.`"""
    mark = getattr(error, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    problem = getattr(error, "problem", None) or str(error).splitlines()[0]
    return f"{source} is not valid YAML{where}: {problem}. Fix the file and rerun."


def yaml_fields(path: str | Path) -> dict[str, Any]:
    """The DiLoCo fields a YAML file sets: its `diloco:` section if present, else the whole mapping; every key must
    be a field (`ValueError` naming the key, the file and the closest field)."""
    try:
        data = load_yaml_strictly(Path(path).read_text()) or {}
    except yaml.YAMLError as error:
        raise ValueError(describe_yaml_error(error, str(path))) from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of field names to values, got {type(data).__name__}.")
    section = "diloco" in data
    values = data["diloco"] if section else data
    if not isinstance(values, dict):
        raise ValueError(f"{path}: the diloco: section must be a mapping of field names to values.")
    check_known_keys(values, diloco_field_names(), f"{path}" + (" (section diloco:)" if section else ""))
    return dict(values)


def env_name(field_name: str) -> str:
    """The environment variable of a field: `DILOCO_` + its name in upper case."""
    return ENV_PREFIX + field_name.upper()


def env_fields(environ: Mapping[str, str]) -> dict[str, Any]:
    """The DiLoCo fields `DILOCO_*` variables set, parsed to their fields' types; an unknown `DILOCO_*` variable or
    a value that does not parse is a `ValueError` naming the variable (and the closest valid one)."""
    types = typing.get_type_hints(DiLoCoConfig)
    by_variable = {env_name(name): name for name in diloco_field_names()}
    check_known_keys(
        sorted(k for k in environ if k.startswith(ENV_PREFIX)), list(by_variable), "the DILOCO_* environment variables"
    )
    return {
        name: _parse_variable(variable, name, environ[variable], types[name])
        for variable, name in by_variable.items()
        if variable in environ
    }


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _parse_variable(variable: str, field_name: str, text: str, kind: type) -> Any:
    raw = text.strip()
    if kind is bool:
        if raw.lower() in _TRUE + _FALSE:
            return raw.lower() in _TRUE
        raise ValueError(f"{variable}={text!r}: field {field_name} is a boolean (true/false, 1/0, yes/no, on/off).")
    if kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            what = "an integer" if kind is int else "a number"
            raise ValueError(f"{variable}={text!r}: field {field_name} must be {what}.") from None
    return raw


def _with_suggestions(unknown: Iterable[str], valid: Collection[str]) -> str:
    """`'inner_stepz' (did you mean 'inner_steps'?), 'foo'`: each unknown key with the closest valid one, if any."""
    described = []
    for key in unknown:
        close = difflib.get_close_matches(str(key), [str(v) for v in valid], n=1)
        described.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return ", ".join(described)


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r}.")


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}.")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}.")


def _check_float(
    name: str,
    value: Any,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}.")
    if low is not None and (value < low or (low_open and value == low)):
        raise ValueError(f"{name} must be {'>' if low_open else '>='} {low}, got {value}.")
    if high is not None and (value > high or (high_open and value == high)):
        raise ValueError(f"{name} must be {'<' if high_open else '<='} {high}, got {value}.")


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}.")
