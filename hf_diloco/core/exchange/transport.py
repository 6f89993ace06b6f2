"""The transport seam: what one exchange round needs from the network between workers, and its process-group
implementation.

An exchange (`exchange.py`) never calls torch.distributed across workers itself: it sends its contributions and
receives the others' (`exchange`, or piece by piece with `send` / `receive` for the pipelined `reduce_scatter`), agrees
on who contributed and with what weight (`gather_rows`, `sum`) and shares a decision (`broadcast`) through a
`Transport`. `ProcessGroupTransport` carries them over a gloo (or NCCL) process group of the round's members, one rank
per worker: payloads as point-to-point messages with every receive posted first (`exchange_point_to_point`), the small
agreements as collectives. Intra-worker traffic (a worker's data-parallel ranks gathering their shares) stays on the
topology's own groups: it is not between workers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from ..layout.topology import gather_rows
from .pending import WorkersOutOfStepError


class Pending(Protocol):
    """A message under way (`Transport.send` / `receive`)."""

    def wait(self) -> object: ...


class Transport(Protocol):
    """The members of one exchange as the exchange reaches them; `rank` is this worker's index among `size`."""

    rank: int
    size: int

    @property
    def alone(self) -> bool:
        """No other member: nothing crosses the network."""

    def exchange(self, outgoing: Sequence[torch.Tensor], incoming: Sequence[torch.Tensor]) -> None:
        """Send `outgoing[j]` to member j and receive member j's payload into `incoming[j]` (empty entries and this
        member's own are skipped)."""

    def exchange_lengths(self, lengths: torch.Tensor) -> torch.Tensor:
        """One int64 to each member (`lengths[j]` to member j); returns what each member sent here."""

    def send(self, payload: torch.Tensor, destination: int) -> Pending:
        """Start sending `payload` to member `destination`; messages between two members arrive in posting order."""

    def receive(self, buffer: torch.Tensor, source: int) -> Pending:
        """Start receiving member `source`'s next message into `buffer`."""

    def gather_rows(self, row: torch.Tensor) -> torch.Tensor:
        """Every member's small 1-D `row`, stacked in member order (who contributes, weights, norms, schedule tags)."""

    def sum(self, values: torch.Tensor) -> None:
        """Sum `values` over the members, in place."""

    def broadcast(self, values: torch.Tensor, root: int) -> None:
        """Member `root`'s `values` on every member, in place."""


@dataclass(frozen=True)
class ProcessGroupTransport:
    """`Transport` over a process group of the members, one rank per worker (None: this worker alone).

    Attributes:
        group: the members' process group (a torch.distributed group, or a torchft quorum's).
        rank: this worker's rank in it.
        size: its number of members (given, since a torchft quorum's group is not one torch.distributed knows).
    """

    group: dist.ProcessGroup | None
    rank: int
    size: int

    @property
    def alone(self) -> bool:
        return self.size == 1 or self.group is None

    def exchange(self, outgoing: Sequence[torch.Tensor], incoming: Sequence[torch.Tensor]) -> None:
        exchange_point_to_point(incoming, outgoing, self.group, self.rank)

    def exchange_lengths(self, lengths: torch.Tensor) -> torch.Tensor:
        incoming = torch.empty_like(lengths)
        dist.all_to_all_single(incoming, lengths, group=self.group)
        return incoming

    def send(self, payload: torch.Tensor, destination: int) -> Pending:
        return dist.isend(payload, group=self.group, group_dst=destination)

    def receive(self, buffer: torch.Tensor, source: int) -> Pending:
        return dist.irecv(buffer, group=self.group, group_src=source)

    def gather_rows(self, row: torch.Tensor) -> torch.Tensor:
        return gather_rows(row, self.group, self.size)

    def sum(self, values: torch.Tensor) -> None:
        dist.all_reduce(values, group=self.group)

    def broadcast(self, values: torch.Tensor, root: int) -> None:
        dist.broadcast(values, group=self.group, group_src=root)


@dataclass(frozen=True)
class OuterGroup:
    """The workers one exchange averages over, when they are not the topology's fixed outer group (elastic
    membership: the round's members, `elastic.py`).

    Attributes:
        group: a process group of the round's members, one rank per worker.
        rank: this worker's rank in it.
        size: its number of members.
        contributes: this worker's pseudo-gradient counts (a worker that joined during the fragment's round sends
            zeros and the average is taken over the contributors only).
        weight: `round_policy: balanced`: the inner steps this worker trained since its last launch of the fragment;
            the average is then weighted by them (Σ w_m Δm / Σ w) instead of taken plainly. None: a plain average.
        step_seconds: `balanced`: this worker's median inner-step time in its round so far (0.0: not measured); the
            exchange reports the fastest of the members' (`ExchangeResult.fastest_step_seconds`).
        names: the members' names by rank, for messages (empty: "worker <rank>").
    """

    group: dist.ProcessGroup | None
    rank: int
    size: int
    contributes: bool = True
    weight: float | None = None
    step_seconds: float = 0.0
    names: tuple[str, ...] = ()

    def transport(self) -> ProcessGroupTransport:
        """The members as the exchange reaches them."""
        return ProcessGroupTransport(self.group, self.rank, self.size)


@dataclass(frozen=True)
class ScheduleTag:
    """Where in its schedule a worker launches an exchange; every worker of a fixed group must launch each exchange
    at the same tag. `position` counts in `unit`: the inner step (`round_policy: steps`, every worker launches after
    the same step) or the outer round (`balanced`, where workers launch after different numbers of steps)."""

    kind: str  # "launch" | "tail"
    fragment: int
    position: int
    unit: str = "inner step"

    KINDS = ("launch", "tail")
    NBYTES = 24  # sent to each peer before an exchange: three int64

    def as_tensor(self) -> torch.Tensor:
        return torch.tensor([self.KINDS.index(self.kind), self.fragment, self.position], dtype=torch.int64)

    def describe(self, row: list[int]) -> str:
        kind, fragment, position = row
        what = "its final sync" if kind == 1 else "the outer sync"
        return f"{what} of fragment {fragment} at {self.unit} {position}"


def exchange_point_to_point(
    incoming: list[torch.Tensor] | tuple[torch.Tensor, ...],
    outgoing: list[torch.Tensor] | tuple[torch.Tensor, ...],
    group: dist.ProcessGroup | None,
    me: int,
) -> None:
    """What `all_to_all_single` does, as point-to-point messages: `outgoing[j]` to member j of `group`, what member j
    sends into `incoming[j]` (empty entries, and this member's own, are skipped), every receive posted before any send.

    Why not `all_to_all_single`: gloo's TCP transport sends a payload only after the receiver announced its receive,
    and queues that announcement behind whatever the connection is already sending. gloo's all_to_all posts its send
    before its receive, so with two workers the one that posts last streams its whole payload before its announcement
    can reach the other: the two directions of the full-duplex link take turns, and an exchange took twice the link's
    time (`benchmarks.link_rate`). Receives posted first announce themselves before any payload is queued.
    """
    works = [
        dist.irecv(part, group=group, group_src=j) for j, part in enumerate(incoming) if j != me and part.numel() > 0
    ]
    works += [
        dist.isend(part, group=group, group_dst=j) for j, part in enumerate(outgoing) if j != me and part.numel() > 0
    ]
    for work in works:
        work.wait()


def check_in_step(transport: Transport, schedule: ScheduleTag) -> int:
    """Lock-step by contract: every worker of the group launched this exchange at the same schedule tag; returns the
    bytes sent. Each worker sees every tag, so all of them raise together instead of pairing different rounds'
    payloads."""
    if transport.alone:
        return 0
    mine = schedule.as_tensor()
    everyone = transport.gather_rows(mine)
    if not bool((everyone == mine).all()):
        launched = "; ".join(
            f"worker {worker}: {schedule.describe(row)}" for worker, row in enumerate(everyone.tolist())
        )
        raise WorkersOutOfStepError(
            f"The workers are out of step: {launched}. Every worker must call engine.step() once after every inner "
            "optimizer step, including steps a GradScaler skipped, and train the same number of steps (the same "
            "max_steps, gradient_accumulation_steps and resume point); restart every worker from the same checkpoint."
        )
    return (transport.size - 1) * schedule.NBYTES
