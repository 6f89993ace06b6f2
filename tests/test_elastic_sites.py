"""Elastic membership from the config alone: two sites, each one `DiLoCoTrainer` process given `lighthouse` and
`site` in its `DiLoCoTrainingArguments`, against a real `torchft_lighthouse`: both finish with the same θg (bitwise),
every exchange ran with both, the start-up line says the run is elastic and the card counts the exchanges."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.dist_utils import free_port

REPO = Path(__file__).resolve().parents[1]
SITE = REPO / "tests" / "scripts" / "elastic_trainer_site.py"
LIGHTHOUSE = Path(sys.executable).parent / "torchft_lighthouse"
SITES = ["site-a", "site-b"]


def run_sites(
    tmp_path: Path, die_at: dict[str, int] | None = None, round_policy: str = "steps", **variables: str
) -> tuple[list[int], dict[str, str]]:
    """Start a Lighthouse and the two sites (a site in `die_at` dies at the end of that step; `variables` go to
    their environment), then stop the Lighthouse; their exit codes and logs."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "RUST_LOG": "warn", **variables}
    env["ROUND_POLICY"] = round_policy
    for variable in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(variable, None)
    command = [str(LIGHTHOUSE), "--min_replicas", "1", "--join_timeout_ms", "60000", "--bind", f"127.0.0.1:{port}"]
    lighthouse = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    sites = []
    try:
        time.sleep(1.0)
        for slot, site in enumerate(SITES):
            argv = [sys.executable, str(SITE), f"http://127.0.0.1:{port}", site, str(slot), str(tmp_path)]
            argv += [str((die_at or {})[site])] if site in (die_at or {}) else []
            log = (tmp_path / f"{site}.log").open("a")
            sites.append(subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT))
        codes = [process.wait(timeout=240) for process in sites]
    finally:
        for process in [*sites, lighthouse]:
            if process.poll() is None:
                process.kill()
                process.wait()
    return codes, {site: (tmp_path / f"{site}.log").read_text() for site in SITES}


@pytest.mark.parametrize("round_policy", ["steps", "balanced"])
def test_two_trainer_sites_from_the_config_end_with_the_same_global_model(tmp_path, round_policy):
    codes, logs = run_sites(tmp_path, round_policy=round_policy)
    assert codes == [0, 0], logs
    a, b = (torch.load(tmp_path / f"{site}.pt", weights_only=False) for site in SITES)
    assert a["global"].keys() == b["global"].keys()
    for name, value in a["global"].items():
        assert torch.equal(value, b["global"][name]), name
    # 4 steps of H=2: 2 exchanges, both with both sites (start_workers=2).
    for result in (a, b):
        assert result["summary"]["exchanges"] == 2 and result["summary"]["fewest_workers"] == 2, result["summary"]
    for site in SITES:
        assert f"elastic, site {site}, min_workers 1" in logs[site], logs[site]
    card = (tmp_path / "site-a" / "README.md").read_text()
    assert "| Worker membership | elastic: 2 exchanges among 2 workers; 0 drop(s), 0 join(s)" in card, card


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
    assert codes == [0, 0], logs
    a, b = (torch.load(tmp_path / f"{site}.pt", weights_only=False) for site in SITES)
    for name, value in a["global"].items():
        assert torch.equal(value, b["global"][name]), name
    for result in (a, b):
        assert result["summary"]["exchanges"] == 1 and result["summary"]["fewest_workers"] == 2, result["summary"]
