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
import math
import secrets
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from ..exchange.pending import ExchangeResult, OuterSyncError, PendingExchange, SerialWorker
from ..rounds.fragment import Fragment, InFlight
from ..settings.settings_check import check_same_published
from .board import RoundBoard, SettingsMismatchError
from .manifest import ClosingRule, Contribution, Manifest, weigh
from .names import check_site_name
from .objects import BoundedStore, ObjectStore, check_create_if_absent
from .sealing import JobKeys
from .site import SiteGroup
from .tensors import from_safetensors, to_safetensors

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
    sharded_model: bool
    tokens_per_step: float


@dataclass
class StoreFlight:
    """A launch whose rounds the store thread is settling: applied at `apply_at`."""

    future: Future
    apply_at: int
    sent: torch.Tensor
    description: str


@dataclass
class Settled:
    """What the store thread hands the training thread for one launch: every round to apply, in order, with this
    rank's share of its average; the residual of this rank's encode; the bytes and the time it waited."""

    rounds: list[tuple[Manifest, torch.Tensor | None]]
    residual: torch.Tensor | None
    bytes_up: int
    bytes_down: int
    wait_seconds: float


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
        self.keys = JobKeys(secret, insecure=config.insecure_no_secret)
        self.site = SiteGroup(engine.topology, config.sync_timeout_seconds)
        incarnation = f"{self.site.share([secrets.randbits(48)])[0]:012x}"
        self.bounded = BoundedStore(store, config.store_timeout_seconds)
        self.board = RoundBoard(self.bounded, self.keys, config.site, incarnation, self.site.index, self.site.size)
        self.rule = ClosingRule(config.quorum, config.grace_seconds, config.round_deadline_seconds,
                                config.adaptive_grace)  # fmt: skip
        self.thread = SerialWorker("diloco-store")
        self.applied = {fragment.index: 0 for fragment in engine.fragments}
        self.finished_fragments: set[int] = set()
        self.flights: dict[int, StoreFlight] = {}
        self.launched_at = {fragment.index: 0 for fragment in engine.fragments}
        self._in_manifests: dict[int, dict[int, set]] = {fragment.index: {} for fragment in engine.fragments}
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
        self._check_job()
        for fragment in self.engine.fragments:
            self._load_latest(fragment)
        rounds = [self.applied[f.index] for f in self.engine.fragments]
        self.engine.inner_step = self.config.inner_steps * min(rounds) if rounds else 0
        for fragment in self.engine.fragments:
            fragment.write_local(fragment.theta_g)
            self.launched_at[fragment.index] = self.engine.inner_step
        if any(rounds):
            logger.warning(
                "joined the store job at %s from round %s: continuing at inner step %d",
                self.bounded.url, rounds, self.engine.inner_step,
            )  # fmt: skip

    def launch(self, fragment: Fragment, delta: torch.Tensor) -> None:
        """Send this rank's share of the fragment's pseudo-gradient; its rounds are applied at the overlap mode's
        apply step (at once with τ = 0)."""
        index, engine = fragment.index, self.engine
        if self.finished:
            return  # the job has ended: nothing more enters θg but the final rounds of `close()`
        tokens = (engine.inner_step - self.launched_at[index]) * engine.tokens_per_step
        self.launched_at[index] = engine.inner_step
        sent = delta.detach().to("cpu", torch.float32).contiguous()
        job = functools.partial(self._settle_launch, index, sent, self.applied[index], tokens, final=False)
        description = (
            f"the store round of fragment {index} after round {self.applied[index]} at inner step {engine.inner_step}"
        )
        flight = StoreFlight(self.thread.submit(job), engine.inner_step + self.config.sync_delay, sent, description)
        self.flights[index] = flight
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
        """Wait for every launch in flight to be uploaded and settled (a checkpoint: the store holds the rest)."""
        for flight in self.flights.values():
            self._wait(flight)

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
            job = functools.partial(self._settle_launch, fragment.index, tail, self.applied[fragment.index], tokens,
                                    final=True)  # fmt: skip
            what = f"the final store round of fragment {fragment.index}"
            self.flights[fragment.index] = StoreFlight(self.thread.submit(job), self.engine.inner_step, tail, what)
            self._apply(fragment, merge=False)
        self.thread.shutdown()
        self.site.close()

    def summary(self) -> dict:
        return {**self.log.summary(), "ignored_objects": len(self.board.ignored), "store": self.bounded.url}

    # ----------------------------------------------------------------------------------------------- applying

    def _apply(self, fragment: Fragment, merge: bool) -> None:
        flight = self.flights.pop(fragment.index)
        engine = self.engine
        started = time.perf_counter()
        settled = self._wait(flight)
        engine.stats.sync_wait_seconds += time.perf_counter() - started
        engine.stats.store_wait_seconds += settled.wait_seconds
        engine.stats.store_bytes_up += settled.bytes_up
        engine.stats.store_bytes_down += settled.bytes_down
        residual = settled.residual
        first = True
        for manifest, average in settled.rounds:
            self._apply_round(fragment, manifest, average, flight.sent, settled.bytes_up if first else 0)
            first = False
        if self.config.sync_delay == 0 or not merge or fragment.index in self.finished_fragments:
            fragment.write_local(fragment.theta_g)
        else:
            fragment.merge_local(self.config.merge_alpha)
        fragment.residual = None if residual is None else residual.mul_(self.config.error_feedback_decay)

    def _apply_round(self, fragment: Fragment, manifest: Manifest, average: torch.Tensor | None,
                     sent: torch.Tensor, bytes_sent: int) -> None:  # fmt: skip
        engine, index = self.engine, fragment.index
        if manifest.round != self.applied[index] + 1:
            raise OuterSyncError(f"fragment {index}: round {manifest.round} follows round {self.applied[index]}")
        if average is not None:
            result = ExchangeResult(average, None, bytes_sent, 0, contributors=len(manifest.sites))
            flight = InFlight(PendingExchange.completed(result, "store round"), engine.inner_step, sent=sent)
            engine.rounds.workers = max(1, len(manifest.sites))
            record = (engine.rounds.apply_tail if manifest.final else engine.rounds.apply)(fragment, flight)
            engine.rounds.publish(record)
        self.applied[index] = manifest.round
        self._remember(index, manifest)
        engine.stats.store_rounds += 0 if manifest.final else 1
        engine.stats.store_late_contributions += manifest.late
        engine.stats.store_sites_in_round = len(manifest.sites)
        self.log.rounds.append({
            "fragment": index, "round": manifest.round, "sites": len(manifest.sites), "late": manifest.late,
            "quorum_met": manifest.quorum_met, "closed_by": manifest.closed_by, "final": manifest.final,
        })  # fmt: skip
        for entry in manifest.entries:
            if entry.clip < 1:
                engine.stats.clipped_contributions += 1
                logger.warning(
                    "round %d of fragment %d scaled site %s's contribution down to %.3g of itself: its norm %.3g is "
                    "over robust_clip_factor=%g x the round's lower median norm", manifest.round, index,
                    entry.contribution.site, entry.clip, entry.contribution.norm, self.config.robust_clip_factor,
                )  # fmt: skip
        if manifest.final:
            self.finished_fragments.add(index)
        elif not manifest.quorum_met:
            logger.warning(
                "round %d of fragment %d closed at the deadline (round_deadline_seconds=%g) with %d site(s) of quorum "
                "%d: %s", manifest.round, index, self.config.round_deadline_seconds, len(manifest.sites),
                self.config.quorum, ", ".join(manifest.sites),
            )  # fmt: skip
        if (
            manifest.closed_by == self.config.site
            and not manifest.final
            and manifest.round % self.config.snapshot_every == 0
        ):
            self._snapshot_later(fragment, manifest.round)

    def _wait(self, flight: StoreFlight) -> Settled:
        bound = (
            self.config.round_deadline_seconds * (1 + self.config.max_staleness)
            + 4 * self.config.store_timeout_seconds
        )
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

    # ----------------------------------------------------------------------------------------------- the store thread

    def _settle_launch(self, index: int, sent: torch.Tensor, base: int, tokens: float, final: bool) -> Settled:
        """Upload this rank's share, let the leader settle the rounds to apply, and average each (this rank's share)."""
        codec, pool = self.engine.exchange.codec, self.engine.exchange.coding_pool()
        up, down = self.bounded.bytes_up, self.bounded.bytes_down
        padded = _padded(sent, codec.align)
        payload = codec.encode(padded, pool)
        residual = None
        if self.config.error_feedback:
            residual = torch.sub(padded, codec.decode(payload, padded.numel(), pool=pool))[: sent.numel()].clone()
        own = bytes(payload.numpy())
        shares = self.site.gather_hashes(self.board.put_share(index, base, own, padded.numel(), codec.name))
        norm = math.sqrt(self.site.total(float(sent.double().pow(2).sum())))
        started = time.monotonic()
        if self.site.leader:
            self.board.put_record(index, base, tokens, shares, final=final, norm=norm)
            self.board.beat(dict(self.applied))
        last = self.site.share([self._settle(index, base, final) if self.site.leader else 0])[0]
        waited = time.monotonic() - started
        own_ident = (self.config.site, self.board.incarnation, base)
        rounds = [self._read_round(index, r, padded.numel(), {own_ident: own}) for r in range(base + 1, last + 1)]
        return Settled(rounds, residual, self.bounded.bytes_up - up, self.bounded.bytes_down - down, waited)

    def _settle(self, index: int, base: int, final: bool) -> int:
        """(Leader.) The last round to apply now: the first round after `base` once decided (closing it when due),
        then every round already decided after it; with `final`, up to the fragment's final round."""
        target, last = base + 1, base
        idents = self._applied_idents(index)
        waiting_since, quorum_at, seen = time.monotonic(), None, set()
        while True:
            manifest = self.board.manifest(index, target)
            if manifest is not None:
                idents |= {entry.contribution.ident for entry in manifest.entries}
                last, target = target, target + 1
                waiting_since, quorum_at, seen = time.monotonic(), None, set()
                if manifest.final or not final:
                    break
                continue
            window = range(target - 1 - self.config.max_staleness, target)
            pending = [c for c in self.board.contributions(index, window, final) if c.ident not in idents]
            now = time.monotonic()
            sites = {c.site for c in pending}
            for contribution in pending:
                if contribution.ident not in seen and quorum_at is not None:
                    self.rule.observe(now - quorum_at)
                seen.add(contribution.ident)
            if quorum_at is None and len(sites) >= self.config.quorum:
                quorum_at = now
            if self.rule.due(len(sites), None if quorum_at is None else now - quorum_at, now - waiting_since):
                entries = weigh(pending, target, self.config.max_staleness, self.config.robust_clip_factor)
                proposal = Manifest(index, target, self.config.site, entries, final=final,
                                    quorum_met=len(sites) >= self.config.quorum, waited_seconds=now - waiting_since)  # fmt: skip
                self.board.decide(proposal)
                continue
            time.sleep(self._poll_seconds())
        if not final:  # rounds other sites decided since: a site behind catches up at once
            while (manifest := self.board.manifest(index, last + 1)) is not None:
                last += 1
                if manifest.final:
                    break
        return last

    def _poll_seconds(self) -> float:
        return min(1.0, max(0.05, self.rule.grace() / 4))

    def _read_round(self, index: int, round_: int, numel: int, own: dict) -> tuple[Manifest, torch.Tensor | None]:
        """Round `round_`'s manifest and this rank's share of its weighted average (None: nothing to average)."""
        manifest = self.board.manifest(index, round_)
        if manifest is None:
            raise OuterSyncError(f"round {round_} of fragment {index} was decided but its manifest cannot be read")
        if not manifest.entries:
            return manifest, None
        codec, pool = self.engine.exchange.codec, self.engine.exchange.coding_pool()
        nbytes = codec.encoded_nbytes(numel)
        total = torch.zeros(numel, dtype=torch.float32)
        part = torch.empty(numel, dtype=torch.float32)
        for entry in manifest.entries:  # in the manifest's order: every site sums the same way, bit for bit
            payload = own.get(entry.contribution.ident)
            if payload is None:
                payload = self.board.fetch_share(index, entry, nbytes)
            codec.decode(torch.frombuffer(bytearray(payload), dtype=torch.uint8), numel, out=part, pool=pool)
            total.add_(part.mul_(entry.weight))
        return manifest, total[: self.engine.fragments[index].theta_g.numel()]

    # ----------------------------------------------------------------------------------------------- snapshots

    def _snapshot_later(self, fragment: Fragment, round_: int) -> None:
        """Write θg and the outer state after `round_` from the store thread (copies: training goes on)."""
        payload = snapshot_bytes(fragment, self.engine.guard, round_)
        self.thread.submit(functools.partial(self._write_snapshot, fragment.index, round_, payload))

    def _write_snapshot(self, index: int, round_: int, payload: bytes) -> None:
        self.board.put_snapshot(index, round_, payload)
        self.site.barrier()
        if self.site.leader:
            self.board.mark_snapshot(index, round_)
            self._clean(index, round_)

    def _clean(self, index: int, snapshot_round: int) -> None:
        """Remove what no live site and no joiner needs any more: rounds before the older of the two newest
        snapshots and of every live site's position, less the staleness window."""
        snapshots = self.board.snapshot_rounds(index)
        keep_snapshot = snapshots[-2] if len(snapshots) > 1 else snapshot_round
        live = self.board.live_sites(self.config.round_deadline_seconds * 3 + self.config.store_timeout_seconds)
        positions = [applied.get(index, 0) for applied in live.values()]
        keep_from = min([keep_snapshot, *positions]) - self.config.max_staleness
        if keep_from > 0:
            self.board.delete_before(index, keep_from, keep_snapshot)

    def _load_latest(self, fragment: Fragment) -> None:
        """θg and the outer state of the fragment's latest complete snapshot (round 0's, written now for a fresh
        job), then every round decided after it."""
        index = fragment.index
        latest = self.board.snapshot_rounds(index) if self.site.leader else []
        start = self.site.share([latest[-1] if latest else -1])[0]
        if start < 0:
            self.board.put_snapshot(index, 0, snapshot_bytes(fragment, self.engine.guard, 0))
            self.site.barrier()
            if self.site.leader:
                self.board.mark_snapshot(index, 0)
            self.site.barrier()
            start = 0
        load_snapshot(fragment, self.engine.guard, self.board.read_snapshot(index, start))
        self.applied[index] = start
        last = start
        if self.site.leader:
            while self.board.manifest(index, last + 1) is not None:
                last += 1
        last = self.site.share([last])[0]
        for round_ in range(start + 1, last + 1):
            manifest, average = self._read_round(index, round_, _padded_numel(fragment, self.engine), {})
            self._apply_round(fragment, manifest, average, torch.zeros(0), 0)

    def _check_job(self) -> None:
        """Refuse, naming each field, a site whose settings, model or shape differ from the job's; the first site
        writes the job record."""
        engine, config = self.engine, self.config
        if self.site.leader:
            check_create_if_absent(self.bounded, f"probes/{config.site}-{self.board.incarnation}")
        mine = {
            "settings": config.shared_settings(), "fingerprint": config.fingerprint(),
            "model": model_description(engine), "shards": self.site.size,
            "sharding": "fsdp" if engine.sharded_model else "replicated",
        }  # fmt: skip
        job = self.board.read_job()
        if job is None and self.site.leader:
            job = self.board.create_job({**mine, "job_id": secrets.token_hex(8), "created": time.time()})
        self.site.barrier()
        job = job or self.board.read_job()
        if job is None:
            raise OuterSyncError(f"the store {self.bounded.url} holds no job record after this site's leader wrote it")
        check_same_published(mine, job, f"The store job at {self.bounded.url} runs",
                             "start this site with the job's config (hf-diloco configs, or the first site's YAML)",
                             theirs="the job", ours="this site")  # fmt: skip
        for key, what in (("model", "model"), ("shards", "ranks per site"), ("sharding", "sharding")):
            if job.get(key) != mine[key]:
                raise SettingsMismatchError(
                    f"The store job at {self.bounded.url} trains another {what} than this site: the job's is "
                    f"{_short(job.get(key))}, this site's {_short(mine[key])}. Start this site with the job's model and "
                    "launch (pipeline_stages x data_parallel_per_worker ranks, FSDP or not), or use another store_url "
                    "for another job."
                )
        self.board.job_id = str(job["job_id"])


def snapshot_bytes(fragment: Fragment, guard: DivergenceGuard, round_: int) -> bytes:
    """The safetensors bytes of this rank's share of θg and the fragment's outer state after `round_`."""
    tensors = {"theta_g": fragment.theta_g.detach().cpu().clone()}
    state = fragment.outer_optimizer.state.get(fragment.theta_g, {})
    if torch.is_tensor(state.get("momentum_buffer")):
        tensors["momentum_buffer"] = state["momentum_buffer"].detach().cpu().clone()
    metadata = {
        "round": str(round_),
        "outer_state": json.dumps({k: v for k, v in state.items() if not torch.is_tensor(v)}),
        "guard": json.dumps({
            "scales": guard.scales.get(fragment.index, []),
            "skipped_in_a_row": guard.skipped_in_a_row.get(fragment.index, 0),
        }),
    }  # fmt: skip
    return to_safetensors(tensors, metadata)


def load_snapshot(fragment: Fragment, guard: DivergenceGuard, payload: memoryview) -> None:
    """θg and the outer optimizer state of this rank's share, and the fragment's guard history, from a snapshot."""
    tensors, metadata = from_safetensors(payload, {"theta_g": fragment.theta_g.numel()})
    fragment.theta_g.copy_(tensors["theta_g"].reshape(fragment.theta_g.shape))
    state = {k: v for k, v in json.loads(metadata.get("outer_state", "{}")).items()}
    if "momentum_buffer" in tensors:
        state["momentum_buffer"] = (
            tensors["momentum_buffer"].to(fragment.theta_g.device).reshape(fragment.theta_g.shape)
        )
    fragment.outer_optimizer.state.pop(fragment.theta_g, None)
    if state:
        fragment.outer_optimizer.state[fragment.theta_g] = state
    history = json.loads(metadata.get("guard", "{}"))
    guard.scales[fragment.index] = [float(s) for s in history.get("scales", [])]
    guard.skipped_in_a_row[fragment.index] = int(history.get("skipped_in_a_row", 0))


def model_description(engine: StoreEngine) -> str:
    """The fragments' pieces and sizes this rank holds: what every site's same rank must hold alike."""
    return ";".join(
        f"{fragment.index}:"
        + ",".join(f"{piece.name}[{piece.start}:{piece.stop}]" for piece in fragment.pieces)
        + f"={fragment.theta_g.numel()}"
        for fragment in engine.fragments
    )


def _padded_numel(fragment: Fragment, engine: StoreEngine) -> int:
    align = engine.exchange.codec.align
    return max(1, math.ceil(fragment.theta_g.numel() / align)) * align


def _padded(values: torch.Tensor, align: int) -> torch.Tensor:
    padded_numel = max(1, math.ceil(values.numel() / align)) * align
    if padded_numel == values.numel():
        return values
    padded = torch.zeros(padded_numel, dtype=torch.float32)
    padded[: values.numel()].copy_(values)
    return padded


def _short(value: object, limit: int = 160) -> str:
    text = str(value)
    return text if len(text) <= limit else text[:limit] + "..."


def contributions_of(manifests: Sequence[Manifest]) -> list[Contribution]:
    """Every contribution the manifests apply (tests and the replaying reference read them)."""
    return [entry.contribution for manifest in manifests for entry in manifest.entries]
