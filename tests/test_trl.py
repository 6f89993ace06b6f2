"""TRL's SFTTrainer combined with DiLoCoTrainer in both base-class orders: the loss is the one a plain SFTTrainer
computes (1 worker: the same batch; 2 workers: the mean of the workers' losses at step 1 is the plain loss on both
workers' rows together), and no per-step collective leaves the worker, whatever TRL gathers for its metrics."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from datasets import Dataset

from hf_diloco import DiLoCoTrainer, DiLoCoTrainingArguments
from tests.dist_utils import run_on_processes
from tests.engine_common import tiny_llama

trl = pytest.importorskip(
    "trl", reason="TRL is an optional dependency: pip install 'hf_diloco[trl]' (make setup does)"
)
SFTConfig, SFTTrainer = trl.SFTConfig, trl.SFTTrainer

VOCAB, SEQ, ROWS, BATCH, H, STEPS = 320, 16, 64, 2, 2, 4


@dataclass
class SFTDiLoCoConfig(DiLoCoTrainingArguments, SFTConfig):
    pass


class SFTFirst(SFTTrainer, DiLoCoTrainer):
    pass


class DiLoCoFirst(DiLoCoTrainer, SFTTrainer):
    pass


ORDERS = {"sft_first": SFTFirst, "diloco_first": DiLoCoFirst}


def _dataset() -> Dataset:
    ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(0)).tolist()
    return Dataset.from_dict({"input_ids": ids})


def _arguments(config_class, output_dir: Path, batch: int = BATCH, **extra):
    return config_class(
        output_dir=str(output_dir), use_cpu=True, max_steps=STEPS, per_device_train_batch_size=batch,
        learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True, bf16=False,
        seed=0, dataloader_num_workers=0, **extra,
    )  # fmt: skip


def _train(trainer_class, args, tokenizer_dir: Path, callbacks=()) -> dict[int, float]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    trainer = trainer_class(
        model=tiny_llama(VOCAB, layers=2, max_positions=SEQ),
        args=args,
        train_dataset=_dataset(),
        processing_class=tokenizer,
        callbacks=list(callbacks),
    )
    trainer.train()
    return {entry["step"]: entry for entry in trainer.state.log_history if "loss" in entry}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    from hf_diloco.job.data import train_bpe_tokenizer

    folder = tmp_path_factory.mktemp("tokenizer")
    texts = ["def add(x, y):\n    return x + y\n", "class Point:\n    x: int\n"] * 8
    train_bpe_tokenizer(texts, vocab_size=VOCAB - 20, show_progress=False).save_pretrained(folder)
    return folder


def _two_workers(rank: int, world: int, out_dir: str, tokenizer_dir: str) -> dict:
    from tests.test_trainer import _CollectiveRecorder, _PhaseCallback

    recorder = _CollectiveRecorder()
    results = {}
    for name, trainer_class in ORDERS.items():
        recorder.phase, recorder.calls = "setup", []
        args = _arguments(SFTDiLoCoConfig, Path(out_dir) / name, inner_steps=H)
        logs = _train(trainer_class, args, Path(tokenizer_dir), callbacks=[_PhaseCallback(recorder)])
        results[name] = {"logs": logs, "calls": list(recorder.calls)}
    return results


@pytest.mark.timeout(300)
def test_one_worker_trains_with_the_plain_sft_loss_in_either_order(tmp_path, tokenizer_dir):
    plain = _train(SFTTrainer, _arguments(SFTConfig, tmp_path / "plain"), tokenizer_dir)
    for name, trainer_class in ORDERS.items():
        combined = _train(trainer_class, _arguments(SFTDiLoCoConfig, tmp_path / name, inner_steps=H), tokenizer_dir)
        for step in range(1, H + 1):  # before the first outer step changes the weights
            assert combined[step]["loss"] == pytest.approx(plain[step]["loss"], abs=1e-6), (name, step)
        assert combined[STEPS]["num_tokens"] == STEPS * BATCH * SEQ  # TRL's own metrics still logged


@pytest.mark.timeout(600)
def test_two_workers_in_either_order_have_the_right_loss_and_stay_inside_the_worker(tmp_path, tokenizer_dir):
    ranks = run_on_processes(_two_workers, 2, str(tmp_path), str(tokenizer_dir), timeout_seconds=300)
    # One process reading both workers' first batches (rows 0-1 and 2-3 of the same shuffled order).
    plain = _train(SFTTrainer, _arguments(SFTConfig, tmp_path / "plain", batch=2 * BATCH), tokenizer_dir)
    for name in ORDERS:
        first = [rank[name]["logs"][1]["loss"] for rank in ranks]
        assert first[0] != first[1], "the workers must read different rows"
        assert sum(first) / 2 == pytest.approx(plain[1]["loss"], abs=1e-5), (name, first, plain[1]["loss"])
        for rank in ranks:
            logs = rank[name]["logs"]
            assert logs[STEPS]["diloco/outer_steps"] == STEPS // H
            assert logs[STEPS]["num_tokens"] == STEPS * BATCH * SEQ, "TRL's token count is the worker's"
            crossing = [(phase, op) for phase, op, group in rank[name]["calls"] if len(group) > 1]
            between_syncs = [(phase, op) for phase, op in crossing if phase.isdigit() and int(phase) % H]
            assert between_syncs == [], f"{name}: collectives across workers between syncs: {between_syncs}"
            assert {int(phase) for phase, _ in crossing if phase.isdigit()} == set(range(H, STEPS + 1, H))
