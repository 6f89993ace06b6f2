"""Who is inside an elastic job: the check every group torchft forms passes before any payload crosses it.

torchft's Lighthouse admits any process that reaches it, and puts it in the next quorum: a stranger would take part in
the exchange (its numbers summed into θg; under `reduce_scatter` it would even average a chunk for everyone) and
could ask a site for its state. So each member proves, in every group, that it holds the job's secret: the members
all-gather a fresh random nonce each, then a record (its commit count, whether a heal from the group was refused,
a mark of its θg, its store's address) with the HMAC-SHA256, under a key derived from the secret, of the record, its
rank, its replica id and every nonce. A tag cannot be computed without the secret, nor replayed from another group
(the nonces are fresh, the rank and the id are bound). A member whose tag does not verify is refused and named, and
the exchange runs among the members that verify, in a gloo group of their own (`subgroup`), rendezvoused in the
store of the first of them under a name only the secret gives: nothing the stranger sends is summed, and nothing of
θg is sent to it. The records also carry the mark of θg, so that members holding different θg (two sites that
trained apart and meet again, or two that could not heal from a stranger) are made equal (`heal_source`) before any
exchange, instead of averaging pseudo-gradients of different models.

Under `insecure_no_secret` the key is one everybody knows: the check still finds members that hold different θg,
and authenticates nobody.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import io
import logging
import os
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..core.membership.membership import RoundView
from ..core.settings.secret import SECRET_FILE_VARIABLE, SECRET_VARIABLE

logger = logging.getLogger(__name__)

NONCE_BYTES = 16
TAG_BYTES = 32
STORE_BYTES = 64  # a store's "host:port", padded
_RECORD = struct.Struct(f"<qB32s{STORE_BYTES}s")  # commit count, flags, θg mark, store address
RECORD_BYTES = _RECORD.size + TAG_BYTES
_INSECURE = b"hf_diloco: no secret (insecure_no_secret)"


class SecretMismatch(RuntimeError):
    """A worker that never met a member of its job finds most of its group unable to prove its secret: its own secret
    is most likely not the job's."""


def members_key(secret: bytes | None) -> bytes:
    """The key members prove the secret with (a public one without a secret: `insecure_no_secret`)."""
    return hmac.new(secret if secret is not None else _INSECURE, b"hf_diloco elastic members v1", "sha256").digest()


def theta_mark(key: bytes, digest: bytes) -> bytes:
    """What a record says of θg: a keyed hash of its digest, equal for equal θg and telling a stranger nothing."""
    return hmac.new(key, b"theta\0" + digest, hashlib.sha256).digest()


def proof(key: bytes, text: str) -> str:
    """The job's proof of `text` (e.g. the settings a site publishes for joiners)."""
    return hmac.new(key, b"text\0" + text.encode(), hashlib.sha256).hexdigest()


@dataclass(frozen=True)
class Member:
    """One member of a group as its record says.

    Attributes:
        rank: its rank in torchft's group.
        name: its replica id (without torchft's suffix).
        progress: its commit count (torchft's step) once the group formed.
        refused_heal: its site refused the state a member served for a heal in this group (not signed with the
            job's secret, or not served to it): it holds its own state, not the job's.
        mark: `theta_mark` of its θg.
        store: its store's address, `host:port`.
        verified: its tag verified under this worker's key.
    """

    rank: int
    name: str
    progress: int
    refused_heal: bool
    mark: bytes
    store: str
    verified: bool


def check_members(
    group: dist.ProcessGroup, rank: int, names: list[str], key: bytes, progress: int, refused_heal: bool,
    mark: bytes, store: str,
) -> tuple[list[Member], str]:  # fmt: skip
    """Every member's record, checked against `key`, and a name of this check no other shares (from the nonces): two
    all-gathers over `group` (16 and `RECORD_BYTES` bytes per member). `names`: the quorum's replica ids by rank."""
    size = len(names)
    nonces = b"".join(_all_gather(group, size, os.urandom(NONCE_BYTES)))
    address = store.encode()[:STORE_BYTES]
    body = _RECORD.pack(progress, int(refused_heal), mark, address)
    rows = _all_gather(group, size, body + _tag(key, rank, names[rank], nonces, body))
    members = []
    for index, row in enumerate(rows):
        record, tag = row[: _RECORD.size], row[_RECORD.size :]
        verified = hmac.compare_digest(tag, _tag(key, index, names[index], nonces, record))
        count, flags, their_mark, their_store = _RECORD.unpack(record)
        members.append(
            Member(
                index, names[index].split(":")[0], count, bool(flags & 1), their_mark,
                their_store.rstrip(b"\0").decode(errors="replace"), verified,
            )
        )  # fmt: skip
    return members, hashlib.sha256(nonces).hexdigest()[:32]


def heal_source(members: list[Member]) -> tuple[Member, list[Member]]:
    """Among verified `members`, whose state the group takes, and who must take it: the source is a member that
    did not refuse a heal (it holds the job's state) at the highest commit count, the first by rank on a tie; a
    member takes its state when it refused a heal or its θg differs. Every member computes the same from the same
    records."""
    holders = [member for member in members if not member.refused_heal] or members
    source = max(holders, key=lambda member: (member.progress, -member.rank))
    takers = [member for member in members if member.refused_heal or member.mark != source.mark]
    return source, takers


def subgroup(
    members: list[Member], rank: int, key: bytes, label: str, timeout: timedelta
) -> tuple[dist.ProcessGroup, int]:
    """A gloo group of `members` (the verified ones, by rank) and this worker's rank in it, rendezvoused in the store
    of the first of them under a name derived from the key (a stranger cannot read or write its keys)."""
    from torch._C._distributed_c10d import ProcessGroup, ProcessGroupGloo

    first = members[0].store
    host, _, port = first.rpartition(":")
    client = dist.TCPStore(host.strip("[]"), int(port), is_master=False, timeout=timeout)
    name = hmac.new(key, f"subgroup\0{label}".encode(), hashlib.sha256).hexdigest()[:32]
    store = dist.PrefixStore(f"hf_diloco/members/{name}", client)
    mine = [member.rank for member in members].index(rank)
    group = ProcessGroup(store, mine, len(members))
    group._set_default_backend(ProcessGroup.BackendType.GLOO)
    backend = ProcessGroupGloo(store, mine, len(members), timeout)
    backend._set_sequence_number_for_group()
    group._register_backend(torch.device("cpu"), ProcessGroup.BackendType.GLOO, backend)
    return group, mine


def share_state(group: dist.ProcessGroup, source: int, rank: int, state: dict | None) -> bytes:
    """Broadcast the serialised `state` (given on the `source` rank) over `group`: its bytes on every rank."""
    from torch.distributed._serialization import _streaming_save

    payload = b""
    if rank == source:
        buffer = io.BytesIO()
        _streaming_save(state, buffer)
        payload = buffer.getvalue()
    length = torch.tensor([len(payload)], dtype=torch.int64)
    dist.broadcast(length, group=group, group_src=source)
    data = (
        torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        if payload
        else torch.empty(int(length), dtype=torch.uint8)
    )
    dist.broadcast(data, group=group, group_src=source)
    return data.numpy().tobytes()


def _tag(key: bytes, rank: int, name: str, nonces: bytes, record: bytes) -> bytes:
    message = b"member\0" + str(rank).encode() + b"\0" + name.encode() + b"\0" + nonces + record
    return hmac.new(key, message, hashlib.sha256).digest()


def _all_gather(group: dist.ProcessGroup, size: int, mine: bytes) -> list[bytes]:
    tensor = torch.frombuffer(bytearray(mine), dtype=torch.uint8)
    parts = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(parts, tensor, group=group)
    return [part.numpy().tobytes() for part in parts]


class MemberCheck:
    """The check of every group a `TorchftMembership` forms (the module docstring), with what it learned: the
    processes refused so far and whether this worker has met a member.

    Args:
        membership: the worker's membership (its Manager, site collectives, state callbacks and heal record).
        key: `members_key` of the job's secret.
        load: reads a served state safely (`torchft_membership.load_heal_state`).
    """

    def __init__(self, membership: Any, key: bytes, load: Callable[[io.BytesIO, str], object]):
        self.membership, self.key, self.load = membership, key, load
        self.refused: dict[str, int] = {}  # name -> groups it was refused in
        self.met_a_member = False  # this worker has been in a group with another verified member
        self.subgroup: dist.ProcessGroup | None = None

    def members_only(self, view: RoundView) -> RoundView:
        """The group of the members that prove the job's secret, every one of them holding the same θg: strangers
        are refused and named before any payload, and a member whose θg differs from the others' (or that refused a
        heal from a stranger) takes a member's state first."""
        ship = self.membership
        heal = ship._heal
        # A site's ranks decide alike: each flag from any rank.
        refused_heal, alone = ship._site_any("stranger" in heal, view.group is None or view.size <= 1)
        if alone:
            return view
        names = list(heal.get("replica_ids", []))
        started = time.perf_counter()
        host, port = ship._store_address
        store = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        members, failure = None, None
        try:
            members, label = check_members(
                view.group, view.rank, names, self.key, ship.manager.current_step(), refused_heal, self._site_mark(),
                store,
            )  # fmt: skip
        except RuntimeError as error:  # a member lost or silent during the check: asked again
            failure = error
        if ship._site_any(members is None)[0]:
            ship.manager.report_error(failure or RuntimeError("another rank of this site could not check its group"))
            return view
        verified = self._site_all([member.verified for member in members])
        inside = [member for member, ok in zip(members, verified) if ok]
        strangers = tuple(member.name for member, ok in zip(members, verified) if not ok)
        if strangers:
            self._refuse(strangers, len(inside), len(members))
        self.met_a_member = self.met_a_member or len(inside) > 1
        group, rank = view.group, view.rank
        if strangers and len(inside) > 1:
            timeout = timedelta(seconds=ship._timeouts[0])
            self.subgroup, rank = subgroup(inside, view.rank, self.key, f"{label}/{ship.site_rank}", timeout)
            group = self.subgroup
        elif strangers:
            group, rank = None, 0
        view = RoundView(
            group, rank, len(inside), view.healed, view.heal_bytes, view.heal_seconds,
            tuple(member.name for member in inside), strangers,
        )  # fmt: skip
        return self._same_state(view, inside, started) if len(inside) > 1 else view

    def _refuse(self, strangers: tuple[str, ...], inside: int, size: int) -> None:
        ship = self.membership
        for name in strangers:
            self.refused[name] = self.refused.get(name, 0) + 1
        ship.earlier_members = [name for name in ship.earlier_members if name not in strangers]
        if not self.met_a_member and 2 * inside < size:
            raise SecretMismatch(
                f"This worker could not verify {len(strangers)} of the {size - 1} other members of its group "
                f"({', '.join(strangers)}): they do not prove this worker's secret. Most likely this worker holds "
                f"another secret than the job's: give it the job's secret ({SECRET_FILE_VARIABLE} or "
                f"{SECRET_VARIABLE}), the same on every site; if those are not the job's sites, stop them."
            )
        one = len(strangers) == 1
        logger.warning(
            "refused %s in this group: %s not prove the job's secret, so nothing is exchanged with %s and the "
            "exchange runs among the %d member(s) that do",
            ", ".join(strangers),
            "it does" if one else "they do",
            "it" if one else "them",
            inside,
        )

    def _same_state(self, view: RoundView, inside: list[Member], started: float) -> RoundView:
        """Make every member of `inside` hold the same θg: when one refused a heal or holds other θg, the group
        takes `heal_source`'s state, broadcast over the group (a heal among members)."""
        ship = self.membership
        source, takers = heal_source(inside)
        if not takers:
            return view
        me = inside[view.rank]
        differ = [member.name for member in takers if not member.refused_heal]
        if differ:
            logger.warning(
                "the global model of %s differs from %s's (they trained apart, or started from states of their own): "
                "%s take %s's state",
                ", ".join(differ),
                source.name,
                ", ".join(differ),
                source.name,
            )
        payload, failure = None, None
        try:
            payload = share_state(
                view.group, inside.index(source), view.rank, ship._state_dict() if me == source else None
            )
        except RuntimeError as error:
            failure = error
        failed, takes = ship._site_any(payload is None, me in takers)
        if failed:
            ship.manager.report_error(failure or RuntimeError("another rank of this site could not share the state"))
            return view
        if not takes:
            return view
        ship._load_state_dict(self.load(io.BytesIO(payload), f"the member {source.name}"))
        ship.manager.load_state_dict({"step": source.progress, "batches_committed": ship.manager.batches_committed()})
        ship._heal.pop("stranger", None)
        seconds = time.perf_counter() - started
        return dataclasses.replace(view, healed=True, heal_bytes=view.heal_bytes + len(payload), heal_seconds=seconds)

    def _site_mark(self) -> bytes:
        """`theta_mark` of this site's θg: every rank's digest (its share), the same on every rank of the site."""
        ship = self.membership
        digest = ship._digest() if ship._digest is not None else b""
        if ship.site_size > 1:
            mine = torch.frombuffer(bytearray(hashlib.sha256(digest).digest()), dtype=torch.uint8)
            parts = [torch.empty_like(mine) for _ in range(ship.site_size)]
            dist.all_gather(parts, mine, group=ship._site_group)
            digest = b"".join(part.numpy().tobytes() for part in parts)
        return theta_mark(self.key, digest)

    def _site_all(self, flags: list[bool]) -> list[bool]:
        """Each flag: whether it holds on every rank of the site."""
        ship = self.membership
        if ship.site_size == 1:
            return flags
        values = torch.tensor([int(flag) for flag in flags], dtype=torch.int64)
        dist.all_reduce(values, op=dist.ReduceOp.MIN, group=ship._site_group)
        return [bool(value) for value in values.tolist()]
