"""A torchft Lighthouse in the test's process and elastic workers (tests/scripts/elastic_worker.py) against it, each
with an event log: what tests/test_elastic.py and tests/test_elastic_balanced.py run."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

os.environ.setdefault("RUST_LOG", "warn")  # the Lighthouse in this process logs every quorum otherwise

WORKER = Path(__file__).parent / "scripts" / "elastic_worker.py"
# The job's secret every elastic test site holds (elastic membership refuses to start without one).
JOB_SECRET = {"HF_DILOCO_JOB_SECRET": "elastic-tests-job-secret"}
ROOT = Path(__file__).resolve().parent.parent
STEPS, H = 32, 4  # the worker's defaults here: inner steps of a run, and H


class LighthouseProcess:
    """torchft's `torchft_lighthouse` command in its own process on a fixed port, so that it can be killed and started
    again at the same address (a Lighthouse in the test's process cannot: its open connections outlive `shutdown`)."""

    def __init__(self, out: Path, heartbeat_ms: int, join_timeout_ms: int):
        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))
        self.port, self.out = probe.getsockname()[1], out
        probe.close()
        self.argv = [str(Path(sys.executable).parent / "torchft_lighthouse"), "--bind", f"[::]:{self.port}",
                     "--min_replicas", "1", "--join_timeout_ms", str(join_timeout_ms),
                     "--heartbeat_timeout_ms", str(heartbeat_ms)]  # fmt: skip
        self.process: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        log = (self.out / "lighthouse.log").open("ab")
        self.process = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # listening once a connection is accepted
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=1):
                return
            time.sleep(0.05)
        raise AssertionError(f"the Lighthouse did not listen on port {self.port} within 30 s")

    def address(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    shutdown = kill


class ElasticJob:
    """A Lighthouse (in this process, or with `lighthouse_process` in its own) and worker processes against it, each
    with an event log in `out`."""

    def __init__(self, out: Path, heartbeat_ms: int = 2000, join_timeout_ms: int = 5000, lighthouse_process=False):
        from torchft._torchft import LighthouseServer

        self.out = out
        if lighthouse_process:
            self.lighthouse = LighthouseProcess(out, heartbeat_ms, join_timeout_ms)
        else:
            self.lighthouse = LighthouseServer(
                bind="[::]:0", min_replicas=1, join_timeout_ms=join_timeout_ms, heartbeat_timeout_ms=heartbeat_ms
            )
        self.processes: dict[str, subprocess.Popen] = {}
        self.started = time.monotonic()

    def start(self, slot: int, *args: str, name: str | None = None, env: dict | None = None) -> subprocess.Popen:
        """Worker `slot` (its log and events under `name`, by default worker<slot>); `env`: variables it gets on top
        of this job's (another HF_DILOCO_JOB_SECRET makes it a stranger to the job)."""
        name = name or f"worker{slot}"
        log = (self.out / f"{name}.log").open("ab")
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "RUST_LOG": "warn",
            "OMP_NUM_THREADS": "1",
            **JOB_SECRET,
            **(env or {}),
        }
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


def sites_ended_alike(folder: Path, sites: list[str], codes: list[int], logs: dict[str, str]) -> list[dict]:
    """Every site exited with 0 and saved (FOLDER/SITE.pt) the same θg, bit for bit; their saved results."""
    assert codes == [0] * len(sites), logs
    results = [torch.load(folder / f"{site}.pt", weights_only=False) for site in sites]
    for site, other in zip(sites[1:], results[1:]):
        assert other["global"].keys() == results[0]["global"].keys(), site
        for name, value in results[0]["global"].items():
            assert torch.equal(value, other["global"][name]), (site, name)
    return results


def assert_same_global(job: ElasticJob, replicas: list[str]) -> dict[str, torch.Tensor]:
    finals = {replica: job.final(replica)["global"] for replica in replicas}
    first = finals[replicas[0]]
    for replica in replicas[1:]:
        for name, value in first.items():
            assert torch.equal(value, finals[replica][name]), f"θg of {replica} differs from {replicas[0]} at {name}"
    return first
