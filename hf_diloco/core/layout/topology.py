"""Rank grid -> process groups.

A *worker* is `pipeline_stages x data_parallel` contiguous ranks on a fast interconnect that together hold one
replica of the model. Inside a worker, rank `w * worker_size + dp * stages + stage` is data-parallel rank `dp`
of pipeline stage `stage`. The outer (cross-worker) group of a rank joins the ranks with the same stage and the
same data-parallel index in every worker: with D data-parallel ranks per worker, each of them owns 1/D of the outer
state and exchanges that share over its own outer group (`shard.py`).
"""

from __future__ import annotations

import atexit
import datetime
import gc
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class RankLayout:
    """Pure arithmetic over the rank grid (no process groups), so it is testable without a launcher."""

    world_size: int
    pipeline_stages: int = 1
    data_parallel: int = 1

    def __post_init__(self) -> None:
        if self.world_size % self.worker_size:
            raise ValueError(
                f"world size {self.world_size} is not divisible by the worker size pipeline_stages x "
                f"data_parallel_per_worker = {self.pipeline_stages} x {self.data_parallel} = {self.worker_size}. "
                "Launch a multiple of that many processes or change the two settings."
            )

    @property
    def worker_size(self) -> int:
        return self.pipeline_stages * self.data_parallel

    @property
    def num_workers(self) -> int:
        return self.world_size // self.worker_size

    def worker_of(self, rank: int) -> int:
        return rank // self.worker_size

    def stage_of(self, rank: int) -> int:
        return rank % self.worker_size % self.pipeline_stages

    def dp_of(self, rank: int) -> int:
        return rank % self.worker_size // self.pipeline_stages

    def rank_at(self, worker: int, dp: int, stage: int) -> int:
        return worker * self.worker_size + dp * self.pipeline_stages + stage

    def worker_ranks(self, worker: int) -> list[int]:
        return list(range(worker * self.worker_size, (worker + 1) * self.worker_size))

    def data_parallel_ranks(self, worker: int, stage: int) -> list[int]:
        return [self.rank_at(worker, dp, stage) for dp in range(self.data_parallel)]

    def pipeline_ranks(self, worker: int, dp: int) -> list[int]:
        return [self.rank_at(worker, dp, stage) for stage in range(self.pipeline_stages)]

    def outer_ranks(self, dp: int, stage: int) -> list[int]:
        return [self.rank_at(w, dp, stage) for w in range(self.num_workers)]


class Topology:
    """The process groups one rank needs. Build it with `Topology.from_default_group` (or `single_process`).

    Groups (each `None` when the rank is alone in it, so callers can skip the collective):
        worker_group: every rank of this worker.
        data_parallel_group: same worker, same stage; DDP's gradient all-reduce runs here, and so does the engine's
            all-gather of updated parameters (in their dtype, on their device; synchronous on the training thread).
        data_parallel_sync_group: the same ranks as `data_parallel_group` in a second process group (gloo), used by
            the outer sync's background thread so it never interleaves with DDP's collectives.
        shard_group: the same ranks in a third gloo group, used by the engine on the training thread: each rank owns
            1/D of the outer state, and the worker gathers outer state and agrees on a round's verdict here.
        pipeline_group: same worker, same data-parallel index: the stages of one pipeline.
        outer_group: same stage and data-parallel index across workers; the only group that crosses workers.
        control_group: every rank, on gloo: the engine's start-up check, whose `monitored_barrier` names the ranks
            that do not arrive.

    `from_default_group` creates the gloo groups (outer, data-parallel sync, control) with `timeout_seconds`, so every
    collective the engine issues on them fails within that bound instead of the default group's.
    """

    def __init__(self, layout: RankLayout, rank: int, groups: dict[str, dist.ProcessGroup | None]):
        self.layout = layout
        self.rank = rank
        self.worker_group = groups.get("worker")
        self.data_parallel_group = groups.get("data_parallel")
        self.data_parallel_sync_group = groups.get("data_parallel_sync")
        self.shard_group = groups.get("shard")
        self.pipeline_group = groups.get("pipeline")
        self.outer_group = groups.get("outer")
        self.world_group = groups.get("world")
        self.control_group = groups.get("control")
        if any(group is not None for group in groups.values()):
            _tear_down_process_groups_at_exit()
            _live_topologies.add(self)

    def release_groups(self) -> None:
        """Drop this topology's references to its process groups (they must not outlive the interpreter's teardown)."""
        self.worker_group = self.data_parallel_group = self.data_parallel_sync_group = self.shard_group = None
        self.pipeline_group = self.outer_group = self.world_group = self.control_group = None

    @property
    def num_workers(self) -> int:
        return self.layout.num_workers

    @property
    def worker_index(self) -> int:
        return self.layout.worker_of(self.rank)

    @property
    def stage_index(self) -> int:
        return self.layout.stage_of(self.rank)

    @property
    def dp_index(self) -> int:
        return self.layout.dp_of(self.rank)

    @property
    def data_parallel_size(self) -> int:
        return self.layout.data_parallel

    @property
    def pipeline_stages(self) -> int:
        return self.layout.pipeline_stages

    @property
    def data_shard(self) -> tuple[int, int]:
        """(index, count) of the data shard this rank reads: one per (worker, dp) pair, shared by the stages."""
        return (
            self.worker_index * self.layout.data_parallel + self.dp_index,
            self.num_workers * self.layout.data_parallel,
        )

    def outer_peers(self) -> list[int]:
        return self.layout.outer_ranks(self.dp_index, self.stage_index)

    @classmethod
    def single_process(cls) -> Topology:
        return cls(RankLayout(1), 0, {})

    @classmethod
    def from_default_group(
        cls, pipeline_stages: int = 1, data_parallel_per_worker: int = 1, timeout_seconds: float | None = None
    ) -> Topology:
        """Create every group on every rank, in the same order (torch requires it), and keep the ones this rank is in."""
        if not (dist.is_available() and dist.is_initialized()):
            layout = RankLayout(1, pipeline_stages, data_parallel_per_worker)
            return cls(layout, 0, {})
        layout = RankLayout(dist.get_world_size(), pipeline_stages, data_parallel_per_worker)
        rank = dist.get_rank()
        timeout = datetime.timedelta(seconds=timeout_seconds) if timeout_seconds else None
        kwargs = {"timeout": timeout} if timeout else {}
        candidates: dict[str, list[list[int]]] = {
            "worker": [layout.worker_ranks(w) for w in range(layout.num_workers)],
            "data_parallel": [
                layout.data_parallel_ranks(w, s)
                for w in range(layout.num_workers)
                for s in range(layout.pipeline_stages)
            ],
            "pipeline": [
                layout.pipeline_ranks(w, d) for w in range(layout.num_workers) for d in range(layout.data_parallel)
            ],
            "outer": [
                layout.outer_ranks(d, s) for d in range(layout.data_parallel) for s in range(layout.pipeline_stages)
            ],
        }
        candidates["data_parallel_sync"] = candidates["shard"] = candidates["data_parallel"]
        candidates["control"] = [list(range(layout.world_size))]
        groups: dict[str, dist.ProcessGroup | None] = {"world": dist.group.WORLD}
        for name, rank_lists in candidates.items():
            groups[name] = None
            for ranks in rank_lists:
                if len(ranks) == 1:
                    continue  # a group of one needs no collective; every rank skips it alike
                group = dist.new_group(ranks, backend=_backend_for(name), **kwargs)
                if rank in ranks:
                    groups[name] = group
        return cls(layout, rank, groups)


def gather_rows(mine: torch.Tensor, group: dist.ProcessGroup | None, size: int | None = None) -> torch.Tensor:
    """Every member's `mine` (a small 1-D tensor), stacked in the group's rank order; `mine` alone as one row
    without a group (one process: nothing to gather). `size`: the group's size, where the group is not one
    torch.distributed knows (a torchft quorum's)."""
    size = (dist.get_world_size(group) if size is None else size) if group is not None else 1
    if size == 1:
        return mine.unsqueeze(0)
    parts = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(parts, mine, group=group)
    return torch.stack(parts)


def _backend_for(group_name: str) -> str:
    # The outer sync moves CPU buffers (the global copy lives off the accelerator), from a background thread and on the
    # training thread, so its groups are gloo whatever the training backend is; so is the control group
    # (monitored_barrier needs gloo).
    return "gloo" if group_name in ("outer", "data_parallel_sync", "shard", "control") else dist.get_backend()


_teardown_registered = False
_live_topologies: weakref.WeakSet[Topology] = weakref.WeakSet()


def _tear_down_process_groups_at_exit() -> None:
    """Destroy the process groups when the interpreter exits, if the script has not done so itself.

    Scripts written for `Trainer` rarely call `destroy_process_group()`, and each engine adds gloo groups with their
    own threads; torn down during interpreter finalisation instead, a rank can abort ("terminate called without an
    active exception") after a run that finished and saved everything, and torchrun then reports the job as failed.
    The handler destroys the groups and frees the ones this package still references, while the interpreter is whole.
    """
    global _teardown_registered
    if not _teardown_registered:
        atexit.register(_destroy_if_initialized)
        _teardown_registered = True


def _destroy_if_initialized() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    # destroy_process_group() unregisters the groups, but a group object still referenced from Python (a trainer
    # kept in a script's globals holds its topology) would be freed during interpreter finalisation, when its gloo
    # threads can no longer take the GIL. Free them now, while the interpreter is whole.
    for topology in list(_live_topologies):
        topology.release_groups()
    gc.collect()
