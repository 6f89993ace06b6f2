"""`benchmarks.lowrank_split` runs end to end on a tiny fragment (2 workers x 2 ranks of real gloo processes)."""

from __future__ import annotations

import json

import pytest

from benchmarks import lowrank_split


@pytest.mark.timeout(180)
def test_smoke_measures_a_split_low_rank_sync(tmp_path):
    out = tmp_path / "result.json"
    tiny = ["--layers", "1", "--hidden", "32", "--intermediate", "64", "--vocab", "128", "--rank", "2"]
    lowrank_split.main([*tiny, "--rounds", "2", "--json", str(out)])
    result = json.loads(out.read_text())
    assert len(result["per_rank"]) == 4 and result["max"]["cpu_seconds"] > 0
    # the factors and the matrix straddling the cut, far from the (D - 1) / D of the fragment a gather sends
    assert 0 < result["max"]["intra_bytes"] < 0.25 * result["numel"] * 4
    assert result["max"]["sent_bytes"] > 0
