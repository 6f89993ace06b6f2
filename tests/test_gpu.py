"""The GPU lane (`pytest -m gpu`): each test runs one check of `scripts/gpu_check.py` on CUDA and asserts that it
passed. Without CUDA every test is skipped, saying why; `tests/test_gpu_check_script.py` runs the script's CPU dry
run in the ordinary suite.

Why these checks are the right ones on a GPU (the argument on paper, until a GPU has run them): the engine keeps θg
and every exchange on the CPU over gloo, so with two workers on one GPU the only CUDA paths are the θm reads and
writes (device <-> host copies of each piece), the inner step and what the front-ends add (autocast, GradScaler,
compile, FSDP2 on NCCL). `workers` and `bf16_autocast` hold invariant 1 (θg bitwise equal) through those copies and
that parameters stay on the device; `compile` that writing θm in place keeps the compiled graph's guards; `grad_scaler`
that workers skipping different steps stay in lock-step; `fsdp_resume` that a sharded state saved on CUDA resumes
bitwise; `throughput` and `copy_bandwidth` the costs the projection assumes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "gpu_check.py"

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU: torch.cuda.is_available() is False here"
    ),
]


def _run_check(name: str, tmp_path: Path) -> dict:
    out = tmp_path / f"{name}.json"
    command = [sys.executable, str(SCRIPT), "--device", "cuda", "--checks", name, "--out", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert out.exists(), result.stdout[-3000:] + result.stderr[-5000:]
    check = json.loads(out.read_text())["checks"][name]
    assert result.returncode == 0 and check["passed"], json.dumps(check, indent=1)
    return check


@pytest.mark.timeout(600)
def test_two_workers_on_one_gpu_in_every_mode(tmp_path):
    modes = _run_check("workers", tmp_path)["modes"]
    assert set(modes) == {"streaming", "eager", "delayed_int8_ef", "lowrank"}


@pytest.mark.timeout(600)
def test_bf16_autocast(tmp_path):
    _run_check("bf16_autocast", tmp_path)


@pytest.mark.timeout(600)
def test_compiled_model_does_not_recompile_after_the_first_sync(tmp_path):
    check = _run_check("compile", tmp_path)
    assert check["backend"] == "inductor" and check["recompiles_after_first_sync"]["unique_graphs"] == 0


@pytest.mark.timeout(600)
def test_grad_scaler_skips_keep_workers_in_lock_step(tmp_path):
    check = _run_check("grad_scaler", tmp_path)
    assert check["skips_differ_between_workers"] and "skipped" not in check["loops"]["plugin"]


@pytest.mark.timeout(600)
def test_fsdp2_on_nccl_resumes_bitwise(tmp_path):
    assert _run_check("fsdp_resume", tmp_path)["backend"] == "nccl"


@pytest.mark.timeout(600)
def test_diloco_trainer_keeps_trainer_throughput_and_memory(tmp_path):
    check = _run_check("throughput", tmp_path)
    assert check["throughput_ratio"] >= 0.97 and check["peak_memory_ratio"] <= 1.02


@pytest.mark.timeout(600)
def test_pinned_and_pageable_copy_bandwidth(tmp_path):
    check = _run_check("copy_bandwidth", tmp_path)
    assert check["gb_per_second"]["pinned"] > 0 and check["gb_per_second"]["pageable"] > 0
