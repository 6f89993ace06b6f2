"""Atomic checkpoints: a checkpoint counts only once its manifest exists, and every file matches the manifest.

Every rank writes its files into `checkpoint-N`; after a barrier, global rank 0 writes `diloco_manifest.json` (size
and sha256 of every file) to a temporary name and renames it into place, which is atomic on POSIX file systems. A
crash before that rename leaves a folder without a manifest, which resume never picks; a truncated or altered file
no longer matches its manifest and is refused with a message saying what to do.

What a run never does with a checkpoint it refused (incomplete, corrupt, or with an unreadable manifest): resume from
it, delete it in rotation, or write over it. A folder that holds checkpoints of which none verifies is an error when
asked to resume, not a silent start from step 0; a refused checkpoint that stands where a new save must go is moved
aside to `refused-checkpoint-N`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MANIFEST_NAME = "diloco_manifest.json"
# Beside the manifest of a run's last checkpoint: the final model the run saved (see `record_final_model`).
FINAL_MODEL_NAME = "final_model.json"
TRAINER_STATE_NAME = "trainer_state.json"
REFUSED_PREFIX = "refused-"
_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
# Files of a saved model at the top of a folder (what `save_pretrained` writes for the weights).
_WEIGHT_FILE_RE = re.compile(r"^(model|pytorch_model|adapter_model)(-\d+-of-\d+)?\.(safetensors|bin)(\.index\.json)?$")

logger = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """A checkpoint that must not be resumed from."""


class CheckpointSaveError(OSError):
    """Writing a checkpoint failed (a full disk, a file-size limit, ...); the folder was left without a manifest."""


@dataclass(frozen=True)
class CheckpointScan:
    """The `checkpoint-N` folders of an output folder, sorted by step.

    Attributes:
        complete (`tuple[Path, ...]`): the checkpoints that verify against their manifest.
        refused (`tuple[tuple[Path, str], ...]`): the others, each with the reason it is refused.
    """

    complete: tuple[Path, ...]
    refused: tuple[tuple[Path, str], ...]

    @property
    def newest_complete(self) -> Path | None:
        return self.complete[-1] if self.complete else None

    def refused_after(self, step: int) -> list[tuple[Path, str]]:
        return [(path, reason) for path, reason in self.refused if checkpoint_step(path) > step]


def write_manifest(folder: str | os.PathLike) -> Path:
    """Record size and sha256 of every file under `folder`, then publish the manifest atomically."""
    folder = Path(folder)
    files = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST_NAME):
        if path.name.startswith(f".{MANIFEST_NAME}"):
            continue
        files[str(path.relative_to(folder))] = {"size": path.stat().st_size, "sha256": _sha256(path)}
    temporary = folder / f".{MANIFEST_NAME}.tmp"
    with open(temporary, "w") as handle:
        json.dump({"format": 1, "files": files}, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, folder / MANIFEST_NAME)
    return folder / MANIFEST_NAME


def verify_checkpoint(folder: str | os.PathLike) -> None:
    """Raise `CheckpointError` unless `folder` is a complete checkpoint whose files match their manifest."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"Checkpoint {folder} does not exist.")
    files = _manifest_files(folder)
    for name, expected in files.items():
        path = folder / name
        if not path.is_file():
            raise CheckpointError(f"Checkpoint {folder} is missing {name}; resume from an earlier checkpoint.")
        if path.stat().st_size != expected["size"] or _sha256(path) != expected["sha256"]:
            raise CheckpointError(
                f"Checkpoint {folder} is corrupt: {name} does not match its manifest (size or sha256 differ). Resume "
                "from an earlier checkpoint."
            )


def load_checkpoint_file(path: str | os.PathLike, output_dir: str | os.PathLike | None = None, mmap: bool = False):
    """`torch.load` of a checkpoint's pickle (`map_location="cpu"`, `weights_only=True`: tensors and plain containers
    only, nothing of it runs). A file holding anything else raises `CheckpointError` naming it and the way out; torch's
    own message, which suggests loading it with `weights_only=False`, is not shown."""
    import pickle
    import warnings

    import torch

    try:
        with warnings.catch_warnings():  # torch warns about the pickle protocol of a file it is about to refuse
            warnings.simplefilter("ignore", UserWarning)
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as error:
        raise CheckpointError(_foreign_pickle(Path(path), output_dir, str(error))) from None


def refuse_foreign_pickles(checkpoint: str | os.PathLike, output_dir: str | os.PathLike | None = None) -> None:
    """Before a resume loads anything: every pickle of `checkpoint` that a resume reads (`*.pt`, `*.pth`, `*.bin`
    but `training_args.bin`, which holds the arguments object and is never read back) opens with `weights_only=True`
    under the numpy types transformers allows for its RNG state, or `CheckpointError` names it. Tensors are mapped,
    not read."""
    import zipfile

    from transformers.trainer_pt_utils import safe_globals

    for path in sorted(Path(checkpoint).iterdir()):
        if path.suffix in (".pt", ".pth", ".bin") and path.name != "training_args.bin" and path.is_file():
            with safe_globals():
                load_checkpoint_file(path, output_dir, mmap=zipfile.is_zipfile(path))


def _foreign_pickle(path: Path, output_dir: str | os.PathLike | None, torch_message: str) -> str:
    named = re.search(r"GLOBAL ([\w.]+)", torch_message)
    what = f"it would call {named.group(1)}" if named else "it is not a torch.save of tensors and plain containers"
    folder = path.parent
    where = Path(output_dir) if output_dir is not None else folder.parent
    return (
        f"{path} holds objects other than tensors and plain containers ({what}): it is not a checkpoint this project "
        f"wrote, and nothing of it was loaded or run. Move {folder} out of {where} (a resume then takes the newest "
        "checkpoint left), or start a new run in another --output_dir."
    )


def checkpoint_step(folder: str | os.PathLike) -> int:
    """The step N of a `checkpoint-N` folder."""
    match = _CHECKPOINT_RE.match(Path(folder).name)
    if match is None:
        raise ValueError(f"{folder} is not a checkpoint-N folder.")
    return int(match.group(1))


def scan_checkpoints(output_dir: str | os.PathLike) -> CheckpointScan:
    """Verify every `checkpoint-N` folder directly under `output_dir`."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return CheckpointScan((), ())
    folders = sorted(
        (p for p in output_dir.iterdir() if p.is_dir() and _CHECKPOINT_RE.match(p.name)), key=checkpoint_step
    )
    complete, refused = [], []
    for folder in folders:
        try:
            verify_checkpoint(folder)
        except CheckpointError as error:
            refused.append((folder, str(error)))
        else:
            complete.append(folder)
    return CheckpointScan(tuple(complete), tuple(refused))


def last_complete_checkpoint(output_dir: str | os.PathLike) -> str | None:
    """The newest `checkpoint-N` under `output_dir` that passes `verify_checkpoint`, skipping (and naming) others."""
    scan = scan_checkpoints(output_dir)
    for path, reason in scan.refused:
        logger.warning(f"Skipping {path}: {reason}")
    return None if scan.newest_complete is None else str(scan.newest_complete)


def checkpoint_to_resume(output_dir: str | os.PathLike, start_over: str = "pass `--auto_resume false`") -> str | None:
    """
    The checkpoint a run in `output_dir` resumes from: the newest complete one.

    Args:
        output_dir (`str` or `os.PathLike`): the run's output folder.
        start_over (`str`, *optional*): how the caller's user starts over from step 0 in this folder, for the message.

    Returns:
        `str` or `None`: the newest complete checkpoint; `None` when the folder holds no `checkpoint-N` at all.

    Raises:
        `CheckpointError`: when the folder holds checkpoints but none verifies. A run must not start over from step 0
            there without being told to: it would rotate away and overwrite what the previous run left. The message
            names the folder, each checkpoint's problem and the ways out.
    """
    scan = scan_checkpoints(output_dir)
    if scan.newest_complete is not None:
        for path, reason in scan.refused_after(checkpoint_step(scan.newest_complete)):
            logger.warning(f"Not resuming from {path}, which is newer but refused (it is kept as it is): {reason}")
        return str(scan.newest_complete)
    if not scan.refused:
        return None
    problems = "\n".join(f"  - {path.name}: {reason}" for path, reason in scan.refused)
    raise CheckpointError(
        f"output_dir {Path(output_dir)} holds checkpoints from an earlier run, but none of them can be resumed "
        f"from:\n{problems}\nNothing was trained, deleted or overwritten. Either repair or delete those folders (a "
        "refused checkpoint's weights may be intact: check them before deleting), or start a new run in another "
        f"folder (`--output_dir`), or {start_over} to start over from step 0 in this folder knowingly (the refused "
        f"checkpoints are then kept, moved aside to {REFUSED_PREFIX}checkpoint-N when a new save needs the name)."
    )


def rotate_checkpoints(
    output_dir: str | os.PathLike,
    save_total_limit: int | None,
    keep: Iterable[str | os.PathLike | None] = (),
    keep_newest: bool = True,
) -> list[Path]:
    """
    Delete the oldest complete checkpoints until at most `save_total_limit` complete ones remain.

    Only checkpoints that verify are ever deleted (and counted); those in `keep` (for example the best model's) and,
    with `keep_newest`, the newest complete one are never deleted. Age is the time the manifest was published.

    Returns:
        `list[Path]`: the deleted folders.
    """
    if not save_total_limit or save_total_limit <= 0:
        return []
    complete = sorted(scan_checkpoints(output_dir).complete, key=_published_at)
    protected = {complete[-1].resolve()} if complete and keep_newest else set()
    protected |= {Path(path).resolve() for path in keep if path}
    deleted = []
    remaining = len(complete)
    for folder in complete:
        if remaining <= max(save_total_limit, len(protected)):
            break
        if folder.resolve() not in protected:
            shutil.rmtree(folder)
            deleted.append(folder)
            remaining -= 1
    return deleted


def make_way_for_checkpoint(folder: str | os.PathLike) -> Path | None:
    """
    Clear the path of a checkpoint about to be written, without losing a refused one.

    A complete checkpoint at that path (an earlier run's at the same step, which this run replaces, as the Trainer
    does) is deleted; an incomplete or corrupt one is moved aside to `refused-checkpoint-N` (or `...-2`, ...), so
    nothing a user may still want to repair is overwritten, and no stale file of it ends up in the new manifest.

    Returns:
        `Path` or `None`: where a refused checkpoint was moved, if one was.
    """
    folder = Path(folder)
    if not folder.exists():
        return None
    try:
        verify_checkpoint(folder)
    except CheckpointError as error:
        aside = _free_name(folder.with_name(f"{REFUSED_PREFIX}{folder.name}"))
        os.replace(folder, aside)
        logger.warning(f"Moved the refused checkpoint {folder} aside to {aside} (kept, not deleted): {error}")
        return aside
    logger.warning(f"Replacing the complete checkpoint {folder} left by an earlier run at the same step.")
    shutil.rmtree(folder)
    return None


def save_failure(folder: str | os.PathLike, error: BaseException, rank: int) -> CheckpointSaveError:
    """The error to raise when writing checkpoint `folder` failed with `error` on `rank`: what is safe, what to do."""
    folder = Path(folder)
    newest = scan_checkpoints(folder.parent).newest_complete
    try:
        free = f"{shutil.disk_usage(folder.parent).free / 2**20:,.0f} MiB free there now"
    except OSError:
        free = "free space unknown"
    resume = (
        f"the run then resumes from {newest.name}" if newest is not None else "there is no complete checkpoint yet"
    )
    return CheckpointSaveError(
        f"Saving checkpoint {folder} failed on rank {rank}: {type(error).__name__}: {error}. The folder is left "
        f"without a {MANIFEST_NAME}, so it is never resumed from, and no earlier checkpoint was deleted. If the disk "
        f"filled or a file-size limit was hit ({free}), free space (delete old runs, lower save_total_limit) or point "
        f"--output_dir at a larger disk, and rerun: {resume}."
    )


def read_trainer_state(checkpoint: str | os.PathLike) -> dict[str, Any]:
    """The `trainer_state.json` of a checkpoint as a dict (`global_step`, `max_steps`, `num_train_epochs`, ...)."""
    path = Path(checkpoint) / TRAINER_STATE_NAME
    if not path.is_file():
        raise CheckpointError(f"Checkpoint {checkpoint} has no {TRAINER_STATE_NAME}: it was not written by a Trainer.")
    return json.loads(path.read_text())


def record_final_model(output_dir: str | os.PathLike, checkpoint: str | os.PathLike) -> None:
    """
    Write in the run's last `checkpoint` the size and sha256 of the final model's weight files in `output_dir`.

    The final model is not always the checkpoint's: with a sync delay (tau > 0) `close()` applies the fragments in
    flight after the last checkpoint. A re-run of the finished run compares the folder's model against this record
    (`final_model_matches_checkpoint`), so it knows its own final model from a damaged one. The record sits beside
    the checkpoint's manifest, outside it: the checkpoint's own files are unchanged.
    """
    files = {
        path.name: {"size": path.stat().st_size, "sha256": _sha256(path)}
        for path in sorted(Path(output_dir).iterdir())
        if path.is_file() and _WEIGHT_FILE_RE.match(path.name)
    }
    temporary = Path(checkpoint) / f".{FINAL_MODEL_NAME}.tmp"
    temporary.write_text(json.dumps({"format": 1, "files": files}, indent=1))
    os.replace(temporary, Path(checkpoint) / FINAL_MODEL_NAME)


def final_model_matches_checkpoint(output_dir: str | os.PathLike, checkpoint: str | os.PathLike) -> bool:
    """Whether `output_dir` already holds the final model of the run whose last checkpoint is `checkpoint`, byte for
    byte (per `record_final_model`'s record, else per the checkpoint's manifest: the model it holds)."""
    weights = _final_model_files(Path(checkpoint))
    if not weights:
        return False
    for name, expected in weights.items():
        path = Path(output_dir) / name
        if not path.is_file() or path.stat().st_size != expected["size"] or _sha256(path) != expected["sha256"]:
            return False
    return True


def refuse_a_damaged_final_model(output_dir: str | os.PathLike, checkpoint: str | os.PathLike) -> None:
    """Before a finished run's final model is saved again from its last `checkpoint`: raise `CheckpointError` when
    `output_dir` holds a weight file of that model that differs from the checkpoint's (truncated, corrupt or
    replaced), naming it, instead of overwriting it. Absent files (the job stopped before its final save) pass."""
    weights = _final_model_files(Path(checkpoint))
    for name, expected in weights.items():
        path = Path(output_dir) / name
        if not path.is_file():
            continue
        size = path.stat().st_size
        if size == expected["size"] and _sha256(path) == expected["sha256"]:
            continue
        what = f"{size} bytes, the checkpoint's {expected['size']}" if size != expected["size"] else "other bytes"
        raise CheckpointError(
            f"{path} is not the final model of this finished run ({what}): it is truncated, corrupt or was replaced. "
            f"Nothing was written. To write the run's final model again from {Path(checkpoint).name}, move that file "
            f"aside (e.g. to {name}.damaged) and rerun; to keep it, use another --output_dir."
        )


def _final_model_files(checkpoint: Path) -> dict[str, dict[str, Any]]:
    """Size and sha256 of each weight file of the run's final model: the record of `record_final_model` when the
    final save wrote one, else the checkpoint's own weight files (its manifest)."""
    record = checkpoint / FINAL_MODEL_NAME
    if record.is_file():
        try:
            files = json.loads(record.read_text()).get("files")
        except (ValueError, UnicodeDecodeError, AttributeError):
            files = None
        if isinstance(files, dict) and files:
            return files
    return {name: entry for name, entry in _manifest_files(checkpoint).items() if _WEIGHT_FILE_RE.match(name)}


def _manifest_files(folder: Path) -> dict[str, dict[str, Any]]:
    """The manifest's `files` mapping, checked for shape; `CheckpointError` when missing or malformed."""
    manifest_path = folder / MANIFEST_NAME
    if not manifest_path.is_file():
        raise CheckpointError(
            f"Checkpoint {folder} is incomplete (no {MANIFEST_NAME}): the job stopped while writing it. Resume from "
            "an earlier checkpoint (resume_from_checkpoint=True picks the newest complete one) or delete this folder."
        )
    try:
        manifest = json.loads(manifest_path.read_text())
    except (ValueError, UnicodeDecodeError) as error:
        raise CheckpointError(f"Checkpoint {folder} has an unreadable {MANIFEST_NAME} (not JSON: {error}).") from error
    files = manifest.get("files") if isinstance(manifest, dict) else None
    well_formed = (
        isinstance(files, dict)
        and files
        and all(
            isinstance(entry, dict) and isinstance(entry.get("size"), int) and isinstance(entry.get("sha256"), str)
            for entry in files.values()
        )
    )
    if not well_formed:
        raise CheckpointError(
            f"Checkpoint {folder} has an unreadable {MANIFEST_NAME}: it must map `files` to a non-empty "
            "{name: {size, sha256}} table. Resume from an earlier checkpoint."
        )
    return files


def _published_at(folder: Path) -> tuple[float, int]:
    return (folder / MANIFEST_NAME).stat().st_mtime, checkpoint_step(folder)


def _free_name(path: Path) -> Path:
    candidate, number = path, 1
    while candidate.exists():
        number += 1
        candidate = path.with_name(f"{path.name}-{number}")
    return candidate


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()
