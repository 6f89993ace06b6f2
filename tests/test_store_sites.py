"""Sites that share no network, only a store: each a process (or a torchrun of ranks) of its own with no process group
between sites, against a real S3 server (moto's, over HTTP on loopback) or a folder. θg is bit for bit equal on every
site after every round and equal to the replay of the store's bytes in tests/store_common.py; faults (a site killed
mid-upload and restarted, one paused past the grace window, one started rounds late) stop nobody else; objects that are
not the job's are ignored and named."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch

from tests.store_common import (
    SECRET,
    StoreBytes,
    events,
    log_of,
    per_round,
    replay,
    results,
    s3_server,
    start_site,
    wait_all,
    whole,
)


def _check_matches_the_replay(store: StoreBytes, out: Path, sites: list[str], max_staleness: int = 2) -> dict:
    """Every site's θg after every round it applied is the replay's, bit for bit; every site ends with the same."""
    reference = replay(store, max_staleness=max_staleness)
    finals = {}
    for site in sites:
        shares = results(out, site)
        for key, theta in per_round(shares).items():
            assert torch.equal(theta, reference[key]), f"site {site}, round {key}: not the replay's θ"
        finals[site] = whole(shares)
    first = next(iter(finals.values()))
    assert all(torch.equal(theta, first) for theta in finals.values()), "the sites ended with different θg"
    last = max(reference)
    assert last[1] and torch.equal(first, reference[last]), "the sites' final θg is not the replay's last round"
    return reference


@pytest.mark.timeout(240)
def test_three_sites_one_of_two_ranks_through_s3_match_a_replay_of_the_store(tmp_path):
    """Three sites (a, b of one process; c a torchrun of 2 DDP ranks, its shares cut in halves) through moto's S3
    server: one manifest per round, every site applies it, θg bitwise equal after every round and to the replay."""
    with s3_server() as env:
        url = "s3://job-bucket/runs/one"
        sites = {"a": start_site("a", url, tmp_path, env=env, steps=24),
                 "b": start_site("b", url, tmp_path, env=env, steps=24),
                 "c": start_site("c", url, tmp_path, ranks=2, env=env, steps=24)}  # fmt: skip
        wait_all(sites, tmp_path, timeout=180)
        store = StoreBytes(url, env)
    reference = _check_matches_the_replay(store, tmp_path, list(sites))
    regular = [key for key in reference if key[0] > 0 and not key[1]]
    assert len(regular) >= 5, sorted(reference)
    manifests = store.named(r"f0/m/\d{8}-[0-9a-f]{16}")
    assert len({name.split("/")[2][:8] for name in manifests}) == len(manifests)  # exactly one per round
    # A round holds each site's fresh contribution at most once; a late one from the round before may join it.
    fresh = [[e["site"] for e in store.opened(name)[0]["entries"] if e["staleness"] == 0] for name in manifests]
    assert all(len(sites_) == len(set(sites_)) for sites_ in fresh), fresh
    assert max(len(sites_) for sites_ in fresh) == 3, fresh
    assert len(results(tmp_path, "c")) == 2  # both ranks of c recorded their halves


@pytest.mark.timeout(300)
def test_sites_train_on_through_a_kill_mid_upload_a_pause_and_a_late_start(tmp_path):
    """A folder store, quorum 2 of 4 sites: b is killed while it writes its 3rd share and started again (it joins from
    the store), c is paused (SIGSTOP) one step into a round for 5 s, past the grace window, and resumed (its
    contribution enters a later round, down-weighted), d starts 3 rounds late.
    Site a never waits longer than the grace window plus a round's work; every site ends with the same θg, the
    replay's."""
    url = f"file://{tmp_path}/store"
    options = {"steps": 40, "step_seconds": 0.15, "config": {"quorum": 2, "grace_seconds": 1.0, "max_staleness": 4}}
    sites = {"a": start_site("a", url, tmp_path, **options),
             "b": start_site("b", url, tmp_path, hold_upload=3, **options),
             "c": start_site("c", url, tmp_path, **options)}  # fmt: skip
    held = tmp_path / "b" / "upload-3"
    deadline = time.monotonic() + 120
    while not held.exists():
        assert time.monotonic() < deadline and sites["b"].poll() is None, log_of(tmp_path, "b")[-2000:]
        time.sleep(0.1)
    sites["b"].send_signal(signal.SIGKILL)
    sites["b"].wait()
    sites["b"] = start_site("b", url, tmp_path, **options)  # the same command again
    restarted = time.monotonic()
    while not _trains_again(tmp_path, "b"):
        assert time.monotonic() - restarted < 60, log_of(tmp_path, "b")[-2000:]
        time.sleep(0.2)
    _pause_mid_round(sites["c"], tmp_path, "c", seconds=5.0)  # a and b close a round or two in the meantime
    while _last_step(tmp_path, "a") < 12:
        time.sleep(0.2)
    sites["d"] = start_site("d", url, tmp_path, **options)
    wait_all(sites, tmp_path, timeout=240)
    store = StoreBytes(url)
    _check_matches_the_replay(store, tmp_path, list(sites), max_staleness=4)
    assert "joined the store job" in log_of(tmp_path, "b") and "joined the store job" in log_of(tmp_path, "d")
    assert any(e["event"] == "joined" and e["step"] >= 12 for e in events(tmp_path, "d")), events(tmp_path, "d")[:2]
    times = [e["time"] for e in events(tmp_path, "a") if e["event"] == "step"]
    longest = max(later - earlier for earlier, later in zip(times, times[1:]))
    assert longest < 8.0, f"site a stood still for {longest:.1f} s"
    late = sum(store.opened(name)[0]["entries"][i]["staleness"] > 0
               for name in store.named(r"f0/m/\d{8}-[0-9a-f]{16}")
               for i in range(len(store.opened(name)[0]["entries"])))  # fmt: skip
    assert late > 0  # c's contributions from before its pause entered later rounds


def _last_step(out: Path, site: str) -> int:
    return max([e["step"] for e in events(out, site) if e["event"] == "step"], default=0)


def _trains_again(out: Path, site: str) -> bool:
    """A restarted site has joined and trained two steps since."""
    log = events(out, site) if (out / site / "events-0.jsonl").exists() else []
    joins = [i for i, e in enumerate(log) if e["event"] == "joined"]
    return len(joins) == 2 and sum(1 for e in log[joins[-1] :] if e["event"] == "step") >= 2


def _pause_mid_round(process, out: Path, site: str, seconds: float) -> None:
    """SIGSTOP a site one step into a round (so its next contribution comes after the others' round closed), for
    `seconds`, then SIGCONT."""
    deadline = time.monotonic() + 60
    while _last_step(out, site) % 4 != 1:
        assert time.monotonic() < deadline, f"site {site} did not reach a round's first step"
        time.sleep(0.02)
    os.kill(process.pid, signal.SIGSTOP)
    time.sleep(seconds)
    os.kill(process.pid, signal.SIGCONT)


@pytest.mark.timeout(240)
def test_objects_that_are_not_the_job_s_are_ignored_named_and_never_applied(tmp_path):
    """While two sites train, objects are put into the store: a record signed with another secret, one truncated,
    a record of round 1 replayed under round 2's name, and one of another job (the same secret). Every one is named in
    the sites' warnings and their summaries; θg is the replay of the manifests, which list none of them."""
    from hf_diloco.core.store.names import StoreNames
    from hf_diloco.core.store.sealing import JobKeys, seal

    url = f"file://{tmp_path}/store"
    options = {"steps": 32, "step_seconds": 0.2}
    sites = {site: start_site(site, url, tmp_path, **options) for site in ("a", "b")}
    store_dir = tmp_path / "store"
    names = StoreNames(JobKeys(SECRET.encode()))
    while not list(store_dir.glob("f0/c/00000001/a/*/record")):
        assert all(p.poll() is None for p in sites.values()), log_of(tmp_path, "a")[-2000:]
        time.sleep(0.1)
    (real,) = store_dir.glob("f0/c/00000001/a/*/record")
    planted = {
        "forged": (names.record(0, 2, "mallory", "0" * 12), seal(JobKeys(b"not the secret"), {"kind": "record"})),
        "truncated": (names.record(0, 2, "trudy", "1" * 12), real.read_bytes()[:-7]),
        "replayed": (names.record(0, 2, "a", "2" * 12), real.read_bytes()),
        "another job": (names.record(0, 2, "eve", "3" * 12), seal(JobKeys(SECRET.encode()), {
            "kind": "record", "job": "another", "fragment": 0, "base": 2, "site": "eve", "incarnation": "3" * 12,
            "contribution": {"site": "eve", "incarnation": "3" * 12, "base": 2, "tokens": 1e9, "record": ""},
        }, b'{"shares": []}')),
    }  # fmt: skip
    for key, data in planted.values():
        path = store_dir / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    wait_all(sites, tmp_path, timeout=200)
    store = StoreBytes(url)
    _check_matches_the_replay(store, tmp_path, list(sites))
    for what, (key, _) in planted.items():
        assert f"ignored the store object {key}" in log_of(tmp_path, "a") + log_of(tmp_path, "b"), what
        assert any(key in results(tmp_path, site)[0]["summary"]["ignored_objects"] for site in sites), what
    for name in store.named(r"f0/m/\d{8}-[0-9a-f]{16}"):
        assert {e["site"] for e in store.opened(name)[0]["entries"]} <= {"a", "b"}


@pytest.mark.timeout(240)
def test_two_accelerate_loops_with_the_plugin_train_one_model_through_a_store(tmp_path):
    """examples/accelerate_loop.py as it is, one process per site, given the store by `DILOCO_*` variables, streaming
    two fragments with each exchange behind an inner step (τ = 1): the two sites save the same global model."""
    import subprocess
    import sys

    from safetensors.torch import load_file

    from tests.store_common import ROOT, site_env

    processes = {}
    for site in ("a", "b"):
        variables = {"DILOCO_INNER_STEPS": "4", "DILOCO_NUM_FRAGMENTS": "2", "DILOCO_SYNC_DELAY": "1",
                     "DILOCO_EXCHANGE": "store", "DILOCO_STORE_URL": f"file://{tmp_path}/store",
                     "DILOCO_SITE": site, "DILOCO_QUORUM": "2", "DILOCO_GRACE_SECONDS": "1"}  # fmt: skip
        argv = [sys.executable, str(ROOT / "examples" / "accelerate_loop.py"), "--use_cpu", "--max_steps", "16",
                "--num_rows", "64", "--output_dir", str(tmp_path / site)]  # fmt: skip
        log = (tmp_path / f"{site}.log").open("wb")
        processes[site] = subprocess.Popen(
            argv, env=site_env(variables), stdout=log, stderr=subprocess.STDOUT, cwd=ROOT
        )
    wait_all(processes, tmp_path, timeout=200)
    models = [load_file(str(tmp_path / site / "final" / "model.safetensors")) for site in processes]
    assert models[0].keys() == models[1].keys() and all(models[0][k].equal(models[1][k]) for k in models[0])
    assert "through the store file://" in log_of(tmp_path, "a")
