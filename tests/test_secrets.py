"""Secrets are never written: the main job on 2 processes (torchrun), given a Hub token on its command line, a job secret
(a variable and a file) and store credentials in its environment, writes none of them into any byte under its output
folder (the lock file while it is held, logs, card, `all_results.json`, `training_args.bin`, TensorBoard, checkpoints)
or on stdout / stderr; a second job refused by the first one's lock names the holder's command without them; the lock
file is readable by its owner only. Beside them, `redact` and `redact_argv` on the forms a secret takes."""

from __future__ import annotations

import os
import secrets
import signal
import stat
import string
import sys
import time
from pathlib import Path

import pytest

from hf_diloco.integrations.output_lock import LOCK_NAME
from hf_diloco.integrations.redaction import REDACTED, known_secrets, redact, redact_argv
from tests.test_pretrain_script import _finish, _small_config, _start, _torchrun

ROOT = Path(__file__).resolve().parent.parent


def _random(prefix: str = "", length: int = 24) -> str:
    return prefix + "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(length))


def _session(leader: int) -> list[int]:
    """Every process of the session `leader` started (a torchrun launch and its ranks)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getsid(int(entry.name)) == leader:
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def _leaks(values: dict[str, str], where: dict[str, bytes]) -> list[tuple[str, str]]:
    """(secret's name, where it was found) for every secret found in any of the byte strings."""
    return [(name, place) for name, value in values.items() for place, data in where.items() if value.encode() in data]


def _every_file(folder: Path) -> dict[str, bytes]:
    return {str(path): path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file()}


@pytest.mark.timeout(600)
def test_no_secret_reaches_a_file_or_a_message_and_the_lock_is_the_owners(tmp_path):
    token = _random("hf_", 34)
    secret_file = tmp_path / "job_secret"
    values = {
        "--hub_token": token,
        "HF_DILOCO_JOB_SECRET": _random(),
        "HF_DILOCO_JOB_SECRET_FILE": _random(),
        "AWS_SECRET_ACCESS_KEY": _random(length=40),
        "AWS_SESSION_TOKEN": _random(length=60),
        "HF_TOKEN": _random("hf_", 34),
    }
    secret_file.write_text(values["HF_DILOCO_JOB_SECRET_FILE"] + "\n")
    environment = {name: value for name, value in values.items() if not name.startswith("-")}
    environment["HF_DILOCO_JOB_SECRET_FILE"] = str(secret_file)
    output_dir = tmp_path / "out"
    job = [str(ROOT / "scripts" / "pretrain.py"), "--config", str(_small_config(tmp_path)), "--output_dir"]
    first = _start([*_torchrun(2), *job, str(output_dir), "--use_cpu", "--hub_token", token], environment)
    lock = output_dir / LOCK_NAME
    paused = []
    try:
        deadline = time.monotonic() + 180
        while not (lock.is_file() and lock.read_bytes().strip()) and first.poll() is None:
            assert time.monotonic() < deadline, "the first job never took its output folder's lock"
            time.sleep(0.05)
        # The whole first job paused while it holds the lock: the second job meets it held, whatever its speed.
        paused = _session(first.pid)
        for pid in paused:
            os.kill(pid, signal.SIGSTOP)
        assert stat.S_IMODE(lock.stat().st_mode) == 0o600
        held = _every_file(output_dir)
        assert "--hub_token ***" in held[str(lock)].decode()  # the token was on the command line it records
        second = _finish(
            _start([sys.executable, "-m", "hf_diloco", "pretrain", *job[1:], str(output_dir), f"--hub_token={token}"],
                   environment),
            timeout=180,
        )  # fmt: skip
    finally:
        for pid in paused:
            os.kill(pid, signal.SIGCONT)
    result = _finish(first, timeout=420)
    assert result.returncode == 0, result.stderr[-5000:]
    assert second.returncode == 2, second.stderr[-3000:]
    assert f"hf-diloco: error: The output folder {output_dir} is in use by another job: pid " in second.stderr
    assert "--hub_token ***" in second.stderr and "--use_cpu" in second.stderr  # the holder's command, redacted
    written = _every_file(output_dir)
    assert {"training_args.bin", "all_results.json", "README.md", "diloco_state_rank1.pt"} <= {
        Path(path).name for path in written
    }
    assert any("events.out.tfevents" in path for path in written)
    streams = {
        "first job's stdout": result.stdout.encode(),
        "first job's stderr": result.stderr.encode(),
        "second job's stdout": second.stdout.encode(),
        "second job's stderr": second.stderr.encode(),
    }
    assert _leaks(values, {**held, **written, **streams}) == []


def test_redact_hides_secret_flags_variables_files_and_url_passwords(tmp_path):
    secret_file = tmp_path / "secret"
    secret_file.write_text("file-secret-123\n")
    environ = {
        "AWS_SECRET_ACCESS_KEY": "aws-secret-456",
        "HF_DILOCO_JOB_SECRET_FILE": str(secret_file),
        "TOKENIZERS_PARALLELISM": "false",  # not a secret: its last word is not one
        "HF_TOKEN": "1",  # too short to be looked for by value
    }
    argv = ["hf-diloco", "pretrain", "--hub_token", "cli-token-789", "--hub-token=eq-token-012", "--max_steps", "8"]
    assert known_secrets(environ, argv) == {"aws-secret-456", "file-secret-123", "cli-token-789", "eq-token-012"}
    assert redact_argv([*argv, "--data.path", "s3://x/aws-secret-456"], environ) == [
        "hf-diloco", "pretrain", "--hub_token", REDACTED, f"--hub-token={REDACTED}", "--max_steps", "8",
        "--data.path", f"s3://x/{REDACTED}",
    ]  # fmt: skip
    text = (
        "started: hf-diloco pretrain --hub_token hf_OLDvalueNotKnownHereXXXXXXXXXXXXXXX --auth_password 'a b' "
        "--tokenizer.path tok --lighthouse https://me:pw-in-url@host:29510 file-secret-123 false 1"
    )
    assert redact(text, environ, argv) == (
        "started: hf-diloco pretrain --hub_token *** --auth_password *** --tokenizer.path tok --lighthouse "
        "https://me:***@host:29510 *** false 1"
    )
    assert redact("a token hf_abcdefghijklmnopqrstuvwxyz0123456789 in a message", {}, []) == "a token *** in a message"
