"""The elastic block of docs/how-to/elastic.md run as written on two sites against the `torchft_lighthouse` command the
page starts: both train, save the global model and its card, and end with the same θg; the membership summary counts
what happened and the card states it. Lost with its Lighthouse after a checkpoint, the job resumes from it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from tests.dist_utils import free_port
from tests.elastic_common import JOB_SECRET, sites_ended_alike

REPO = Path(__file__).resolve().parents[1]
HARNESS = REPO / "tests" / "scripts" / "readme_elastic_snippet.py"
LIGHTHOUSE = Path(sys.executable).parent / "torchft_lighthouse"
SITES = ["site-a", "site-b"]


def run_sites(folder: Path, die_at: int | None = None) -> tuple[list[int], dict[str, str]]:
    """A Lighthouse and the two sites running the snippet in `folder` (dying at `die_at`); then the Lighthouse is
    stopped too. Their exit codes and logs."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "RUST_LOG": "warn", **JOB_SECRET}
    command = [str(LIGHTHOUSE), "--min_replicas", "1", "--join_timeout_ms", "60000", "--bind", f"127.0.0.1:{port}"]
    lighthouse = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    sites = []
    try:
        time.sleep(1.0)
        address = f"http://127.0.0.1:{port}"
        for slot, site in enumerate(SITES):
            argv = [sys.executable, str(HARNESS), address, site, str(slot), str(folder)]
            argv += [] if die_at is None else [str(die_at)]
            log = (folder / f"{site}.log").open("a")
            sites.append(subprocess.Popen(argv, cwd=folder, env=env, stdout=log, stderr=subprocess.STDOUT))
        codes = [process.wait(timeout=300) for process in sites]
    finally:
        for process in [*sites, lighthouse]:
            if process.poll() is None:
                process.kill()
                process.wait()
    return codes, {site: (folder / f"{site}.log").read_text() for site in SITES}


def both_sites_end_alike(tmp_path, exchanges: int) -> dict:
    """Both sites exit 0 with the same θg after `exchanges` exchanges of both sites; returns site a's result."""
    codes, logs = run_sites(tmp_path)
    a, b = sites_ended_alike(tmp_path, SITES, codes, logs)
    for result in (a, b):
        summary = result["summary"]
        assert summary["exchanges"] == exchanges and summary["fewest_workers"] == 2, summary
    return a


def test_the_readme_elastic_snippet_trains_two_sites(tmp_path):
    # Both run every one of the 3 rounds of 100 steps with both sites, from one start (min_workers=2).
    a = both_sites_end_alike(tmp_path, exchanges=3)
    card = (tmp_path / "out-site-a" / "README.md").read_text()
    assert "| Worker membership | elastic: 3 exchanges among 2 workers; 0 drop(s), 0 join(s)" in card
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "out-site-a")
    for name, value in saved.state_dict().items():
        if name in a["global"]:
            assert torch.equal(value, a["global"][name]), name
    # Its checkpoint is of the last round: θg and the outer state as they ended.
    state = torch.load(tmp_path / "checkpoint-site-a.pt", weights_only=True)
    assert state["inner_step"] == 300 and state["elastic_progress"] > 0 and state["outer_optimizer"]
    assert torch.equal(torch.cat([value.flatten() for value in state["global"]]), flat(a["global"], state))


def flat(parameters: dict[str, torch.Tensor], state: dict) -> torch.Tensor:
    """θg by name, flattened in the checkpoint's order (one fragment: the parameters in model order)."""
    assert len(state["global"]) == 1
    return torch.cat([value.flatten() for value in parameters.values()])


def test_the_readme_elastic_snippet_resumes_a_job_lost_with_its_lighthouse(tmp_path):
    """Every site dies at step 150 (its checkpoint is of step 100) and the Lighthouse is stopped; restarted against a
    new one, the sites resume at step 100 (2 exchanges left, not 3) and end with the same θg."""
    codes, logs = run_sites(tmp_path, die_at=150)
    assert codes == [9, 9], logs
    saved = torch.load(tmp_path / "checkpoint-site-a.pt", weights_only=True)
    assert saved["inner_step"] == 100
    both_sites_end_alike(tmp_path, exchanges=2)
