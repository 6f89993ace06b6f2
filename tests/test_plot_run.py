"""`hf-diloco plot` (hf_diloco/cli/plot.py; scripts/plot_run.py wraps it) on synthetic trainer_state.json files."""

import json
import struct
from pathlib import Path

import pytest

from hf_diloco.cli import plot

pytestmark = pytest.mark.timeout(120)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def plot_run():
    return plot


def _history(with_tokens: bool, with_diloco: bool = True) -> list[dict]:
    history = []
    for step in range(10, 101, 10):
        entry = {"step": step, "epoch": step / 100, "loss": 5.0 - step / 50, "learning_rate": 1e-3}
        if with_tokens:
            entry["num_input_tokens_seen"] = step * 512
        if with_diloco:
            entry.update(
                {
                    "diloco/bytes_sent": (step // 20) * 4_000_000,
                    "diloco/sync_wait_seconds": 0.01 * step,
                    "diloco/outer_steps": step // 20,
                }
            )
        history.append(entry)
        if step % 50 == 0:
            history.append({"step": step, "epoch": step / 100, "eval_loss": 4.5 - step / 100})
    return history


def _write_state(folder: Path, history: list[dict]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "trainer_state.json"
    path.write_text(json.dumps({"global_step": 100, "log_history": history}))
    return path


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_main_writes_three_pngs(tmp_path, plot_run, capsys):
    state = _write_state(tmp_path / "run", _history(with_tokens=True))
    assert plot_run.main([str(state), "--out", str(tmp_path / "plots")]) == 0
    for name in ("loss", "bytes_sent", "sync_wait"):
        path = tmp_path / "plots" / f"{name}.png"
        assert path.stat().st_size > 0
        width, height = _png_size(path)
        assert width > 100 and height > 100
    assert "sync_wait:" in capsys.readouterr().out


def test_run_directory_uses_latest_checkpoint_and_several_runs(tmp_path, plot_run):
    _write_state(tmp_path / "diloco" / "checkpoint-50", _history(with_tokens=False)[:3])
    _write_state(tmp_path / "diloco" / "checkpoint-100", _history(with_tokens=False))
    _write_state(tmp_path / "ddp", _history(with_tokens=False, with_diloco=False))
    assert plot_run.find_trainer_state(tmp_path / "diloco").parent.name == "checkpoint-100"
    out = tmp_path / "plots"
    assert plot_run.main([str(tmp_path / "diloco"), str(tmp_path / "ddp"), "--out", str(out)]) == 0
    assert {p.name for p in out.iterdir()} == {"loss.png", "bytes_sent.png", "sync_wait.png"}


def test_baseline_without_diloco_metrics_plots_loss_only(tmp_path, plot_run):
    state = _write_state(tmp_path / "ddp", _history(with_tokens=True, with_diloco=False))
    written = plot_run.plot_runs({"ddp": plot_run.load_log_history(state)}, tmp_path / "plots")
    assert set(written) == {"loss"}
    _png_size(written["loss"])


def test_eval_entries_get_tokens_by_interpolation(plot_run):
    history = [
        {"step": 10, "loss": 3.0, "num_input_tokens_seen": 1000},
        {"step": 15, "eval_loss": 2.5},
        {"step": 20, "loss": 2.0, "num_input_tokens_seen": 3000},
    ]
    key, tokens = plot_run.token_axis(history)
    assert key == "num_input_tokens_seen"
    assert plot_run.metric_series(history, "eval_loss", tokens) == ([2000.0], [2.5])
    assert plot_run.metric_series(history, "loss", None) == ([10.0, 20.0], [3.0, 2.0])
    assert plot_run.token_axis([{"step": 1, "loss": 1.0}]) is None


def test_final_model_evaluation_is_its_own_point_after_the_last_sync(tmp_path, plot_run):
    """The Trainer's evaluation at the last step came before close() applied the last sync; all_results.json holds
    the final model's: the plot draws both, labelled, the final one at the run's last step."""
    run = tmp_path / "run"
    _write_state(run, _history(with_tokens=True))
    (run / "all_results.json").write_text(json.dumps({"eval_loss": 3.25, "num_input_tokens_seen": 51200}))
    history = plot_run.load_log_history(run)
    lines = plot_run.loss_lines({"run": history}, {"run": plot_run.token_axis(history)[1]}, {"run": 3.25})
    assert [label for *_, label in lines] == ["run train", "run eval during training",
                                             "run final model (after the last sync)"]  # fmt: skip
    assert lines[-1][:2] == ([100 * 512], [3.25])
    assert plot_run.final_evaluation(run) == 3.25 and plot_run.final_evaluation(tmp_path / "nothing") is None
    assert plot_run.main([str(run), "--out", str(tmp_path / "plots")]) == 0


def test_plots_go_into_the_runs_folder_not_the_current_directory(tmp_path, plot_run, monkeypatch, capsys):
    """`hf-diloco plot RUN` from anywhere writes RUN/plots; given a checkpoint's trainer_state.json, the run's folder
    above it; with several runs, the first one's."""
    run, other, elsewhere = tmp_path / "outputs" / "run", tmp_path / "outputs" / "ddp", tmp_path / "elsewhere"
    _write_state(run, _history(with_tokens=True))
    checkpoint_state = _write_state(run / "checkpoint-100", _history(with_tokens=True))
    _write_state(other, _history(with_tokens=True, with_diloco=False))
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    for arguments in ([str(run)], [str(checkpoint_state)], [str(run), str(other)]):
        assert plot_run.main(arguments) == 0
        assert {p.name for p in (run / "plots").iterdir()} == {"loss.png", "bytes_sent.png", "sync_wait.png"}
        assert f"loss: {run / 'plots' / 'loss.png'}" in capsys.readouterr().out
        for path in (run / "plots").iterdir():
            path.unlink()
    assert list(elsewhere.iterdir()) == [] and not (run / "checkpoint-100" / "plots").exists()
    assert not (other / "plots").exists()
