"""`benchmarks.scaling`: bytes per rank per sync of both exchange patterns against their definitions (a smoke run)."""

import json

import pytest

from benchmarks import scaling

MODEL = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2}


@pytest.mark.timeout(600)
def test_bytes_per_sync_match_the_pattern_formulas(tmp_path):
    rows = scaling.main(
        ["--workers", "2", "3", "--rounds", "2", "--model", json.dumps(MODEL), "--out", str(tmp_path / "scaling")]
    )
    assert [(r["workers"], r["pattern"]) for r in rows] == [
        (m, p) for m in (2, 3) for p in ("reduce_scatter", "all_gather")
    ]
    for row in rows:
        m, numel = row["workers"], row["parameters"]
        padded = -(-numel // (m * 128)) * m * 128  # whole fp4 blocks of 128 values in each of the M chunks
        payload = padded // 2 + padded // 128 * 4  # 4-bit codes and an fp32 scale per block
        per_rank = 2 * (m - 1) / m * payload if row["pattern"] == "reduce_scatter" else (m - 1) * payload
        per_rank += (m - 1) * (24 + 4)  # the schedule tag every worker checks first, the norm robust clipping gathers
        assert row["payload_bytes"] == payload
        assert row["bytes_per_sync"] == [pytest.approx(per_rank)] * m
        assert row["sync_seconds"] > 0
    assert (tmp_path / "scaling.md").read_text().count("`all_gather`") == 2
