"""What an elastic worker trusts: a heal never unpickles objects, a heal payload is signed with the job's secret,
its servers listen on its own address only, and two live workers under one replica id are refused.

The hostile peer is real: a separate process serving, in torchft's streaming format, a pickle whose `__reduce__`
would create a marker file on whoever unpickles it. The healer is the transport a `TorchftMembership` heals through.
The two-worker runs use real torchft Managers against a Lighthouse in this process (one thread per worker).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import psutil
import pytest
import torch

pytest.importorskip("torchft")

HOST = "127.0.0.1"
SECRET = "heal-trust-job-secret"  # the job's secret both workers hold, unless a test gives each its own

HOSTILE_PEER = r"""
import builtins, sys
from http.server import BaseHTTPRequestHandler, HTTPServer

import torch
from torch.distributed._serialization import _streaming_save

from hf_diloco.backends.torchft_membership import seal_heal_state

marker = sys.argv[1]


class Payload:
    def __reduce__(self):  # runs on whoever unpickles this: creates the marker file
        return (builtins.exec, (f"open({marker!r}, 'w').close()",))


STATES = {
    "/checkpoint/0/full": {"user": {"default": {"global": [torch.ones(3)], "evil": Payload()}}, "torchft": {"step": 0}},
    "/checkpoint/1/full": seal_heal_state({"user": {"default": {"global": [torch.arange(3.0)], "phase": ("launch", 0)}},
                                           "torchft": {"step": 1, "batches_committed": 2}}, 1, None),
    # The hostile object inside a well-formed envelope: refused as well.
    "/checkpoint/2/full": seal_heal_state({"user": {"default": {"evil": Payload()}}}, 2, None),
}


class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        _streaming_save(STATES[self.path], self.wfile)

    def log_message(self, *args):
        pass


server = HTTPServer(("127.0.0.1", 0), Handler)
print(server.server_address[1], flush=True)
server.serve_forever()
"""


@pytest.fixture
def hostile_peer(tmp_path):
    marker = tmp_path / "executed"
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent))
    peer = subprocess.Popen(
        [sys.executable, "-c", HOSTILE_PEER, str(marker)], stdout=subprocess.PIPE, text=True, env=env
    )
    port = int(peer.stdout.readline())
    yield f"http://{HOST}:{port}/checkpoint/", marker
    peer.kill()
    peer.wait()


def test_a_heal_state_holding_an_object_is_refused_and_nothing_runs(hostile_peer):
    from hf_diloco.backends.torchft_membership import HealStateRefused, _counting_http_transport, _servers_bound_to

    url, marker = hostile_peer
    sink: dict = {}
    with _servers_bound_to(HOST):
        transport = _counting_http_transport(timedelta(seconds=10), sink, HOST)
    try:
        with pytest.raises(HealStateRefused, match=r"refused the state served for a heal by http://127\.0\.0\.1"):
            transport.recv_checkpoint(src_rank=0, metadata=url, step=0, timeout=timedelta(seconds=10))
        assert not marker.exists(), "the peer's pickle ran code on the healer"
        assert "objects other than tensors and plain containers" in sink["refused"]
        with pytest.raises(HealStateRefused, match="objects other than tensors and plain containers"):
            transport.recv_checkpoint(src_rank=0, metadata=url, step=2, timeout=timedelta(seconds=10))
        assert not marker.exists(), "the peer's pickle ran code on the healer"
        # A state of tensors and plain containers (what hf_diloco serves) loads as it was sent.
        sink.clear()
        state = transport.recv_checkpoint(src_rank=0, metadata=url, step=1, timeout=timedelta(seconds=10))
        assert torch.equal(state["user"]["default"]["global"][0], torch.arange(3.0))
        assert state["user"]["default"]["phase"] == ("launch", 0) and state["torchft"]["batches_committed"] == 2
        assert sink["bytes"] > 0 and "refused" not in sink
        assert transport.address().startswith(f"http://{HOST}:")
        assert transport._server.socket.getsockname()[0] in (HOST, f"::ffff:{HOST}")
    finally:
        transport.shutdown(wait=False)


STRANGER = r"""
import sys, urllib.error, urllib.parse, urllib.request

from hf_diloco.backends.torchft_membership import PROOF_HEADER, heal_request_proof

url, secret = sys.argv[1], sys.argv[2]
request = urllib.request.Request(url)
if secret:  # a proof under a secret that is not the job's
    request.add_header(PROOF_HEADER, heal_request_proof(urllib.parse.urlsplit(url).path, secret.encode()))
try:
    with urllib.request.urlopen(request, timeout=10) as response:
        body = response.read()
        print(response.status, len(body))
except urllib.error.HTTPError as error:
    print(error.code, len(error.read()))
"""


def test_a_heal_state_is_served_only_to_a_request_that_proves_the_jobs_secret(tmp_path):
    """A worker serves its state (as torchft does while a peer heals). A stranger in another process, which knows the
    address, the port and the step, asks for it without a proof and with a proof under another secret: both get 403
    and none of the state's bytes; a member's transport, holding the secret, receives the state."""
    from hf_diloco.backends.torchft_membership import REFUSED_STATE, _counting_http_transport, _servers_bound_to

    served = {"user": {"default": {"global": [torch.full((4096,), 7.0)]}}, "torchft": {"step": 3}}
    with _servers_bound_to(HOST):
        server = _counting_http_transport(timedelta(seconds=10), {}, HOST, SECRET.encode())
        member = _counting_http_transport(timedelta(seconds=10), {}, HOST, SECRET.encode())
        other = _counting_http_transport(timedelta(seconds=10), sink := {}, HOST, b"another-secret")
    try:
        server.send_checkpoint([1], 3, served, timedelta(seconds=10))
        url = f"{server.address()}3/full"
        env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent))
        for secret in ("", "another-secret"):
            stranger = subprocess.run(
                [sys.executable, "-c", STRANGER, url, secret], capture_output=True, text=True, env=env, timeout=60
            )
            status, length = stranger.stdout.split()
            assert status == "403" and int(length) < 1000, stranger  # torchft's error page, not the 16 KB state
        # A worker with another secret is refused the same way; it loads nothing and torchft applies a stand-in.
        stand_in = other.recv_checkpoint(src_rank=0, metadata=server.address(), step=3, timeout=timedelta(seconds=10))
        assert stand_in == {"torchft": {"step": 3, "batches_committed": 0}, "user": {"default": REFUSED_STATE}}
        assert sink["stranger"] == (
            f"the worker at {url} refused to serve its state for a heal (HTTP 403): this worker did not prove the "
            "job's secret to it (it holds another secret than the job's, or none). Give every worker the same secret "
            "(HF_DILOCO_JOB_SECRET_FILE or HF_DILOCO_JOB_SECRET), or stop this worker."
        )
        assert "bytes" not in sink and "refused" not in sink
        state = member.recv_checkpoint(src_rank=0, metadata=server.address(), step=3, timeout=timedelta(seconds=10))
        assert torch.equal(state["user"]["default"]["global"][0], served["user"]["default"]["global"][0])
    finally:
        for transport in (server, member, other):
            transport.shutdown(wait=False)


def listening_addresses() -> dict[int, str]:
    """Port -> local address of every socket this process listens on."""
    connections = psutil.Process().net_connections(kind="tcp")
    return {c.laddr.port: c.laddr.ip for c in connections if c.status == psutil.CONN_LISTEN}


def two_workers(
    lighthouse: str,
    names: list[str],
    states: list,
    secrets: tuple = (SECRET, SECRET),
    min_workers: int = 2,
    leave_on_error: bool = True,
    quorum_timeout: int = 20,
) -> tuple[list, list, list, list]:
    """`TorchftMembership`s joining at once (one thread each; two unless more names are given): their memberships,
    views, errors and the states they loaded in a heal. A worker whose `begin_round` raised leaves the job, as its
    process would (`leave_on_error`)."""
    from hf_diloco.backends.torchft_membership import TorchftMembership

    memberships = [
        TorchftMembership(
            lighthouse,
            name,
            min_workers=min_workers,
            min_workers_timeout=30,
            sync_timeout=10,
            quorum_timeout=quorum_timeout,
            host=HOST,
            secret=secret,
            insecure_no_secret=secret is None,
        )
        for name, secret in zip(names, secrets)
    ]
    loaded: list = []
    for membership, state in zip(memberships, states):
        membership.bind(lambda state=state: state, loaded.append)
    views, errors = [None] * len(names), [None] * len(names)

    def join(index: int) -> None:
        try:
            views[index] = memberships[index].begin_round()
        except Exception as error:  # noqa: BLE001 -- reported to the test
            errors[index] = error
            if leave_on_error:
                memberships[index].close()

    threads = [threading.Thread(target=join, args=(index,), daemon=True) for index in range(len(names))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return memberships, views, errors, loaded


@pytest.fixture
def lighthouse():
    from torchft._torchft import LighthouseServer

    server = LighthouseServer(bind=f"{HOST}:0", min_replicas=2, join_timeout_ms=2000)
    yield server.address()
    server.shutdown()


class Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):  # runs on whoever unpickles this
        return (open, (str(self.marker), "w"))


def test_a_torchft_heal_from_a_hostile_peer_is_refused_and_servers_listen_on_the_host_only(lighthouse, tmp_path):
    from hf_diloco.backends.torchft_membership import HealStateRefused

    marker = tmp_path / "executed"
    hostile = {"global": [torch.zeros(2)], "evil": Payload(marker)}
    started = time.monotonic()
    memberships, views, errors, loaded = two_workers(
        lighthouse, ["site_a", "site_b"], [hostile, hostile], min_workers=1, leave_on_error=False, quorum_timeout=6
    )
    try:
        # At step 0 one worker heals from the other (torchft's first sync): that one refuses, nothing ran.
        # (the other, left waiting for the refused one in its group, stops at its quorum_timeout: 6 s here)
        refused = [error for error in errors if isinstance(error, HealStateRefused)]
        assert len(refused) == 1, errors
        assert "objects other than tensors and plain containers" in str(refused[0])
        assert not marker.exists() and loaded == []
        listening = listening_addresses()
        for membership in memberships:
            ports = [membership._store.port, membership.manager._checkpoint_transport._server.socket.getsockname()[1]]
            ports.append(int(membership.manager._manager.address().rsplit(":", 1)[1]))
            bound = {port: listening.get(port) for port in ports}
            assert all(address in (HOST, f"::ffff:{HOST}") for address in bound.values()), bound
    finally:
        for membership in memberships:
            membership.close()
    assert time.monotonic() - started < 60


def test_two_live_workers_under_one_replica_id_are_refused(lighthouse):
    from hf_diloco.backends.torchft_membership import DuplicateReplicaId

    state = {"global": [torch.zeros(2)]}
    memberships, views, errors, _ = two_workers(
        lighthouse, ["site_a", "site_a"], [state, state], min_workers=1, quorum_timeout=6
    )
    try:
        duplicates = [error for error in errors if isinstance(error, DuplicateReplicaId)]
        assert len(duplicates) == 1, errors
        assert "two live workers joined the Lighthouse" in str(duplicates[0]) and "'site_a'" in str(duplicates[0])
        # The worker that was there first is not refused: it waits for a group without the duplicate (which this
        # Lighthouse, of --min_replicas 2, never forms: it stops at its quorum_timeout).
        [first] = [error for error in errors if not isinstance(error, DuplicateReplicaId)]
        assert first is None or "No quorum from the Lighthouse" in str(first), errors
    finally:
        for membership in memberships:
            membership.close()


def test_a_heal_is_checked_against_the_jobs_secret(lighthouse):

    states = [{"global": [torch.full((2,), 1.0)]}, {"global": [torch.full((2,), 2.0)]}]
    memberships, views, errors, loaded = two_workers(lighthouse, ["site_a", "site_b"], states, (b"s3cret", "s3cret"))
    for membership in memberships:
        membership.close()
    assert errors == [None, None] and sum(view.healed for view in views) == 1
    [state] = loaded  # the healer took the other's state, signed with the shared secret
    assert any(torch.equal(state["global"][0], served["global"][0]) for served in states)


def test_a_peer_with_another_secret_gets_no_state_and_is_refused_from_the_group(lighthouse):
    """Two workers with different secrets meet at step 0: site_a serves site_b a heal, which site_a's server refuses
    (403) before any byte of state; site_b does not stop, loads nothing, and the member check refuses each from the
    other's group: each trains in a group of its own, naming the other."""
    state = {"global": [torch.zeros(2)]}
    memberships, views, errors, loaded = two_workers(
        lighthouse, ["site_a", "site_b"], [state, state], ("alpha-secret-1", "beta-secret-2"), min_workers=1
    )
    for membership in memberships:
        membership.close()
    assert errors == [None, None] and loaded == [], errors
    assert [(view.size, view.refused, view.healed) for view in views] == [
        (1, ("site_b",), False),
        (1, ("site_a",), False),
    ]
    refusal = memberships[1]._heal["stranger"]
    assert (
        refusal.startswith("the worker at http://127.0.0.1:")
        and "refused to serve its state for a heal (HTTP 403)" in refusal
    )
    assert "secret-1" not in refusal and "secret-2" not in refusal  # never in a message
    assert memberships[0].refused == {"site_b": 1} and memberships[1].refused == {"site_a": 1}


def test_a_heal_served_without_the_jobs_secret_is_refused_before_it_is_read(lighthouse):
    """A peer run with insecure_no_secret serves its state unsigned (site_a, the first member, serves at step 0): the
    healer, which holds the secret, does not read it, and refuses the peer from its group."""
    state = {"global": [torch.zeros(2)]}
    memberships, views, errors, loaded = two_workers(
        lighthouse, ["site_a", "site_b"], [state, state], (None, SECRET), min_workers=1
    )
    for membership in memberships:
        membership.close()
    assert errors == [None, None] and loaded == [], errors
    assert "it is not signed with this job's secret" in memberships[1]._heal["stranger"]
    assert views[1].refused == ("site_a",) and views[1].size == 1


def test_a_stranger_in_the_group_is_refused_before_any_payload_and_the_members_exchange_without_it(lighthouse):
    """Two members and a stranger (another secret) form one torchft quorum. The stranger's heal is refused by the
    member that serves it; the member check refuses the stranger in both members' groups, and the two exchange over a
    group of their own (a real all-reduce between them). The stranger, which met no member of its own job, stops with
    `SecretMismatch` naming the way out."""
    from hf_diloco.backends.torchft_membership import SecretMismatch

    state = {"global": [torch.zeros(2)]}
    names, secrets = ["site_a", "site_b", "stranger"], (SECRET, SECRET, "stranger-secret")
    memberships, views, errors, loaded = two_workers(lighthouse, names, [state] * 3, secrets, min_workers=2)
    try:
        assert errors[:2] == [None, None] and isinstance(errors[2], SecretMismatch), errors
        assert str(errors[2]) == (
            "This worker could not verify 2 of the 2 other members of its group (site_a, site_b): they do not prove "
            "this worker's secret. Most likely this worker holds another secret than the job's: give it the job's "
            "secret (HF_DILOCO_JOB_SECRET_FILE or HF_DILOCO_JOB_SECRET), the same on every site; if those are not "
            "the job's sites, stop them."
        )
        assert [(view.size, view.members, view.refused) for view in views[:2]] == [
            (2, ("site_a", "site_b"), ("stranger",)),
            (2, ("site_a", "site_b"), ("stranger",)),
        ]
        assert "refused to serve its state for a heal (HTTP 403)" in memberships[2]._heal["stranger"]
        assert len(loaded) == 1  # site_b's heal from site_a; nothing reached the stranger
        sums = [None, None]

        def reduce(index: int) -> None:
            value = torch.tensor([float(index + 1)])
            torch.distributed.all_reduce(value, group=views[index].group)
            sums[index] = float(value)

        threads = [threading.Thread(target=reduce, args=(index,)) for index in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
        assert sums == [3.0, 3.0]
    finally:
        for membership in memberships:
            membership.close()


@pytest.mark.timeout(60)
def test_a_quorum_that_never_forms_names_the_lighthouse_and_the_ways_out():
    """A real Lighthouse waiting for a second worker that never comes (what a worker sees once the Lighthouse is
    lost): torchft's bare `TimeoutError: status: Cancelled` becomes a `QuorumTimeout` naming the address."""
    from torchft._torchft import LighthouseServer, ManagerClient, ManagerServer

    from hf_diloco.backends.torchft_membership import QuorumTimeout, _RecordingClient

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=2)
    server = ManagerServer(
        replica_id="alone",
        lighthouse_addr=lighthouse.address(),
        hostname="127.0.0.1",
        bind="127.0.0.1:0",
        store_addr="127.0.0.1:1",
        world_size=1,
        heartbeat_interval=timedelta(milliseconds=100),
        connect_timeout=timedelta(seconds=5),
        quorum_retries=0,
    )
    try:
        client = ManagerClient(server.address(), connect_timeout=timedelta(seconds=5))
        sink: dict = {}
        recording = _RecordingClient(client, sink, lighthouse.address(), 1.0, "127.0.0.1")
        with pytest.raises(QuorumTimeout) as timed_out:
            recording._quorum(
                group_rank=0,
                step=0,
                checkpoint_metadata="",
                shrink_only=False,
                timeout=timedelta(seconds=1),
                commit_failures=0,
                init_sync=True,
            )
        message = str(timed_out.value)
        assert f"No quorum from the Lighthouse {lighthouse.address()} within quorum_timeout=1s" in message
        assert "status: Cancelled" in message and "resuming from their last checkpoint" in message
        assert isinstance(timed_out.value, TimeoutError) and "replica_ids" not in sink
    finally:
        server.shutdown()
        lighthouse.shutdown()
