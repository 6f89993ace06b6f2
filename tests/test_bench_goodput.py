"""`benchmarks.goodput`: four sites through a store and through the elastic gloo path under one fault schedule, and
the store without faults (a smoke run of `--quick`); its counting store and its arithmetic."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from benchmarks import goodput
from benchmarks.store_counts import CountingStore, kind_of, manifest_tokens


@pytest.mark.timeout(900)
def test_quick_run_measures_each_run_in_its_window(tmp_path, capsys):
    out = tmp_path / "goodput"
    report = goodput.main(["--quick", "--out", str(out), "--work", str(tmp_path / "work")])
    runs = report["runs"]
    assert list(runs) == ["store_faults", "elastic_faults", "store_clean"]
    tokens_per_step = 2 * 64  # --quick: 2 sequences of 64 tokens
    for name, run in runs.items():
        # Every site but the one killed on purpose reached the end; through the Lighthouse, the restarted one may
        # still be waiting for a group when the few seconds of --quick are over (the gloo path's own cost).
        allowed = {"site1_1"} if name == "elastic_faults" else set()
        assert set(run["unfinished_sites"]) <= allowed, (name, run["unfinished_sites"])
        assert run["rounds"] >= 2 and run["tokens_into_theta"] > 0, name
        assert run["tokens_into_theta"] <= run["tokens_trained"], name  # nothing enters θg that was not trained
        assert run["tokens_into_theta"] % tokens_per_step == 0 and run["tokens_trained"] % tokens_per_step == 0
        assert math.isclose(run["goodput_tokens_per_second"], run["tokens_into_theta"] / run["window_seconds"])
        assert all(1 <= sites <= 4 for sites in run["sites_per_round"])
    for name in ("store_faults", "elastic_faults"):
        faults = runs[name]["faults"]
        assert list(sorted(faults, key=faults.get)) == ["kill", "restart", "stop", "continue"], faults
        # two rounds of H = 4 paced steps, from when each signal was sent (the stop a few ms late at worst)
        assert faults["continue"] - faults["stop"] >= 2 * 4 * 0.15 - 0.05
    # Through the store nobody waits for the slowed site: it trains about half the steps of the healthy one.
    trained = runs["store_faults"]["tokens_trained_by_site"]
    assert trained["site2_0"] < 0.75 * trained["site0_0"]
    assert "killed_site_back_seconds" not in runs["store_clean"]
    at = report["eval"]["tokens"]["all_runs"]
    assert at == min(run["tokens_into_theta"] for run in runs.values())
    for name in runs:
        assert math.isfinite(report["eval"]["losses"][name]["all_runs"]), name
    table = out.with_suffix(".md").read_text()
    assert table.startswith("| | store, faults | elastic gloo, faults | store, no faults |")
    assert f"| eval loss at {at:,.0f} tokens (every run) |" in table and table in capsys.readouterr().out
    stored = json.loads(out.with_suffix(".json").read_text())
    assert stored["command"].startswith("python -m benchmarks.goodput --quick") and "secret" not in stored["settings"]


def test_loss_at_equal_tokens_is_linear_between_rounds():
    metas = [(Path("a"), {"tokens": 100.0}), (Path("b"), {"tokens": 300.0}), (Path("c"), {"tokens": 400.0})]
    losses = {"a": 5.0, "b": 4.0, "c": 3.5}

    def loss_of(path: Path) -> float:
        return losses[path.name]

    assert goodput.at_tokens(metas, 200.0, loss_of) == pytest.approx(4.5)
    assert goodput.at_tokens(metas, 300.0, loss_of) == 4.0
    assert math.isnan(goodput.at_tokens(metas, 50.0, loss_of))  # before the first round
    assert math.isnan(goodput.at_tokens(metas, 500.0, loss_of))  # the run never got that many tokens in


def test_fault_schedule_and_arguments():
    args = goodput.parse(["--window_seconds", "100", "--inner_steps", "10", "--pace_seconds", "0.5",
                          "--kill_at", "0.2", "--restart_after_seconds", "5", "--pause_at", "0.5"])  # fmt: skip
    assert goodput.fault_times(args, 1000.0) == [(1020.0, "kill"), (1025.0, "restart"), (1050.0, "stop"),
                                                 (1060.0, "continue")]  # fmt: skip
    for bad in (["--runs", "store_faults,nope"], ["--sync_delay", "0"], ["--kill_at", "0.7", "--pause_at", "0.5"],
                ["--window_seconds", "20", "--pause_at", "0.9"]):  # fmt: skip
        with pytest.raises(SystemExit):
            goodput.parse(bad)


def test_counting_store_counts_by_kind_and_keeps_verified_manifests(tmp_path):
    """Against a real folder store, written by the store's own board: every request counted by operation and kind,
    and a round's manifest kept as the job's key verifies it (one sealed with another secret is not)."""
    from hf_diloco import open_store
    from hf_diloco.core.store.board import RoundBoard
    from hf_diloco.core.store.manifest import Manifest, weigh
    from hf_diloco.core.store.objects import BoundedStore
    from hf_diloco.core.store.sealing import JobKeys

    counting = CountingStore(open_store(f"file://{tmp_path}/store"), b"secret")
    board = RoundBoard(BoundedStore(counting, 10.0), JobKeys(b"secret"), "site-a", "0" * 12, 0, 1)
    board.job_id = "job"
    board.put_share(0, 0, bytes(64), [["w", 0, 128]], "fp4")
    board.put_record(0, 0, 512.0, [{"sha256": "0" * 64, "segments": [["w", 0, 128]]}], final=False, norm=1.0)
    found = board.contributions(0, range(0, 1), final=False)
    board.decide(Manifest(0, 1, "site-a", weigh(found, 1, 2)))
    assert board.manifest(0, 1) is not None
    counts = counting.snapshot()["requests"]
    assert counts["put/share"] == counts["put/record"] == counts["put/manifest"] == 1
    assert counts["list/record"] == 1 and counts["get/record"] == 1 and counts["get/manifest"] == 1
    assert manifest_tokens(counting.manifests[0, 1]) == 512.0
    assert counting.manifests[0, 1]["entries"][0]["site"] == "site-a"
    stranger = CountingStore(open_store(f"file://{tmp_path}/store"), b"another secret")
    stranger.get(board.names.manifest(0, 1))
    assert stranger.manifests == {}
    assert [kind_of(key) for key in ("f0/c/00000001/", "f0/m/00000002-ab", "f1/s/00000000/done-ab", "sites/x-ab",
                                     "job-ab", "probes/x")] == ["record", "manifest", "snapshot", "heartbeat", "job",
                                                               "probe"]  # fmt: skip
