"""A torchft Lighthouse in the test's process and elastic workers (tests/scripts/elastic_worker.py) against it, each
with an event log: what tests/test_elastic.py and tests/test_elastic_balanced.py run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

os.environ.setdefault("RUST_LOG", "warn")  # the Lighthouse in this process logs every quorum otherwise

WORKER = Path(__file__).parent / "scripts" / "elastic_worker.py"
ROOT = Path(__file__).resolve().parent.parent
STEPS, H = 32, 4  # the worker's defaults here: inner steps of a run, and H


class ElasticJob:
    """A Lighthouse in this process and worker processes against it, each with an event log in `out`."""

    def __init__(self, out: Path, heartbeat_ms: int = 2000, join_timeout_ms: int = 5000):
        from torchft._torchft import LighthouseServer

        self.out = out
        self.lighthouse = LighthouseServer(
            bind="[::]:0", min_replicas=1, join_timeout_ms=join_timeout_ms, heartbeat_timeout_ms=heartbeat_ms
        )
        self.processes: dict[str, subprocess.Popen] = {}
        self.started = time.monotonic()

    def start(self, slot: int, *args: str, name: str | None = None) -> subprocess.Popen:
        name = name or f"worker{slot}"
        log = (self.out / f"{name}.log").open("ab")
        env = dict(os.environ, PYTHONPATH=str(ROOT), RUST_LOG="warn", OMP_NUM_THREADS="1")
        argv = [sys.executable, str(WORKER), "--lighthouse", self.lighthouse.address(), "--slot", str(slot)]
        argv += ["--out", str(self.out), "--steps", str(STEPS), "--inner_steps", str(H), *args]
        self.processes[name] = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        return self.processes[name]

    def events(self, replica: str) -> list[dict]:
        path = self.out / f"events_{replica}.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]

    def wait_for(self, replica: str, predicate, timeout: float = 120.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for event in self.events(replica):
                if predicate(event):
                    return event
            time.sleep(0.1)
        raise AssertionError(f"{replica} never reached the expected point; its log:\n{self.log(replica)}")

    def wait_for_log(self, replica: str, text: str, timeout: float = 120.0) -> None:
        """Return once `text` is in the replica's log (within `timeout`)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            path = self.out / f"{replica}.log"
            if path.exists() and text in path.read_text(errors="replace"):
                return
            time.sleep(0.1)
        raise AssertionError(f"{replica} never logged {text!r}; its log:\n{self.log(replica)}")

    def finish(self, timeout: float = 180.0) -> dict[str, int]:
        deadline = time.monotonic() + timeout
        codes = {}
        for name, process in self.processes.items():
            try:
                codes[name] = process.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                codes[name] = process.wait()
        return codes

    def log(self, name: str) -> str:
        path = self.out / f"{name}.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""

    def final(self, replica: str) -> dict:
        return torch.load(self.out / f"final_{replica}.pt", weights_only=False)

    def close(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.kill()
                process.wait()
        self.lighthouse.shutdown()


def assert_same_global(job: ElasticJob, replicas: list[str]) -> dict[str, torch.Tensor]:
    finals = {replica: job.final(replica)["global"] for replica in replicas}
    first = finals[replicas[0]]
    for replica in replicas[1:]:
        for name, value in first.items():
            assert torch.equal(value, finals[replica][name]), f"θg of {replica} differs from {replicas[0]} at {name}"
    return first
