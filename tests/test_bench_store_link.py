"""`benchmarks.store_link`: rounds through an S3 server behind a tbf-shaped veth link, against the gloo path on that
link. Its arithmetic, and a smoke run of `--quick` over a real link between network namespaces (needs root and
iproute2, as tests/test_bench_wan_smoke.py; without them the test fails saying so)."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from benchmarks import store_link


def test_help_and_arguments(capsys):
    with pytest.raises(SystemExit) as exit_info:
        store_link.main(["--help"])
    assert exit_info.value.code == 0 and "tc ... tbf rate R" in capsys.readouterr().out
    for bad in (["--runs", "store_blocking,nope"], ["--sites", "4"], ["--sync_delay", "40"]):
        with pytest.raises(SystemExit):
            store_link.parse(bad)


def _events(store: bool, rounds: list[tuple[int, int, float]], inner_steps: int = 4) -> list[dict]:
    """A site's event log: one round per (bytes up, bytes down, seconds of its launching step)."""

    def stats(up: int, down: int) -> dict:
        return {"store_bytes_up": up, "store_bytes_down": down} if store else {"bytes_sent": up}

    counts = {"requests": {"put/share": 0}, "bytes": {}}
    events = [{"kind": "training", "stats": stats(0, 0), "counts": counts, "cpu": 1.0}]
    up = down = 0
    step = 0
    for number, (up_bytes, down_bytes, seconds) in enumerate(rounds, start=1):
        for _ in range(inner_steps):
            step += 1
            engine = seconds if step == number * inner_steps else 0.0
            events.append({"kind": "step", "step": step, "start": step, "computed": step + 0.5,
                           "stepped": step + 0.5 + engine})  # fmt: skip
        up, down = up + up_bytes, down + down_bytes
        counts = {"requests": {"put/share": number}, "bytes": {}}
        events.append({"kind": "round", "step": step, "final": False, "stats": stats(up, down), "counts": counts})
    return [*events, {"kind": "loop_done", "cpu": 6.0}]


def test_figures_per_round_and_the_time_bytes_take_at_the_rate():
    logs = [_events(True, [(100, 300, 2.0), (100, 300, 3.0)]), _events(True, [(120, 280, 1.0), (100, 300, 4.0)])]
    args = store_link.parse(["--inner_steps", "4", "--sync_delay", "2"])
    run = store_link.run_figures("store_blocking", logs, args)
    assert run["rounds"] == 2
    assert run["link_up_bytes_per_round"] == [220, 200] and run["link_down_bytes_per_round"] == [580, 600]
    assert run["exchange_seconds_per_round"] == [2.0, 4.0]  # the slower site's launching step
    assert run["up_bytes_per_site_round"] == 105 and run["down_bytes_per_site_round"] == 295
    assert run["requests_per_site_round"] == {"put/share": 1.0}
    # a store round: the uploads, then the downloads, one after the other, at the rate
    assert store_link.expected_seconds(run, 100.0) == [8.0, 8.0]
    gloo = store_link.run_figures("gloo_blocking", [_events(False, [(100, 0, 1.0)]), _events(False, [(100, 0, 1.0)])],
                                  args)  # fmt: skip
    assert gloo["link_up_bytes_per_round"] == gloo["link_down_bytes_per_round"] == [200]
    assert store_link.expected_seconds(gloo, 100.0) == [1.0]  # each worker's 100 bytes, both directions at once
    # 8 steps of 0.5 s compute each; the loop from the first start to the last end
    assert run["utilization_by_site"][0] == pytest.approx(4.0 / (8.5 + 3.0 - 1))
    assert run["compute_seconds"] == 4.0 and run["cpu_seconds"] == 5.0


def test_requests_are_checked_against_the_formulas_round_by_round():
    def entry(polls: int, bases: int, lost: bool = False, lists: int | None = None) -> dict:
        requests = {"get/manifest": polls + 2 + lost, "list/record": (polls - 1) * bases if lists is None else lists,
                    "put/share": 1, "put/record": 1, "put/heartbeat": 1, "get/record": 2, "get/share": 1,
                    "put/manifest": 1}  # fmt: skip
        return {"requests": requests, "bytes": {"put/manifest": 0 if lost else 700}}

    # rounds 1, 2, 3 list 1, 2, 3 bases (max_staleness 2); a lost race reads the winner's manifest once more
    site = {"rounds": [entry(4, 1), entry(2, 2, lost=True), entry(5, 3), entry(3, 3, lists=5)]}
    assert store_link.formula_matches([site], sites=2) == [3, 4]


@pytest.mark.timeout(600)
def test_quick_run_over_a_shaped_link(tmp_path):
    if os.geteuid() != 0:
        pytest.fail("the store link benchmark creates network namespaces and needs root; run the suite as root")
    if shutil.which("ip") is None or shutil.which("tc") is None:
        pytest.fail("ip and tc not found: install iproute2 (apt-get install iproute2) to run this test")
    report = store_link.main(["--quick", "--out", str(tmp_path / "link"), "--work", str(tmp_path / "work")])
    runs = report["runs"]
    assert list(runs) == list(store_link.RUNS)
    assert 0.5 * 50e6 / 8 < report["tcp"]["bytes_per_second"] < 1.1 * 50e6 / 8  # the link's own rate, near tbf's
    for name, run in runs.items():
        assert run["rounds"] == 2 and 0 < run["utilization"] <= 1, name
    store, gloo = runs["store_blocking"], runs["gloo_blocking"]
    # A site writes its encoded share once and reads the other site's: about one payload each way, as gloo sends.
    assert 0.9 < store["up_bytes_per_site_round"] / gloo["up_bytes_per_site_round"] < 1.2
    assert 0.9 < store["down_bytes_per_site_round"] / gloo["down_bytes_per_site_round"] < 1.2
    requests = store["requests_per_site_round"]
    assert requests["put/share"] == requests["put/record"] == requests["put/heartbeat"] == 1
    # One manifest per round between two sites: 0.5 per site, up to 1 where both saw the quorum at once and both
    # tried to create it (the create-if-absent keeps one: tests/test_store.py's race).
    assert 0.5 <= requests["put/manifest"] <= 1 and requests["get/share"] == 1 and requests["get/record"] == 2
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"hfdwan{os.getpid()}-" not in namespaces  # the link is gone
