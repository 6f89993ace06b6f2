"""Elastic workers on real processes: a torchft Lighthouse, three workers (tests/scripts/elastic_worker.py), gloo.

A worker is SIGKILLed (or SIGSTOPped) while the others are inside an exchange; they retry among themselves and
continue without restart; the worker is restarted (or continued), heals from a live peer at the next exchange and
the three finish with bitwise-equal θg. The codec-`none` runs are compared with a reference written here in plain
torch: SGD inner steps on each worker's slot, the mean over the workers that contributed to each round, Nesterov
outer SGD.
"""

from __future__ import annotations

import re
import signal
import time

import pytest
import torch

from tests.elastic_common import STEPS, ElasticJob, H, assert_same_global
from tests.engine_common import batch_for, tiny_model

INNER_LR, OUTER_LR, MOMENTUM = 0.05, 0.7, 0.9


@pytest.fixture
def job(tmp_path):
    job = ElasticJob(tmp_path)
    yield job
    job.close()


def exchanges(job: ElasticJob, replica: str) -> dict[int, dict]:
    return {event["step"]: event for event in job.events(replica) if event["kind"] == "exchange"}


def reference(contributors: dict[int, list[int]], tau: int = 0) -> dict[str, torch.Tensor]:
    """θg after STEPS inner steps: every round, each contributing worker trains H SGD steps on its slot from θg; θg
    takes a Nesterov step with the mean of their pseudo-gradients (in worker order). With `tau` > 0 (streaming with
    α = 0) each round's average is applied τ steps after its launch and θm <- θg then: a round after the first trains
    from θg only its last H - τ steps (the τ steps before the apply are trained, then overwritten)."""
    model = tiny_model(seed=0)
    names = [name for name, _ in model.named_parameters()]
    theta = {name: p.detach().clone() for name, p in model.named_parameters()}
    momentum = {name: torch.zeros_like(value) for name, value in theta.items()}
    for end in range(H, STEPS + 1, H):
        deltas = []
        for worker in contributors[end]:
            with torch.no_grad():
                for name, p in model.named_parameters():
                    p.copy_(theta[name])
            for step in range(end - H if end == H else end - H + tau, end):
                model.zero_grad()
                model(**batch_for(worker, step)).loss.backward()
                with torch.no_grad():
                    for p in model.parameters():
                        p -= INNER_LR * p.grad
            deltas.append({name: theta[name] - p.detach() for name, p in model.named_parameters()})
        for name in names:
            total = deltas[0][name].clone()
            for delta in deltas[1:]:
                total += delta[name]
            mean = total / len(deltas)
            momentum[name] = MOMENTUM * momentum[name] + mean
            theta[name] = theta[name] - OUTER_LR * (mean + MOMENTUM * momentum[name])
    return theta


def check_lost_and_joined(job: ElasticJob, lost_at: int, tau: int = 0) -> None:
    """The round of `lost_at` committed among two after a retry; the worker came back, healed and counts again. With
    `tau` > 0 the survivors' exchanges ran behind the inner steps (logged when they complete, τ steps later)."""
    survivor = exchanges(job, "worker0")
    assert survivor[lost_at]["workers"] == 2 and survivor[lost_at]["contributors"] == 2
    assert survivor[lost_at]["retries"] >= 1
    joined = [e for e in job.events("worker2") if e["kind"] == "exchange" and e["healed"]]
    assert joined, job.log("worker2")
    join_step = joined[-1]["step"]
    assert lost_at < join_step < STEPS
    if not tau:  # healed, it holds the others' θg at the exchange (theirs is logged after its apply with τ > 0)
        assert joined[-1]["theta_g"] == survivor[join_step]["theta_g"]
    # Its first round counts from the next one.
    assert survivor[join_step]["workers"] == 3 and survivor[join_step]["contributors"] == 2
    for step, entry in survivor.items():
        expected = 3 if step < lost_at or step > join_step else 2
        assert entry["contributors"] == expected, (step, entry)
    theta = assert_same_global(job, ["worker0", "worker1", "worker2"])
    plan = {end: [0, 1, 2] if end < lost_at or end > join_step else [0, 1] for end in range(H, STEPS + 1, H)}
    expected = reference(plan, tau)
    for name, value in expected.items():
        torch.testing.assert_close(theta[name], value, rtol=0, atol=1e-5, msg=name)
    summary = job.final("worker2")["summary"]
    assert summary["heals"] >= 1 and summary["heal_bytes"] > 0
    assert job.final("worker0")["summary"]["drops"] >= 1 and job.final("worker0")["summary"]["joins"] >= 1


def kill_mid_exchange_and_restart(job: ElasticJob, lost_at: int, args: list[str], wait_at: int) -> None:
    """Workers 0 and 1 run with `args`; worker 2 stalls inside the exchange of inner step `lost_at` and is SIGKILLed
    there. Once the two committed that exchange without it, worker 2 starts again (`min_workers` 2); the two, waiting
    at `wait_at`, go on when it heartbeats to the Lighthouse (their next quorum waits for it). All three end with 0."""
    go = job.out / "restarted"
    survivor_args = [*args, "--start_workers", "3", "--wait_at", str(wait_at), "--wait_file", str(go)]
    job.start(0, *survivor_args)
    job.start(1, *survivor_args)
    victim = job.start(2, *args, "--start_workers", "3", "--stall_at", str(lost_at), "--stall_seconds", "60")
    job.wait_for("worker2", lambda e: e["kind"] == "stalling")
    time.sleep(0.5)  # the others are inside the exchange now, waiting for this worker
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    job.wait_for("worker0", lambda e: e["kind"] == "exchange" and e["step"] == lost_at)
    restarted = time.time()
    job.start(2, *args, "--min_workers", "2")  # the same replica name and slot, a new process
    job.wait_for("worker2", lambda e: e["kind"] == "bound" and e["time"] > restarted, timeout=120)
    go.touch()
    codes = job.finish()
    assert codes == {"worker0": 0, "worker1": 0, "worker2": 0}, {n: job.log(n) for n in codes}


def test_a_killed_worker_is_dropped_mid_exchange_and_rejoins(job):
    """SIGKILL with the exchange in flight: the two others retry among themselves and go on; restarted, the worker
    heals from a live peer at the next exchange and the three finish with the same θg as the reference."""
    lost_at = 12
    kill_mid_exchange_and_restart(job, lost_at, [], wait_at=lost_at + H + 2)
    check_lost_and_joined(job, lost_at)


def test_a_worker_lost_with_a_background_exchange_in_flight_matches_the_reference(job):
    """Streaming with τ = 1 (α = 0): every exchange runs behind the next inner step, as with a fixed membership.
    SIGKILL with the survivors' exchange in flight: they find it failed when it is due, retry it among the two and
    apply it at the same step; restarted, the worker heals at the next launch and joins the exchange running then.
    θg is bitwise equal on the three and equal within 1e-5 to the plain-torch reference of those rounds."""
    lost_at = 12
    kill_mid_exchange_and_restart(job, lost_at, ["--sync_delay", "1", "--merge_alpha", "0"], wait_at=lost_at + H + 2)
    check_lost_and_joined(job, lost_at, tau=1)
    survivor = exchanges(job, "worker0")
    assert all(entry["background"] for entry in survivor.values()), survivor  # the retried one too, first
    # The lost round completed (and was logged) at its apply, τ = 1 step after its launch.
    completed = next(e for e in job.events("worker0") if e["kind"] == "exchange" and e["step"] == lost_at)
    steps_before = [e["step"] for e in job.events("worker0") if e["kind"] == "step" and e["time"] <= completed["time"]]
    assert max(steps_before) == lost_at + 1, steps_before


def test_a_stopped_worker_is_dropped_after_the_timeout_and_rejoins(job):
    """SIGSTOP with the exchange in flight: the others give up on it after sync_timeout, retry among themselves and
    go on; continued, its own exchange fails, it heals from a live peer and the three finish alike."""
    lost_at, go = 12, job.out / "continued"
    common = ["--start_workers", "3", "--sync_timeout", "4"]
    survivor_args = [*common, "--wait_at", str(lost_at + H + 2), "--wait_file", str(go)]
    job.start(0, *survivor_args)
    job.start(1, *survivor_args)
    victim = job.start(2, *common, "--stall_at", str(lost_at), "--stall_seconds", "3")
    job.wait_for("worker2", lambda e: e["kind"] == "stalling")
    time.sleep(0.5)
    victim.send_signal(signal.SIGSTOP)
    stopped = time.monotonic()
    job.wait_for("worker0", lambda e: e["kind"] == "exchange" and e["step"] == lost_at)
    dropped_after = time.monotonic() - stopped
    victim.send_signal(signal.SIGCONT)
    # The others go on only once the continued worker, its own exchange failed, asks for a new group: released
    # earlier, they could finish the run within its collective's bound (4 s), leaving no live peer to heal from.
    job.wait_for_log("worker2", "retrying with the workers present")
    go.touch()
    codes = job.finish()
    assert codes == {"worker0": 0, "worker1": 0, "worker2": 0}, {n: job.log(n) for n in codes}
    assert dropped_after < 30, dropped_after  # the collective's bound (4 s), then a quorum without it
    # Not before the bound: the survivor's exchange began after its step before (a logged event), so a drop that
    # waited out the 4 s bound ends more than 4 s after that event, however loaded the machine is.
    events = job.events("worker0")
    step_before = next(e["time"] for e in events if e["kind"] == "step" and e["step"] == lost_at - 1)
    exchange = next(e["time"] for e in events if e["kind"] == "exchange" and e["step"] == lost_at)
    assert exchange - step_before > 4.0, exchange - step_before
    check_lost_and_joined(job, lost_at)


def test_fewer_workers_than_min_workers_stop_after_the_bound(job):
    """min_workers=3 and one lost: the two others wait for a third, then stop with a message naming the bound."""
    lost_at = 8
    common = ["--start_workers", "3", "--min_workers", "3", "--min_workers_timeout", "6"]
    job.start(0, *common)
    job.start(1, *common)
    victim = job.start(2, *common, "--stall_at", str(lost_at), "--stall_seconds", "60")
    job.wait_for("worker2", lambda e: e["kind"] == "stalling")
    time.sleep(0.5)
    victim.kill()
    killed = time.monotonic()
    codes = job.finish(timeout=60)
    waited = time.monotonic() - killed
    assert codes["worker0"] != 0 and codes["worker1"] != 0
    for name in ("worker0", "worker1"):
        log = job.log(name)
        # Waiting apart, the two may meet in one group or each find itself alone: either way below the minimum.
        assert re.search(r"MinWorkersTimeout: only [12] of the 3 workers required \(min_workers=3\)", log), log
        assert "min_workers_timeout=6s" in log
        assert not any(e["kind"] == "exchange" and e["step"] >= lost_at for e in job.events(name))
    assert 6 < waited < 40, waited


@pytest.mark.parametrize(
    "mode",
    [
        ["--fragments", "2"],
        ["--fragments", "2", "--sync_delay", "1"],
        ["--overlap", "delayed", "--robust_clip_factor", "2.0"],
        ["--overlap", "eager", "--fragments", "2"],
    ],
    ids=["streaming", "streaming_tau1", "delayed_clipped", "eager"],
)
def test_each_overlap_mode_with_a_lossy_codec_under_a_drop_and_a_join(job, mode):
    """fp4 with error feedback in every overlap mode: a worker lost with an exchange in flight and restarted; every
    worker ends with the same θg and the membership counters say what happened. The delayed case also clips
    outliers (`robust_clip_factor`), its joiner's zeros left out of the median."""
    lost_at = 12
    # The survivors wait out sync_timeout for the killed worker: 5 s, not the worker's default 10 s.
    codec = ["--compression", "fp4", "--error_feedback", "--sync_timeout", "5", *mode]
    kill_mid_exchange_and_restart(job, lost_at, codec, wait_at=lost_at + 3)
    theta = assert_same_global(job, ["worker0", "worker1", "worker2"])
    assert all(bool(torch.isfinite(value).all()) for value in theta.values())
    survivor = exchanges(job, "worker0")
    assert survivor[lost_at]["workers"] == 2 and survivor[lost_at]["retries"] >= 1
    # Every survivor's exchange ran behind its inner steps, except plain streaming's (τ = 0 blocks by definition).
    assert all(entry["background"] == (mode != ["--fragments", "2"]) for entry in survivor.values()), survivor
    joined = [e for e in job.events("worker2") if e["kind"] == "exchange" and e["healed"]][-1]
    later = [entry for step, entry in survivor.items() if step > joined["step"] + H]
    assert later and all(entry["contributors"] == 3 for entry in later)
    metrics = job.final("worker0")["metrics"]
    assert metrics["diloco/workers_in_round"] == 3 and metrics["diloco/exchange_retries"] >= 1
    assert metrics["diloco/membership_drops"] >= 1 and metrics["diloco/membership_joins"] >= 1
    assert job.final("worker2")["metrics"]["diloco/heal_bytes"] > 0


@pytest.mark.parametrize(
    "settings, named",
    [
        (dict(data_parallel_per_worker=2), "2 ranks per site without the site's topology"),
        (dict(data_parallel_per_worker=2), "a membership of site_size 1 for 2 rank(s) per site"),
        (dict(pipeline_stages=2), "2 ranks per site without the site's topology"),
        (dict(lowrank_rank=2), "low-rank or adaptive compression"),
    ],
)
def test_what_elastic_membership_does_not_run_is_refused_before_it_joins(settings, named):
    from hf_diloco import DiLoCo, DiLoCoConfig
    from hf_diloco.backends.torchft_membership import TorchftMembership

    # Never contacted: refused before joining.
    membership = TorchftMembership("http://127.0.0.1:1", "worker0", secret="s")
    model = tiny_model()
    with pytest.raises(ValueError, match="Elastic membership") as error:
        DiLoCo(model, None, DiLoCoConfig(inner_steps=4, **settings), membership=membership)
    assert named in str(error.value)
    assert membership.manager is None


def test_a_lighthouse_killed_and_restarted_at_its_address_leaves_the_job_training(tmp_path):
    """The Lighthouse process is SIGKILLed after the step-8 exchange and started again at the same address 3 s later:
    the workers' quorum requests reach the new one (torchft sends one request only, to the Lighthouse that died), no
    worker leaves, and θg is the reference's with both workers in every round."""
    job = ElasticJob(tmp_path, lighthouse_process=True)
    try:
        args = ["--start_workers", "2", "--min_workers", "2", "--step_seconds", "0.25"]
        job.start(0, *args)
        job.start(1, *args)
        job.wait_for("worker0", lambda e: e["kind"] == "exchange" and e["step"] == 8)
        job.lighthouse.kill()
        killed = time.time()
        time.sleep(3)
        job.lighthouse.start()
        codes = job.finish()
        assert codes == {"worker0": 0, "worker1": 0}, {name: job.log(name) for name in codes}
        theta = assert_same_global(job, ["worker0", "worker1"])
        for replica in ("worker0", "worker1"):
            seen = exchanges(job, replica)
            assert sorted(seen) == list(range(H, STEPS + 1, H)), job.log(replica)
            assert all(entry["contributors"] == 2 and entry["retries"] == 0 for entry in seen.values()), seen
        after = min(entry["time"] for entry in exchanges(job, "worker0").values() if entry["time"] > killed)
        assert after - killed >= 3.0  # the next round's quorum waited for the restarted Lighthouse
        expected = reference({end: [0, 1] for end in range(H, STEPS + 1, H)})
        for name, value in expected.items():
            torch.testing.assert_close(theta[name], value, rtol=0, atol=1e-5, msg=name)
    finally:
        job.close()
