"""`hf_diloco.core.settings.scaling_rules` against the DiLoCo scaling-law paper's joint fits, written out here, and the values
its fits give at the sizes ANCHORS.md quotes."""

from __future__ import annotations

import pytest

from hf_diloco.core.settings.scaling_rules import scaling_law_settings


@pytest.mark.parametrize("num_parameters, num_workers", [(35e6, 1), (150e6, 2), (1e9, 4), (2.4e9, 8)])
def test_settings_are_the_papers_joint_fits(num_parameters, num_workers):
    settings = scaling_law_settings(num_parameters, num_workers, block_size=512)
    gamma = 22256 * num_parameters**-0.8827 * num_workers**0.2929  # Table 10
    batch = 0.00709 * num_parameters**0.4695 * num_workers**0.3399  # Table 10, sequences of 2048 tokens
    assert settings.inner_learning_rate.value == pytest.approx(gamma, rel=1e-12)
    assert settings.global_batch_tokens.value == pytest.approx(batch * 2048, rel=1e-12)
    assert settings.global_batch_sequences.value == pytest.approx(batch * 2048 / 512, rel=1e-12)
    assert settings.outer_momentum.value == 0.9 and settings.warmup_steps.value == 1000
    assert settings.warnings == ()  # inside the fitted range, at H = 30
    assert all(
        "2503.09799" in setting.source or "block_size" in setting.source for setting in settings.settings().values()
    )


def test_values_the_fits_give_at_known_sizes():
    """The arithmetic of the joint fit quoted in ANCHORS.md (section 2)."""
    rate = {m: scaling_law_settings(1e9, m).inner_learning_rate.value for m in (1, 2, 8)}
    assert rate == pytest.approx({1: 2.5e-4, 2: 3.1e-4, 8: 4.7e-4}, rel=0.02)
    assert scaling_law_settings(150e6, 2).inner_learning_rate.value == pytest.approx(1.65e-3, rel=0.01)
    assert scaling_law_settings(1e9, 1).global_batch_tokens.value / 2048 == pytest.approx(119, rel=0.01)


def test_outer_learning_rate_follows_figure_7_by_workers():
    by_workers = {m: scaling_law_settings(1e9, m).outer_learning_rate.value for m in (1, 2, 4, 8, 16)}
    assert by_workers == {1: 0.4, 2: 0.6, 4: 0.6, 8: 0.8, 16: 0.8}
    assert 0.6 < scaling_law_settings(1e9, 6).outer_learning_rate.value < 0.8  # between the grid's points


def test_outside_the_fitted_range_is_called_an_extrapolation():
    settings = scaling_law_settings(2e6, 16, inner_steps=100, total_steps=400)
    assert len(settings.warnings) == 3
    assert "outside the fitted range" in settings.warnings[0] and "M=16" in settings.warnings[1]
    assert "H=100" in settings.warnings[2]
    assert settings.warmup_steps.value == 40 and "a tenth" in settings.warmup_steps.source
    with pytest.raises(ValueError, match="num_workers must be > 0"):
        scaling_law_settings(1e9, 0)


# ------------------------------------------------------------------------------------------- `auto` in the main job


def _parse(tmp_path, flags: list[str], environ: dict[str, str] | None = None, training: dict | None = None):
    import yaml

    from hf_diloco.cli.pretrain_arguments import parse_command_line
    from hf_diloco.job.config_file import shipped_config_text

    config = yaml.safe_load(shipped_config_text("tiny_diloco"))
    config["training"].update(training or {})
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    base = ["--config", str(path), "--use_cpu", "--output_dir", str(tmp_path / "out")]
    return parse_command_line([*base, *flags], environ=environ or {})


def test_auto_in_the_config_flags_and_variables_resolves_from_the_model(tmp_path):
    """`auto` from the YAML (learning_rate), a flag (per_device_train_batch_size) and a variable (outer_lr) becomes
    the laws' value for the model the job builds, stated with its source, at start-up."""
    from hf_diloco.cli.auto_settings import resolve_auto_values
    from hf_diloco.job.modeling import build_model

    parsed = _parse(
        tmp_path,
        ["--per_device_train_batch_size", "auto", "--gradient_accumulation_steps", "2"],
        environ={"DILOCO_OUTER_LR": "auto"},
        training={"learning_rate": "auto"},
    )
    assert set(parsed.auto.keys) == {"learning_rate", "per_device_train_batch_size", "outer_lr"}
    assert parsed.auto.keys["outer_lr"] == "DILOCO_OUTER_LR" and parsed.auto.keys["per_device_train_batch_size"] == (
        "--per_device_train_batch_size"
    )
    model = build_model(parsed.config.section("model"), 4096, seed=0)
    lines = resolve_auto_values(parsed.auto, parsed.args, model, 256, "diloco")
    n = sum(p.numel() for p in model.parameters())
    assert parsed.args.learning_rate == pytest.approx(22256 * n**-0.8827)  # M = 1 worker
    sequences = 0.00709 * n**0.4695 * 2048 / 256
    assert parsed.args.per_device_train_batch_size == max(1, round(sequences / 2))  # 1 worker x 1 rank x 2 steps
    assert parsed.args.outer_lr == 0.4
    assert f"N={n:,} parameters, M=1 worker(s), H=50" in lines[0]  # tiny_diloco: inner_steps 50
    assert any("learning_rate=" in line and "Table 10" in line for line in lines)
    assert any("outside the fitted range" in line for line in lines)  # a tiny model: an extrapolation, said so


def test_auto_with_the_ddp_baseline_is_refused_before_any_work(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    import yaml

    from hf_diloco.job.config_file import shipped_config_text

    config = yaml.safe_load(shipped_config_text("tiny_ddp"))
    config["training"]["learning_rate"] = "auto"
    path = tmp_path / "ddp.yaml"
    path.write_text(yaml.safe_dump(config))
    script = Path(__file__).resolve().parent.parent / "scripts" / "pretrain.py"
    command = [sys.executable, str(script), "--config", str(path), "--output_dir", str(tmp_path / "out")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "learning_rate: auto (in " in result.stderr and "trainer: ddp" in result.stderr
    assert not (tmp_path / "out").exists()
