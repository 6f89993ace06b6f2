"""`round_policy: balanced` under elastic membership, on real processes: a torchft Lighthouse, workers of
tests/scripts/elastic_worker.py whose inner steps are paced to a fixed length, one of them twice as long.

Nothing can come from plans here (the workers of an exchange are whoever is present), so the exchange weighs: each
worker reports the steps its Δ covers and its step time, the average is Σ w_m Δm / Σ w, and each worker plans its next
round against the fastest member of the round's last exchange. Compared with a reference written here in plain torch:
SGD inner steps from θg on each worker's batches, the steps-weighted mean, Nesterov outer SGD.
"""

from __future__ import annotations

import signal
import time

import pytest
import torch

from hf_diloco.core.rounds.round_policy import RoundClock
from tests.elastic_common import ElasticJob, assert_same_global
from tests.engine_common import batch_for, tiny_model

H, ROUNDS, PACED_SECONDS = 8, 5, 0.15
INNER_LR, OUTER_LR, MOMENTUM = 0.05, 0.7, 0.9  # the worker script's SGD and the config's outer defaults
BALANCED = ["--round_policy", "balanced", "--inner_steps", str(H), "--paced_seconds", str(PACED_SECONDS)]


@pytest.fixture
def job(tmp_path):
    job = ElasticJob(tmp_path)
    yield job
    job.close()


def rounds_of(job: ElasticJob, replica: str) -> list[dict]:
    return [event for event in job.events(replica) if event["kind"] == "round"]


def weighted_reference(rounds: list[list[tuple[int, int, int]]]) -> dict[str, torch.Tensor]:
    """θg after `rounds`, each a list of (worker, first inner step, steps): every worker trains its steps of SGD from
    θg on its own batches, θg takes a Nesterov step with the mean of their pseudo-gradients weighted by steps."""
    model = tiny_model(seed=0)
    theta = {name: p.detach().clone() for name, p in model.named_parameters()}
    momentum = {name: torch.zeros_like(value) for name, value in theta.items()}
    for members in rounds:
        total = {name: torch.zeros_like(value) for name, value in theta.items()}
        for worker, first, steps in members:
            with torch.no_grad():
                for name, p in model.named_parameters():
                    p.copy_(theta[name])
            for step in range(first, first + steps):
                model.zero_grad()
                model(**batch_for(worker, step)).loss.backward()
                with torch.no_grad():
                    for p in model.parameters():
                        p -= INNER_LR * p.grad
            for name, p in model.named_parameters():
                total[name] += steps * (theta[name] - p.detach())
        weight = sum(steps for _, _, steps in members)
        for name in theta:
            mean = total[name] / weight
            momentum[name] = MOMENTUM * momentum[name] + mean
            theta[name] = theta[name] - OUTER_LR * (mean + MOMENTUM * momentum[name])
    return theta


def test_elastic_balanced_rounds_follow_speed_and_weight_the_average_by_steps(job):
    """Two elastic workers, one at half speed: from round 2 it runs H/2 steps per round, the fast one waits little,
    both end with the same θg, and θg is the reference's steps-weighted average."""
    common = [*BALANCED, "--rounds", str(ROUNDS), "--start_workers", "2"]
    job.start(0, *common)
    job.start(1, *common, "--slowed")
    codes = job.finish(timeout=120)
    assert codes == {"worker0": 0, "worker1": 0}, {name: job.log(name) for name in codes}
    fast, slow = rounds_of(job, "worker0"), rounds_of(job, "worker1")
    assert [event["round_steps"] for event in fast] == [H] * ROUNDS
    assert [event["round_steps"] for event in slow] == [H] + [H // 2] * (ROUNDS - 1)
    waits = [event["wait_fraction"] for event in fast[2:]]
    # Under `steps` it waits half of every round (measured: 50%; balanced 1%): what is left is the quorum and exchange.
    assert sum(waits) / len(waits) <= 0.1, waits
    theta = assert_same_global(job, ["worker0", "worker1"])
    first_slow = [0, H] + [H + k * (H // 2) for k in range(1, ROUNDS - 1)]
    plan = [[(0, r * H, H), (1, first_slow[r], H if r == 0 else H // 2)] for r in range(ROUNDS)]
    for name, value in weighted_reference(plan).items():
        torch.testing.assert_close(theta[name], value, rtol=0, atol=1e-5, msg=name)
    exchange = job.final("worker0")["rounds"][-2]
    assert exchange["workers"] == exchange["contributors"] == 2


def test_a_slow_worker_lost_under_balanced_rejoins_and_is_measured_again(job):
    """The slow worker is killed inside an exchange: the fast one retries alone and goes on with H steps per round;
    restarted, the slow worker heals, runs H steps in its first round (not measured yet), then H/2, and both end with
    the same θg."""
    rounds, go = 6, job.out / "restarted"
    lost_at = 2 * H  # the fast worker's second round's last exchange; the slow worker's is at H + H/2
    # Two fragments: the joiner may come in mid-round, and close() syncs fragment 0's tail, weighted.
    common = [*BALANCED, "--fragments", "2", "--rounds", str(rounds), "--start_workers", "2", "--sync_timeout", "10"]
    job.start(0, *common, "--wait_at", str(lost_at + 2), "--wait_file", str(go))
    victim = job.start(1, *common, "--slowed", "--stall_at", str(H + H // 2), "--stall_seconds", "60")
    job.wait_for("worker1", lambda e: e["kind"] == "stalling")
    time.sleep(0.5)  # the fast worker is inside the exchange now, waiting for the slow one
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    job.wait_for("worker0", lambda e: e["kind"] == "exchange" and e["step"] == lost_at)
    restarted = time.time()
    job.start(1, *BALANCED, "--fragments", "2", "--rounds", str(rounds), "--slowed", "--min_workers", "1")
    job.wait_for("worker1", lambda e: e["kind"] == "bound" and e["time"] > restarted, timeout=120)
    go.touch()
    codes = job.finish(timeout=180)
    assert codes == {"worker0": 0, "worker1": 0}, {name: job.log(name) for name in codes}
    assert_same_global(job, ["worker0", "worker1"])
    survivor = {e["step"]: e for e in job.events("worker0") if e["kind"] == "exchange"}
    assert survivor[lost_at]["retries"] >= 1 and survivor[lost_at]["contributors"] == 1
    assert [event["round_steps"] for event in rounds_of(job, "worker0")] == [H] * rounds
    joined = [e for e in job.events("worker1") if e["kind"] == "exchange" and e["healed"]][-1]
    after = [event for event in rounds_of(job, "worker1") if event["time"] > joined["time"]]
    assert [event["round_steps"] for event in after][:2] == [H, H // 2], after
    assert after[-1]["rounds"] == rounds  # it ends at the job's round, counted from the peer it healed from
    later = [entry for step, entry in survivor.items() if step > joined["step"] + H]
    assert later and all(entry["contributors"] == 2 for entry in later)
    tails = [entry for entry in job.final("worker0")["rounds"] if entry["final"]]
    assert [(entry["fragment"], entry["contributors"]) for entry in tails] == [(0, 2)]  # fragment 1 ended the round


def test_at_a_rounds_end_every_elastic_worker_syncs_the_same_tails_without_asking():
    """Under membership nobody knows the others' tails: at a round's end all but the last fragment, else all."""
    from hf_diloco.core.layout.topology import Topology
    from hf_diloco.core.rounds.round_policy import BalancedRounds

    policy = BalancedRounds(8, 2, 0, Topology.single_process(), weighs_in_exchange=True)
    assert policy.tail_scales(0) == [None, None]
    for step in range(1, 9):
        policy.launches(step)
        policy.end_round_if_due(step, RoundClock())
        assert policy.tail_scales(step) == ([1.0, None] if step == 8 else [1.0, 1.0]), step
    assert policy.launch_weights == [4, 8] and policy.launch_scale(0) == 1.0  # all since the start, each
