"""`DiLoCoPlugin` under elastic membership, as a user launches it: examples/accelerate_loop.py unchanged (paced by
tests/scripts/elastic_plugin_site.py), one process per site, the membership from `DILOCO_LIGHTHOUSE`, `DILOCO_SITE`
and `DILOCO_MIN_WORKERS`, against a real Lighthouse. Site b is killed mid-run and started again: site a waits for it
(min_workers 2), b heals from a and takes over the job's step, and both end with the same global model, bit for bit."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from tests.elastic_common import JOB_SECRET, ElasticJob

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "scripts" / "elastic_plugin_site.py"
MAX_STEPS, H = 60, 5


class PluginSites(ElasticJob):
    def start_site(self, name: str, start_workers: int) -> subprocess.Popen:
        env = dict(
            os.environ,
            PYTHONPATH=str(REPO),
            OMP_NUM_THREADS="1",
            RUST_LOG="warn",
            DILOCO_LIGHTHOUSE=self.lighthouse.address(),
            DILOCO_SITE=name,
            DILOCO_INNER_STEPS=str(H),
            DILOCO_MIN_WORKERS="2",
            DILOCO_START_WORKERS=str(start_workers),
            DILOCO_MIN_WORKERS_TIMEOUT="120",
            **JOB_SECRET,
        )
        argv = [sys.executable, str(SCRIPT), "--use_cpu", "--max_steps", str(MAX_STEPS), "--pace", "0.05"]
        argv += ["--output_dir", str(self.out / name)]
        log = (self.out / f"{name}.log").open("ab")
        self.processes[name] = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        return self.processes[name]

    def logged_step(self, name: str) -> int:
        steps = re.findall(r"\] step (\d+) loss", self.log(name))
        return int(steps[-1]) if steps else 0

    def wait_for_step(self, name: str, step: int, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while self.logged_step(name) < step:
            assert time.monotonic() < deadline, f"{name} never reached step {step}; its log:\n{self.log(name)}"
            assert self.processes[name].poll() is None, f"{name} ended early; its log:\n{self.log(name)}"
            time.sleep(0.1)


def test_a_plugin_site_lost_and_restarted_heals_and_both_end_identical(tmp_path):
    job = PluginSites(tmp_path)
    try:
        job.start_site("a", start_workers=2)
        victim = job.start_site("b", start_workers=2)
        job.wait_for_step("b", 20)
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        lost_at = job.logged_step("a")
        time.sleep(3)  # past the Lighthouse's heartbeat timeout: b is gone, a waits for a second site
        job.start_site("b", start_workers=1)
        codes = job.finish(timeout=240)
        assert codes == {"a": 0, "b": 0}, {name: job.log(name) for name in codes}
        finals = {name: load_file(tmp_path / name / "final" / "model.safetensors") for name in ("a", "b")}
        assert finals["a"].keys() == finals["b"].keys()
        for key, value in finals["a"].items():
            assert torch.equal(value, finals["b"][key]), key
        stats = {name: torch.load(tmp_path / name / "stats.pt") for name in ("a", "b")}
        assert stats["b"]["stats"]["heals"] >= 1 and stats["b"]["stats"]["heal_bytes"] > 0
        assert "1 of 2 workers present" in (tmp_path / "a.log").read_text(
            errors="replace"
        )  # a waited for a second site instead of training alone
        assert stats["b"]["stats"]["outer_steps"] < stats["a"]["stats"]["outer_steps"]  # b's rounds began at its heal
        # The healed site took over the job's step and stopped with the other at max_steps.
        assert stats["a"]["inner_step"] == stats["b"]["inner_step"] == MAX_STEPS
        assert lost_at < MAX_STEPS  # b was lost mid-run
        assert "healed from a live peer" in (tmp_path / "b.log").read_text(errors="replace")
    finally:
        job.close()
