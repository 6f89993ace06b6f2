"""Loss parity at a fixed token budget: single-worker AdamW, DDP, DiLoCo, Streaming fp4, eager/delayed, M = 4.

    python scripts/bench_quality.py            # 1.38 M parameters, 819,200 tokens (0.6 per parameter)
    python scripts/bench_quality.py --long     # 229 k parameters, 1,720,320 tokens (7.5 per parameter)

A thin front end of `scripts/bench_comm.py` (same model, data, optimizer and byte counting): every method trains on
the same total number of tokens, so a method with M workers runs 1/M of the single worker's steps per worker. Writes
benchmarks/quality.{md,json,png} (`--long`: benchmarks/quality_long.*). Other flags go to bench_comm.py (`--seed`).

`--long` trades model size for tokens per parameter on the same 2-core budget: hidden 64, 4 layers, a 1024-token
vocabulary, 600 corpus files; 12x more tokens per parameter than the default, closer to how pretraining runs are
actually sized (the papers compare methods at ~20 tokens per parameter).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

# Outer optimizer for these short runs (4-16 outer rounds), picked by the sweeps in benchmarks/sweeps/ (BENCHMARKS.md
# section 5): the paper's outer_lr 0.7 / Nesterov 0.9 remembers ~10 rounds, longer than these runs, and cost 10% of
# loss here. Streaming DiLoCo (its tau/alpha merge pulls the local model towards theta_g) did best with a larger step.
SHORT_RUN_OUTER = "outer_lr=0.5,outer_momentum=0.5"
STREAMING_OUTER = "outer_lr=0.8,outer_momentum=0.3"

QUALITY_METHODS = [
    "ddp@1",  # one worker, plain AdamW (DDP over a single process sends nothing)
    f"diloco_h50:{SHORT_RUN_OUTER}@1",  # M = 1 (Scaling Laws for DiLoCo, arXiv 2503.09799: slightly better than AdamW)
    "ddp@2",
    f"diloco_h50:{SHORT_RUN_OUTER}@2",
    f"streaming_fp4:{STREAMING_OUTER}@2",
    f"diloco_fp4:{SHORT_RUN_OUTER}@2",  # H = 100, no overlap: the reference for eager, delayed and adaptive
    f"eager_fp4:{SHORT_RUN_OUTER}@2",
    f"eager_fp4:{SHORT_RUN_OUTER},eager_estimate=fitted@2",
    f"delayed_fp4:{SHORT_RUN_OUTER}@2",
    f"adaptive_fp4:{SHORT_RUN_OUTER}@2",
    f"diloco_h50:{SHORT_RUN_OUTER}@4",
]


LONG_RUN = {
    "--token_budget": str(1680 * 8 * 128),
    "--model": json.dumps({"hidden_size": 64, "num_hidden_layers": 4, "intermediate_size": 128}),
    "--vocab_size": "1024",
    "--train_files": "600",
    "--out": "benchmarks/quality_long",
}


def regime_defaults(long: bool) -> dict[str, str]:
    """bench_comm.py flags of a regime: the default one (0.6 tokens per parameter) or `--long` (7.5)."""
    return dict(LONG_RUN) if long else {"--token_budget": str(800 * 8 * 128), "--out": "benchmarks/quality"}


def with_defaults(argv: list[str], defaults: dict[str, str]) -> list[str]:
    """`argv` plus every flag of `defaults` it does not set itself."""
    return argv + [item for flag, value in defaults.items() if flag not in argv for item in (flag, value)]


def main(argv: list[str] | None = None) -> None:
    import bench_comm

    argv = list(sys.argv[1:] if argv is None else argv)
    long = "--long" in argv
    if long:
        argv.remove("--long")
    if "--methods" not in argv:
        argv += ["--methods", *QUALITY_METHODS]
    bench_comm.main(with_defaults(argv, regime_defaults(long)))


if __name__ == "__main__":
    main()
