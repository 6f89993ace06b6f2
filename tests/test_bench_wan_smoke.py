"""Smoke run of `python -m benchmarks.wan --quick` over a real rate-limited veth pair between two network namespaces.

Needs root and iproute2 (CI runs as root); without them the tests fail with a message saying so.
"""

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.netns import parse_proc_net_dev, tbf_arguments

ROOT = Path(__file__).resolve().parents[1]
COMMAND = [sys.executable, "-m", "benchmarks.wan"]

METHODS = {"ddp", "diloco", "streaming", "diloco_x", "local"}
# --quick model: LlamaForCausalLM, vocab 256, hidden 64, MLP 256, 4 layers, untied embeddings.
VOCAB, HIDDEN, MLP, LAYERS = 256, 64, 256, 4
QUICK_STEPS, QUICK_H = 24, 12


def _require_netns() -> None:
    if os.geteuid() != 0:
        pytest.fail("the slow-link benchmark test needs root (it creates network namespaces); run the suite as root")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        pytest.fail(f"{missing} not found: install iproute2 (apt-get install iproute2) to run this test")


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _links() -> set[str]:
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    return {line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if ":" in line}


def _assert_gone(pid: int) -> None:
    assert not {f"hfdwan{pid}-0", f"hfdwan{pid}-1"} & _namespaces(), "the benchmark left its namespaces behind"
    assert not {f"hfw{pid}a", f"hfw{pid}b"} & _links(), "the benchmark left its veth pair behind"


def _run_quick(out_dir: Path, timeout: float) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        # Entropy coding on: the veth counters then also check the package's count of variable-length payloads.
        [*COMMAND, "--quick", "--entropy-coding", "--rates", "200", "--out-dir", str(out_dir)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # lets the script remove its namespaces
        output, _ = proc.communicate(timeout=60)
        pytest.fail(f"benchmarks.wan --quick took longer than {timeout}s:\n{output[-3000:]}")
    return proc, output


def _param_bytes() -> int:
    attention = 4 * HIDDEN * HIDDEN
    mlp = 3 * HIDDEN * MLP
    norms = 2 * HIDDEN
    return 4 * (2 * VOCAB * HIDDEN + LAYERS * (attention + mlp + norms) + HIDDEN)


@pytest.mark.timeout(300)
def test_quick_benchmark_reports_every_method_and_cleans_up(tmp_path):
    _require_netns()
    proc, output = _run_quick(tmp_path, timeout=240)
    assert proc.returncode == 0, output[-3000:]
    _assert_gone(proc.pid)

    report = json.loads((tmp_path / "wan_results.json").read_text())
    assert (tmp_path / "wan_utilization.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| 200 | diloco |" in (tmp_path / "wan_results.md").read_text()
    rows = {row["method"]: row for row in report["runs"]}
    assert set(rows) == METHODS
    for method, row in rows.items():
        assert row["status"] == "ok", (method, row.get("error"))
        assert row["steps_done"] == QUICK_STEPS, method
        assert row["tokens"] == 2 * QUICK_STEPS * 2 * 64, method  # 2 workers x steps x batch 2 x 64 tokens
        assert row["tokens_per_second"] > 0, method
        assert 0.0 < row["utilization"] <= 1.0, method
        assert 0.0 < row["utilization_incl_drain"] <= row["utilization"] + 1e-9, method
        assert math.isfinite(row["eval_loss"]) and 0.5 < row["eval_loss"] < math.log(VOCAB) + 0.1, method
        # Both ends of one veth: what one end transmitted, the other received.
        ranks = row["ranks"]
        for sender, receiver in ((0, 1), (1, 0)):
            tx, rx = ranks[sender]["veth_tx_bytes"], ranks[receiver]["veth_rx_bytes"]
            assert abs(tx - rx) <= 0.01 * max(tx, 1) + 4096, (method, tx, rx)

    grad_bytes = _param_bytes()
    assert rows["ddp"]["grad_bytes"] == grad_bytes
    # No communication at all in the compute-ceiling run.
    assert rows["local"]["wire_tx_bytes_per_rank"] < 4096
    # DDP all-reduces the whole gradient every step: each of 2 ranks sends about one gradient per step.
    ddp_ratio = rows["ddp"]["wire_tx_bytes_per_rank"] / (QUICK_STEPS * grad_bytes)
    assert 0.95 < ddp_ratio < 1.5, ddp_ratio
    # DiLoCo fp32, M = 2: per sync each rank sends half the vector in the all_to_all and half in the all_gather.
    assert rows["diloco"]["outer_steps"] == QUICK_STEPS // QUICK_H
    # plus the 24-byte schedule tag each worker sends its peer before every sync, and the 4-byte norm robust
    # clipping gathers
    per_sync = grad_bytes + 24 + 4
    assert rows["diloco"]["package_bytes_sent_per_rank"] == QUICK_STEPS // QUICK_H * per_sync
    for method in ("diloco", "streaming", "diloco_x"):
        package = rows[method]["package_bytes_sent_per_rank"]
        ratio = rows[method]["wire_tx_bytes_per_rank"] / package
        assert 0.95 < ratio < 1.5, (method, ratio)
    # Compressed methods put fewer bytes on the wire than fp32 DiLoCo, which puts far fewer than DDP.
    assert rows["streaming"]["wire_tx_bytes_per_rank"] < 0.5 * rows["diloco"]["wire_tx_bytes_per_rank"]
    assert rows["diloco"]["wire_tx_bytes_per_rank"] < 0.2 * rows["ddp"]["wire_tx_bytes_per_rank"]
    assert report["summary"]["regime"]["rate_mbit"] == 200


@pytest.mark.timeout(180)
def test_sigterm_mid_run_removes_namespaces_and_workers(tmp_path):
    _require_netns()
    proc = subprocess.Popen(
        [*COMMAND, "--quick", "--out-dir", str(tmp_path)],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    namespace = f"hfdwan{proc.pid}-0"
    deadline = time.monotonic() + 120
    while namespace not in _namespaces():
        assert proc.poll() is None and time.monotonic() < deadline, "the benchmark never created its namespaces"
        time.sleep(0.2)
    time.sleep(3)  # let the workers start inside the namespaces
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) != 0
    _assert_gone(proc.pid)
    # Worker command lines name their spec file inside the run's work directory, bench_wan_<pid>_*.
    leftovers = subprocess.run(["pgrep", "-f", f"bench_wan_{proc.pid}_"], capture_output=True, text=True)
    assert leftovers.stdout.strip() == "", "worker processes survived the benchmark"


def test_tbf_arguments_and_counter_parsing():
    assert tbf_arguments(10) == ["tbf", "rate", "10mbit", "burst", "32768", "latency", "200ms"]
    assert tbf_arguments(1000)[4] == str(1000 * 10**6 // 8 // 100)  # 10 ms of traffic once that exceeds 32 KiB
    with pytest.raises(ValueError):
        tbf_arguments(0)
    text = (
        "Inter-|   Receive                                                |  Transmit\n"
        " face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls "
        "carrier compressed\n"
        "    lo:       0       0    0    0    0     0          0         0        0       0    0    0    0     0"
        "       0          0\n"
        " hfw12a: 1317976    900    0    0    0     0          0         0  1283820     870    0    0    0     0"
        "       0          0\n"
    )
    assert parse_proc_net_dev(text, "hfw12a") == (1317976, 1283820)
