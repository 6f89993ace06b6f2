"""The engine's exchanges through an object store (`exchange: store`): sites that share no network, only a bucket.

Per fragment F the job runs rounds 1, 2, ...; round R applies, to θg after round R - 1, the contributions its
manifest lists (`manifest.py`). A site launches F every H steps as without a store, sending its pseudo-gradient Δ
trained from the round it applied last (its `base`), and then waits for the first round after that base:

* **Upload.** Each rank encodes its own share of Δ with the job's codec (error feedback as ever) and writes it; the
  site's leader then writes the site's record of the contribution (its tokens, every share's hash).
* **One decision per round.** The leader reads round base + 1's manifest; while there is none, it lists the
  contributions that round may apply and, once `quorum` sites are in and the grace window has passed (or at the hard
  deadline), writes the manifest create-if-absent: exactly one manifest per round whoever races, and every site
  applies that one, so θg and the outer optimizer stay bit for bit equal on every site. Manifests already written
  after it are read too: a site that fell behind applies every round it missed, in order.
* **Nobody waits for the slowest.** A contribution that missed its round is applied by a later one, down-weighted
  by its staleness; its site does not stall: it applies the rounds as decided and trains on.
* **Apply.** On the training thread, at the overlap mode's apply step (streaming: τ steps after the launch), every
  rank applies the rounds the leader named, each an outer step (the guards as ever), then θm follows θg.
* **Join.** A site that starts, late or after a crash, loads the latest complete snapshot of θg and the outer
  state (written every `snapshot_every` rounds by the site that closed the round), replays the manifests after it
  and continues at the job's step; a fresh job's first site writes round 0's snapshot. Nothing needs a live peer.
* **The end.** `close()` sends each fragment's tail as a contribution to the fragment's final round, which competes
  for the name of the next round: the job's last round of F is a plain average of the tails in, and a site still
  training that meets it stops (`finished`) and ends with the same θg.

docs/design.md, "Sites that cannot reach each other", has the rest: the objects, trust, cleanup and what it costs.
"""

from __future__ import annotations

import functools
import json
import logging
import secrets
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from ..exchange.pending import ExchangeResult, OuterSyncError, PendingExchange, SerialWorker
from ..rounds.fragment import Fragment, InFlight
from .board import RoundBoard
from .joining import Snapshots, check_job, replay_after
from .manifest import Manifest
from .names import check_site_name
from .objects import BoundedStore, ObjectStore, StoreUnreachableError
from .sealing import JobKeys
from .segments import merge_maps, model_map, share_segments
from .settle import RoundSettler, Settled, padded_numel
from .site import SiteGroup

if TYPE_CHECKING:
    from ..exchange.exchange import OuterExchange
    from ..layout.topology import Topology
    from ..rounds.rounds import DivergenceGuard, RoundKeeper
    from ..rounds.stats import EngineStats
    from ..settings.config import DiLoCoConfig

logger = logging.getLogger(__name__)


class StoreEngine(Protocol):
    """What `StoreRounds` reads and runs of its engine (`DiLoCo`)."""

    config: DiLoCoConfig
    topology: Topology
    fragments: list[Fragment]
    inner_step: int
    stats: EngineStats
    guard: DivergenceGuard
    exchange: OuterExchange
    rounds: RoundKeeper
    model: nn.Module
    tokens_per_step: float


@dataclass
class StoreFlight:
    """A launch whose rounds the store thread is settling: applied at `apply_at`."""

    future: Future
    apply_at: int
    sent: torch.Tensor
    description: str


@dataclass
class StoreLog:
    """The rounds this site applied, for logs, metrics and the model card."""

    rounds: list[dict] = field(default_factory=list)

    def summary(self) -> dict:
        sites = [entry["sites"] for entry in self.rounds if not entry["final"]]
        return {
            "rounds": len(sites),
            "fewest_sites": min(sites, default=0),
            "most_sites": max(sites, default=0),
            "mean_sites": round(sum(sites) / len(sites), 2) if sites else 0.0,
            "late_contributions": sum(entry["late"] for entry in self.rounds),
            "closed_at_deadline": sum(1 for entry in self.rounds if not entry["quorum_met"]),
            "clipped": sorted({site for entry in self.rounds for site in entry.get("clipped", [])}),
        }


class StoreRounds:
    """The engine's exchanges through a store (see the module docstring).

    Args:
        engine: the engine whose fragments and schedule this runs.
        store: the store, reached by a backend (`hf_diloco.backends.object_store.open_store`).
        secret: the job's secret (`settings.secret.job_secret()`), or None with `insecure_no_secret`.
    """

    def __init__(self, engine: StoreEngine, store: ObjectStore, secret: bytes | None):
        config = engine.config
        check_site_name(config.site)
        self.engine, self.config = engine, config
        keys = JobKeys(secret, insecure=config.insecure_no_secret)
        waits = config.sync_timeout_seconds + 2 * config.round_deadline_seconds + config.store_timeout_seconds
        self.site = SiteGroup(engine.topology, waits)
        incarnation = f"{self.site.share([secrets.randbits(48)])[0]:012x}"
        self.bounded = BoundedStore(store, config.store_timeout_seconds)
        self.board = RoundBoard(self.bounded, keys, config.site, incarnation, self.site.index, self.site.size)
        self.thread = SerialWorker("diloco-store")
        self.applied = {fragment.index: 0 for fragment in engine.fragments}
        self.finished_fragments: set[int] = set()
        self.flights: dict[int, StoreFlight] = {}
        self.launched_at = {fragment.index: 0 for fragment in engine.fragments}
        self._in_manifests: dict[int, dict[int, set]] = {fragment.index: {} for fragment in engine.fragments}
        self.segments = {fragment.index: share_segments(fragment) for fragment in engine.fragments}
        self.settler = RoundSettler(
            config, self.board, self.site, self.bounded,
            lambda: (engine.exchange.codec, engine.exchange.coding_pool()), self._applied_idents,
            lambda: dict(self.applied), self.segments,
        )  # fmt: skip
        self.snapshots = Snapshots(config, self.board, self.site, engine.guard, self.thread, self.segments)
        self.log = StoreLog()
        stats = engine.stats
        stats.store_rounds = stats.store_late_contributions = stats.store_bytes_up = stats.store_bytes_down = 0
        stats.store_sites_in_round = 0
        stats.store_wait_seconds = 0.0

    # ----------------------------------------------------------------------------------------------- the engine's

    @property
    def finished(self) -> bool:
        """The job's final round of some fragment was applied: the job has ended, training stops."""
        return bool(self.finished_fragments)

    def join(self) -> None:
        """Read (or, for a fresh job, write) the job record, load each fragment's latest snapshot, replay the rounds
        after it, and continue at the job's step."""
        engine = self.engine
        shapes = {name: list(param.shape) for name, param in engine.model.named_parameters() if param.requires_grad}
        ranks = self.site.gather_text(json.dumps(model_map(engine.fragments, shapes)))
        model = merge_maps([json.loads(text) for text in ranks])
        mine = {"settings": self.config.shared_settings(), "fingerprint": self.config.fingerprint(), "model": model}
        check_job(self.config, self.board, self.site, self.bounded, mine)
        for fragment in engine.fragments:
            start = self.snapshots.load_latest(fragment)
            self.applied[fragment.index] = start
            replay_after(self.board, self.site, fragment.index, start, functools.partial(self._replay, fragment))
        rounds = [self.applied[f.index] for f in engine.fragments]
        # The job's step, or this site's own where a checkpoint put it further (its round there never closed).
        engine.inner_step = max(engine.inner_step, self.config.inner_steps * min(rounds) if rounds else 0)
        for fragment in engine.fragments:
            fragment.write_local(fragment.theta_g)
            self.launched_at[fragment.index] = engine.inner_step
        if any(rounds):
            logger.warning("joined the store job at %s after round(s) %s of its fragments: continuing at inner step %d",
                           self.bounded.url, rounds, engine.inner_step)  # fmt: skip

    def launch(self, fragment: Fragment, delta: torch.Tensor) -> None:
        """Send this rank's share of the fragment's pseudo-gradient; its rounds are applied at the overlap mode's
        apply step (at once with τ = 0)."""
        index, engine = fragment.index, self.engine
        if self.finished:
            return  # the job has ended: nothing more enters θg but the final rounds of `close()`
        tokens = (engine.inner_step - self.launched_at[index]) * engine.tokens_per_step
        self.launched_at[index] = engine.inner_step
        sent = delta.detach().to("cpu", torch.float32).contiguous()
        job = functools.partial(self.settler.contribute, index, sent, self.applied[index], tokens, False)
        what = (
            f"the store round of fragment {index} after round {self.applied[index]} at inner step {engine.inner_step}"
        )
        self.flights[index] = StoreFlight(
            self.thread.submit(job), engine.inner_step + self.config.sync_delay, sent, what
        )
        if self.config.sync_delay == 0:
            self._apply(fragment, merge=False)

    def apply_due(self, step: int) -> None:
        """Apply the launches whose apply step is `step` (before that step's launches), in launch order."""
        for index in sorted(self.flights, key=lambda i: self.flights[i].apply_at):
            if self.flights[index].apply_at == step:
                self._apply(self.engine.fragments[index], merge=True)

    def resume(self) -> None:
        """After the engine loaded a checkpoint: the store's θg and outer state are the job's, newer than the
        checkpoint's; join again from them."""
        self.drain()
        self.flights.clear()
        self.join()

    def drain(self) -> None:
        """Wait until every launch in flight is uploaded and settled (a checkpoint: the store holds the rest); one
        that failed (the store lost) is dropped: its rounds are the store's, read again when the site resumes."""
        for index, flight in list(self.flights.items()):
            try:
                self._wait(flight)
            except (StoreUnreachableError, OuterSyncError):
                del self.flights[index]

    def close(self) -> None:
        """Apply what is in flight, then send each fragment's tail to its final round and apply everything up to it,
        so every site ends with the same θg."""
        for index in sorted(self.flights, key=lambda i: self.flights[i].apply_at):
            self._apply(self.engine.fragments[index], merge=False)
        for fragment in self.engine.fragments:
            if fragment.index in self.finished_fragments:
                continue
            tail = fragment.pseudo_gradient(fragment.theta_g).detach().to("cpu", torch.float32).contiguous()
            tokens = (self.engine.inner_step - self.launched_at[fragment.index]) * self.engine.tokens_per_step
            job = functools.partial(self.settler.contribute, fragment.index, tail, self.applied[fragment.index],
                                    tokens, True)  # fmt: skip
            what = f"the final store round of fragment {fragment.index}"
            self.flights[fragment.index] = StoreFlight(self.thread.submit(job), self.engine.inner_step, tail, what)
            self._apply(fragment, merge=False)
        self.thread.shutdown()
        self.site.close()

    def bytes_per_round(self) -> int:
        """The payload bytes this rank writes in one round of every fragment (its shares, encoded)."""
        codec = self.engine.exchange.codec
        return sum(
            codec.encoded_nbytes(padded_numel(fragment.theta_g.numel(), codec.align))
            for fragment in self.engine.fragments
        )

    def summary(self) -> dict:
        return {**self.log.summary(), "ignored_objects": self.board.ignored, "store": self.bounded.url}

    # ----------------------------------------------------------------------------------------------- applying

    def _apply(self, fragment: Fragment, merge: bool) -> None:
        flight = self.flights.pop(fragment.index)
        stats = self.engine.stats
        started = time.perf_counter()
        settled = self._wait(flight)
        stats.sync_wait_seconds += time.perf_counter() - started
        stats.store_wait_seconds += settled.wait_seconds
        stats.store_bytes_up += settled.bytes_up
        stats.store_bytes_down += settled.bytes_down
        for number, (manifest, average) in enumerate(settled.rounds):
            self._apply_round(fragment, manifest, average, flight.sent, settled.bytes_up if number == 0 else 0)
        if self.config.sync_delay == 0 or not merge or fragment.index in self.finished_fragments:
            fragment.write_local(fragment.theta_g)
        else:
            fragment.merge_local(self.config.merge_alpha)
        residual = settled.residual
        fragment.residual = None if residual is None else residual.mul_(self.config.error_feedback_decay)

    def _replay(self, fragment: Fragment, round_: int) -> None:
        """A round decided before this site joined: applied to θg as every site applied it."""
        manifest, average = self.settler.read_round(fragment.index, round_)
        self._apply_round(fragment, manifest, average, torch.zeros(0), 0)

    def _apply_round(self, fragment: Fragment, manifest: Manifest, average: torch.Tensor | None,
                     sent: torch.Tensor, bytes_sent: int) -> None:  # fmt: skip
        engine, index = self.engine, fragment.index
        if manifest.round != self.applied[index] + 1:
            raise OuterSyncError(f"fragment {index}: round {manifest.round} follows round {self.applied[index]}")
        record = None
        if average is not None:
            result = ExchangeResult(average, None, bytes_sent, 0, contributors=len(manifest.sites))
            flight = InFlight(PendingExchange.completed(result, "store round"), engine.inner_step, sent=sent)
            engine.rounds.workers = max(1, len(manifest.sites))
            record = (engine.rounds.apply_tail if manifest.final else engine.rounds.apply)(fragment, flight)
        self.applied[index] = manifest.round
        self._remember(index, manifest)
        self._book(index, manifest)
        if record is not None:  # observers see the round applied and counted
            engine.rounds.publish(record)
        if manifest.final:
            self.finished_fragments.add(index)
        elif manifest.closed_by == self.config.site and manifest.round % self.config.snapshot_every == 0:
            self.snapshots.write_later(fragment, manifest.round)

    def _book(self, index: int, manifest: Manifest) -> None:
        """The round in the stats, the log and, where it needs saying, a warning."""
        stats = self.engine.stats
        stats.store_rounds += 0 if manifest.final else 1
        stats.store_late_contributions += manifest.late
        stats.store_sites_in_round = len(manifest.sites)
        clipped = [entry for entry in manifest.entries if entry.clip < 1]
        stats.clipped_contributions += len(clipped)
        self.log.rounds.append({
            "fragment": index, "round": manifest.round, "sites": len(manifest.sites), "late": manifest.late,
            "quorum_met": manifest.quorum_met, "closed_by": manifest.closed_by, "final": manifest.final,
            "clipped": [entry.contribution.site for entry in clipped],
        })  # fmt: skip
        for entry in clipped:
            logger.warning(
                "round %d of fragment %d scaled site %s's contribution down to %.3g of itself: its norm %.3g is over "
                "robust_clip_factor=%g x the round's lower median norm", manifest.round, index,
                entry.contribution.site, entry.clip, entry.contribution.norm, self.config.robust_clip_factor,
            )  # fmt: skip
        if not manifest.quorum_met and not manifest.final:
            logger.warning(
                "round %d of fragment %d closed at the deadline (round_deadline_seconds=%g) with %d site(s) of quorum "
                "%d: %s", manifest.round, index, self.config.round_deadline_seconds, len(manifest.sites),
                self.config.quorum, ", ".join(manifest.sites) or "none",
            )  # fmt: skip

    def _wait(self, flight: StoreFlight) -> Settled:
        config = self.config
        bound = config.round_deadline_seconds * (2 + config.max_staleness) + 4 * config.store_timeout_seconds
        try:
            return flight.future.result(timeout=bound)
        except TimeoutError as error:
            raise OuterSyncError(f"{flight.description} did not settle within {bound:g} s") from error

    def _remember(self, index: int, manifest: Manifest) -> None:
        """The contributions the last rounds applied (a later round must not apply them again)."""
        window = self._in_manifests[index]
        window[manifest.round] = {entry.contribution.ident for entry in manifest.entries}
        for old in [r for r in window if r < manifest.round - self.config.max_staleness - 1]:
            del window[old]

    def _applied_idents(self, index: int) -> set:
        return set().union(*self._in_manifests[index].values()) if self._in_manifests[index] else set()
