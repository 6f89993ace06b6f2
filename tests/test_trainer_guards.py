"""Nothing lost, nothing silent, nothing hangs: DiLoCoTrainer on real processes (tests/scripts/guarded_train.py) with
refused checkpoints, a finished run, a resume with another model, settings that differ between ranks, a Hub token,
a peer stopped (SIGSTOP) in the middle of a save, and a disk that fills during a save."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from hf_diloco.integrations.atomic_checkpoints import (
    MANIFEST_NAME,
    CheckpointError,
    checkpoint_to_resume,
    final_model_matches_checkpoint,
    verify_checkpoint,
)
from tests.dist_utils import free_port
from tests.engine_common import tiny_llama
from tests.scripts.guarded_train import SECRET_TOKEN

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "scripts" / "guarded_train.py"


def _launch(base: Path, mode: str, stopped_peer: bool = False, timeout: float = 500) -> list[str]:
    """Run the script's `mode` on 2 processes joined by env:// (as torchrun would); return each rank's output.

    With `stopped_peer`, rank 1 is expected to stop itself: it is SIGKILLed once rank 0 is done."""
    base.mkdir(parents=True, exist_ok=True)
    port = free_port()
    processes, outputs = [], [[] for _ in range(2)]
    for rank in range(2):
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE="2",
            LOCAL_WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
            PYTHONPATH=str(ROOT),
        )
        # Output goes through a pipe, never a file: a file-size limit in the child must not hit its own log.
        process = subprocess.Popen(
            [sys.executable, str(SCRIPT), "--base_dir", str(base), "--mode", mode],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        threading.Thread(target=lambda p=process, o=outputs[rank]: o.extend(p.stdout), daemon=True).start()
        processes.append(process)
    try:
        processes[0].wait(timeout=timeout)
        processes[1].wait(timeout=1 if stopped_peer else 120)
    except subprocess.TimeoutExpired:
        pass
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    logs = ["".join(lines) for lines in outputs]
    if not stopped_peer:
        assert [p.returncode for p in processes] == [0, 0], logs[0][-4000:] + logs[1][-4000:]
    return logs


def _results(base: Path, mode: str, rank: int) -> dict:
    return json.loads((base / f"{mode}_rank{rank}.json").read_text())


@pytest.fixture(scope="module")
def sequence(tmp_path_factory):
    base = tmp_path_factory.mktemp("guards")
    _launch(base, "sequence")
    return base, [_results(base, "sequence", rank) for rank in range(2)]


@pytest.mark.timeout(600)
def test_resuming_at_the_last_step_trains_and_writes_nothing(sequence):
    """A crash after the final checkpoint, then a rerun of the finished job: no step, no file changed, the model is
    the checkpoint's; saving it then gives the same weights as the final checkpoint."""
    base, results = sequence
    for result in results:
        assert result["first"]["steps"] == list(range(1, 9))
        for case in ("after_final_checkpoint", "rerun"):
            assert result[case]["steps"] == [] and result[case]["global_step"] == 8, case
            assert result[case]["changed"] == [], f"{case}: the output folder changed"
        assert result["after_final_checkpoint"]["finished"]
        assert result["after_final_checkpoint"]["model_is_checkpoint"]


@pytest.mark.timeout(600)
def test_checkpoints_that_all_fail_to_verify_stop_the_run_and_are_never_lost(sequence):
    """scheduler.pt truncated in every checkpoint (weights intact): resume_from_checkpoint=True and the main job's
    auto-resume both stop with an error naming the folder, the problem and the ways out, before any step and without
    touching a file; starting over knowingly (with save_total_limit=1) moves them aside instead of deleting them."""
    base, results = sequence
    run = base / "run"
    for result in results:
        refused = result["refused"]
        assert refused["error"] == "CheckpointError" and refused["steps"] == [] and refused["changed"] == []
        assert result["refused_auto_resume"]["error"] == "CheckpointError"
        for message in (refused["message"], result["refused_auto_resume"]["message"]):
            for part in (
                str(run),
                "checkpoint-4",
                "checkpoint-8",
                "scheduler.pt",
                "--output_dir",
                "--auto_resume false",
            ):
                assert part in message, part
    before = results[0]["refused"]["before"]
    after = results[0]["start_over"]["after"]
    assert results[0]["start_over"]["steps"] == list(range(1, 9))
    for step in (4, 8):
        kept = {k: v for k, v in before.items() if k.startswith(f"checkpoint-{step}/")}
        assert kept and all(after.get(f"refused-{name}") == digest for name, digest in kept.items()), step
    assert "checkpoint-4/model.safetensors" not in after, "the new checkpoint-4 is rotated away (limit 1)"
    verify_checkpoint(run / "checkpoint-8")
    assert final_model_matches_checkpoint(run, run / "refused-checkpoint-8"), "the final model was written over"


@pytest.mark.timeout(600)
def test_resume_with_another_model_or_world_size_is_refused_before_loading(sequence, tmp_path):
    base, results = sequence
    for result in results:
        other = result["other_model"]
        assert other["error"] == "CheckpointError" and other["changed"] == []
        assert "hidden_size: 32 -> 64" in other["message"] and "--output_dir" in other["message"]
    from hf_diloco import DiLoCoTrainer, DiLoCoTrainingArguments

    model = tiny_llama(128, layers=2, max_positions=32, heads=2, kv_heads=2)
    args = DiLoCoTrainingArguments(output_dir=str(tmp_path), use_cpu=True, max_steps=8, inner_steps=4, report_to=[])
    with pytest.raises(CheckpointError, match="written by 2 processes, this run has 1.*Resume with 2 processes"):
        DiLoCoTrainer(model=model, args=args).train(resume_from_checkpoint=str(base / "run" / "checkpoint-8"))


@pytest.mark.timeout(600)
def test_resume_with_other_settings_than_the_checkpoint_names_them_before_any_step(sequence):
    """Another compression, inner_steps, batch, data seed or tokenizer than the checkpoint's: refused on every rank,
    naming the setting, both values and the ways out; nothing trained or written. (The same values resume: the
    `rerun` case above.)"""
    _, results = sequence
    expected = {
        "compression": 'compression: "none" in the checkpoint, "int8" in this run',
        "inner_steps": "inner_steps: 4 in the checkpoint, 2 in this run",
        "batch": "per_device_train_batch_size: 2 in the checkpoint, 4 in this run",
        "data_seed": "data_seed: null in the checkpoint, 7 in this run",
        "tokenizer": 'tokenizer: "sha256:first" in the checkpoint, "sha256:another" in this run',
    }
    for result in results:
        for case, named in expected.items():
            refused = result[f"changed_{case}"]
            assert refused["error"] == "CheckpointError", (case, refused)
            assert named in refused["message"] and "Resume with the checkpoint's values" in refused["message"], case
            assert "another --output_dir" in refused["message"]
            assert refused["steps"] == [] and refused["changed"] == [], case
            assert refused["message"].count(" in the checkpoint, ") == 1, refused["message"]


@pytest.mark.timeout(600)
def test_settings_that_differ_between_ranks_fail_at_start_on_every_rank(sequence):
    """Rank 1 has another max_steps and another hidden_act (same shapes): both ranks fail before the first step,
    naming the settings and the rank, instead of hanging at the first save."""
    _, results = sequence
    for result in results:
        mismatch = result["mismatch"]
        assert mismatch["error"] == "SettingsMismatchError" and mismatch["steps"] == []
        assert "max_steps: ranks [1] disagree with rank 0 (rank 0: 8; rank 1: 12)" in mismatch["message"]
        assert 'hidden_act: rank 0 "silu", rank 1 "gelu"' in mismatch["message"]
        assert mismatch["seconds"] < 30


@pytest.mark.timeout(600)
def test_no_token_lands_in_any_file_written(sequence):
    base, _ = sequence
    written = [path for path in base.rglob("*") if path.is_file()]
    assert any(path.name == "training_args.bin" for path in written)
    leaking = [str(path) for path in written if SECRET_TOKEN.encode() in path.read_bytes()]
    assert leaking == []
    args = torch.load(base / "run" / "checkpoint-8" / "training_args.bin", weights_only=False)
    assert args.hub_token is None and args.max_steps == 8


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("stall_in", "point"),
    [
        ("files", "the end of writing checkpoint-4 (every rank's files written)"),
        ("model", "the Trainer's barrier in saving checkpoint-4"),
    ],
)
def test_a_peer_stopped_while_saving_fails_the_save_within_the_bound(tmp_path, stall_in, point):
    """Rank 1 is SIGSTOPped while saving checkpoint-4, after writing its files or (with a tracked best metric, where
    the Trainer's own save waits for every rank) before the model is saved: rank 0 raises within
    sync_timeout_seconds (8 s) naming the point and rank 1, and leaves checkpoint-4 without a manifest, which no
    later run resumes from."""
    start = time.time()
    mode = f"stall_in_{stall_in}"
    logs = _launch(tmp_path, mode, stopped_peer=True)
    result = _results(tmp_path, mode, 0)
    error = result["train"]
    assert error["error"] == "PeerTimeoutError", logs[0][-4000:]
    assert error["message"].startswith(f"Rank(s) [1] did not reach {point} within sync_timeout_seconds=8 s")
    stalled_at = float((tmp_path / "stall" / "stalled_at").read_text())
    assert 6 <= result["failed_at"] - stalled_at <= 23
    checkpoint = tmp_path / "stall" / "checkpoint-4"
    assert (checkpoint / "model.safetensors").is_file() and not (checkpoint / MANIFEST_NAME).exists()
    with pytest.raises(CheckpointError, match="checkpoint-4: .*incomplete"):
        checkpoint_to_resume(tmp_path / "stall")
    assert time.time() - start < 200


@pytest.mark.timeout(400)
def test_a_disk_that_fills_during_a_save_loses_nothing(tmp_path):
    """Files over 2 kB cannot be written after checkpoint-4 (RLIMIT_FSIZE in the child): saving checkpoint-8 fails on
    both ranks with an error naming the folder and what to do; checkpoint-4 stays complete, and once space is back the
    run resumes from it and finishes (the half-written checkpoint-8 moved aside, not reused)."""
    _launch(tmp_path, "disk_full")
    folder = tmp_path / "disk"
    for rank in range(2):
        result = _results(tmp_path, "disk_full", rank)
        full = result["full"]
        assert full["error"] == "CheckpointSaveError"
        message = full["message"]
        assert f"Saving checkpoint {folder / 'checkpoint-8'} failed on rank {rank}" in message
        assert "no earlier checkpoint was deleted" in message and "resumes from checkpoint-4" in message
        assert result["resumed"] == {"from": str(folder / "checkpoint-4"), "steps": [5, 6, 7, 8]}
    verify_checkpoint(folder / "checkpoint-4")
    verify_checkpoint(folder / "checkpoint-8")
    assert not (folder / "refused-checkpoint-8" / MANIFEST_NAME).exists()
