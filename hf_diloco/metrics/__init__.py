"""`evaluate` metric modules shipped with hf_diloco, loadable offline with `evaluate.load(path)`."""

from pathlib import Path

_METRICS_DIR = Path(__file__).resolve().parent


def perplexity_metric_path() -> str:
    """
    Directory of the perplexity metric module, for `evaluate.load(perplexity_metric_path())`.

    The module aggregates losses (or logits and labels) the evaluation loop already has; it downloads nothing.
    """
    return str(_METRICS_DIR / "perplexity")


__all__ = ["perplexity_metric_path"]
