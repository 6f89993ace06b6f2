"""How good is eager overlap's estimate of the round's average? Measures it on a real run of 2 (`--workers`) workers.

    python -m benchmarks.eager_estimate --long
    python -m benchmarks.eager_estimate --long --method eager_fp4:inner_steps=25,outer_lr=1.0,outer_momentum=0.0
    python -m benchmarks.eager_estimate --long --method diloco_fp4:inner_steps=25,outer_lr=0.5,outer_momentum=0.5

Eager applies an estimate E^r of round r's average at once and swaps it for the true avg^r a round later:
Δ~ = avg^{r-1} - E^{r-1} + E^r. With outer lr 1 and no momentum a worker then starts round r+1 at exactly
avg^r - E^r from where blocking DiLoCo would start it, so ||E^r - avg^r|| / ||avg^r|| is what the overlap costs.
`own_share` (Kale et al.) has E^r = Δm^r / M; `fitted` has E^r = w^r·Δm^r, one w^r per parameter fitted on round
r-1 (see docs/design.md). It trains the method with the training run of `benchmarks.comm` (`benchmarks.common`:
model, data and optimizer; `--long`: the longer-run model of `benchmarks.quality --long`).

An eager method: for every round whose true average arrives, the error of both estimates from this worker's own
Δm^r (whichever the run applies), the fitted weights' overall scale, the error of the Δ~ the run applied (the
quantity measured in-run), and the cosine between consecutive averages.

A blocking DiLoCo method (one fragment, no delay): along its trajectory, what each candidate estimate would have
missed of every round's average (Δm/M, the stale avg^{r-1}, Δm itself, w·Δm with one w per fragment or per
parameter, and a per-parameter fit on the round itself, which no worker could make), and the cosine between the
workers' pseudo-gradients of a round.

The instrumentation is an observer of the engine (`register_round_observer`) in the worker processes: it reads each
round's record and does not change what the engine computes. Writes `--out` (every round of every worker, JSON) and
the printed table next to it (`.md`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch

from benchmarks.common import (
    REGIMES,
    RESULTS_DIR,
    command_line,
    parse_method,
    prepare_data,
    run_on_workers,
    run_settings,
    steps_for_budget,
    train_worker,
    with_defaults,
)

EAGER_COLUMNS = {
    "own_share_error": "own_share: norm(Δm/M - avg) / norm(avg)",
    "fitted_error": "fitted: norm(w·Δm - avg) / norm(avg)",
    "fitted_weight": "norm(w·Δm) / norm(Δm)",
    "applied_error": "applied Δ~: norm(Δ~ - avg) / norm(avg)",
    "consecutive_cosine": "cos(avg^{r-1}, avg^r)",
}
# Along a blocking run: what each candidate estimate would have missed of every round's average.
BLOCKING_COLUMNS = {
    "own_share_error": "Δm/M",
    "stale_error": "avg^{r-1}",
    "own_error": "Δm",
    "fragment_fit_error": "w·Δm, one w per fragment",
    "fitted_error": "w·Δm, one w per parameter (fitted)",
    "oracle_error": "per parameter, w fitted on this round",
    "workers_cosine": "cos(Δm, Δk), mean over worker pairs",
    "consecutive_cosine": "cos(avg^{r-1}, avg^r)",
}


def scaled_per_parameter(sizes, vector, own, average, workers: int | None):
    """`vector` with each parameter's values (`sizes`: values per piece) times the least-squares w of `average` on
    `own` over that parameter, clipped to [1/M, 1] as the engine does (`workers` = M), or not clipped (`workers`
    None)."""
    from hf_diloco.core.rounds.overlap import fitted_estimate_weight

    scaled = vector.detach().clone()
    for out, mine, mean in zip(scaled.split(sizes), own.split(sizes), average.split(sizes)):
        if workers is None:
            weight = float(mine @ mean) / max(float(mine @ mine), 1e-30)
        else:
            weight = fitted_estimate_weight(mine, mean, workers)
        out.mul_(weight)
    return scaled


def _relative_error(estimate, average) -> float:
    return float((estimate - average).norm() / average.norm().clamp_min(1e-30))


def _cosine(a, b) -> float:
    return float(torch.nn.functional.cosine_similarity(a, b, dim=0))


def recording_worker(rank: int, world: int, method: str, args: argparse.Namespace, folder: str) -> dict:
    """An eager run, with every round's estimates scored against its true average (an observer of the engine)."""
    records: list[dict] = []
    last_round: dict = {}  # fragment -> the RoundRecord of its previous round
    previous_average: dict[int, torch.Tensor] = {}

    def observe(record) -> None:
        if record.final:
            return
        fragment, average, before = record.fragment, record.average, last_round.get(record.fragment)
        last_round[fragment] = record
        if average is None:
            return
        row = {"step": record.step, "fragment": fragment, "average_norm": float(average.norm())}
        # The round's launch applied an estimate built on the previous average (the record of that previous round
        # carries it); a first or restarted round's Δ~ = Δm / M is not meant as an estimate of the average.
        if before is not None and before.average is not None:
            own, workers = record.sent.detach().clone(), record.workers
            fitted = scaled_per_parameter(record.piece_sizes, own, before.sent, before.average, workers)
            row["own_share_error"] = _relative_error(own / workers, average)
            row["fitted_error"] = _relative_error(fitted, average)
            row["fitted_weight"] = float(fitted.norm() / own.norm().clamp_min(1e-30))
            row["applied_error"] = _relative_error(before.estimate, average)
        if fragment in previous_average:
            row["consecutive_cosine"] = _cosine(previous_average[fragment], average)
        records.append(row)
        previous_average[fragment] = average.detach().clone()

    return train_worker(rank, world, method, args, folder, observer=observe) | {"rounds": records}


def recording_blocking_worker(rank: int, world: int, method: str, args: argparse.Namespace, folder: str) -> dict:
    """A blocking run (P = 1, τ = 0), with every candidate estimate scored against each round's true average.

    The workers' pseudo-gradients are all-gathered once per round for their cosine: a collective the run itself
    does not have, made after the round's average is known, so the training is unchanged."""
    import torch.distributed as dist

    from hf_diloco.core.rounds.overlap import fitted_estimate_weight

    records: list[dict] = []
    before: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # fragment -> last round's (own Δm, average)

    def observe(record) -> None:
        if record.final:
            return
        own, workers, fragment, average = record.sent.detach().clone(), record.workers, record.fragment, record.average
        everyone = [torch.zeros_like(own) for _ in range(world)]
        dist.all_gather(everyone, own)
        if average is None:
            return
        row = {"step": record.step, "fragment": fragment, "average_norm": float(average.norm())}
        pairs = [(a, b) for i, a in enumerate(everyone) for b in everyone[i + 1 :]]
        row["workers_cosine"] = sum(_cosine(a, b) for a, b in pairs) / len(pairs)
        row["own_share_error"] = _relative_error(own / workers, average)
        row["own_error"] = _relative_error(own, average)
        oracle = scaled_per_parameter(record.piece_sizes, own, own, average, None)
        row["oracle_error"] = _relative_error(oracle, average)
        if fragment in before:
            last_own, last_average = before[fragment]
            row["stale_error"] = _relative_error(last_average, average)
            whole = fitted_estimate_weight(last_own, last_average, workers)
            row["fragment_fit_error"] = _relative_error(whole * own, average)
            fitted = scaled_per_parameter(record.piece_sizes, own, last_own, last_average, workers)
            row["fitted_error"] = _relative_error(fitted, average)
            row["consecutive_cosine"] = _cosine(last_average, average)
        records.append(row)
        before[fragment] = (own, average.detach().clone())

    return train_worker(rank, world, method, args, folder, observer=observe) | {"rounds": records}


def report(method: str, steps: int, eval_loss: float, rounds: list[dict], columns: dict[str, str]) -> str:
    """The markdown table of every round, then the median of each column."""
    lines = [
        f"{method}, {steps} steps per worker, eval loss {eval_loss:.4f}",
        "",
        "| inner step | norm(avg) | " + " | ".join(columns.values()) + " |",
        "|---" * (2 + len(columns)) + "|",
    ]
    for row in rounds:
        cells = ["-" if row.get(key) is None else f"{row[key]:.3f}" for key in columns]
        lines.append(f"| {row['step']} | {row['average_norm']:.4f} | " + " | ".join(cells) + " |")
    medians = []
    for key, title in columns.items():
        values = [row[key] for row in rounds if key in row]
        if values:
            medians.append(f"{title}: {statistics.median(values):.3f}")
    lines += ["", "Medians: " + "; ".join(medians) + "."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--long", action="store_true", help="The model, corpus and budget of quality --long.")
    parser.add_argument("--method", default="eager_fp4:outer_lr=0.5,outer_momentum=0.5")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--token_budget", type=int, default=0, help="Override the regime's token budget.")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", default=f"{RESULTS_DIR}/eager_estimate.json", help="Writes OUT and OUT with .md.")
    args = parser.parse_args(argv)
    try:
        fields = parse_method(args.method)[1] or {}
    except (ValueError, TypeError) as error:
        parser.error(str(error))
    eager = fields.get("overlap") == "eager"
    blocking = fields and fields.get("overlap", "streaming") == "streaming"
    blocking = blocking and fields.get("num_fragments", 1) == 1 and fields.get("sync_delay", 0) == 0
    if not (eager or blocking):
        parser.error("--method must be an eager method or a blocking DiLoCo one (one fragment, sync_delay 0)")
    comm_argv = ["--seed", str(args.seed)] + (["--token_budget", str(args.token_budget)] if args.token_budget else [])
    comm_argv = with_defaults(comm_argv, REGIMES["long" if args.long else "short"])
    run_args = run_settings(comm_argv)
    run_args.workers = args.workers
    run_args.steps = steps_for_budget(run_args, run_args.workers)
    worker, columns = (recording_worker, EAGER_COLUMNS) if eager else (recording_blocking_worker, BLOCKING_COLUMNS)
    with tempfile.TemporaryDirectory() as folder:
        prepare_data(Path(folder), run_args.block_size, run_args.train_files, run_args.vocab_size, args.seed)
        outcome = run_on_workers(worker, args.workers, args.method, run_args, folder)
    table = report(args.method, run_args.steps, outcome[0]["eval_loss"], outcome[0]["rounds"], columns)
    print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"argv": comm_argv, "method": args.method, "workers": outcome}, indent=1))
    out.with_suffix(".md").write_text(f"`{command_line('eager_estimate', argv)}`\n\n{table}\n")


if __name__ == "__main__":
    main()
