"""Per-rank memory of the DiLoCo engine with D = 1, 2, 4 data-parallel ranks per worker, and a projection to 1B / 7B /
70B models with D = 8.

    python -m benchmarks.memory          # writes benchmarks/results/memory.json and benchmarks/results/memory.md

Two workers of D ranks each (2 D real gloo processes on this machine) train a Llama built from a config (random
init) for a few rounds in every mode below, with the model replicated on the D ranks (DDP) and sharded over them
(FSDP2, `fully_shard` over `hf_diloco.worker_mesh`). Measured per rank:

- `outer_state_bytes`: `engine.stats["outer_state_bytes"]` after the last step (θg, outer momentum, eager's trajectory
  and its momentum, residuals, low-rank warm starts, exchanges in flight): exact, counted by the engine.
- peak RSS: the process's peak resident memory (`ru_maxrss`) after the first mode's run, each (D, sharding) in fresh
  processes that run that mode first, and the engine's part of it: that peak minus the peak before the engine was
  created (the model, the inner optimizer's state after one warm-up step, torch itself).

The projection multiplies each mode's outer-state bytes per parameter at D = 1 by the parameter count of three
public model configurations (instantiated on the meta device, nothing downloaded), per rank for D = 8 with the state
sharded (1/D) and replicated (every rank holding all of it), and per node of 8 ranks.
Low rank's warm start is not proportional to the parameter count; the projection leaves it out.
"""

from __future__ import annotations

import argparse
import datetime
import os
import resource
import socket
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel
from transformers import LlamaConfig, LlamaForCausalLM

from benchmarks.common import RESULTS_DIR, command_line, write_results
from hf_diloco import DiLoCo, DiLoCoConfig, Topology, worker_mesh

WORKERS = 2
RANKS = (1, 2, 4)
PROJECTED_RANKS = 8
# mode -> (label in the tables, DiLoCo settings); inner_steps H = 8 throughout
MODES = {
    "diloco": ("DiLoCo", dict()),
    "streaming": ("Streaming (P=4, tau=1)", dict(num_fragments=4, sync_delay=1)),
    "eager": ("Eager (P=4)", dict(num_fragments=4, overlap="eager")),
    "delayed_int8_ef": ("Delayed, int8 + error feedback", dict(overlap="delayed", compression="int8", error_feedback=True)),
    "lowrank8_fp8_ef": ("Low rank 8, fp8 + error feedback", dict(lowrank_rank=8, compression="fp8", error_feedback=True)),
}  # fmt: skip
RSS_MODE = "eager"
# Public configurations: Llama 3.2 1B, Llama 2 7B, Llama 3 70B.
PROJECTED_MODELS = {
    "1B": dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True,
    ),
    "7B": dict(
        hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, vocab_size=32000, tie_word_embeddings=False,
    ),
    "70B": dict(
        hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
        num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False,
    ),
}  # fmt: skip


def bench_model(hidden: int, layers: int, vocab: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _run_mode(settings: dict, ranks: int, sharded: bool, args: argparse.Namespace) -> dict:
    config = DiLoCoConfig(inner_steps=8, data_parallel_per_worker=ranks, **settings)
    model = bench_model(args.hidden, args.layers, args.vocab)
    if sharded:
        mesh = worker_mesh(config)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(dist.get_rank())

    def inner_step(forward: torch.nn.Module) -> None:
        ids = torch.randint(0, args.vocab, (2, 32), generator=generator)
        forward(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    topology = Topology.from_default_group(1, ranks, config.sync_timeout_seconds)
    forward = model
    if ranks > 1 and not sharded:
        forward = DistributedDataParallel(model, process_group=topology.data_parallel_group)
    inner_step(forward)  # the inner optimizer's state exists before the engine does
    before = _peak_rss_bytes()
    engine = DiLoCo(model, optimizer, config, topology=topology)
    for _ in range(args.steps):
        inner_step(forward)
        engine.step()
    held = engine.stats["outer_state_bytes"]
    engine.close()
    return {
        "outer_state_bytes": held,
        "peak_rss_bytes": _peak_rss_bytes(),
        "engine_rss_bytes": _peak_rss_bytes() - before,
        "parameters": sum(p.numel() for p in model.parameters()),
    }


def _rank_main(rank: int, world: int, port: int, job: dict, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600))
    try:
        args = argparse.Namespace(**job["args"])
        results = {
            (name, sharded): _run_mode(MODES[name][1], job["ranks"], sharded, args)
            for name in job["modes"]
            for sharded in job["sharded"]
        }
        torch.save(results, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _launch(ranks: int, modes: list[str], sharded: list[bool], args: argparse.Namespace) -> list[dict]:
    """Every mode on WORKERS x `ranks` fresh processes; returns each rank's results."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    world = WORKERS * ranks
    job = {"ranks": ranks, "modes": modes, "sharded": sharded, "args": vars(args)}
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_rank_main, args=(world, port, job, out), nprocs=world, join=True)
        return [torch.load(Path(out) / f"rank{rank}.pt", weights_only=False) for rank in range(world)]


def _column(ranks: int, sharded: bool) -> str:
    return f"D={ranks} {'FSDP' if sharded else 'DDP'}"


def measure(args: argparse.Namespace) -> dict:
    """Outer-state bytes of `args.modes` and peak RSS of the first of them (`RSS_MODE` by default), the largest over
    ranks, by (D, sharding): one launch of fresh processes per (D, sharding), the first mode run first, so its peak
    is not one an earlier run left."""
    outer: dict[str, dict[str, int]] = {name: {} for name in args.modes}
    rss: dict[str, dict[str, int]] = {}
    rss_mode = args.modes[0]
    parameters = 0
    for ranks in args.ranks:
        for sharded in [False] if ranks == 1 else [False, True]:  # one rank: nothing to shard
            column = _column(ranks, sharded)
            per_rank = _launch(ranks, args.modes, [sharded], args)
            for name in args.modes:
                outer[name][column] = max(result[name, sharded]["outer_state_bytes"] for result in per_rank)
            rss[column] = {
                key: max(result[rss_mode, sharded][key] for result in per_rank)
                for key in ("peak_rss_bytes", "engine_rss_bytes")
            }
            parameters = per_rank[0][rss_mode, sharded]["parameters"]
    return {
        "parameters": parameters,
        "outer_state_bytes": outer,
        "rss_mode": rss_mode,
        "rss": rss,
        "projection": project(outer, parameters),
    }


def project(outer: dict[str, dict[str, int]], parameters: int) -> dict:
    """Outer-state bytes per rank and per node of `PROJECTED_RANKS` ranks for the projected models."""
    counts = {}
    for label, fields in PROJECTED_MODELS.items():
        with torch.device("meta"):
            counts[label] = sum(p.numel() for p in LlamaForCausalLM(LlamaConfig(**fields)).parameters())
    table = {}
    for name in outer:
        if MODES[name][1].get("lowrank_rank"):
            continue
        per_parameter = outer[name][_column(1, False)] / parameters
        table[name] = {
            "bytes_per_parameter": per_parameter,
            **{
                label: {
                    "parameters": count,
                    "sharded_per_rank": per_parameter * count / PROJECTED_RANKS,
                    "sharded_per_node": per_parameter * count,
                    "replicated_per_rank": per_parameter * count,
                    "replicated_per_node": per_parameter * count * PROJECTED_RANKS,
                }
                for label, count in counts.items()
            },
        }
    return table


def _gb(value: float) -> str:
    return f"{value / 1e9:.1f} GB"


def _mb(value: float) -> str:
    return f"{value / 1e6:.2f} MB"


def markdown(result: dict, command: str) -> str:
    outer, rss, projection = result["outer_state_bytes"], result["rss"], result["projection"]
    columns = list(next(iter(outer.values())))
    lines = [
        f"`{command}` ({result['parameters']:,} parameters, {WORKERS} workers of D ranks)",
        "",
        'Outer-state bytes per rank (`engine.stats["outer_state_bytes"]`, the largest over ranks):',
        "",
        "| mode | " + " | ".join(columns) + " |",
        "|---|" + "---|" * len(columns),
    ]
    for name in outer:
        base = outer[name][_column(1, False)]
        cells = [f"{_mb(outer[name][c])} ({outer[name][c] / base:.2f}x)" for c in columns]
        lines.append(f"| {MODES[name][0]} | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"Peak resident memory per rank, {MODES[result['rss_mode']][0]} (the engine's part: the peak after the run minus "
        "the peak before it):",
        "",
        "| ranks per worker | peak RSS | the engine's part |",
        "|---|---|---|",
    ]
    for label, values in rss.items():
        lines.append(f"| {label} | {_mb(values['peak_rss_bytes'])} | {_mb(values['engine_rss_bytes'])} |")
    labels = list(PROJECTED_MODELS)
    lines += [
        "",
        f"Projected outer state with D = {PROJECTED_RANKS} ranks per node (bytes per parameter measured at D = 1):",
        "",
        "| mode | bytes / parameter | "
        + " | ".join(f"{label}: per rank, per node (replicated: per rank, per node)" for label in labels)
        + " |",
        "|---|---|" + "---|" * len(labels),
    ]
    for name, row in projection.items():
        cells = [
            f"{_gb(row[label]['sharded_per_rank'])}, {_gb(row[label]['sharded_per_node'])} "
            f"({_gb(row[label]['replicated_per_rank'])}, {_gb(row[label]['replicated_per_node'])})"
            for label in labels
        ]
        lines.append(f"| {MODES[name][0]} | {row['bytes_per_parameter']:.1f} | " + " | ".join(cells) + " |")
    counts = ", ".join(f"{label} = {next(iter(projection.values()))[label]['parameters']:,}" for label in labels)
    lines += ["", f"Parameters: {counts}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256, help="hidden size of the benchmark Llama")
    parser.add_argument("--layers", type=int, default=4, help="its decoder layers")
    parser.add_argument("--vocab", type=int, default=4096, help="its vocabulary")
    parser.add_argument("--steps", type=int, default=20, help="inner steps per run (H = 8)")
    parser.add_argument(
        "--ranks", type=int, nargs="+", default=list(RANKS), help="data-parallel ranks per worker (D); 1 is needed"
    )
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=list(MODES),
        default=[RSS_MODE, *(name for name in MODES if name != RSS_MODE)],
        help="modes to measure; the first one's peak RSS is measured too",
    )
    parser.add_argument("--out", default=f"{RESULTS_DIR}/memory", help="writes OUT.json and OUT.md")
    args = parser.parse_args(argv)
    if 1 not in args.ranks:
        parser.error("--ranks must include 1: every ratio and the projection are relative to one rank per worker")
    result = measure(args)
    result["command"] = command_line("memory", argv)
    table = markdown(result, result["command"])
    write_results(args.out, result, table)
    return result


if __name__ == "__main__":
    main()
