"""Joining a store job without anyone's help, and the snapshots that make it possible.

A site that starts reads the job record (the first site writes it, create-if-absent) and is refused, naming the field,
when its settings, model or shape differ, before it writes anything. It then loads, per fragment, the latest complete
snapshot of θg and the outer state and replays every round decided after it; a fresh job's first site writes round
0's snapshot (every site then starts from those same bits). The site that closed a round whose number is a multiple
of `snapshot_every` writes the snapshot after it (copies taken on the training thread, written on the store thread),
and its leader then removes what nobody needs any more: rounds before the older of the two newest snapshots and of
every live site's position (its heartbeat), less the staleness window.
"""

from __future__ import annotations

import functools
import json
import secrets
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from ..exchange.pending import OuterSyncError, SerialWorker
from ..rounds.fragment import Fragment
from ..settings.settings_check import check_same_published
from .board import RoundBoard, SettingsMismatchError
from .objects import BoundedStore, check_create_if_absent
from .segments import describe_difference, overlaps
from .site import SiteGroup
from .tensors import from_safetensors, to_safetensors

if TYPE_CHECKING:
    from ..rounds.rounds import DivergenceGuard
    from ..settings.config import DiLoCoConfig


def check_job(config: DiLoCoConfig, board: RoundBoard, site: SiteGroup, bounded: BoundedStore, mine: dict) -> None:
    """Refuse, naming each field or the first parameter that differs, a site whose settings or model (`mine`:
    `settings`, `fingerprint`, `model`: the site's `segments.model_map`) differ from the job's; the first site writes
    the job record. Sites may differ in shape (ranks, stages, sharding). Sets the board's job id."""
    if site.leader:
        check_create_if_absent(bounded, f"probes/{config.site}-{board.incarnation}")
    job = board.read_job()
    if job is None and site.leader:
        job = board.create_job({**mine, "job_id": secrets.token_hex(8), "created": time.time()})
    site.barrier()
    job = job or board.read_job()
    if job is None:
        raise OuterSyncError(f"the store {bounded.url} holds no job record after this site's leader wrote it")
    shape = ("pipeline_stages", "data_parallel_per_worker")
    theirs = {"settings": {k: v for k, v in job["settings"].items() if k not in shape}, "fingerprint": ""}
    ours = {"settings": {k: v for k, v in mine["settings"].items() if k not in shape}, "fingerprint": ""}
    check_same_published(ours, theirs, f"The store job at {bounded.url} runs",
                         "start this site with the job's config (the first site's YAML)",
                         theirs="the job", ours="this site")  # fmt: skip
    if job["model"] != mine["model"]:
        raise SettingsMismatchError(
            f"The store job at {bounded.url} trains another model than this site: "
            f"{describe_difference(job['model'], mine['model'])}. Start this site with the job's model config (and "
            "fragment settings), or use another store_url for another job."
        )
    board.job_id = str(job["job_id"])


class Snapshots:
    """Writing, finding and loading the snapshots of one rank's shares.

    Args:
        config, board, site: the run's settings, the store job, the site's ranks.
        guard: the engine's divergence guard (its history of each fragment travels with the snapshot).
        thread: the store thread, on which snapshots are written in launch order.
        segments: this rank's share of each fragment by parameter name and range (`segments.py`).
    """

    def __init__(self, config: DiLoCoConfig, board: RoundBoard, site: SiteGroup, guard: DivergenceGuard,
                 thread: SerialWorker, segments: dict[int, list]):  # fmt: skip
        self.config, self.board, self.site, self.guard, self.thread = config, board, site, guard, thread
        self.segments = segments

    def write_later(self, fragment: Fragment, round_: int) -> None:
        """Write θg and the outer state after `round_` from the store thread (copies: training goes on)."""
        payload = snapshot_bytes(fragment, self.guard, round_)
        self.thread.submit(functools.partial(self._write, fragment.index, round_, payload))

    def load_latest(self, fragment: Fragment) -> int:
        """Load the fragment's latest complete snapshot (round 0's, written now, for a fresh job); its round."""
        index = fragment.index
        latest = self.board.snapshot_rounds(index) if self.site.leader else []
        start = self.site.share([latest[-1] if latest else -1])[0]
        if start < 0:  # a fresh job: every site offers its θg, the first marked is the job's
            self._write(index, 0, snapshot_bytes(fragment, self.guard, 0), clean=False)
            self.site.barrier()
            start = 0
        writer = self.board.snapshot_shares(index, start)
        mine = self.segments[index]
        parts = []
        for shard, share in enumerate(writer["shares"]):
            pairs = overlaps(mine, share["segments"])
            if pairs:
                parts.append((pairs, self.board.read_snapshot(index, start, writer, shard)))
        load_snapshot(fragment, self.guard, parts)
        return start

    def _write(self, index: int, round_: int, payload: bytes, clean: bool = True) -> None:
        share = self.board.put_snapshot(index, round_, payload, self.segments[index])
        shares = [json.loads(text) for text in self.site.gather_text(json.dumps(share))]
        if self.site.leader:
            self.board.mark_snapshot(index, round_, shares)
            if clean:
                self._clean(index, round_)

    def _clean(self, index: int, snapshot_round: int) -> None:
        snapshots = self.board.snapshot_rounds(index)
        keep_snapshot = snapshots[-2] if len(snapshots) > 1 else snapshot_round
        live = self.board.live_sites(self.config.round_deadline_seconds * 3 + self.config.store_timeout_seconds)
        positions = [applied.get(index, 0) for applied in live.values()]
        keep_from = min([keep_snapshot, *positions]) - self.config.max_staleness
        if keep_from > 0:
            self.board.delete_before(index, keep_from, keep_snapshot)


def replay_after(board: RoundBoard, site: SiteGroup, index: int, start: int, apply: Callable[[int], None]) -> int:
    """Apply (`apply(round)`) every round of fragment `index` decided after `start`, the leader counting them for
    the whole site; the last one."""
    last = start
    if site.leader:
        while board.manifest(index, last + 1) is not None:
            last += 1
    last = site.share([last])[0]
    for round_ in range(start + 1, last + 1):
        apply(round_)
    return last


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


def load_snapshot(fragment: Fragment, guard: DivergenceGuard, parts: list[tuple[list, memoryview]]) -> None:
    """θg and the outer optimizer state of this rank's share, and the fragment's guard history, from the snapshot's
    shares that overlap it (`parts`: the overlaps and the share's payload), whatever shape of site wrote them."""
    theta = fragment.theta_g
    momentum = torch.zeros_like(theta)
    state: dict = {}
    history: dict = {}
    for pairs, payload in parts:
        tensors, metadata = from_safetensors(payload)
        for position, their_position, size in pairs:
            theta[position : position + size] = tensors["theta_g"][their_position : their_position + size]
            if "momentum_buffer" in tensors:
                momentum[position : position + size] = tensors["momentum_buffer"][
                    their_position : their_position + size
                ]
        state = dict(json.loads(metadata.get("outer_state", "{}")))
        history = json.loads(metadata.get("guard", "{}"))
        if "momentum_buffer" in tensors:
            state["momentum_buffer"] = momentum
    fragment.outer_optimizer.state.pop(theta, None)
    if state:
        fragment.outer_optimizer.state[theta] = state
    guard.scales[fragment.index] = [float(scale) for scale in history.get("scales", [])]
    guard.skipped_in_a_row[fragment.index] = int(history.get("skipped_in_a_row", 0))
