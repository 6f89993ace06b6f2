"""Goodput under faults: four sites through an object store against today's elastic gloo path, and against no faults.

    python -m benchmarks.goodput          # four runs of a 1200 s window: about 90 minutes; benchmarks/results/goodput.*
    python -m benchmarks.goodput --quick --out /tmp/goodput     # a smoke run of a few seconds per run

Four sites (one process each, on this machine) train one small Llama with DiLoCo on the stdlib corpus (the data and
model of `benchmarks.common`, each site on its own quarter of the training blocks, AdamW), fp4 with error feedback,
every site's payload to every other (`all_gather`), the exchange running behind `--sync_delay` inner steps. Each
site runs one inner step every `--pace_seconds` on average (compute, then a sleep; a step whose compute overran is
made up by the next steps' sleeps, unless the site fell more than 10 steps behind, i.e. it was stopped), so a site's
speed is set by the benchmark and not by how the shared cores are split: a paused or killed site gives the others no
CPU they can turn into steps. Runs, one after the other, in one invocation:

1. **store, faults**: `exchange: store` through a moto S3 server on loopback (a real HTTP endpoint; `s3://` with
   `AWS_ENDPOINT_URL`), quorum `--quorum`, adaptive grace of at most `--grace_seconds`.
2. **elastic, faults**: `TorchftMembership` against a torchft Lighthouse in this process (loopback), the gloo
   exchange of `benchmarks.elastic_outage`.
3. **store, no faults**: run 1 without the faults.
4. **elastic, no faults**: run 2 without the faults (what the gloo path keeps of its own).

The faults of runs 1 and 2, the same schedule (seconds from the window's start): site 1 is SIGKILLed at
`--kill_at` x the window and started again `--restart_after_seconds` later (it joins from the store, or heals from a
live peer); site 2 is slowed 2x for the whole window (each step sleeps to twice the pace); site 3 is SIGSTOPped at
`--pause_at` x the window for two rounds' time (2 x H x pace) and then SIGCONTed. Site 0 is never touched: it records
every round it applies (time, the tokens the round's contributions trained) and θg after it.

Measured, per run, over the window (from the moment all four sites start training, `--window_seconds` long):

- **goodput**: the tokens that entered θg in rounds site 0 applied inside the window, per second. Through the store:
  the sum of the tokens of every contribution of each round's manifest (as the store recorded it, read and verified
  by `benchmarks.store_counts.CountingStore`); elastic: each exchange's contributors x H x tokens per step.
- **trained**: the tokens the sites trained in the window (their inner steps), whether they entered θg or not.
- **eval loss at equal tokens**: θg of site 0 after each round, evaluated on the held-out split, interpolated
  linearly in tokens at T, the fewest tokens any run got into θg (and at the store runs' own common count).

Each worker stops at the window's end (no `close()`: the job's end is not what is measured). Logs and θg files stay
in `--work`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from benchmarks.common import RESULTS_DIR, EventLog, command_line, ran_as_worker, write_results

BAND = 0.8  # the loss band: the rounds from BAND x T to T tokens
ROOT = Path(__file__).resolve().parent.parent
SITES = 4
HEALTHY, KILLED, SLOWED, PAUSED = 0, 1, 2, 3
RUNS = {
    "store_faults": ("store", True),
    "elastic_faults": ("elastic", True),
    "store_clean": ("store", False),
    "elastic_clean": ("elastic", False),
}
DEFAULT_RUNS = ",".join(RUNS)
LABELS = {
    "store_faults": "store, faults",
    "elastic_faults": "elastic gloo, faults",
    "store_clean": "store, no faults",
    "elastic_clean": "elastic gloo, no faults",
}
BUCKET = "goodput"
SLOW_FACTOR = 2.0
START_BOUND_SECONDS = 300.0  # a worker that is not ready by then failed
END_MARGIN_SECONDS = 20.0  # a worker still running this long after the window is stopped

BENCH_MODEL = {"hidden_size": 64, "num_hidden_layers": 4, "intermediate_size": 128}  # the long regime's
QUICK_MODEL = {"hidden_size": 32, "num_hidden_layers": 1, "intermediate_size": 64, "num_attention_heads": 2,
               "num_key_value_heads": 2}  # fmt: skip
QUICK = {
    "--runs": "store_faults,elastic_faults,store_clean",
    "--window_seconds": "12",
    "--inner_steps": "4",
    "--sync_delay": "1",
    "--pace_seconds": "0.15",
    "--batch": "2",
    "--model": json.dumps(QUICK_MODEL),
    "--vocab_size": "300",
    "--train_files": "20",
    "--block_size": "64",
    "--grace_seconds": "0.5",
    "--kill_at": "0.2",
    "--pause_at": "0.6",
    "--restart_after_seconds": "0",
    "--eval_every": "1",
    "--eval_blocks": "256",
}


# ----------------------------------------------------------------------------------------------- the worker


def worker_main(cli: argparse.Namespace) -> None:
    """One site: builds its engine (joining the store job or the Lighthouse), waits for the window, trains paced
    steps until the window ends, and exits (site 0 writes θg after every round it applies)."""
    signal.alarm(int(cli.window_seconds + START_BOUND_SECONDS + 2 * END_MARGIN_SECONDS))  # never outlive the run
    torch.set_num_threads(1)
    if cli.cpu is not None:
        os.sched_setaffinity(0, {cli.cpu})
    run = Path(cli.run_dir)
    event = EventLog(run / f"events_{cli.site}_{cli.attempt}.jsonl")
    event("starting")
    data = torch.load(Path(cli.work) / "data.pt")
    model, optimizer = site_model(cli, data)
    engine, counting = site_engine(cli, model, optimizer)
    tokens_per_step = cli.batch * data["train"].shape[1]
    engine.tokens_per_step = tokens_per_step
    event("ready", step=engine.inner_step)
    go = wait_for_go(run / "go.json")
    shard = data["train"][cli.site :: SITES]
    pace = Pace(cli.pace_seconds * (SLOW_FACTOR if cli.slowed else 1.0))
    recorder = RoundRecorder(engine, counting, run, cli, tokens_per_step, event) if cli.site == HEALTHY else None
    incarnation = engine.store.board.incarnation if engine.store is not None else ""
    event("training", step=engine.inner_step, incarnation=incarnation)
    while time.time() < go["end"]:
        started = time.time()
        lr = cli.lr * min(1.0, (engine.inner_step + 1) / cli.warmup)
        for group in optimizer.param_groups:
            group["lr"] = lr
        index = (torch.arange(cli.batch) + engine.inner_step * cli.batch) % len(shard)
        ids = shard[index]
        model(input_ids=ids, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        computed = time.time()
        base = engine.store.applied[0] if engine.store is not None else None  # the round a launch trains from
        engine.step()
        stepped = time.time()
        if recorder is not None:
            recorder.after_step()
        event("step", step=engine.inner_step, start=started, computed=computed, stepped=stepped)
        if engine.inner_step % cli.inner_steps == 0 and base is not None:
            event("launch", step=engine.inner_step, base=base, incarnation=incarnation)
        pace.wait()
    counts = counting.snapshot() if counting is not None else None
    event("end", step=engine.inner_step, stats=dict(engine.stats), counts=counts)
    os._exit(0)  # no close(): the window is over, and the job's end is not measured


class Pace:
    """One inner step every `seconds` on average: a step whose compute overran is made up by the next steps'
    sleeps (the shared cores' hiccups do not change a site's rate), unless the site fell more than `FORGIVEN` steps
    behind: then it was stopped (SIGSTOP), and it goes on at its rate from now without making that time up."""

    FORGIVEN = 10

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.due = time.time() + seconds

    def wait(self) -> None:
        now = time.time()
        if now - self.due > self.FORGIVEN * self.seconds:
            self.due = now
        time.sleep(max(0.0, self.due - now))
        self.due += self.seconds


def site_model(cli: argparse.Namespace, data: dict) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from benchmarks.common import inner_optimizer
    from hf_diloco.job.modeling import DEFAULT_MODEL_CONFIG, build_model

    spec = {"config": {**DEFAULT_MODEL_CONFIG, **json.loads(cli.model)}}
    model = build_model(spec, data["vocab"], *data["ids"], seed=cli.seed)
    return model, inner_optimizer(model, "adamw", cli.lr)


def diloco_settings(cli: argparse.Namespace) -> dict:
    """The DiLoCo settings of every run (the transport's own fields apart)."""
    return dict(
        inner_steps=cli.inner_steps,
        sync_delay=cli.sync_delay,
        outer_lr=cli.outer_lr,
        outer_momentum=cli.outer_momentum,
        compression=cli.compression,
        error_feedback=cli.compression != "none",
        exchange_pattern="all_gather",
    )


def site_engine(cli: argparse.Namespace, model: torch.nn.Module, optimizer: object) -> tuple[object, object]:
    from hf_diloco import DiLoCo, DiLoCoConfig

    if cli.transport == "store":
        from benchmarks.store_counts import CountingStore
        from hf_diloco import open_store
        from hf_diloco.core.settings.secret import job_secret

        config = DiLoCoConfig(
            **diloco_settings(cli), exchange="store", store_url=cli.url, site=f"site{cli.site}", quorum=cli.quorum,
            grace_seconds=cli.grace_seconds, adaptive_grace=True, round_deadline_seconds=cli.deadline_seconds,
            max_staleness=cli.max_staleness, snapshot_every=cli.snapshot_every, store_timeout_seconds=60.0,
        )  # fmt: skip
        counting = CountingStore(open_store(cli.url), job_secret())
        return DiLoCo(model, optimizer, config, store=counting), counting
    from hf_diloco.backends.torchft_membership import TorchftMembership

    config = DiLoCoConfig(**diloco_settings(cli), sync_timeout_seconds=cli.sync_timeout)
    membership = TorchftMembership(
        cli.url, f"site{cli.site}", min_workers=cli.min_workers, start_workers=cli.start_workers,
        min_workers_timeout=120.0, sync_timeout=cli.sync_timeout, quorum_timeout=120.0, connect_timeout=30.0,
        poll_seconds=0.5,
    )  # fmt: skip
    return DiLoCo(model, optimizer, config, membership=membership), None


def wait_for_go(path: Path) -> dict:
    deadline = time.monotonic() + START_BOUND_SECONDS
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {path} within {START_BOUND_SECONDS:g} s")
        time.sleep(0.05)
    go = json.loads(path.read_text())
    time.sleep(max(0.0, go["start"] - time.time()))
    return go


@dataclass
class RoundRecorder:
    """Site 0's record of the rounds it applies: when, the tokens that entered θg, and θg after them."""

    engine: object
    counting: object
    run: Path
    cli: argparse.Namespace
    tokens_per_step: int
    event: Callable
    seen: int = 0
    tokens: float = 0.0
    saved: int = field(default=0)

    def after_step(self) -> None:
        engine = self.engine
        rounds = engine.store.log.rounds if engine.store is not None else engine.elastic.log.rounds
        new = [entry for entry in rounds[self.seen :] if not entry.get("final")]
        self.seen = len(rounds)
        if not new:
            return
        for entry in new:
            self.event("round", tokens=self.round_tokens(entry), **self.describe(entry))
        self.saved += 1
        theta = {name: value.detach().clone() for name, value in engine.global_parameters().items()}
        torch.save({"tokens": self.tokens, "time": time.time()}, self.run / "theta" / f"{self.saved:05d}.meta")
        torch.save(theta, self.run / "theta" / f"{self.saved:05d}.pt")

    def round_tokens(self, entry: dict) -> float:
        if self.engine.store is not None:
            from benchmarks.store_counts import manifest_tokens

            header = self.counting.manifests[entry["fragment"], entry["round"]]
            tokens = manifest_tokens(header)
        else:
            tokens = entry["contributors"] * self.cli.inner_steps * self.tokens_per_step
        self.tokens += tokens
        return tokens

    def describe(self, entry: dict) -> dict:
        if self.engine.store is None:
            return {"step": entry["step"], "sites": entry["contributors"], "workers": entry["workers"],
                    "retries": entry["retries"], "total": self.tokens, "late": 0}  # fmt: skip
        header = self.counting.manifests[entry["fragment"], entry["round"]]
        return {
            "round": entry["round"], "sites": entry["sites"], "late": entry["late"], "total": self.tokens,
            "staleness": [e["staleness"] for e in header["entries"]], "who": [e["site"] for e in header["entries"]],
            "contributions": [[e["site"], e["incarnation"], e["base"]] for e in header["entries"]],
            "quorum_met": entry["quorum_met"],
        }  # fmt: skip


# ----------------------------------------------------------------------------------------------- the driver


class Sites:
    """The four site processes of one run (a restarted site is a new attempt), each its own process group."""

    def __init__(self, run_dir: Path, argv: list[str], env: dict, pin: bool):
        self.run_dir, self.argv, self.env, self.pin = run_dir, argv, env, pin
        self.processes: dict[tuple[int, int], subprocess.Popen] = {}
        self.started: dict[tuple[int, int], float] = {}

    def start(self, site: int, attempt: int, *extra: str) -> None:
        argv = [sys.executable, "-m", "benchmarks.goodput", "worker", "--site", str(site), "--attempt", str(attempt),
                "--run_dir", str(self.run_dir), *self.argv, *extra]  # fmt: skip
        if self.pin:
            argv += ["--cpu", str(site % os.cpu_count())]
        log = (self.run_dir / f"site{site}_{attempt}.log").open("wb")
        self.started[site, attempt] = time.time()
        self.processes[site, attempt] = subprocess.Popen(
            argv, env=self.env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True
        )

    def events(self, site: int, attempt: int = 0) -> list[dict]:
        path = self.run_dir / f"events_{site}_{attempt}.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]

    def signal(self, site: int, attempt: int, number: int) -> float:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.processes[site, attempt].pid, number)
        return time.time()

    def wait_ready(self, sites: list[tuple[int, int]]) -> None:
        deadline = time.monotonic() + START_BOUND_SECONDS
        for site, attempt in sites:
            while not any(e["kind"] == "ready" for e in self.events(site, attempt)):
                process = self.processes[site, attempt]
                if process.poll() is not None:
                    raise RuntimeError(f"site {site} exited ({process.returncode}) before it was ready; see "
                                       f"{self.run_dir / f'site{site}_{attempt}.log'}")  # fmt: skip
                if time.monotonic() > deadline:
                    raise TimeoutError(f"site {site} was not ready within {START_BOUND_SECONDS:g} s")
                time.sleep(0.1)

    def finish(self, end: float) -> dict[tuple[int, int], int]:
        codes = {}
        for key, process in self.processes.items():
            try:
                codes[key] = process.wait(timeout=max(1.0, end + END_MARGIN_SECONDS - time.time()))
            except subprocess.TimeoutExpired:
                self.signal(*key, signal.SIGKILL)
                codes[key] = process.wait()
        return codes

    def close(self) -> None:
        for key, process in self.processes.items():
            if process.poll() is None:
                self.signal(*key, signal.SIGCONT)
                self.signal(*key, signal.SIGKILL)
                process.wait()


def worker_argv(args: argparse.Namespace, work: Path, url: str) -> list[str]:
    names = ("inner_steps", "sync_delay", "pace_seconds", "batch", "lr", "warmup", "seed", "outer_lr",
             "outer_momentum", "compression", "quorum", "grace_seconds", "deadline_seconds", "max_staleness",
             "snapshot_every", "sync_timeout", "window_seconds")  # fmt: skip
    return [f"--{name}={getattr(args, name)}" for name in names] + ["--model", args.model, "--work", str(work),
                                                                    "--url", url]  # fmt: skip


@contextlib.contextmanager
def transport(kind: str, run_name: str, args: argparse.Namespace):
    """The store's URL and the sites' environment (a moto S3 server on loopback), or the Lighthouse's address."""
    env = dict(os.environ, OMP_NUM_THREADS="1", RUST_LOG="warn", PYTHONPATH=str(ROOT))
    if kind == "store":
        from tests.store_common import s3_server

        with s3_server(BUCKET) as s3:
            yield f"s3://{BUCKET}/{run_name}", {**env, **s3, "HF_DILOCO_JOB_SECRET": args.secret}
        return
    os.environ["RUST_LOG"] = "warn"
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=int(args.join_timeout * 1000),
                                  heartbeat_timeout_ms=int(args.heartbeat_timeout * 1000))  # fmt: skip
    port = int(lighthouse.address().rsplit(":", 1)[1].strip("/"))
    try:
        yield f"http://localhost:{port}", {**env, "HF_DILOCO_JOB_SECRET": args.secret}  # elastic needs it too
    finally:
        lighthouse.shutdown()


def fault_times(args: argparse.Namespace, start: float) -> list[tuple[float, str]]:
    """The fault schedule: (time, action), in order of time."""
    round_seconds = args.inner_steps * args.pace_seconds
    kill = start + args.kill_at * args.window_seconds
    pause = start + args.pause_at * args.window_seconds
    schedule = [(kill, "kill"), (kill + args.restart_after_seconds, "restart"), (pause, "stop"),
                (pause + 2 * round_seconds, "continue")]  # fmt: skip
    return sorted(schedule)


def run_one(name: str, args: argparse.Namespace, work: Path) -> dict:
    """One run: the four sites, the window, the faults; the figures of `figures`."""
    kind, faulty = RUNS[name]
    run_dir = work / name
    (run_dir / "theta").mkdir(parents=True, exist_ok=True)
    for stale in [run_dir / "go.json", *run_dir.glob("events_*"), *(run_dir / "theta").iterdir()]:
        stale.unlink(missing_ok=True)
    with transport(kind, name, args) as (url, env):
        sites = Sites(run_dir, worker_argv(args, work, url), env, args.pin)
        try:
            membership = ["--start_workers", str(SITES), "--min_workers", "1"] if kind == "elastic" else []
            for site in range(SITES):
                slowed = ["--slowed"] if faulty and site == SLOWED else []
                sites.start(site, 0, "--transport", kind, *membership, *slowed)
            sites.wait_ready([(site, 0) for site in range(SITES)])
            start = time.time() + 1.0
            end = start + args.window_seconds
            (run_dir / "go.json").write_text(json.dumps({"start": start, "end": end}))
            done: dict[str, float] = {}
            for when, action in fault_times(args, start) if faulty else []:
                time.sleep(max(0.0, when - time.time()))
                if action == "kill":
                    done[action] = sites.signal(KILLED, 0, signal.SIGKILL)
                elif action == "restart":
                    rejoin = ["--start_workers", "1", "--min_workers", "2"] if kind == "elastic" else []
                    sites.start(KILLED, 1, "--transport", kind, *rejoin)
                    done[action] = time.time()
                elif action == "stop":
                    done[action] = sites.signal(PAUSED, 0, signal.SIGSTOP)
                else:
                    done[action] = sites.signal(PAUSED, 0, signal.SIGCONT)
            codes = sites.finish(end)
        finally:
            sites.close()
    events = {key: sites.events(*key) for key in sites.processes}
    # A site that did not reach the window's end on its own (other than the one killed on purpose) is named.
    unfinished = {
        f"site{site}_{attempt}": code for (site, attempt), code in codes.items()
        if not any(e["kind"] == "end" for e in events[site, attempt]) and not (faulty and (site, attempt) == (KILLED, 0))
    }  # fmt: skip
    return figures(name, events, start, end, done, args, unfinished)


# ----------------------------------------------------------------------------------------------- the figures


def figures(
    name: str, events: dict[tuple[int, int], list[dict]], start: float, end: float, faults: dict[str, float],
    args: argparse.Namespace, unfinished: dict[str, int],
) -> dict:  # fmt: skip
    """A run's figures from its sites' event logs (`events[site, attempt]`); see the module docstring."""
    tokens_per_step = args.batch * args.block_size
    rounds = [e for e in events.get((HEALTHY, 0), []) if e["kind"] == "round" and e["time"] <= end]
    into = sum(e["tokens"] for e in rounds)
    trained = {
        f"site{site}_{attempt}": tokens_per_step * sum(
            1 for e in log if e["kind"] == "step" and start <= e["stepped"] <= end
        )
        for (site, attempt), log in events.items()
    }  # fmt: skip
    steps0 = [e for e in events.get((HEALTHY, 0), []) if e["kind"] == "step" and start <= e["stepped"] <= end]
    compute0 = sum(e["computed"] - e["start"] for e in steps0)
    waited0 = sum(e["stepped"] - e["computed"] for e in steps0)
    result = {
        "run": name,
        "window_seconds": end - start,
        "rounds": len(rounds),
        "tokens_into_theta": into,
        "goodput_tokens_per_second": into / (end - start),
        "tokens_trained": sum(trained.values()),
        "tokens_trained_by_site": trained,
        "sites_per_round": [e["sites"] for e in rounds],
        "late_contributions": sum(e.get("late", 0) for e in rounds),
        "retries": sum(e.get("retries", 0) for e in rounds),
        "site0_compute_seconds": compute0,
        "site0_engine_seconds": waited0,
        "site0_steps": len(steps0),
        "site0_utilization": compute0 / (end - start),
        "curve": [(e["time"] - start, e["total"]) for e in rounds],
        "faults": {action: when - start for action, when in faults.items()},
        "unfinished_sites": unfinished,
        "window_end_time": end,
    }
    result.update(contributions(events, rounds, start, end, args))
    restarted = events.get((KILLED, 1), [])
    first = next((e for e in restarted if e["kind"] == "step"), None)
    if "kill" in faults and first is not None:
        result["killed_site_back_seconds"] = first["stepped"] - faults["kill"]
        ready = next(e for e in restarted if e["kind"] == "ready")
        result["restarted_start_to_ready_seconds"] = ready["time"] - faults["restart"]
    return result


def contributions(
    events: dict[tuple[int, int], list[dict]], rounds: list[dict], start: float, end: float, args: argparse.Namespace
) -> dict:
    """Through a store: the contributions the sites launched in the window, those a round site 0 applied in the
    window took in, and those launched at least two rounds before the end that no such round took in (left out: too
    stale, or lost with a killed process)."""
    launched = {
        (f"site{site}", e["incarnation"], e["base"]): e["time"]
        for (site, _), log in events.items() for e in log if e["kind"] == "launch" and start <= e["time"] <= end
    }  # fmt: skip
    if not launched:
        return {}
    entered = {tuple(c) for e in rounds for c in e.get("contributions", [])}
    settled_by = end - 2 * args.inner_steps * args.pace_seconds
    left_out = sorted(key for key, when in launched.items() if key not in entered and when <= settled_by)
    return {"contributions_launched": len(launched), "contributions_entered": len(entered & set(launched)),
            "contributions_left_out": [list(key) for key in left_out]}  # fmt: skip


def evaluate_runs(results: dict[str, dict], work: Path, args: argparse.Namespace) -> dict:
    """Eval loss of θg at equal tokens: at T (the fewest tokens any run got into θg in the window) and at the store
    runs' own common count, interpolated linearly in tokens between the two rounds around it."""
    from benchmarks.common import evaluate

    data = torch.load(work / "data.pt")
    model, _ = site_model(args, data)
    eval_ids = data["eval"][: args.eval_blocks or None]
    everyone = min(result["tokens_into_theta"] for result in results.values())
    stores = [r["tokens_into_theta"] for name, r in results.items() if RUNS[name][0] == "store"]
    points = {"all_runs": everyone, "store_runs": min(stores) if stores else everyone}
    losses: dict[str, dict] = {}
    cache: dict[Path, float] = {}

    def loss_of(path: Path) -> float:
        if path not in cache:
            model.load_state_dict(torch.load(path.with_suffix(".pt")), strict=False)
            cache[path] = evaluate(model, eval_ids)
        return cache[path]

    for name in results:
        thetas = sorted((work / name / "theta").glob("*.meta"))
        metas = [(path, torch.load(path)) for path in thetas]
        metas = [(path, meta) for path, meta in metas if meta["time"] <= results[name]["window_end_time"]]
        losses[name] = {key: at_tokens(metas, tokens, loss_of) for key, tokens in points.items()}
        losses[name].update({f"{key}_band": band(metas, tokens, loss_of) for key, tokens in points.items()})
        curve = metas[:: max(1, args.eval_every)]
        losses[name]["curve"] = [(meta["tokens"], loss_of(path)) for path, meta in curve]
    return {"tokens": points, "losses": losses}


def band(metas: list[tuple[Path, dict]], tokens: float, loss_of: Callable[[Path], float]) -> float:
    """The mean eval loss of θg over the rounds whose tokens lie in [BAND x `tokens`, `tokens`]: one round's θg can
    sit on a spike of the loss (the fault-free runs have them too), the band averages a few rounds' worth."""
    losses = [loss_of(path) for path, meta in metas if BAND * tokens <= meta["tokens"] <= tokens]
    return statistics.fmean(losses) if losses else math.nan


def at_tokens(metas: list[tuple[Path, dict]], tokens: float, loss_of: Callable[[Path], float]) -> float:
    """The eval loss at `tokens`, linear between the θg of the last round at or below and the first above."""
    below = [(path, meta) for path, meta in metas if meta["tokens"] <= tokens]
    above = [(path, meta) for path, meta in metas if meta["tokens"] > tokens]
    if not below:
        return math.nan
    low_path, low = below[-1]
    if low["tokens"] == tokens:
        return loss_of(low_path)
    if not above:
        return math.nan  # the run did not get that many tokens into θg
    high_path, high = above[0]
    share = (tokens - low["tokens"]) / (high["tokens"] - low["tokens"])
    return (1 - share) * loss_of(low_path) + share * loss_of(high_path)


# ----------------------------------------------------------------------------------------------- the report


def table(results: dict[str, dict], evals: dict, args: argparse.Namespace) -> str:
    names = list(results)
    clean = results.get("store_clean")
    rows: list[tuple[str, list[str]]] = []

    def row(label: str, value: Callable[[str, dict], str]) -> None:
        rows.append((label, [value(name, results[name]) for name in names]))

    row("rounds site 0 applied in the window", lambda n, r: str(r["rounds"]))
    row("tokens into θg", lambda n, r: f"{r['tokens_into_theta']:,.0f}")
    row("goodput, tokens/s into θg", lambda n, r: f"{r['goodput_tokens_per_second']:,.0f}")
    if clean is not None:
        row("goodput / store without faults", lambda n, r: pct(r["goodput_tokens_per_second"]
                                                                 / clean["goodput_tokens_per_second"]))  # fmt: skip
    row("tokens the sites trained in the window", lambda n, r: f"{r['tokens_trained']:,.0f}")
    if clean is not None:
        row("trained / store without faults", lambda n, r: pct(r["tokens_trained"] / clean["tokens_trained"]))
    row("tokens into θg / tokens trained", lambda n, r: pct(r["tokens_into_theta"] / r["tokens_trained"]))
    row("sites per round: mean (fewest)", lambda n, r: sites_cell(r["sites_per_round"]))
    row("late contributions (entered a later round)", lambda n, r: str(r["late_contributions"]))
    row("contributions launched / entered / left out",
        lambda n, r: f"{r['contributions_launched']} / {r['contributions_entered']} / {len(r['contributions_left_out'])}"
        if "contributions_launched" in r else "-")  # fmt: skip
    row("exchanges retried", lambda n, r: str(r["retries"]))
    row("site 0: compute / window", lambda n, r: pct(r["site0_utilization"]))
    row("site 0: seconds inside engine.step()", lambda n, r: f"{r['site0_engine_seconds']:.1f}")
    row("killed site: kill -> its first step again, s",
        lambda n, r: f"{r['killed_site_back_seconds']:.1f}" if "killed_site_back_seconds" in r else "-")  # fmt: skip
    for key, label in (("all_runs", "every run"), ("store_runs", "the store runs")):
        tokens = evals["tokens"][key]
        for kind, what in (
            (key, f"at {tokens:,.0f} tokens"),
            (f"{key}_band", f"from {BAND:g} x to {tokens:,.0f} tokens"),
        ):
            row(f"eval loss {what} ({label})", lambda n, r, k=kind: number(evals["losses"][n].get(k, math.nan), ".4f"))
            if clean is not None:
                reference = evals["losses"]["store_clean"].get(kind, math.nan)
                row(f"gap against the store without faults, {what} ({label})",
                    lambda n, r, k=kind, ref=reference: number(100 * (evals["losses"][n].get(k, math.nan) / ref - 1),
                                                               "+.2f", "%"))  # fmt: skip
    lines = ["| | " + " | ".join(LABELS[n] for n in names) + " |", "|---" * (len(names) + 1) + "|"]
    lines += [f"| {label} | " + " | ".join(cells) + " |" for label, cells in rows]
    return "\n".join(lines) + "\n\n" + caption(args) + "\n"


def number(value: float, spec: str, unit: str = "") -> str:
    return "-" if math.isnan(value) else f"{value:{spec}}{unit}"


def sites_cell(sites: list[int]) -> str:
    return f"{sum(sites) / len(sites):.2f} ({min(sites)})" if sites else "-"


def pct(value: float) -> str:
    return f"{100 * value:.1f}%"


def caption(args: argparse.Namespace) -> str:
    round_seconds = args.inner_steps * args.pace_seconds
    return (
        f"4 sites, one process each, {args.parameters:,}-parameter Llama ({args.model}), {args.batch} x "
        f"{args.block_size} tokens per step, each step paced to {args.pace_seconds:g} s, H = {args.inner_steps} "
        f"({round_seconds:g} s a round), the exchange behind τ = {args.sync_delay} steps, {args.compression} with "
        f"error feedback, all_gather, outer lr {args.outer_lr:g} / momentum {args.outer_momentum:g}, a "
        f"{args.window_seconds:g} s window. Store: a moto S3 server on loopback, quorum {args.quorum}, adaptive grace "
        f"<= {args.grace_seconds:g} s, max_staleness {args.max_staleness}, snapshot_every {args.snapshot_every}. "
        f"Elastic: torchft Lighthouse (join timeout {args.join_timeout:g} s, heartbeat timeout "
        f"{args.heartbeat_timeout:g} s), sync_timeout {args.sync_timeout:g} s. Faults: site 1 SIGKILLed at "
        f"{args.kill_at * args.window_seconds:g} s and restarted {args.restart_after_seconds:g} s later; site 2 at half "
        f"speed throughout; site 3 SIGSTOPped at {args.pause_at * args.window_seconds:g} s for "
        f"{2 * round_seconds:g} s (two rounds)."
    )


# ----------------------------------------------------------------------------------------------- arguments


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.goodput", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="A smoke run: tiny model, a window of seconds.")
    parser.add_argument("--runs", default=DEFAULT_RUNS, help=f"Comma-separated runs of {', '.join(RUNS)}.")
    parser.add_argument("--window_seconds", type=float, default=1200.0)
    parser.add_argument("--inner_steps", type=int, default=20)
    parser.add_argument("--sync_delay", type=int, default=8, help="τ: inner steps the exchange runs behind.")
    parser.add_argument("--pace_seconds", type=float, default=0.5, help="Each inner step lasts at least this long.")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--block_size", type=int, default=128)
    parser.add_argument("--model", default=json.dumps(BENCH_MODEL), help="JSON overrides of the default model config.")
    parser.add_argument("--vocab_size", type=int, default=1024)
    parser.add_argument("--train_files", type=int, default=900)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--outer_lr", type=float, default=0.7)
    parser.add_argument("--outer_momentum", type=float, default=0.9)
    parser.add_argument("--compression", default="fp4")
    parser.add_argument("--quorum", type=int, default=2)
    parser.add_argument("--grace_seconds", type=float, default=2.0, help="Store: the most the adaptive grace waits.")
    parser.add_argument("--deadline_seconds", type=float, default=60.0)
    parser.add_argument("--max_staleness", type=int, default=2)
    parser.add_argument("--snapshot_every", type=int, default=10)
    parser.add_argument("--sync_timeout", type=float, default=10.0, help="Elastic: the exchange's bound.")
    parser.add_argument("--join_timeout", type=float, default=60.0, help="Elastic: the Lighthouse's join timeout.")
    parser.add_argument("--heartbeat_timeout", type=float, default=5.0)
    parser.add_argument("--kill_at", type=float, default=0.25, help="Site 1's kill, as a share of the window.")
    parser.add_argument("--restart_after_seconds", type=float, default=10.0)
    parser.add_argument("--pause_at", type=float, default=0.6, help="Site 3's pause, as a share of the window.")
    parser.add_argument("--eval_every", type=int, default=10, help="Rounds between the points of the loss curve.")
    parser.add_argument("--eval_blocks", type=int, default=0, help="Held-out blocks evaluated (0: all of them).")
    parser.add_argument("--pin", action="store_true", help="Pin site i to CPU i mod the CPU count.")
    parser.add_argument("--out", default=str(Path(RESULTS_DIR) / "goodput"), help="Writes OUT.json and OUT.md.")
    parser.add_argument("--work", default=None, help="Folder for data, logs and θg files (default: a temp dir).")
    parser.add_argument("--rescore", default=None, metavar="JSON",
                        help="Score the runs of this earlier report again (its --work must still hold their θg): "
                        "no site is started.")  # fmt: skip
    return parser


def worker_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.goodput worker")
    for name in ("site", "attempt", "inner_steps", "sync_delay", "batch", "warmup", "seed", "quorum",
                 "max_staleness", "snapshot_every", "start_workers", "min_workers"):  # fmt: skip
        parser.add_argument(f"--{name}", type=int, default=0)
    for name in ("pace_seconds", "lr", "outer_lr", "outer_momentum", "grace_seconds", "deadline_seconds",
                 "sync_timeout", "window_seconds"):  # fmt: skip
        parser.add_argument(f"--{name}", type=float, default=0.0)
    for name in ("transport", "run_dir", "work", "url", "model", "compression"):
        parser.add_argument(f"--{name}", required=True)
    parser.add_argument("--slowed", action="store_true")
    parser.add_argument("--cpu", type=int, default=None)
    return parser


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    unknown = [name for name in args.runs.split(",") if name not in RUNS]
    if unknown:
        parser.error(f"--runs: {', '.join(unknown)} unknown; choose from {', '.join(RUNS)}")
    if not 0 < args.sync_delay < args.inner_steps:
        parser.error(f"--sync_delay must be in (0, --inner_steps={args.inner_steps}): the exchange runs behind")
    if not 0 < args.kill_at < args.pause_at < 1:
        parser.error("--kill_at and --pause_at are shares of the window: 0 < kill_at < pause_at < 1")
    if args.pause_at * args.window_seconds + 2 * args.inner_steps * args.pace_seconds >= args.window_seconds:
        parser.error("the pause (two rounds from --pause_at) must end inside the window: lower --pause_at")


def parse(argv: list[str]) -> argparse.Namespace:
    parser = build_parser()
    if "--quick" in argv:
        argv = [*argv, *[item for flag, value in QUICK.items() if flag not in argv for item in (flag, value)]]
    args = parser.parse_args(argv)
    check_arguments(parser, args)
    return args


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    if ran_as_worker(argv, worker_main, worker_parser):
        return {}
    args = parse(argv)
    torch.set_num_threads(1)  # the evaluation, on cores the sites share
    if args.rescore:
        earlier = json.loads(Path(args.rescore).read_text())
        settings = {**earlier["settings"], "out": args.out, "rescore": args.rescore}
        return finish(earlier["runs"], argparse.Namespace(**settings), Path(settings["work"]), argv)
    work = Path(args.work or tempfile.mkdtemp(prefix="goodput_"))
    work.mkdir(parents=True, exist_ok=True)
    args.secret = secrets.token_hex(16)  # the job's secret, to the sites through their environment
    from benchmarks.common import prepare_data

    if not (work / "data.pt").exists():
        prepare_data(work, args.block_size, args.train_files, args.vocab_size)
    data = torch.load(work / "data.pt")
    args.parameters = sum(p.numel() for p in site_model(args, data)[0].parameters())
    results = {}
    for name in args.runs.split(","):
        print(f"{name} ...", flush=True)
        results[name] = run_one(name, args, work)
    return finish(results, args, work, argv)


def finish(results: dict[str, dict], args: argparse.Namespace, work: Path, argv: list[str]) -> dict:
    evals = evaluate_runs(results, work, args)
    report_table = table(results, evals, args)
    settings = {key: value for key, value in vars(args).items() if key != "secret"}
    report = {"command": command_line("goodput", argv), "settings": settings, "runs": results, "eval": evals,
              "table": report_table}  # fmt: skip
    write_results(args.out, report, report_table)
    print(f"wrote {args.out}.json and {args.out}.md; logs and θg in {work}")
    return report


if __name__ == "__main__":
    main()
