"""`scripts/gpu_check.py` runs here: `--help`, and a CPU dry run of its two-worker check (the GPU lane runs every
check on CUDA, tests/test_gpu.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "gpu_check.py"


def _run(*args: str, timeout: float) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def test_help_lists_every_check():
    result = _run("--help", timeout=60)
    assert result.returncode == 0, result.stderr
    for name in ("workers", "bf16_autocast", "compile", "grad_scaler", "fsdp_resume", "throughput", "copy_bandwidth"):
        assert name in result.stdout


@pytest.mark.timeout(240)
def test_cpu_dry_run_of_two_workers_writes_passing_json(tmp_path):
    out = tmp_path / "gpu_check.json"
    result = _run("--device", "cpu", "--checks", "workers", "copy_bandwidth", "--out", str(out), timeout=200)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["dry_run"] and report["passed"] and report["environment"]["device"] == "cpu"
    modes = report["checks"]["workers"]["modes"]
    assert set(modes) == {"streaming", "eager", "delayed_int8_ef", "lowrank"}
    for mode, numbers in modes.items():
        assert numbers["theta_g_bitwise_equal"] and numbers["parameters_on_device"] and numbers["finite"], mode
    # 10 steps at H = 4: streaming and eager with 2 fragments launch every 2 steps; delayed and low rank every 4.
    assert [modes[m]["outer_steps"] for m in ("streaming", "eager", "delayed_int8_ef", "lowrank")] == [5, 5, 2, 2]
    assert "CUDA" in report["checks"]["copy_bandwidth"]["skipped"]
