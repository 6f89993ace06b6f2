"""A refusal under a launcher, as a user meets it: `hf-diloco launch` (torchrun's own agent) ends it with one message
and exit status 2, nothing from torchrun after it; a crash keeps its traceback and torchrun's report; under plain
`torchrun` the report names the refusal."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from transformers import LlamaConfig, LlamaForCausalLM

from tests.dist_utils import free_port
from tests.test_pretrain_script import _environment, _finish, _small_config

ROOT = Path(__file__).resolve().parent.parent
PROGRAMS = Path(sys.executable).parent


def _launch(tmp_path: Path, config: Path, *flags: str, plain_torchrun: bool = False) -> subprocess.Popen:
    port = ["--master_port", str(free_port())]
    if plain_torchrun:
        launcher = [str(PROGRAMS / "torchrun"), "--nproc_per_node", "2", *port, "-m", "hf_diloco", "pretrain"]
    else:
        launcher = [str(PROGRAMS / "hf-diloco"), "launch", "--nproc_per_node", "2", *port, "pretrain"]
    command = [*launcher, "--config", str(config), "--use_cpu", *flags]
    return subprocess.Popen(
        command, cwd=tmp_path, env=_environment(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip


@pytest.mark.timeout(420)
def test_a_refusal_under_hf_diloco_launch_ends_with_its_one_message_and_exit_status_2(tmp_path):
    config = _small_config(tmp_path)
    bad_file = tmp_path / "bad.yaml"
    bad_file.write_text(config.read_text().replace("inner_steps: 4", "inner_stepz: 4"))
    cases = {
        "flag value": (config, ["--max_steps", "abc"], r"argument --max_steps/--max-steps: invalid int value: 'abc'"),
        "diloco value": (config, ["--inner_steps", "0"], r"inner_steps must be >= 1, got 0"),
        "config": (bad_file, [], r"bad\.yaml \(section diloco:\): 'inner_stepz' \(did you mean 'inner_steps'\?\)"),
    }
    launched = {
        name: _launch(tmp_path, file, *flags, "--output_dir", str(tmp_path / name.replace(" ", "_")))
        for name, (file, flags, _) in cases.items()
    }
    for name, (_, _, expected) in cases.items():
        result = _finish(launched[name], 300)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2, f"{name}: {result.stderr[-3000:]}"
        assert lines[-1].startswith("hf-diloco: error: ") and re.search(expected, lines[-1]), f"{name}: {lines[-5:]}"
        assert result.stderr.count("hf-diloco: error: ") == 1, f"{name}: {result.stderr[-3000:]}"
        for torchrun_says in ("Traceback", "ChildFailedError", "torch/distributed/elastic", "exitcode"):
            assert torchrun_says not in result.stderr, f"{name}: {result.stderr[-3000:]}"
        assert not (tmp_path / name.replace(" ", "_") / "tokenizer").exists(), name


@pytest.mark.timeout(420)
def test_a_crash_under_hf_diloco_launch_keeps_its_traceback_and_torchruns_report(tmp_path):
    """A damaged weights file to start from is not a refusal: the rank's traceback, the agent's lines and
    torchrun's ChildFailedError report, exit status 1, as under torchrun."""
    damaged = tmp_path / "damaged"
    LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=4, vocab_size=512, max_position_embeddings=256)).save_pretrained(
        damaged)  # fmt: skip
    weights = damaged / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    config = yaml.safe_load(_small_config(tmp_path).read_text())
    config["model"] = {"model_name_or_path": str(damaged)}
    (tmp_path / "from_damaged.yaml").write_text(yaml.safe_dump(config))
    result = _finish(_launch(tmp_path, tmp_path / "from_damaged.yaml", "--output_dir", str(tmp_path / "out")), 300)
    assert result.returncode == 1, result.stderr[-3000:]
    report = result.stderr[result.stderr.index("failed (exitcode: 1)") :]
    assert "SafetensorError" in result.stderr[: result.stderr.index("failed (exitcode: 1)")]  # the rank's traceback
    assert "ChildFailedError" in report and "Root Cause (first observed failure)" in report
    assert "exitcode  : 1" in report and "hf-diloco: error: " not in result.stderr


@pytest.mark.timeout(300)
def test_under_plain_torchrun_the_report_names_the_refusal(tmp_path):
    """torchrun's own exit status (1) and report cannot be changed from a rank: the message is said once by rank 0
    (or not at all when the agent stops it first), and torchrun's report gives it as the failed ranks' traceback."""
    result = _finish(
        _launch(tmp_path, _small_config(tmp_path), "--inner_steps", "0", "--output_dir", str(tmp_path / "out"),
                plain_torchrun=True), 300,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr[-3000:]
    message = "hf-diloco: error: inner_steps must be >= 1, got 0. (set: inner_steps by the command line)"
    root_cause = result.stderr.split("Root Cause (first observed failure):")[1]
    assert re.search(r"exitcode  : 2 .*\n.*\n  traceback : " + re.escape(message), root_cause), root_cause
    assert sum(line == message for line in result.stderr.splitlines()) <= 1
    assert not (tmp_path / "out" / "tokenizer").exists()
