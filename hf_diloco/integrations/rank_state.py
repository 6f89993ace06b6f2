"""Each rank's DiLoCo state on disk, one file per rank next to the front-end's own checkpoint files.

Workers differ in their local parameters, inner optimizer and residuals, so every rank writes `diloco_state_rank{r}.pt`
(the engine's `state_dict()`, the number of processes that wrote it, and what the front-end adds) and reads back its
own. A folder written by another number of processes is refused with a message that says what to do.

The inner optimizer state is written once per replica: the D data-parallel ranks of a DDP worker hold the same bits
of it (the same averaged gradients applied to the same weights by the same optimizer), so only the worker's first
data-parallel rank (of the same pipeline stage) writes it, and the others record that rank (`inner_optimizer_rank`)
and read it from that rank's file on resume. FSDP ranks hold different shards and write their own; so does a rank
of a one-rank worker. Files without the record (every rank with its own inner state) load as they always did.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..core.diloco import DiLoCo
from .atomic_checkpoints import load_checkpoint_file

RANK_STATE_NAME = "diloco_state_rank{rank}.pt"
_RANK_STATE_RE = re.compile(r"^diloco_state_rank(\d+)\.pt$")


def rank_state_path(folder: str | os.PathLike, rank: int) -> Path:
    """Where rank `rank` keeps its DiLoCo state in `folder`."""
    return Path(folder) / RANK_STATE_NAME.format(rank=rank)


def ranks_with_state(folder: str | os.PathLike) -> list[int]:
    """The ranks whose DiLoCo state `folder` holds, sorted."""
    names = os.listdir(folder) if os.path.isdir(folder) else []
    return sorted(int(match.group(1)) for match in map(_RANK_STATE_RE.match, names) if match)


def inner_state_holder(engine: DiLoCo, rank: int) -> int | None:
    """The rank whose file holds the inner optimizer state of rank `rank` (this process) when it is another's: the
    worker's first data-parallel rank of this stage, for the other replicated (DDP) ranks of a worker; None when the
    rank writes its own (D = 1, FSDP shards, no inner optimizer, or a `rank` that is not the engine's own)."""
    topology = engine.topology
    if engine.sharded_model or engine.inner_optimizer is None or topology.data_parallel_size == 1:
        return None
    holder = topology.layout.rank_at(topology.worker_index, 0, topology.stage_index)
    return None if rank != topology.rank or holder == rank else holder


def save_rank_state(
    folder: str | os.PathLike, rank: int, world_size: int, engine: DiLoCo, extra: Mapping[str, Any] | None = None
) -> Path:
    """Write this rank's engine state (and `extra`, e.g. buffers) to `folder`; returns the file. A replicated rank
    other than its worker's first leaves the inner optimizer state to that rank's file (`inner_state_holder`)."""
    path = rank_state_path(folder, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = engine.state_dict()
    holder = inner_state_holder(engine, rank)
    if holder is not None:
        state["inner_optimizer"] = None
    torch.save({"engine": state, "world_size": world_size, "inner_optimizer_rank": holder, **(extra or {})}, path)
    return path


def load_rank_state(
    folder: str | os.PathLike, rank: int, world_size: int, engine: DiLoCo, required: bool = True
) -> dict[str, Any] | None:
    """
    Restore this rank's engine state from `folder`.

    Args:
        folder (`str` or `os.PathLike`): a folder `save_rank_state` wrote into.
        rank (`int`), world_size (`int`): this process's rank and the number of processes of this run.
        engine (`DiLoCo`): the engine to restore.
        required (`bool`, *optional*): when `False`, a folder that holds no DiLoCo state at all returns `None`.

    Returns:
        `dict` or `None`: everything the file holds (the front-end restores its own `extra` from it).

    Raises:
        `FileNotFoundError`: this rank's file is missing (the folder holds the state of other ranks, or none).
        `ValueError`: the state was written by another number of processes; `CheckpointError` (a `ValueError`): the
            file holds objects other than tensors and plain containers (nothing of it runs).
    """
    path = rank_state_path(folder, rank)
    if not path.is_file():
        written = ranks_with_state(folder)
        if not written and not required:
            return None
        reason = (
            f"{folder} holds the DiLoCo state of rank(s) {written} and this run has {world_size} processes"
            if written
            else f"{folder} holds no DiLoCo state (it was saved without DiLoCo)"
        )
        raise FileNotFoundError(
            f"{path} is missing: {reason}. Resume with the number of processes that saved it, or start a new run in "
            "another output folder."
        )
    state = load_checkpoint_file(path)
    if state["world_size"] != world_size:
        raise ValueError(
            f"{folder} was written by {state['world_size']} processes, this run has {world_size}: resume with "
            f"{state['world_size']} processes, or start a new run in another output folder."
        )
    holder = state.get("inner_optimizer_rank")
    if holder is not None:
        state["engine"]["inner_optimizer"] = _inner_state_from(folder, int(holder), world_size)
    engine.load_state_dict(state["engine"])
    return state


def _inner_state_from(folder: str | os.PathLike, holder: int, world_size: int) -> dict:
    """The inner optimizer state that rank `holder` wrote for the replicas of its worker."""
    path = rank_state_path(folder, holder)
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing: it holds the inner optimizer state of every data-parallel rank of its worker. Resume "
            "from a complete checkpoint (every rank's file), or start a new run in another output folder."
        )
    state = load_checkpoint_file(path)
    if state["world_size"] != world_size or state["engine"].get("inner_optimizer") is None:
        raise ValueError(
            f"{path} holds no inner optimizer state for this run's {world_size} processes: the folder mixes files of "
            "different runs. Resume from a checkpoint written by one run, or start a new run in another output folder."
        )
    return state["engine"]["inner_optimizer"]
