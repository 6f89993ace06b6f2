"""Perplexity from losses or from logits and labels, without downloading a scoring model.

The Hub's `perplexity` metric scores text with a model it downloads; here the model under training already produced
the losses (or logits), so this module only aggregates them: perplexity = exp(total NLL / total tokens), with the
sums taken over the whole evaluation set (not a mean of per-batch perplexities).
"""

import math

import datasets
import evaluate
import numpy as np

_DESCRIPTION = """
Perplexity of a causal language model computed from what the evaluation loop already has:

* per-example sums of token negative log-likelihoods (`predictions`, nats) and the number of tokens they cover
  (`references`), or
* logits (`predictions`, shape `(seq_len, vocab)` per example) and labels (`references`, shape `(seq_len,)`),
  where labels equal to `ignore_index` are skipped and, with `shift=True` (the Hugging Face causal-LM convention),
  the logits at position i are scored against the label at position i + 1.

perplexity = exp(sum of NLL / number of tokens). Nothing is downloaded; the module loads offline by path.
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions (`list[float]` or `list[list[list[float]]]`): per-example NLL sums in nats, or per-example logits.
    references (`list[int]` or `list[list[int]]`): per-example token counts, or per-example labels.
    shift (`bool`, *optional*, defaults to `True`): logits form only; score logits[i] against labels[i + 1].
    ignore_index (`int`, *optional*, defaults to `-100`): logits form only; labels to skip.

Returns:
    perplexity (`float`): exp(total NLL / total tokens); `inf` if that overflows.
    mean_nll (`float`): total NLL / total tokens (the usual `eval_loss` when every token counts once).
    eval_tokens (`int`): total tokens scored.

Examples:
    >>> metric = evaluate.load(hf_diloco.metrics.perplexity_metric_path())
    >>> metric.compute(predictions=[2.0, 4.0], references=[2, 2])["mean_nll"]
    1.5
"""

_CITATION = """
@misc{douillard2023diloco,
  title={DiLoCo: Distributed Low-Communication Training of Language Models},
  author={Arthur Douillard and others},
  year={2023},
  eprint={2311.08105},
  archivePrefix={arXiv},
}
"""

_LOSS_FEATURES = datasets.Features({"predictions": datasets.Value("float64"), "references": datasets.Value("int64")})
_LOGIT_FEATURES = datasets.Features(
    {
        "predictions": datasets.Sequence(datasets.Sequence(datasets.Value("float32"))),
        "references": datasets.Sequence(datasets.Value("int64")),
    }
)


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class Perplexity(evaluate.Metric):
    """Perplexity aggregated from NLL sums and token counts, or from logits and labels."""

    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            # The scalar form is tried first: a nested list of logits does not encode as a float.
            features=[_LOSS_FEATURES, _LOGIT_FEATURES],
        )

    def _compute(self, predictions, references, shift: bool = True, ignore_index: int = -100) -> dict:
        if len(predictions) and np.ndim(predictions[0]) == 0:
            total_nll = float(np.sum(np.asarray(predictions, dtype=np.float64)))
            total_tokens = int(np.sum(np.asarray(references, dtype=np.int64)))
        else:
            total_nll, total_tokens = 0.0, 0
            for logits, labels in zip(predictions, references):
                nll, tokens = _nll_from_logits(logits, labels, shift, ignore_index)
                total_nll += nll
                total_tokens += tokens
        if total_tokens <= 0:
            raise ValueError("perplexity needs at least one scored token; got a total token count of 0.")
        mean_nll = total_nll / total_tokens
        try:
            perplexity = math.exp(mean_nll)
        except OverflowError:
            perplexity = float("inf")
        return {"perplexity": perplexity, "mean_nll": mean_nll, "eval_tokens": total_tokens}


def _nll_from_logits(logits, labels, shift: bool, ignore_index: int) -> tuple[float, int]:
    logits = np.asarray(logits, dtype=np.float64)
    labels = np.asarray(labels, dtype=np.int64)
    if shift:
        logits, labels = logits[:-1], labels[1:]
    if logits.shape[0] != labels.shape[0]:
        raise ValueError(f"logits cover {logits.shape[0]} positions but labels cover {labels.shape[0]}.")
    keep = labels != ignore_index
    logits, labels = logits[keep], labels[keep]
    if labels.size == 0:
        return 0.0, 0
    peak = logits.max(axis=-1, keepdims=True)
    log_norm = np.log(np.exp(logits - peak).sum(axis=-1)) + peak[:, 0]
    picked = logits[np.arange(labels.size), labels]
    return float(np.sum(log_norm - picked)), int(labels.size)
