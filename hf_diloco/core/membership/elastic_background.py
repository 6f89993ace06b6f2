"""Under elastic membership, the transfer hidden behind the inner steps again.

An overlap mode that applies an exchange's average after its launch (streaming with τ > 0, delayed, eager) runs the
exchange in the background with a fixed membership. Under membership a group cannot be formed, nor a state served to
a worker that heals, while an exchange is in flight; so the exchange is launched among the members of its launch's
group and completed, on the training thread, before anything could form another group:

* at the first of its apply (streaming: τ steps after the launch) and the step before the next launch of any
  fragment (delayed, eager: a fragment's average is applied at its next launch, a round later; with P fragments
  another one launches H/P steps later), through the engine's `finish_due`;
* when the overlap mode applies it, when a checkpoint waits for it, and before any other group (`drain`).

Completing it is what the inline path does at the launch: the members commit the result, or discard it identically
on every survivor and retry the same Δ among whoever is left (inline, then). A worker that heals in such a retry
is at the survivors' step, before their next launch: it joins the exchange being retried (the served state leaves it
out: `running_in_background`), applies it at the others' apply step (the phase carries the launch step), and takes
part in the next launch with them. A worker healed at a launch, one that does not contribute to the fragment yet, a
blocking mode and `round_policy: balanced` run inline as before.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch

from ..exchange.pending import ExchangeResult, PendingExchange
from ..rounds.fragment import Fragment, InFlight

if TYPE_CHECKING:
    from .membership import RoundView


class ExchangeRunner(Protocol):
    """What `BackgroundExchange` runs of its `elastic.ElasticRounds` (the inline path's own steps)."""

    engine: Any

    def attempt(
        self, fragment: Fragment, delta: torch.Tensor, view: RoundView, final: bool, blocking: bool = True
    ) -> ExchangeResult | PendingExchange | None: ...

    def wait_for(self, pending: PendingExchange) -> ExchangeResult | None: ...

    def settle(
        self, fragment: Fragment, delta: torch.Tensor, view: RoundView, result: ExchangeResult | None, background: bool
    ) -> tuple[Fragment, torch.Tensor, ExchangeResult, bool]: ...

    def committed(self, fragment: Fragment) -> None: ...

    def contributes(self, fragment: Fragment) -> bool: ...


class DeferredExchange:
    """An exchange launched among one group's members and left running behind the inner steps. It stands in the
    overlap mode's flight for a `PendingExchange`; `wait()` completes it once (`BackgroundExchange.complete`)."""

    def __init__(
        self,
        background: BackgroundExchange,
        fragment: Fragment,
        delta: torch.Tensor,
        view: RoundView,
        pending: PendingExchange | None,
        finish_at: int,
    ):
        self.background, self.fragment, self.delta, self.view = background, fragment, delta, view
        self.finish_at = finish_at
        self._pending: PendingExchange | None = pending
        self.result: ExchangeResult | None = None

    def wait(self) -> ExchangeResult:
        if self.result is None:
            pending, self._pending = self._pending, None
            self.result = self.background.complete(self, pending)
        return self.result


def running_in_background(flight: InFlight) -> bool:
    """Whether `flight` is an exchange still running in the background (not served to a worker that heals)."""
    return isinstance(flight.pending, DeferredExchange) and flight.pending.result is None


class BackgroundExchange:
    """The one exchange an `ElasticRounds` may have running behind the inner steps (see the module docstring)."""

    def __init__(self, rounds: ExchangeRunner):
        self.rounds = rounds
        self.running: DeferredExchange | None = None

    def start(self, fragment: Fragment, delta: torch.Tensor, view: RoundView) -> bool:
        """Launch the exchange of `fragment` among `view`'s members in the background and hand the overlap mode its
        flight now, as a fixed membership does; False (nothing launched) where it runs inline."""
        engine = self.rounds.engine
        finish_at = self._finish_step(fragment, view)
        if finish_at <= engine.inner_step:
            return False
        pending = self.rounds.attempt(fragment, delta, view, final=False, blocking=False)
        self.running = DeferredExchange(self, fragment, delta, view, pending, finish_at)
        engine.overlap.workers = engine.rounds.workers = view.size  # M until the contributors are known
        flight = InFlight(self.running, engine.inner_step + engine.overlap.apply_delay, sent=delta)
        engine.overlap.launched(fragment, flight)
        return True

    def finish_due(self, step: int) -> None:
        """Complete the running exchange when `step` is its last step of overlap (the engine's step calls this before
        it applies or launches anything)."""
        if self.running is not None and step >= self.running.finish_at:
            self.drain()

    def drain(self) -> None:
        """Complete the running exchange, if any: every group is formed with nothing in flight."""
        if self.running is not None:
            self.running.wait()

    def complete(self, deferred: DeferredExchange, pending: PendingExchange | None) -> ExchangeResult:
        """The background exchange's result once every member commits it (retried inline among whoever is left)."""
        rounds, engine = self.rounds, self.rounds.engine
        self.running = None
        result = None if pending is None else rounds.wait_for(pending)
        _, _, result, _ = rounds.settle(deferred.fragment, deferred.delta, deferred.view, result, background=True)
        rounds.committed(deferred.fragment)
        engine.overlap.workers = engine.rounds.workers = max(1, result.contributors)
        return result

    def _finish_step(self, fragment: Fragment, view: RoundView) -> int:
        """The step at which an exchange launched now completes: its apply (streaming, τ > 0) or the step before the
        next launch of any fragment (delayed, eager), whichever is first. The launch step itself (inline) for a
        blocking mode, `balanced` rounds, a worker that just healed or does not contribute to this fragment yet."""
        engine, config = self.rounds.engine, self.rounds.engine.config
        inline = engine.overlap.blocking or engine.round_policy.balanced or view.healed
        if inline or not self.rounds.contributes(fragment):
            return engine.inner_step
        steps_to_next_launch = config.inner_steps // config.num_fragments
        return engine.inner_step + min(engine.overlap.apply_delay, steps_to_next_launch - 1)
