"""A run stopped by SIGTERM or SIGINT ends at once with exit status 143 or 130 (128 + the signal) and one message from
rank 0 naming the last saved step (its checkpoint folder) and the command that resumes from it.

The handler runs where Python runs signal handlers: in the main thread, between two bytecodes (a rank inside a
collective takes it when the collective returns, at once when its peers got the same signal and left). It does not
unwind the training loop, whose clean-up (`close()`'s final syncs, a barrier) would wait for peers that the same
signal stopped, up to its bound: it says where the run stands, gives the output folder's lock back and ends the
process (`os._exit`). A checkpoint being written stays without its manifest and is never resumed from; TensorBoard
events since the writer's last flush are lost (each checkpoint's `trainer_state.json` keeps the log).

The last saved step is the newest `checkpoint-N` whose manifest exists (the DDP baseline's checkpoints have none:
its newest). The command is the launcher's when there is one (torchrun or `accelerate launch`: this process's
parent), else this process's own, as `/proc` records it (`sys.argv` elsewhere), with its secrets as `***`.

Only a signal whose handler is Python's default is taken: a handler the program installed stays. The main job installs
its handler first, so the `DiLoCoTrainer` inside it leaves the job's message in place.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from .atomic_checkpoints import MANIFEST_NAME, checkpoint_step
from .output_lock import release_output_folder
from .redaction import REDACTED, redact_argv

SIGNALS = (signal.SIGTERM, signal.SIGINT)
_CHECKPOINT_RE = re.compile(r"^checkpoint-\d+$")


@dataclass
class StoppedRun:
    """What a run stopped by a signal says, filled in as the run learns it.

    Attributes:
        who: the message's first word (`hf-diloco`, `DiLoCoTrainer`).
        output_dir: where its checkpoints are; None before the run knows it (nothing was written yet).
        resume: how to resume, given the last complete checkpoint (or None), the command and its folder.
        manifests: whether a checkpoint counts only once its manifest exists (DiLoCo) or as soon as it exists.
    """

    who: str
    output_dir: str | None = None
    resume: Callable[[Path | None, list[str], str], str] | None = None
    manifests: bool = True

    def message(self, signum: int) -> str:
        name = signal.Signals(signum).name
        if self.output_dir is None or self.resume is None:
            return f"{self.who}: stopped by {name} before the run started; nothing was written."
        last = last_saved_checkpoint(self.output_dir, self.manifests)
        saved = f"The last saved step is {checkpoint_step(last)} ({last})" if last else "No checkpoint was saved yet"
        command = launch_command()
        shown = redact_argv(command)
        note = f" (the values shown as {REDACTED} are secrets: give them as before)" if shown != command else ""
        text = f"{self.who}: stopped by {name}. {saved}. {self.resume(last, shown, os.getcwd())}{note}"
        return text.replace(shlex.quote(REDACTED), REDACTED)  # a placeholder to replace, not a value to paste


@contextlib.contextmanager
def stop_on_signals(run: StoppedRun) -> Iterator[StoppedRun]:
    """While inside, SIGTERM and SIGINT stop this process as the module says (nothing outside the main thread, or
    where the program installed its own handler); the handlers before it are restored on leaving."""
    installed = {}
    if threading.current_thread() is threading.main_thread():
        for signum in SIGNALS:
            if signal.getsignal(signum) in (signal.SIG_DFL, signal.default_int_handler):
                installed[signum] = signal.signal(signum, lambda signum, frame: _stop(run, signum))
    try:
        yield run
    finally:
        for signum, previous in installed.items():
            signal.signal(signum, previous)


def last_saved_checkpoint(output_dir: str | os.PathLike, manifests: bool = True) -> Path | None:
    """The newest `checkpoint-N` of `output_dir` (with its manifest, when `manifests`), or None."""
    folder = Path(output_dir)
    found = [path for path in folder.iterdir() if _CHECKPOINT_RE.match(path.name)] if folder.is_dir() else []
    complete = [path for path in found if not manifests or (path / MANIFEST_NAME).is_file()]
    return max(complete, key=checkpoint_step, default=None)


def launch_command() -> list[str]:
    """The command that started this run: the launcher's (torchrun and `accelerate launch` start the ranks as their
    children) or this process's own, with an interpreter running an installed script left out."""
    pid = os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else os.getpid()
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
        argv = [part.decode(errors="replace") for part in raw]
    except OSError:
        argv = [sys.executable, *sys.argv]
    if len(argv) > 1 and _is_script(argv[1]):  # `python .venv/bin/torchrun ...` as the kernel records a script
        argv = argv[1:]
    if shutil.which(os.path.basename(argv[0])) == argv[0]:
        argv[0] = os.path.basename(argv[0])
    return argv


def rerun_or_resume_from(auto_resume: bool) -> Callable[[Path | None, list[str], str], str]:
    """How the main job resumes: the same command when it resumes by itself (`auto_resume`, no checkpoint named),
    else the command naming the checkpoint with `--resume_from_checkpoint`."""

    def resume(last: Path | None, command: list[str], folder: str) -> str:
        named = any(part.split("=")[0] in ("--resume_from_checkpoint", "--resume-from-checkpoint") for part in command)
        if last is None:
            return f"Nothing to resume from: the same command starts over (in {folder}): {shlex.join(command)}"
        if auto_resume and not named:
            return f"To resume from it, run the same command again (in {folder}): {shlex.join(command)}"
        return f"To resume from it, run (in {folder}): {shlex.join(_with_checkpoint(command, last))}"

    return resume


def resume_a_trainer(last: Path | None, command: list[str], folder: str) -> str:
    """How a `DiLoCoTrainer` script resumes: its command again, with `trainer.train(resume_from_checkpoint=...)`."""
    if last is None:
        return f"Nothing to resume from: running the script again starts over (in {folder}): {shlex.join(command)}"
    return (
        f"To resume from it, run the script again (in {folder}: {shlex.join(command)}) with "
        f'trainer.train(resume_from_checkpoint=True), which takes the newest complete checkpoint, or "{last}".'
    )


def _with_checkpoint(command: list[str], checkpoint: Path) -> list[str]:
    kept, skip = [], False
    for part in command:
        name = part.split("=")[0]
        if skip or name in ("--resume_from_checkpoint", "--resume-from-checkpoint"):
            skip = not skip and "=" not in part
            continue
        kept.append(part)
    return [*kept, "--resume_from_checkpoint", str(checkpoint)]


def _is_script(path: str) -> bool:
    try:
        with open(path, "rb") as handle:
            return handle.read(2) == b"#!" and os.access(path, os.X_OK)
    except OSError:
        return False


def _stop(run: StoppedRun, signum: int) -> None:
    if _rank() == 0:
        try:
            print(run.message(signum), file=sys.stderr, flush=True)
        except Exception as error:  # the message must never keep a stopped run alive
            print(f"{run.who}: stopped by {signal.Signals(signum).name} ({error}).", file=sys.stderr, flush=True)
    if run.output_dir is not None:
        release_output_folder(run.output_dir)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(128 + signum)


def _rank() -> int:
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0
