"""A method against DDP over several seeds: the summary cells of the loss tables and the plot of the curves.

`benchmarks.flagship --table` (the 7.5-tokens-per-parameter runs) and `benchmarks.paper_regime` (20 tokens per
parameter) both report, per method, the mean gap to DDP of the same seed with its standard error, how many seeds are
above +1% and +2% (counted on the gaps as the cells print them, so that a cell of +1.00% is not above +1%), and how
many times fewer bytes than DDP it sent; and both draw loss against tokens and against bytes sent, each method's mean
over its seeds with the min-max band shaded.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

# One curve of one seed: (tokens trained by all workers, bytes one worker had sent by then, loss).
Curve = list[tuple[float, float, float]]


def mean_gap_cell(gaps: list[float]) -> str:
    """`**+1.23% ± 0.45**` (mean and standard error of the mean, in percent; no error for one seed)."""
    error = f" ± {100 * statistics.stdev(gaps) / math.sqrt(len(gaps)):.2f}" if len(gaps) > 1 else ""
    return f"**{100 * statistics.fmean(gaps):+.2f}%{error}**"


def above_cells(gaps: list[float], limits: tuple[float, ...] = (1, 2)) -> list[str]:
    """`k of n` per limit in percent: the seeds whose gap, as printed (two decimals), is above it."""
    return [f"{sum(round(100 * gap, 2) > limit for gap in gaps)} of {len(gaps)}" for limit in limits]


def fewer_cell(ratios: list[float]) -> str:
    """`3713x`, or `1071-1077x` where the seeds' ratios round differently."""
    low, high = min(ratios), max(ratios)
    return f"{low:.0f}x" if round(low) == round(high) else f"{low:.0f}-{high:.0f}x"


def plot_over_seeds(series: dict[str, list[Curve]], path: Path, ylabel: str, note: str = "") -> bool:
    """Loss against tokens and against bytes sent (log): each method's mean over its seeds, min-max shaded.

    A method's curves are cut to the shortest; its points where nothing was sent yet are left off the bytes panel
    (a log axis has no 0). False (and a line saying so) where matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        print(f"matplotlib is not installed: no {path}", flush=True)
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_tokens, by_bytes) = plt.subplots(1, 2, figsize=(12, 4.6))
    for name, curves in series.items():
        length = min(len(curve) for curve in curves)
        tokens = [curves[0][i][0] for i in range(length)]
        sent = [statistics.fmean(curve[i][1] for curve in curves) for i in range(length)]
        losses = [[curve[i][2] for curve in curves] for i in range(length)]
        mean = [statistics.fmean(values) for values in losses]
        low, high = [min(values) for values in losses], [max(values) for values in losses]
        label = f"{name} ({len(curves)} seed{'s' if len(curves) > 1 else ''})"
        (line,) = by_tokens.plot(tokens, mean, label=label)
        by_tokens.fill_between(tokens, low, high, color=line.get_color(), alpha=0.2)
        kept = [i for i in range(length) if sent[i] > 0]
        by_bytes.plot([sent[i] for i in kept], [mean[i] for i in kept], color=line.get_color(), label=label)
        by_bytes.fill_between(
            [sent[i] for i in kept], [low[i] for i in kept], [high[i] for i in kept], color=line.get_color(), alpha=0.2
        )
    by_tokens.set(xlabel="tokens trained (all workers)", ylabel=ylabel, title="Loss vs tokens")
    by_bytes.set(xlabel="bytes sent per worker (log)", ylabel=ylabel, title="Loss vs bytes sent", xscale="log")
    for axis in (by_tokens, by_bytes):
        axis.legend(fontsize=8)
        axis.grid(alpha=0.3)
    fig.suptitle(f"mean over seeds, min-max shaded{'; ' + note if note else ''}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
