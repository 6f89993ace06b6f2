"""Loss parity at a fixed token budget: single-worker AdamW, DDP, DiLoCo, Streaming fp4, eager/delayed, M = 4.

    python -m benchmarks.quality            # 1.38 M parameters, 819,200 tokens (0.6 per parameter)
    python -m benchmarks.quality --long     # 229 k parameters, 1,720,320 tokens (7.5 per parameter)

A front end of `benchmarks.comm` (same model, data, optimizer and byte counting): every method trains on the same
total number of tokens, so a method with M workers runs 1/M of the single worker's steps per worker. Writes
benchmarks/results/quality.{md,json,png} (`--long`: quality_long.*). The methods are the preset `--preset` names
(default `parity`, the methods of the stored tables) unless `--methods` lists them; other flags go to
`benchmarks.comm` (`--seed`, `--out`).

`--long` trades model size for tokens per parameter on the same 2-core budget (`REGIMES` in `benchmarks.common`):
12x more tokens per parameter than the default, closer to how pretraining runs are actually sized (the papers
compare methods at ~20 tokens per parameter).
"""

from __future__ import annotations

import argparse
import sys

from benchmarks import comm
from benchmarks.common import REGIMES, RESULTS_DIR, with_defaults

# Outer optimizer for these short runs (4-16 outer rounds), picked by the outer-optimizer sweep of BENCHMARKS.md's
# loss parity: the paper's outer_lr 0.7 / Nesterov 0.9 remembers ~10 rounds, longer than these runs, and cost 10% of
# loss here. Streaming DiLoCo (its tau/alpha merge pulls the local model towards theta_g) did best with a larger step.
SHORT_RUN_OUTER = "outer_lr=0.5,outer_momentum=0.5"
STREAMING_OUTER = "outer_lr=0.8,outer_momentum=0.3"

OUTPUTS = {"short": "quality", "long": "quality_long"}  # under benchmarks/results/, unless --out
PRESETS = {
    # The methods of results/quality.json and results/quality_long.json, in their order.
    "parity": [
        "ddp@1",  # one worker, plain AdamW (DDP over a single process sends nothing)
        f"diloco_h50:{SHORT_RUN_OUTER}@1",  # M = 1 (Scaling Laws for DiLoCo, arXiv 2503.09799: better than AdamW)
        "ddp@2",
        f"diloco_h50:{SHORT_RUN_OUTER}@2",
        f"streaming_fp4:{STREAMING_OUTER}@2",
        f"diloco_fp4:{SHORT_RUN_OUTER}@2",  # H = 100, no overlap: the reference for eager, delayed and adaptive
        f"eager_fp4:{SHORT_RUN_OUTER}@2",
        f"delayed_fp4:{SHORT_RUN_OUTER}@2",
        f"adaptive_fp4:{SHORT_RUN_OUTER}@2",
        f"diloco_h50:{SHORT_RUN_OUTER}@4",
    ],
}


def comm_arguments(argv: list[str]) -> list[str]:
    """The `benchmarks.comm` arguments of a `benchmarks.quality` command line."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--long", action="store_true", help="7.5 tokens per parameter instead of 0.6.")
    parser.add_argument("--preset", choices=sorted(PRESETS), help="The methods (default parity), unless --methods.")
    args, rest = parser.parse_known_args(argv)
    listed = any(item == "--methods" or item.startswith("--methods=") for item in rest)
    if listed and args.preset:
        parser.error("give either --preset or --methods, not both")
    if not listed:
        rest += ["--methods", *PRESETS[args.preset or "parity"]]
    regime = "long" if args.long else "short"
    return with_defaults(rest, {**REGIMES[regime], "--out": f"{RESULTS_DIR}/{OUTPUTS[regime]}"})


def main(argv: list[str] | None = None) -> list[dict]:
    return comm.main(comm_arguments(list(sys.argv[1:] if argv is None else argv)))


if __name__ == "__main__":
    main()
