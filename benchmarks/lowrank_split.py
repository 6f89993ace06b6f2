"""Host cost of one low-rank (PowerSGD) sync per rank, with each worker's fragment split between D = 2 ranks.

    python -m benchmarks.lowrank_split                      # this code
    python -m benchmarks.lowrank_split --before b660c1d     # and hf_diloco as it is in revision b660c1d, after it

2 workers x D data-parallel ranks (one gloo process each, one torch thread) average a Llama-shaped fragment (the
matrices of `--layers` decoder layers of hidden `--hidden` and MLP `--intermediate`, their norms, the embedding
and the head of `--vocab` rows) with `OuterExchange` and a `LowRankCompressor` of rank `--rank`, as the engine does:
each rank holds a contiguous share of the fragment's flat pseudo-gradient (a `ShardLayout`) plus its residual. A
sync runs inline on the calling thread (`blocking=True`); measured per rank and sync: the process's CPU seconds
(every thread, gloo's included), wall seconds, and the bytes sent inside the worker and across workers. Each figure
is the median over `--rounds` syncs after one warm-up, then the largest over the ranks. `--before REV` runs the same
job with `hf_diloco` exported from git revision REV (its code first on `PYTHONPATH` of a child process).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.common import command_line

WORKERS = 2


def fragment_shapes(args: argparse.Namespace) -> list[tuple[int, ...]]:
    """The tensors of a Llama's embedding, decoder layers and head, in model order."""
    h, f = args.hidden, args.intermediate
    layer = [(h, h), (h // 2, h), (h // 2, h), (h, h), (f, h), (f, h), (h, f), (h,), (h,)]
    return [(args.vocab, h), *layer * args.layers, (h,), (args.vocab, h)]


def _rank_main(rank: int, world: int, port: int, job: dict, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=1800))
    try:
        torch.save(_measure_rank(argparse.Namespace(**job)), Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _measure_rank(args: argparse.Namespace) -> dict:
    from hf_diloco.core.compression.codecs import make_codec
    from hf_diloco.core.compression.lowrank import LowRankCompressor
    from hf_diloco.core.exchange.exchange import OuterExchange
    from hf_diloco.core.layout.shard import ShardLayout
    from hf_diloco.core.layout.topology import Topology

    topology = Topology.from_default_group(data_parallel_per_worker=args.ranks)
    shapes = fragment_shapes(args)
    numel = sum(torch.Size(shape).numel() for shape in shapes)
    span = -(-numel // args.ranks)
    layout = ShardLayout(numel, tuple(((k * span, min(span, numel - k * span)),) for k in range(args.ranks)))
    offset, length = layout.runs[topology.dp_index][0]
    exchange = OuterExchange(topology, make_codec(args.compression), keep_residual=True)
    compressor = LowRankCompressor(shapes, args.rank, seed=0)
    generator = torch.Generator().manual_seed(topology.worker_index)
    residual = torch.zeros(length)
    cpu, wall, intra, sent = [], [], [], []
    for _ in range(args.rounds + 1):
        share = torch.randn(numel, generator=generator)[offset : offset + length] + residual
        started_cpu, started = time.process_time(), time.perf_counter()
        result = exchange.launch(share, "benchmark", blocking=True, compressor=compressor, layout=layout).wait()
        cpu.append(time.process_time() - started_cpu)
        wall.append(time.perf_counter() - started)
        intra.append(result.bytes_sent_intra_worker)
        sent.append(result.bytes_sent)
        residual = result.residual if result.residual is not None else residual
    exchange.close()
    return {
        "cpu_seconds": statistics.median(cpu[1:]),
        "wall_seconds": statistics.median(wall[1:]),
        "intra_bytes": statistics.median(intra[1:]),
        "sent_bytes": statistics.median(sent[1:]),
        "numel": numel,
    }


def measure(args: argparse.Namespace) -> dict:
    """Every rank's medians for this process's `hf_diloco`, and the largest over the ranks."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    world = WORKERS * args.ranks
    job = {k: v for k, v in vars(args).items() if k not in ("before", "json")}
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_rank_main, args=(world, port, job, out), nprocs=world, join=True)
        ranks = [torch.load(Path(out) / f"rank{rank}.pt", weights_only=False) for rank in range(world)]
    worst = {key: max(r[key] for r in ranks) for key in ("cpu_seconds", "wall_seconds", "intra_bytes", "sent_bytes")}
    return {"per_rank": ranks, "max": worst, "numel": ranks[0]["numel"]}


def measure_revision(revision: str, argv: list[str]) -> dict:
    """`measure` in a child process with `hf_diloco` as it is in git revision `revision`."""
    root = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory() as tree:
        archive = subprocess.run(["git", "archive", revision, "hf_diloco"], cwd=root, capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", tree], input=archive.stdout, check=True)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([tree, str(root)]))
        output = Path(tree) / "result.json"
        command = [sys.executable, "-m", "benchmarks.lowrank_split", *_without_before(argv), "--json", str(output)]
        subprocess.run(command, cwd=tree, env=env, check=True)  # its directory first on the path: its hf_diloco
        return json.loads(output.read_text())


def _without_before(argv: list[str]) -> list[str]:
    out, skip = [], False
    for item in argv:
        if skip:
            skip = False
            continue
        if item == "--before":
            skip = True
            continue
        if not item.startswith("--before="):
            out.append(item)
    return out


def table(rows: dict[str, dict]) -> str:
    lines = [
        "| code | CPU s per sync per rank | wall s | bytes inside the worker | bytes across workers |",
        "|---|---|---|---|---|",
    ]
    for name, row in rows.items():
        worst = row["max"]
        lines.append(
            f"| {name} | {worst['cpu_seconds']:.3f} | {worst['wall_seconds']:.3f} | {worst['intra_bytes']:,.0f} "
            f"| {worst['sent_bytes']:,.0f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=688)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--rank", type=int, default=8, help="PowerSGD rank")
    parser.add_argument("--ranks", type=int, default=2, help="data-parallel ranks per worker (D)")
    parser.add_argument("--compression", default="none")
    parser.add_argument("--rounds", type=int, default=5, help="syncs measured after one warm-up")
    parser.add_argument("--before", default=None, help="also run hf_diloco of this git revision")
    parser.add_argument("--json", default=None, help="write the results here as JSON")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    rows = {"this code": measure(args)}
    if args.before:
        rows[args.before] = measure_revision(args.before, argv)
    if args.json:
        Path(args.json).write_text(json.dumps(rows["this code"]))
        return
    print(command_line("lowrank_split", argv))
    print(f"{rows['this code']['numel']:,} parameters, {WORKERS} workers x D = {args.ranks}, rank {args.rank}")
    print(table(rows))


if __name__ == "__main__":
    main()
