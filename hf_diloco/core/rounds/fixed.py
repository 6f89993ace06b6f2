"""The engine's exchanges among a fixed group of workers (the default: every worker of the launch, in lock-step):
a launch hands the fragment's pseudo-gradient to the exchange, checked in step by its schedule tag, and the overlap
mode applies it; a tail of `close()` is averaged at once. Under elastic membership (`membership/elastic.py`) and
through a store (`store/rounds.py`) other runners take these calls."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from ..exchange.pending import PendingExchange
from ..exchange.transport import ScheduleTag
from .fragment import Fragment, InFlight

if TYPE_CHECKING:
    from ..exchange.exchange import OuterExchange
    from ..layout.topology import Topology
    from .overlap import Overlap
    from .round_policy import RoundClock, RoundPolicy
    from .rounds import RoundKeeper


class FixedGroupEngine(Protocol):
    """What `FixedGroupRounds` reads of its engine (`DiLoCo`)."""

    topology: Topology
    inner_step: int
    exchange: OuterExchange
    overlap: Overlap
    round_policy: RoundPolicy
    rounds: RoundKeeper
    clock: RoundClock


class FixedGroupRounds:
    def __init__(self, engine: FixedGroupEngine):
        self.engine = engine

    def launch(self, fragment: Fragment, delta: torch.Tensor) -> None:
        engine = self.engine
        scale = engine.round_policy.weigh(delta, fragment.index)  # `balanced`: this worker's share by its steps
        pending = self._send(fragment, delta, "launch", blocking=engine.overlap.blocking, balance=scale)
        flight = InFlight(pending, engine.inner_step + engine.overlap.apply_delay, sent=delta, scale=scale)
        engine.overlap.launched(fragment, flight)

    def tail(self, fragment: Fragment, delta: torch.Tensor, scale: float = 1.0) -> None:
        engine = self.engine
        delta = delta * scale if scale != 1.0 else delta
        pending = self._send(fragment, delta, "tail", blocking=True, balance=scale)
        record = engine.rounds.apply_tail(fragment, InFlight(pending, engine.inner_step, sent=delta, scale=scale))
        fragment.write_local(fragment.theta_g)
        engine.rounds.publish(record)

    def _send(
        self, fragment: Fragment, delta: torch.Tensor, kind: str, blocking: bool, balance: float = 1.0
    ) -> PendingExchange:
        """Launch the exchange of one fragment's pseudo-gradient (`kind`: a round's "launch" or a "tail" of
        `close()`), its average decoded into the fragment's buffer; the workers first check they are in step.
        `balance`: what `delta` was scaled by for the steps it covers (`balanced`), for robust clipping."""
        engine = self.engine
        peers = engine.topology.outer_peers()
        what = "outer sync" if kind == "launch" else "final outer sync"
        position, unit = engine.round_policy.schedule_position(engine.inner_step)
        return engine.exchange.launch(
            delta.cpu(),
            f"{what} of fragment {fragment.index} at inner step {engine.inner_step} with peers {peers}",
            blocking=blocking,
            compressor=fragment.compressor,
            context={**self._launch_context(fragment), "balance": balance},
            layout=fragment.values.layout,
            out=fragment.average_buffer(),
            schedule=ScheduleTag(kind, fragment.index, position, unit),
        )

    def _launch_context(self, fragment: Fragment) -> dict:
        """What an adaptive policy needs to know about this launch (how much compute the exchange can hide behind)."""
        engine = self.engine
        return {
            "step": engine.inner_step,
            "fragment": fragment.index,
            "step_seconds": engine.clock.seconds,
            "overlap_steps": engine.overlap.overlap_steps,
        }
