"""Atomic checkpoints: a checkpoint counts only once its manifest exists, and every file matches the manifest.

Every rank writes its files into `checkpoint-N`; after a barrier, global rank 0 writes `diloco_manifest.json` (size
and sha256 of every file) to a temporary name and renames it into place, which is atomic on POSIX file systems. A
crash before that rename leaves a folder without a manifest, which resume never picks; a truncated or altered file
no longer matches its manifest and is refused with a message saying what to do.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from pathlib import Path

MANIFEST_NAME = "diloco_manifest.json"
_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")

logger = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """A checkpoint that must not be resumed from."""


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
    manifest_path = folder / MANIFEST_NAME
    if not folder.is_dir():
        raise CheckpointError(f"Checkpoint {folder} does not exist.")
    if not manifest_path.is_file():
        raise CheckpointError(
            f"Checkpoint {folder} is incomplete (no {MANIFEST_NAME}): the job stopped while writing it. Resume from "
            "an earlier checkpoint (resume_from_checkpoint=True picks the newest complete one) or delete this folder."
        )
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except (ValueError, KeyError) as error:
        raise CheckpointError(f"Checkpoint {folder} has an unreadable {MANIFEST_NAME}: {error}.") from error
    for name, expected in files.items():
        path = folder / name
        if not path.is_file():
            raise CheckpointError(f"Checkpoint {folder} is missing {name}; resume from an earlier checkpoint.")
        if path.stat().st_size != expected["size"] or _sha256(path) != expected["sha256"]:
            raise CheckpointError(
                f"Checkpoint {folder} is corrupt: {name} does not match its manifest (size or sha256 differ). Resume "
                "from an earlier checkpoint."
            )


def last_complete_checkpoint(output_dir: str | os.PathLike) -> str | None:
    """The newest `checkpoint-N` under `output_dir` that passes `verify_checkpoint`, skipping (and naming) others."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return None
    candidates = sorted(
        (int(m.group(1)), p) for p in output_dir.iterdir() if p.is_dir() and (m := _CHECKPOINT_RE.match(p.name))
    )
    for _, path in reversed(candidates):
        try:
            verify_checkpoint(path)
        except CheckpointError as error:
            logger.warning(f"Skipping {path}: {error}")
            continue
        return str(path)
    return None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()
