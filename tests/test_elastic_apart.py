"""One job, one model at the end: elastic sites either end with the same θg or each says that it trained alone, on
real processes against a real torchft Lighthouse (tests/scripts/elastic_worker.py, a loop of its own that exits 3
as `hf-diloco pretrain` does; the main job's own exit, card and results are checked at the end).

The two cases of issue 51: a site paused (SIGSTOP) while its peer finished the job, and a site that served a heal
and was paused some seconds later. With `min_workers` 1 each site goes on alone and says so at every round it trains
alone, and at its end; with `min_workers` 2 neither trains alone: each stops after `min_workers_timeout`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from hf_diloco.job.config_file import shipped_config_text
from tests.elastic_common import JOB_SECRET, ROOT, ElasticJob, LighthouseProcess

APART = 3  # the exit status of a site whose last rounds ran alone


@pytest.fixture
def job(tmp_path):
    job = ElasticJob(tmp_path)
    yield job
    job.close()


def said_alone(log: str, site: str, rounds: range) -> None:
    """`site` warned at each of `rounds` that it trained it alone since the first, and said so at its end."""
    for count, round_ in enumerate(rounds, start=1):
        assert (
            f"{site} trained round {round_} alone: no other site has been in its exchanges since round {rounds[0]} "
            f"({count} round(s) alone), so its global model differs from the job's. min_workers=1 lets a site train "
            "alone; with min_workers=2 it would wait min_workers_timeout for another site and then stop." in log
        ), (round_, log[-3000:])
    assert (
        f"{site} trained {len(rounds)} rounds alone from round {rounds[0]} to its end: its model differs from the "
        "job's (no other site was in its exchanges since)." in log
    ), log[-3000:]


def test_a_site_paused_while_its_peer_finished_and_the_peer_both_say_they_trained_alone(job):
    """worker1 stops before inner step 11 (SIGSTOP while it waits there); worker0 finishes the job's 12 rounds, the
    last 10 without it. worker1 is resumed after worker0 exited and trains the same 10 rounds alone. Both exit with
    status 3, each having warned at each round alone and said at its end that its model differs from the job's;
    their θg differ (the issue's case, which ended with 0 and no word)."""
    go = job.out / "resume_worker1"
    common = ["--steps", "48", "--start_workers", "2", "--sync_timeout", "5", "--paced_seconds", "0.05"]
    first = job.start(0, *common)
    second = job.start(1, *common, "--wait_at", "10", "--wait_file", str(go))
    job.wait_for("worker1", lambda e: e["kind"] == "step" and e["step"] == 10)
    second.send_signal(signal.SIGSTOP)
    assert first.wait(timeout=180) == APART, job.log("worker0")
    second.send_signal(signal.SIGCONT)
    go.touch()
    assert second.wait(timeout=180) == APART, job.log("worker1")
    for name in ("worker0", "worker1"):
        said_alone((job.out / f"{name}.log").read_text(), name, range(3, 13))
        summary = job.final(name)["summary"]
        assert (summary["alone_rounds"], summary["alone_from_round"]) == (10, 3), summary
    one, other = job.final("worker0")["global"], job.final("worker1")["global"]
    assert any(not torch.equal(one[name], other[name]) for name in one)


def test_a_site_paused_after_serving_a_heal_and_the_healed_site_both_say_they_trained_alone(job):
    """worker0 trains alone from the start (a new job: nothing to say); worker1 joins and heals from it, the two train
    together, then worker0 is paused before inner step 49 (SIGSTOP). worker1 trains rounds 13-16 alone and exits 3;
    worker0, resumed after, does the same."""
    go = job.out / "resume_worker0"
    first = job.start(0, "--steps", "64", "--paced_seconds", "0.5", "--wait_at", "48", "--wait_file", str(go))
    job.wait_for("worker0", lambda e: e["kind"] == "step" and e["step"] == 4)
    second = job.start(1, "--steps", "64", "--start_workers", "2", "--sync_timeout", "5")
    joined = job.wait_for("worker1", lambda e: e["kind"] == "joined", timeout=120)
    assert 4 <= joined["step"] < 48, joined
    job.wait_for("worker0", lambda e: e["kind"] == "step" and e["step"] == 48, timeout=120)
    first.send_signal(signal.SIGSTOP)
    assert second.wait(timeout=180) == APART, job.log("worker1")
    first.send_signal(signal.SIGCONT)
    go.touch()
    assert first.wait(timeout=180) == APART, job.log("worker0")
    assert "healed from a live peer" in (job.out / "worker1.log").read_text()
    for name in ("worker0", "worker1"):
        log = (job.out / f"{name}.log").read_text()
        said_alone(log, name, range(13, 17))
        assert "trained round 1 alone" not in log  # worker0's first rounds were a new job's, not a site's apart
    one, other = job.final("worker0")["global"], job.final("worker1")["global"]
    assert any(not torch.equal(one[name], other[name]) for name in one)


def test_with_min_workers_2_neither_site_trains_alone(job):
    """The first case with `min_workers` 2: worker0 never runs an exchange alone; it waits min_workers_timeout for
    another site and stops with `MinWorkersTimeout`, and so does worker1 once resumed. Neither ends with a model of
    its own."""
    go = job.out / "resume_worker1"
    common = ["--steps", "48", "--start_workers", "2", "--sync_timeout", "5", "--paced_seconds", "0.05"]
    common += ["--min_workers", "2", "--min_workers_timeout", "10"]
    first = job.start(0, *common)
    second = job.start(1, *common, "--wait_at", "10", "--wait_file", str(go))
    job.wait_for("worker1", lambda e: e["kind"] == "step" and e["step"] == 10)
    second.send_signal(signal.SIGSTOP)
    assert first.wait(timeout=180) not in (0, APART)
    second.send_signal(signal.SIGCONT)
    go.touch()
    assert second.wait(timeout=180) not in (0, APART)
    for name in ("worker0", "worker1"):
        log = job.log(name)
        assert (
            "MinWorkersTimeout: only 1 of the 2 workers required (min_workers=2) joined within "
            "min_workers_timeout=10s; start more workers against the Lighthouse" in log
        ), log
        assert "alone" not in log and not (job.out / f"final_{name}.pt").exists()
        assert all(e["workers"] == 2 for e in job.events(name) if e["kind"] == "exchange")


def _site(tmp_path: Path, lighthouse: str, name: str, *flags: str) -> subprocess.Popen:
    """`hf-diloco pretrain` as one elastic site (one process) of a small run."""
    config = yaml.safe_load(shipped_config_text("tiny_diloco"))
    config["data"].update(max_train_samples=12, max_eval_samples=2, block_size=64)
    config["tokenizer"]["vocab_size"] = 512
    config["model"]["config"].update(hidden_size=32, num_hidden_layers=1, intermediate_size=64)
    config["training"].update(
        max_steps=40, logging_steps=4, eval_strategy="no", save_strategy="no", per_device_train_batch_size=2,
        warmup_steps=0,
    )  # fmt: skip
    config["diloco"].update(inner_steps=4, start_workers=2, membership_sync_timeout=5)
    path = tmp_path / "site.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {key: value for key, value in os.environ.items() if not key.startswith("DILOCO_")}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHONPATH=str(ROOT), **JOB_SECRET)
    argv = [sys.executable, "-m", "hf_diloco", "pretrain", "--config", str(path), "--use_cpu"]
    argv += ["--output_dir", str(tmp_path / name), "--lighthouse", lighthouse, "--site", name, *flags]
    log = (tmp_path / f"{name}.log").open("ab")
    return subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)


@pytest.mark.timeout(900)
def test_the_main_job_says_it_in_its_log_results_card_and_exit_status(tmp_path):
    """The first case through `hf-diloco pretrain`: site-b is paused before its inner step 13; site-a finishes alone
    and exits 3, naming the rounds in its last line, `all_results.json` and its model card; so does site-b once
    resumed."""
    lighthouse = LighthouseProcess(tmp_path, heartbeat_ms=2000, join_timeout_ms=5000)
    sites = {}
    try:
        sites["site-a"] = _site(tmp_path, lighthouse.address(), "site-a")
        sites["site-b"] = _site(tmp_path, lighthouse.address(), "site-b")
        log_b = tmp_path / "site-b.log"
        deadline = time.monotonic() + 300
        while "'diloco/inner_step': '8'" not in log_b.read_text(errors="replace") and time.monotonic() < deadline:
            time.sleep(0.05)
        sites["site-b"].send_signal(signal.SIGSTOP)
        assert sites["site-a"].wait(timeout=300) == APART, (tmp_path / "site-a.log").read_text()[-3000:]
        sites["site-b"].send_signal(signal.SIGCONT)
        assert sites["site-b"].wait(timeout=300) == APART, log_b.read_text()[-3000:]
    finally:
        for process in sites.values():
            if process.poll() is None:
                process.kill()
        lighthouse.kill()
    for name in sites:
        log = (tmp_path / f"{name}.log").read_text()
        results = json.loads((tmp_path / name / "all_results.json").read_text())
        rounds, first = results["diloco_alone_rounds"], results["diloco_alone_from_round"]
        assert results["diloco_site"] == name and rounds >= 1 and first + rounds - 1 == 10, results
        said = (
            f"{name} trained {rounds} round{'s' if rounds > 1 else ''} alone from round {first} to its end: its model "
            "differs from the job's (no other site was in its exchanges since)"
        )
        assert f"DiLoCo run summary: {said}." in log and f"hf-diloco: {said}. Exit status 3." in log, log[-3000:]
        assert f"trained round 10 alone: no other site has been in its exchanges since round {first}" in log
        card = (tmp_path / name / "README.md").read_text()
        assert f"**In this run:** {said}." in card
        assert f"its last {rounds} round(s), from round {first}, ran alone: this model differs from the job's" in card
