"""README.md's elastic block run as written on two sites against the `torchft_lighthouse` command the README
starts: both train, save the global model and its card, and end with the same θg; the membership summary counts what
happened and the card states it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from tests.dist_utils import free_port

REPO = Path(__file__).resolve().parents[1]
HARNESS = REPO / "tests" / "scripts" / "readme_elastic_snippet.py"
LIGHTHOUSE = Path(sys.executable).parent / "torchft_lighthouse"


def test_the_readme_elastic_snippet_trains_two_sites(tmp_path):
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "RUST_LOG": "warn"}
    command = [str(LIGHTHOUSE), "--min_replicas", "1", "--join_timeout_ms", "60000", "--bind", f"127.0.0.1:{port}"]
    lighthouse = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    sites = []
    try:
        time.sleep(1.0)
        address = f"http://127.0.0.1:{port}"
        for slot, site in enumerate(["site-a", "site-b"]):
            argv = [sys.executable, str(HARNESS), address, site, str(slot), str(tmp_path)]
            log = (tmp_path / f"{site}.log").open("w")
            sites.append(subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT))
        codes = [process.wait(timeout=300) for process in sites]
    finally:
        for process in [*sites, lighthouse]:
            if process.poll() is None:
                process.kill()
                process.wait()
    logs = {site: (tmp_path / f"{site}.log").read_text() for site in ["site-a", "site-b"]}
    assert codes == [0, 0], logs
    a, b = (torch.load(tmp_path / f"{site}.pt", weights_only=False) for site in ["site-a", "site-b"])
    for name, value in a["global"].items():
        assert torch.equal(value, b["global"][name]), name
    # Both ran every one of the 3 rounds of 100 steps with both sites, from one start (min_workers=2).
    for result in (a, b):
        assert result["summary"]["exchanges"] == 3 and result["summary"]["fewest_workers"] == 2
    card = (tmp_path / "out-site-a" / "README.md").read_text()
    assert "| Worker membership | elastic: 3 exchanges among 2 workers; 0 drop(s), 0 join(s)" in card
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "out-site-a")
    for name, value in saved.state_dict().items():
        if name in a["global"]:
            assert torch.equal(value, a["global"][name]), name
