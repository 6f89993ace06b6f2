"""Draw the documentation site's figures into docs/img/ (PNG, matplotlib; no network).

    python scripts/docs_figures.py

- round.png, overlap.png: the concepts (what a round is; streaming fragments and overlap as a timeline), drawn from
  the schedule rules of docs/design.md with the shipped configs' settings.
- link.png: what crosses the link per worker, from the named figures of docs/figures.json (stored results).
- default_job_loss.png: the default job's loss beside DDP's, drawn by `hf-diloco plot` from the runs' logs stored in
  benchmarks/results/default_job/.
- comm_targets_loss.png, wan_utilization.png: benchmark plots from benchmarks/results.
- loss_over_seeds.png: DDP and the shipped `slow_link` and `sign_link` over the ten confirming seeds
  (`benchmarks.flagship --table ... --plot`, from benchmarks/results/seeds/); paper_regime_loss.png: the
  20-tokens-per-parameter runs (`benchmarks.paper_regime`'s own plot).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, Rectangle  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
IMG = ROOT / "docs" / "img"
RESULTS = ROOT / "benchmarks" / "results"
COMPUTE, EXCHANGE, GLOBAL = "#9ecae1", "#fdae6b", "#74c476"


def _lane(ax, y: float, label: str) -> None:
    ax.text(-0.5, y + 0.35, label, ha="right", va="center", fontsize=10)


def draw_round(path: Path) -> None:
    """Two workers, H inner steps each, then one outer sync; DDP's per-step all-reduce beneath for contrast."""
    steps, workers = 8, 2
    fig, ax = plt.subplots(figsize=(10, 4.2))
    for w in range(workers):
        y = 3.2 - 1.1 * w
        _lane(ax, y, f"worker {w + 1}")
        for r in range(2):
            start = r * (steps + 2)
            for s in range(steps):
                ax.add_patch(Rectangle((start + s, y), 0.9, 0.7, color=COMPUTE))
            ax.add_patch(Rectangle((start + steps, y), 1.8, 0.7, color=EXCHANGE))
    for r in range(2):
        x = r * (steps + 2) + steps
        for w in range(workers):
            ax.add_patch(Rectangle((x, 3.2 - 1.1 * w - 0.15), 1.8, 0.15, color=GLOBAL))
    x = 2 * (steps + 2) - 2
    ax.text(
        x + 0.9,
        4.05,
        "outer sync: average Δ = θg − θm,\nθg ← OuterOpt(θg, Δ), then θm ← θg",
        ha="center",
        va="bottom",
        fontsize=8,
    )
    ax.text(
        steps / 2,
        4.05,
        f"H = {steps} inner steps, each worker on its own data,\nnothing crosses workers",
        ha="center",
        va="bottom",
        fontsize=8,
    )
    y = 0.4
    _lane(ax, y, "DDP, for contrast")
    for s in range(2 * (steps + 2)):
        ax.add_patch(Rectangle((s, y), 0.6, 0.7, color=COMPUTE))
        ax.add_patch(Rectangle((s + 0.6, y), 0.35, 0.7, color=EXCHANGE))
    ax.text(2 * (steps + 2) + 0.3, y + 0.35, "all-reduce of the\ngradients every step", va="center", fontsize=8)
    ax.add_patch(Rectangle((0, -0.7), 0.8, 0.35, color=COMPUTE))
    ax.text(1, -0.52, "inner step (compute)", va="center", fontsize=8)
    ax.add_patch(Rectangle((6, -0.7), 0.8, 0.35, color=EXCHANGE))
    ax.text(7, -0.52, "exchange over the link", va="center", fontsize=8)
    ax.add_patch(Rectangle((12, -0.7), 0.8, 0.35, color=GLOBAL))
    ax.text(13, -0.52, "θg updated, the same on every worker", va="center", fontsize=8)
    _timeline_frame(ax, (-4.5, 2 * (steps + 2) + 4), (-0.9, 5.4),
                    "One round: H inner steps on every worker, then one outer sync (2 rounds shown)")  # fmt: skip
    _save(fig, path)


def draw_overlap(path: Path) -> None:
    """Streaming DiLoCo, H = 8, P = 4, tau = 1: one fragment launched every H/P steps, applied tau steps later."""
    steps, fragments, tau = 16, 4, 1
    h = 8
    fig, ax = plt.subplots(figsize=(10, 4.4))
    _lane(ax, 4.4, "inner steps")
    for s in range(steps):
        ax.add_patch(Rectangle((s, 4.4), 0.9, 0.7, color=COMPUTE))
        ax.text(s + 0.45, 4.75, str(s + 1), ha="center", va="center", fontsize=7)
    for p in range(fragments):
        y = 3.2 - 0.9 * p
        _lane(ax, y, f"fragment {p}")
        launch_offset = ((p + 1) * h // fragments) % h
        for t in range(1, steps + 1):
            if t % h == launch_offset:
                ax.add_patch(Rectangle((t, y), tau, 0.6, color=EXCHANGE))
                ax.add_patch(
                    FancyArrowPatch((t, y + 0.75), (t, 4.35), arrowstyle="-|>", mutation_scale=8, color="gray")
                )
                ax.add_patch(Rectangle((t + tau - 0.08, y), 0.16, 0.6, color=GLOBAL))
    ax.text(
        steps / 2,
        5.35,
        "H = 8, P = 4 fragments, τ = 1: a fragment is launched every H/P = 2 steps after the "
        "step that ends it,\nits exchange runs in the background during the next τ steps, then it is applied "
        "(merged with weight α)",
        ha="center",
        va="bottom",
        fontsize=8,
    )
    ax.add_patch(Rectangle((0, -0.2), 0.8, 0.35, color=EXCHANGE))
    ax.text(1, -0.02, "exchange in flight, behind compute", va="center", fontsize=8)
    ax.add_patch(Rectangle((8, -0.2), 0.16, 0.35, color=GLOBAL))
    ax.text(8.5, -0.02, "apply: θg ← OuterOpt, θm ← α·θm + (1 − α)·θg", va="center", fontsize=8)
    _timeline_frame(ax, (-3.5, steps + 1.5), (-0.4, 6.3),
                    "Streaming fragments and overlap: the exchange hides behind the inner steps")  # fmt: skip
    _save(fig, path)


def draw_link(path: Path) -> None:
    """x fewer bytes than fp32 DDP per token, per method, from the stored results (log scale)."""
    figures = json.loads((ROOT / "docs" / "figures.json").read_text())
    comm = {r["method"]: r for r in json.loads((RESULTS / "comm.json").read_text())["results"]}
    ddp = comm["ddp"]["bytes_per_token"]
    methods = [
        ("DDP, fp32 gradients\nevery step", 1.0),
        ("DiLoCo H = 100, fp32\n(comm.json)", ddp / comm["diloco"]["bytes_per_token"]),
        ("Streaming DiLoCo fp4\n(comm_targets.json)", float(figures["streaming_fp4_fewer_bytes"]["text"][:-1])),
        ("slow_link: fp4 + deflate,\nH = 120", float(figures["slow_link_fewer_bytes"]["text"].split("-")[0])),
        ("sign_link: 1 bit per value,\nH = 120", float(figures["sign_link_fewer_bytes"]["text"][:-1])),
    ]
    fig, ax = plt.subplots(figsize=(9, 3.8))
    names, ratios = zip(*methods)
    bars = ax.barh(range(len(names)), ratios, color=[EXCHANGE, COMPUTE, COMPUTE, GLOBAL, GLOBAL])
    ax.set_xscale("log")
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.invert_yaxis()
    for bar, ratio in zip(bars, ratios):
        ax.text(bar.get_width() * 1.1, bar.get_y() + bar.get_height() / 2, f"{ratio:.0f}x", va="center", fontsize=8)
    ax.set_xlim(0.8, 20000)
    ax.set_xlabel("x fewer bytes than fp32 DDP per token trained (2 workers; log scale)")
    ax.set_title("What crosses the link, per worker")
    _save(fig, path)


def draw_comm_loss(path: Path) -> None:
    """Training loss of DDP and Streaming DiLoCo fp4 on the same tokens (benchmarks/results/comm_targets.json)."""
    results = json.loads((RESULTS / "comm_targets.json").read_text())["results"]
    fig, ax = plt.subplots(figsize=(8, 4))
    for result in results:
        steps, losses = zip(*result["train_curve"])
        ax.plot(steps, losses, label=f"{result['method']} (eval {result['eval_loss']:.3f})")
    ax.set_xlabel("step (8 x 128 tokens per worker, 2 workers)")
    ax.set_ylabel("training loss")
    ax.set_title("DDP and Streaming DiLoCo fp4, 400 steps (comm_targets.json)")
    ax.legend(fontsize=8)
    _save(fig, path)


def draw_default_job(path: Path) -> None:
    """`hf-diloco plot` of the default job and of DDP on the same job, from their stored logs."""
    runs = RESULTS / "default_job"
    with tempfile.TemporaryDirectory() as out:
        command = [str(Path(sys.executable).parent / "hf-diloco"), "plot", str(runs / "tiny_diloco"),
                   str(runs / "tiny_ddp"), "--out", out]  # fmt: skip
        subprocess.run(command, check=True, timeout=300)
        shutil.copyfile(Path(out) / "loss.png", path)


def draw_loss_over_seeds(path: Path) -> None:
    """The long regime's runs on the confirming seeds, drawn by `benchmarks.flagship --table --plot`: every method
    that ran on all of them (a runner-up tried on a few is left out)."""
    seeds = range(10, 20)  # benchmarks/figures.py's CONFIRMING_SEEDS
    runs = {run.name: json.loads(run.read_text()) for run in sorted((RESULTS / "seeds").glob("*.json"))}
    seen: dict[str, set] = {}
    for run in runs.values():
        words = run["command"].split()
        for result in run["results"]:
            seen.setdefault(result["method"], set()).add(int(words[words.index("--seed") + 1]))
    complete = {method for method, found in seen.items() if set(seeds) <= found}
    with tempfile.TemporaryDirectory() as folder:
        for name, run in runs.items():
            kept = [result for result in run["results"] if result["method"] in complete]
            (Path(folder) / name).write_text(json.dumps({**run, "results": kept}))
        command = [sys.executable, "-m", "benchmarks.flagship", "--table", *sorted(map(str, Path(folder).iterdir())),
                   "--seeds", *map(str, seeds), "--plot", str(path)]  # fmt: skip
        subprocess.run(command, check=True, timeout=300, cwd=ROOT, stdout=subprocess.DEVNULL)


def _timeline_frame(ax, xlim: tuple[float, float], ylim: tuple[float, float], title: str) -> None:
    """A timeline's frame: its extent, no axes, its title."""
    ax.set_xlim(*xlim)
    ax.set_ylim(*ylim)
    ax.axis("off")
    ax.set_title(title)


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    IMG.mkdir(parents=True, exist_ok=True)
    draw_round(IMG / "round.png")
    draw_overlap(IMG / "overlap.png")
    draw_link(IMG / "link.png")
    draw_comm_loss(IMG / "comm_targets_loss.png")
    shutil.copyfile(RESULTS / "wan_utilization.png", IMG / "wan_utilization.png")
    draw_loss_over_seeds(IMG / "loss_over_seeds.png")
    shutil.copyfile(RESULTS / "paper_regime" / "paper_regime.png", IMG / "paper_regime_loss.png")
    if (RESULTS / "default_job").is_dir():
        draw_default_job(IMG / "default_job_loss.png")


if __name__ == "__main__":
    main()
