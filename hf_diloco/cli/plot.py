"""`hf-diloco plot`: turn the logs of one or more training runs into PNG plots.

Reads the `log_history` of a Trainer's `trainer_state.json` (given directly, or found in a run directory or its
latest `checkpoint-*`) and writes:

* `loss.png`: training and evaluation loss against tokens seen (against steps when no token count was logged),
  with the final model's evaluation (`all_results.json`, after the last sync) as a point of its own,
* `bytes_sent.png`: cumulative bytes sent across workers by the outer sync (`diloco/bytes_sent`) against tokens,
* `sync_wait.png`: cumulative seconds spent waiting for outer syncs (`diloco/sync_wait_seconds`) against steps.

The PNG files go into `plots/` in the run's folder (the first run's with several; `--out` names another folder).
Several runs (e.g. DiLoCo and a DDP baseline) go on the same axes, one line each:

    hf-diloco plot outputs/tiny_diloco outputs/tiny_ddp/trainer_state.json     # writes outputs/tiny_diloco/plots/

Needs matplotlib (`pip install "hf_diloco[plots]"`).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

TOKEN_KEYS = ("num_input_tokens_seen", "diloco/tokens_seen")
LogHistory = list[dict[str, float]]


def find_trainer_state(path: str | Path) -> Path:
    """`path` itself if it is a file, else `trainer_state.json` in the directory or in its latest checkpoint."""
    path = Path(path)
    if path.is_file():
        return path
    if (path / "trainer_state.json").is_file():
        return path / "trainer_state.json"
    checkpoints = sorted(
        (p for p in path.glob("checkpoint-*") if (p / "trainer_state.json").is_file()),
        key=lambda p: int(re.sub(r"\D", "", p.name) or 0),
    )
    if not checkpoints:
        raise FileNotFoundError(f"no trainer_state.json in {path} or its checkpoint-* folders")
    return checkpoints[-1] / "trainer_state.json"


def run_folder(path: str | Path) -> Path:
    """The output folder of the run that `path` names: a run directory itself, or the folder holding a
    `trainer_state.json` file (the run's, above it, when that is a `checkpoint-N` folder)."""
    path = Path(path)
    if path.is_file():
        path = path.parent
        if re.fullmatch(r"checkpoint-\d+", path.name):
            path = path.parent
    return path


def load_log_history(path: str | Path) -> LogHistory:
    """The `log_history` entries of a run (a `trainer_state.json` or a run directory)."""
    state = json.loads(find_trainer_state(path).read_text())
    return [entry for entry in state.get("log_history", []) if "step" in entry]


def token_axis(history: LogHistory) -> tuple[str, dict[int, float]] | None:
    """
    Tokens seen at every logged step, from the first token counter that was logged.

    Entries without the counter (e.g. evaluation logs) get it by linear interpolation over steps.
    Returns `(key, {step: tokens})`, or None when no token counter was logged.
    """
    for key in TOKEN_KEYS:
        known = sorted({int(e["step"]): float(e[key]) for e in history if key in e}.items())
        if known:
            steps, tokens = zip(*known)
            every_step = sorted({int(e["step"]) for e in history})
            return key, dict(zip(every_step, np.interp(every_step, steps, tokens).tolist()))
    return None


def metric_series(history: LogHistory, key: str, x_axis: dict[int, float] | None) -> tuple[list[float], list[float]]:
    """`(x, y)` for every entry that logged `key`; x is tokens when `x_axis` is given, else the step."""
    xs, ys = [], []
    for entry in history:
        if key in entry:
            step = int(entry["step"])
            xs.append(x_axis[step] if x_axis is not None else float(step))
            ys.append(float(entry[key]))
    return xs, ys


def final_evaluation(path: str | Path) -> float | None:
    """
    The final model's `eval_loss`, from the `all_results.json` of a run folder (None when there is none).

    It is taken after `close()` applied the last outer sync, so it differs from the evaluation the Trainer logged
    at the same step during training (before that sync): the plot draws it as a point of its own.
    """
    path = Path(path)
    results = (path if path.is_dir() else path.parent) / "all_results.json"
    if not results.is_file():
        return None
    value = json.loads(results.read_text()).get("eval_loss")
    return None if value is None else float(value)


def loss_lines(
    runs: dict[str, LogHistory], x_axes: dict[str, dict[int, float] | None], finals: dict[str, float] | None = None
) -> list[tuple[list[float], list[float], str, str]]:
    """The loss plot's lines: each run's training and evaluation loss, and its final model's evaluation (`finals`,
    label -> eval_loss) at the run's last logged step, labelled as taken after the last sync."""
    lines = []
    for label, history in runs.items():
        for key, style, name in (("loss", "-", "train"), ("eval_loss", "o--", "eval during training")):
            xs, ys = metric_series(history, key, x_axes[label])
            if xs:
                lines.append((xs, ys, style, f"{label} {name}"))
        final = (finals or {}).get(label)
        if final is not None and history:
            last = max(int(entry["step"]) for entry in history)
            x = x_axes[label][last] if x_axes[label] is not None else float(last)
            lines.append(([x], [final], "*", f"{label} final model (after the last sync)"))
    return lines


def plot_runs(
    runs: dict[str, LogHistory], out_dir: str | Path, finals: dict[str, float] | None = None
) -> dict[str, Path]:
    """Write the plots for `runs` (label -> log history) into `out_dir`; returns plot name -> path of those written.
    `finals` (label -> eval_loss of the final model, see `final_evaluation`) adds each run's final point."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    axes = {label: token_axis(history) for label, history in runs.items()}
    # Mixing tokens and steps on one axis would mislead: use tokens only if every run logged them.
    use_tokens = all(axis is not None for axis in axes.values())
    x_label = "tokens seen" if use_tokens else "optimizer step"

    def x_axis(label: str) -> dict[int, float] | None:
        return axes[label][1] if use_tokens else None

    written = {}
    losses = loss_lines(runs, {label: x_axis(label) for label in runs}, finals)
    if losses:
        written["loss"] = _save_plot(losses, x_label, "loss", "Loss", out_dir / "loss.png")

    bytes_lines = []
    for label, history in runs.items():
        xs, ys = metric_series(history, "diloco/bytes_sent", x_axis(label))
        if xs:
            bytes_lines.append((xs, [y / 1e6 for y in ys], "-", label))
    if bytes_lines:
        title = "Bytes sent across workers (outer sync, per process)"
        # Cumulative counters that jump at each outer sync: draw them as steps, not slopes.
        written["bytes_sent"] = _save_plot(
            bytes_lines, x_label, "MB sent", title, out_dir / "bytes_sent.png", drawstyle="steps-post"
        )

    wait_lines = []
    for label, history in runs.items():
        xs, ys = metric_series(history, "diloco/sync_wait_seconds", None)
        if xs:
            wait_lines.append((xs, ys, "-", label))
    if wait_lines:
        title = "Time waiting for outer syncs (cumulative)"
        written["sync_wait"] = _save_plot(
            wait_lines, "optimizer step", "seconds", title, out_dir / "sync_wait.png", drawstyle="steps-post"
        )
    return written


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise SystemExit('hf-diloco plot needs matplotlib: pip install "hf_diloco[plots]"') from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save_plot(lines: list, x_label: str, y_label: str, title: str, path: Path, drawstyle: str = "default") -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=100)
    for xs, ys, style, label in lines:
        ax.plot(xs, ys, style, label=label, markersize=4, drawstyle=drawstyle)
    ax.set_xlabel(x_label)
    ax.set_ylabel(y_label)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _run_label(path: str, taken: set[str]) -> str:
    resolved = Path(path).resolve()
    label = resolved.parent.name if resolved.is_file() else resolved.name
    while label in taken:
        label += "'"
    return label


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hf-diloco plot",
        description="Plot loss, bytes sent across workers and time waiting for syncs of one or more runs (PNG files).",
    )
    parser.add_argument("runs", nargs="+", help="run directories or trainer_state.json files")
    parser.add_argument(
        "--out", default=None, help="directory for the PNG files (default: plots/ in the (first) run's folder)"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    runs: dict[str, LogHistory] = {}
    finals: dict[str, float] = {}
    for path in args.runs:
        label = _run_label(path, set(runs))
        runs[label] = load_log_history(path)
        final = final_evaluation(path)
        if final is not None:
            finals[label] = final
    if not any(runs.values()):
        print("no log entries found; nothing to plot", file=sys.stderr)
        return 1
    written = plot_runs(runs, args.out or run_folder(args.runs[0]) / "plots", finals)
    for name in ("loss", "bytes_sent", "sync_wait"):
        print(f"{name}: {written[name]}" if name in written else f"{name}: not logged, no plot")
    return 0
