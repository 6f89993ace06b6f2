"""Plumbing of `python -m benchmarks.peers`: the implementations train a tiny Llama on 2 real gloo processes each
(torchft under a real Lighthouse), every sync is timed, and the fp32 DiLoCo ones end each round with the same θg."""

from __future__ import annotations

import json

import pytest

from benchmarks import peers

pytest.importorskip("torchft", reason="the peers benchmark runs torchft's DiLoCo: pip install 'hf_diloco[elastic]'")

ROUNDS, H = 2, 2


@pytest.mark.timeout(600)
def test_peers_time_every_sync_and_agree_on_theta_g(tmp_path):
    implementations = ["hf_diloco", "torchft", "reference", "accelerate"]
    out = tmp_path / "peers"
    argv = ["--sizes", "0", "--inner-steps", str(H), "--rounds", str(ROUNDS), "--seq-len", "16", "--out", str(out)]
    peers.main([*argv, "--implementations", *implementations])
    stored = json.loads(out.with_suffix(".json").read_text())
    assert [row["implementation"] for row in stored["rows"]] == implementations
    for row in stored["rows"]:
        assert row["parameters"] == stored["rows"][0]["parameters"] > 0
        assert row["syncs_timed"] == 2 * (ROUNDS - 1)  # both workers, every round after the first
        assert row["sync_cpu_s"] > 0 and row["step_cpu_s"] > row["step_overhead_cpu_s"] >= 0
    diffs = stored["theta_g_max_abs_diff"]["0"]
    assert set(diffs) == {"hf_diloco vs reference", "hf_diloco vs torchft", "reference vs torchft"}
    for pair in diffs.values():
        assert len(pair) == ROUNDS and max(pair) < 1e-6
    assert stored["theta_g_max_abs_change_first_to_last_round"]["0"] > 1e-4  # θg moved: the agreement is not vacuous
    assert "| torchft |" in out.with_suffix(".md").read_text()
