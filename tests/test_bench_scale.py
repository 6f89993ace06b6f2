"""Smoke run of `python -m benchmarks.scale`: the two D = 2 workers (replicated and FSDP2) on a 27k-parameter Llama,
one launch, two syncs each; the bytes inside the worker and the outer state match what is known without them."""

from __future__ import annotations

import json
import shlex

import pytest

from benchmarks import scale

# hidden 32 (4 heads of 8, 2 key-value heads), MLP 64, 2 layers, vocabulary 128, untied head: embeddings 2 x 128 x 32,
# per layer q 32x32 + k, v 16x32 + o 32x32 + MLP 3 x 32x64 + 2 norms of 32, and the final norm.
LAYER = 32 * 32 + 2 * 16 * 32 + 32 * 32 + 3 * 32 * 64 + 2 * 32
SMOKE_PARAMETERS = 2 * 128 * 32 + 2 * LAYER + 32
GUARD_BYTES = 64  # the scalars a sync's guards combine inside the worker (a few float64 values)


@pytest.mark.timeout(240)
def test_scale_smoke_counts_the_bytes_inside_the_worker(tmp_path):
    out = tmp_path / "scale"
    result = scale.main(["--smoke", "--configs", "D=2 DDP", "D=2 FSDP", "--out", str(out)])
    stored = json.loads(out.with_suffix(".json").read_text())
    assert stored["parameters"] == SMOKE_PARAMETERS == result["parameters"]
    assert stored["largest_unit"] == LAYER  # a decoder layer outweighs the root's embeddings, head and norm
    ddp, fsdp = stored["configs"]["D=2 DDP"], stored["configs"]["D=2 FSDP"]
    for row in (ddp, fsdp):
        assert row["measured"]["syncs"] == 2
        # plain DiLoCo's 16 fp32 bytes per parameter, each rank holding 1/D of them
        assert row["measured"]["outer_state_bytes"] == 16 * SMOKE_PARAMETERS // 2
        assert row["measured"]["cpu_seconds_per_sync"] > 0
    # DDP: each rank sends its half of the updated fp32 parameters to the other rank, once per sync.
    assert ddp["formula"]["intra_worker_bytes_per_sync"] == 4 * SMOKE_PARAMETERS / 2
    assert 0 <= ddp["measured"]["intra_worker_bytes_per_sync"] - 4 * SMOKE_PARAMETERS / 2 <= GUARD_BYTES
    # FSDP2: nothing gathered, the model stays sharded; only the guards' scalars.
    assert fsdp["formula"]["intra_worker_bytes_per_sync"] == 0
    assert 0 < fsdp["measured"]["intra_worker_bytes_per_sync"] <= GUARD_BYTES
    table = out.with_suffix(".md").read_text()
    assert "| D=2 DDP |" in table and "| D=2 FSDP |" in table and "(0.1 MB) |" in table


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
