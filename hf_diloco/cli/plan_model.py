"""What `hf-diloco plan` decides, and the numbers it expects, each with its source (no model is built here).

From N parameters, M sites of D GPUs, the slowest site's link and a token budget:

- the step time: the GPUs' bf16 dense peak x an assumed MFU (`GPU_PEAK_FLOPS`), a given `--step_seconds`, or one
  measured on this machine (`plan.measure_step_seconds`);
- the scaling laws' inner learning rate, global batch, outer learning rate and warmup (`core.scaling_rules`);
- the codec, P, tau and H from `core.projection`'s measured model of one sync (bytes over the link at its measured
  efficiency, this repository's measured host CPU per GB, the compute a sync can hide behind): the first option, in
  order of preference, whose projected compute utilization reaches `TARGET_UTILIZATION`: the smallest H of
  `INNER_STEPS_CHOICES` (the paper's fits are at H = 30), then the codec (`none`, lossless; fp4 as the shipped
  `slow_link` config; fp4 with deflate, fewer bytes for more host CPU), then blocking DiLoCo before Streaming DiLoCo
  with P = 4, tau = 1 (the shipped `streaming_diloco` config); where none reaches it, the option that keeps most;
- `round_policy: balanced` when the sites' relative speeds differ.
"""

from __future__ import annotations

import dataclasses
import math
import re

from ..core.settings.projection import (
    LINK_EFFICIENCY_SOURCE,
    MEASURED_LINK_EFFICIENCY,
    MEASURED_STAGE_RATES,
    STAGE_RATES_SOURCE,
    host_seconds,
    inside_worker,
    sync_bytes,
    utilization,
)
from ..core.settings.scaling_rules import FITTED_INNER_STEPS, ScalingLawSettings, Setting, scaling_law_settings

# Dense bf16 tensor-core peak FLOP/s per GPU (no sparsity), from NVIDIA's datasheets.
GPU_PEAK_FLOPS = {"a100": 312e12, "h100": 989e12, "h200": 989e12, "l40s": 362e12}
GPU_SOURCE = "NVIDIA datasheet, dense bf16 peak"
DEFAULT_MFU = 0.4
MFU_SOURCE = "an assumed model FLOP utilization (typical of well-tuned LLM pretraining at this scale)"
INNER_STEPS_CHOICES = (30, 50, 100, 200, 500)
TARGET_UTILIZATION = 0.9
STREAMING_FRAGMENTS, STREAMING_DELAY = 4, 1
LAYOUTS = ((1, 0), (STREAMING_FRAGMENTS, STREAMING_DELAY))  # (P, tau): blocking DiLoCo, then Streaming DiLoCo
# What deflate leaves of an fp4 payload: 88.9% for Gaussian codes (the training run's pseudo-gradients: 85%).
DEFLATED_SHARE = 0.889
DEFLATE_SOURCE = 'deflated to 88.9% (Gaussian fp4 codes; 85% for a training run\'s, BENCHMARKS.md "Overhead")'
CODEC_OPTIONS = (("none", False), ("fp4", False), ("fp4", True))
EXCHANGE_PATTERN = "reduce_scatter"
SCALE_DTYPE = "bf16"  # the shipped slow-link configs' compression_scale_dtype
PLANNED_CODECS = ("none", "bf16", "fp4")  # the codecs whose host cost benchmarks.sync_cost measured
# Inside a site, the projection's nominal rates (benchmarks.projection's defaults): bf16 parameters, NVLink, PCIe.
PARAMETER_BYTES, INTRA_NODE_GBYTES, HOST_COPY_GBYTES = 2, 300.0, 25.0
TOKENS_PER_PARAMETER = 20
TOKENS_SOURCE = "20 tokens per parameter (compute-optimal, Hoffmann et al. 2022, arXiv 2203.15556)"
_LINK_UNITS = {"k": 1e-6, "m": 1e-3, "g": 1.0, "t": 1e3}
_LINK = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmgt])?(?:bit|b|bps)?(?:/s)?\s*$", re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class Sites:
    """M sites of D GPUs each; the slowest link and the largest latency decide every exchange."""

    workers: int
    gpus_per_site: int
    link_gbit: float
    latency_seconds: float
    speeds: tuple[float, ...]  # relative, one per site

    @property
    def balanced(self) -> bool:
        return len(set(self.speeds)) > 1

    @property
    def effective_workers(self) -> float:
        """How many sites' worth of tokens each of the fastest site's steps trains: under `balanced` every site
        trains at its own speed; under `steps` every site runs at the slowest one's pace."""
        fastest = max(self.speeds)
        if self.balanced:
            return sum(speed / fastest for speed in self.speeds)
        return float(self.workers)


@dataclasses.dataclass(frozen=True)
class SyncProjection:
    """One setting's projected sync (`core.projection`), per rank, seconds unless named otherwise."""

    inner_steps: int
    fragments: int
    sync_delay: int
    compression: str
    entropy_coding: bool
    bytes_per_sync: float
    transfer: float
    main: float
    exchange: float
    inside_site: float
    period: float
    window: float
    utilization: float


@dataclasses.dataclass(frozen=True)
class Plan:
    """Every choice (a `Setting`: value and source) and the projection of the chosen setting."""

    num_parameters: float
    sites: Sites
    block_size: int
    tokens: Setting
    step_seconds: Setting
    laws: ScalingLawSettings
    per_device_batch: int
    max_steps: int
    choices: dict[str, Setting]
    sync: SyncProjection
    tried: tuple[SyncProjection, ...]  # the H search
    wall_seconds: float

    @property
    def on_gpus(self) -> bool:
        """The step time is the GPUs' (not this machine's CPU measurement)."""
        return not self.step_seconds.source.startswith("measured on this machine")

    @property
    def global_batch_tokens(self) -> int:
        return self.per_device_batch * self.block_size * self.sites.gpus_per_site * self.sites.workers


def parse_link(text: str) -> float:
    """Gbit/s of a link written `1gbit`, `100mbit`, `2.5 Gbit/s`, `500M` or a bare number (Gbit/s)."""
    match = _LINK.match(text)
    if not match:
        raise ValueError(
            f"--link: {text!r} is not a bandwidth; write it as a number and a unit, e.g. 1gbit, 100mbit, 2.5gbit/s."
        )
    value = float(match.group(1)) * _LINK_UNITS[(match.group(2) or "g").lower()]
    if not value > 0:
        raise ValueError(f"--link: {text!r} must be a positive bandwidth.")
    return value


def gpu_step_seconds(num_parameters: float, tokens_per_site_step: float, gpus: int, gpu: str, mfu: float) -> Setting:
    """6 N FLOPs per token (forward and backward) over the site's GPUs at `mfu` of their peak."""
    if gpu not in GPU_PEAK_FLOPS:
        raise ValueError(
            f"--gpu: unknown GPU type {gpu!r}; one of {', '.join(GPU_PEAK_FLOPS)}, or give --step_seconds."
        )
    seconds = 6 * num_parameters * tokens_per_site_step / (gpus * GPU_PEAK_FLOPS[gpu] * mfu)
    return Setting(
        seconds,
        f"6 N FLOPs per token x {tokens_per_site_step:,.0f} tokens / ({gpus} x {gpu.upper()} at "
        f"{GPU_PEAK_FLOPS[gpu]:.3g} FLOP/s, {GPU_SOURCE}, x MFU {mfu:g}, {MFU_SOURCE})",
    )


def project_sync(
    num_parameters: float,
    sites: Sites,
    step_seconds: float,
    inner_steps: int,
    fragments: int,
    sync_delay: int,
    compression: str,
    entropy_coding: bool,
) -> SyncProjection:
    """`core.projection`'s model of one fragment's sync at this machine's measured host rates and the link's
    measured efficiency; the link's latency counts 2 (M - 1) times (the reduce-scatter's messages in sequence)."""
    fragment = num_parameters / fragments
    gigabytes_per_rank = fragment * 4 / 1e9 / sites.gpus_per_site
    main, exchange = host_seconds(
        MEASURED_STAGE_RATES, gigabytes_per_rank, compression, EXCHANGE_PATTERN, sites.workers, entropy_coding
    )
    sent = sync_bytes(fragment, compression, EXCHANGE_PATTERN, sites.workers, SCALE_DTYPE)
    if entropy_coding:
        sent *= DEFLATED_SHARE
    if sites.workers == 1:
        sent = 0.0
    latency = 2 * (sites.workers - 1) * sites.latency_seconds
    transfer = sent * 8 / (sites.link_gbit * 1e9 * MEASURED_LINK_EFFICIENCY) + latency
    _, intra, copies = inside_worker(
        fragment, sites.gpus_per_site, PARAMETER_BYTES, INTRA_NODE_GBYTES, HOST_COPY_GBYTES
    )
    period, window = inner_steps / fragments * step_seconds, sync_delay * step_seconds
    return SyncProjection(
        inner_steps=inner_steps,
        fragments=fragments,
        sync_delay=sync_delay,
        compression=compression,
        entropy_coding=entropy_coding,
        bytes_per_sync=sent,
        transfer=transfer,
        main=main,
        exchange=exchange,
        inside_site=intra + copies,
        period=period,
        window=window,
        utilization=utilization(period, main + intra + copies, exchange, transfer, window),
    )


def make_plan(
    num_parameters: float,
    sites: Sites,
    block_size: int,
    step_seconds: Setting | None,
    gpu: str,
    mfu: float,
    tokens: float | None,
    compression: str | None = None,
) -> Plan:
    """Every setting of the run and its projection (see the module docstring for the rules)."""
    check_inputs(num_parameters, sites, block_size, mfu, tokens, compression)
    budget = (
        Setting(float(tokens), "--tokens") if tokens else Setting(TOKENS_PER_PARAMETER * num_parameters, TOKENS_SOURCE)
    )
    laws = scaling_law_settings(num_parameters, sites.workers, FITTED_INNER_STEPS, block_size)
    ranks = sites.workers * sites.gpus_per_site
    per_device_batch = max(1, round(laws.global_batch_sequences.value / ranks))
    site_tokens = per_device_batch * block_size * sites.gpus_per_site
    if step_seconds is None:
        step_seconds = gpu_step_seconds(num_parameters, site_tokens, sites.gpus_per_site, gpu, mfu)
    step = step_seconds.value  # the fastest site's

    def project(h: int, fragments: int, delay: int, codec: str, entropy: bool) -> SyncProjection:
        return project_sync(num_parameters, sites, step, h, fragments, delay, codec, entropy)

    tried = tuple(
        project(_divisible(h, fragments), fragments, delay, codec, entropy)
        for h in INNER_STEPS_CHOICES
        for codec, entropy in _codecs(compression)
        for fragments, delay in LAYOUTS
    )
    sync = next((t for t in tried if t.utilization >= TARGET_UTILIZATION), None)
    sync = sync or max(tried, key=lambda t: t.utilization)
    choices = _choices(sync, tried, compression)
    site_step_tokens = site_tokens * sites.effective_workers
    steps = math.ceil(budget.value / site_step_tokens / sync.inner_steps) * sync.inner_steps  # whole rounds
    laws = scaling_law_settings(num_parameters, sites.workers, sync.inner_steps, block_size, steps)
    choices["round_policy"] = (
        Setting(
            "balanced",
            f"site speeds {', '.join(f'{s:g}' for s in sites.speeds)} differ: each site's steps per "
            'round follow its speed (BENCHMARKS.md "Unequal sites")',
        )  # fmt: skip
        if sites.balanced
        else Setting("steps", "every site at the same speed")
    )
    slowest = step * max(sites.speeds) / min(sites.speeds)
    wall = steps * (step if sites.balanced else slowest) / sync.utilization
    return Plan(
        num_parameters=num_parameters,
        sites=sites,
        block_size=block_size,
        tokens=budget,
        step_seconds=step_seconds,
        laws=laws,
        per_device_batch=per_device_batch,
        max_steps=steps,
        choices=choices,
        sync=sync,
        tried=tried,
        wall_seconds=wall,
    )


def check_inputs(
    num_parameters: float, sites: Sites, block_size: int, mfu: float, tokens: float | None, compression: str | None
) -> None:
    """Each bad input as one error naming its flag."""
    checks = (
        ("--params", num_parameters > 0, f"must be a positive parameter count, got {num_parameters:g}"),
        ("--workers", sites.workers >= 1, f"must be at least 1 site, got {sites.workers}"),
        ("--gpus_per_site", sites.gpus_per_site >= 1, f"must be at least 1 GPU, got {sites.gpus_per_site}"),
        ("--latency_ms", sites.latency_seconds >= 0, "must not be negative"),
        ("--site_speeds", len(sites.speeds) == sites.workers, f"needs one speed per site ({sites.workers})"),
        ("--site_speeds", all(s > 0 for s in sites.speeds), "must be positive relative speeds, e.g. 1 1 0.5"),
        ("--block_size", block_size >= 1, f"must be positive, got {block_size}"),
        ("--mfu", 0 < mfu <= 1, f"must be in (0, 1], got {mfu:g}"),
        ("--tokens", tokens is None or tokens > 0, f"must be a positive token budget, got {tokens}"),
        ("--compression", compression in (None, *PLANNED_CODECS), f"must be one of {', '.join(PLANNED_CODECS)}"),
    )
    for flag, ok, message in checks:
        if not ok:
            raise ValueError(f"{flag}: {message}.")


def _codecs(forced: str | None) -> tuple[tuple[str, bool], ...]:
    """(compression, entropy_coding) options in order of preference: lossless fp32 first, then fp4, then fp4 with
    deflate (fewer bytes, more host CPU)."""
    if forced == "fp4":
        return (("fp4", False), ("fp4", True))
    return ((forced, False),) if forced else CODEC_OPTIONS


def _choices(sync: SyncProjection, tried: tuple[SyncProjection, ...], forced: str | None) -> dict[str, Setting]:
    """Each setting of the chosen option and why: the first option in order of preference (smallest H, then the
    codec, then blocking) whose projected utilization reaches the target."""
    reached = sync.utilization >= TARGET_UTILIZATION
    per_h = len(tried) // len(INNER_STEPS_CHOICES)
    start = tried.index(sync) // per_h * per_h
    same_h = tried[start : start + per_h]  # every option at the chosen H
    best = {(t.compression, t.entropy_coding): max(
        u.utilization for u in same_h if (u.compression, u.entropy_coding) == (t.compression, t.entropy_coding))
        for t in same_h}  # fmt: skip
    if start == 0 and reached:
        h_source = f"the scaling laws' H = 30 (their fits' H) keeps {sync.utilization:.1%} >= {TARGET_UTILIZATION:.0%}"
    elif reached:
        h_source = (
            f"the smallest H of {', '.join(map(str, INNER_STEPS_CHOICES))} at which an option's projected utilization "
            f"reaches {TARGET_UTILIZATION:.0%} (the fits are at H = 30)"
        )
    else:
        h_source = (
            f"no option up to H = {INNER_STEPS_CHOICES[-1]} reaches {TARGET_UTILIZATION:.0%}: the one that keeps the "
            "most (a faster link, more GPUs per site or fewer sites would do better)"
        )
    if forced:
        codec_source = "--compression"
    elif sync.compression == "none":
        codec_source = f"fp32 (lossless) keeps {sync.utilization:.1%} at H = {sync.inner_steps}"
    else:
        codec_source = (
            f"fp32 keeps at most {best[('none', False)]:.1%} at H = {sync.inner_steps}: fp4 as the shipped slow_link "
            'config (BENCHMARKS.md "1000x fewer bytes than DDP: the slow-link frontier": -0.40% ± 0.54 eval loss '
            "against DDP over 10 seeds)"
        )
    entropy_source = (
        f"lossless deflate of the fp4 payload, {DEFLATE_SOURCE}, for more host CPU"
        if sync.entropy_coding
        else "off: deflate's host CPU would cost more than its bytes save here, or nothing to deflate"
    )
    blocking = max(
        (t.utilization for t in same_h if t.fragments == 1 and t.compression == sync.compression
         and t.entropy_coding == sync.entropy_coding), default=0.0)  # fmt: skip
    if sync.fragments == 1:
        layout_source = f"blocking DiLoCo keeps {sync.utilization:.1%}: nothing to overlap"
    else:
        layout_source = (
            f"blocking DiLoCo keeps {blocking:.1%} here: Streaming DiLoCo as the shipped streaming_diloco config "
            "(Douillard et al. 2025, arXiv 2501.18512), one fragment every H / P steps, each exchange overlapped "
            "with tau steps"
        )
    return {
        "inner_steps": Setting(sync.inner_steps, h_source),
        "compression": Setting(sync.compression, codec_source),
        "entropy_coding": Setting(sync.entropy_coding, entropy_source),
        "num_fragments": Setting(sync.fragments, layout_source),
        "sync_delay": Setting(sync.sync_delay, layout_source),
    }


def _divisible(inner_steps: int, fragments: int) -> int:
    """The nearest H above `inner_steps` that P divides (one fragment every H / P steps)."""
    return math.ceil(inner_steps / fragments) * fragments


def projection_sources() -> dict[str, str]:
    """Where each measured constant of the projection comes from."""
    return {
        "link efficiency": f"{MEASURED_LINK_EFFICIENCY:g} of the nominal rate ({LINK_EFFICIENCY_SOURCE})",
        "host rates": STAGE_RATES_SOURCE,
        "inside a site": f"bf16 parameters, all-gather at {INTRA_NODE_GBYTES:g} GB/s (NVLink), device-host copies at "
        f"{HOST_COPY_GBYTES:g} GB/s (PCIe): benchmarks.projection's nominal rates",
    }
