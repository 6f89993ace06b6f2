"""The measured projection of one outer sync: bytes, link time, host CPU and compute utilization.

Per sync of one fragment (1/P of the model) on a worker of D GPUs:

- bytes = what the exchange sends per rank for the fragment's encoded payload: 2 (M - 1) / M of it with
  `reduce_scatter`, (M - 1) x with `all_gather`;
- transfer = bytes x 8 / (link bandwidth x link efficiency, the share of the nominal rate an exchange gets: 0.9 on
  the tbf link of `benchmarks.wan`, BENCHMARKS.md "One exchange against the link's rate" and "Projection to 1B, 7B
  and 70B models");
- host CPU = the GB of fp32 one rank handles (1/D of the fragment) x the CPU seconds per GB that `benchmarks.sync_cost`
  measured for each stage on one core: the training thread's stages (pseudo-gradient, outer step, unflatten: `main`)
  and the background exchange's (encode, decode, sum, and deflate / inflate with entropy coding: `exchange`);
- inside the worker, on the training thread: the D ranks all-gather the updated fragment in the parameters' dtype,
  (D - 1) / D of it per rank (NVLink), and each rank copies its 1/D share to the host and back, 2 / D of it (PCIe);
- period = the compute between two fragment launches, H / P steps; window = the compute an exchange can hide behind,
  tau steps (0: blocking);
- utilization = period / (period + main + intra + copies + max(0, exchange + transfer - window)).

`benchmarks.projection` prints this model for 1B / 7B / 70B and validates it against `benchmarks.wan`; `hf-diloco
plan` uses it to choose H, P, tau and the codec. Pure Python apart from the codec registry (bits per value).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from ..compression.codecs import make_codec

# Published training throughput (H100 80GB, bf16, sequence length 2048) from mosaicml/llm-foundry,
# scripts/train/benchmarking/README.md, table "H100 80GB BF16": (parameters, GPUs, global batch in tokens,
# tokens per second of all GPUs). A step is one global batch: batch / throughput seconds.
STEP_TIMES = {
    "1B": (1_315_950_592, 8, 229_376, 363_645),
    "7B": (6_658_859_008, 8, 98_304, 85_144),
    "70B": (64_862_437_376, 64, 4_194_304, 66_523),
}
STEP_SOURCE = "mosaicml/llm-foundry scripts/train/benchmarking/README.md, H100 80GB BF16, sequence length 2048"
MAIN_STAGES = ("pseudo-gradient", "outer step", "unflatten")
# The exchange's stages and how much of the model each processes per sync, by pattern (M workers): reduce_scatter
# encodes the M chunks, sums the M decoded chunks it owns, encodes the averaged chunk and decodes all M averages;
# all_gather encodes once and sums M decoded vectors.
EXCHANGE_STAGES: dict[str, Callable[[int], dict[str, float]]] = {
    "reduce_scatter": lambda m: {"encode": 1 + 1 / m, "sum": 1.0, "decode": 1.0},
    "all_gather": lambda m: {"encode": 1.0, "sum": float(m)},
}
# The share of a link's nominal rate a blocking exchange got on the tbf link of `benchmarks.wan`: its transfers alone
# 0.95-0.96 (`benchmarks.link_rate`), the whole sync of a training run a little less (slow start after the idle
# round); 0.9 predicts the four runs of the validation within 7%.
MEASURED_LINK_EFFICIENCY = 0.9
LINK_EFFICIENCY_SOURCE = 'BENCHMARKS.md "Projection to 1B, 7B and 70B models", validation against benchmarks.wan'
# GB of fp32 per CPU second of each stage on one core of this repository's 2-core AMD EPYC host, at the largest model
# (32 M parameters) of `benchmarks/results/sync_cost.json` (`benchmarks.projection --costs` reads the file itself;
# tests/test_plan.py checks that this table is the file's).
MEASURED_STAGE_RATES = {
    "pseudo-gradient": 7.837108156069792,
    "outer step": 4.836530739876444,
    "unflatten": 10.81106739104752,
    "none encode": 1.8035540723825025,
    "none decode": 10.874195245834041,
    "none sum": 9.497015080733341,
    "bf16 encode": 2.2152131493672536,
    "bf16 decode": 12.436346310274118,
    "bf16 sum": 9.101751034685698,
    "fp4 encode": 2.7169456708083204,
    "fp4 decode": 5.3428170562262185,
    "fp4 sum": 5.723026871355343,
    "fp4 deflate": 0.2847321276624256,
    "fp4 inflate": 1.565535499183965,
}
STAGE_RATES_SOURCE = (
    'benchmarks/results/sync_cost.json (BENCHMARKS.md "The outer round\'s host CPU cost"; one core, 32 M parameters)'
)


def stage_rates(costs: Mapping, threads: int) -> dict[str, float]:
    """GB of fp32 model per CPU second of every stage of a `benchmarks.sync_cost` result, at its largest model
    measured with `threads` threads."""
    largest = max(row["parameters"] for row in costs["rows"] if row["threads"] == threads)
    return {
        row["stage"]: row["gb_per_cpu_second"]
        for row in costs["rows"]
        if row["threads"] == threads and row["parameters"] == largest and row["version"] == "package"
    }


def host_seconds(
    rates: Mapping[str, float], gigabytes: float, compression: str, pattern: str, workers: int, entropy: bool = False
) -> tuple[float, float]:
    """(training-thread seconds, background-exchange seconds) of one sync of `gigabytes` of fp32."""
    main = sum(gigabytes / rates[stage] for stage in MAIN_STAGES)
    shares = EXCHANGE_STAGES[pattern](workers)
    exchange = sum(share * gigabytes / rates[f"{compression} {stage}"] for stage, share in shares.items())
    if entropy:
        exchange += sum(gigabytes / rates[f"{compression} {stage}"] for stage in ("deflate", "inflate"))
    return main, exchange


def pattern_bytes(pattern: str, workers: int, payload_bytes: float) -> float:
    """Bytes one rank sends to average a vector whose whole encoded payload is `payload_bytes`: `reduce_scatter`
    sends M - 1 chunks of 1/M of it, then its averaged chunk to the M - 1 others (2 (M - 1) / M x payload);
    `all_gather` sends the whole payload to the M - 1 others ((M - 1) x payload)."""
    if pattern == "all_gather":
        return (workers - 1) * payload_bytes
    return 2 * (workers - 1) / workers * payload_bytes


def sync_bytes(
    parameters: float, compression: str, pattern: str, workers: int, scale_dtype: str = "fp32", block_size: int = 128
) -> float:
    """Bytes one rank sends per sync of `parameters` values (block padding neglected; before any entropy coding)."""
    codec = make_codec(compression, block_size=block_size, scale_dtype=scale_dtype)
    payload = parameters * codec.bits / 8 + parameters / codec.align * getattr(codec, "scale_nbytes", 0)
    return pattern_bytes(pattern, workers, payload)


def inside_worker(
    parameters: float, gpus: int, parameter_bytes: int, intra_node_gbytes: float, host_copy_gbytes: float
) -> tuple[float, float, float]:
    """(bytes each rank sends inside the worker, their seconds, device-host copy seconds) of one sync of `parameters`
    values: the all-gather of the update in the parameters' dtype, and each rank's share copied out and back."""
    intra = (gpus - 1) / gpus * parameters * parameter_bytes
    copied = 2 * parameters / gpus * parameter_bytes
    return intra, intra / (intra_node_gbytes * 1e9), copied / (host_copy_gbytes * 1e9)


def utilization(period: float, main: float, exchange: float, transfer: float, window: float) -> float:
    """Compute / wall time of one fragment period: the exchange's excess over its window stalls the training
    (`main`: every second of the training thread, the copies and the gather inside the worker included)."""
    return period / (period + main + max(0.0, exchange + transfer - window))
