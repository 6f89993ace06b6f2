"""One job per output folder: a lock file held by the job's main process from before it writes anything to its exit.

The lock is `fcntl.flock` on `output_dir/.hf_diloco.lock`: atomic, held as long as the process lives, released by
the kernel when it dies (so a killed job never blocks the next). The file, readable by its owner only, records the
holder (host, pid, start time, command with every secret replaced by `***`, `redaction.py`) for the message a second
job gets; a record left by a process that is gone (the lock free, the file still
there after a kill) is taken over with a log line. At a clean exit the holder deletes the file while it still holds
the lock; a job that opened the file just before checks, once it holds the lock, that the path still names the file
it locked, and starts over otherwise (so two jobs never hold locks on two different files of the same name).

On a file system without `flock` (some Lustre mounts) the record alone decides: a holder on this host whose pid
still runs, or one on another host, refuses the job.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import json
import logging
import os
import socket
import sys
import time
from pathlib import Path

from .redaction import redact, redact_argv

logger = logging.getLogger(__name__)

LOCK_NAME = ".hf_diloco.lock"

_held: dict[str, int] = {}  # real path of a held lock file -> its open descriptor (one per process)


class OutputFolderRefused(RuntimeError):
    """The output folder cannot be this job's."""


class OutputFolderInUseError(OutputFolderRefused):
    """Another job holds the output folder's lock."""


class OutputFolderNotWritableError(OutputFolderRefused):
    """The output folder (or its lock file) cannot be written: a read-only folder or file system."""


def acquire_output_folder(folder: str | os.PathLike) -> Path:
    """Take `folder`'s lock for this process (a no-op when this process holds it already) until it exits.

    Raises:
        `OutputFolderInUseError`: naming the job that holds it and the ways out.
        `OutputFolderNotWritableError`: the folder cannot be written, before anything was built to be written there.
    """
    folder = Path(folder)
    path = folder / LOCK_NAME
    key = os.path.realpath(path)
    if key in _held:
        return path
    while True:
        descriptor = _open_lock_file(folder, path)
        try:
            previous = _read_record(descriptor)
            if not _flock(descriptor, previous):
                raise OutputFolderInUseError(_refusal(folder, previous))
            if not _still_names(path, descriptor):  # its holder deleted it at exit meanwhile: open the new one
                os.close(descriptor)
                continue
            previous = _read_record(descriptor)
            if previous and not _is_this_process(previous):
                logger.warning(
                    "Taking over the lock of %s left by %s (no longer running).", folder, _describe_holder(previous)
                )
            os.fchmod(descriptor, 0o600)  # a file left by a killed job may have been readable by all
            _write_record(descriptor)
        except BaseException:
            os.close(descriptor)
            raise
        break
    _held[key] = descriptor
    atexit.register(release_output_folder, folder)
    return path


def _open_lock_file(folder: Path, path: Path) -> int:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as error:
        if not isinstance(error, PermissionError) and error.errno != errno.EROFS:
            raise
        raise OutputFolderNotWritableError(
            f"The output folder {folder} cannot be written ({error.strerror}: {error.filename}): the run writes its "
            "tokenizer, checkpoints and model there. Nothing was trained. Give this run a folder it can write with "
            f"--output_dir, or make {folder} writable for this user."
        ) from None


def release_output_folder(folder: str | os.PathLike) -> None:
    """Give `folder`'s lock back (the file deleted while still locked); nothing when this process does not hold it."""
    path = Path(folder) / LOCK_NAME
    descriptor = _held.pop(os.path.realpath(path), None)
    if descriptor is None:
        return
    try:
        if _still_names(path, descriptor):
            path.unlink()
    except OSError:
        pass
    finally:
        os.close(descriptor)  # releases the flock


def _still_names(path: Path, descriptor: int) -> bool:
    try:
        named = path.stat()
    except FileNotFoundError:
        return False
    mine = os.fstat(descriptor)
    return (named.st_dev, named.st_ino) == (mine.st_dev, mine.st_ino)


def lock_holder(folder: str | os.PathLike) -> dict | None:
    """The record of `folder`'s lock file (host, pid, started, command), or None when there is none."""
    path = Path(folder) / LOCK_NAME
    if not path.exists():
        return None
    descriptor = os.open(path, os.O_RDONLY)
    try:
        return _read_record(descriptor) or None
    finally:
        os.close(descriptor)


def _flock(descriptor: int, previous: dict) -> bool:
    """True when this process now holds the lock."""
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError as error:
        if error.errno not in (errno.ENOLCK, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
            raise
        logger.warning("The file system of the output folder has no flock (%s): the lock record alone decides.", error)
        return not previous or not _holder_may_run(previous)


def _holder_may_run(record: dict) -> bool:
    if record.get("host") != socket.gethostname():
        return True  # another host's process cannot be checked from here
    try:
        os.kill(int(record.get("pid", 0)), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError, OverflowError):
        return True
    return True


def _is_this_process(record: dict) -> bool:
    return record.get("host") == socket.gethostname() and record.get("pid") == os.getpid()


def _read_record(descriptor: int) -> dict:
    os.lseek(descriptor, 0, os.SEEK_SET)
    text = os.read(descriptor, 65536).decode(errors="replace").strip()
    if not text:
        return {}
    try:
        record = json.loads(text)
    except json.JSONDecodeError:
        return {"unreadable": text[:200]}
    return record if isinstance(record, dict) else {"unreadable": text[:200]}


def _write_record(descriptor: int) -> None:
    record = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": " ".join(redact_argv(sys.argv))[:500],
    }
    os.ftruncate(descriptor, 0)
    os.lseek(descriptor, 0, os.SEEK_SET)
    os.write(descriptor, (json.dumps(record) + "\n").encode())
    os.fsync(descriptor)


def _describe_holder(record: dict) -> str:
    # Redacted again: a record written by another version, or one this process can tell secrets in, says no more.
    if "unreadable" in record:
        return f"a process whose record is unreadable ({redact(str(record['unreadable']))!r})"
    started = f", started {record['started']}" if record.get("started") else ""
    command = f": {redact(str(record['command']))}" if record.get("command") else ""
    return f"pid {record.get('pid', '?')} on host {record.get('host', '?')}{started}{command}"


def _refusal(folder: Path, record: dict) -> str:
    holder = _describe_holder(record) if record else "another process (it left no record)"
    return (
        f"The output folder {folder} is in use by another job: {holder}. Two jobs in one folder overwrite each "
        f"other's checkpoints and results. Wait for it to finish (or stop it), or give this run its own folder "
        f"with --output_dir. (The lock is {folder / LOCK_NAME}; it is released when its holder exits.)"
    )


def hold_output_folder(
    folder: str | os.PathLike,
    is_main_process: bool,
    group: object | None,
    timeout_seconds: float,
    bound: str = "sync_timeout_seconds",
) -> None:
    """The job's main process takes `folder`'s lock; every rank of `group` (a gloo group of all ranks, or None)
    raises the same `OutputFolderInUseError` (or `OutputFolderNotWritableError`) when it could not, instead of
    waiting for it at a later point."""
    from ..core.membership.agreement import all_gather_text
    from .global_points import wait_for_all_ranks

    refusal = ""
    if is_main_process:
        try:
            acquire_output_folder(folder)
        except OutputFolderRefused as error:
            refusal = f"{type(error).__name__}:{error}"
    if group is not None:
        wait_for_all_ranks(group, "taking the output folder's lock", timeout_seconds, bound)
        refusal = all_gather_text(refusal, group)[0]
    if refusal:
        kind, _, message = refusal.partition(":")
        raise {cls.__name__: cls for cls in OutputFolderRefused.__subclasses__()}[kind](message)
