"""What a membership backend gives the engine: the group of each exchange (`RoundView`) and the `Membership`
protocol, which `torchft_membership.TorchftMembership` implements and `elastic.ElasticRounds` runs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch.distributed as dist

StateFn = Callable[[], dict]
LoadFn = Callable[[dict], None]
DigestFn = Callable[[], bytes]


@dataclass(frozen=True)
class RoundView:
    """The group one exchange runs in, as this worker sees it.

    Attributes:
        group: a process group of the members, one rank per worker (None when this worker is alone).
        rank: this worker's rank in it.
        size: the number of members.
        healed: this worker has just loaded a live peer's state (through the `load_state_dict` it was bound to);
            on a site of several ranks, true on all of them when any one did.
        heal_bytes: bytes received for that state.
        heal_seconds: seconds the transfer took.
        members: the members' names by rank (empty where the backend does not name them).
        refused: processes of the backend's group refused as not members of the job (they did not prove its secret):
            nothing is exchanged with them.
    """

    group: dist.ProcessGroup | None
    rank: int
    size: int
    healed: bool = False
    heal_bytes: int = 0
    heal_seconds: float = 0.0
    members: tuple[str, ...] = ()
    refused: tuple[str, ...] = ()


class Membership(Protocol):
    """Who takes part in each exchange. `bind` comes first; then, per exchange, `begin_round`, the exchange over
    `view.group`, `report_error` if it failed, `end_round`."""

    def bind(self, state_dict: StateFn, load_state_dict: LoadFn, digest: DigestFn | None = None) -> None:
        """The global state a worker behind the others receives from a live peer, how it is loaded, and a digest of
        the θg the next exchange uses (equal on two workers exactly when that θg is), which a backend may compare."""

    def begin_round(self) -> RoundView:
        """Form the group for the next exchange (heal this worker first when it is behind)."""

    def report_error(self, error: Exception) -> None:
        """The exchange failed on this worker: the round must not be committed."""

    def end_round(self) -> bool:
        """True: apply the exchange's result (every member decides alike); False: discard it and retry."""

    def close(self) -> None:
        """Leave the job."""

    # Optional (`getattr`): `earlier_members`, the workers of the job's last group before this one came (none for a
    # fresh job), and `lighthouse`, where the job is found (what a worker alone is told); `progress()`, the job's
    # committed rounds, stored in a checkpoint, and `resume_at(progress)`, which counts from a checkpoint's again.
