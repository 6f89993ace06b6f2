"""What an elastic job refuses before it costs the live workers anything, on real processes against a real torchft
Lighthouse (tests/scripts/elastic_worker.py): a joiner with other DiLoCo settings stops before it is a participant
the others wait for."""

from __future__ import annotations

import pytest

from tests.elastic_common import ElasticJob

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
