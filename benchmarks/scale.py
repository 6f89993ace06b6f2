"""Host memory and host cost of the engine at scale: the largest Llama this machine fits through the engine, one
worker unsharded (D = 1), with D = 2 data-parallel ranks replicated (DDP, in fp32 and in bf16) and sharded (FSDP2),
and as S = 2 pipeline stages.

    python -m benchmarks.scale            # a 278 M-parameter Llama; writes benchmarks/results/scale.json and .md
    python -m benchmarks.scale --smoke    # a tiny Llama, the same code path, in seconds

Each configuration runs in its own fresh processes (one process per rank, real gloo groups), one after the other,
so its peak is its own; before each the run checks that the machine has the memory the formula below predicts (plus
a margin) and otherwise records the configuration as not run, with the command to run it later. A configuration
trains a Llama built from a config (random init, nothing downloaded) with AdamW for a few inner steps and 2 outer
syncs of plain DiLoCo (H = `--inner_steps`; P = 1, tau = 0, so a sync runs whole inside `engine.step()` and its host
cost is measurable there). The pipelined worker is built as the package builds one (`PipelineRunner`, as
`DiLoCoTrainer` with `pipeline_stages` > 1 does): every rank builds the whole model on the CPU, the runner plans the
cut and checks the chained stages, `place_own_stage` frees the other stage's parameters; a step is the runner's
1F1B schedule over `pipeline_microbatches` (2) micro-batches of the others' batch, and the engine syncs the stage's
parameters. Measured per rank, the largest over the ranks, each next to its formula:

- peak RSS (`ru_maxrss`). Formula, N parameters of b bytes, the fp32 outer state of plain DiLoCo (θg, the outer
  momentum, the reused pseudo-gradient and average buffers: 16 bytes per parameter) and the process's own baseline
  (torch and transformers imported, measured before the model is built):
  D = 1: N (b model + b grad + 2b AdamW + 16 outer); DDP: N (4b + b DDP buckets) + 16 N / D; FSDP2:
  N (4b + 16) / D + 4 b U, U the largest FSDP unit (a decoder layer, or the root: embeddings, head, final norm):
  while it runs, its parameters gathered and its all-gather buffer, its gradients unsharded and its reduce-scatter
  buffer; pipeline: max(N b, N_s (4b + 16)), N_s the larger stage's parameters: the whole model exists on every rank
  until the cut, then a stage's model, gradients, AdamW moments and outer state. The activations a stage holds
  (2 micro-batches of 1 x 32 tokens: fp32 logits of 32 x vocabulary, 4 MB each at 32000 tokens, hidden states of
  128 kB) stay under 0.5% of that and are left out.
- host CPU-seconds per sync: this process's CPU time (every thread) inside the `engine.step()` calls, divided by the
  syncs. Formula: D = 1's figure x the rank's share of the values (1/D with D data-parallel ranks: every stage of a
  sync runs on the rank's share; N_s / N on a pipeline stage), plus, with DDP, the all-gather of the updated
  parameters. Only against a D = 1 of the same dtype.
- bytes inside the worker per sync (`stats["bytes_sent_intra_worker"]` / syncs). Formula: DDP (D - 1) / D x N x b
  (each rank's updated parameters, all-gathered in their own dtype on the worker's training group: 2 bytes each in
  bf16, 4 in fp32), FSDP2, D = 1 and the pipeline's stages (one rank per stage): 0, beside a few scalars of the
  guards (the activations a pipeline sends between stages are inner-step traffic, not the sync's).

The ranks run with glibc's mmap threshold fixed at 1 MB (`--mmap_threshold`; see `MALLOC_VARIABLES`), so a peak
is what was live rather than what a fragmented heap kept. The target: the sharded and the pipelined host peaks at
most 0.6x the unsharded one.
"""

from __future__ import annotations

import argparse
import datetime
import os
import resource
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel
from transformers import LlamaConfig, LlamaForCausalLM

from benchmarks.common import RESULTS_DIR, command_line, write_results
from hf_diloco import DiLoCo, DiLoCoConfig, Topology, worker_mesh
from hf_diloco.parallel.pipeline import (
    PipelinePlan,
    PipelineRunner,
    PipelineStageModule,
    check_batch,
    plan_pipeline,
)


@dataclass(frozen=True)
class Setup:
    """One configuration: D data-parallel ranks and S pipeline stages in one worker (D x S processes).

    Attributes:
        ranks: data-parallel ranks per worker D.
        stages: pipeline stages S.
        sharded: the D ranks shard the model with FSDP2 (else DDP replicates it).
        dtype: the parameters' dtype; None: `--dtype`.
    """

    ranks: int
    stages: int = 1
    sharded: bool = False
    dtype: str | None = None

    @property
    def processes(self) -> int:
        return self.ranks * self.stages


CONFIGS = {
    "D=1": Setup(1),
    "D=2 DDP": Setup(2),
    "D=2 DDP bf16": Setup(2, dtype="bfloat16"),
    "D=2 FSDP": Setup(2, sharded=True),
    "S=2 pipeline": Setup(1, stages=2),
}
REDUCED = ("D=2 FSDP", "S=2 pipeline")  # the configurations whose host peak the target bounds
TARGET_RATIO = 0.6
# A Llama of 278 M parameters: 18 layers of hidden 1024 (16 heads, 8 key-value heads, MLP 2816), vocabulary 32000,
# untied head. With AdamW and plain DiLoCo's outer state, ~10 GB per unsharded process: what fits here (24 GB, other
# jobs beside) for D = 1 and for two ranks of D = 2.
FULL = dict(hidden=1024, layers=18, intermediate=2816, vocab=32000, heads=16, kv_heads=8, steps=4, inner_steps=2)
SMOKE = dict(hidden=32, layers=2, intermediate=64, vocab=128, heads=4, kv_heads=2, steps=4, inner_steps=2)
OUTER_BYTES_PER_PARAMETER = 16  # θg, outer momentum, pseudo-gradient buffer, average buffer (fp32)
MARGIN_BYTES = 2 * 2**30  # left free beside a configuration's predicted total before it is started
BASELINE_BYTES = 2**30  # a rank's baseline (torch and transformers imported) beside its formula, when checking memory
SEQUENCE, ROWS = 32, 1
# glibc raises its mmap threshold up to 32 MB as large blocks are freed, after which freed tensors below it stay in
# the heap, fragmented: FSDP's per-unit gather and reduce-scatter buffers then hold the peak up (127 M parameters,
# D = 2 FSDP: 0.88x the unsharded peak with glibc's default, 0.68x at 40 M with a fixed 1 MB threshold against
# 0.90x without). A fixed threshold returns every freed tensor to the system, so the peak is what is live.
MALLOC_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def llama_config(args: argparse.Namespace) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=SEQUENCE,
        tie_word_embeddings=False,
    )


def fsdp_units(model: LlamaForCausalLM) -> list[torch.nn.Module]:
    """What is `fully_shard`-ed before the root, as the front-ends shard a worker's model: every decoder layer; the
    root keeps the embeddings, the head and the final norm."""
    return list(model.model.layers)


def model_sizes(args: argparse.Namespace, stages: int = 2) -> dict[str, int]:
    """Parameters N, the largest FSDP unit U (counted on the meta device) and the larger pipeline stage N_s (the
    package's own cut into `stages`, planned on uninitialised storage)."""
    with torch.device("meta"):
        model = LlamaForCausalLM(llama_config(args))
    units = [sum(p.numel() for p in unit.parameters()) for unit in fsdp_units(model)]
    total = sum(p.numel() for p in model.parameters())
    units.append(total - sum(units))  # the root's own
    # The plan's probe forward needs real tensors (the mask reads values); their values do not matter: uninitialised
    # bf16 storage, freed on return.
    model = model.to(torch.bfloat16).to_empty(device="cpu")
    model.model.rotary_emb.inv_freq.zero_()
    plan, _ = plan_pipeline(model, stages, check_batch(model))
    return {"parameters": total, "largest_unit": max(units), "largest_stage": max(_stage_sizes(model, plan))}


def _stage_sizes(model: nn.Module, plan: PipelinePlan) -> list[int]:
    """Parameters each stage of `plan` holds."""
    return [sum(p.numel() for p in PipelineStageModule(model, plan, s).parameters()) for s in range(plan.num_stages)]


def _rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


@dataclass
class Trained:
    """What one rank trains: the module the engine syncs, the inner step's forward and backward of a batch of token
    ids, its topology and the length of the whole block stack when the module holds part of it."""

    module: nn.Module
    loss_backward: Callable[[torch.Tensor], None]
    topology: Topology
    num_blocks: int | None = None


def _build_data_parallel(setup: Setup, config: DiLoCoConfig, model: nn.Module, peaks: dict) -> Trained:
    """The whole model on every rank: replicated by DDP (D > 1), sharded by FSDP2, or alone (D = 1)."""
    if setup.sharded:
        mesh = worker_mesh(config)
        for unit in fsdp_units(model):
            fully_shard(unit, mesh=mesh)
        fully_shard(model, mesh=mesh)
        peaks["model sharded"] = _rss_bytes()
    topology = Topology.from_default_group(1, setup.ranks, config.sync_timeout_seconds)
    forward = model
    if setup.ranks > 1 and not setup.sharded:
        forward = DistributedDataParallel(model, process_group=topology.data_parallel_group)

    def loss_backward(ids: torch.Tensor) -> None:
        forward(input_ids=ids, labels=ids).loss.backward()

    return Trained(model, loss_backward, topology)


def _build_pipeline_stage(setup: Setup, config: DiLoCoConfig, model: nn.Module, peaks: dict) -> Trained:
    """This rank's stage, as `PipelineTrainerMixin` builds it: plan and check on the whole model, keep the stage."""
    topology = Topology.from_default_group(setup.stages, setup.ranks, config.sync_timeout_seconds)
    runner = PipelineRunner.for_worker(model, topology, config, "cpu")
    peaks["stages planned and checked"] = _rss_bytes()
    runner.place_own_stage()
    if runner.tied_parameters():
        raise ValueError("the benchmark's Llama has an untied head: no stage should hold a tied copy")

    def loss_backward(ids: torch.Tensor) -> None:
        runner.train_step({"input_ids": ids, "labels": ids})

    return Trained(runner.stage_module, loss_backward, topology, runner.plan.num_layers)


def _run_rank(setup: Setup, args: argparse.Namespace) -> dict:
    baseline = _rss_bytes()  # torch and transformers imported, the process group up
    dtype = getattr(torch, setup.dtype or args.dtype)
    config = DiLoCoConfig(
        inner_steps=args.inner_steps,
        data_parallel_per_worker=setup.ranks,
        pipeline_stages=setup.stages,
        sync_timeout_seconds=1800,
    )
    peaks = {}  # the peak so far after each stage: where the peak is reached
    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config(args)).to(dtype)
    peaks["model built"] = _rss_bytes()
    build = _build_pipeline_stage if setup.stages > 1 else _build_data_parallel
    trained = build(setup, config, model, peaks)
    optimizer = torch.optim.AdamW(trained.module.parameters(), lr=1e-4)
    # Every stage of a pipeline reads the same batch; data-parallel replicas read their own.
    generator = torch.Generator().manual_seed(trained.topology.dp_index)
    rows = ROWS * (config.pipeline_microbatches if setup.stages > 1 else 1)

    def inner_step() -> None:
        trained.loss_backward(torch.randint(0, args.vocab, (rows, SEQUENCE), generator=generator))
        optimizer.step()
        optimizer.zero_grad()

    inner_step()  # AdamW's state exists before the engine does
    peaks["first inner step"] = _rss_bytes()
    engine = DiLoCo(trained.module, optimizer, config, topology=trained.topology, num_blocks=trained.num_blocks)
    peaks["engine built"] = _rss_bytes()
    cpu_seconds = wall_seconds = 0.0
    for _ in range(args.steps):
        inner_step()
        cpu, wall = time.process_time(), time.perf_counter()
        engine.step()
        cpu_seconds += time.process_time() - cpu
        wall_seconds += time.perf_counter() - wall
        if engine.stats["outer_steps"] and "first sync" not in peaks:
            peaks["first sync"] = _rss_bytes()
    syncs = engine.stats["outer_steps"]
    result = {
        "baseline_rss_bytes": baseline,
        "peak_rss_bytes": _rss_bytes(),
        "syncs": syncs,
        "cpu_seconds_per_sync": cpu_seconds / syncs,
        "wall_seconds_per_sync": wall_seconds / syncs,
        "intra_worker_bytes_per_sync": engine.stats["bytes_sent_intra_worker"] / syncs,
        "outer_state_bytes": engine.stats["outer_state_bytes"],
        "trained_parameters": sum(p.numel() for p in trained.module.parameters()),
        "peak_rss_after_bytes": peaks,
    }
    engine.close()
    return result


def _rank_main(rank: int, world: int, port: int, job: dict, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(job["threads"])
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=1800))
    try:
        args = argparse.Namespace(**job["args"])
        result = {label: _run_rank(CONFIGS[label], args) for label in job["labels"]}
        torch.save(result, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _launch(labels: list[str], args: argparse.Namespace) -> list[dict]:
    """Each of `labels` in turn on the same fresh processes (as many as each needs); every rank's results by label."""
    world = CONFIGS[labels[0]].processes
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    job = {"labels": labels, "args": vars(args), "threads": 1}
    saved = {name: os.environ.get(name) for name in MALLOC_VARIABLES}
    if args.mmap_threshold:  # read by glibc when a process starts: the spawned ranks get it
        os.environ.update({name: str(args.mmap_threshold) for name in MALLOC_VARIABLES})
    try:
        with tempfile.TemporaryDirectory() as out:
            mp.spawn(_rank_main, args=(world, port, job, out), nprocs=world, join=True)
            return [torch.load(Path(out) / f"rank{rank}.pt", weights_only=False) for rank in range(world)]
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def dtype_bytes(dtype: str) -> int:
    return torch.empty((), dtype=getattr(torch, dtype)).element_size()


def formulas(setup: Setup, sizes: dict[str, int], b: int) -> dict[str, float]:
    """Predicted bytes per rank beyond the baseline, and intra-worker bytes per sync (module docstring), for
    parameters of `b` bytes."""
    n, outer, d = sizes["parameters"], OUTER_BYTES_PER_PARAMETER, setup.ranks
    if setup.stages > 1:
        memory = max(n * b, sizes["largest_stage"] * (4 * b + outer))
    elif setup.sharded:
        memory = n * (4 * b + outer) / d + 4 * b * sizes["largest_unit"]
    elif d > 1:
        memory = n * 5 * b + n * outer / d
    else:
        memory = n * (4 * b + outer)
    gathered = 0 if setup.sharded or d == 1 else (d - 1) / d * n * b
    return {"rss_above_baseline_bytes": memory, "intra_worker_bytes_per_sync": gathered}


def share_of_values(setup: Setup, sizes: dict[str, int]) -> float:
    """The part of the model's values a rank's sync works on (the CPU-seconds formula's factor)."""
    if setup.stages > 1:
        return sizes["largest_stage"] / sizes["parameters"] / setup.ranks
    return 1 / setup.ranks


def _available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def _measured(results: list[dict]) -> dict:
    """The largest over the ranks of every figure, and of the peak after each stage of the run."""
    measured = {key: max(r[key] for r in results) for key in results[0] if key != "peak_rss_after_bytes"}
    measured["peak_rss_after_bytes"] = {
        stage: max(r["peak_rss_after_bytes"][stage] for r in results) for stage in results[0]["peak_rss_after_bytes"]
    }
    measured["rss_above_baseline_bytes"] = max(r["peak_rss_bytes"] - r["baseline_rss_bytes"] for r in results)
    return measured


def measure(args: argparse.Namespace, argv: list[str]) -> dict:
    sizes = model_sizes(args)
    rows: dict[str, dict] = {}
    for labels in _launches(args):
        predicted = {
            label: formulas(CONFIGS[label], sizes, dtype_bytes(CONFIGS[label].dtype or args.dtype)) for label in labels
        }
        processes = CONFIGS[labels[0]].processes
        needed = max(processes * (p["rss_above_baseline_bytes"] + BASELINE_BYTES) for p in predicted.values())
        needed += MARGIN_BYTES
        available = _available_bytes()
        if available < needed:
            for label in labels:
                rerun = command_line("scale", [*argv_without_configs(argv), "--configs", label])
                short = f"{available / 2**30:.1f} GiB available, {needed / 2**30:.1f} needed"
                rows[label] = {"not_run": short, "command": rerun}
                print(f"{label}: not run ({short}); run later: {rerun}", flush=True)
            continue
        per_rank = _launch(labels, args)
        for label in labels:
            setup = CONFIGS[label]
            measured = _measured([rank_results[label] for rank_results in per_rank])
            rows[label] = {
                "ranks": setup.ranks,
                "stages": setup.stages,
                "sharded": setup.sharded,
                "dtype": setup.dtype or args.dtype,
                "measured": measured,
                "formula": predicted[label],
            }
            print(f"{label}: peak RSS {measured['peak_rss_bytes'] / 1e9:.2f} GB per rank", flush=True)
    _compare_with_unsharded(rows, sizes)
    ratios = [rows.get(label, {}).get("peak_rss_vs_unsharded") for label in REDUCED if label in args.configs]
    return {
        **sizes,
        "dtype": args.dtype,
        "workers": 1,
        "inner_steps": args.inner_steps,
        "steps": args.steps,
        "mmap_threshold": args.mmap_threshold,
        "configs": rows,
        "target": f"sharded and pipelined peak RSS <= {TARGET_RATIO}x the unsharded one",
        "target_met": None if not ratios or None in ratios else all(r <= TARGET_RATIO for r in ratios),
    }


def _compare_with_unsharded(rows: dict[str, dict], sizes: dict[str, int]) -> None:
    """Each measured row's peak against D = 1's, and D = 1's CPU-seconds per sync times its share: for rows of
    D = 1's dtype only (another dtype's memory and cost are not the same model's)."""
    base = rows.get("D=1", {})
    if "measured" not in base:
        return
    for label, row in rows.items():
        if "measured" in row and row["dtype"] == base["dtype"]:
            row["peak_rss_vs_unsharded"] = row["measured"]["peak_rss_bytes"] / base["measured"]["peak_rss_bytes"]
            share = share_of_values(CONFIGS[label], sizes)
            row["cpu_seconds_formula"] = base["measured"]["cpu_seconds_per_sync"] * share


def _launches(args: argparse.Namespace) -> list[list[str]]:
    """The configurations each launch of fresh processes runs: one each, so that its peak is its own; with --smoke
    those of the same process count share one (their peaks are then not their own, but the suite's test stays
    quick)."""
    if not args.smoke:
        return [[label] for label in args.configs]
    by_processes: dict[int, list[str]] = {}
    for label in args.configs:
        by_processes.setdefault(CONFIGS[label].processes, []).append(label)
    return list(by_processes.values())


def argv_without_configs(argv: list[str]) -> list[str]:
    """`argv` without its `--configs` values (the command to rerun one configuration names its own)."""
    out, skipping = [], False
    for item in argv:
        if item == "--configs":
            skipping = True
        elif skipping and not item.startswith("--"):
            continue
        else:
            skipping = False
            out.append(item)
    return out


def _gb(value: float) -> str:
    return f"{value / 1e9:.2f} GB"


def _table_row(label: str, row: dict) -> str:
    if "measured" not in row:
        return f"| {label} | not run: {row['not_run']}; `{row['command']}` | | | | | | |"
    m, f = row["measured"], row["formula"]
    ratio = f"{row['peak_rss_vs_unsharded']:.2f}x" if "peak_rss_vs_unsharded" in row else "-"
    cpu_formula = f"{row['cpu_seconds_formula']:.2f}" if "cpu_seconds_formula" in row else "-"
    return (
        f"| {label} | {row['dtype']} | {_gb(m['peak_rss_bytes'])} | {ratio} | {_gb(m['rss_above_baseline_bytes'])} "
        f"({_gb(f['rss_above_baseline_bytes'])}) | {m['cpu_seconds_per_sync']:.2f} ({cpu_formula}) "
        f"| {m['wall_seconds_per_sync']:.2f} | {m['intra_worker_bytes_per_sync'] / 1e6:.1f} MB "
        f"({f['intra_worker_bytes_per_sync'] / 1e6:.1f} MB) |"
    )


def markdown(result: dict) -> str:
    lines = [
        f"`{result['command']}`: a Llama of {result['parameters']:,} parameters (largest FSDP unit "
        f"{result['largest_unit']:,}, larger of 2 pipeline stages {result['largest_stage']:,}), one worker, "
        f"{result['steps']} inner steps, H = {result['inner_steps']}, plain DiLoCo; per rank, the largest over the "
        "ranks, measured (formula):",
        "",
        "| configuration | dtype | peak RSS | vs D=1 | above the baseline (formula) | host CPU-s per sync (formula) "
        "| wall s per sync | bytes inside the worker per sync (formula) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += [_table_row(label, row) for label, row in result["configs"].items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="a tiny Llama (seconds; the suite's test)")
    for name, value in FULL.items():
        parser.add_argument(f"--{name}", type=int, default=None, help=f"default {value} ({SMOKE[name]} with --smoke)")
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="the parameters' dtype (of every configuration that does not name its own)",
    )
    parser.add_argument(
        "--mmap_threshold",
        type=int,
        default=2**20,
        help="glibc MALLOC_MMAP_THRESHOLD_ and MALLOC_TRIM_THRESHOLD_ of the ranks, bytes (0: glibc's dynamic default)",
    )
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS), help="what to run")
    parser.add_argument("--out", default=f"{RESULTS_DIR}/scale", help="writes OUT.json and OUT.md")
    args = parser.parse_args(argv)
    for name, value in (SMOKE if args.smoke else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.steps < args.inner_steps:
        parser.error(f"--steps ({args.steps}) must reach at least one sync (--inner_steps {args.inner_steps})")
    argv = list(sys.argv[1:] if argv is None else argv)
    result = measure(args, argv)
    result["command"] = command_line("scale", argv)
    table = markdown(result)
    write_results(args.out, result, table)
    return result


if __name__ == "__main__":
    main()
