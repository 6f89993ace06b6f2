"""Loss parity at a fixed token budget: single-worker AdamW, DDP, DiLoCo, Streaming fp4, eager/delayed, M = 4.

    python scripts/bench_quality.py --token_budget 1638400

A thin front end of `scripts/bench_comm.py` (same model, data, optimizer and byte counting): every method trains on
the same total number of tokens, so a method with M workers runs 1/M of the single worker's steps per worker. Writes
benchmarks/quality.{md,json,png}.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

QUALITY_METHODS = [
    "ddp@1",  # one worker, plain AdamW (DDP over a single process sends nothing)
    "diloco_h50@1",  # DiLoCo with M = 1 (Scaling Laws for DiLoCo, arXiv 2503.09799: slightly better than AdamW)
    "ddp@2",
    "diloco_h50@2",
    "streaming_fp4@2",
    "eager_fp4@2",
    "delayed_fp4@2",
    "diloco_h50@4",
]


def main(argv: list[str] | None = None) -> None:
    import bench_comm

    argv = list(sys.argv[1:] if argv is None else argv)
    if "--methods" not in argv:
        argv += ["--methods", *QUALITY_METHODS]
    if "--token_budget" not in argv:
        argv += ["--token_budget", str(1600 * 8 * 128)]
    if "--out" not in argv:
        argv += ["--out", "benchmarks/quality"]
    bench_comm.main(argv)


if __name__ == "__main__":
    main()
