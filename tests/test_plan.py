"""`hf-diloco plan`: its YAML against the DiLoCo scaling laws' joint fit and the sync projection, both written out
here; its choices as the link and the sites change; its refusals; and one run of `hf-diloco pretrain` from its
YAML on a tiny model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hf_diloco.cli import main as hf_diloco
from hf_diloco.cli.plan import count_parameters
from hf_diloco.cli.plan_model import parse_link
from hf_diloco.cli.plan_yaml import llama_parameters, llama_shape
from hf_diloco.core.settings.projection import MEASURED_STAGE_RATES, stage_rates
from hf_diloco.core.settings.scaling_rules import scaling_law_settings
from hf_diloco.job.config_file import read_config

ROOT = Path(__file__).resolve().parent.parent
ISSUE_COMMAND = ["--params", "1e9", "--workers", "4", "--gpus_per_site", "8", "--link", "1gbit"]


def _plan(tmp_path: Path, capsys, *flags: str, name: str = "plan.yaml") -> tuple[dict, dict, str]:
    """(the YAML as read_config reads it, the --json plan, the markdown written beside the YAML)."""
    out = tmp_path / name
    assert hf_diloco(["plan", *flags, "--out", str(out), "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    config = read_config(out)
    return config.values, planned, out.with_suffix(".md").read_text()


def test_the_issues_command_writes_the_papers_joint_fit_and_shows_utilization(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert hf_diloco(["plan", *ISSUE_COMMAND, "--out", "plan.yaml"]) == 0
    printed = capsys.readouterr().out
    config = read_config(tmp_path / "plan.yaml").values  # the schema check of `hf-diloco pretrain --config`
    n, m, gpus = 1e9, 4, 8
    gamma = 22256 * n**-0.8827 * m**0.2929  # Table 10, joint fit
    sequences = 0.00709 * n**0.4695 * m**0.3399  # Table 10, sequences of 2048 tokens
    training, diloco = config["training"], config["diloco"]
    assert training["learning_rate"] == pytest.approx(gamma, rel=1e-3)
    assert training["learning_rate"] == pytest.approx(scaling_law_settings(n, m).inner_learning_rate.value, rel=1e-3)
    # The global batch is the fit's, rounded to whole sequences per GPU.
    assert abs(training["per_device_train_batch_size"] - sequences / (m * gpus)) <= 0.5
    assert config["data"]["block_size"] == 2048 and diloco["data_parallel_per_worker"] == gpus
    assert diloco["outer_lr"] == 0.6 and training["warmup_steps"] == 1000  # Figure 7 at M = 4; section 3
    assert training["max_steps"] % diloco["inner_steps"] == 0
    assert diloco["inner_steps"] % diloco["num_fragments"] == 0
    assert (tmp_path / "plan.md").read_text() in printed
    row = next(line for line in printed.splitlines() if line.startswith("| compute utilization |"))
    assert row.split("|")[2].strip().endswith("%")
    assert "2503.09799" in printed and "hf-diloco plan --params 1e9" in (tmp_path / "plan.yaml").read_text()


def test_the_projected_utilization_is_the_sync_model_written_out(tmp_path, capsys):
    config, planned, _ = _plan(tmp_path, capsys, *ISSUE_COMMAND)
    diloco, training = config["diloco"], config["training"]
    n, m, gpus = 1e9, 4, 8
    h, p, tau = diloco["inner_steps"], diloco["num_fragments"], diloco["sync_delay"]
    assert diloco["compression"] == "fp4" and diloco["compression_scale_dtype"] == "bf16"
    deflate = diloco["entropy_coding"]
    tokens_per_site_step = training["per_device_train_batch_size"] * 2048 * gpus
    step = 6 * n * tokens_per_site_step / (gpus * 989e12 * 0.4)  # H100 dense bf16 peak at 40% MFU
    fragment = n / p
    sent = 2 * (m - 1) / m * fragment * (4 + 16 / 128) / 8  # fp4 codes and a bf16 scale per 128 values
    sent *= 0.889 if deflate else 1  # deflated Gaussian fp4 codes (BENCHMARKS.md, "Overhead")
    transfer = sent * 8 / (1e9 * 0.9)  # at 0.9 of the nominal rate
    rates = stage_rates(json.loads((ROOT / "benchmarks/results/sync_cost.json").read_text()), threads=1)
    gigabytes = fragment * 4 / 1e9 / gpus
    main = gigabytes * sum(1 / rates[s] for s in ("pseudo-gradient", "outer step", "unflatten"))
    exchange = gigabytes * sum(
        share / rates[f"fp4 {s}"]
        for s, share in {"encode": 1 + 1 / m, "sum": 1, "decode": 1, "deflate": deflate, "inflate": deflate}.items()
    )
    inside = (gpus - 1) / gpus * fragment * 2 / 300e9 + 2 * fragment / gpus * 2 / 25e9
    period = h / p * step
    expected = period / (period + main + inside + max(0.0, exchange + transfer - tau * step))
    assert planned["sync"]["bytes_per_sync"] == pytest.approx(sent)
    assert planned["step_seconds"]["value"] == pytest.approx(step)
    assert planned["sync"]["utilization"] == pytest.approx(expected)
    assert planned["wall_seconds"] == pytest.approx(training["max_steps"] * step / expected)


def test_the_inner_steps_grow_as_the_link_shrinks(tmp_path, capsys):
    settings = {}
    for link in ("10mbit", "10gbit"):
        config, planned, table = _plan(tmp_path, capsys, *ISSUE_COMMAND[:-1], link, name=f"{link}.yaml")
        settings[link] = config["diloco"]
        for option in {(t["compression"], t["entropy_coding"], t["fragments"]) for t in planned["tried"]}:
            by_h = [t for t in planned["tried"] if (t["compression"], t["entropy_coding"], t["fragments"]) == option]
            assert [t["utilization"] for t in by_h] == sorted(
                t["utilization"] for t in by_h
            )  # longer rounds hide more
        chosen = planned["sync"]
        assert chosen["utilization"] >= 0.9 or chosen["inner_steps"] == planned["tried"][-1]["inner_steps"]
        assert f"| compute utilization | {chosen['utilization']:.1%} |" in table
    assert settings["10mbit"]["inner_steps"] > settings["10gbit"]["inner_steps"]
    assert settings["10mbit"]["compression"] == "fp4"
    # A fast link and a large model (long steps): the paper's H = 30, blocking, fp32.
    fast = ["--params", "7e9", "--workers", "2", "--gpus_per_site", "8", "--link", "100gbit"]
    config, planned, _ = _plan(tmp_path, capsys, *fast)
    assert (config["diloco"]["inner_steps"], config["diloco"]["num_fragments"]) == (30, 1)
    assert config["diloco"]["compression"] == "none"


def test_unequal_site_speeds_plan_balanced_rounds(tmp_path, capsys):
    flags = ["--params", "3e8", "--workers", "3", "--link", "1gbit", "--site_speeds"]
    equal, _, _ = _plan(tmp_path, capsys, *flags, "1", "1", "1", name="equal.yaml")
    unequal, planned, table = _plan(tmp_path, capsys, *flags, "1", "1", "0.5", name="unequal.yaml")
    assert equal["diloco"]["round_policy"] == "steps"
    assert unequal["diloco"]["round_policy"] == "balanced" and "| round_policy | balanced |" in table
    # Balanced rounds end at whole rounds; the slow site trains half as many tokens per step of the fastest.
    assert unequal["training"]["max_steps"] % unequal["diloco"]["inner_steps"] == 0
    assert unequal["training"]["max_steps"] > equal["training"]["max_steps"] * 2.5 / 3


@pytest.mark.parametrize(
    "flags, flag",
    [
        ([*ISSUE_COMMAND, "--gpu", "tpu9"], "--gpu"),
        (["--params", "1e9", "--workers", "4", "--link", "fast"], "--link"),
        (["--params=-5", "--workers", "4", "--link", "1gbit"], "--params"),
        (["--params", "1e9", "--link", "1gbit"], "--workers"),
        ([*ISSUE_COMMAND, "--site_speeds", "1", "2"], "--site_speeds"),
        (["--params", "1e9", "--workers", "2", "--link", "1gbit", "--measure"], "--measure"),
    ],
)
def test_bad_input_is_one_line_naming_the_flag(tmp_path, capsys, flags, flag):
    out = tmp_path / "plan.yaml"
    assert hf_diloco(["plan", *flags, "--out", str(out)]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hf-diloco: error: ") and flag in lines[0], captured.err
    assert not out.exists()


def test_help_lists_the_flags(capsys):
    with pytest.raises(SystemExit) as exit:
        hf_diloco(["plan", "--help"])
    assert exit.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--params", "--model", "--workers", "--gpus_per_site", "--link", "--site_speeds", "--measure"):
        assert flag in text


def test_links_parse_with_their_units():
    assert [parse_link(t) for t in ("1gbit", "100mbit", "2.5 Gbit/s", "500M", "10", "1e3kbit")] == pytest.approx(
        [1.0, 0.1, 2.5, 0.5, 10.0, 0.001]
    )


def test_the_llama_written_for_a_parameter_count_has_about_that_many(tmp_path):
    for n, vocab in ((2e5, 512), (1.2e8, 32000), (1e9, 32000), (7e9, 32000)):
        shape = llama_shape(n, vocab, 2048)
        counted = count_parameters(shape, vocab)  # transformers' own model, on the meta device
        assert counted == llama_parameters(shape["hidden_size"], shape["num_hidden_layers"], vocab)
        assert counted == pytest.approx(n, rel=0.1)
    # A config file: N is the model it describes.
    config = {**llama_shape(1e6, 512, 128), "vocab_size": 512}
    (tmp_path / "model.json").write_text(json.dumps(config))
    assert hf_diloco(["plan", "--model", str(tmp_path / "model.json"), "--workers", "2", "--link", "1gbit",
                      "--out", str(tmp_path / "plan.yaml"), "--json"]) == 0  # fmt: skip
    assert read_config(tmp_path / "plan.yaml").values["model"]["config"] == config
    assert (
        hf_diloco(["plan", "--params", "1e5", "--workers", "1", "--link", "1gbit", "--out", str(tmp_path / "x.yaml")])
        == 2
    )


def test_the_shipped_host_rates_are_the_stored_measurement():
    stored = stage_rates(json.loads((ROOT / "benchmarks/results/sync_cost.json").read_text()), threads=1)
    assert MEASURED_STAGE_RATES == {stage: stored[stage] for stage in MEASURED_STAGE_RATES}


@pytest.mark.timeout(600)
def test_the_plan_starts_hf_diloco_pretrain_on_a_tiny_model(tmp_path, capsys):
    out = tmp_path / "out"
    flags = ["--params", "2e5", "--vocab_size", "512", "--block_size", "64", "--workers", "1", "--link", "1gbit",
             "--measure", "--tokens", "60000", "--output_dir", str(out)]  # fmt: skip
    config, planned, table = _plan(tmp_path, capsys, *flags)
    assert "measured on this machine's CPU" in planned["step_seconds"]["source"] and "bf16" not in config["training"]
    env = {name: value for name, value in os.environ.items() if not name.startswith("DILOCO_")}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHONPATH=str(ROOT))
    command = [sys.executable, "-m", "hf_diloco", "pretrain", "--config", str(tmp_path / "plan.yaml"), "--use_cpu",
               "--data.max_train_samples", "12", "--data.max_eval_samples", "2"]  # fmt: skip
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=540)
    assert result.returncode == 0, result.stderr[-3000:]
    steps, h = config["training"]["max_steps"], config["diloco"]["inner_steps"]
    assert f"H={h}, P=1" in result.stderr and f"{steps // h} outer round(s) in {steps} steps" in result.stderr
    assert (out / "config.json").is_file()


def test_the_slowest_link_and_the_largest_latency_decide_the_sync(tmp_path, capsys):
    flags = ["--params", "3e8", "--workers", "2", "--link", "1gbit", "100mbit", "--latency_ms", "10", "50"]
    config, planned, _ = _plan(tmp_path, capsys, *flags, "--compression", "fp4")
    sync = planned["sync"]
    assert planned["link_gbit"] == pytest.approx(0.1) and config["diloco"]["compression"] == "fp4"
    latency = 2 * (2 - 1) * 0.05  # the reduce-scatter's two messages in sequence
    assert sync["transfer"] == pytest.approx(sync["bytes_per_sync"] * 8 / (0.1e9 * 0.9) + latency)
