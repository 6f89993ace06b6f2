"""Sync wall time and bytes per rank as the number of workers grows, for both exchange patterns, against the formulas.

    python -m benchmarks.scaling --workers 2 4 8

M workers (one process each on this machine, joined by gloo) hold the same small Llama (`--model`, the default bench
model of 1.38 M parameters); in each of `--rounds` rounds every worker moves its parameters by its own random step and
calls `engine.step()` of a DiLoCo engine with `inner_steps: 1`, so that every step is one blocking outer sync of the
whole model (`--compression`, default fp4). Per M and `exchange_pattern` it records the bytes this rank sent per sync
(`stats["bytes_sent"]`) and the median wall time of a sync (the slowest worker's, after one warm-up round), next to
what the patterns cost by their definition, for the encoded payload E of the whole padded model on one rank:

- `reduce_scatter`: each rank sends M - 1 encoded chunks of E / M, then its averaged chunk to the M - 1 others:
  2 (M - 1) / M x E, flat in M (the bandwidth-optimal all-reduce);
- `all_gather`: each rank sends its whole encoded vector to the M - 1 others: (M - 1) x E, linear in M.

The processes share this machine's cores, so the wall times rise with M from the CPU work (each of the M processes
encodes, decodes and sums) as well as from the bytes; no link is emulated (loopback). Writes OUT.json and OUT.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.common import RESULTS_DIR, command_line, exchange_bytes, run_on_workers

PATTERNS = ("reduce_scatter", "all_gather")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--rounds", type=int, default=6, help="Syncs per pattern; the first is a warm-up.")
    parser.add_argument("--compression", default="fp4")
    parser.add_argument("--model", default="", help="JSON overrides of the default model config.")
    parser.add_argument("--out", default=f"{RESULTS_DIR}/scaling", help="Writes OUT.json and OUT.md.")
    return parser


def main(argv: list[str] | None = None) -> list[dict]:
    args = build_parser().parse_args(argv)
    if args.rounds < 2:
        build_parser().error("--rounds must be at least 2: the first sync is a warm-up")
    rows = []
    for workers in args.workers:
        print(f"{workers} workers ...", flush=True)
        outcome = run_on_workers(sync_worker, workers, args.compression, args.rounds, args.model, timeout_seconds=1800)
        for pattern in PATTERNS:
            per_rank = [rank_result[pattern] for rank_result in outcome]
            payload = per_rank[0]["payload_bytes"]
            slowest = [max(seconds) for seconds in zip(*(r["seconds"] for r in per_rank))][1:]
            rows.append(
                {
                    "workers": workers,
                    "pattern": pattern,
                    "parameters": per_rank[0]["parameters"],
                    "payload_bytes": payload,
                    "bytes_per_sync": [r["bytes_per_sync"] for r in per_rank],
                    "formula_bytes": exchange_bytes(pattern, workers, payload, schedule_tag=True, clip_norm=True),
                    "sync_seconds": statistics.median(slowest),
                }
            )
    write_report(rows, args, argv)
    return rows


def sync_worker(rank: int, world: int, compression: str, rounds: int, model_json: str) -> dict:
    """One worker: per pattern, `rounds` blocking syncs of the whole model; its bytes and seconds per sync."""
    from hf_diloco import DiLoCo, DiLoCoConfig
    from hf_diloco.core.compression.codecs import make_codec
    from hf_diloco.job.modeling import DEFAULT_MODEL_CONFIG, build_model

    model = build_model({"config": {**DEFAULT_MODEL_CONFIG, **json.loads(model_json or "{}")}}, 4096, seed=0)
    numel = sum(p.numel() for p in model.parameters())
    codec = make_codec(compression)
    padded = -(-numel // (world * codec.align)) * world * codec.align
    step = torch.Generator().manual_seed(rank)
    results = {}
    for pattern in PATTERNS:
        config = DiLoCoConfig(
            inner_steps=1, outer_lr=1.0, outer_momentum=0.0, compression=compression, exchange_pattern=pattern
        )
        engine = DiLoCo(model, None, config)
        seconds = []
        for _ in range(rounds):
            with torch.no_grad():
                for param in model.parameters():
                    param.add_(torch.randn(param.shape, generator=step), alpha=1e-3)
            dist.barrier()  # every worker starts the sync together: its time is the sync's, not a neighbour's lag
            started = time.perf_counter()
            engine.step()
            seconds.append(time.perf_counter() - started)
        results[pattern] = {
            "parameters": numel,
            "payload_bytes": codec.encoded_nbytes(padded),
            "bytes_per_sync": engine.stats["bytes_sent"] / rounds,
            "seconds": seconds,
        }
        engine.close()
    return results


def write_report(rows: list[dict], args: argparse.Namespace, argv: list[str] | None) -> None:
    command = command_line("scaling", argv)
    lines = [
        f"`{command}` ({rows[0]['parameters']:,} parameters, {args.compression}: a whole-model payload E of "
        f"{rows[0]['payload_bytes']:,} bytes at M = {rows[0]['workers']})",
        "",
        "| M | pattern | bytes per sync per rank | by the formula | measured / formula | x E | sync wall time (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        sent = row["bytes_per_sync"][0]
        lines.append(
            f"| {row['workers']} | `{row['pattern']}` | {sent:,.0f} | {row['formula_bytes']:,.0f} | "
            f"{sent / row['formula_bytes']:.4f} | {sent / row['payload_bytes']:.3f} | {row['sync_seconds']:.3f} |"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.md").write_text("\n".join(lines) + "\n")
    Path(f"{out}.json").write_text(json.dumps({"command": command, "rows": rows}, indent=2))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
