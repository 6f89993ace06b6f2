"""Elastic membership from the config alone: two sites, each one `DiLoCoTrainer` process given `lighthouse` and
`site` in its `DiLoCoTrainingArguments`, against a real `torchft_lighthouse`: both finish with the same θg (bitwise),
every exchange ran with both, the start-up line says the run is elastic and the card counts the exchanges."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.dist_utils import free_port
from tests.elastic_common import JOB_SECRET, sites_ended_alike

REPO = Path(__file__).resolve().parents[1]
SITE = REPO / "tests" / "scripts" / "elastic_trainer_site.py"
LIGHTHOUSE = Path(sys.executable).parent / "torchft_lighthouse"
TORCHRUN = Path(sys.executable).parent / "torchrun"
SITES = ["site-a", "site-b"]


def site_environment(**variables: str) -> dict[str, str]:
    """The environment of a site launched on its own: this checkout, one thread, no launcher's rank variables."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "RUST_LOG": "warn", **JOB_SECRET}
    env.update(variables)
    for variable in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(variable, None)
    return env


@contextlib.contextmanager
def lighthouse_and_sites(env: dict[str, str]) -> Iterator[tuple[int, list[subprocess.Popen]]]:
    """A Lighthouse on a free port, and a list the caller adds its sites' processes to; on the way out every one
    still running is killed, the Lighthouse last."""
    port = free_port()
    command = [str(LIGHTHOUSE), "--min_replicas", "1", "--join_timeout_ms", "60000", "--bind", f"127.0.0.1:{port}"]
    lighthouse = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    processes: list[subprocess.Popen] = []
    try:
        time.sleep(1.0)
        yield port, processes
    finally:
        for process in [*processes, lighthouse]:
            if process.poll() is None:
                process.kill()
                process.wait()


def run_sites(
    tmp_path: Path,
    die_at: dict[str, int] | None = None,
    round_policy: str = "steps",
    ranks: int = 1,
    **variables: str,
) -> tuple[list[int], dict[str, str]]:
    """Start a Lighthouse and the two sites (a site in `die_at` dies at the end of that step; `variables` go to
    their environment; with `ranks` > 1 each site is a torchrun of that many ranks, DATA_PARALLEL or PIPELINE_STAGES
    in `variables` saying which), then stop the Lighthouse; their exit codes and logs."""
    env = site_environment(**variables, ROUND_POLICY=round_policy)
    with lighthouse_and_sites(env) as (port, sites):
        for slot, site in enumerate(SITES):
            launcher = [sys.executable]
            if ranks > 1:
                launcher = [str(TORCHRUN), "--standalone", "--nproc_per_node", str(ranks)]
            argv = [*launcher, str(SITE), f"http://127.0.0.1:{port}", site, str(slot), str(tmp_path)]
            argv += [str((die_at or {})[site])] if site in (die_at or {}) else []
            log = (tmp_path / f"{site}.log").open("a")
            sites.append(subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT))
        codes = [process.wait(timeout=240) for process in sites]
    return codes, {site: (tmp_path / f"{site}.log").read_text() for site in SITES}


@pytest.mark.parametrize("round_policy", ["steps", "balanced"])
def test_two_trainer_sites_from_the_config_end_with_the_same_global_model(tmp_path, round_policy):
    codes, logs = run_sites(tmp_path, round_policy=round_policy)
    a, b = sites_ended_alike(tmp_path, SITES, codes, logs)
    # 4 steps of H=2: 2 exchanges, both with both sites (start_workers=2).
    for result in (a, b):
        assert result["summary"]["exchanges"] == 2 and result["summary"]["fewest_workers"] == 2, result["summary"]
    for site in SITES:
        assert f"elastic, site {site}, min_workers 1" in logs[site], logs[site]
    card = (tmp_path / "site-a" / "README.md").read_text()
    assert "| Worker membership | elastic: 2 exchanges among 2 workers; 0 drop(s), 0 join(s)" in card, card


def test_two_trainer_sites_overlap_each_exchange_with_the_next_inner_step(tmp_path):
    """Streaming with τ = 1 through `DiLoCoTrainer` under membership: both exchanges run behind the next inner step
    (completed when they are applied) and the two sites end with the same θg."""
    codes, logs = run_sites(tmp_path, SYNC_DELAY="1")
    a, b = sites_ended_alike(tmp_path, SITES, codes, logs)
    for result in (a, b):
        summary = result["summary"]
        assert summary["exchanges"] == 2 and summary["in_background"] == 2, summary
        assert summary["fewest_workers"] == 2, summary


SITES_OF_TWO_RANKS = {
    "ddp": dict(DATA_PARALLEL="2"),
    "fsdp": dict(DATA_PARALLEL="2", FSDP="1"),
    "pipeline": dict(PIPELINE_STAGES="2"),
}


@pytest.mark.parametrize("kind", SITES_OF_TWO_RANKS)
def test_two_trainer_sites_of_two_ranks_each_end_with_the_same_global_model(tmp_path, kind):
    """Each site a `torchrun --nproc_per_node 2` of `DiLoCoTrainer` ranks: two data-parallel ranks (DDP, or FSDP2
    over the two) or two pipeline stages. One member per site, both exchanges with both sites, θg bitwise equal, the
    start-up line naming the site's ranks."""
    codes, logs = run_sites(tmp_path, ranks=2, **SITES_OF_TWO_RANKS[kind])
    a, b = sites_ended_alike(tmp_path, SITES, codes, logs)
    for result in (a, b):
        assert result["summary"]["exchanges"] == 2 and result["summary"]["most_workers"] == 2, result["summary"]
    for site in SITES:
        ranks = "2 pipeline stages" if kind == "pipeline" else "2 data-parallel ranks"
        assert f"elastic, site {site}, min_workers 1: {ranks} per site" in logs[site], logs[site]


@pytest.mark.slow
def test_a_trainer_site_lost_mid_run_leaves_the_other_to_finish_alone(tmp_path):
    codes, logs = run_sites(tmp_path, die_at={"site-b": 3})
    assert codes == [0, 3], logs
    summary = torch.load(tmp_path / "site-a.pt", weights_only=False)["summary"]
    # The first exchange (step 2) ran with both; the second (step 4) among the survivor alone, after a drop.
    assert summary["exchanges"] == 2 and summary["fewest_workers"] == 1 and summary["most_workers"] == 2, summary
    assert summary["drops"] >= 1, summary


def test_trainer_sites_lost_with_their_lighthouse_resume_from_their_checkpoints(tmp_path):
    """Both sites checkpoint at step 2 (θg and the outer state in each one's DiLoCo state) and die at step 3; the
    Lighthouse is stopped. Restarted against a new one with `resume_from_checkpoint`, they resume at step 2 (one
    exchange left, not two) and end with the same θg."""
    codes, logs = run_sites(tmp_path, die_at={"site-a": 3, "site-b": 3}, SAVE_STEPS="2")
    assert codes == [3, 3], logs
    for site in SITES:
        state = torch.load(tmp_path / site / "checkpoint-2" / "diloco_state_rank0.pt", weights_only=True)["engine"]
        assert state["inner_step"] == 2 and state["elastic_progress"] > 0 and state["outer_optimizer"], site
    codes, logs = run_sites(tmp_path, SAVE_STEPS="2", RESUME="1")
    a, b = sites_ended_alike(tmp_path, SITES, codes, logs)
    for result in (a, b):
        assert result["summary"]["exchanges"] == 1 and result["summary"]["fewest_workers"] == 2, result["summary"]


HEAL_SITE = REPO / "tests" / "scripts" / "elastic_trainer_heal.py"


def _start_heal_site(
    port: int, site: str, slot: int, mode: str, tmp_path: Path, env: dict, ranks: int = 1
) -> subprocess.Popen:
    launcher = [sys.executable] if ranks == 1 else [str(TORCHRUN), "--standalone", "--nproc_per_node", str(ranks)]
    argv = [*launcher, str(HEAL_SITE), f"http://127.0.0.1:{port}", site, str(slot), str(tmp_path), mode]
    log = (tmp_path / f"{site}-{mode}.log").open("a")
    return subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)


def _lose_and_restart_site_b(tmp_path: Path, ranks: int = 1, **variables: str) -> tuple[list[int], int]:
    """site-a and site-b train; site-b dies at step 3 (its last rank) and is started again from nothing while site-a
    waits at step 6 until the new site-b heartbeats to the Lighthouse. The exit codes of site-a and the new site-b,
    and that of the lost one."""
    env = site_environment(**variables)
    with lighthouse_and_sites(env) as (port, processes):
        processes.append(_start_heal_site(port, "site-a", 0, "wait", tmp_path, env, ranks))
        processes.append(_start_heal_site(port, "site-b", 1, "die", tmp_path, env, ranks))
        lost = processes[1].wait(timeout=240)
        before = _heartbeating(port, "site-b")
        processes.append(_start_heal_site(port, "site-b", 1, "rejoin", tmp_path, env, ranks))
        deadline = time.monotonic() + 120
        while not _heartbeating(port, "site-b") - before and time.monotonic() < deadline:
            time.sleep(0.2)
        (tmp_path / "rejoined").touch()  # site-a goes on: the Lighthouse now waits for the new site-b too
        return [processes[0].wait(timeout=240), processes[2].wait(timeout=240)], lost


def _heartbeating(port: int, site: str) -> set[str]:
    """The torchft replica ids (`site:uuid`, one per start of a site) on the Lighthouse's status page."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=5) as response:
        return set(re.findall(rf"{site}:[0-9a-f-]+", response.read().decode(errors="replace")))


@pytest.mark.slow
def test_a_lost_trainer_site_restarted_fresh_heals_and_its_trainer_jumps_to_the_jobs_step(tmp_path):
    """site-b dies at step 3 and is started again from nothing while site-a trains on (site-a waits at step 6 until
    the new site-b heartbeats to the Lighthouse). The new site-b heals as it joins, at site-a's next exchange: its
    Trainer starts at the job's step, reads the batches an uninterrupted run reads at those steps, ends at max_steps
    with site-a, on the same learning rate, and with the same θg."""
    codes, lost = _lose_and_restart_site_b(tmp_path)
    logs = {path.name: path.read_text() for path in tmp_path.glob("*.log")}
    assert codes == [0, 0] and lost == 3, logs
    a = torch.load(tmp_path / "site-a-wait.pt", weights_only=False)
    b = torch.load(tmp_path / "site-b-rejoin.pt", weights_only=False)
    for name, value in a["global"].items():
        assert torch.equal(value, b["global"][name]), name
    assert b["summary"]["heals"] == 1 and a["global_step"] == b["global_step"] == 12, (a["summary"], b["summary"])
    # The new site-b trained steps 1-2 on its own, healed at the exchange after step 2, and went on from the job's
    # step there: the steps between were never trained, and each step read the batch of its place in the epoch.
    steps = sorted(b["seen"])
    healed_at = steps[0] - 1
    assert steps == list(range(healed_at + 1, 13)) and healed_at >= 4, steps  # the job was past step 3
    for step in steps:
        assert b["seen"][step] == b["order"][step - 1], (step, b["seen"], b["order"])
    assert f"continues at the job's step {healed_at}" in logs["site-b-rejoin.log"], logs["site-b-rejoin.log"]
    # The learning-rate schedule and the log follow the job's step: the same last rate as site-a; no log between.
    rates = [
        [entry["learning_rate"] for entry in run["log"] if entry.get("step") == 12 and "learning_rate" in entry]
        for run in (a, b)
    ]
    assert rates[0] and rates[0] == rates[1], rates
    logged = [entry["step"] for entry in b["log"] if "loss" in entry]
    assert logged == steps, logged


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["fsdp", "pipeline"])
def test_a_site_that_loses_one_rank_leaves_whole_and_heals_both_ranks_when_restarted(tmp_path, kind):
    """Each site a torchrun of two `DiLoCoTrainer` ranks: FSDP2 over two data-parallel ranks, or two pipeline stages.
    One rank of site-b dies at step 3: its torchrun stops the other, and site-a trains on without it. site-b, started
    again from nothing, heals each of its ranks from the matching rank of site-a (FSDP: its rows of θg and of the
    outer state; pipeline: its stage's), its Trainers jump to the job's step, and the four ranks end with the same θg,
    bit for bit. With FSDP a site's epoch is 8 steps, so a heal at the job's step 8 skips one whole epoch."""
    codes, lost = _lose_and_restart_site_b(tmp_path, ranks=2, **SITES_OF_TWO_RANKS[kind])
    logs = {path.name: path.read_text() for path in tmp_path.glob("*.log")}
    assert codes == [0, 0] and lost != 0, logs
    assert not list(tmp_path.glob("site-b-die_r*.pt")), "the lost site ran on"
    runs = {
        (site, rank): torch.load(tmp_path / f"{site}-{mode}_r{rank}.pt", weights_only=False)
        for site, mode in (("site-a", "wait"), ("site-b", "rejoin"))
        for rank in (0, 1)
    }
    for (site, rank), run in runs.items():
        assert run["sharded"] == (kind == "fsdp") and run["global_step"] == 12, (site, rank, run["global_step"])
        reference = runs["site-a", rank]["global"]  # a stage's θg is its own parameters'; FSDP's every parameter
        assert run["global"].keys() == reference.keys(), (site, rank)
        for name, value in reference.items():
            assert torch.equal(value, run["global"][name]), (site, rank, name)
    stages = [set(runs["site-a", rank]["global"]) for rank in (0, 1)]
    assert (stages[0] == stages[1]) == (kind == "fsdp") and (kind == "fsdp" or not stages[0] & stages[1]), stages
    for rank in (0, 1):
        healed, live = runs["site-b", rank]["summary"], runs["site-a", rank]["summary"]
        assert healed["heals"] == 1 and live["drops"] >= 1 and live["fewest_workers"] == 1, (healed, live)
        # The healed ranks trained (and logged a loss at) the job's steps from the heal on, not the steps the job ran
        # without them.
        logged = [entry["step"] for entry in runs["site-b", rank]["log"] if "loss" in entry]
        assert logged == list(range(logged[0], 13)) and logged[0] > 5, logged
