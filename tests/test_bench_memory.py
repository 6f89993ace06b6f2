"""Smoke run of `python -m benchmarks.memory`: one launch (2 one-rank workers, a 45k-parameter Llama, one outer
round and a streaming fragment in flight) writes its JSON and table, and its numbers match what is known without it."""

from __future__ import annotations

import json

import pytest

from benchmarks import memory

# hidden 32 (4 heads of 8, 2 key-value heads), MLP 64, 4 layers, vocabulary 128, untied head: embeddings 2 x 128 x 32,
# per layer q 32x32 + k, v 16x32 + o 32x32 + MLP 3 x 32x64 + 2 norms of 32, and the final norm.
SMOKE_PARAMETERS = 2 * 128 * 32 + 4 * (32 * 32 + 2 * 16 * 32 + 32 * 32 + 3 * 32 * 64 + 2 * 32) + 32
LLAMA_2_7B_PARAMETERS = 6_738_415_616  # the published count of Llama 2 7B


@pytest.mark.timeout(300)
def test_memory_benchmark_writes_its_table(tmp_path):
    out = tmp_path / "memory"
    argv = ["--hidden", "32", "--layers", "4", "--vocab", "128", "--steps", "10", "--ranks", "1"]
    memory.main([*argv, "--modes", "diloco", "streaming", "--out", str(out)])
    result = json.loads(out.with_suffix(".json").read_text())
    assert result["parameters"] == SMOKE_PARAMETERS
    assert result["command"].startswith("python -m benchmarks.memory --hidden 32")
    # Plain DiLoCo holds θg, the outer momentum and the reused pseudo-gradient and average buffers, all fp32: 16
    # bytes per parameter, nothing in flight after step 10 (H = 8).
    assert result["outer_state_bytes"]["diloco"] == {"D=1 DDP": 16 * SMOKE_PARAMETERS}
    assert result["outer_state_bytes"]["streaming"]["D=1 DDP"] > 8 * SMOKE_PARAMETERS  # a fragment in flight
    seven_b = result["projection"]["diloco"]["7B"]
    assert seven_b["parameters"] == LLAMA_2_7B_PARAMETERS
    assert seven_b["sharded_per_rank"] == pytest.approx(2 * LLAMA_2_7B_PARAMETERS)  # 16 bytes / parameter / 8 ranks
    assert seven_b["replicated_per_node"] == pytest.approx(128 * LLAMA_2_7B_PARAMETERS)
    rss = result["rss"]["D=1 DDP"]
    # The smoke model's outer state (0.73 MB) can fit in memory the process had already touched before the engine
    # existed, so its part of the peak may be 0 here; at the benchmark's size it is hundreds of MB.
    assert 0 <= rss["engine_rss_bytes"] < rss["peak_rss_bytes"]
    table = out.with_suffix(".md").read_text()
    assert "| DiLoCo | 0.73 MB (1.00x) |" in table and "| D=1 DDP |" in table


def test_memory_benchmark_needs_one_rank_per_worker_as_its_baseline(capsys):
    with pytest.raises(SystemExit):
        memory.main(["--ranks", "2", "4"])
    assert "--ranks must include 1" in capsys.readouterr().err
