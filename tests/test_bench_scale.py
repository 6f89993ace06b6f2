"""Smoke run of `python -m benchmarks.scale`: the D = 2 workers (replicated in fp32 and in bf16, FSDP2) and the
S = 2 pipelined worker on a 27k-parameter Llama, one launch, two syncs each; the bytes inside the worker, the outer
state and each stage's parameters match what is known without them. The stored full-size results hold every
configuration, meet the memory target and count the bytes inside the worker in the parameters' dtype."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from benchmarks import scale

# hidden 32 (4 heads of 8, 2 key-value heads), MLP 64, 2 layers, vocabulary 128, untied head: embeddings 2 x 128 x 32,
# per layer q 32x32 + k, v 16x32 + o 32x32 + MLP 3 x 32x64 + 2 norms of 32, and the final norm.
LAYER = 32 * 32 + 2 * 16 * 32 + 32 * 32 + 3 * 32 * 64 + 2 * 32
SMOKE_PARAMETERS = 2 * 128 * 32 + 2 * LAYER + 32
# Two pipeline stages of one layer each: the first holds the embeddings, the last the final norm and the head.
STAGE_0, STAGE_1 = 128 * 32 + LAYER, LAYER + 32 + 128 * 32
GUARD_BYTES = 64  # the scalars a sync's guards combine inside the worker (a few float64 values)


@pytest.mark.timeout(300)
def test_scale_smoke_counts_the_bytes_inside_the_worker(tmp_path):
    out = tmp_path / "scale"
    configs = ["D=2 DDP", "D=2 DDP bf16", "D=2 FSDP", "S=2 pipeline"]
    result = scale.main(["--smoke", "--configs", *configs, "--out", str(out)])
    stored = json.loads(out.with_suffix(".json").read_text())
    assert stored["parameters"] == SMOKE_PARAMETERS == result["parameters"]
    assert stored["largest_unit"] == LAYER  # a decoder layer outweighs the root's embeddings, head and norm
    assert stored["largest_stage"] == STAGE_1 > STAGE_0  # the last stage: the first one's embeddings plus the norm
    ddp, bf16, fsdp, pipeline = (stored["configs"][label] for label in configs)
    for row in (ddp, bf16, fsdp):
        assert row["measured"]["syncs"] == 2
        # plain DiLoCo's 16 fp32 bytes per parameter, each rank holding 1/D of them, whatever the parameters' dtype
        assert row["measured"]["outer_state_bytes"] == 16 * SMOKE_PARAMETERS // 2
        assert row["measured"]["cpu_seconds_per_sync"] > 0
    # DDP: each rank sends its half of the updated parameters to the other rank, once per sync, in their dtype.
    for row, dtype_bytes in ((ddp, 4), (bf16, 2)):
        assert row["formula"]["intra_worker_bytes_per_sync"] == dtype_bytes * SMOKE_PARAMETERS / 2
        assert 0 <= row["measured"]["intra_worker_bytes_per_sync"] - dtype_bytes * SMOKE_PARAMETERS / 2 <= GUARD_BYTES
    assert (ddp["dtype"], bf16["dtype"]) == ("float32", "bfloat16")
    # FSDP2: nothing gathered, the model stays sharded; only the guards' scalars.
    assert fsdp["formula"]["intra_worker_bytes_per_sync"] == 0
    assert 0 < fsdp["measured"]["intra_worker_bytes_per_sync"] <= GUARD_BYTES
    # The pipeline: each rank trains and syncs its own stage only, alone among its stage's ranks of the worker.
    assert pipeline["measured"]["syncs"] == 2
    assert pipeline["measured"]["trained_parameters"] == STAGE_1  # the largest over the ranks
    assert pipeline["measured"]["outer_state_bytes"] == 16 * STAGE_1
    assert (
        pipeline["measured"]["intra_worker_bytes_per_sync"] == pipeline["formula"]["intra_worker_bytes_per_sync"] == 0
    )
    assert pipeline["formula"]["rss_above_baseline_bytes"] == max(4 * SMOKE_PARAMETERS, STAGE_1 * (4 * 4 + 16))
    table = out.with_suffix(".md").read_text()
    for label in configs:
        assert f"| {label} |" in table
    assert "(0.1 MB) |" in table


def test_rerun_command_names_one_configuration():
    argv = ["--hidden", "64", "--configs", "D=1", "D=2 FSDP", "--out", "x"]
    assert scale.argv_without_configs(argv) == ["--hidden", "64", "--out", "x"]


def test_a_configuration_without_the_memory_is_recorded_with_its_command(tmp_path, monkeypatch):
    monkeypatch.setattr(scale, "_available_bytes", lambda: 2**30)  # 1 GiB free: less than any configuration needs
    out = tmp_path / "scale"
    result = scale.main(["--smoke", "--configs", "D=1", "D=2 FSDP", "--out", str(out)])
    for label in ("D=1", "D=2 FSDP"):
        row = result["configs"][label]
        assert "measured" not in row and "1.0 GiB available" in row["not_run"]
        assert row["command"] == f"python -m benchmarks.scale --smoke --out {out} --configs {shlex.quote(label)}"
    assert result["target_met"] is None
    assert "not run: 1.0 GiB available" in out.with_suffix(".md").read_text()


FULL_RESULTS = Path(scale.RESULTS_DIR) / "scale.json"


def test_stored_results_hold_every_configuration_and_meet_the_target():
    stored = json.loads((Path(__file__).resolve().parents[1] / FULL_RESULTS).read_text())
    assert stored["parameters"] >= 250_000_000
    assert set(stored["configs"]) == set(scale.CONFIGS)
    rows = stored["configs"]
    assert all("measured" in row for row in rows.values()), "a configuration was not run"
    for label in scale.REDUCED:  # the sharded and the pipelined host peaks, against the unsharded one
        assert rows[label]["peak_rss_vs_unsharded"] <= 0.6, label
    assert stored["target_met"] is True
    n = stored["parameters"]
    for label, dtype_bytes in (("D=2 DDP", 4), ("D=2 DDP bf16", 2)):
        row = rows[label]
        assert row["dtype"] == {4: "float32", 2: "bfloat16"}[dtype_bytes]
        assert row["formula"]["intra_worker_bytes_per_sync"] == n * dtype_bytes / 2
        assert 0 <= row["measured"]["intra_worker_bytes_per_sync"] - n * dtype_bytes / 2 <= GUARD_BYTES
    for label in ("D=1", "D=2 FSDP", "S=2 pipeline"):
        assert rows[label]["measured"]["intra_worker_bytes_per_sync"] <= GUARD_BYTES
    assert rows["S=2 pipeline"]["measured"]["trained_parameters"] == stored["largest_stage"] < n
