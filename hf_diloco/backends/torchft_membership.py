"""`Membership` through torchft: a Lighthouse forms a quorum for every exchange, a Manager rebuilds the gloo group
of its members and heals a worker that is behind from a live peer (over HTTP, no shared file system).

Install with `pip install "hf_diloco[elastic]"` (torchft 0.2.0). Start one Lighthouse on a stable host that every
worker reaches, on a private address (`torchft_lighthouse --min_replicas 1 --join_timeout_ms 60000 --bind
10.0.0.5:29510`); it is the job's single point of failure: if it dies, restart the job from its last checkpoint.

What a worker trusts: the state it heals from is loaded with `weights_only=True` (tensors and plain containers only;
anything else, a pickled object with a `__reduce__` included, is refused with `HealStateRefused` before it runs), and
its servers (rendezvous store, checkpoint server, Manager) listen on the address of `host` only (127.0.0.1 unless
named). The job's secret (`secret=`, or the file named by `HF_DILOCO_JOB_SECRET_FILE`, or `HF_DILOCO_JOB_SECRET`) is
required unless `insecure_no_secret`: a heal state is served only to a request that proves it and carries an
HMAC-SHA256 of its bytes and step, checked before the payload is read, and every group's members prove it before any
payload (`torchft_members.py`): a process without it is refused from the group, named, and nothing is exchanged with
it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import hmac
import io
import ipaddress
import json
import logging
import os
import pickle
import re
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

from ..core.membership.elastic import MinWorkersTimeout, check_published_settings, check_same_sharding
from ..core.membership.membership import DigestFn, LoadFn, RoundView, StateFn
from ..core.settings.secret import SECRET_FILE_VARIABLE, SECRET_VARIABLE, elastic_secret
from .torchft_members import MemberCheck, members_key, proof
from .torchft_members import SecretMismatch as SecretMismatch  # raised by `begin_round`, importable from here

logger = logging.getLogger(__name__)
# How long one quorum request waits before it is sent again (a Lighthouse restarted at the same address answers only
# requests made after it came back); `quorum_timeout` bounds them all.
QUORUM_ATTEMPT_SECONDS = 10.0
SETTINGS_KEY = "hf_diloco/settings"  # in each worker's own store: its DiLoCo settings, read by a joiner
PROOF_HEADER = "X-HF-DiLoCo-Proof"  # a heal request's proof of the job's secret (`heal_request_proof`)
LOOPBACK = "127.0.0.1"  # where a worker's servers listen unless `host` names the address other sites reach
os.environ.setdefault("RUST_LOG", "warn")  # torchft's Rust side logs every quorum at INFO otherwise


class HealStateRefused(RuntimeError):
    """The state a live peer served for a heal holds something other than tensors and plain containers."""


class DuplicateReplicaId(RuntimeError):
    """Two live workers joined the Lighthouse under the same `replica_id`."""


class QuorumTimeout(TimeoutError):
    """No quorum within `quorum_timeout`: the Lighthouse was lost, or too few workers reached it."""


class UnsignedHealState(HealStateRefused):
    """A state served for a heal that does not prove the job's secret (not signed with it, or not served to this
    worker at all): its source is not a member of the job. Not loaded; the member check decides what follows."""


REFUSED_STATE = {"hf_diloco_refused": 1}  # what torchft applies in place of a state that was refused


class TorchftMembership:
    """One worker of an elastic job (its `replica_id` names it to the Lighthouse): one process, or one rank of a site
    of several data-parallel ranks (`site_rank`, `site_size`, `site_group`).

    A site of D ranks is one member: its rank 0 runs the Manager's server, which asks the Lighthouse for one quorum
    on behalf of all D ranks, so every rank of the site sees the same members, step and heal; rank k exchanges over a
    group of the rank k of every member (the 1/D of each fragment it owns), heals from rank k of a live site, and the
    site commits a round only when all of its ranks can (torchft's `should_commit` is a vote of the D ranks).

    Args:
        lighthouse: the Lighthouse's address, `http://host:port`.
        replica_id: a name for this worker, unique in the job (a site or host name; a restarted worker may reuse
            it).
        min_workers: an exchange never runs with fewer workers: the worker waits for more to join, asking again
            every `poll_seconds`, and raises `MinWorkersTimeout` after `min_workers_timeout` seconds.
        start_workers: the first group waits (with the same bound) for this many workers, so that a job starts with
            its whole membership instead of healing late starters one by one.
        min_workers_timeout: the bound of those waits, in seconds.
        sync_timeout: the bound of one collective or state transfer, in seconds: a member silent for longer is
            dropped from the exchange (the engine retries among the others). The site's commit vote waits twice as
            long, since one of its ranks may reach it a whole `sync_timeout` after another.
        quorum_timeout: the bound of one quorum, in seconds; it must exceed the Lighthouse's `join_timeout_ms` and
            the time between two exchanges (a worker that joins waits at most that long for the others' next one).
        connect_timeout: the bound of reaching the Lighthouse and a peer's manager, in seconds.
        poll_seconds: the pause between two quorums while too few workers are present.
        host: the name or address the other workers reach this one at (its group's rendezvous store is announced
            under it); 127.0.0.1 by default, which only workers on this machine reach: name this machine's address
            on the sites' network for a job of several machines. The worker's store, checkpoint server and Manager
            listen on this address only (not on every interface).
        site_rank: this process's rank among the site's ranks (its worker's pipeline stages and data-parallel
            ranks, in the topology's order); rank k of a site exchanges with rank k of the others.
        site_size: the number of the site's ranks (every site of the job must have the same).
        site_group: a gloo group of the site's ranks (its rank 0 first), where rank 0 hands the others the site's
            store and the ranks agree whether to ask for a quorum again; None for a site of one process.
        secret: the job's shared secret (the same on every worker; never logged or saved): the state this worker
            serves for a heal is signed with it and the state it heals from must be. By default the contents of the
            file `$HF_DILOCO_JOB_SECRET_FILE`, else `$HF_DILOCO_JOB_SECRET`; none is refused with a `ValueError`
            unless `insecure_no_secret`.
        insecure_no_secret: run without a secret, on a network nobody else can reach: heals and members are then
            not authenticated.
    """

    def __init__(
        self,
        lighthouse: str,
        replica_id: str,
        min_workers: int = 1,
        start_workers: int = 1,
        min_workers_timeout: float = 300.0,
        sync_timeout: float = 60.0,
        quorum_timeout: float = 600.0,
        connect_timeout: float = 60.0,
        poll_seconds: float = 1.0,
        host: str | None = None,
        secret: str | bytes | None = None,
        site_rank: int = 0,
        site_size: int = 1,
        site_group: dist.ProcessGroup | None = None,
        insecure_no_secret: bool = False,
    ):
        if min_workers < 1 or start_workers < 1:
            raise ValueError(f"min_workers and start_workers must be at least 1; got {min_workers}, {start_workers}.")
        if not 0 <= site_rank < site_size or (site_size > 1 and site_group is None):
            raise ValueError(
                f"site_rank {site_rank} of site_size {site_size} (site_group {'set' if site_group else 'None'}): "
                "pass the rank in [0, site_size) of this process among its site's ranks, and with site_size > 1 a "
                "gloo group of those ranks."
            )
        self.site_rank, self.site_size, self._site_group = site_rank, site_size, site_group
        self.lighthouse, self.replica_id = lighthouse, replica_id
        self.min_workers, self.min_workers_timeout, self.poll_seconds = min_workers, min_workers_timeout, poll_seconds
        self._required = max(min_workers, start_workers)
        self._timeouts = (sync_timeout, quorum_timeout, connect_timeout)
        self._secret = elastic_secret(secret, insecure_no_secret)
        self._key = members_key(self._secret)
        self._members = MemberCheck(self, self._key, load_heal_state)
        self._digest: DigestFn | None = None
        self._state_dict: StateFn | None = None
        self.host = host or LOOPBACK
        self._store_address: tuple[str, int] = (self.host, 0)
        if not host and not _is_loopback(self.lighthouse):
            logger.warning(
                "the Lighthouse %s is not on this machine, but this worker's servers listen on %s, which only "
                "workers on this machine reach: set host (site_host) to the address the other sites reach this one at.",
                self.lighthouse,
                LOOPBACK,
            )
        self._heal: dict = {}
        self._load_state_dict: LoadFn | None = None
        self.manager = None
        self._pg = None
        self._store = None
        self._store_socket: socket.socket | None = None
        self.earlier_members: list[str] = []  # the Lighthouse's last quorum when this worker came (`bind`)

    def bind(self, state_dict: StateFn, load_state_dict: LoadFn, digest: DigestFn | None = None) -> None:
        """Join the job: the Manager starts heartbeating to the Lighthouse from here on. `digest`: bytes that equal
        on two workers exactly when the θg the next exchange uses does (compared in every group)."""
        from torchft import Manager, ProcessGroupGloo

        sync_timeout, quorum_timeout, connect_timeout = (timedelta(seconds=s) for s in self._timeouts)
        self._load_state_dict, self._state_dict, self._digest = load_state_dict, state_dict, digest
        members: list[tuple[str, str]] = []
        if self.site_rank == 0:
            # The site's own store, on its rank 0: the Lighthouse announces it to the other workers as the
            # rendezvous of the groups this site leads, under `host`; it listens on `host`'s address only (a socket
            # bound here and handed over: TCPStore itself would listen on every interface).
            self._store_socket = _listening_socket(self.host)
            self._store = dist.TCPStore(
                self.host,
                self._store_socket.getsockname()[1],
                is_master=True,
                wait_for_workers=False,
                master_listen_fd=self._store_socket.fileno(),
            )
            members = _last_quorum_members(self.lighthouse, min(connect_timeout.total_seconds(), 10.0))
            state = state_dict()
            mine, sharding = _settings_of(state), state.get("sharding", "replicated")
            # Before this worker's Manager heartbeats: from then on the Lighthouse waits for it, and the next
            # quorum includes it, so a refusal at its heal would cost the live workers a failed exchange and a
            # retry.
            self._check_live_settings(mine, sharding, [store for _, store in members])
            published = {**(mine or {}), "site_size": self.site_size, "sharding": sharding}
            text = json.dumps(published, sort_keys=True)
            self._store.set(SETTINGS_KEY, json.dumps({**published, "proof": proof(self._key, text)}))
        # Every rank of a site reads the same store and earlier members: its rank 0's.
        store_address, members = self._from_site_rank_zero(
            ((self.host, self._store.port if self._store else 0), members)
        )
        if self.site_rank > 0:
            self._store = dist.TCPStore(*store_address, is_master=False, timeout=connect_timeout)
        self._store_address = store_address
        self.earlier_members = sorted({replica.split(":")[0] for replica, _ in members})
        self._pg = _group_per_quorum_and_step(ProcessGroupGloo)(self._heal, timeout=sync_timeout)
        with _servers_bound_to(self.host):
            self.manager = Manager(
                pg=self._pg,
                load_state_dict=self._on_heal,
                state_dict=state_dict,
                min_replica_size=1,  # min_workers is enforced in begin_round, with a bound and a clear message
                use_async_quorum=False,  # heal before the exchange: the group's members all hold the same state
                timeout=sync_timeout,
                quorum_timeout=quorum_timeout,
                connect_timeout=connect_timeout,
                rank=self.site_rank,
                world_size=self.site_size,
                store_addr=store_address[0],
                store_port=store_address[1],
                lighthouse_addr=self.lighthouse,
                replica_id=self.replica_id,
                hostname=self.host,
                checkpoint_transport=_counting_http_transport(
                    sync_timeout, self._heal, self.host, self._secret, lambda: self.manager.batches_committed()
                ),
            )
        # The members of each quorum, for the duplicate-id check (torchft keeps them only in a local variable).
        self.manager._client = _RecordingClient(
            self.manager._client, self._heal, self.lighthouse, self._timeouts[1], self.host
        )

    def begin_round(self) -> RoundView:
        """Form the group of the next exchange; blocks, bounded by `min_workers_timeout`, while fewer than the
        required workers are present or the group could not be rebuilt (a peer lost meanwhile: asked again)."""
        deadline = time.monotonic() + self.min_workers_timeout
        required, self._required = self._required, self.min_workers
        view = healed = self._members.members_only(self._checked_quorum())
        while True:
            # A site's ranks ask again together (each may see its own group fail), and time out together.
            unready = view.size < required or self._error() is not None or (view.group is None and view.size > 1)
            unready, expired = self._site_any(unready, time.monotonic() > deadline)
            if not unready:
                break
            if expired:
                if view.size >= required:
                    raise MinWorkersTimeout(
                        f"could not form a group of the {view.size} workers present within "
                        f"min_workers_timeout={self.min_workers_timeout:g}s: {self._error() or 'no group was built'}. "
                        f"Every worker must reach the others under their host names (this one is {self.host!r}; "
                        "set `host` to an address the others reach)."
                    )
                refused = (
                    f" ({len(view.refused)} more refused: {', '.join(view.refused)} did not prove the job's secret)"
                    if view.refused
                    else ""
                )
                raise MinWorkersTimeout(
                    f"only {view.size} of the {required} workers required (min_workers={self.min_workers}) joined "
                    f"within min_workers_timeout={self.min_workers_timeout:g}s{refused}; start more workers against "
                    f"the Lighthouse {self.lighthouse}, or lower min_workers."
                )
            logger.warning("%d of %d workers present (%s); asking again", view.size, required, self._error() or "ok")
            time.sleep(self.poll_seconds)
            view = self._members.members_only(self._checked_quorum())
            healed = view if view.healed else healed
        # At a job's first group torchft heals each rank of a site from its own primary (rank k's is member k mod
        # M), so some ranks of a site may heal and others not: every rank then writes θg into the model alike.
        (site_healed,) = self._site_any(healed.healed)
        if site_healed and not view.healed:
            view = dataclasses.replace(
                view, healed=True, heal_bytes=healed.heal_bytes, heal_seconds=healed.heal_seconds
            )
        return view

    def _checked_quorum(self) -> RoundView:
        view = self._quorum()
        self._check_quorum()
        return view

    def _from_site_rank_zero(self, value: object) -> object:
        """Rank 0's `value` on every rank of the site (`value` itself for a site of one process)."""
        if self.site_size == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self._site_group, 0), group=self._site_group)
        return box[0]

    def _site_any(self, *flags: bool) -> tuple[bool, ...]:
        """Each flag: whether it holds on any rank of the site."""
        if self.site_size == 1:
            return flags
        values = torch.tensor([int(flag) for flag in flags], dtype=torch.int64)
        dist.all_reduce(values, op=dist.ReduceOp.MAX, group=self._site_group)
        return tuple(bool(value) for value in values.tolist())

    def _check_quorum(self) -> None:
        """Stop at a refused heal (its state is never loaded) or at a second live worker under this worker's id."""
        if "refused" in self._heal:
            raise HealStateRefused(self._heal["refused"])
        _check_duplicate_id(self._heal, self.replica_id, self.lighthouse)

    def _check_live_settings(self, mine: dict | None, sharding: str, stores: list[str]) -> None:
        timeout = min(self._timeouts[2], 10.0)
        check_live_settings(mine, sharding, stores, self.site_size, self.replica_id, self._key, timeout)

    def progress(self) -> int:
        """The job's committed rounds as torchft counts them (equal on every member after a commit): what a
        checkpoint stores, so that a resumed worker is behind, equal to or ahead of the others as its state is."""
        return self.manager.current_step()

    def resume_at(self, progress: int) -> None:
        """Count from a checkpoint's `progress`: at the next group whoever is behind heals from whoever is ahead."""
        self.manager.load_state_dict({"step": progress, "batches_committed": self.manager.batches_committed()})

    def report_error(self, error: Exception) -> None:
        self.manager.report_error(error)

    def end_round(self) -> bool:
        # The vote waits for every rank of the site. A rank whose peer died fails its exchange at once, while its
        # sibling, exchanging with a peer that is alive but silent, fails only at the collective's bound
        # (`sync_timeout`); the vote must outwait that lag, or the fast rank gives up on a sibling about to vote.
        return self.manager.should_commit(timeout=timedelta(seconds=2 * self._timeouts[0]))

    def close(self) -> None:
        if self.manager is not None:
            self.manager.shutdown(wait=False)
            self.manager = None

    def _quorum(self) -> RoundView:
        self._heal.clear()
        # Never shrink_only: a worker resumed after a hang, retrying its own round, would be left out of every
        # later quorum.
        self.manager.start_quorum(allow_heal=True, shrink_only=False)
        rank = self.manager.participating_rank()
        return RoundView(
            group=self._group(),
            rank=-1 if rank is None else rank,
            size=self.manager.num_participants(),
            healed="applied" in self._heal,
            heal_bytes=int(self._heal.get("bytes", 0)),
            heal_seconds=float(self._heal.get("seconds", 0.0)),
        )

    def _group(self) -> dist.ProcessGroup | None:
        """The quorum's gloo group, None when it could not be built (asked again by `begin_round`)."""
        if self._error() is not None:
            return None
        try:
            return self._pg.parent
        except AssertionError:  # torchft: "process group not initialized" after a failed configure
            return None

    @property
    def refused(self) -> dict[str, int]:
        """The processes refused from this worker's groups (they did not prove the job's secret), with the number of
        groups each was refused in."""
        return self._members.refused

    def _on_heal(self, state: dict) -> None:
        if isinstance(state, dict) and state.get("hf_diloco_refused"):  # the source is not a member: nothing loaded
            return
        self._heal["applied"] = True
        self._load_state_dict(state)

    def _error(self) -> str | None:
        error = self.manager.errored()
        return None if error is None else str(error.original_exception)


def check_live_settings(
    mine: dict | None, sharding: str, stores: list[str], site_size: int, replica_id: str, key: bytes, timeout: float
) -> None:
    """Refuse to join live workers that run with other DiLoCo settings (`ValueError` naming each field) or sites of
    another number of ranks or sharding: what a member of the Lighthouse's last quorum (its store in `stores`)
    published with the job's proof, read before this worker is a participant (settings without it, which a stranger
    could publish to keep joiners out, are not compared). Nothing to compare with (a fresh job, no member reachable):
    the heal's own check remains."""
    for address in stores:
        peer = _published_settings(address, timeout)
        if peer is None:
            continue
        claimed = peer.pop("proof", None)
        if not isinstance(claimed, str) or not hmac.compare_digest(
            claimed, proof(key, json.dumps(peer, sort_keys=True))
        ):
            logger.warning("the settings published at %s do not prove the job's secret: not compared", address)
            continue
        theirs = int(peer.get("site_size", 1))
        if theirs != site_size:
            raise ValueError(
                f"The live sites run {theirs} rank(s) each and this site {replica_id!r} {site_size}: rank k of a site "
                "exchanges with rank k of the others, so every site needs the same number. Launch this site with "
                f"{theirs} process(es) (torchrun --nproc_per_node {theirs}, pipeline_stages x data_parallel_per_worker "
                f"= {theirs})."
            )
        check_same_sharding(peer.get("sharding", "replicated"), sharding)
        if mine is not None and ("settings" in peer or "fingerprint" in peer):
            check_published_settings(mine, peer)
        return


def _check_duplicate_id(quorum: dict, replica_id: str, lighthouse: str) -> None:
    """Stop a worker that joined under the id of a live one (the later, which heals in `quorum`); the other logs it."""
    names = [replica.split(":")[0] for replica in quorum.get("replica_ids", [])]
    if names.count(replica_id) > 1:
        message = (
            f"two live workers joined the Lighthouse {lighthouse} as replica_id {replica_id!r}; give every worker its "
            "own replica_id (a restarted worker may reuse its own once the old process is gone)."
        )
        if quorum.get("heal"):  # the later one (it is behind, so it heals) stops; the other trains on
            raise DuplicateReplicaId(message)
        logger.error("%s This worker continues; the other one stops.", message)


def _settings_of(state: dict) -> dict | None:
    """The `{"settings", "fingerprint"}` of a global state (None for a state that carries none)."""
    if "settings" not in state or "fingerprint" not in state:
        return None
    return {"settings": state["settings"], "fingerprint": state["fingerprint"]}


def _last_quorum_members(lighthouse: str, timeout: float) -> list[tuple[str, str]]:
    """The (replica id, store `host:port`) of each member of the Lighthouse's last quorum, read from its status page
    (torchft 0.2.0 has no other way to ask without joining); none for a fresh Lighthouse or a page not read."""
    try:
        with urllib.request.urlopen(f"{lighthouse.rstrip('/')}/status", timeout=timeout) as response:
            page = response.read().decode(errors="replace")
    except (OSError, ValueError) as error:
        logger.warning(
            "could not read the Lighthouse's status at %s (%s); settings compared at the heal", lighthouse, error
        )
        return []
    return re.findall(r"<b>([^<]+)</b>.*?TCPStore:\s*(\S+?)\s*<br", page, flags=re.DOTALL)


def _published_settings(address: str, timeout: float) -> dict | None:
    """The settings a live worker published in its store at `address`; None when it does not answer (a member that
    has left) or published none."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()  # a store gone: refused at once
        store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout))
        if not store.check([SETTINGS_KEY]):
            return None
        return json.loads(store.get(SETTINGS_KEY))
    except (OSError, ValueError, RuntimeError) as error:  # not reachable, gone meanwhile, or not hf_diloco's
        logger.info("no settings from the live worker's store %s (%s)", address, error)
        return None


def _counting_http_transport(
    timeout: timedelta,
    sink: dict,
    host: str,
    secret: bytes | None = None,
    committed: Callable[[], int] = lambda: 0,
) -> object:
    """torchft's HTTP checkpoint transport, announced under `host`, serving each state sealed (`seal_heal_state`) and,
    with a secret, only to a request that proves it (`heal_request_proof`; any other gets 403 before a byte of state),
    loading what this worker receives safely and checking its seal (`open_heal_state`), and recording its bytes and
    seconds (or why it was refused) in `sink`.

    A state that does not prove the job's secret (unsigned, or refused to this worker) is not loaded: torchft is given
    `REFUSED_STATE` in its place, with the group's step and this worker's `committed()` batches, so that it neither
    fails the group nor asks the same source again, and the member check (`_members_only`) decides whose state this
    worker takes."""
    from torchft.checkpointing import HTTPTransport

    class CountingHTTPTransport(HTTPTransport):
        def send_checkpoint(self, dst_ranks: list, step: int, state_dict: object, timeout: timedelta) -> None:
            super().send_checkpoint(dst_ranks, step, seal_heal_state(state_dict, step, secret), timeout)

        def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> object:
            address = f"{metadata}{step}/full"
            try:
                return open_heal_state(self._load_from_address(address, timeout), step, secret, address)
            except UnsignedHealState as refused:
                sink.pop("refused", None)
                sink["stranger"] = str(refused)
                logger.warning("%s", refused)
                return {
                    "torchft": {"step": step, "batches_committed": committed()},
                    "user": {"default": REFUSED_STATE},
                }
            except HealStateRefused as refused:
                sink["refused"] = str(refused)
                raise

        @classmethod
        def _load_from_address(cls, address: str, timeout: timedelta) -> object:
            started = time.perf_counter()
            request = urllib.request.Request(address)
            if secret is not None:
                request.add_header(PROOF_HEADER, heal_request_proof(urllib.parse.urlsplit(address).path, secret))
            try:
                with urllib.request.urlopen(request, timeout=timeout.total_seconds()) as response:
                    reader = _CountingReader(response)
                    state = load_heal_state(reader, address)
            except HealStateRefused as refused:
                sink["refused"] = str(refused)
                raise
            except urllib.error.HTTPError as error:
                if error.code != 403:
                    raise
                raise UnsignedHealState(
                    f"the worker at {address} refused to serve its state for a heal (HTTP 403): this worker did not "
                    "prove the job's secret to it (it holds another secret than the job's, or none). Give every "
                    f"worker the same secret ({SECRET_FILE_VARIABLE} or {SECRET_VARIABLE}), or stop this worker."
                ) from None
            sink["bytes"], sink["seconds"] = reader.count, time.perf_counter() - started
            return state

        def address(self) -> str:  # torchft announces this machine's host name, not the address it listens on
            return f"http://{_url_host(host)}:{self._server.socket.getsockname()[1]}/checkpoint/"

    transport = CountingHTTPTransport(timeout=timeout, num_chunks=0)
    if secret is not None:
        _serve_members_only(transport._server, secret)
    return transport


def heal_request_proof(path: str, secret: bytes) -> str:
    """What a request for a heal state at `path` (`/checkpoint/<step>/full`) carries in `PROOF_HEADER`: the
    HMAC-SHA256 of the path under the job's secret, which only members compute."""
    return hmac.new(secret, b"hf_diloco heal request\0" + path.encode(), hashlib.sha256).hexdigest()


def _serve_members_only(server: object, secret: bytes) -> None:
    """Make torchft's checkpoint server answer a request without the job's proof with 403, before it reads or sends
    any of the state it serves (the check comes before torchft's handler takes its lock)."""
    handler = server.RequestHandlerClass

    class MembersOnly(handler):
        def do_GET(self) -> None:  # noqa: N802 -- the name http.server calls
            proof = self.headers.get(PROOF_HEADER, "").encode(errors="replace")
            if not hmac.compare_digest(proof, heal_request_proof(self.path, secret).encode()):
                logger.warning(
                    "refused a request for this worker's state from %s (%s): it does not prove the job's secret",
                    self.client_address[0],
                    self.path[:100],
                )
                self.send_error(403, "Not a member of this job: the request does not prove the job's secret")
                return
            super().do_GET()

    server.RequestHandlerClass = MembersOnly


def load_heal_state(stream: object, source: str) -> object:
    """Read a state served for a heal (torchft's streaming format) with `weights_only=True`: tensors and plain
    containers only. Anything else (a pickled object, whose `__reduce__` would run code here) is refused before it is
    built, with `HealStateRefused` naming `source`."""
    from torch.distributed._serialization import _streaming_load

    try:
        return _streaming_load(stream, weights_only=True)
    except pickle.UnpicklingError as error:
        raise HealStateRefused(
            f"refused the state served for a heal by {source}: it holds objects other than tensors and plain "
            f"containers, which this worker never unpickles ({str(error).splitlines()[0]}). The peer runs another "
            "version of hf_diloco or is not trusted; stop it, or stop this worker."
        ) from None


def seal_heal_state(state: object, step: int, secret: bytes | None) -> dict:
    """The envelope a worker serves for a heal: `state` serialised (torchft's streaming format) as a uint8 tensor,
    and the HMAC-SHA256 of those bytes and `step` under `secret` ("" without one)."""
    from torch.distributed._serialization import _streaming_save

    buffer = io.BytesIO()
    _streaming_save(state, buffer)
    payload = buffer.getvalue()
    return {
        "hf_diloco_heal": 1,
        "payload": torch.frombuffer(bytearray(payload), dtype=torch.uint8),
        "hmac": _seal(payload, step, secret) if secret else "",
    }


def open_heal_state(envelope: object, step: int, secret: bytes | None, source: str) -> object:
    """The state inside a `seal_heal_state` envelope (read with `load_heal_state`), after checking its HMAC when this
    worker has a secret; `HealStateRefused` naming `source` otherwise, before the payload is read."""
    if not (isinstance(envelope, dict) and envelope.get("hf_diloco_heal") == 1 and "payload" in envelope):
        raise UnsignedHealState(
            f"refused the state served for a heal by {source}: it is not an hf_diloco heal envelope (another "
            "version of hf_diloco, or not an hf_diloco worker). Run the same hf_diloco version on every worker."
        )
    payload = envelope["payload"].numpy().tobytes()
    if secret is not None:
        received = envelope.get("hmac")
        if not isinstance(received, str) or not hmac.compare_digest(received, _seal(payload, step, secret)):
            raise UnsignedHealState(
                f"refused the state served for a heal by {source}: it is not signed with this job's secret (the "
                f"peer has another secret, or none). Give every worker the same secret ({SECRET_FILE_VARIABLE} or "
                f"{SECRET_VARIABLE}), or stop that peer."
            )
    return load_heal_state(io.BytesIO(payload), source)


def _seal(payload: bytes, step: int, secret: bytes) -> str:
    message = b"hf_diloco heal\0" + str(step).encode() + b"\0" + payload  # the step: an older state is not replayable
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


class _RecordingClient:
    """torchft's Manager client, recording the members of each quorum (for the duplicate-id check), and turning
    torchft's bare quorum timeout (`TimeoutError: status: Cancelled`) into a `QuorumTimeout` that names the
    Lighthouse and what to do."""

    def __init__(self, client: object, sink: dict, lighthouse: str, quorum_timeout: float, host: str):
        self._client_, self._sink = client, sink
        self._lighthouse, self._quorum_timeout, self._host = lighthouse, quorum_timeout, host

    def _quorum(self, *args: object, **kwargs: object) -> object:
        # One request to a Lighthouse that dies is never answered, and torchft's Manager does not send it again to a
        # Lighthouse restarted at the same address: asked again every QUORUM_ATTEMPT_SECONDS, the request reaches
        # the new one. A request the Lighthouse already holds is replaced by the new one, so asking again is safe.
        deadline = time.monotonic() + self._quorum_timeout
        while True:
            attempt = min(QUORUM_ATTEMPT_SECONDS, max(0.0, deadline - time.monotonic()))
            try:
                result = self._client_._quorum(*args, **{**kwargs, "timeout": timedelta(seconds=attempt)})
                break
            except TimeoutError as error:
                if time.monotonic() < deadline:
                    continue
                raise QuorumTimeout(
                    f"No quorum from the Lighthouse {self._lighthouse} within quorum_timeout={self._quorum_timeout:g}s "
                    f"(torchft: {error}). Either the Lighthouse stopped or is unreachable from this worker "
                    f"({self._host}): check that it runs at that address; or fewer than its --min_replicas workers "
                    "reached it. A Lighthouse restarted at the same address within quorum_timeout brings the job back; "
                    "after that, restart the workers, resuming from their last checkpoint. Lower quorum_timeout to find "
                    "out sooner."
                ) from error
        self._sink["replica_ids"], self._sink["heal"] = list(result.replica_ids), bool(result.heal)
        self._sink["max_step"] = int(result.max_step)
        return result

    def __getattr__(self, name: str) -> object:
        return getattr(self._client_, name)


def _group_per_quorum_and_step(process_group_class: type) -> type:
    """torchft's gloo group whose rendezvous keys are named by the quorum's id and its commit count, not the id alone.

    torchft names them `torchft/<quorum id>/<rank>` in the store of the quorum's first member. A restarted Lighthouse
    numbers its quorums from 1 again, so a later quorum of the same members could meet the keys an earlier one left
    under the same id and connect to listeners that are gone. Every member of a quorum reads the same commit count
    (`max_step`) in it, ids are not reused within one Lighthouse's life and the count only grows, so a pair recurs
    only if a restarted Lighthouse reaches an earlier id again before the job commits another round."""

    class GroupPerQuorumAndStep(process_group_class):
        def __init__(self, sink: dict, **kwargs: object):
            super().__init__(**kwargs)
            self._sink = sink

        def configure(self, store_addr: str, *args: object, **kwargs: object) -> None:
            super().configure(f"{store_addr}/step{self._sink.get('max_step', 0)}", *args, **kwargs)

    return GroupPerQuorumAndStep


def _is_loopback(url: str) -> bool:
    """Whether the host of `url` (http://host:port) is this machine's loopback."""
    host = urllib.parse.urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _resolve(host: str) -> tuple[socket.AddressFamily, str]:
    family, _, _, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    return family, address[0]


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _listening_socket(host: str) -> socket.socket:
    family, address = _resolve(host)
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((address, 0))
    listener.listen(128)
    return listener


@contextlib.contextmanager
def _servers_bound_to(host: str) -> Iterator[None]:
    """While torchft builds a Manager: its Manager server and its checkpoint server listen on `host`'s address
    instead of every interface (torchft 0.2.0 binds `[::]` with no option; the two names it binds through are
    replaced for the construction only, on this thread, which is the only one building a Manager)."""
    import torchft.checkpointing.http_transport as http_transport
    import torchft.manager as manager_module

    family, address = _resolve(host)
    server_class, original_http = http_transport._IPv6HTTPServer, http_transport._IPv6HTTPServer
    original_manager = manager_module.ManagerServer

    class BoundHTTPServer(server_class):
        address_family = family

        def __init__(self, server_address: tuple, handler: type):
            super().__init__((address, server_address[1]), handler)

    def bound_manager_server(*args: object, bind: str, **kwargs: object) -> object:
        port = bind.rsplit(":", 1)[1]
        return original_manager(*args, bind=f"{_url_host(address)}:{port}", **kwargs)

    http_transport._IPv6HTTPServer, manager_module.ManagerServer = BoundHTTPServer, bound_manager_server
    try:
        yield
    finally:
        http_transport._IPv6HTTPServer, manager_module.ManagerServer = original_http, original_manager


class _CountingReader:
    def __init__(self, stream: object):
        self.stream, self.count = stream, 0

    def read(self, size: int = -1) -> bytes:
        data = self.stream.read(size)
        self.count += len(data)
        return data

    def readinto(self, buffer: memoryview) -> int:
        count = self.stream.readinto(buffer)
        self.count += count
        return count

    def readline(self, size: int = -1) -> bytes:
        data = self.stream.readline(size)
        self.count += len(data)
        return data
