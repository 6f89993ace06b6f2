"""How good is eager overlap's estimate of the round's average? Measures it on a real 2-worker run.

    python scripts/bench_eager_estimate.py --long
    python scripts/bench_eager_estimate.py --long --method eager_fp4:inner_steps=25,outer_lr=1.0,outer_momentum=0.0

Eager applies an estimate E^r of round r's average at once and swaps it for the true avg^r a round later:
Δ~ = avg^{r-1} - E^{r-1} + E^r. With outer lr 1 and no momentum a worker then starts round r+1 at exactly
avg^r - E^r from where blocking DiLoCo would start it, so ||E^r - avg^r|| / ||avg^r|| is what the overlap costs.
`own_share` (Kale et al.) has E^r = Δm^r / M; `fitted` has E^r = w^r·Δm^r, one w^r per parameter fitted on round
r-1 (see the engine's docstring). This script trains the method with bench_comm.py's model, data and optimizer
(`--long`: bench_quality.py's longer-run model) and records, for every round whose true average arrives, the error of
both estimates from this worker's own Δm^r (whichever the run applies), the fitted weights' overall scale, the error
of the Δ~ the run applied (the quantity sessions 3-4 measured), and the cosine between consecutive averages. The
instrumentation wraps two engine methods in the worker processes; it does not change what the engine computes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

COLUMNS = {
    "own_share_error": "own_share: norm(Δm/M - avg) / norm(avg)",
    "fitted_error": "fitted: norm(w·Δm - avg) / norm(avg)",
    "fitted_weight": "norm(w·Δm) / norm(Δm)",
    "applied_error": "applied Δ~: norm(Δ~ - avg) / norm(avg)",
    "consecutive_cosine": "cos(avg^{r-1}, avg^r)",
}


def recording_worker(rank: int, world: int, method: str, args: argparse.Namespace, folder: str) -> dict:
    import bench_comm

    from hf_diloco import DiLoCo
    from hf_diloco.core.diloco import fitted_estimate_weight

    records: list[dict] = []
    launched: dict[int, dict] = {}  # fragment -> this round's own Δm, w·Δm and the applied Δ~
    previous_average: dict[int, torch.Tensor] = {}
    eager_update, finish_round = DiLoCo._eager_update, DiLoCo._finish_round

    def recording_eager_update(self, fragment, delta, previous, average):
        if average is not None:  # a first round's Δ~ = Δm / M is not meant as an estimate of the average
            applied, _ = self._eager_estimate(fragment, delta, previous, average)
            workers, own = self.topology.num_workers, delta.detach().clone()
            fitted = own.clone()  # w·Δm^r, one w per parameter fitted on round r-1
            for (_, out), (_, sent), (_, mean) in zip(
                self._unflatten(fragment, fitted),
                self._unflatten(fragment, previous.sent),
                self._unflatten(fragment, average),
            ):
                out.mul_(fitted_estimate_weight(sent.reshape(-1), mean.reshape(-1), workers))
            launched[fragment] = {
                "own": own,
                "fitted": fitted,
                "weight": float(fitted.norm() / own.norm().clamp_min(1e-30)),
                "applied": applied.detach().clone(),
            }
        return eager_update(self, fragment, delta, previous, average)

    def recording_finish_round(self, fragment, flight):
        average = finish_round(self, fragment, flight)
        round_, before = launched.pop(fragment, None), previous_average.get(fragment)
        if average is not None:
            norm = average.norm().clamp_min(1e-30)
            row = {"step": self.inner_step, "fragment": fragment, "average_norm": float(average.norm())}
            if round_ is not None:
                own, workers = round_["own"], self.topology.num_workers
                row["own_share_error"] = float((own / workers - average).norm() / norm)
                row["fitted_error"] = float((round_["fitted"] - average).norm() / norm)
                row["fitted_weight"] = round_["weight"]
                row["applied_error"] = float((round_["applied"] - average).norm() / norm)
            if before is not None:
                row["consecutive_cosine"] = float(torch.nn.functional.cosine_similarity(before, average, dim=0))
            records.append(row)
            previous_average[fragment] = average.detach().clone()
        return average

    DiLoCo._eager_update, DiLoCo._finish_round = recording_eager_update, recording_finish_round
    result = bench_comm.worker(rank, world, method, args, folder)
    result["rounds"] = records
    return result


def report(method: str, steps: int, eval_loss: float, rounds: list[dict]) -> str:
    """The markdown table of every round, then the median of each column."""
    lines = [
        f"{method}, {steps} steps per worker, eval loss {eval_loss:.4f}",
        "",
        "| inner step | norm(avg) | " + " | ".join(COLUMNS.values()) + " |",
        "|---" * (2 + len(COLUMNS)) + "|",
    ]
    for row in rounds:
        cells = ["-" if row.get(key) is None else f"{row[key]:.3f}" for key in COLUMNS]
        lines.append(f"| {row['step']} | {row['average_norm']:.4f} | " + " | ".join(cells) + " |")
    medians = []
    for key, title in COLUMNS.items():
        values = [row[key] for row in rounds if key in row]
        if values:
            medians.append(f"{title}: {statistics.median(values):.3f}")
    lines += ["", "Medians: " + "; ".join(medians) + "."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    import bench_comm
    import bench_quality

    from tests.dist_utils import run_on_processes

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--long", action="store_true", help="bench_quality.py --long's model, corpus and budget.")
    parser.add_argument("--method", default="eager_fp4:outer_lr=0.5,outer_momentum=0.5")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--token_budget", type=int, default=0, help="Override the regime's token budget.")
    parser.add_argument("--out", default="benchmarks/eager_estimate.json")
    args = parser.parse_args(argv)
    comm_argv = ["--seed", str(args.seed)] + (["--token_budget", str(args.token_budget)] if args.token_budget else [])
    comm_argv = bench_quality.with_defaults(comm_argv, bench_quality.regime_defaults(args.long))
    run_args = bench_comm.parse_args(comm_argv)
    run_args.workers = 2
    run_args.steps = bench_comm.steps_for_budget(run_args, run_args.workers)
    with tempfile.TemporaryDirectory() as folder:
        bench_comm.prepare_data(Path(folder), run_args.block_size, run_args.train_files, run_args.vocab_size)
        outcome = run_on_processes(recording_worker, 2, args.method, run_args, folder, timeout_seconds=3600)
    print(report(args.method, run_args.steps, outcome[0]["eval_loss"], outcome[0]["rounds"]))
    Path(args.out).write_text(json.dumps({"argv": comm_argv, "method": args.method, "workers": outcome}, indent=1))


if __name__ == "__main__":
    main()
