"""`scripts/bench_entropy_coding.py` runs and measures what the exchange does (a smoke run on a small payload)."""

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_entropy_coding.py"


@pytest.mark.timeout(120)
def test_throughput_script_round_trips_and_reports_every_thread_count():
    spec = importlib.util.spec_from_file_location("bench_entropy_coding", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    # ~3.3 MB of fp4 codes and scales: several 1 MiB pieces, the last one partial; a length the script must pad.
    results = module.main(["--numel", str(6 * 2**20 + 1000), "--threads", "1", "2", "--repeats", "1"])
    assert [r["threads"] for r in results] == [1, 2]
    for r in results:
        assert r["deflate_mb_per_s"] > 0 and r["inflate_mb_per_s"] > 0
        assert 0.8 < r["deflated_share"] < 0.95  # Gaussian fp4 codes: ~0.89 of the payload (BENCHMARKS.md)
    assert results[0]["deflated_share"] == results[1]["deflated_share"]  # threads change nothing in the bytes
