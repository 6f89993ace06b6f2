"""Smoke run of `python -m benchmarks.link_rate` over a real tbf-shaped veth pair between two network namespaces.

Needs root and iproute2 (CI runs as root); without them the test fails with a message saying so.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(300)
def test_one_exchange_and_tcp_over_a_shaped_link(tmp_path):
    if os.geteuid() != 0 or shutil.which("tc") is None:
        pytest.fail("benchmarks.link_rate needs root and iproute2 (it creates network namespaces); run as root")
    out = tmp_path / "link_rate.json"
    command = [sys.executable, "-m", "benchmarks.link_rate", "--rates", "50", "--megabytes", "1", "--repeats", "1"]
    command += ["--modes", "tcp,point_to_point,exchange", "--codecs", "none", "--out", str(out)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {row["mode"]: row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"tcp", "point_to_point", "exchange_none"}
    # 1 MB each way at 50 Mbit/s: 0.16 s at best; no measurement can beat the token bucket by more than its burst.
    for row in rows.values():
        assert row["nominal_seconds"] == pytest.approx(row["bytes_each_way"] * 8 / 50e6)
        assert row["median_seconds"] > 0.9 * row["nominal_seconds"], row
    # The exchange of a 250,000-value fp32 vector between 2 workers: half of it each way twice, and the schedule tag.
    assert rows["exchange_none"]["bytes_each_way"] == 250_000 * 4 + 24
    assert 0 < rows["exchange_none"]["transfer_seconds"] <= rows["exchange_none"]["median_seconds"]
