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

# Outer optimizer for short runs, picked by the sweep in BENCHMARKS.md section 5 (8-16 outer rounds): the paper's
# outer_lr 0.7 / Nesterov 0.9 remembers ~10 rounds, longer than these runs, and lost 10% of loss here.
SHORT_RUN_OUTER = "outer_lr=0.5,outer_momentum=0.5"

QUALITY_METHODS = [
    "ddp@1",  # one worker, plain AdamW (DDP over a single process sends nothing)
    f"diloco_h50:{SHORT_RUN_OUTER}@1",  # M = 1 (Scaling Laws for DiLoCo, arXiv 2503.09799: slightly better than AdamW)
    "ddp@2",
    f"diloco_h50:{SHORT_RUN_OUTER}@2",
    f"streaming_fp4:{SHORT_RUN_OUTER}@2",
    f"diloco_fp4:{SHORT_RUN_OUTER}@2",  # no overlap, the reference for eager and delayed
    f"eager_fp4:{SHORT_RUN_OUTER}@2",
    f"delayed_fp4:{SHORT_RUN_OUTER}@2",
    f"diloco_h50:{SHORT_RUN_OUTER}@4",
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
