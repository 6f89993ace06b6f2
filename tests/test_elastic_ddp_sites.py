"""Elastic sites of two data-parallel ranks (DDP, gloo), each launched with `torchrun --nproc_per_node 2` against a
real Lighthouse (tests/scripts/elastic_ddp_site.py): every process of one site is killed mid-run, the other site
trains on alone without a restart; the lost site, started again, heals on both of its ranks from the matching rank of
the live site, and all four ranks finish with the same θg, bit for bit. A site that breaks mid-exchange (one rank
dead, the other hung) leaves the job whole (its torchrun stops the hung rank), and the others train on."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import torch

from tests.elastic_common import JOB_SECRET, ElasticJob
from tests.engine_common import tiny_model

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "scripts" / "elastic_ddp_site.py"
TORCHRUN = Path(sys.executable).parent / "torchrun"
STEPS, WAIT_AT = 10, 6
RANKS = (0, 1)


class DdpSites(ElasticJob):
    """The Lighthouse in this process, and sites of two ranks each, each rank with its own event log."""

    def start_site(self, site: str, slot: int, *extra: str) -> subprocess.Popen:
        env = dict(os.environ, PYTHONPATH=str(REPO), RUST_LOG="warn", OMP_NUM_THREADS="1", **JOB_SECRET)
        for variable in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(variable, None)
        argv = [str(TORCHRUN), "--standalone", "--nproc_per_node", "2", str(SCRIPT), self.lighthouse.address()]
        argv += [site, str(slot), str(self.out), str(STEPS), *extra]
        log = (self.out / f"{site}.log").open("ab")
        self.processes[site] = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        return self.processes[site]

    def wait_for_ranks(self, site: str, predicate) -> None:
        for rank in RANKS:
            self.wait_for(f"{site}_r{rank}", predicate)

    def kill_site(self, site: str) -> None:
        """Kill the site's torchrun and both of its ranks at once, as a lost machine (by their ids: torchrun starts
        its ranks in sessions of their own)."""
        process = self.processes.pop(site)
        ranks = psutil.Process(process.pid).children(recursive=True)
        for victim in [process, *ranks]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim.pid, signal.SIGKILL)
        process.wait()
        psutil.wait_procs(ranks, timeout=30)
        for rank in RANKS:  # a restarted site's events start afresh
            path = self.out / f"events_{site}_r{rank}.jsonl"
            if path.exists():
                path.rename(path.with_suffix(".lost"))

    def close(self) -> None:
        for site, process in list(self.processes.items()):
            if process.poll() is None:
                self.kill_site(site)
        super().close()


def test_a_site_of_two_ranks_lost_and_restarted_heals_both_ranks_and_ends_identical(tmp_path):
    job = DdpSites(tmp_path, heartbeat_ms=2000, join_timeout_ms=5000)
    try:
        job.start_site("site-a", 0, str(WAIT_AT))
        job.start_site("site-b", 1, "3")  # held at step 3, mid-round, until it is killed there
        job.wait_for_ranks("site-b", lambda e: e["kind"] == "waiting")
        job.kill_site("site-b")  # both ranks and their torchrun, mid-run: site-a's exchanges at 4 and 6 are alone
        killed_at = time.monotonic()
        job.wait_for_ranks("site-a", lambda e: e["kind"] == "waiting")
        # The survivor has trained on alone up to WAIT_AT, without a restart.
        job.start_site("site-b", 1)
        job.wait_for_ranks("site-b", lambda e: e["kind"] == "bound")
        (tmp_path / "go").touch()
        codes = job.finish(timeout=240)
        assert codes == {"site-a": 0, "site-b": 0}, {site: job.log(site) for site in codes}
    finally:
        job.close()
    finals = {(site, rank): job.final(f"{site}_r{rank}") for site in ("site-a", "site-b") for rank in RANKS}
    first = finals["site-a", 0]["global"]
    for key, final in finals.items():
        assert final["global"].keys() == first.keys()
        for name, value in first.items():
            assert torch.equal(value, final["global"][name]), f"θg of {key} differs from site-a rank 0 at {name}"
    assert first.keys() == {name for name, _ in tiny_model().named_parameters()}
    assert not torch.equal(first["lm_head.weight"], tiny_model(seed=0).lm_head.weight.detach())  # it trained
    survivor = finals["site-a", 0]["summary"]
    assert survivor["fewest_workers"] == 1 and survivor["most_workers"] == 2, survivor
    assert survivor["drops"] >= 1 and survivor["joins"] >= 1, survivor
    assert time.monotonic() - killed_at < 200
    numel = sum(value.numel() for value in first.values())
    for rank in RANKS:
        joined = job.events(f"site-b_r{rank}")
        restarted = [e for e in joined if e["kind"] == "joined"][-1]
        assert restarted["step"] >= WAIT_AT, restarted  # it continued where the job was, not from step 0
        metrics = finals["site-b", rank]["metrics"]
        assert finals["site-b", rank]["summary"]["heals"] >= 1 and metrics["diloco/heal_bytes"] > 0, metrics
        # Rank k heals its own half of θg and of the outer momentum (4 bytes x numel / 2 each) from rank k of
        # site-a, not the whole of both (8 bytes x numel); a few KiB of framing on top.
        assert 4 * numel < metrics["diloco/heal_bytes"] < 4 * numel + 16384, (metrics["diloco/heal_bytes"], numel)


def test_a_site_that_breaks_mid_exchange_leaves_whole_and_the_other_site_trains_on(tmp_path):
    """Site-b breaks inside its step-4 exchange: its rank 1 dies, its rank 0 hangs. Site-a's rank 1 fails at once and
    its rank 0 only at the collective's bound (membership_sync_timeout, 5 s); the site's commit vote outwaits that
    lag, so both ranks of site-a retry together without site-b, and site-b's torchrun ends its hung rank."""
    job = DdpSites(tmp_path, heartbeat_ms=2000, join_timeout_ms=5000)
    try:
        job.start_site("site-a", 0)
        site_b = job.start_site("site-b", 1, "0", "4")
        job.wait_for("site-b_r1", lambda e: e["kind"] == "breaking")
        lost_at = time.monotonic()
        assert site_b.wait(timeout=120) != 0, job.log("site-b")  # its torchrun stopped the hung rank, not hung
        left_after = time.monotonic() - lost_at
        codes = job.finish(timeout=180)
        assert codes == {"site-a": 0, "site-b": codes["site-b"]}, job.log("site-a")
        log = job.log("site-a")
    finally:
        job.close()
    # Site-a's rank 0 waited out its collective's bound; both failures are named by gloo's own words.
    assert "Timed out waiting 5000ms" in log and "Connection" in log, log
    assert "world group map" not in log, log  # not torch's logging wrapper's error about torchft's group
    assert left_after < 60, left_after
    assert not (tmp_path / "final_site-b_r0.pt").exists()
    a0, a1 = (job.final(f"site-a_r{rank}") for rank in RANKS)
    for name, value in a0["global"].items():
        assert torch.equal(value, a1["global"][name]), name
    assert a0["summary"]["fewest_workers"] == 1 and a0["summary"]["drops"] >= 1, a0["summary"]
    for final in (a0, a1):
        assert final["metrics"]["diloco/exchange_retries"] >= 1, final["metrics"]  # the step-4 round, retried
