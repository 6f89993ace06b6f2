"""One job per output folder: while a process holds the folder's lock, the main job and a `DiLoCoTrainer` in the
same folder are refused naming the holder; a lock left by a killed process is taken over with a log line; a clean
exit leaves no lock file."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket

import pytest

from hf_diloco.integrations.output_lock import (
    LOCK_NAME,
    OutputFolderInUseError,
    acquire_output_folder,
    lock_holder,
    release_output_folder,
)
from tests.engine_common import tiny_model
from tests.test_pretrain_script import hold_output_folder_in_a_process as hold


def test_a_trainer_in_a_held_folder_is_refused_naming_the_holder(tmp_path):
    """(The main job's refusal is a case of tests/test_pretrain_script.py's bad-input run.)"""
    from hf_diloco import DiLoCoTrainer, DiLoCoTrainingArguments

    folder = tmp_path / "out"
    holder = hold(folder)
    try:
        assert lock_holder(folder)["pid"] == holder.pid
        named = rf"The output folder .*out is in use by another job: pid {holder.pid} on host {socket.gethostname()}"
        args = DiLoCoTrainingArguments(output_dir=str(folder), use_cpu=True, max_steps=4, inner_steps=4, report_to=[])
        with pytest.raises(OutputFolderInUseError, match=named):
            DiLoCoTrainer(model=tiny_model(), args=args)
        assert sorted(path.name for path in folder.iterdir()) == [LOCK_NAME]  # nothing written
        assert lock_holder(folder)["pid"] == holder.pid
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    assert not (folder / LOCK_NAME).exists()  # released at the holder's exit, the file removed


def test_a_lock_left_by_a_killed_process_is_taken_over_with_a_log_line(tmp_path, caplog):
    folder = tmp_path / "out"
    holder = hold(folder)
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=60)
    assert lock_holder(folder)["pid"] == holder.pid  # its record is still there; its flock went with it
    with caplog.at_level(logging.WARNING, logger="hf_diloco.integrations.output_lock"):
        acquire_output_folder(folder)
    try:
        assert f"Taking over the lock of {folder} left by pid {holder.pid} on host" in caplog.text
        assert lock_holder(folder)["pid"] == os.getpid()
        acquire_output_folder(folder)  # this process again: held already, nothing changes
    finally:
        release_output_folder(folder)
    assert not (folder / LOCK_NAME).exists()
    # A record by hand (a pid that is not running), no flock at all: taken over as well.
    folder.joinpath(LOCK_NAME).write_text(json.dumps({"host": socket.gethostname(), "pid": holder.pid}))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hf_diloco.integrations.output_lock"):
        acquire_output_folder(folder)
    release_output_folder(folder)
    assert f"left by pid {holder.pid}" in caplog.text
