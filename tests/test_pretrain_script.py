"""The main job end to end: `scripts/pretrain.py` (a thin wrapper of `hf-diloco pretrain`) on 1 process and on 2
processes (torchrun, gloo); re-running a finished or incompatible output folder; every shipped config parses."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from hf_diloco.cli.config_file import shipped_config_names, shipped_config_text
from hf_diloco.cli.pretrain_arguments import parse_command_line
from tests.dist_utils import free_port

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "pretrain.py"
STEPS = 8


def _small_config(tmp_path: Path, trainer: str = "diloco") -> Path:
    config = yaml.safe_load(shipped_config_text(f"tiny_{trainer}"))
    config["data"].update(max_train_samples=12, max_eval_samples=2, block_size=64)
    config["tokenizer"]["vocab_size"] = 512
    config["model"]["config"].update(hidden_size=32, num_hidden_layers=2, intermediate_size=64)
    config["training"].update(
        max_steps=STEPS, logging_steps=2, eval_steps=4, save_steps=4, per_device_train_batch_size=2, warmup_steps=0
    )
    if trainer == "diloco":
        config["diloco"].update(inner_steps=4)
    path = tmp_path / f"{trainer}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _run(command: list[str], timeout: int = 420, expect_success: bool = True) -> subprocess.CompletedProcess:
    env = dict(
        os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false"
    )
    env["PYTHONPATH"] = str(ROOT)
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if expect_success:
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result


def _torchrun(processes: int) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes),
        "--master_port", str(free_port()),
    ]  # fmt: skip


def _check_output_folder(output_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(output_dir)
    tokenizer = AutoTokenizer.from_pretrained(output_dir)
    ids = tokenizer("def main():\n    return 0\n", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss
    assert torch.isfinite(loss)
    assert tokenizer.model_max_length == model.config.max_position_embeddings == 256
    metrics = json.loads((output_dir / "all_results.json").read_text())
    assert metrics["eval_loss"] < 7.0  # log(512) = 6.24 at random; a few steps already move below ~6.3
    if "eval_tokens" in metrics:  # scored by the shipped evaluate module (not for the pipelined/DDP-free paths)
        assert metrics["eval_perplexity"] == pytest.approx(math.exp(metrics["eval_loss"]), rel=1e-4)
        assert metrics["eval_tokens"] > 0


def _assert_card_quotes_all_results(output_dir: Path) -> None:
    """The card's results (front matter model-index and the table) are exactly those in all_results.json."""
    results = json.loads((output_dir / "all_results.json").read_text())
    card = (output_dir / "README.md").read_text()
    front = yaml.safe_load(card.split("---\n")[1])
    [index] = front["model-index"]
    quoted = {metric["name"]: metric["value"] for metric in index["results"][0]["metrics"]}
    assert quoted == {k: v for k, v in results.items() if k.startswith("eval_") and not _timing(k)}
    section = card.split("## Evaluation results")[1].split("##")[0]
    assert "after training" in section
    table = dict(re.findall(r"^\| (eval_\w+) \| ([\d.,e+-]+) \|$", section, flags=re.M))
    assert set(table) == set(quoted)
    for key, text in table.items():
        assert float(text.replace(",", "")) == pytest.approx(results[key], rel=1e-5), key


def _timing(key: str) -> bool:
    return key.endswith(("_runtime", "_samples_per_second", "_steps_per_second"))


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    out = tmp_path_factory.mktemp("pretrain_1")
    output_dir = out / "out1"
    result = _run([sys.executable, str(SCRIPT), "--config", str(_small_config(out)), "--output_dir", str(output_dir)])
    return output_dir, result


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    """2 workers, 2 fragments with one step of delay (tau > 0: `close()` changes theta_g after the last evaluation
    during training), with command-line overrides of the training, DiLoCo and config sections."""
    out = tmp_path_factory.mktemp("pretrain_2")
    output_dir = out / "out2"
    overrides = ["--use_cpu", "--num_fragments", "2", "--sync_delay", "1", "--data.block_size", "32"]
    result = _run(
        _torchrun(2) + [str(SCRIPT), "--config", str(_small_config(out)), "--output_dir", str(output_dir), *overrides]
    )
    return output_dir, result


@pytest.mark.timeout(480)
def test_pretrain_single_process(one_process):
    output_dir, result = one_process
    _check_output_folder(output_dir)
    _assert_card_quotes_all_results(output_dir)
    assert (output_dir / "checkpoint-4" / "diloco_state_rank0.pt").is_file()
    assert "DiLoCo run: 1 worker x 1 data-parallel rank x 1 pipeline stage = 1 process; H=4" in result.stderr


@pytest.mark.timeout(480)
def test_pretrain_two_processes_and_command_line_overrides(two_processes):
    output_dir, result = two_processes
    _check_output_folder(output_dir)
    _assert_card_quotes_all_results(output_dir)
    state = json.loads((output_dir / f"checkpoint-{STEPS}" / "trainer_state.json").read_text())
    logged = [entry for entry in state["log_history"] if "diloco/bytes_sent" in entry]
    assert logged and logged[-1]["diloco/bytes_sent"] > 0  # two workers really exchanged
    assert {"diloco/outer_steps", "diloco/sync_wait_seconds", "diloco/pseudo_grad_norm"} <= set(logged[-1])
    saved = torch.load(output_dir / f"checkpoint-{STEPS}" / "diloco_state_rank1.pt", weights_only=True)
    assert len(saved["engine"]["global"]) == 2  # the --num_fragments override reached the engine
    # The --data.block_size override reached the data: 32 tokens per row, 8 x 2 x 2 rows seen.
    assert logged[-1]["num_input_tokens_seen"] == STEPS * 2 * 32
    # The last evaluation during training (step 8) was taken before close() merged the in-flight fragment.
    during = [e["eval_loss"] for e in state["log_history"] if "eval_loss" in e and e["step"] == STEPS]
    final = json.loads((output_dir / "all_results.json").read_text())["eval_loss"]
    assert during and during[-1] != final
    summary = "DiLoCo run: 2 workers x 1 data-parallel rank x 1 pipeline stage = 2 processes; H=4, P=2, tau=1"
    assert result.stderr.count(summary) == 1, "one start-up line, on the main process only"
    # Progress bars on the main process only: one tokenization bar per split, not one per split and rank.
    assert result.stderr.count("Tokenizing:   0%") == 2


@pytest.mark.timeout(480)
def test_checkpoints_store_each_piece_of_state_once(two_processes):
    """Each rank's inner optimizer and grad scaler live in its DiLoCo state file only; the LR schedule in scheduler.pt."""
    output_dir, _ = two_processes
    checkpoint = output_dir / f"checkpoint-{STEPS}"
    names = {path.name for path in checkpoint.iterdir()}
    assert "optimizer.pt" not in names and "scaler.pt" not in names
    assert {"scheduler.pt", "diloco_state_rank0.pt", "diloco_state_rank1.pt"} <= names


@pytest.mark.timeout(300)
def test_pretrain_ddp_baseline(tmp_path):
    output_dir = tmp_path / "ddp"
    _run(
        [sys.executable, str(SCRIPT), "--config", str(_small_config(tmp_path, "ddp")), "--output_dir", str(output_dir)]
    )
    _check_output_folder(output_dir)


@pytest.mark.timeout(300)
def test_rerun_of_a_finished_folder_leaves_it_and_names_the_ways_out(one_process, tmp_path):
    output_dir, _ = one_process
    weights = (output_dir / "model.safetensors").read_bytes()
    result = _run(
        [sys.executable, str(SCRIPT), "--config", str(_small_config(tmp_path)), "--output_dir", str(output_dir)]
    )
    assert "already holds a finished run" in result.stderr
    assert "--output_dir" in result.stderr and "--auto_resume false" in result.stderr
    assert (output_dir / "model.safetensors").read_bytes() == weights
    assert not (output_dir / f"checkpoint-{STEPS + 4}").exists()


@pytest.mark.timeout(300)
def test_checkpoint_of_another_process_count_is_refused_naming_the_ways_out(two_processes, tmp_path):
    """What `make run` after `make run-multi` met when both wrote one folder: refused before any work."""
    output_dir, _ = two_processes
    before = {path: path.stat().st_mtime_ns for path in output_dir.rglob("*") if path.is_file()}
    command = [sys.executable, str(SCRIPT), "--config", str(_small_config(tmp_path)), "--output_dir", str(output_dir)]
    result = _run([*command, "--max_steps", str(2 * STEPS)], expect_success=False)
    assert result.returncode != 0
    message = result.stderr[-3000:]
    assert "written by 2 processes and this run has 1" in message, message
    assert "--output_dir" in message and "--auto_resume false" in message
    assert {path: path.stat().st_mtime_ns for path in output_dir.rglob("*") if path.is_file()} == before


def test_makefile_runs_use_separate_folders():
    make = subprocess.run(["make", "-n", "run", "run-multi"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    folders = re.findall(r"--output_dir (\S+)", make.stdout)
    assert len(folders) == 2 and folders[0] != folders[1], make.stdout


@pytest.mark.parametrize("name", shipped_config_names())
def test_every_shipped_config_parses(name):
    command_line = parse_command_line(["--config", name, "--use_cpu"])
    assert command_line.args.output_dir == f"outputs/{name}"
    assert command_line.auto_resume is True
