"""Elastic membership as `DiLoCoConfig` fields (`lighthouse`, `site`, ...): checked with clear messages, the same
through every front-end's way of setting fields, out of the fingerprint, and a launch of several processes refused."""

from __future__ import annotations

import json

import pytest
import torch

from hf_diloco import DiLoCoConfig
from hf_diloco.cli.pretrain_arguments import parse_command_line
from hf_diloco.core.layout.topology import RankLayout, Topology
from hf_diloco.core.settings.config import env_fields
from hf_diloco.integrations.engine_session import check_one_process_per_site, membership_from_config

ELASTIC = dict(lighthouse="http://10.0.0.5:29510", site="site-a")
SECRET = "membership-config-test-secret"  # elastic membership refuses to start without the job's secret


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(site="site-a"), "site ('site-a') needs lighthouse"),
        (dict(lighthouse="10.0.0.5:29510", site="a"), "lighthouse must be the Lighthouse's address, http://host:port"),
        (dict(lighthouse="http://", site="a"), "lighthouse must be the Lighthouse's address"),
        (dict(lighthouse="http://10.0.0.5:29510"), "site must name this site"),
        (dict(lighthouse="http://10.0.0.5:29510", site="  "), "site must name this site"),
        (dict(ELASTIC, min_workers=0), "min_workers must be >= 1, got 0"),
        (dict(ELASTIC, start_workers=0), "start_workers must be >= 1, got 0"),
        (dict(ELASTIC, min_workers_timeout=0), "min_workers_timeout must be > 0.0"),
        (dict(ELASTIC, membership_sync_timeout=float("nan")), "membership_sync_timeout must be a finite number"),
        (dict(ELASTIC, site_host=5), "site_host must be a string"),
    ],
)
def test_bad_membership_fields_are_refused_naming_the_field(fields, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        DiLoCoConfig(**fields)


@pytest.fixture(autouse=True)
def job_secret(monkeypatch):
    """Every site of these tests holds the job's secret, as elastic membership requires."""
    monkeypatch.setenv("HF_DILOCO_JOB_SECRET", SECRET)
    monkeypatch.delenv("HF_DILOCO_JOB_SECRET_FILE", raising=False)


def test_elastic_membership_without_the_jobs_secret_is_refused_unless_the_insecure_mode_is_named(monkeypatch):
    from hf_diloco.backends.torchft_membership import TorchftMembership

    monkeypatch.delenv("HF_DILOCO_JOB_SECRET")
    expected = (
        "elastic membership (lighthouse) needs the job's secret, so that no process outside the job can join it, "
        "read the global model through a heal or put anything into it: write it to a file only the job's user can "
        "read and set HF_DILOCO_JOB_SECRET_FILE to that file (or set HF_DILOCO_JOB_SECRET) on every site, the same "
        "on all of them. On a network nobody else can reach, insecure_no_secret: true runs without one."
    )
    with pytest.raises(ValueError) as refused:
        membership_from_config(DiLoCoConfig(**ELASTIC), Topology.single_process())
    assert str(refused.value) == expected
    with pytest.raises(ValueError, match=r"needs the job's secret"):
        TorchftMembership(ELASTIC["lighthouse"], "site-a")
    insecure = membership_from_config(DiLoCoConfig(**ELASTIC, insecure_no_secret=True), Topology.single_process())
    assert insecure.manager is None and insecure._secret is None


def test_a_sites_servers_listen_on_loopback_unless_its_address_is_named():
    config = DiLoCoConfig(**ELASTIC)
    assert membership_from_config(config, Topology.single_process()).host == "127.0.0.1"
    named = DiLoCoConfig(**ELASTIC, site_host="10.0.0.6")
    assert membership_from_config(named, Topology.single_process()).host == "10.0.0.6"


def test_membership_stays_out_of_the_fingerprint_so_sites_may_differ():
    fixed = DiLoCoConfig()
    a = DiLoCoConfig(**ELASTIC, min_workers=2, min_workers_timeout=30.0)
    b = DiLoCoConfig(lighthouse="http://lighthouse:1", site="site-b", site_host="10.0.0.7")
    assert fixed.fingerprint() == a.fingerprint() == b.fingerprint()
    assert membership_from_config(fixed, Topology.single_process()) is None


def test_every_front_end_sets_membership_the_same_way():
    flags = ["--use_cpu", "--lighthouse", "http://10.0.0.5:29510", "--site", "site-a", "--min_workers", "2"]
    args = parse_command_line(flags, environ={}).args
    assert (args.lighthouse, args.site, args.min_workers) == ("http://10.0.0.5:29510", "site-a", 2)
    assert args.diloco_config().lighthouse == "http://10.0.0.5:29510"
    variables = {"DILOCO_LIGHTHOUSE": "http://10.0.0.5:29510", "DILOCO_SITE": "site-b", "DILOCO_MIN_WORKERS": "2"}
    assert env_fields(variables) == {"lighthouse": "http://10.0.0.5:29510", "site": "site-b", "min_workers": 2}
    with pytest.raises(ValueError, match="site must name this site"):
        parse_command_line(["--use_cpu", "--lighthouse", "http://10.0.0.5:29510"], environ={})


def test_a_launch_of_several_processes_under_membership_is_refused_saying_what_to_do():
    config = DiLoCoConfig(**ELASTIC)
    with pytest.raises(ValueError, match=r"this launch has 2 processes.*torchrun --nproc_per_node 1"):
        membership_from_config(config, Topology(RankLayout(2), 0, {}))
    with pytest.raises(
        ValueError,
        match=r"Set data_parallel_per_worker \(times pipeline_stages\) to 4 to make these processes one site",
    ):
        check_one_process_per_site(config, 4)
    with pytest.raises(ValueError, match="= 1 x 2: one launch is one site"):
        check_one_process_per_site(DiLoCoConfig(**ELASTIC, data_parallel_per_worker=2), 4)
    check_one_process_per_site(DiLoCoConfig(**ELASTIC, pipeline_stages=2, data_parallel_per_worker=2), 4)  # one site
    check_one_process_per_site(DiLoCoConfig(), 4)  # a fixed membership of several processes is as before


def test_a_launch_of_one_sites_data_parallel_ranks_is_one_membership_of_that_many_ranks():
    """A launch of D processes with data_parallel_per_worker D is one site: each rank's membership says its rank in
    the site and D (nothing connects before `bind`)."""
    config = DiLoCoConfig(**ELASTIC, data_parallel_per_worker=2)
    check_one_process_per_site(config, 2)
    membership = membership_from_config(config, Topology(RankLayout(2, 1, 2), 1, {"control": object()}))
    assert (membership.replica_id, membership.site_rank, membership.site_size) == ("site-a", 1, 2)
    assert membership.manager is None


def publish(store: torch.distributed.TCPStore, settings: dict, secret: str = SECRET) -> None:
    """What a live site of the job (holding `secret`) publishes in its store for joiners."""
    from hf_diloco.backends.torchft_members import members_key, proof
    from hf_diloco.backends.torchft_membership import SETTINGS_KEY

    signed = proof(members_key(secret.encode()), json.dumps(settings, sort_keys=True))
    store.set(SETTINGS_KEY, json.dumps({**settings, "proof": signed}))


def test_settings_a_stranger_publishes_are_not_compared(caplog):
    """A stranger that publishes other settings (or none proven) in its store cannot keep a joiner out."""
    from hf_diloco.backends.torchft_membership import SETTINGS_KEY, TorchftMembership

    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    config = DiLoCoConfig(**ELASTIC)
    mine = {"settings": config.shared_settings(), "fingerprint": config.fingerprint()}
    other = DiLoCoConfig(**ELASTIC, inner_steps=7)
    theirs = {"settings": other.shared_settings(), "fingerprint": other.fingerprint(), "site_size": 1}
    joiner = TorchftMembership(ELASTIC["lighthouse"], "site-b")
    for published in ({**theirs, "proof": "0" * 64}, theirs):
        store.set(SETTINGS_KEY, json.dumps(published))
        joiner._check_live_settings(mine, "replicated", [f"127.0.0.1:{store.port}"])  # not compared: joins
    assert (
        f"the settings published at 127.0.0.1:{store.port} do not prove the job's secret: not compared" in caplog.text
    )
    publish(store, theirs, secret="a stranger's secret")
    joiner._check_live_settings(mine, "replicated", [f"127.0.0.1:{store.port}"])
    publish(store, theirs)  # the same settings from a member: refused, naming the field
    with pytest.raises(ValueError, match=r"inner_steps: 7 in the peer, 100 in this worker"):
        joiner._check_live_settings(mine, "replicated", [f"127.0.0.1:{store.port}"])


def test_a_site_of_another_number_of_ranks_is_refused_before_it_joins_naming_the_launch():
    """A live site published its settings and its D (1 here) in its store: a joiner of D 2 stops before its Manager
    exists (it would leave rank 1 of its site without a peer), naming the launch that fits."""
    from hf_diloco.backends.torchft_membership import TorchftMembership

    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    config = DiLoCoConfig(**ELASTIC)
    published = {"settings": config.shared_settings(), "fingerprint": config.fingerprint()}
    publish(store, {**published, "site_size": 1})
    joiner = TorchftMembership(ELASTIC["lighthouse"], "site-b", site_rank=0, site_size=2, site_group=object())
    with pytest.raises(ValueError, match=r"live sites run 1 rank\(s\) each and this site 'site-b' 2"):
        joiner._check_live_settings(published, "replicated", [f"127.0.0.1:{store.port}"])
    with pytest.raises(
        ValueError, match=r"torchrun --nproc_per_node 1, pipeline_stages x data_parallel_per_worker = 1"
    ):
        joiner._check_live_settings(None, "replicated", [f"127.0.0.1:{store.port}"])
    same = TorchftMembership(ELASTIC["lighthouse"], "site-c")
    same._check_live_settings(published, "replicated", [f"127.0.0.1:{store.port}"])  # one rank each: joins
    assert joiner.manager is None and same.manager is None


def test_a_site_that_shards_the_model_otherwise_is_refused_before_it_joins_naming_the_launch():
    """A live site of two replicated (DDP) ranks published its sharding: an FSDP site of two ranks stops before its
    Manager exists (rank k's share of θg would be other values on each), and so does the reverse."""
    from hf_diloco.backends.torchft_membership import TorchftMembership

    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    config = DiLoCoConfig(**ELASTIC, data_parallel_per_worker=2)
    published = {"settings": config.shared_settings(), "fingerprint": config.fingerprint()}
    publish(store, {**published, "site_size": 2, "sharding": "replicated"})
    joiner = TorchftMembership(ELASTIC["lighthouse"], "site-b", site_rank=0, site_size=2, site_group=object())
    with pytest.raises(ValueError, match=r"live sites hold the model replicated .* this site fsdp.*without FSDP"):
        joiner._check_live_settings(published, "fsdp", [f"127.0.0.1:{store.port}"])
    publish(store, {**published, "site_size": 2, "sharding": "fsdp"})
    with pytest.raises(ValueError, match=r"this site replicated.*with the Trainer's fsdp arguments"):
        joiner._check_live_settings(published, "replicated", [f"127.0.0.1:{store.port}"])
    joiner._check_live_settings(published, "fsdp", [f"127.0.0.1:{store.port}"])  # the same sharding: joins
    assert joiner.manager is None
