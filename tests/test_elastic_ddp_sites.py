"""Elastic sites of two data-parallel ranks (DDP, gloo), each launched with `torchrun --nproc_per_node 2` against a
real Lighthouse (tests/scripts/elastic_ddp_site.py): every process of one site is killed mid-run, the other site
trains on alone without a restart; the lost site, started again, heals on both of its ranks from the matching rank of
the live site, and all four ranks finish with the same θg, bit for bit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from tests.elastic_common import ElasticJob
from tests.engine_common import tiny_model

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "scripts" / "elastic_ddp_site.py"
TORCHRUN = Path(sys.executable).parent / "torchrun"
STEPS, WAIT_AT = 10, 6
RANKS = (0, 1)


class DdpSites(ElasticJob):
    """The Lighthouse in this process, and sites of two ranks each, each rank with its own event log."""

    def start_site(self, site: str, slot: int, *extra: str) -> subprocess.Popen:
        env = dict(os.environ, PYTHONPATH=str(REPO), RUST_LOG="warn", OMP_NUM_THREADS="1")
        for variable in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(variable, None)
        argv = [str(TORCHRUN), "--standalone", "--nproc_per_node", "2", str(SCRIPT), self.lighthouse.address()]
        argv += [site, str(slot), str(self.out), str(STEPS), *extra]
        log = (self.out / f"{site}.log").open("ab")
        # Its own session: the test kills the site's torchrun and both of its ranks at once, as a lost machine.
        process = subprocess.Popen(
            argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True
        )
        self.processes[site] = process
        return process

    def wait_for_ranks(self, site: str, predicate) -> None:
        for rank in RANKS:
            self.wait_for(f"{site}_r{rank}", predicate)

    def kill_site(self, site: str) -> None:
        process = self.processes.pop(site)
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        for rank in RANKS:  # a restarted site's events start afresh
            path = self.out / f"events_{site}_r{rank}.jsonl"
            path.rename(path.with_suffix(".lost"))


def test_a_site_of_two_ranks_lost_and_restarted_heals_both_ranks_and_ends_identical(tmp_path):
    job = DdpSites(tmp_path, heartbeat_ms=2000, join_timeout_ms=5000)
    try:
        job.start_site("site-a", 0, str(WAIT_AT))
        job.start_site("site-b", 1)
        job.wait_for_ranks("site-b", lambda e: e["kind"] == "step" and e["step"] >= 3)
        job.kill_site("site-b")  # both ranks and their torchrun, mid-run
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
        # Rank k heals its own half of θg and of the outer optimizer state from rank k of site-a, not the whole.
        assert metrics["diloco/heal_bytes"] < 2 * 4 * numel, (metrics["diloco/heal_bytes"], numel)
