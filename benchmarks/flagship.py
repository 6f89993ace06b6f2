"""The shipped slow-link config against DDP at equal tokens: bytes per token (close() tail included) and eval loss.

    python -m benchmarks.flagship --seed 2 --out runs/flagship_seed2        # one run: DDP and the config, side by side
    python -m benchmarks.flagship --table runs/flagship_seed*.json          # per-seed table, mean and standard error
    python -m benchmarks.flagship --table runs/flagship_seed*.json --plot seeds.png    # and the curves over the seeds

A run is `benchmarks.quality --long` (the 229,952-parameter Llama, 1,720,320 tokens, 7.5 tokens per parameter,
2 workers) with two methods: `ddp@2` and `diloco` with every setting of the `diloco:` section of `--config` (a
shipped config name or a YAML file; default `slow_link`); the config's model, data and training sections are not
used, the long regime's are. `--methods` adds other candidates to the same run (specs of `benchmarks.comm`).

`--table` reads such runs and prints, per seed and method, the eval loss gap to DDP of the same seed and how many
times fewer bytes per token the method sent than DDP, counting every byte: the training loop's and the once-per-run
tail sync of `close()` (which `benchmarks.comm` reports apart). Then the mean ± standard error of the gaps and how
many seeds' gaps are above +1% and above +2%, over the seeds given (`--seeds` picks some, e.g. the held-out ones). DDP of a seed may come from any of the runs (a run
without `ddp@2` borrows it: DDP is deterministic for a seed); two DDP runs of one seed with different losses are
refused. `--plot` draws each method's training loss (worker 0, running mean) against tokens and against bytes sent,
mean and min-max over the seeds (`benchmarks.over_seeds`), a shipped config named by its name.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
from pathlib import Path

from benchmarks import quality
from benchmarks.common import RESULTS_DIR, parse_method, run_overrides
from benchmarks.over_seeds import Curve, above_cells, fewer_cell, mean_gap_cell, plot_over_seeds

DEFAULT_CONFIG = "slow_link"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--config", default=DEFAULT_CONFIG, help="Shipped config name or YAML file (its diloco section)."
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--methods", nargs="*", default=[], help="Other candidates run in the same benchmark run.")
    parser.add_argument("--out", default=f"{RESULTS_DIR}/flagship", help="Writes OUT.json, OUT.md and OUT.png.")
    parser.add_argument("--table", nargs="+", type=Path, metavar="RUN", help="Print the table of these runs instead.")
    parser.add_argument("--seeds", type=int, nargs="*", help="With --table: only these seeds.")
    parser.add_argument(
        "--plot", type=Path, metavar="PNG", help="With --table: draw each method's loss over the seeds into PNG."
    )
    return parser


def main(argv: list[str] | None = None) -> list[dict] | list[str]:
    args = build_parser().parse_args(argv)
    if args.table:
        runs = [json.loads(path.read_text()) for path in args.table]
        lines = table(runs, args.seeds)
        print("\n".join(lines))
        if args.plot:
            plot(runs, args.plot, args.seeds)
        return lines
    methods = ["ddp@2", config_method(args.config), *args.methods]
    return quality.main(["--long", "--seed", str(args.seed), "--out", args.out, "--methods", *methods])


def config_method(name_or_path: str) -> str:
    """The `benchmarks.comm` spec of a config's `diloco:` section: `diloco` with every setting it names, 2 workers."""
    from hf_diloco.job.config_file import read_config

    section = read_config(name_or_path).section("diloco")
    settings = ",".join(
        f"{key}={str(value).lower() if isinstance(value, bool) else value}" for key, value in section.items()
    )
    return f"diloco:{settings}@2"


def total_bytes_per_token(result: dict) -> float:
    """Every byte a worker sent (the loop's and the tail sync of `close()`) per token it trained."""
    return (result["bytes_sent"] + result["final_sync_bytes"]) / result["tokens_per_worker"]


def seed_of(run: dict) -> int:
    command = run["command"].split()
    return int(command[command.index("--seed") + 1]) if "--seed" in command else 0


def ddp_by_seed(runs: list[dict]) -> dict[int, dict]:
    """The `ddp@2` result of every seed among `runs`; a seed's DDP runs must agree on the loss."""
    found: dict[int, dict] = {}
    for run in runs:
        for result in run["results"]:
            if result["method"] != "ddp@2":
                continue
            seed = seed_of(run)
            first = found.setdefault(seed, result)
            if first["eval_loss"] != result["eval_loss"]:
                raise ValueError(
                    f"two ddp@2 runs of seed {seed} disagree ({first['eval_loss']} and {result['eval_loss']}): "
                    "compare runs made with the same package."
                )
    return found


def gaps_by_method(runs: list[dict], seeds: list[int] | None = None) -> dict[str, dict[int, tuple[float, float]]]:
    """Per method and seed of `runs` (only `seeds`, where given): (gap to DDP of the seed, x fewer bytes, tail
    included)."""
    rows: dict[str, dict[int, tuple[float, float]]] = {}
    ddp_of = ddp_by_seed(runs)
    for run in runs:
        seed = seed_of(run)
        if seeds and seed not in seeds:
            continue
        if seed not in ddp_of:
            raise ValueError(f"no ddp@2 run of seed {seed} among the runs: add one (benchmarks.quality --long).")
        ddp = ddp_of[seed]
        for result in run["results"]:
            if result["method"] == "ddp@2":
                continue
            gap = result["eval_loss"] / ddp["eval_loss"] - 1
            fewer = total_bytes_per_token(ddp) / total_bytes_per_token(result)
            rows.setdefault(result["method"], {})[seed] = (gap, fewer)
    return rows


def table(runs: list[dict], seeds: list[int] | None = None) -> list[str]:
    """Per seed and method: gap to DDP and bytes ratio (tail included); then mean ± s.e. of the gaps."""
    rows = gaps_by_method(runs, seeds)
    all_seeds = sorted({seed for per_seed in rows.values() for seed in per_seed})
    header = ["method", *(f"seed {s}" for s in all_seeds), "mean gap ± s.e.", "above +1%", "above +2%"]
    lines = ["| " + " | ".join([*header, "x fewer bytes than DDP"]) + " |", "|" + "---|" * (len(header) + 1)]
    for method, per_seed in rows.items():
        gaps = [gap for gap, _ in per_seed.values()]
        cells = [f"{100 * per_seed[s][0]:+.2f}%" if s in per_seed else "" for s in all_seeds]
        summary = [mean_gap_cell(gaps), *above_cells(gaps), fewer_cell([ratio for _, ratio in per_seed.values()])]
        lines.append(f"| {method} | " + " | ".join([*cells, *summary]) + " |")
    return lines


def train_curve(result: dict) -> Curve:
    """(tokens of all workers, bytes one worker had sent, worker 0's training loss, running mean) every logged step.

    The runs log no eval curve, only worker 0's batch loss every few steps (between DiLoCo's syncs, its local model's):
    a running mean over a tenth of the run shows the trend. Bytes by step `s` are the loop's bytes times the share of
    its syncs done by then (DDP syncs every step, DiLoCo every H steps); the last point adds close()'s tail."""
    steps, syncs = result["steps"], max(result["syncs"], 1)
    tokens_per_step = result["tokens_per_worker"] / steps * result["workers"]
    logged, losses = zip(*result["train_curve"])
    window = max(1, len(losses) // 10)
    smooth = [statistics.fmean(losses[max(0, i - window + 1) : i + 1]) for i in range(len(losses))]
    sent = [result["bytes_sent"] * (step * syncs // steps) / syncs for step in logged]
    sent[-1] += result["final_sync_bytes"] if logged[-1] == steps else 0
    return [(step * tokens_per_step, bytes_, loss) for step, bytes_, loss in zip(logged, sent, smooth)]


def plot(runs: list[dict], path: Path, seeds: list[int] | None = None) -> bool:
    """Every method's training loss against tokens and bytes sent, mean and min-max over the seeds of `runs`."""
    series: dict[str, dict[int, Curve]] = {}
    for seed, ddp in sorted(ddp_by_seed(runs).items()):
        if not seeds or seed in seeds:
            series.setdefault("ddp@2", {})[seed] = train_curve(ddp)
    for run in runs:
        seed = seed_of(run)
        if seeds and seed not in seeds:
            continue
        for result in run["results"]:
            if result["method"] != "ddp@2":
                series.setdefault(result["method"], {})[seed] = train_curve(result)
    labels = short_labels(list(series))
    named = {labels[method]: list(per_seed.values()) for method, per_seed in series.items()}
    return plot_over_seeds(named, path, "train loss, worker 0 (running mean)", "the specs are in the table")


def short_labels(methods: list[str]) -> dict[str, str]:
    """A shipped config's name for its spec (`sign_link`), else `name@M` with ` (a)`, ` (b)`... where several
    methods would get one label."""
    from hf_diloco.job.config_file import shipped_config_names

    shipped = {}
    for name in shipped_config_names():
        with contextlib.suppress(KeyError, ValueError):
            shipped[settings_of(config_method(name))] = name
    short = {
        method: shipped.get(settings_of(method), f"{method.split('@')[0].split(':')[0]}@{method.rpartition('@')[2]}")
        for method in methods
    }
    labels = {}
    for method, label in short.items():
        twins = [other for other in methods if short[other] == label]
        labels[method] = label if len(twins) < 2 else f"{label} ({chr(ord('a') + twins.index(method))})"
    return labels


def settings_of(method: str) -> tuple[str, str, str, int | None]:
    """A spec as the run it makes: method name, the whole `DiLoCoConfig` (defaults filled in), run settings and
    workers. Two specs that differ only in the order of their settings, or in naming a default, compare equal."""
    from hf_diloco import DiLoCoConfig

    name, fields, workers = parse_method(method)
    config = "" if fields is None else repr(DiLoCoConfig(**fields))
    return name if fields is None else "diloco", config, repr(sorted(run_overrides(method).items())), workers


if __name__ == "__main__":
    main()
