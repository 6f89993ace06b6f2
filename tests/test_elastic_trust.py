"""What an elastic job refuses before it costs the live workers anything, on real processes against a real torchft
Lighthouse (tests/scripts/elastic_worker.py): a joiner with other DiLoCo settings stops before it is a participant
the others wait for."""

from __future__ import annotations

import hashlib
import time

import pytest
import torch

from tests.elastic_common import STEPS, ElasticJob, H, assert_same_global
from tests.test_elastic import reference

SYNC_TIMEOUT = 30.0  # the survivors' bound of one collective: what a bad joiner must not cost them


@pytest.fixture
def job(tmp_path):
    job = ElasticJob(tmp_path)
    yield job
    job.close()


def test_a_joiner_with_other_settings_is_refused_before_the_others_wait_for_it(job):
    """Two workers train; a third with `error_feedback` set where theirs is not starts against the Lighthouse. It
    reads their settings before its Manager heartbeats and stops naming the field; the two never see it in a group,
    retry nothing, and finish within a bound well below their collective's timeout."""
    go = job.out / "joiner_started"
    common = ["--sync_timeout", str(SYNC_TIMEOUT), "--steps", "40"]
    survivors = [*common, "--start_workers", "2", "--paced_seconds", "0.15", "--wait_at", "8", "--wait_file", str(go)]
    job.start(0, *survivors)
    job.start(1, *survivors)
    job.wait_for("worker0", lambda e: e["kind"] == "joined")
    joiner = job.start(2, *common, "--error_feedback")
    job.wait_for("worker2", lambda e: e["kind"] == "starting")
    go.touch()  # the two train on while the joiner builds its engine
    released = job.events("worker2")[-1]["time"]
    assert joiner.wait(timeout=60) != 0
    log = job.log("worker2")
    assert (
        "ValueError: A live peer runs with other DiLoCo settings (error_feedback: false in the peer, true in this "
        "worker): start this worker with the running workers' DiLoCo config (error_feedback=false)." in log
    ), log
    assert not any(e["kind"] == "bound" for e in job.events("worker2")), "the joiner became a participant"
    codes = job.finish(timeout=120)
    assert codes == {"worker0": 0, "worker1": 0, "worker2": codes["worker2"]}, {n: job.log(n) for n in codes}
    for name in ("worker0", "worker1"):
        exchanges = [e for e in job.events(name) if e["kind"] == "exchange"]
        assert len(exchanges) == 10 and all(e["workers"] == 2 and e["retries"] == 0 for e in exchanges), exchanges
        closed = next(e for e in job.events(name) if e["kind"] == "closed")
        assert closed["summary"]["joins"] == 0 and closed["summary"]["drops"] == 0
        # 32 paced steps of 0.15 s after the release, and the exchanges: far below one collective's bound.
        assert closed["time"] - released < SYNC_TIMEOUT / 2, closed["time"] - released


def test_a_worker_alone_in_a_job_that_ran_refuses_to_start_it_over(job):
    """The first worker of a fresh job trains alone (start_workers 1) and leaves; a second, started after it left,
    finds no peer and loaded no checkpoint: it stops at its first step, naming the Lighthouse, the worker that was
    there and the ways out, instead of training the job over from its own initial weights and exiting 0."""
    first = job.start(0, "--steps", "8")
    assert first.wait(timeout=120) == 0, job.log("worker0")
    late = job.start(1, "--steps", "8")
    assert late.wait(timeout=120) != 0
    log = job.log("worker1")
    expected = (
        f"AloneWithoutState: This worker is alone: the Lighthouse {job.lighthouse.address()} last formed a group of "
        "worker0, none of which joined this worker's first group"
    )
    assert expected in log and "start_workers=2" in log and "resume_from_checkpoint" in log, log
    assert not (job.out / "final_worker1.pt").exists()
    assert [e["kind"] for e in job.events("worker1")] == ["starting", "bound", "joined"]


def digest(tensors: list[torch.Tensor]) -> str:
    """What tests/scripts/elastic_worker.py logs of θg."""
    hasher = hashlib.sha256()
    for tensor in tensors:
        hasher.update(tensor.detach().contiguous().numpy().tobytes())
    return hasher.hexdigest()[:16]


def test_a_whole_job_lost_with_its_lighthouse_resumes_from_its_checkpoints(tmp_path):
    """Two sites checkpoint every 8 inner steps (2 rounds); at step 18 every process and the Lighthouse are lost.
    Restarted against a fresh Lighthouse, each site resumes from its checkpoint of step 16 (2 steps lost, less than
    one interval) with θg bitwise what it saved, and the two finish with the same θg as a run never interrupted (the
    plain-torch reference of tests/test_elastic.py)."""
    every, lost_at = 8, 18
    common = ["--start_workers", "2", "--checkpoint_every", str(every), "--resume"]
    first = ElasticJob(tmp_path)
    try:
        for slot in (0, 1):  # each waits before step `lost_at` for a file that never comes
            first.start(slot, *common, "--wait_at", str(lost_at), "--wait_file", str(tmp_path / "never"))
        for name in ("worker0", "worker1"):
            first.wait_for(name, lambda e: e["kind"] == "step" and e["step"] == lost_at)
    finally:
        first.close()  # SIGKILL every worker, then the Lighthouse
    saved = {
        name: torch.load(tmp_path / f"checkpoint_{name}.pt", weights_only=True) for name in ("worker0", "worker1")
    }
    assert [state["inner_step"] for state in saved.values()] == [16, 16]
    second = ElasticJob(tmp_path)
    try:
        for slot in (0, 1):
            second.start(slot, *common)
        codes = second.finish(timeout=180)
    finally:
        second.close()
    assert codes == {"worker0": 0, "worker1": 0}, {name: second.log(name) for name in codes}
    for name, state in saved.items():
        [resumed] = [e for e in second.events(name) if e["kind"] == "resumed"]
        assert resumed["step"] == 16 and lost_at - resumed["step"] <= every
        assert resumed["theta_g"] == digest(state["global"])  # bitwise what was saved
        exchanges = [e for e in second.events(name) if e["kind"] == "exchange" and e["time"] > resumed["time"]]
        assert [e["step"] for e in exchanges] == [20, 24, 28, 32] and all(e["workers"] == 2 for e in exchanges)
    theta = assert_same_global(second, ["worker0", "worker1"])
    expected = reference({end: [0, 1] for end in range(H, STEPS + 1, H)})
    for name, value in expected.items():
        torch.testing.assert_close(theta[name], value, rtol=0, atol=1e-5, msg=name)


def test_a_site_restarted_from_an_older_checkpoint_heals_from_the_live_one(job):
    """worker1 dies at step 18 (its checkpoint is of step 16); worker0 trains on alone. Restarted with `--resume`,
    worker1 loads its checkpoint, which is older than the live state: it heals from worker0 instead of going back to
    step 16, and the two finish with the same θg."""
    go = job.out / "restarted"
    common = ["--steps", "40", "--checkpoint_every", "8", "--resume"]
    job.start(0, *common, "--start_workers", "2", "--wait_at", "26", "--wait_file", str(go))
    victim = job.start(1, *common, "--start_workers", "2", "--wait_at", "18", "--wait_file", str(job.out / "never"))
    job.wait_for("worker1", lambda e: e["kind"] == "step" and e["step"] == 18)
    victim.kill()
    victim.wait()
    job.wait_for("worker0", lambda e: e["kind"] == "step" and e["step"] == 26)
    restarted = time.time()
    job.start(1, *common)
    job.wait_for("worker1", lambda e: e["kind"] == "bound" and e["time"] > restarted)
    go.touch()
    codes = job.finish()
    assert codes == {"worker0": 0, "worker1": 0}, {name: job.log(name) for name in codes}
    assert torch.load(job.out / "checkpoint_worker1.pt", weights_only=True)["inner_step"] == 40
    [resumed] = [e for e in job.events("worker1") if e["kind"] == "resumed"]
    live = {e["step"]: e for e in job.events("worker0") if e["kind"] == "exchange"}
    assert resumed["step"] > 26 and resumed["theta_g"] == live[resumed["step"]]["theta_g"], resumed
    assert all(live[step]["workers"] == 2 for step in (36, 40))
    assert_same_global(job, ["worker0", "worker1"])


STRANGER_ENV = {"HF_DILOCO_JOB_SECRET": "not-this-jobs-secret"}  # knows every address and port, not the secret


def stranger_refused_everywhere(job: ElasticJob) -> None:
    """What both start orders end with: the stranger stopped itself naming the way out; the two members trained
    every round together and only together, named the stranger in their logs, and their θg is that of two workers
    (the plain-torch reference): nothing of the stranger's reached it."""
    codes = job.finish(timeout=180)
    assert codes["worker0"] == 0 and codes["worker1"] == 0, {name: job.log(name) for name in codes}
    assert codes["stranger"] != 0
    assert (
        "SecretMismatch: This worker could not verify 2 of the 2 other members of its group (worker0, worker1): they "
        "do not prove this worker's secret. Most likely this worker holds another secret than the job's: give it "
        "the job's secret (HF_DILOCO_JOB_SECRET_FILE or HF_DILOCO_JOB_SECRET), the same on every site; if those are "
        "not the job's sites, stop them." in job.log("stranger")
    ), job.log("stranger")
    assert not (job.out / "final_stranger.pt").exists()
    for name in ("worker0", "worker1"):
        assert (
            "refused stranger in this group: it does not prove the job's secret, so nothing is exchanged with it and "
            "the exchange runs among the 2 member(s) that do" in (job.out / f"{name}.log").read_text()
        ), job.log(name)
        exchanges = [e for e in job.events(name) if e["kind"] == "exchange"]
        assert [e["step"] for e in exchanges] == list(range(H, STEPS + 1, H)), exchanges
        assert all(e["workers"] == 2 and e["contributors"] == 2 for e in exchanges), exchanges
    theta = assert_same_global(job, ["worker0", "worker1"])
    expected = reference({end: [0, 1] for end in range(H, STEPS + 1, H)})
    for name, value in expected.items():
        torch.testing.assert_close(theta[name], value, rtol=0, atol=1e-5, msg=name)


def test_a_stranger_joining_a_running_job_gets_nothing_and_puts_nothing_in(job):
    """Two members train; a stranger (the same program, another secret) joins through the Lighthouse. Its heal is
    refused by the member serving it (HTTP 403, before a byte of the state); the members' check refuses it from
    their group before any payload, and it stops. The two train on, bit for bit as two workers alone."""
    go = job.out / "stranger_bound"
    members = ["--start_workers", "2", "--paced_seconds", "0.1", "--wait_at", "12", "--wait_file", str(go)]
    job.start(0, *members)
    job.start(1, *members)
    job.wait_for("worker0", lambda e: e["kind"] == "step" and e["step"] == 12)
    job.start(2, "--replica_id", "stranger", name="stranger", env=STRANGER_ENV)
    job.wait_for("stranger", lambda e: e["kind"] == "bound")
    go.touch()
    stranger_refused_everywhere(job)
    stranger = job.log("stranger")
    assert "refused to serve its state for a heal (HTTP 403): this worker did not prove the job's secret" in stranger
    assert "healed from a live peer" not in stranger
    served = (job.out / "worker0.log").read_text() + (job.out / "worker1.log").read_text()
    assert "refused a request for this worker's state from 127.0.0.1" in served


def test_a_stranger_running_before_the_job_cannot_stop_it_nor_enter_it(job):
    """A stranger (another secret) trains alone against the Lighthouse first; then the two members start. Their heal
    from it (the only worker at the highest step) is refused by its server; neither loads anything of it, the check
    refuses it, worker1 takes worker0's state, and the two train the job from worker0's weights, bit for bit as two
    workers alone. The stranger, which met no member of its own, stops."""
    job.start(2, "--replica_id", "stranger", "--steps", "400", "--paced_seconds", "0.1", name="stranger",
              env=STRANGER_ENV)  # fmt: skip
    job.wait_for("stranger", lambda e: e["kind"] == "step" and e["step"] == 8)
    job.start(0, "--start_workers", "2")
    job.start(1, "--start_workers", "2")
    stranger_refused_everywhere(job)
    for name in ("worker0", "worker1"):
        log = (job.out / f"{name}.log").read_text()
        assert "the settings published at " in log and "do not prove the job's secret: not compared" in log
        assert "refused to serve its state for a heal (HTTP 403)" in log
    assert "refused a request for this worker's state from 127.0.0.1" in (job.out / "stranger.log").read_text()
