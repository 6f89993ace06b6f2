"""A launch's work on the store thread: upload this rank's share, let the site's leader settle the rounds to apply
(closing one when its rule says so), and average this rank's share of each.

Every rank of a site runs the same jobs in launch order; the leader writes the site's record once every rank's share
is written (their hashes gathered in the site's group) and tells the others the last round to apply, so that every
rank applies the same rounds. The average of a round sums, in the manifest's order, each contribution decoded and
multiplied by its weight in fp32, every product rounded before the sum (no fused multiply-add): the same operations on
the same bytes give the same bits on every site.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..exchange.pending import OuterSyncError
from .board import RoundBoard
from .manifest import ClosingRule, Manifest, weigh
from .objects import StoreUnreachableError
from .segments import overlaps
from .site import SiteGroup

if TYPE_CHECKING:
    from ..compression.codecs import Codec
    from ..settings.config import DiLoCoConfig
    from .objects import BoundedStore


@dataclass
class Settled:
    """What the store thread hands the training thread for one launch: every round to apply, in order, with this
    rank's share of its average (None: a round with nothing to average); the residual of this rank's encode; the
    bytes up and down; how long the leader waited for the first round to be decided."""

    rounds: list[tuple[Manifest, torch.Tensor | None]]
    residual: torch.Tensor | None
    bytes_up: int
    bytes_down: int
    wait_seconds: float


class RoundSettler:
    """The store thread's side of `StoreRounds`.

    Args:
        config: the run's settings (site, quorum, staleness, clipping, error feedback).
        board, site, bounded: the store job as this rank reads and writes it, its site's ranks, the store's counters.
        codec: encodes and decodes shares (the exchange's), with `pool`'s threads.
        applied: per fragment, the contributions of the rounds applied last (a later round must not apply them
            again); `positions`: the rounds applied, for the heartbeat; `segments`: this rank's share of each
            fragment by parameter name and range.
    """

    def __init__(
        self,
        config: DiLoCoConfig,
        board: RoundBoard,
        site: SiteGroup,
        bounded: BoundedStore,
        codec: Callable[[], tuple[Codec, object]],
        applied: Callable[[int], set],
        positions: Callable[[], dict[int, int]],
        segments: dict[int, list],
    ):
        self.config, self.board, self.site, self.bounded = config, board, site, bounded
        self.codec = codec
        self.applied = applied
        self.positions = positions
        self.segments = segments
        self.rule = ClosingRule(config.quorum, config.grace_seconds, config.round_deadline_seconds,
                                config.adaptive_grace)  # fmt: skip

    def contribute(self, index: int, sent: torch.Tensor, base: int, tokens: float, final: bool) -> Settled:
        """Upload this rank's share of `sent` (trained from round `base`), then settle and average the rounds."""
        codec, pool = self.codec()
        up, down = self.bounded.bytes_up, self.bounded.bytes_down
        padded = padded_to(sent, codec.align)
        payload = codec.encode(padded, pool)
        residual = None
        if self.config.error_feedback:
            residual = torch.sub(padded, codec.decode(payload, padded.numel(), pool=pool))[: sent.numel()].clone()
        own = bytes(payload.numpy())
        failure: Exception | None = None
        share = "!"  # what a rank that lost the store tells the others, so that the whole site stops together
        try:
            sha = self.board.put_share(index, base, own, self.segments[index], codec.name)
            share = json.dumps({"sha256": sha, "segments": self.segments[index]})
        except StoreUnreachableError as error:
            failure = error
        texts = self.site.gather_text(share)
        self._stop_with_the_site("!" in texts, failure)
        shares = [json.loads(text) for text in texts]
        norm = math.sqrt(self.site.total(float(sent.double().pow(2).sum())))
        started = time.monotonic()
        last = -1
        if self.site.leader:
            try:
                self.board.put_record(index, base, tokens, shares, final=final, norm=norm)
                self.board.beat(self.positions())
                last = self.settle(index, base, final)
            except StoreUnreachableError as error:
                failure = error
        last = self.site.share([last])[0]
        self._stop_with_the_site(last < 0, failure)
        waited = time.monotonic() - started
        own_share = {(self.config.site, self.board.incarnation, base, self.site.index): own}
        rounds = []
        try:
            rounds = [self.read_round(index, r, own_share) for r in range(base + 1, last + 1)]
        except StoreUnreachableError as error:
            failure = error
        self._stop_with_the_site(self.site.total(float(failure is not None)) > 0, failure)
        return Settled(rounds, residual, self.bounded.bytes_up - up, self.bounded.bytes_down - down, waited)

    def _stop_with_the_site(self, stopped: bool, failure: Exception | None) -> None:
        """Raise on every rank of the site when any of them lost the store (its own error where it has one)."""
        if stopped:
            raise failure or StoreUnreachableError(
                f"another rank of site {self.config.site} lost the store {self.bounded.url}: see its error"
            )

    def settle(self, index: int, base: int, final: bool) -> int:
        """(The leader.) The last round to apply now: the first round after `base` once decided (closing it when its
        rule says so), then every round decided after it; with `final`, up to the fragment's final round."""
        target, last = base + 1, base
        idents = self.applied(index)
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
            # A tail waits for the final round however many rounds were decided while it waited.
            oldest = (min(base, target - 1) if final else target - 1) - self.config.max_staleness
            pending = [
                c for c in self.board.contributions(index, range(oldest, target), final) if c.ident not in idents
            ]
            now = time.monotonic()
            sites = {c.site for c in pending}
            for contribution in pending:
                if contribution.ident not in seen and quorum_at is not None:
                    self.rule.observe(now - quorum_at)
                seen.add(contribution.ident)
            if quorum_at is None and len(sites) >= self.config.quorum:
                quorum_at = now
            since_quorum = None if quorum_at is None else now - quorum_at
            if self.rule.due(len(sites), since_quorum, now - waiting_since) or (
                final and now - waiting_since >= self.config.round_deadline_seconds
            ):
                staleness = target if final else self.config.max_staleness  # the final round takes every tail
                entries = weigh(pending, target, staleness, self.config.robust_clip_factor)
                self.board.decide(Manifest(
                    index, target, self.config.site, entries, final=final,
                    quorum_met=len(sites) >= self.config.quorum, waited_seconds=now - waiting_since,
                ))  # fmt: skip
                continue
            time.sleep(min(1.0, max(0.05, self.rule.grace() / 4)))
        if not final:  # rounds other sites decided since: a site behind catches up at once
            while (manifest := self.board.manifest(index, last + 1)) is not None:
                last += 1
                if manifest.final:
                    break
        return last

    def read_round(self, index: int, round_: int, own: dict | None = None) -> tuple[Manifest, torch.Tensor | None]:
        """Round `round_`'s manifest and this rank's share of its weighted average (None: nothing to average); `own`
        maps this rank's own share of a contribution (site, incarnation, base, shard) to its payload, not read back.

        Each contribution's values of this rank's segments come from whichever of its shares hold them (a site of
        another shape cuts the fragment otherwise, `segments.py`)."""
        manifest = self.board.manifest(index, round_)
        if manifest is None:
            raise OuterSyncError(f"round {round_} of fragment {index} was decided but its manifest cannot be read")
        if not manifest.entries:
            return manifest, None
        codec, pool = self.codec()
        mine = self.segments[index]
        numel = sum(length for _, _, length in mine)
        total = torch.zeros(numel, dtype=torch.float32)
        part = torch.empty(numel, dtype=torch.float32)
        for entry in manifest.entries:  # in the manifest's order: every site sums the same way, bit for bit
            c = entry.contribution
            held = 0
            for shard, share in enumerate(self.board.shares_of(index, c)):
                pairs = overlaps(mine, share["segments"])
                if not pairs:
                    continue
                length = padded_numel(sum(size for _, _, size in share["segments"]), codec.align)
                payload = (own or {}).get((*c.ident, shard))
                if payload is None:
                    payload = self.board.fetch_share(index, c, shard, share, codec.encoded_nbytes(length))
                decoded = codec.decode(torch.frombuffer(bytearray(payload), dtype=torch.uint8), length, pool=pool)
                for position, their_position, size in pairs:
                    part[position : position + size] = decoded[their_position : their_position + size]
                    held += size
            if held != numel:
                raise OuterSyncError(
                    f"round {round_} of fragment {index}: site {c.site}'s contribution holds {held} of this rank's "
                    f"{numel} values (its model is cut otherwise; the job record should have refused it)"
                )
            total.add_(part.mul_(entry.weight))
        return manifest, total


def padded_numel(numel: int, align: int) -> int:
    """A share's length padded to whole codec blocks."""
    return max(1, math.ceil(numel / align)) * align


def padded_to(values: torch.Tensor, align: int) -> torch.Tensor:
    """`values` followed by zeros up to whole codec blocks (itself when it is already)."""
    padded = padded_numel(values.numel(), align)
    if padded == values.numel():
        return values
    out = torch.zeros(padded, dtype=torch.float32)
    out[: values.numel()].copy_(values)
    return out
