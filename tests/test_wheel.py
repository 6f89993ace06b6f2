"""`pip install` of the built wheel gives a working `hf-diloco` command with its configs and templates, run from a
folder outside the checkout (a fresh virtualenv that reuses this one's torch, transformers, ... instead of
installing them again)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parent.parent
SMALL_RUN = [
    "--max_steps", "2", "--inner_steps", "2", "--eval_steps", "2", "--save_steps", "2", "--logging_steps", "1",
    "--per_device_train_batch_size", "2", "--warmup_steps", "0", "--data.max_train_samples", "8",
    "--data.max_eval_samples", "2", "--data.block_size", "32", "--tokenizer.vocab_size", "300",
    "--model.config.hidden_size", "16", "--model.config.num_hidden_layers", "1", "--model.config.intermediate_size", "32",
]  # fmt: skip


def _run(command: list, cwd: Path, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{command}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return result


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    _run(
        [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation", "-q", "-w", str(out)],
        out,
    )
    [built] = out.glob("hf_diloco-*.whl")
    return built


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """A fresh virtualenv holding the wheel; this virtualenv's site-packages supplies the dependencies."""
    venv = tmp_path_factory.mktemp("venv")
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], venv)
    python = venv / "bin" / "python"
    site = Path(
        _run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], venv).stdout.strip()
    )
    # A plain path line: this virtualenv's packages become importable, but its editable hf_diloco finder (a .pth
    # file of that folder) does not run, so the wheel's hf_diloco is the only one.
    (site / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index", str(wheel)],
        venv,
        _clean_env(),  # with the checkout on PYTHONPATH, pip would take hf_diloco as installed already
    )
    return venv


def _clean_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return env


@pytest.mark.timeout(300)
def test_wheel_holds_the_command_configs_and_templates(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for name in ("tiny_diloco", "tiny_ddp", "streaming_diloco", "diloco_x"):
        assert f"hf_diloco/configs/{name}.yaml" in names
    assert {
        "hf_diloco/model_cards/diloco_model_card.md",
        "hf_diloco/cli/pretrain.py",
        "hf_diloco/__main__.py",
    } <= names
    assert "hf_diloco/metrics/perplexity/perplexity.py" in names
    [entry_points] = [name for name in names if name.endswith(".dist-info/entry_points.txt")]
    assert "hf-diloco = hf_diloco.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()
    # The configs and the card template come from the repository's top-level folders, their single source.
    for folder in ("configs", "model_cards"):
        shipped = {name.split("/")[-1] for name in names if name.startswith(f"hf_diloco/{folder}/")}
        assert shipped == {path.name for path in (ROOT / folder).iterdir() if path.is_file()}, folder


def test_every_package_folder_is_listed_in_pyproject():
    """pyproject.toml names the packages (it maps configs/ and model_cards/ into hf_diloco): none may be missed."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {".".join(path.parent.relative_to(ROOT).parts) for path in (ROOT / "hf_diloco").rglob("*.py")}
    assert listed == folders | {"hf_diloco.configs", "hf_diloco.model_cards"}


@pytest.mark.timeout(600)
def test_installed_command_runs_the_main_job_outside_the_checkout(installed, tmp_path):
    command, env = installed / "bin" / "hf-diloco", _clean_env()
    where = _run(
        [str(installed / "bin" / "python"), "-c", "import hf_diloco; print(hf_diloco.__file__)"], tmp_path, env
    )
    assert Path(where.stdout.strip()).is_relative_to(installed), where.stdout
    assert "pretrain" in _run([str(command), "--help"], tmp_path, env).stdout
    result = _run(
        [str(command), "pretrain", "--config", "tiny_diloco", "--output_dir", "out", *SMALL_RUN], tmp_path, env
    )
    assert "DiLoCo run: 1 worker" in result.stderr
    results = json.loads((tmp_path / "out" / "all_results.json").read_text())
    assert results["eval_loss"] > 0 and (tmp_path / "out" / "model.safetensors").is_file()
    assert "diloco" in (tmp_path / "out" / "README.md").read_text()
