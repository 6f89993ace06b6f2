"""Per-seed loss gaps from several `benchmarks.comm` / `benchmarks.quality` runs, with their mean and standard error.

    python -m benchmarks.quality --long --seed 1 --out runs/long_seed1      # and so on for every seed
    python -m benchmarks.seed_table benchmarks/results/quality_long.json runs/long_seed*.json \
        --versus eager_fp4=diloco_fp4 adaptive_fp4=eager_fp4

Each JSON is one run (one `--seed`, read from its command line); runs of the same seed are merged. A method is
compared with the DDP run of the same seed and the same number of workers (`ddp@1`, plain AdamW, for single-worker
methods; the multi-worker DDP run for the others), or with the method named by `--versus name=reference` (method names
without overrides, e.g. `eager_fp4`), or by `--pair METHOD REFERENCE` (full method names, overrides and `@workers`
included: two settings of one method); a method named in several pairs gets a row for each reference. A method may appear in several files of one seed only with the same eval loss
(a deterministic rerun); it is then counted once.
The gap is `loss / reference - 1`; a method is reported only for the seeds where it and its reference both ran.
`--losses` prints the eval losses themselves (per seed and their mean over the seeds a method ran), e.g. for a grid of
learning rates where every setting is a candidate rather than a comparison.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path


def load_run(path: Path) -> tuple[int, list[dict]]:
    run = json.loads(path.read_text())
    match = re.search(r"--seed (\d+)", run["command"])
    return (int(match.group(1)) if match else 0), run["results"]


def base_name(method: str) -> str:
    return method.split("@")[0].split(":")[0]


def references_of(result: dict, results: list[dict], versus: list[tuple[str, str]]) -> list[dict]:
    """What `result` is compared with: every reference named for its full name, else for its base name, else DDP."""
    named = [ref for method, ref in versus if method == result["method"]]
    named = named or [ref for method, ref in versus if method == base_name(result["method"])]
    references = []
    for wanted in named or [None]:
        for other in results:
            if other is result or other["workers"] != result["workers"]:
                continue
            if wanted in (other["method"], base_name(other["method"])) or (
                wanted is None and base_name(other["method"]) == "ddp"
            ):
                references.append(other)
                break
    return references


def load_runs(paths: list[Path]) -> dict[int, list[dict]]:
    """The results of several runs by seed; a method in two files of one seed must have the same eval loss."""
    runs: dict[int, list[dict]] = {}
    for path in paths:
        seed, results = load_run(path)
        earlier = {r["method"]: r["eval_loss"] for r in runs.get(seed, [])}
        differing = sorted(r["method"] for r in results if earlier.get(r["method"], r["eval_loss"]) != r["eval_loss"])
        if differing:
            raise ValueError(f"{path}: seed {seed} already has {differing} from another file, with another eval loss")
        runs.setdefault(seed, []).extend(r for r in results if r["method"] not in earlier)
    return runs


def gaps_by_pair(
    runs: dict[int, list[dict]], versus: list[tuple[str, str]]
) -> dict[tuple[str, str], dict[int, float]]:
    """(method, reference) -> seed -> eval-loss gap (a fraction), for every method and each of its references."""
    gaps: dict[tuple[str, str], dict[int, float]] = {}
    for seed in sorted(runs):
        for result in runs[seed]:
            for reference in references_of(result, runs[seed], versus):
                row = gaps.setdefault((result["method"], reference["method"]), {})
                row[seed] = result["eval_loss"] / reference["eval_loss"] - 1
    return gaps


def gap_table(runs: dict[int, list[dict]], versus: list[tuple[str, str]]) -> list[str]:
    seeds = sorted(runs)
    rows = []
    for (method, reference), per_seed in gaps_by_pair(runs, versus).items():
        values = list(per_seed.values())
        error = f"{100 * statistics.stdev(values) / len(values) ** 0.5:.2f}%" if len(values) > 1 else "-"
        cells = {seed: f"{100 * gap:+.2f}%" for seed, gap in per_seed.items()}
        rows.append(([method, reference], cells, [f"**{100 * statistics.fmean(values):+.2f}%**", error]))
    return _markdown(seeds, ["method", "vs"], rows, ["mean", "std. error"])


def loss_table(runs: dict[int, list[dict]]) -> list[str]:
    seeds = sorted(runs)
    losses: dict[str, dict[int, float]] = {}
    for seed in seeds:
        for result in runs[seed]:
            losses.setdefault(result["method"], {})[seed] = result["eval_loss"]
    rows = [
        (
            [method],
            {seed: f"{loss:.4f}" for seed, loss in per_seed.items()},
            [f"**{statistics.fmean(per_seed.values()):.4f}**"],
        )
        for method, per_seed in losses.items()
    ]
    return _markdown(seeds, ["method"], rows, ["mean"])


def _markdown(
    seeds: list[int], lead: list[str], rows: list[tuple[list[str], dict[int, str], list[str]]], tail: list[str]
) -> list[str]:
    """A table with the `lead` columns, one column per seed (empty where a row has no cell), then the `tail` ones."""
    header = [*lead, *(f"seed {s}" for s in seeds), *tail]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for first, cells, last in rows:
        lines.append("| " + " | ".join([*first, *(cells.get(s, "") for s in seeds), *last]) + " |")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="JSON files written by benchmarks.comm (one per seed).")
    parser.add_argument("--versus", nargs="*", default=[], help="`method=reference` pairs (names without overrides).")
    parser.add_argument(
        "--pair", nargs=2, action="append", default=[], metavar=("METHOD", "REFERENCE"), help="full method names"
    )
    parser.add_argument("--losses", action="store_true", help="eval losses per seed instead of gaps")
    args = parser.parse_args(argv)
    versus = [tuple(pair.split("=", 1)) for pair in args.versus] + [tuple(pair) for pair in args.pair]
    try:
        runs = load_runs(args.runs)
    except ValueError as error:
        parser.error(str(error))
    print("\n".join(loss_table(runs) if args.losses else gap_table(runs, versus)))


if __name__ == "__main__":
    main()
