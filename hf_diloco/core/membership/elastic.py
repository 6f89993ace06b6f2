"""Elastic workers: every outer exchange runs among the workers alive at that moment.

A `Membership` (the backend: `torchft_membership.TorchftMembership`, a torchft Lighthouse + Manager) forms the
round's group right before each exchange (`begin_round`), says after it whether every member may apply the result
(`end_round`), and gives a worker that is behind (started late, restarted, resumed after a hang) the global state of a
live peer while it forms the group. `ElasticRounds` is the engine's side of it, with these rules:

* **Quorum per exchange.** Each launch (and each tail sync of `close()`) asks for a group of the workers present. A
  worker that died or hung (past the backend's timeouts) is simply not in it.
* **Retry the same pseudo-gradient.** When an exchange fails (a member lost with the exchange in flight) or a member
  cannot commit, every member discards the result, asks for a new group and sends the same Δ again: nothing of the
  round is lost but the missing worker's share. What was in flight from the lost worker is discarded on every
  survivor alike, so θg stays identical on every worker.
* **Join with weight 0.** A worker behind the others loads their state (θg, outer optimizer states, inner step,
  divergence guard, and which exchange they are about to run), writes θg into its model, and takes part in that
  exchange sending zeros: the average is taken over the contributors only. Each fragment counts from its next
  round on (a fragment's round started before the join would carry fewer inner steps). Its error-feedback residuals
  start at zero; its inner optimizer state is its own (fresh for a new process).
* **Averages over contributors.** The exchange adds one int64 all-reduce (the number of contributors) to the round.
  With `round_policy: balanced` it is an all-gather of (contributes, steps, step time) instead, and the average is
  weighted by the steps each contributor trained since its last launch of the fragment (`round_policy.py`).

The overlap mode's rule (streaming with τ > 0, delayed, eager) decides when an average is applied, as without
elastic membership, and its exchange runs behind the inner steps until then (`elastic_background.py`), completed
before any other group forms: between two groups nothing is in flight, so a group can be formed and a state served
at any launch; a worker that heals receives the averages the others have completed and not applied yet, and applies
them at the same steps. A worker is one process, or a site of one worker's ranks (S pipeline stages x D
data-parallel ranks, DDP or FSDP2: each rank's membership forms the site's one quorum, and rank k exchanges its share
with rank k of the other sites; docs/design.md, "A site of several ranks").
"""

from __future__ import annotations

import hashlib
import logging
import struct
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist

from ..exchange.pending import ExchangeResult, OuterSyncError, PendingExchange, unmasked_collective_error
from ..exchange.transport import OuterGroup
from ..rounds.checkpoint import load_shared_state, shared_state
from ..rounds.fragment import Fragment, InFlight
from ..settings.settings_check import check_same_published
from .elastic_background import BackgroundExchange, running_in_background
from .membership import Membership, RoundView

if TYPE_CHECKING:
    from ..exchange.exchange import OuterExchange
    from ..rounds.overlap import Overlap
    from ..rounds.round_policy import RoundClock, RoundPolicy
    from ..rounds.rounds import DivergenceGuard, RoundKeeper
    from ..rounds.stats import EngineStats
    from ..settings.config import DiLoCoConfig

logger = logging.getLogger(__name__)


class MinWorkersTimeout(RuntimeError):
    """Fewer than `min_workers` workers could be reached within the configured bound."""


class AloneWithoutState(RuntimeError):
    """A worker of a job that has run finds no live peer and loaded no checkpoint: it would start the job over."""


@dataclass
class MembershipLog:
    """Membership per exchange, for logs, metrics and the model card.

    Attributes:
        rounds: one entry per exchange this worker completed: inner step of its launch, outer round, fragment,
            workers in the group, contributors, retries, whether this worker healed first, whether it ran behind the
            inner steps.
        heal_bytes, heal_seconds: what healing from peers cost this worker in all.
        site: this worker's name in messages.
        min_workers: the fewest workers an exchange runs with (1 lets a site train alone).
        company: the job has had other members than this worker (a group of several, or a Lighthouse that had formed
            groups before this worker came): from then on an exchange alone is one its model differs from the
            job's by.
        alone_from, alone_to: the first and the last round of the exchanges this worker has run alone since it was
            last in a group with others (None: it was, at its last exchange).
    """

    rounds: list[dict] = field(default_factory=list)
    heal_bytes: int = 0
    heal_seconds: float = 0.0
    site: str = "this site"
    min_workers: int = 1
    company: bool = False
    alone_from: int | None = None
    alone_to: int = 0

    def record(self, **entry: object) -> None:
        """One completed exchange (the fields of `rounds`); a warning when it ran alone in a job of several."""
        self.rounds.append(entry)
        if entry["workers"] > 1:  # the members hold the same θg (their membership compares it): the job's again
            self.company, self.alone_from = True, None
        elif self.company:
            self.alone_from = entry["round"] if self.alone_from is None else self.alone_from
            self.alone_to = int(entry["round"])
            logger.warning(
                "%s trained round %d alone: no other site has been in its exchanges since round %d (%d round(s) "
                "alone), so its global model differs from the job's. min_workers=%d lets a site train alone; with "
                "min_workers=2 it would wait min_workers_timeout for another site and then stop.",
                self.site,
                self.alone_to,
                self.alone_from,
                self.alone_to - self.alone_from + 1,
                self.min_workers,
            )

    def met(self, size: int, earlier_members: list[str]) -> None:
        """A group formed: `size` members; `earlier_members`: the others (members of the job only) its Lighthouse had
        formed groups of before this worker came."""
        self.company = self.company or size > 1 or bool(earlier_members)

    def apart(self) -> dict | None:
        """This worker's last exchanges ran alone in a job of several: {"rounds": N, "from_round": R}, its model
        differs from the job's; None when its last exchange had others in it (or it never had any)."""
        if self.alone_from is None:
            return None
        return {"rounds": self.alone_to - self.alone_from + 1, "from_round": self.alone_from}

    def summary(self) -> dict:
        """Exchanges, the fewest and most workers in one, joins and drops (rises and falls of the group size
        between consecutive exchanges), retries, heals, exchanges run behind the inner steps, and the heals' bytes
        and seconds."""
        sizes = [entry["workers"] for entry in self.rounds]
        changes = [after - before for before, after in zip(sizes, sizes[1:])]
        return {
            "exchanges": len(self.rounds),
            "fewest_workers": min(sizes, default=0),
            "most_workers": max(sizes, default=0),
            "joins": sum(change for change in changes if change > 0),
            "drops": -sum(change for change in changes if change < 0),
            "retries": sum(entry["retries"] for entry in self.rounds),
            "heals": sum(1 for entry in self.rounds if entry["healed"]),
            "in_background": sum(1 for entry in self.rounds if entry.get("background")),
            "heal_bytes": self.heal_bytes,
            "heal_seconds": round(self.heal_seconds, 3),
            "alone_rounds": (self.apart() or {}).get("rounds", 0),
            "alone_from_round": (self.apart() or {}).get("from_round"),
        }


class ElasticEngine(Protocol):
    """What `ElasticRounds` reads and runs of its engine (`DiLoCo`): it is the engine's exchange runner under a
    membership, so it holds the engine's parts rather than copies of them."""

    config: DiLoCoConfig
    fragments: list[Fragment]
    inner_step: int
    stats: EngineStats
    guard: DivergenceGuard
    round_policy: RoundPolicy
    clock: RoundClock
    exchange: OuterExchange
    overlap: Overlap
    rounds: RoundKeeper

    @property
    def outer_rounds(self) -> int: ...


class ElasticRounds:
    """The engine's exchanges under a `Membership` (see the module docstring for the rules).

    Args:
        engine: the engine whose fragments and schedule this runs.
        membership: the backend; bound here to `global_state` / `load_global_state`.
    """

    def __init__(self, engine: ElasticEngine, membership: Membership):
        self.engine = engine
        self.membership = membership
        site = getattr(membership, "replica_id", "this site")
        self.log = MembershipLog(site=site, min_workers=engine.config.min_workers)
        # ("launch" | "tail", fragment, inner step of the launch) from a launch until its exchange is committed
        self._phase: tuple[str, int, int] | None = None
        self._tails_done: list[int] = []
        self.background = BackgroundExchange(self)  # an exchange running behind the inner steps
        self._weight = 0.0  # `balanced`: the steps this worker's Δ of the exchange being formed covers
        self._contributing = {fragment.index for fragment in engine.fragments}
        self.alone_without_state = False  # see `check_can_train`
        _zero_membership_stats(engine.stats)
        membership.bind(self.global_state, self.load_global_state, lambda: theta_digest(engine.fragments, self._phase))

    # ----------------------------------------------------------------------------------------------- the engine's

    def join(self, view: RoundView | None = None) -> None:
        """The first group: every worker's start. A worker behind the others takes their state and then the exchange
        they are about to run."""
        view = view or self._begin()
        while True:
            if view.healed and self._phase is not None:
                self._run(None, None, view)
                self.alone_without_state = False
                return
            # Every member waits until the others have healed (a peer serves its state only until it commits), then
            # commits the join as a round: a worker that starts later is behind, and heals. Every rank of a site
            # votes, its barrier failed or not (the site's commit waits for all of its ranks).
            reached = self._barrier(view)
            if self.membership.end_round() and reached:
                # Alone in a job that has run: its own initial weights would start the job over (`check_can_train`).
                earlier = getattr(self.membership, "earlier_members", [])
                self.alone_without_state = view.size == 1 and not view.healed and bool(earlier)
                return
            view = self._begin()

    def check_can_train(self) -> None:
        """Refuse to train a worker that found no live peer in a job that has run and loaded no checkpoint (with
        `min_workers` 1 nothing else stops it): it would train alone from its own initial weights and save that."""
        if self.alone_without_state:
            raise _alone_without_state(self.membership)

    def resume(self, state: dict) -> None:
        """After the engine loaded a checkpoint: meet the others again at the checkpoint's progress (the torchft
        step it was saved at), so that whoever is behind heals from whoever is ahead: this worker from live peers
        that went on since, or a site whose checkpoint is older from one with a newer (a whole job restarted after
        its Lighthouse was lost, where every site resumes at once)."""
        self.background.drain()
        resume_at = getattr(self.membership, "resume_at", None)
        if resume_at is not None:
            resume_at(int(state.get("elastic_progress", 0)))  # none stored: behind any live peer
        self._phase, self._tails_done = None, []
        self.join()
        self.alone_without_state = False  # it holds the job's state: its checkpoint's, or a live peer's

    def with_progress(self, state: dict) -> dict:
        """A checkpoint `state` with the job's progress, for `resume`."""
        progress = getattr(self.membership, "progress", None)
        return state if progress is None else {**state, "elastic_progress": progress()}

    def launch(self, fragment: Fragment, delta: torch.Tensor) -> None:
        """Exchange the fragment's pseudo-gradient among the workers present and apply the average: at once, or, in
        an overlap mode that applies it later, in the background (`elastic_background.py`)."""
        self.background.drain()
        self._phase = ("launch", fragment.index, self.engine.inner_step)
        self._weight = float(self.engine.round_policy.launch_weights[fragment.index]) if self._balanced else 0.0
        view = self._begin()
        if view.healed and self._phase is None:  # healed from peers meeting after a resume: their join is this one's
            self.join(view)
            return
        if not self.background.start(fragment, delta, view):
            self._run(fragment, delta, view)

    def tail(self, fragment: Fragment, delta: torch.Tensor) -> None:
        """`close()`'s plain-average sync of a fragment's tail, among the workers present."""
        self.background.drain()
        if fragment.index in self._tails_done:
            return  # synced while this worker healed into the others' close()
        self._phase = ("tail", fragment.index, self.engine.inner_step)
        if self._balanced:
            self._weight = float(self.engine.round_policy.steps_since_launch(fragment.index, self.engine.inner_step))
        self._run(fragment, delta, self._begin())

    def close(self) -> None:
        self.membership.close()

    # ----------------------------------------------------------------------------------------------- the state

    def global_state(self) -> dict:
        """What a worker behind the others receives: identical on every member at a group's formation."""
        engine = self.engine
        return {
            **shared_state(engine.config, engine.inner_step, engine.fragments, engine.guard, copy=False),
            # The exchange being retried is not served: the healer joins it (`phase`), as at a launch.
            "flights": {
                fragment.index: _completed_flight(fragment.flight)
                for fragment in engine.fragments
                if fragment.flight is not None and not running_in_background(fragment.flight)
            },
            "phase": self._phase,
            "tails_done": list(self._tails_done),
            "outer_rounds": engine.outer_rounds,
            "sharding": sharding_kind(engine.sharded_model),
            "shapes": model_shapes(engine.fragments),
        }

    def load_global_state(self, state: dict) -> None:
        """Take a live peer's `global_state`: θg into the model, this worker's own round discarded."""
        engine = self.engine
        check_peer_settings(engine.config, state)
        check_same_sharding(state.get("sharding", "replicated"), sharding_kind(engine.sharded_model))
        check_same_model(engine.fragments, state)
        engine.inner_step = load_shared_state(engine.fragments, engine.guard, state)
        # θg reaches the model in `_begin`, on every rank of the site at once (a collective among them).
        for index, flight in state["flights"].items():
            # A completed exchange the others apply later (τ > 0, delayed, eager): this worker sent nothing in it.
            fragment = engine.fragments[int(index)]
            result = ExchangeResult(flight["average"], None, 0, 0, contributors=flight["contributors"])
            zeros = torch.zeros_like(fragment.theta_g)
            fragment.flight = InFlight(PendingExchange.completed(result), flight["apply_at"], sent=zeros)
        self._phase = None if state["phase"] is None else tuple(state["phase"])
        self._tails_done = list(state["tails_done"])
        if self._balanced:
            joined_at = None if self._phase is None else self._phase[1]
            engine.round_policy.joined(engine.inner_step, joined_at, int(state["outer_rounds"]))
        # At step 0 (every worker's start) nothing was trained yet: every fragment's first round counts in full.
        self._contributing = {f.index for f in engine.fragments} if engine.inner_step == 0 else set()

    # ----------------------------------------------------------------------------------------------- internals

    @property
    def _balanced(self) -> bool:
        return self.engine.round_policy.balanced

    def _begin(self) -> RoundView:
        view = self.membership.begin_round()
        self.log.met(view.size, getattr(self.membership, "earlier_members", []))
        _count_membership(self.engine.stats, view)
        if view.healed:
            self._write_healed_state()
            self.log.heal_bytes += view.heal_bytes
            self.log.heal_seconds += view.heal_seconds
            logger.warning(
                "healed from a live peer: %d bytes in %.2f s; continuing at inner step %d",
                view.heal_bytes,
                view.heal_seconds,
                self.engine.inner_step,
            )
        return view

    def _write_healed_state(self) -> None:
        """After a heal, on every rank of the site (each rank's θg share: the peer's it loaded, or its own where
        torchft healed only some of the site's ranks, at a job's first group): θg into the model, this worker's
        own residuals dropped, eager's start point restarted from θg."""
        for fragment in self.engine.fragments:
            fragment.write_local(fragment.theta_g)
            fragment.residual = None
            if fragment.trajectory is not None:  # eager: this worker's own start point restarts from θg
                fragment.trajectory.restart_from(fragment)

    def _run(self, fragment: Fragment | None, delta: torch.Tensor | None, view: RoundView) -> None:
        """Exchange until the members commit (retrying the same Δ among whoever is left), then apply."""
        if view.healed or fragment is None:
            fragment, delta = self._joining_exchange()
            self._weight = 0.0
        result = self.attempt(fragment, delta, view, self._phase[0] == "tail")
        fragment, delta, result, final = self.settle(fragment, delta, view, result, background=False)
        self._apply(fragment, delta, result, final)

    def settle(
        self, fragment: Fragment, delta: torch.Tensor, view: RoundView, result: ExchangeResult | None, background: bool
    ) -> tuple[Fragment, torch.Tensor, ExchangeResult, bool]:
        """From an attempt's `result` (None: it failed here) to a committed one: while the members cannot all
        commit, form a group of whoever is left and send the same Δ again (zeros, once this worker healed into it).
        `background`: the first attempt ran behind the inner steps (logged with the exchange)."""
        retries, healed, launched_at = 0, view.healed, self._phase[2]
        while not (self.membership.end_round() and result is not None):
            retries += 1
            self.engine.stats.exchange_retries += 1
            logger.warning(
                "the exchange of fragment %d at inner step %d did not complete among %d workers; retrying with the "
                "workers present",
                fragment.index,
                launched_at,
                view.size,
            )
            view = self._begin()
            healed = healed or view.healed
            if view.healed:
                fragment, delta = self._joining_exchange()
                self._weight = 0.0
                launched_at = self._phase[2]
            result = self.attempt(fragment, delta, view, self._phase[0] == "tail")
        final = self._phase[0] == "tail"
        self.log.record(
            step=launched_at, round=self.engine.outer_rounds, fragment=fragment.index, final=final, workers=view.size,
            contributors=result.contributors, retries=retries, healed=healed, background=background,
        )  # fmt: skip
        return fragment, delta, result, final

    def committed(self, fragment: Fragment) -> None:
        """The fragment's exchange is committed: no group is being formed, and its rounds count this worker's Δ."""
        self._phase = None
        self._contributing.add(fragment.index)

    def contributes(self, fragment: Fragment) -> bool:
        """Whether this worker sends its own Δ for `fragment` (not zeros: it has trained a whole round of it)."""
        return fragment.index in self._contributing

    def _barrier(self, view: RoundView) -> bool:
        if view.group is None or view.size == 1:
            return True
        try:
            dist.all_reduce(torch.zeros(1, dtype=torch.int64), group=view.group)
        except Exception as error:
            cause = unmasked_collective_error(error)
            if not isinstance(cause, RuntimeError):  # not a peer lost: a defect, raised as it is
                raise
            self.membership.report_error(cause)
            return False
        self.engine.stats.bytes_sent += (view.size - 1) * 8
        return True

    def _joining_exchange(self) -> tuple[Fragment, torch.Tensor]:
        """After a heal: the exchange the others are running, with nothing of this worker's to add."""
        fragment = self.engine.fragments[self._phase[1]]
        return fragment, torch.zeros_like(fragment.theta_g)

    def attempt(
        self, fragment: Fragment, delta: torch.Tensor, view: RoundView, final: bool, blocking: bool = True
    ) -> ExchangeResult | PendingExchange | None:
        """One exchange among the group's members: its result (`blocking`) or the exchange under way; None when it
        failed here (reported to the membership, so that no member commits it)."""
        engine = self.engine
        balanced = self._balanced
        outer = OuterGroup(
            view.group, view.rank, view.size,
            contributes=fragment.index in self._contributing and (self._weight > 0 or not balanced),
            weight=self._weight if balanced else None,
            step_seconds=engine.clock.median_step_seconds() if balanced else 0.0, names=view.members,
        )  # fmt: skip
        what = "final outer sync" if final else "outer sync"
        description = (
            f"{what} of fragment {fragment.index} at inner step {engine.inner_step} among {view.size} workers"
        )
        try:
            pending = engine.exchange.launch(
                delta.cpu(), description, blocking=blocking, compressor=fragment.compressor, outer=outer,
                out=fragment.average_buffer(),
            )  # fmt: skip
        except OuterSyncError as error:
            return self._failed(error)
        return self.wait_for(pending) if blocking else pending

    def wait_for(self, pending: PendingExchange) -> ExchangeResult | None:
        try:
            return pending.wait()
        except OuterSyncError as error:
            return self._failed(error)

    def _failed(self, error: OuterSyncError) -> None:
        logger.warning("%s", error)
        self.membership.report_error(error)
        return None

    def _apply(self, fragment: Fragment, delta: torch.Tensor, result: ExchangeResult, final: bool) -> None:
        engine = self.engine
        launched_at = self._phase[2]
        flight = InFlight(PendingExchange.completed(result), engine.inner_step, sent=delta, scale=result.scale)
        if self._balanced:
            engine.round_policy.observe_fastest(result.fastest_step_seconds)
        self.committed(fragment)
        if final:
            self._tails_done.append(fragment.index)
            record = engine.rounds.apply_tail(fragment, flight) if result.contributors else None
            fragment.write_local(fragment.theta_g)
            if record is not None:
                engine.rounds.publish(record)
        elif result.contributors or engine.overlap.saves_sent:
            # Applied now (sync_delay 0) or later by the overlap mode's rule, as without elastic membership; a
            # delayed or eager round whose members all joined during it applies a zero average. A worker that healed
            # into a retry at the others' apply step (a background exchange) applies it at once, as they do.
            flight.apply_at = launched_at + engine.overlap.apply_delay
            engine.overlap.workers = engine.rounds.workers = max(1, result.contributors)  # M: the workers averaged
            engine.overlap.launched(fragment, flight)
            if flight.apply_at <= engine.inner_step and fragment.flight is flight:
                engine.overlap.apply_due(engine.fragments, flight.apply_at)
        else:  # every member joined during this round: there is nothing to average
            fragment.write_local(fragment.theta_g)


def theta_digest(fragments: list[Fragment], phase: tuple[str, int, int] | None) -> bytes:
    """Bytes equal on two workers exactly when the θg of the exchange being formed (`phase`'s fragment; every
    fragment's at the join) is: the exact int64 sum of its float32 bits (integer addition, the same on any number of
    threads) and every 1021st value, hashed. Cheap enough for every group: the membership compares it, so that members
    holding different θg never average their rounds."""
    digest = hashlib.sha256()
    for fragment in fragments if phase is None else [fragments[phase[1]]]:
        theta = fragment.theta_g.detach().float()
        digest.update(struct.pack("<q", int(theta.view(torch.int32).sum(dtype=torch.int64))))
        digest.update(theta[::1021].cpu().numpy().tobytes())
    return digest.digest()


def _zero_membership_stats(stats: EngineStats) -> None:
    stats.workers_in_round = stats.membership_joins = stats.membership_drops = 0
    stats.exchange_retries = stats.heals = stats.heal_bytes = 0
    stats.heal_seconds = 0.0


def _count_membership(stats: EngineStats, view: RoundView) -> None:
    """The engine's membership counters after a group formed: its size, the rises and falls since the last group,
    and a heal's bytes and seconds."""
    if stats.workers_in_round:
        stats.membership_joins += max(0, view.size - stats.workers_in_round)
        stats.membership_drops += max(0, stats.workers_in_round - view.size)
    stats.workers_in_round = view.size
    if view.healed:
        stats.heals += 1
        stats.heal_bytes += view.heal_bytes
        stats.heal_seconds += view.heal_seconds


def _alone_without_state(membership: Membership) -> AloneWithoutState:
    earlier = ", ".join(getattr(membership, "earlier_members", []))
    lighthouse = getattr(membership, "lighthouse", "the job's Lighthouse")
    return AloneWithoutState(
        f"This worker is alone: the Lighthouse {lighthouse} last formed a group of {earlier}, none of which joined "
        "this worker's first group (gone, or not at an exchange within the Lighthouse's join timeout), and this "
        "worker loaded no checkpoint, so it would train the job over from its own initial weights (min_workers=1 "
        "lets a worker train alone). Resume it from the job's last checkpoint (DiLoCo.load_state_dict; "
        "resume_from_checkpoint in the Trainer and hf-diloco pretrain), or start it together with the other sites "
        "(start_workers=2 makes its first group wait for another), or start a new Lighthouse for a new run."
    )


def check_peer_settings(config: DiLoCoConfig, state: dict) -> None:
    """Refuse a live peer's `global_state` written with other DiLoCo settings than `config`, naming each field with
    both values (only the fingerprints for a peer of a version that sent no settings)."""
    mine = {"settings": config.shared_settings(), "fingerprint": config.fingerprint()}
    check_published_settings(mine, state)


def sharding_kind(sharded_model: bool) -> str:
    """How a site's ranks hold the model: "fsdp" (each rank its FSDP2 shards, and the outer state by those rows) or
    "replicated" (each rank the whole model, the outer state by 1/D of the flat vector)."""
    return "fsdp" if sharded_model else "replicated"


def check_same_sharding(theirs: str, mine: str) -> None:
    """Refuse a live site whose ranks shard the model otherwise: rank k's share of θg is FSDP's rows of rank k on one
    and the k-th 1/D of the flat vector on the other, so the same rank of each would hold different values."""
    if theirs != mine:
        launch = "with the Trainer's fsdp arguments" if theirs == "fsdp" else "without FSDP"
        raise ValueError(
            f"The live sites hold the model {theirs} on their ranks and this site {mine}: rank k of a site exchanges "
            f"its share of the global model with rank k of the others, and the shares of the two differ. Launch this "
            f"site as the others are ({launch})."
        )


def model_shapes(fragments: list[Fragment]) -> list[list]:
    """[name, shape] of each piece the fragments sync, in order: what a healer compares its own model with."""
    return [[piece.name, list(shape)] for f in fragments for piece, shape in zip(f.pieces, f.shapes)]


def check_same_model(fragments: list[Fragment], state: dict) -> None:
    """Refuse a live peer's `global_state` for another model (another width, depth or vocabulary) before any of it is
    loaded, naming the first parameter whose shape differs, with both shapes (from a peer that sent no shapes: θg's
    size by fragment)."""
    mine, theirs = model_shapes(fragments), state.get("shapes")
    if theirs is None:
        mine = [[f"θg of fragment {f.index}", [f.theta_g.numel()]] for f in fragments]
        theirs = [[f"θg of fragment {index}", [saved.numel()]] for index, saved in enumerate(state["global"])]
    if theirs == mine:
        return
    peer, own = next(((peer, own) for peer, own in zip(theirs, mine) if peer != own), (None, None))
    if peer is None:
        first = f"the peer syncs {len(theirs)} parameters and this worker {len(mine)}"
    elif peer[0] == own[0]:
        first = f"{own[0]} is {peer[1]} in the peer and {own[1]} in this worker"
    else:
        first = f"the peer syncs {peer[0]} {peer[1]} where this worker syncs {own[0]} {own[1]}"
    raise ValueError(
        f"A live peer trains another model than this worker: {first}. Every site of a job trains the same model: "
        "start this worker with the live sites' model settings (model: in the config, e.g. hidden_size, "
        "num_hidden_layers, the vocabulary), or train this model as a job of its own, against another Lighthouse."
    )


def check_published_settings(mine: dict, peer: dict) -> None:
    """`check_peer_settings` between the `{"settings", "fingerprint"}` this worker and a live peer publish (what a
    joiner compares before it takes part in a quorum)."""
    check_same_published(
        mine,
        peer,
        "A live peer runs",
        "start this worker with the running workers' DiLoCo config",
        theirs="the peer",
        ours="this worker",
    )


def _completed_flight(flight: InFlight) -> dict:
    """An exchange that has completed (every exchange runs inline) but is applied later, as a healer receives it."""
    result = flight.pending.wait()
    # A copy: the average may be a view of a longer reused buffer, which pickling would send whole.
    return {"apply_at": flight.apply_at, "average": result.average.clone(), "contributors": result.contributors}
