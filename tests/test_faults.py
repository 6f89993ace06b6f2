"""Faults: a worker SIGKILLed mid-round restarts and resumes bitwise; half-written and corrupt checkpoints."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hf_diloco.checkpointing import (
    MANIFEST_NAME,
    CheckpointError,
    last_complete_checkpoint,
    verify_checkpoint,
    write_manifest,
)
from tests.dist_utils import free_port

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "scripts" / "fault_train.py"


def _torchrun(output_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--max-restarts",
        "1",
        "--master_port",
        str(free_port()),
        str(SCRIPT),
        "--output_dir",
        str(output_dir),
        *extra,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return result


@pytest.mark.timeout(900)
def test_sigkilled_worker_restarts_resumes_and_matches_the_uninterrupted_run(tmp_path):
    clean, faulty = tmp_path / "clean", tmp_path / "faulty"
    _torchrun(clean)
    _torchrun(faulty, "--kill_at_step", "10")  # rank 1 dies at step 10: mid-round, an exchange in flight
    assert (faulty / "killed_once").exists()
    expected = load_file(clean / "final" / "model.safetensors")
    actual = load_file(faulty / "final" / "model.safetensors")
    assert expected.keys() == actual.keys()
    for name in expected:
        assert torch.equal(expected[name], actual[name]), name
    steps = [int(line) for line in (faulty / "steps_rank0.log").read_text().split()]
    redone = len(steps) - len(set(steps))
    assert 0 < redone <= 4  # at most one checkpoint interval (save_steps = 4) of work was done twice
    assert sorted(set(steps)) == list(range(1, 17))


def _fake_checkpoint(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"weights" * 100)
    (folder / "diloco_state_rank0.pt").write_bytes(b"state" * 50)
    return folder


def test_checkpoint_without_manifest_is_never_picked_and_is_refused(tmp_path):
    good = _fake_checkpoint(tmp_path / "checkpoint-4")
    write_manifest(good)
    _fake_checkpoint(tmp_path / "checkpoint-8")  # the job died while writing this one
    assert last_complete_checkpoint(tmp_path) == str(good)
    with pytest.raises(CheckpointError, match="incomplete"):
        verify_checkpoint(tmp_path / "checkpoint-8")


def test_corrupt_or_truncated_checkpoint_is_refused(tmp_path):
    folder = _fake_checkpoint(tmp_path / "checkpoint-4")
    write_manifest(folder)
    verify_checkpoint(folder)
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[:-10])
    with pytest.raises(CheckpointError, match="corrupt"):
        verify_checkpoint(folder)
    (folder / "model.safetensors").write_bytes(data[:-1] + b"X")  # same size, one byte changed
    with pytest.raises(CheckpointError, match="corrupt"):
        verify_checkpoint(folder)
    assert last_complete_checkpoint(tmp_path) is None
    (folder / MANIFEST_NAME).write_text("{not json")
    with pytest.raises(CheckpointError, match="unreadable"):
        verify_checkpoint(folder)
