"""Clear answers where a user met raw ones, each on real processes as the user meets it, the message asserted whole:
SIGTERM / SIGINT end the main job (1 process, and 2 under torchrun) and a `DiLoCoTrainer` script with 143 / 130 and one
message from rank 0 naming the last saved step and the command that resumes from it (which does); a read-only output
folder is refused at start-up (exit 2) before anything is built; a checkpoint whose pickle holds objects is refused
naming the file, and nothing of it runs. (A joiner of another model width: tests/test_elastic_pretrain.py.)"""

from __future__ import annotations

import ctypes
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from hf_diloco.integrations.atomic_checkpoints import MANIFEST_NAME, CheckpointError, checkpoint_step, write_manifest
from hf_diloco.integrations.output_lock import LOCK_NAME
from tests.test_pretrain_script import _environment, _small_config, _torchrun

ROOT = Path(__file__).resolve().parent.parent
PR_CAPBSET_DROP, CAP_DAC_OVERRIDE = 24, 1


class RunsACommand:
    """What a pickle of this object does when it is loaded without `weights_only`: it runs a shell command."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def _launch(command: list[str], log: Path, env: dict[str, str] | None = None, preexec=None) -> subprocess.Popen:
    """A process in a session of its own, its output in `log` (a pipe left unread would stop a long run), with
    SIGINT's default disposition, as a terminal gives it: a suite started in the background (`make test &`) passes
    its children SIGINT ignored, and a program keeps an ignored signal ignored."""

    def start() -> None:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        if preexec is not None:
            preexec()

    with open(log, "wb") as handle:
        return subprocess.Popen(
            command, cwd=ROOT, env=_environment(env), stdout=handle, stderr=subprocess.STDOUT,
            start_new_session=True, preexec_fn=start,
        )  # fmt: skip


def _wait(process: subprocess.Popen, timeout: float = 300) -> int:
    try:
        return process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        raise


def _saved(output_dir: Path) -> dict[int, float]:
    """Step -> the time its manifest was published, of every complete checkpoint."""
    manifests = output_dir.glob(f"checkpoint-*/{MANIFEST_NAME}")
    return {checkpoint_step(path.parent): path.stat().st_mtime_ns for path in manifests}


def _signal_once_saved(process: subprocess.Popen, output_dir: Path, signum: int, after: int, log: Path) -> int:
    """Send `signum` to `process` as soon as a checkpoint past step `after` is complete; its exit status."""
    deadline = time.monotonic() + 300
    while not any(step > after for step in _saved(output_dir)):
        assert process.poll() is None, log.read_text(errors="replace")[-3000:]
        assert time.monotonic() < deadline, "no checkpoint was saved within 300 s"
        time.sleep(0.02)
    process.send_signal(signum)
    return _wait(process, 120)


def _stop_lines(log: Path) -> list[str]:
    return [line for line in log.read_text(errors="replace").splitlines() if ": stopped by SIG" in line]


def _shown(argv: list[str]) -> str:
    """The command as the stop message shows it: the interpreter by its name where PATH finds this one."""
    first = "python" if shutil.which("python") == argv[0] else argv[0]
    return shlex.join([first, *argv[1:]])


def _long_config(tmp_path: Path) -> Path:
    """The small job made long (it is stopped long before its end) and keeping every checkpoint."""
    config = yaml.safe_load(_small_config(tmp_path).read_text())
    config["training"].update(max_steps=4000, eval_steps=4000, save_total_limit=None, disable_tqdm=True)
    path = tmp_path / "long.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.timeout(600)
def test_sigterm_names_the_last_saved_step_and_the_command_that_resumes_from_it(tmp_path):
    output_dir, first_log, second_log = tmp_path / "out", tmp_path / "first.log", tmp_path / "second.log"
    command = [sys.executable, "-m", "hf_diloco", "pretrain", "--config", str(_long_config(tmp_path))]
    command += ["--output_dir", str(output_dir)]
    status = _signal_once_saved(_launch(command, first_log), output_dir, signal.SIGTERM, 4, first_log)
    assert status == 143, first_log.read_text()[-3000:]
    saved = _saved(output_dir)
    last = max(saved)
    [line] = _stop_lines(first_log)
    assert line == (
        f"hf-diloco: stopped by SIGTERM. The last saved step is {last} ({output_dir}/checkpoint-{last}). To resume "
        f"from it, run the same command again (in {ROOT}): {_shown(command)}"
    )
    assert not (output_dir / LOCK_NAME).exists()  # given back: the resume is not refused as a second job
    # The command it names resumes: its first checkpoint is past `last`, and none of the earlier ones is rewritten.
    resumed = shlex.split(line.split(f"(in {ROOT}): ", 1)[1])
    status = _signal_once_saved(_launch(resumed, second_log), output_dir, signal.SIGINT, last, second_log)
    assert status == 130, second_log.read_text()[-3000:]
    after = _saved(output_dir)
    assert {step: after[step] for step in saved} == saved
    [line] = _stop_lines(second_log)
    assert line.startswith(f"hf-diloco: stopped by SIGINT. The last saved step is {max(after)} ") and max(after) > last


@pytest.mark.timeout(600)
def test_sigterm_under_torchrun_gives_one_message_from_rank_0_naming_the_launch(tmp_path):
    output_dir, log = tmp_path / "out", tmp_path / "torchrun.log"
    command = [*_torchrun(2), "-m", "hf_diloco", "pretrain", "--config", str(_long_config(tmp_path))]
    command += ["--output_dir", str(output_dir), "--use_cpu"]
    _signal_once_saved(_launch(command, log), output_dir, signal.SIGTERM, 4, log)  # torchrun's own status: its own
    last = max(_saved(output_dir))
    assert _stop_lines(log) == [
        f"hf-diloco: stopped by SIGTERM. The last saved step is {last} ({output_dir}/checkpoint-{last}). To resume "
        f"from it, run the same command again (in {ROOT}): {_shown(command)}"
    ]
    assert not (output_dir / LOCK_NAME).exists()


@pytest.mark.timeout(600)
def test_sigint_ends_a_diloco_trainer_script_with_130_and_how_to_resume(tmp_path):
    output_dir, log = tmp_path / "out", tmp_path / "trainer.log"
    command = [sys.executable, "tests/scripts/fault_train.py", "--output_dir", str(output_dir), "--max_steps", "4000"]
    assert _signal_once_saved(_launch(command, log), output_dir, signal.SIGINT, 4, log) == 130
    last = max(_saved(output_dir))
    assert _stop_lines(log) == [
        f"DiLoCoTrainer: stopped by SIGINT. The last saved step is {last} ({output_dir}/checkpoint-{last}). To resume "
        f"from it, run the script again (in {ROOT}: {_shown(command)}) with trainer.train(resume_from_checkpoint=True), "
        f'which takes the newest complete checkpoint, or "{output_dir}/checkpoint-{last}".'
    ]


def _bound_by_file_modes() -> None:
    """In the child, before it runs: root loses CAP_DAC_OVERRIDE, so a read-only folder binds it as it binds any
    user (for any other user this changes nothing)."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_CAPBSET_DROP, CAP_DAC_OVERRIDE, 0, 0, 0)


@pytest.mark.timeout(300)
def test_a_read_only_output_folder_is_refused_before_anything_is_built(tmp_path):
    folder, log = tmp_path / "read_only", tmp_path / "job.log"
    folder.mkdir()
    folder.chmod(0o555)
    command = [sys.executable, "-m", "hf_diloco", "pretrain", "--config", str(_small_config(tmp_path))]
    try:
        status = _wait(_launch([*command, "--output_dir", str(folder)], log, preexec=_bound_by_file_modes))
    finally:
        folder.chmod(0o755)
    assert status == 2, log.read_text()[-3000:]
    assert log.read_text().splitlines()[-1] == (
        f"hf-diloco: error: The output folder {folder} cannot be written (Permission denied: {folder}/{LOCK_NAME}): "
        "the run writes its tokenizer, checkpoints and model there. Nothing was trained. Give this run a folder it "
        f"can write with --output_dir, or make {folder} writable for this user."
    )
    assert list(folder.iterdir()) == []


def _plant(checkpoint: Path, name: str, marker: Path) -> None:
    """Replace `name` in `checkpoint` by a pickle that runs a command, and publish a manifest that matches it: a
    checkpoint from elsewhere, complete to every check but what its pickles hold."""
    torch.save({"engine": RunsACommand(f"touch {marker}"), "world_size": 1}, checkpoint / name)
    write_manifest(checkpoint)


def _refusal(path: Path, output_dir: Path) -> str:
    return (
        f"{path} holds objects other than tensors and plain containers (it would call posix.system): it is not a "
        f"checkpoint this project wrote, and nothing of it was loaded or run. Move {path.parent} out of {output_dir} "
        "(a resume then takes the newest checkpoint left), or start a new run in another --output_dir."
    )


@pytest.mark.timeout(600)
def test_a_checkpoint_pickle_holding_objects_is_refused_naming_the_file(tmp_path):
    output_dir, marker = tmp_path / "out", tmp_path / "ran"
    command = [sys.executable, "-m", "hf_diloco", "pretrain", "--config", str(_small_config(tmp_path))]
    command += ["--output_dir", str(output_dir)]
    assert _wait(_launch(command, tmp_path / "first.log")) == 0
    planted = output_dir / "checkpoint-8" / "diloco_state_rank0.pt"
    _plant(planted.parent, planted.name, marker)
    log = tmp_path / "resume.log"
    assert _wait(_launch([*command, "--max_steps", "12"], log)) == 2
    text = log.read_text()
    assert text.splitlines()[-1] == f"hf-diloco: error: {_refusal(planted, output_dir)}"
    assert "weights_only" not in text and not marker.exists()
    assert not (output_dir / "checkpoint-12").exists()


def test_a_diloco_trainer_refuses_a_checkpoint_pickle_holding_objects(tmp_path):
    from datasets import Dataset
    from transformers import default_data_collator

    from hf_diloco import DiLoCoTrainer, DiLoCoTrainingArguments
    from tests.engine_common import cpu_trainer_args, tiny_model

    ids = torch.randint(0, 64, (16, 8), generator=torch.Generator().manual_seed(0))
    data = Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})

    def trainer(max_steps: int) -> DiLoCoTrainer:
        args = DiLoCoTrainingArguments(
            **cpu_trainer_args(tmp_path / "out", save_strategy="steps", save_steps=4),
            max_steps=max_steps, per_device_train_batch_size=2, inner_steps=4,
        )  # fmt: skip
        return DiLoCoTrainer(model=tiny_model(), args=args, train_dataset=data, data_collator=default_data_collator)

    trainer(4).train()
    checkpoint, marker = tmp_path / "out" / "checkpoint-4", tmp_path / "ran"
    _plant(checkpoint, "scheduler.pt", marker)
    with pytest.raises(CheckpointError) as refused:
        trainer(8).train(resume_from_checkpoint=True)
    assert str(refused.value) == _refusal(checkpoint / "scheduler.pt", tmp_path / "out")
    assert not marker.exists() and not (tmp_path / "out" / "checkpoint-8").exists()
