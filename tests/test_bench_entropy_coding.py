"""`benchmarks.entropy_coding` runs and measures what the exchange does (a smoke run on a small payload)."""

import pytest

from benchmarks import entropy_coding


@pytest.mark.timeout(120)
def test_throughput_script_round_trips_and_reports_every_thread_count():
    # ~3.3 MB of fp4 codes and scales: several 1 MiB pieces, the last one partial; a length the script must pad.
    results = entropy_coding.main(["--numel", str(6 * 2**20 + 1000), "--threads", "1", "2", "--repeats", "1"])
    assert [r["threads"] for r in results] == [1, 2]
    for r in results:
        assert r["deflate_mb_per_s"] > 0 and r["inflate_mb_per_s"] > 0
        assert 0.8 < r["deflated_share"] < 0.95  # Gaussian fp4 codes: ~0.89 of the payload (BENCHMARKS.md)
    assert results[0]["deflated_share"] == results[1]["deflated_share"]  # threads change nothing in the bytes
