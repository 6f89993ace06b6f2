"""Unequal sites: 2 workers, one slowed to 1/k of the other's speed, `round_policy: steps` against `balanced`, and
data-parallel training (DDP: the gradients all-reduced after every step) as the synchronous reference.

    python -m benchmarks.unequal_sites                      # k = 2 and 4, seeds 0-4, the `--long` regime's model
    python -m benchmarks.unequal_sites --slowdowns 2 --seeds 0
    python -m benchmarks.unequal_sites --quick --out /tmp/unequal   # seconds: H = 10, 80 steps, 50 files

The model, data and optimizer are those of `benchmarks.quality --long` (229 k parameters, the stdlib corpus), DiLoCo
with H = 50 and its short-run outer optimizer. Every run trains the same number of tokens in total over the two
workers (the regime's budget), the learning rate a cosine over the job's tokens so far (both workers', the same
figure on each at every step of a round: the finished rounds' steps plus the round's share of its planned steps). Worker 1 is
slowed by sleeping, after each backward pass, (k - 1) times as long as its forward and backward took, so its speed
is 1/k of worker 0's whatever the machine's load (under DDP before the all-reduce, which then waits for it); worker 0
is not slowed.

For each k the table gives, per policy: the fast worker's wait fraction (the engine's share of a round's wall time,
`diloco/wait_fraction`, mean over rounds 3 onwards; for DDP the all-reduce's share of the run's wall time), the job's tokens per second (all tokens / wall time), and the
eval loss of θg at the end against the equal-speed run (`steps`, k = 1; under `steps` the slowdown changes only the
time, not the loss: the computation is the same; so does DDP's, whose loss gap is against the same reference). Writes benchmarks/results/unequal_sites.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import (
    REGIMES,
    RESULTS_DIR,
    all_reduce_gradients,
    command_line,
    cosine_schedule,
    evaluate,
    prepare_data,
    run_on_workers,
    run_settings,
    write_results,
)

H = 50
POLICIES = ("steps", "balanced", "ddp")
OUTER = {"outer_lr": 0.5, "outer_momentum": 0.5}


def _job_steps(engine, world: int) -> float:
    """Both workers' inner steps so far, as every worker computes it alike: the finished rounds' steps, plus this
    round's planned steps times the share of its own round this worker has done."""
    policy = engine.round_policy
    if not policy.balanced:
        return float(world * engine.inner_step)
    share = (engine.inner_step - policy.round_start) / policy.round_steps
    return sum(policy.steps_done) + share * sum(policy.plan)


def _settings(quick: bool) -> tuple[argparse.Namespace, int]:
    """The long regime's run settings and H (`--quick`: 80 steps over both workers, H = 10, 50 corpus files)."""
    flags = dict(REGIMES["long"])
    if quick:
        flags.update({"--token_budget": str(80 * 8 * 128), "--train_files": "50"})
    return run_settings([item for pair in flags.items() for item in pair]), 10 if quick else H


def _worker(rank: int, world: int, policy: str, slowdown: float, seed: int, folder: str, quick: bool) -> dict:
    from hf_diloco import DiLoCo, DiLoCoConfig
    from hf_diloco.modeling import DEFAULT_MODEL_CONFIG, build_model

    settings, inner_steps = _settings(quick)
    data = torch.load(Path(folder) / "data.pt")
    spec = {"config": {**DEFAULT_MODEL_CONFIG, **json.loads(settings.model)}}
    model = build_model(spec, data["vocab"], *data["ids"], seed=seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr, weight_decay=0.1, betas=(0.9, 0.95))
    ddp = policy == "ddp"
    config = DiLoCoConfig(inner_steps=inner_steps, round_policy="steps" if ddp else policy, **OUTER)
    engine = None if ddp else DiLoCo(model, optimizer, config)
    total_steps = settings.token_budget // (settings.batch_size * settings.block_size)  # over both workers
    schedule = cosine_schedule(total_steps // world, settings.warmup)  # over a worker's steps at equal speed
    shard = data["train"][rank::world]
    slowed = rank == 1
    waits, step, job_steps, all_reduce_seconds = [], 0, 0, 0.0
    started = time.perf_counter()
    while job_steps < total_steps:
        began = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = settings.lr * schedule(step if ddp else round(_job_steps(engine, world) / world))
        index = torch.arange(step * settings.batch_size, (step + 1) * settings.batch_size) % len(shard)
        ids = shard[index]
        model(input_ids=ids, labels=ids).loss.backward()
        if slowed:  # before the all-reduce under DDP, so that the fast worker waits for the slow one's step
            time.sleep((slowdown - 1) * (time.perf_counter() - began))
        if ddp:
            reduce_began = time.perf_counter()
            all_reduce_gradients(model, world)
            all_reduce_seconds += time.perf_counter() - reduce_began
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        if ddp:
            job_steps = world * step
            continue
        rounds = engine.outer_rounds
        engine.step()
        if engine.outer_rounds > rounds:
            waits.append(engine.metrics()["diloco/wait_fraction"])
            job_steps = _job_steps(engine, world)  # the same on both: the job stops at the same round everywhere
    seconds = time.perf_counter() - started
    if ddp:
        eval_loss, wait = evaluate(model, data["eval"]), all_reduce_seconds / seconds
    else:
        engine.close()
        seconds = time.perf_counter() - started
        with engine.global_weights():
            eval_loss = evaluate(model, data["eval"])
        wait = statistics.mean(waits[2:]) if len(waits) > 2 else float("nan")
    return {
        "eval_loss": eval_loss,
        "seconds": seconds,
        "inner_steps": step,
        "rounds": 0 if ddp else engine.outer_rounds,
        "wait_fraction": wait,
        "tokens": step * settings.batch_size * settings.block_size,
    }


def _run(policy: str, slowdown: float, seed: int, folder: str, quick: bool) -> dict:
    fast, slow = run_on_workers(_worker, 2, policy, slowdown, seed, folder, quick)
    return {
        "policy": policy,
        "slowdown": slowdown,
        "seed": seed,
        "eval_loss": fast["eval_loss"],
        "fast_wait_fraction": fast["wait_fraction"],
        "tokens_per_second": (fast["tokens"] + slow["tokens"]) / max(fast["seconds"], slow["seconds"]),
        "steps": [fast["inner_steps"], slow["inner_steps"]],
        "rounds": fast["rounds"],
    }


def _table(runs: list[dict], slowdowns: list[float]) -> str:
    reference = {run["seed"]: run for run in runs if run["slowdown"] == 1}
    lines = [
        "| slowdown | policy | fast worker's wait | job tokens / s | vs equal speed | loss gap (mean ± s.e.) |",
        "|---|---|---|---|---|---|",
    ]
    equal_speed = statistics.mean(run["tokens_per_second"] for run in reference.values())
    lines.append(
        f"| 1 | steps | {statistics.mean(r['fast_wait_fraction'] for r in reference.values()):.1%} | "
        f"{equal_speed:,.0f} | 1.00x | (reference) |"
    )
    for slowdown in slowdowns:
        for policy in POLICIES:
            chosen = [r for r in runs if r["slowdown"] == slowdown and r["policy"] == policy]
            if not chosen:
                continue
            gaps = [100 * (r["eval_loss"] / reference[r["seed"]]["eval_loss"] - 1) for r in chosen]
            error = statistics.stdev(gaps) / math.sqrt(len(gaps)) if len(gaps) > 1 else float("nan")
            speed = statistics.mean(r["tokens_per_second"] for r in chosen)
            lines.append(
                f"| 1/{slowdown:g} | {policy} | {statistics.mean(r['fast_wait_fraction'] for r in chosen):.1%} | "
                f"{speed:,.0f} | {speed / equal_speed:.2f}x | {statistics.mean(gaps):+.2f}% ± {error:.2f} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slowdowns", default="2,4", help="k: the slowed worker's speed is 1/k.")
    parser.add_argument("--seeds", default="0,1,2,3,4")
    parser.add_argument("--out", default=f"{RESULTS_DIR}/unequal_sites")
    parser.add_argument("--quick", action="store_true", help="A few seconds per run (a smoke test, not a result).")
    args = parser.parse_args(argv)
    slowdowns = [float(value) for value in args.slowdowns.split(",")]
    seeds = [int(value) for value in args.seeds.split(",")]
    settings, _ = _settings(args.quick)
    runs = []
    with tempfile.TemporaryDirectory() as folder:
        prepare_data(Path(folder), settings.block_size, settings.train_files, settings.vocab_size)
        for seed in seeds:
            runs.append(_run("steps", 1, seed, folder, args.quick))
            for slowdown in slowdowns:
                for policy in POLICIES:
                    runs.append(_run(policy, slowdown, seed, folder, args.quick))
                    print(json.dumps(runs[-1]), file=sys.stderr)
    table = _table(runs, slowdowns)
    result = {"command": command_line("unequal_sites", argv), "runs": runs}
    write_results(args.out, result, f"`{result['command']}`\n\n{table}\n")
    return result


if __name__ == "__main__":
    main()
