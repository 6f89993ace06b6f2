"""How good is eager overlap's estimate of the round's average? Measures it on a real 2-worker run.

    python scripts/bench_eager_estimate.py --long

Eager (Kale et al.) feeds each worker's own outer optimizer Δ~ = avg^{r-1} + (Δm^r - Δm^{r-1}) / M (its own
contribution fresh, the others' one round stale) where blocking DiLoCo would use the true avg^r, which arrives one
round later. This script trains `eager_fp4` with bench_comm.py's model, data and optimizer (`--long`:
bench_quality.py's longer-run model) and records, for every round whose true average arrives, the relative error
||Δ~ - avg|| / ||avg|| of the estimate and the cosine between consecutive averages avg^{r-1}, avg^r (the stale part
of the estimate is only as good as consecutive rounds are alike). The instrumentation wraps two engine methods in the
worker processes; it does not change what the engine computes.
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


def recording_worker(rank: int, world: int, method: str, args: argparse.Namespace, folder: str) -> dict:
    import bench_comm

    from hf_diloco import DiLoCo

    records: list[dict] = []
    estimates: dict[int, torch.Tensor] = {}
    previous_average: dict[int, torch.Tensor] = {}
    eager_update, finish_round = DiLoCo._eager_update, DiLoCo._finish_round

    def recording_eager_update(self, fragment, delta, previous, average):
        if average is not None:  # a first round's Δ~ = Δm / M is not meant as an estimate of the average
            estimates[fragment] = self._eager_estimate(delta, previous, average).detach().clone()
        return eager_update(self, fragment, delta, previous, average)

    def recording_finish_round(self, fragment, flight):
        average = finish_round(self, fragment, flight)
        estimate, before = estimates.pop(fragment, None), previous_average.get(fragment)
        if average is not None:
            row = {"step": self.inner_step, "fragment": fragment, "average_norm": float(average.norm())}
            if estimate is not None:
                row["estimate_error"] = float((estimate - average).norm() / average.norm().clamp_min(1e-30))
            if before is not None:
                row["consecutive_cosine"] = float(torch.nn.functional.cosine_similarity(before, average, dim=0))
            records.append(row)
            previous_average[fragment] = average.detach().clone()
        return average

    DiLoCo._eager_update, DiLoCo._finish_round = recording_eager_update, recording_finish_round
    result = bench_comm.worker(rank, world, method, args, folder)
    result["rounds"] = records
    return result


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
    rounds = outcome[0]["rounds"]
    print(f"{args.method}, {run_args.steps} steps per worker, eval loss {outcome[0]['eval_loss']:.4f}")
    print("| inner step | norm(avg) | norm(estimate - avg) / norm(avg) | cos(avg^{r-1}, avg^r) |")
    print("|---|---|---|---|")
    for row in rounds:
        error, cosine = row.get("estimate_error"), row.get("consecutive_cosine")
        print(
            f"| {row['step']} | {row['average_norm']:.4f} | {'-' if error is None else f'{error:.3f}'} | "
            f"{'-' if cosine is None else f'{cosine:.3f}'} |"
        )
    errors = [row["estimate_error"] for row in rounds if "estimate_error" in row]
    cosines = [row["consecutive_cosine"] for row in rounds if "consecutive_cosine" in row]
    if errors and cosines:
        print(
            f"\nmedian estimate error {statistics.median(errors):.3f}, median cosine {statistics.median(cosines):.3f}"
        )
    Path(args.out).write_text(json.dumps({"argv": comm_argv, "method": args.method, "workers": outcome}, indent=1))


if __name__ == "__main__":
    main()
