"""Unequal sites: 2 workers, one slowed to 1/k of the other's speed, `round_policy: steps` against `balanced`, and
data-parallel training (DDP: the gradients all-reduced after every step) as the synchronous reference.

    python -m benchmarks.unequal_sites                      # k = 2 and 4, seeds 0-4, the `--long` regime's model
    python -m benchmarks.unequal_sites --slowdowns 2 --seeds 0
    python -m benchmarks.unequal_sites --slowdowns 2 --policies steps,ddp --out benchmarks/results/unequal_sites_ddp
    python -m benchmarks.unequal_sites --quick --out /tmp/unequal   # seconds: H = 10, 80 steps, 50 files
    python -m benchmarks.unequal_sites --link_mbit 20 --slowdowns 2 --seeds 0,1,2 --policies steps,balanced \
        --out benchmarks/results/unequal_sites_link                  # over a 20 Mbit/s link (root: namespaces)

The model, data and optimizer are those of `benchmarks.quality --long` (229 k parameters, the stdlib corpus), DiLoCo
with H = 50 and its short-run outer optimizer. Every run trains the same number of tokens in total over the two
workers (the regime's budget), the learning rate a cosine over the job's tokens so far (both workers', the same
figure on each at every step of a round: the finished rounds' steps plus the round's share of its planned steps). Worker 1 is
slowed by sleeping (k - 1) times as long as each of its steps took, so its speed is 1/k of worker 0's whatever the
machine's load (under DDP (k - 1) times its forward and backward, before the all-reduce, which then waits for it);
worker 0 is not slowed.

For each k the table gives, per policy: the fast worker's wait fraction (the engine's share of a round's wall time,
`diloco/wait_fraction`, mean over rounds 3 onwards; for DDP the all-reduce's share of the run's wall time), the
job's tokens per second (all tokens / wall time), and the eval loss of θg at the end against the equal-speed run
(`steps`, k = 1). Under `steps` the slowdown changes only the time, not the loss: the computation is the same (so
does DDP's; its loss gap is against the same reference). Writes benchmarks/results/unequal_sites.{md,json}.

With `--link_mbit R` the two workers run in two network namespaces joined by a veth pair limited to R Mbit/s each
way (`benchmarks/netns.py`, `tc ... tbf`; needs root), gloo over the veth addresses only, so every exchange crosses
a slow link as between two sites; the table then also gives each run's wall-clock seconds for the job's tokens.
The equal-speed reference runs over the same link.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import (
    REGIMES,
    RESULTS_DIR,
    ShardBatches,
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
    from hf_diloco.job.modeling import DEFAULT_MODEL_CONFIG, build_model

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
    batches = ShardBatches(data["train"], seed, rank, world, settings.batch_size)
    slowed = rank == 1
    waits, step, job_steps, all_reduce_seconds = [], 0, 0, 0.0
    started = time.perf_counter()
    while job_steps < total_steps:
        began = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = settings.lr * schedule(step if ddp else round(_job_steps(engine, world) / world))
        ids = batches(step)
        model(input_ids=ids, labels=ids).loss.backward()
        if ddp and slowed:  # before the all-reduce, which the fast worker then waits in
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
        if slowed:
            time.sleep((slowdown - 1) * (time.perf_counter() - began))
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


def _run(policy: str, slowdown: float, seed: int, folder: str, quick: bool, link=None) -> dict:
    if link is None:
        fast, slow = run_on_workers(_worker, 2, policy, slowdown, seed, folder, quick)
    else:
        fast, slow = _run_over_link(link, policy, slowdown, seed, folder, quick)
    return {
        "seconds": max(fast["seconds"], slow["seconds"]),
        "policy": policy,
        "slowdown": slowdown,
        "seed": seed,
        "eval_loss": fast["eval_loss"],
        "fast_wait_fraction": fast["wait_fraction"],
        "tokens_per_second": (fast["tokens"] + slow["tokens"]) / max(fast["seconds"], slow["seconds"]),
        "steps": [fast["inner_steps"], slow["inner_steps"]],
        "rounds": fast["rounds"],
    }


LINK_PORT = 29500  # inside the benchmark's own namespaces: it cannot collide with anything on the machine


def _run_over_link(link, policy: str, slowdown: float, seed: int, folder: str, quick: bool) -> list[dict]:
    """Both workers of one run, each a process in its namespace, gloo over the rate-limited veth pair."""
    job = json.dumps([policy, slowdown, seed, folder, quick])
    processes = []
    for rank in range(2):
        env = dict(os.environ, MASTER_ADDR=link.addresses[0], MASTER_PORT=str(LINK_PORT), RANK=str(rank))
        env.update(WORLD_SIZE="2", GLOO_SOCKET_IFNAME=link.devices[rank], OMP_NUM_THREADS="1")
        command = [*link.exec_prefix(rank), sys.executable, "-m", "benchmarks.unequal_sites", "--link_worker", job]
        processes.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True, start_new_session=True))
    results = []
    try:
        for process in processes:
            output, _ = process.communicate(timeout=3600)
            if process.returncode != 0:
                raise RuntimeError(f"a worker over the link ended with exit status {process.returncode}")
            results.append(json.loads(output.strip().splitlines()[-1]))
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    return results


def _link_worker(job: str) -> None:
    """One worker inside its namespace: the gloo group over the veth addresses, then `_worker`; its result on stdout."""
    import datetime

    import torch.distributed as dist

    policy, slowdown, seed, folder, quick = json.loads(job)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    try:
        result = _worker(dist.get_rank(), 2, policy, slowdown, seed, folder, quick)
    finally:
        dist.destroy_process_group()
    print(json.dumps(result), flush=True)


def _table(runs: list[dict], slowdowns: list[float], policies: list[str], with_seconds: bool = False) -> str:
    reference = {run["seed"]: run for run in runs if run["slowdown"] == 1}
    header = "| slowdown | policy | fast worker's wait | job tokens / s | vs equal speed | loss gap (mean ± s.e.) |"
    lines = [
        header + (" wall s |" if with_seconds else ""),
        "|---|---|---|---|---|---|" + ("---|" if with_seconds else ""),
    ]

    def seconds(chosen: list[dict]) -> str:
        return f" {statistics.mean(r['seconds'] for r in chosen):.0f} |" if with_seconds else ""

    equal_speed = statistics.mean(run["tokens_per_second"] for run in reference.values())
    lines.append(
        f"| 1 | steps | {statistics.mean(r['fast_wait_fraction'] for r in reference.values()):.1%} | "
        f"{equal_speed:,.0f} | 1.00x | (reference) |{seconds(list(reference.values()))}"
    )
    for slowdown in slowdowns:
        for policy in policies:
            chosen = [r for r in runs if r["slowdown"] == slowdown and r["policy"] == policy]
            if not chosen:
                continue
            gaps = [100 * (r["eval_loss"] / reference[r["seed"]]["eval_loss"] - 1) for r in chosen]
            error = statistics.stdev(gaps) / math.sqrt(len(gaps)) if len(gaps) > 1 else float("nan")
            speed = statistics.mean(r["tokens_per_second"] for r in chosen)
            lines.append(
                f"| 1/{slowdown:g} | {policy} | {statistics.mean(r['fast_wait_fraction'] for r in chosen):.1%} | "
                f"{speed:,.0f} | {speed / equal_speed:.2f}x | {statistics.mean(gaps):+.2f}% ± {error:.2f} |"
                + seconds(chosen)
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slowdowns", default="2,4", help="k: the slowed worker's speed is 1/k.")
    parser.add_argument("--seeds", default="0,1,2,3,4")
    parser.add_argument("--out", default=f"{RESULTS_DIR}/unequal_sites")
    parser.add_argument("--quick", action="store_true", help="A few seconds per run (a smoke test, not a result).")
    parser.add_argument("--policies", default="steps,balanced", help="Of " + ", ".join(POLICIES) + ".")
    parser.add_argument("--link_mbit", type=float, help="Run both workers over a veth link of this rate (root).")
    parser.add_argument("--link_worker", help=argparse.SUPPRESS)  # internal: one worker inside its namespace
    args = parser.parse_args(argv)
    if args.link_worker:
        _link_worker(args.link_worker)
        return {}
    policies = [policy for policy in args.policies.split(",") if policy]
    if set(policies) - set(POLICIES):
        parser.error(f"--policies: choose from {', '.join(POLICIES)}")
    slowdowns = [float(value) for value in args.slowdowns.split(",")]
    seeds = [int(value) for value in args.seeds.split(",")]
    settings, _ = _settings(args.quick)
    runs, link = [], None
    if args.link_mbit:
        from benchmarks.netns import SlowLink

        link = SlowLink.create()
        link.set_rate(args.link_mbit)
    try:
        with tempfile.TemporaryDirectory() as scratch:
            for seed in seeds:
                folder = str(Path(scratch) / f"seed{seed}")  # the seed's held-out files, tokenizer and blocks
                Path(folder).mkdir()
                prepare_data(Path(folder), settings.block_size, settings.train_files, settings.vocab_size, seed)
                runs.append(_run("steps", 1, seed, folder, args.quick, link))
                for slowdown in slowdowns:
                    for policy in policies:
                        runs.append(_run(policy, slowdown, seed, folder, args.quick, link))
                        print(json.dumps(runs[-1]), file=sys.stderr)
    finally:
        if link is not None:
            link.destroy()
    table = _table(runs, slowdowns, policies, with_seconds=link is not None)
    result = {"command": command_line("unequal_sites", argv), "runs": runs}
    write_results(args.out, result, f"`{result['command']}`\n\n{table}\n")
    return result


if __name__ == "__main__":
    main()
