"""The ranks of one site agreeing on what the store said, through a gloo group of their own.

Every rank of a site (S pipeline stages x D data-parallel ranks) exchanges its own share of each fragment through the
store, but what the site decides must be one decision: its leader (the site's first rank) writes the site's record of
a contribution once every rank's share is written, closes rounds, and tells the others which rounds to apply, so that
every rank applies the same rounds (their verdict is a collective inside the site, `rounds.py`). These collectives
run on the store's own thread, in launch order on every rank, on a group no other thread uses.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from ..layout.topology import Topology


class SiteGroup:
    """This rank among its site's ranks: `index` (its shard of the site's outer state), `size`, `leader`."""

    def __init__(self, topology: Topology, timeout_seconds: float):
        layout = topology.layout
        self.size = layout.worker_size
        self.index = topology.rank - layout.worker_of(topology.rank) * layout.worker_size
        self.leader = self.index == 0
        self.group: dist.ProcessGroup | None = None
        if self.size > 1:
            ranks = layout.worker_ranks(topology.worker_index)
            self.group = dist.new_group(ranks, backend="gloo", timeout=timedelta(seconds=timeout_seconds))

    def gather_text(self, mine: str) -> list[str]:
        """Every rank's `mine`, in shard order (on every rank)."""
        if self.group is None:
            return [mine]
        data = mine.encode()
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
        dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64), group=self.group)
        longest = max(int(size) for size in sizes)
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[: len(data)] = torch.tensor(list(data), dtype=torch.uint8)
        parts = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.size)]
        dist.all_gather(parts, padded, group=self.group)
        return [bytes(part[: int(size)].tolist()).decode() for part, size in zip(parts, sizes)]

    def total(self, value: float) -> float:
        """The sum over the site's ranks of `value` (in rank order, float64: the same on every rank)."""
        if self.group is None:
            return value
        parts = [torch.zeros(1, dtype=torch.float64) for _ in range(self.size)]
        dist.all_gather(parts, torch.tensor([value], dtype=torch.float64), group=self.group)
        return float(sum(float(part) for part in parts))

    def share(self, values: list[int]) -> list[int]:
        """The leader's `values` (small ints) on every rank; the others pass a list of the same length."""
        if self.group is None:
            return values
        tensor = torch.tensor(values, dtype=torch.int64)
        dist.broadcast(tensor, group=self.group, group_src=0)
        return tensor.tolist()

    def barrier(self) -> None:
        if self.group is not None:
            dist.all_reduce(torch.zeros(1, dtype=torch.int64), group=self.group)

    def close(self) -> None:
        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None
