"""Host memory and host cost of the engine at scale: the largest Llama this machine fits through the engine, one
worker unsharded (D = 1) and with D = 2 data-parallel ranks, replicated (DDP) and sharded (FSDP2).

    python -m benchmarks.scale            # a 278 M-parameter Llama; writes benchmarks/results/scale.json and .md
    python -m benchmarks.scale --smoke    # a tiny Llama, the same code path, in seconds

Each configuration runs in its own fresh processes (one process per rank, real gloo groups), one after the other,
so its peak is its own; before each the run checks that the machine has the memory the formula below predicts (plus
a margin) and otherwise records the configuration as not run, with the command to run it later. A configuration
trains a Llama built from a config (random init, nothing downloaded) with AdamW for a few inner steps and 2 outer
syncs of plain DiLoCo (H = `--inner_steps`; P = 1, tau = 0, so a sync runs whole inside `engine.step()` and its host
cost is measurable there). Measured per rank, the largest over the ranks, each next to its formula:

- peak RSS (`ru_maxrss`). Formula, N parameters of b bytes, the fp32 outer state of plain DiLoCo (θg, the outer
  momentum, the reused pseudo-gradient and average buffers: 16 bytes per parameter) and the process's own baseline
  (torch and transformers imported, measured before the model is built):
  D = 1: N (b model + b grad + 2b AdamW + 16 outer); DDP: N (4b + b DDP buckets) + 16 N / D; FSDP2:
  N (4b + 16) / D + 4 b U, U the largest FSDP unit (a decoder layer, or the root: embeddings, head, final norm):
  while it runs, its parameters gathered and its all-gather buffer, its gradients unsharded and its reduce-scatter
  buffer.
- host CPU-seconds per sync: this process's CPU time (every thread) inside the `engine.step()` calls, divided by the
  syncs. Formula: D = 1's figure x 1/D (every stage of a sync runs on the rank's 1/D share), plus, with DDP, the
  all-gather of the updated parameters.
- bytes inside the worker per sync (`stats["bytes_sent_intra_worker"]` / syncs). Formula: DDP
  (D - 1) / D x N x 4 (the updated parameters, gathered in fp32 whatever the parameters' dtype), FSDP2 and D = 1: 0
  (a few scalars of the guards).

The ranks run with glibc's mmap threshold fixed at 1 MB (`--mmap_threshold`; see `MALLOC_VARIABLES`), so a peak
is what was live rather than what a fragmented heap kept. The target: the sharded host peak at most 0.6x the
unsharded one.
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
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel
from transformers import LlamaConfig, LlamaForCausalLM

from benchmarks.common import RESULTS_DIR, command_line, write_results
from hf_diloco import DiLoCo, DiLoCoConfig, Topology, worker_mesh

# label -> (data-parallel ranks per worker D, sharded with FSDP2)
CONFIGS = {"D=1": (1, False), "D=2 DDP": (2, False), "D=2 FSDP": (2, True)}
# A Llama of 278 M parameters: 18 layers of hidden 1024 (16 heads, 8 key-value heads, MLP 2816), vocabulary 32000,
# untied head. With AdamW and plain DiLoCo's outer state, ~10 GB per unsharded process: what fits here (24 GB, other
# jobs beside) for D = 1 and for two ranks of D = 2.
FULL = dict(hidden=1024, layers=18, intermediate=2816, vocab=32000, heads=16, kv_heads=8, steps=4, inner_steps=2)
SMOKE = dict(hidden=32, layers=2, intermediate=64, vocab=128, heads=4, kv_heads=2, steps=4, inner_steps=2)
OUTER_BYTES_PER_PARAMETER = 16  # θg, outer momentum, pseudo-gradient buffer, average buffer (fp32)
MARGIN_BYTES = 2 * 2**30  # left free beside a configuration's predicted total before it is started
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


def model_sizes(args: argparse.Namespace) -> dict[str, int]:
    """Parameters N and the largest FSDP unit U, counted on the meta device."""
    with torch.device("meta"):
        model = LlamaForCausalLM(llama_config(args))
    units = [sum(p.numel() for p in unit.parameters()) for unit in fsdp_units(model)]
    total = sum(p.numel() for p in model.parameters())
    units.append(total - sum(units))  # the root's own
    return {"parameters": total, "largest_unit": max(units)}


def _rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _run_rank(ranks: int, sharded: bool, args: argparse.Namespace) -> dict:
    baseline = _rss_bytes()  # torch and transformers imported, the process group up
    dtype = getattr(torch, args.dtype)
    config = DiLoCoConfig(inner_steps=args.inner_steps, data_parallel_per_worker=ranks, sync_timeout_seconds=1800)
    peaks = {}  # the peak so far after each stage: where the peak is reached
    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config(args)).to(dtype)
    peaks["model built"] = _rss_bytes()
    if sharded:
        mesh = worker_mesh(config)
        for unit in fsdp_units(model):
            fully_shard(unit, mesh=mesh)
        fully_shard(model, mesh=mesh)
        peaks["model sharded"] = _rss_bytes()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    topology = Topology.from_default_group(1, ranks, config.sync_timeout_seconds)
    forward = model
    if ranks > 1 and not sharded:
        forward = DistributedDataParallel(model, process_group=topology.data_parallel_group)
    generator = torch.Generator().manual_seed(dist.get_rank())

    def inner_step() -> None:
        ids = torch.randint(0, args.vocab, (ROWS, SEQUENCE), generator=generator)
        forward(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    inner_step()  # AdamW's state exists before the engine does
    peaks["first inner step"] = _rss_bytes()
    engine = DiLoCo(model, optimizer, config, topology=topology)
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
        result = {sharded: _run_rank(job["ranks"], sharded, args) for sharded in job["sharded"]}
        torch.save(result, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _launch(ranks: int, sharded: list[bool], args: argparse.Namespace) -> list[dict]:
    """Each of `sharded` in turn on `ranks` fresh processes; every rank's results by that flag."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    job = {"ranks": ranks, "sharded": sharded, "args": vars(args), "threads": 1}
    saved = {name: os.environ.get(name) for name in MALLOC_VARIABLES}
    if args.mmap_threshold:  # read by glibc when a process starts: the spawned ranks get it
        os.environ.update({name: str(args.mmap_threshold) for name in MALLOC_VARIABLES})
    try:
        with tempfile.TemporaryDirectory() as out:
            mp.spawn(_rank_main, args=(ranks, port, job, out), nprocs=ranks, join=True)
            return [torch.load(Path(out) / f"rank{rank}.pt", weights_only=False) for rank in range(ranks)]
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def formulas(ranks: int, sharded: bool, sizes: dict[str, int], dtype_bytes: int) -> dict[str, float]:
    """Predicted bytes per rank beyond the baseline, and intra-worker bytes per sync (module docstring)."""
    n, b, outer = sizes["parameters"], dtype_bytes, OUTER_BYTES_PER_PARAMETER
    if sharded:
        memory = n * (4 * b + outer) / ranks + 4 * b * sizes["largest_unit"]
    elif ranks > 1:
        memory = n * 5 * b + n * outer / ranks
    else:
        memory = n * (4 * b + outer)
    gathered = 0 if sharded or ranks == 1 else (ranks - 1) / ranks * n * 4
    return {"rss_above_baseline_bytes": memory, "intra_worker_bytes_per_sync": gathered}


def _available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def measure(args: argparse.Namespace, argv: list[str]) -> dict:
    sizes = model_sizes(args)
    dtype_bytes = torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    rows: dict[str, dict] = {}
    for labels in _launches(args):
        ranks = CONFIGS[labels[0]][0]
        predicted = {label: formulas(ranks, CONFIGS[label][1], sizes, dtype_bytes) for label in labels}
        # ~1 GB of baseline per rank beside the formula's part
        needed = max(ranks * (p["rss_above_baseline_bytes"] + 2**30) for p in predicted.values()) + MARGIN_BYTES
        available = _available_bytes()
        if available < needed:
            for label in labels:
                rerun = command_line("scale", [*argv_without_configs(argv), "--configs", label])
                short = f"{available / 2**30:.1f} GiB available, {needed / 2**30:.1f} needed"
                rows[label] = {"not_run": short, "command": rerun}
                print(f"{label}: not run ({short}); run later: {rerun}", flush=True)
            continue
        per_rank = _launch(ranks, [CONFIGS[label][1] for label in labels], args)
        for label in labels:
            results = [rank_results[CONFIGS[label][1]] for rank_results in per_rank]
            measured = {key: max(r[key] for r in results) for key in results[0] if key != "peak_rss_after_bytes"}
            measured["peak_rss_after_bytes"] = {
                stage: max(r["peak_rss_after_bytes"][stage] for r in results)
                for stage in results[0]["peak_rss_after_bytes"]
            }
            measured["rss_above_baseline_bytes"] = max(r["peak_rss_bytes"] - r["baseline_rss_bytes"] for r in results)
            rows[label] = {
                "ranks": ranks,
                "sharded": CONFIGS[label][1],
                "measured": measured,
                "formula": predicted[label],
            }
            print(f"{label}: peak RSS {measured['peak_rss_bytes'] / 1e9:.2f} GB per rank", flush=True)
    base = rows.get("D=1", {}).get("measured")
    for row in rows.values():
        if base and "measured" in row:
            row["peak_rss_vs_unsharded"] = row["measured"]["peak_rss_bytes"] / base["peak_rss_bytes"]
            row["cpu_seconds_formula"] = base["cpu_seconds_per_sync"] / row["ranks"]
    fsdp = rows.get("D=2 FSDP", {}).get("peak_rss_vs_unsharded")
    return {
        **sizes,
        "dtype": args.dtype,
        "workers": 1,
        "inner_steps": args.inner_steps,
        "steps": args.steps,
        "mmap_threshold": args.mmap_threshold,
        "configs": rows,
        "target": "sharded peak RSS <= 0.6x the unsharded one",
        "target_met": None if fsdp is None else fsdp <= 0.6,
    }


def _launches(args: argparse.Namespace) -> list[list[str]]:
    """The configurations each launch of fresh processes runs: one each, so that its peak is its own; with --smoke
    those of the same D share one (their peaks are then not their own, but the suite's test stays quick)."""
    if not args.smoke:
        return [[label] for label in args.configs]
    by_ranks: dict[int, list[str]] = {}
    for label in args.configs:
        by_ranks.setdefault(CONFIGS[label][0], []).append(label)
    return list(by_ranks.values())


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


def markdown(result: dict) -> str:
    lines = [
        f"`{result['command']}`: a Llama of {result['parameters']:,} parameters ({result['dtype']}; largest FSDP unit "
        f"{result['largest_unit']:,}), one worker, {result['steps']} inner steps, H = {result['inner_steps']}, "
        "plain DiLoCo; per rank, the largest over the ranks, measured (formula):",
        "",
        "| configuration | peak RSS | vs D=1 | above the baseline (formula) | host CPU-s per sync (formula) "
        "| wall s per sync | bytes inside the worker per sync (formula) |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, row in result["configs"].items():
        if "measured" not in row:
            lines.append(f"| {label} | not run: {row['not_run']}; `{row['command']}` | | | | | |")
            continue
        m, f = row["measured"], row["formula"]
        ratio = f"{row['peak_rss_vs_unsharded']:.2f}x" if "peak_rss_vs_unsharded" in row else "-"
        cpu_formula = f"{row['cpu_seconds_formula']:.2f}" if "cpu_seconds_formula" in row else "-"
        lines.append(
            f"| {label} | {_gb(m['peak_rss_bytes'])} | {ratio} | {_gb(m['rss_above_baseline_bytes'])} "
            f"({_gb(f['rss_above_baseline_bytes'])}) | {m['cpu_seconds_per_sync']:.2f} ({cpu_formula}) "
            f"| {m['wall_seconds_per_sync']:.2f} | {m['intra_worker_bytes_per_sync'] / 1e6:.1f} MB "
            f"({f['intra_worker_bytes_per_sync'] / 1e6:.1f} MB) |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="a tiny Llama (seconds; the suite's test)")
    for name, value in FULL.items():
        parser.add_argument(f"--{name}", type=int, default=None, help=f"default {value} ({SMOKE[name]} with --smoke)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="the parameters' dtype")
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
