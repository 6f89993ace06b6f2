"""The host CPU cost of one outer round, stage by stage, per GB of fp32 model, next to this machine's copy bandwidth.

    python -m benchmarks.sync_cost --sizes 4 16 64 --threads 1 2 --before 28adba5 main

Every outer round a worker turns its model into a flat fp32 pseudo-gradient, encodes it, sums what the other workers
sent in fp32, encodes the average again, decodes it, takes the outer Nesterov step on θg and writes θm back. This
times each of those stages with the package's own code on vectors of `--sizes` million fp32 values (a model of that
many parameters, as 1024-row matrices):

- `flatten`, `pseudo-gradient`, `unflatten`, `outer step`: a `Fragment` over the whole model (`local()`,
  `pseudo_gradient(θg)`, `write_local(θg)`, `outer_step(average)` with Nesterov SGD, momentum 0.9), with the
  engine's reused buffers (`BufferPool`); `verdict`: the engine's check of the round's average (finite, and its
  largest absolute value, `rounds.finite_and_scale`);
- `encode`, `decode` of every codec (into a vector already in memory: the exchange decodes the round's average into
  the engine's reused buffer), and `sum` (`decode_sum` of M = 2 payloads of half the model each: what a rank sums in
  the default `reduce_scatter` exchange, into a buffer it keeps between rounds), with a `coding_pool` of the thread
  count;
- `deflate`, `inflate` (`entropy_coding`) of the fp4 payload, per GB of the fp32 model it encodes;
- `copy`: `torch.Tensor.copy_` of the same fp32 bytes into a buffer already in memory, the limit; and `fresh copy`
  (`clone`), whose output pages are touched for the first time, as every stage's fresh output is.

Every stage is called once per round, in turn, for `--repeats` rounds, and keeps its fastest call (wall seconds,
and CPU seconds of the process): on cores shared with other jobs the fastest call is the least disturbed one. A
figure is GB of fp32 model per wall second; its share of `copy` compares GB per CPU second (per core: with one
thread, the core's time the stage used). `--before REV [REV ...]` also times the fragment's stages and the codecs'
encode, decode and sum with `hf_diloco/core` as it is in each git revision REV (its own code: its codecs with the
`coding_pool` if they take one, else torch's threads; its fragments with the buffers it has, if any), side by side in
the same rounds. The default fp4 path's round (`reduce_scatter`, M = 2) costs: pseudo-gradient + encode +
sum + encode of half + decode + verdict + outer step + unflatten, printed as wall and CPU seconds per GB of fp32 model;
`benchmarks.projection` reads the stage costs from `--out` (`.json`; `.md` the tables).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace

import torch
from torch import nn

from benchmarks.common import RESULTS_DIR, command_line
from hf_diloco.core.compression import codecs as package_codecs
from hf_diloco.core.compression.codecs import COMPRESSIONS, coding_pool, make_codec
from hf_diloco.core.exchange.payloads import deflate_payload, inflate_payload

BLOCK_SIZES = {"sign": 512}  # the rest at the default 128
SCALE_DTYPES = {"sign": "bf16"}  # the rest at the default fp32
Timing = tuple[float, float]  # (wall seconds, CPU seconds of the process)
ROW_LENGTH = 1024  # the model's matrices: rows of 1024 values
# The default fp4 path's stages and how much of the model each processes per round (reduce_scatter, M = 2: the
# M chunks, then the averaged chunk, 1/M of the model, encoded again).
DEFAULT_ROUND = {
    "pseudo-gradient": 1.0,
    "fp4 encode": 1.5,
    "fp4 sum": 1.0,
    "fp4 decode": 1.0,
    "outer step": 1.0,
    "verdict": 1.0,
    "unflatten": 1.0,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=float, nargs="+", default=[4, 16, 64], help="Model sizes, million parameters.")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--codecs", nargs="+", default=list(COMPRESSIONS), choices=COMPRESSIONS)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--before",
        metavar="REV",
        nargs="+",
        default=[],
        help="Also time the fragment stages and codecs of these git revisions, side by side.",
    )
    parser.add_argument("--out", default=f"{RESULTS_DIR}/sync_cost", help="Writes OUT.json and OUT.md.")
    return parser


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    before = {revision: core_at(revision) for revision in args.before}
    rows = []
    for millions in args.sizes:
        numel = int(millions * 1e6) // 1024 * 1024  # whole blocks of every codec
        for threads in args.threads:
            rows += measure(numel, threads, args.codecs, args.repeats, before)
            print(f"{millions:g} M parameters, {threads} threads: done", flush=True)
    result = {"command": command_line("sync_cost", argv), "before": args.before, "rows": rows}
    result["default_round_seconds_per_gb"] = default_round(rows, "gb_per_second")
    result["default_round_cpu_seconds_per_gb"] = default_round(rows, "gb_per_cpu_second")
    result["default_round_cpu_seconds_per_gb_before"] = {
        revision: default_round(rows, "gb_per_cpu_second", revision) for revision in args.before
    }
    write_report(result, Path(args.out))
    return result


# ----------------------------------------------------------------------------------------------- measuring


def measure(
    numel: int, threads: int, codecs: list[str], repeats: int, before: dict[str, ModuleType] | None = None
) -> list[dict]:
    """Every stage on a model of `numel` fp32 parameters with `threads` threads: one row per stage (`version`
    "package", or a revision of `before`: its `hf_diloco.core` package, from `core_at`)."""
    gigabytes = numel * 4 / 1e9
    rows = []

    def record(stage: str, timing: Timing, version: str = "package") -> None:
        seconds, cpu_seconds = timing
        rows.append(
            {
                "stage": stage,
                "version": version,
                "parameters": numel,
                "threads": threads,
                "seconds": seconds,
                "cpu_seconds": cpu_seconds,
                "gb_per_second": gigabytes / seconds,
                "gb_per_cpu_second": gigabytes / cpu_seconds,
            }
        )

    with torch_threads(threads), contextlib.ExitStack() as stack:
        pool = stack.enter_context(coding_pool(threads)) if threads > 1 else None
        values = torch.randn(numel, generator=torch.Generator().manual_seed(0)) * 1e-3
        stages: dict[tuple[str, str], Callable[[], object]] = {
            ("copy", "package"): functools.partial(torch.empty_like(values).copy_, values),
            ("fresh copy", "package"): values.clone,
        }
        cores = {"package": package_core(), **(before or {})}
        for version, core in cores.items():
            stages.update({(stage, version): call for stage, call in fragment_stages(values, core).items()})
        for name in codecs:
            versions = {"package": make_codec(name, BLOCK_SIZES.get(name, 128), SCALE_DTYPES.get(name, "fp32"))}
            for revision, core in (before or {}).items():
                if name not in core.codecs.COMPRESSIONS:  # a codec added since that revision
                    continue
                versions[revision] = core.codecs.make_codec(
                    name, BLOCK_SIZES.get(name, 128), SCALE_DTYPES.get(name, "fp32")
                )
            for version, codec in versions.items():
                for stage, call in codec_stages(codec, values, pool, reused_output=version == "package").items():
                    stages[f"{name} {stage}", version] = call
        payload = make_codec("fp4").encode(values, pool)
        packed = deflate_payload(payload, pool)
        stages["fp4 deflate", "package"] = lambda: deflate_payload(payload, pool)
        stages["fp4 inflate", "package"] = lambda: inflate_payload(packed, payload.numel(), 0, pool)
        for (stage, version), timing in timed_together(stages, repeats).items():
            record(stage, timing, version)
    return rows


def fragment_stages(values: torch.Tensor, core: ModuleType) -> dict[str, Callable[[], object]]:
    """The engine's per-fragment stages on a model holding `values` (1024-row matrices), with the `Fragment` of
    `core` (`hf_diloco.core` or `core_at`'s) and the buffers its engine gives a fragment, if any."""
    numel = values.numel()
    matrices = [values[start : start + ROW_LENGTH * 1024].clone() for start in range(0, numel, ROW_LENGTH * 1024)]
    params = {f"w{i}": nn.Parameter(m.view(-1, ROW_LENGTH)) for i, m in enumerate(matrices)}
    del matrices
    pieces = [core.fragments.Piece(name, 0, p.shape[0]) for name, p in params.items()]
    worker = core.shard.Worker(core.topology.Topology.single_process(), count_bytes=lambda nbytes: None)
    values_of_rank = core.shard.ReplicatedValues(pieces, params, granularity=1024, worker=worker)
    buffers = {"buffers": core.buffers.BufferPool(limit=3)} if hasattr(core, "buffers") else {}  # P = 1: P + 2
    fragment = core.fragment.Fragment(
        0, pieces, params, torch.device("cpu"), outer_optimizer, values_of_rank, **buffers
    )
    average = torch.randn(numel, generator=torch.Generator().manual_seed(1)) * 1e-4
    fragment.outer_step(average)  # the momentum buffer exists from the first round on
    return {
        "flatten": fragment.local,
        "pseudo-gradient": lambda: fragment.pseudo_gradient(fragment.theta_g),
        "unflatten": lambda: fragment.write_local(fragment.theta_g),
        "outer step": lambda: fragment.outer_step(average),
        "verdict": functools.partial(verdict_of(core), average),
    }


def verdict_of(core: ModuleType) -> Callable[[torch.Tensor], tuple[bool, float]]:
    """Whether the average is finite and its largest absolute value, as `core`'s engine checks every round; before
    `rounds.finite_and_scale`, two passes (`isfinite().all()`, then `abs().max()`) with a temporary each."""
    if hasattr(core, "rounds") and hasattr(core.rounds, "finite_and_scale"):
        return core.rounds.finite_and_scale

    def two_passes(average: torch.Tensor) -> tuple[bool, float]:
        finite = bool(torch.isfinite(average).all())
        return finite, float(average.abs().max()) if finite and average.numel() else 0.0

    return two_passes


def outer_optimizer(tensor: torch.Tensor) -> torch.optim.Optimizer:
    """The engine's outer optimizer at the papers' setting (Nesterov momentum, the default)."""
    return torch.optim.SGD([tensor], lr=0.7, momentum=0.9, nesterov=True)


def codec_stages(codec, values: torch.Tensor, pool, reused_output: bool = False) -> dict[str, Callable[[], object]]:
    """Encode and decode `values` with `codec`, and sum two decoded halves (reduce_scatter, M = 2). `reused_output`:
    decode into a vector already in memory, as the package's exchange decodes the average into the engine's reused
    buffer; else into a fresh vector, as earlier revisions' exchange did."""
    # Whole codec blocks in each half: `topk`'s 4096-value chunks trim up to 8191 values (0.03% of 32 M).
    values = values[: values.numel() // (2 * codec.align) * (2 * codec.align)]
    numel = values.numel()
    new = hasattr(codec, "decode_sum")
    kwargs = {"pool": pool} if new else {}
    payload = codec.encode(values, **kwargs)
    into = {"out": torch.empty_like(values).zero_()} if reused_output else {}
    halves = [codec.encode(half, **kwargs) for half in values.chunk(2)]
    if new and reused_output:  # the exchange sums into a buffer it keeps between rounds
        summed = torch.empty(numel // 2, dtype=torch.float32).zero_()
        add = lambda: codec.decode_sum(halves, numel // 2, pool, summed)  # noqa: E731
    elif new:
        add = lambda: codec.decode_sum(halves, numel // 2, pool)  # noqa: E731
    else:
        add = lambda: summed_one_by_one(codec, halves, numel // 2)  # noqa: E731
    return {
        "encode": lambda: codec.encode(values, **kwargs),
        "decode": lambda: codec.decode(payload, numel, **kwargs, **into),
        "sum": add,
    }


def summed_one_by_one(codec, payloads: list[torch.Tensor], numel: int) -> torch.Tensor:
    """How the exchange summed before `decode_sum`: each payload decoded whole, then added to zeros in order."""
    total = torch.zeros(numel, dtype=torch.float32)
    for payload in payloads:
        total += codec.decode(payload, numel)
    return total


def timed_together(calls: dict, repeats: int) -> dict:
    """Per call, the fewest wall seconds and the fewest CPU seconds of this process over `repeats` rounds that each
    call every function once, in turn (each result dropped before the next call). On cores shared with other jobs
    the fastest call is the one least disturbed by them; taking turns gives every stage, and the copy limit, the same
    chances at a quiet moment; CPU time leaves out the time other jobs held the core."""
    walls: dict = {key: [] for key in calls}
    cpus: dict = {key: [] for key in calls}
    for _ in range(repeats):
        for key, function in calls.items():
            started, started_cpu = time.perf_counter(), time.process_time()
            function()
            walls[key].append(time.perf_counter() - started)
            cpus[key].append(time.process_time() - started_cpu)
    return {key: (min(walls[key]), min(cpus[key])) for key in calls}


@contextlib.contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def package_core() -> SimpleNamespace:
    """This package's engine modules under the flat names `fragment_stages` reads (`core_at` gives an older revision's
    flat core the same way)."""
    from hf_diloco.core.layout import buffers, fragments, shard, topology
    from hf_diloco.core.rounds import fragment, rounds

    return SimpleNamespace(
        codecs=package_codecs, fragment=fragment, fragments=fragments, shard=shard, topology=topology,
        buffers=buffers, rounds=rounds,
    )  # fmt: skip


def core_at(revision: str) -> SimpleNamespace:
    """`hf_diloco/core` of a git revision, imported as its own package `core_at_REV` (it imports only torch, numpy
    and yaml, and itself by relative imports), with the modules `sync_cost` uses under their flat names (a revision
    whose core is in rooms lists where each went in its `MOVED`)."""
    names = subprocess.run(
        ["git", "ls-tree", "-r", "--name-only", f"{revision}:hf_diloco/core"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    name = "core_at_" + "".join(c if c.isalnum() else "_" for c in revision)
    folder = Path(tempfile.mkdtemp()) / name
    for file in names:
        if file.endswith(".py"):
            source = subprocess.run(
                ["git", "show", f"{revision}:hf_diloco/core/{file}"], capture_output=True, text=True, check=True
            ).stdout
            (folder / file).parent.mkdir(parents=True, exist_ok=True)
            (folder / file).write_text(source)
    spec = importlib.util.spec_from_file_location(
        name, folder / "__init__.py", submodule_search_locations=[str(folder)]
    )
    package = importlib.util.module_from_spec(spec)
    sys.modules[name] = package
    spec.loader.exec_module(package)
    moved = {**getattr(package, "MOVED", {}), "rounds": "rounds.rounds" if (folder / "rounds").is_dir() else "rounds"}
    flat = SimpleNamespace()
    for module in ("codecs", "fragment", "fragments", "shard", "topology", "buffers", "rounds"):
        path = moved.get(module, module)
        if (folder / (path.replace(".", "/") + ".py")).exists():
            setattr(flat, module, importlib.import_module(f"{name}.{path}"))
    return flat


# ----------------------------------------------------------------------------------------------- reporting


def default_round(rows: list[dict], rate: str, version: str = "package") -> dict[str, float]:
    """Seconds per GB of fp32 model of one round of the default fp4 path, by thread count (largest model), from the
    rows' `rate` (`gb_per_second`: wall seconds; `gb_per_cpu_second`: CPU seconds) of `version`'s code; the stages
    a revision of `--before` has no row of (unflatten, say) are the package's."""
    largest = max(row["parameters"] for row in rows)
    totals = {}
    for threads in sorted({row["threads"] for row in rows}):
        mine = [row for row in rows if row["parameters"] == largest and row["threads"] == threads]
        rates = {row["stage"]: row[rate] for row in mine if row["version"] == "package"}
        rates.update({row["stage"]: row[rate] for row in mine if row["version"] == version})
        if all(stage in rates for stage in DEFAULT_ROUND):
            totals[str(threads)] = sum(share / rates[stage] for stage, share in DEFAULT_ROUND.items())
    return totals


def write_report(result: dict, out: Path) -> None:
    rows = result["rows"]
    lines = [f"`{result['command']}`", ""]
    sizes = sorted({row["parameters"] for row in rows})
    for threads in sorted({row["threads"] for row in rows}):
        mine = {(r["stage"], r["version"], r["parameters"]): r for r in rows if r["threads"] == threads}
        lines += [
            f"{threads} thread{'s' * (threads > 1)}: GB of fp32 model per wall second, and (in brackets) the stage's "
            "GB per CPU second as a share of `copy`'s (per core):",
            "",
            "| stage | " + " | ".join(f"{size / 1e6:g} M parameters" for size in sizes) + " |",
            "|---|" + "---|" * len(sizes),
        ]
        stages = dict.fromkeys(r["stage"] for r in rows if r["threads"] == threads)
        for version in ("package", *result["before"]):
            for stage in stages:
                if (stage, version, sizes[0]) not in mine:
                    continue
                cells = []
                for size in sizes:
                    row, copy = mine[stage, version, size], mine["copy", "package", size]
                    share = row["gb_per_cpu_second"] / copy["gb_per_cpu_second"]
                    cells.append(f"{row['gb_per_second']:.2f} ({share:.0%})")
                label = stage if version == "package" else f"{stage} ({version})"
                lines.append(f"| {label} | " + " | ".join(cells) + " |")
        lines.append("")
    for threads, seconds in result["default_round_seconds_per_gb"].items():
        cpu = result["default_round_cpu_seconds_per_gb"][threads]
        lines.append(
            f"One round of the default fp4 path ({threads} thread{'s' * (int(threads) > 1)}, {sizes[-1] / 1e6:g} M "
            f"parameters): {seconds:.2f} wall s, {cpu:.2f} CPU s per GB of fp32 model."
        )
    for revision, totals in result.get("default_round_cpu_seconds_per_gb_before", {}).items():
        for threads, cpu in totals.items():
            lines.append(
                f"The same round with the code of {revision} ({threads} thread{'s' * (int(threads) > 1)}): "
                f"{cpu:.2f} CPU s per GB of fp32 model."
            )
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.md").write_text("\n".join(lines) + "\n")
    Path(f"{out}.json").write_text(json.dumps(result, indent=2))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
