"""Faults: a worker SIGKILLed mid-round restarts and resumes bitwise; half-written, corrupt and malformed checkpoints
are never resumed from, rotated away or written over."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hf_diloco.integrations.atomic_checkpoints import (
    MANIFEST_NAME,
    CheckpointError,
    CheckpointSaveError,
    checkpoint_to_resume,
    final_model_matches_checkpoint,
    last_complete_checkpoint,
    make_way_for_checkpoint,
    rotate_checkpoints,
    save_failure,
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


@pytest.mark.parametrize(
    "manifest",
    ['{"format": 1, "files": []}', '{"format": 1, "files": {}}', "[]", '{"files": {"a": 1}}', "not json", "\xff\xfe"],
    ids=["files-list", "files-empty", "top-level-list", "entry-not-a-table", "not-json", "not-text"],
)
def test_a_malformed_manifest_is_refused_and_resume_falls_back(tmp_path, manifest):
    good = _fake_checkpoint(tmp_path / "checkpoint-4")
    write_manifest(good)
    bad = _fake_checkpoint(tmp_path / "checkpoint-8")
    (bad / MANIFEST_NAME).write_bytes(manifest.encode("latin-1"))
    with pytest.raises(CheckpointError, match=f"checkpoint-8 has an unreadable {MANIFEST_NAME}"):
        verify_checkpoint(bad)
    assert last_complete_checkpoint(tmp_path) == str(good)
    assert checkpoint_to_resume(tmp_path) == str(good)


def test_checkpoint_to_resume_starts_fresh_only_where_no_checkpoint_exists(tmp_path, caplog):
    assert checkpoint_to_resume(tmp_path / "not_yet") is None
    assert checkpoint_to_resume(tmp_path) is None
    (tmp_path / "checkpoint-notanumber").mkdir()
    (tmp_path / "logs").mkdir()
    assert checkpoint_to_resume(tmp_path) is None
    corrupt = _fake_checkpoint(tmp_path / "checkpoint-8")
    write_manifest(corrupt)
    (corrupt / "diloco_state_rank0.pt").write_bytes(b"state")  # truncated, the weights intact
    _fake_checkpoint(tmp_path / "checkpoint-12")  # no manifest
    with pytest.raises(CheckpointError) as caught:
        checkpoint_to_resume(tmp_path, start_over="pass `--auto_resume false`")
    message = str(caught.value)
    assert f"output_dir {tmp_path} holds checkpoints from an earlier run, but none of them can be resumed" in message
    assert "checkpoint-8: " in message and "diloco_state_rank0.pt does not match" in message
    assert "checkpoint-12: " in message and "incomplete" in message
    assert "Nothing was trained, deleted or overwritten" in message
    assert "--output_dir" in message and "--auto_resume false" in message
    good = _fake_checkpoint(tmp_path / "checkpoint-4")
    write_manifest(good)
    with caplog.at_level(logging.WARNING, logger="hf_diloco.integrations.atomic_checkpoints"):
        assert checkpoint_to_resume(tmp_path) == str(good)
    assert "checkpoint-8" in caplog.text and "checkpoint-12" in caplog.text and "kept as it is" in caplog.text


def test_rotation_deletes_only_complete_checkpoints(tmp_path):
    folders = {}
    for step in (2, 4, 6, 8, 10):
        folders[step] = _fake_checkpoint(tmp_path / f"checkpoint-{step}")
        write_manifest(folders[step])
        os.utime(folders[step] / MANIFEST_NAME, (step, step))  # published in step order
    (folders[4] / "model.safetensors").write_bytes(b"damaged")  # refused: corrupt
    (folders[6] / MANIFEST_NAME).unlink()  # refused: incomplete
    deleted = rotate_checkpoints(tmp_path, save_total_limit=1, keep=[folders[2]])
    assert deleted == [folders[8]]
    assert all(folders[step].is_dir() for step in (2, 4, 6, 10))
    assert rotate_checkpoints(tmp_path, save_total_limit=1, keep=[folders[2]], keep_newest=False) == [folders[10]]
    assert rotate_checkpoints(tmp_path, save_total_limit=None) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]


def test_a_refused_checkpoint_in_the_way_of_a_save_is_moved_aside_not_overwritten(tmp_path):
    folder = _fake_checkpoint(tmp_path / "checkpoint-8")
    content = {p.name: p.read_bytes() for p in folder.iterdir()}
    assert make_way_for_checkpoint(folder) == tmp_path / "refused-checkpoint-8"
    assert {p.name: p.read_bytes() for p in (tmp_path / "refused-checkpoint-8").iterdir()} == content
    _fake_checkpoint(folder)
    assert make_way_for_checkpoint(folder) == tmp_path / "refused-checkpoint-8-2"
    assert not folder.exists()
    _fake_checkpoint(folder)
    write_manifest(folder)
    assert make_way_for_checkpoint(folder) is None and not folder.exists()  # an earlier run's complete one: replaced
    assert make_way_for_checkpoint(folder) is None


def test_final_model_matches_checkpoint_compares_the_weight_files(tmp_path):
    checkpoint = _fake_checkpoint(tmp_path / "checkpoint-8")
    write_manifest(checkpoint)
    assert not final_model_matches_checkpoint(tmp_path, checkpoint)
    (tmp_path / "model.safetensors").write_bytes((checkpoint / "model.safetensors").read_bytes())
    assert final_model_matches_checkpoint(tmp_path, checkpoint)
    (tmp_path / "model.safetensors").write_bytes(b"other weights")
    assert not final_model_matches_checkpoint(tmp_path, checkpoint)


def test_save_failure_says_what_is_safe_and_what_to_do(tmp_path):
    good = _fake_checkpoint(tmp_path / "checkpoint-4")
    write_manifest(good)
    error = save_failure(tmp_path / "checkpoint-8", OSError(27, "File too large"), rank=1)
    assert isinstance(error, CheckpointSaveError) and isinstance(error, OSError)
    message = str(error)
    assert message.startswith(f"Saving checkpoint {tmp_path / 'checkpoint-8'} failed on rank 1: OSError: ")
    assert "File too large" in message and "MiB free" in message and "resumes from checkpoint-4" in message
