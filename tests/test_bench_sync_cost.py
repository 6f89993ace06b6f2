"""`benchmarks.sync_cost` and `benchmarks.projection`: smoke runs in seconds, and the projection's arithmetic
against the formulas written out here."""

import json
from pathlib import Path

import pytest

from benchmarks import projection, sync_cost

ROOT = Path(__file__).resolve().parents[1]
STAGES = (
    "copy",
    "fresh copy",
    "flatten",
    "pseudo-gradient",
    "unflatten",
    "outer step",
    "verdict",
    "fp4 deflate",
    "fp4 inflate",
)


@pytest.fixture(scope="module")
def costs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("costs") / "sync_cost"
    sync_cost.main(
        [
            "--sizes",
            "0.05",
            "0.1",
            "--threads",
            "1",
            "2",
            "--repeats",
            "1",
            "--codecs",
            "fp4",
            "sign",
            "--before",
            "HEAD",
            "--out",
            str(out),
        ]
    )
    return Path(f"{out}.json")


@pytest.mark.timeout(300)
def test_every_stage_is_timed_at_every_size_and_thread_count(costs):
    result = json.loads(costs.read_text())
    rows = result["rows"]
    for size in (48 * 1024, 97 * 1024):  # 0.05 and 0.1 M parameters in whole 1024-value rows
        for threads in (1, 2):
            timed = {r["stage"] for r in rows if r["parameters"] == size and r["threads"] == threads}
            assert timed == {*STAGES, *(f"{c} {s}" for c in ("fp4", "sign") for s in ("encode", "decode", "sum"))}
    assert all(r["gb_per_second"] > 0 and r["gb_per_cpu_second"] > 0 for r in rows)
    assert set(result["default_round_seconds_per_gb"]) == set(result["default_round_cpu_seconds_per_gb"]) == {"1", "2"}
    assert costs.with_suffix(".md").read_text().count("| fp4 encode |") == 2


@pytest.mark.timeout(300)
def test_a_git_revision_is_timed_side_by_side_with_its_own_code(costs):
    result = json.loads(costs.read_text())
    assert result["before"] == ["HEAD"]
    before = {(r["stage"], r["parameters"], r["threads"]) for r in result["rows"] if r["version"] == "HEAD"}
    for size in (48 * 1024, 97 * 1024):
        for threads in (1, 2):
            assert {("pseudo-gradient", size, threads), ("fp4 encode", size, threads)} <= before
    assert set(result["default_round_cpu_seconds_per_gb_before"]["HEAD"]) == {"1", "2"}
    table = costs.with_suffix(".md").read_text()
    assert table.count("| pseudo-gradient (HEAD) |") == 2 and "The same round with the code of HEAD" in table


@pytest.mark.timeout(300)
def test_projection_bytes_period_and_host_time_follow_the_formulas(costs, capsys):
    rows = projection.main(
        ["--costs", str(costs), "--links", "1", "--settings", "4,100,1", "--link_efficiency", "0.8"]
    )
    row = next(r for r in rows if r["model"] == "7B")
    parameters, gpus, batch, tokens_per_second = 6_658_859_008, 8, 98_304, 85_144  # llm-foundry's 7B row
    fp4_bytes = parameters / 4 * (4 + 32 / 128) / 8  # one fragment: 4-bit codes, an fp32 scale per 128 values
    assert row["bytes_per_sync"] == pytest.approx(fp4_bytes)  # reduce_scatter, M = 2: 2 (M - 1) / M = 1 payload
    assert row["transfer_seconds"] == pytest.approx(fp4_bytes * 8 / (1e9 * 0.8))
    step = batch / tokens_per_second
    assert row["period_seconds"] == pytest.approx(100 / 4 * step) and row["window_seconds"] == pytest.approx(step)
    rate = {
        r["stage"]: r["gb_per_cpu_second"]
        for r in json.loads(costs.read_text())["rows"]
        if r["threads"] == 1 and r["parameters"] == 97 * 1024 and r["version"] == "package"
    }
    per_rank_gb = parameters * 4 / 1e9 / 4 / gpus
    main = per_rank_gb * sum(1 / rate[s] for s in ("pseudo-gradient", "outer step", "unflatten"))
    exchange = per_rank_gb * (1.5 / rate["fp4 encode"] + 1 / rate["fp4 sum"] + 1 / rate["fp4 decode"])
    assert row["main_seconds"] == pytest.approx(main) and row["exchange_seconds"] == pytest.approx(exchange)
    # Inside the worker: (D - 1) / D of the fragment in bf16 over NVLink at 300 GB/s; 2 / D of it over PCIe at 25 GB/s.
    intra_bytes = (gpus - 1) / gpus * parameters / 4 * 2
    assert row["intra_worker_bytes"] == pytest.approx(intra_bytes)
    assert row["intra_worker_seconds"] == pytest.approx(intra_bytes / 300e9)
    assert row["host_copy_seconds"] == pytest.approx(2 * parameters / 4 / gpus * 2 / 25e9)
    stall = max(0.0, exchange + row["transfer_seconds"] - step)
    training_thread = main + row["intra_worker_seconds"] + row["host_copy_seconds"]
    assert row["utilization"] == pytest.approx(
        row["period_seconds"] / (row["period_seconds"] + training_thread + stall)
    )
    assert "| 7B (8, 1.15 s) | 4 | 100 | 1 | 1 Gbit/s |" in capsys.readouterr().out


@pytest.mark.timeout(300)
def test_projection_predicts_every_diloco_and_streaming_run_of_a_wan_result(costs, tmp_path):
    wan = json.loads((ROOT / "benchmarks/results/wan_results.json").read_text())
    with_none = json.loads(costs.read_text())
    for row in list(with_none["rows"]):  # the diloco runs send fp32: give `none` the costs of fp4 here
        if row["stage"].startswith("fp4 "):
            with_none["rows"].append({**row, "stage": row["stage"].replace("fp4", "none", 1)})
    path = tmp_path / "costs.json"
    path.write_text(json.dumps(with_none))
    rows = projection.main(["--costs", str(path), "--validate", str(ROOT / "benchmarks/results/wan_results.json")])
    expected = [(r["method"], r["rate_mbit"]) for r in wan["runs"] if r["method"] in ("diloco", "streaming")]
    assert [(r["method"], r["rate_mbit"]) for r in rows] == expected
    assert all(0 < r["predicted"] <= 1 and r["measured"] > 0 for r in rows)
