"""The Accelerate block of docs/how-to/accelerate.md, run as it is written (tests/scripts/readme_snippet.py) on 1 and 2
processes with a shuffled DataLoader: it trains, evaluates the global model, and its `diloco/*` metrics reach the
TensorBoard tracker; on 2 workers the shuffled shards are disjoint without a per-epoch collective. Launches whose
processes are not joined (torchrun without ACCELERATE_USE_CPU, a MULTI_CPU accelerate config) are refused with a
message."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.dist_utils import free_port

REPO = Path(__file__).resolve().parents[1]
HARNESS = REPO / "tests" / "scripts" / "readme_snippet.py"
BIN = Path(sys.executable).parent
ROWS_PER_PROCESS, H = 400, 10  # 50 steps of 8 rows per process: evaluations at step 50 and after close()


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "ACCELERATE_USE_CPU"}
    return {**env, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "DILOCO_INNER_STEPS": str(H), **extra}


def _launch(command: list[str], cwd: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=400)


def _torchrun(processes: int) -> list[str]:
    return [
        str(BIN / "torchrun"), "--nproc_per_node", str(processes), "--master_addr", "127.0.0.1",
        "--master_port", str(free_port()),
    ]  # fmt: skip


def _scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    [run] = [path.parent for path in folder.rglob("events.out.tfevents.*")]
    accumulator = EventAccumulator(str(run))
    accumulator.Reload()
    return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


def _run_snippet(tmp_path: Path, processes: int) -> tuple[list[dict], subprocess.CompletedProcess]:
    rows = str(ROWS_PER_PROCESS * processes)
    launcher = [sys.executable] if processes == 1 else _torchrun(processes)
    env = _env() if processes == 1 else _env(ACCELERATE_USE_CPU="1")
    result = _launch([*launcher, str(HARNESS), str(tmp_path), rows], tmp_path, env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return [torch.load(tmp_path / f"rank{rank}.pt", weights_only=False) for rank in range(processes)], result


def _check_logged(tmp_path: Path, steps: int) -> None:
    scalars = _scalars(tmp_path / "outputs" / "accelerate_loop")
    assert [step for step, _ in scalars["diloco/outer_steps"]] == list(range(10, steps + 1, 10))
    assert [value for _, value in scalars["diloco/outer_steps"]] == [step // H for step in range(10, steps + 1, 10)]
    assert {"train_loss", "diloco/bytes_sent", "diloco/compute_utilization"} <= set(scalars)
    evaluations = scalars["eval_loss"]
    assert [step for step, _ in evaluations] == [50, steps] and all(0 < value < 10 for _, value in evaluations)
    assert (tmp_path / "outputs" / "accelerate_loop" / "final" / "model.safetensors").is_file()


@pytest.mark.timeout(450)
def test_readme_snippet_on_one_process(tmp_path):
    [rank], result = _run_snippet(tmp_path, 1)
    assert rank["steps"] == 50 and rank["stats"]["outer_steps"] == 50 // H
    assert sorted(rank["read"][:ROWS_PER_PROCESS]) == list(range(ROWS_PER_PROCESS))
    assert rank["read"][:ROWS_PER_PROCESS] != list(range(ROWS_PER_PROCESS)), "the loader must shuffle"
    _check_logged(tmp_path, 50)
    assert "DiLoCo run: 1 worker x 1 data-parallel rank x 1 pipeline stage = 1 process" in result.stderr


@pytest.mark.timeout(450)
def test_readme_snippet_on_two_workers_with_a_shuffled_loader(tmp_path):
    ranks, result = _run_snippet(tmp_path, 2)
    reads = [rank["read"] for rank in ranks]
    assert all(len(read) == ROWS_PER_PROCESS for read in reads)
    assert sorted(reads[0] + reads[1]) == list(range(2 * ROWS_PER_PROCESS)), "each row read once, by one worker"
    assert reads[0] != sorted(reads[0]), "the loader must shuffle"
    for name, value in ranks[0]["global"].items():
        assert torch.equal(ranks[1]["global"][name], value), name
    assert ranks[0]["stats"]["outer_steps"] == 50 // H and ranks[0]["stats"]["bytes_sent"] > 0
    _check_logged(tmp_path, 50)
    assert result.stderr.count("DiLoCo run: 2 workers x 1 data-parallel rank x 1 pipeline stage = 2 processes") == 1


@pytest.mark.timeout(450)
def test_processes_not_joined_are_refused(tmp_path):
    """torchrun without ACCELERATE_USE_CPU on a machine without GPUs: Accelerate runs each process alone."""
    result = _launch([*_torchrun(2), str(HARNESS), str(tmp_path), "800"], tmp_path, _env())
    assert result.returncode != 0
    assert "The launcher started 2 processes (WORLD_SIZE=2)" in result.stderr
    assert "did not join them into one run" in result.stderr and "cpu=True" in result.stderr
    assert not list(tmp_path.glob("rank*.pt")) and not (tmp_path / "outputs" / "accelerate_loop" / "final").exists()


@pytest.mark.timeout(450)
def test_multi_cpu_accelerate_config_without_mpirun_is_refused(tmp_path):
    """accelerate launch with a MULTI_CPU config of 2 processes starts one process with no rank."""
    config = tmp_path / "multi_cpu.yaml"
    config.write_text(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_CPU\nnum_machines: 1\nnum_processes: 2\n"
        "machine_rank: 0\nmixed_precision: 'no'\nuse_cpu: true\n"
    )
    command = [
        str(BIN / "accelerate"), "launch", "--config_file", str(config), "--main_process_port", str(free_port()),
        str(HARNESS), str(tmp_path), "800",
    ]  # fmt: skip
    result = _launch(command, tmp_path, _env())
    assert result.returncode != 0
    assert "accelerate launch was asked for several CPU processes" in result.stderr
    assert "torchrun --nproc_per_node N" in result.stderr
    assert not list(tmp_path.glob("rank*.pt"))
