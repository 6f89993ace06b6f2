"""The perplexity `evaluate` module: loads offline by path, matches hand-computed exp(mean NLL)."""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from hf_diloco.metrics import perplexity_metric_path

ROOT = Path(__file__).resolve().parents[1]

# Runs in a fresh interpreter so the offline switches are read at import time, with every network
# connection refused: loading by path must not need the Hub.
OFFLINE_SCRIPT = """
import socket, sys
def refuse(self, address):
    if self.family in (socket.AF_INET, socket.AF_INET6):
        raise OSError(f"network access attempted: {address}")
    return original(self, address)
original = socket.socket.connect
socket.socket.connect = refuse
import evaluate
metric = evaluate.load(sys.argv[1])
print(repr(metric.compute(predictions=[2.0, 3.5, 0.5], references=[4, 3, 1])))
"""


@pytest.mark.timeout(180)
def test_loads_offline_by_path(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_EVALUATE_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    env["HF_HOME"] = str(tmp_path / "hf_home")
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run(
        [sys.executable, "-c", OFFLINE_SCRIPT, perplexity_metric_path()],
        env=env,
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = eval(done.stdout.strip().splitlines()[-1])
    assert result["eval_tokens"] == 8
    assert result["perplexity"] == pytest.approx(math.exp((2.0 + 3.5 + 0.5) / 8), rel=1e-12)


@pytest.fixture(scope="module")
def metric():
    import evaluate

    return evaluate.load(perplexity_metric_path())


@pytest.mark.timeout(120)
def test_losses_form_with_batches(metric):
    metric.add_batch(predictions=[1.0, 2.0], references=[1, 2])
    metric.add_batch(predictions=[6.0], references=[3])
    result = metric.compute()
    assert result["eval_tokens"] == 6
    assert result["mean_nll"] == pytest.approx(9.0 / 6)
    assert result["perplexity"] == pytest.approx(math.exp(1.5))


@pytest.mark.timeout(120)
def test_logits_form_matches_torch_cross_entropy(metric):
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 6, 11, generator=generator)
    labels = torch.randint(0, 11, (3, 6), generator=generator)
    labels[0, 3] = -100
    labels[2, 1:3] = -100
    # Hugging Face causal-LM loss: logits at i score the label at i + 1, -100 ignored.
    reference = F.cross_entropy(logits[:, :-1].reshape(-1, 11), labels[:, 1:].reshape(-1), ignore_index=-100)
    scored = int((labels[:, 1:] != -100).sum())
    result = metric.compute(predictions=logits.numpy(), references=labels.numpy())
    assert result["eval_tokens"] == scored
    assert result["mean_nll"] == pytest.approx(reference.item(), rel=1e-5)
    assert result["perplexity"] == pytest.approx(math.exp(reference.item()), rel=1e-5)

    unshifted = F.cross_entropy(logits.reshape(-1, 11), labels.reshape(-1), ignore_index=-100)
    result = metric.compute(predictions=logits.numpy(), references=labels.numpy(), shift=False)
    assert result["mean_nll"] == pytest.approx(unshifted.item(), rel=1e-5)


@pytest.mark.timeout(120)
def test_no_tokens_and_overflow(metric):
    with pytest.raises(ValueError, match="token"):
        metric.compute(predictions=[0.0], references=[0])
    assert metric.compute(predictions=[1e6], references=[1])["perplexity"] == math.inf
