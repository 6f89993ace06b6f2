"""Drop-in swap: tests/scripts/run_clm_style.py (an ordinary run_clm.py-style Trainer script) with only `Trainer` ->
`DiLoCoTrainer` and `TrainingArguments` -> `DiLoCoTrainingArguments` swapped (`--use_diloco`), on 1 process and on 2
torchrun processes, with callbacks, compute_metrics, eval_strategy, gradient accumulation, bf16 autocast on CPU,
save_total_limit, load_best_model_at_end and resume_from_checkpoint. Also: tensorboard shows `diloco/*` scalars, and
`push_to_hub` uploads the global model with the DiLoCo model card (to the local fake Hub of tests/test_hub.py)."""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers.utils.hub
import yaml
from datasets import Dataset
from huggingface_hub import HfApi
from safetensors.torch import load, load_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from hf_diloco import DiLoCoTrainer, DiLoCoTrainingArguments
from hf_diloco.publish.model_card import has_diloco_tag
from tests.dist_utils import free_port
from tests.test_hub import fake_hub, loopback_only  # noqa: F401 - the local fake Hub and the no-network guard

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "scripts" / "run_clm_style.py"
H, STEPS, SAVE_EVERY, STOP_AT, LIMIT = 4, 12, 4, 8, 2
COMMON = [
    "--do_train", "--do_eval", "--use_cpu", "--bf16", "--seed", "0", "--max_steps", str(STEPS),
    "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "8", "--gradient_accumulation_steps", "2",
    "--learning_rate", "3e-3", "--lr_scheduler_type", "constant", "--logging_steps", "2",
    "--eval_strategy", "steps", "--eval_steps", str(SAVE_EVERY), "--save_strategy", "steps",
    "--save_steps", str(SAVE_EVERY), "--save_total_limit", str(LIMIT), "--load_best_model_at_end",
    "--metric_for_best_model", "eval_loss", "--report_to", "tensorboard", "--disable_tqdm", "true",
    # "Best" = highest loss: an early checkpoint, so loading it at the end visibly differs from the last weights.
    "--greater_is_better", "true",
]  # fmt: skip
DILOCO = ["--use_diloco", "--inner_steps", str(H)]


def _run(output_dir: Path, *extra: str, processes: int = 1) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    launcher = [sys.executable]
    if processes > 1:
        launcher = [
            str(Path(sys.executable).parent / "torchrun"), "--nproc_per_node", str(processes),
            "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
        ]  # fmt: skip
    command = [*launcher, str(SCRIPT), *COMMON, "--output_dir", str(output_dir), *extra]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]


def _events(output_dir: Path, rank: int = 0) -> list[dict]:
    return json.loads((output_dir / f"events_rank{rank}.json").read_text())


def _params(output_dir: Path, rank: int) -> dict[str, torch.Tensor]:
    return torch.load(output_dir / f"final_params_rank{rank}.pt", weights_only=True)


def _checkpoints(output_dir: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in output_dir.glob("checkpoint-*"))


def _best_step(output_dir: Path) -> int:
    state = json.loads((output_dir / "trainer_state.json").read_text())
    return int(state["best_model_checkpoint"].rsplit("-", 1)[1])


def _assert_same_weights(a: Path, b: Path) -> None:
    first, second = load_file(a), load_file(b)
    assert first.keys() == second.keys()
    for name in first:
        assert torch.equal(first[name], second[name]), name


def _num_parameters() -> int:
    config = LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16,
    )  # fmt: skip
    return sum(p.numel() for p in LlamaForCausalLM(config).parameters())


def _check_saved_folder(folder: Path, expected_bytes: int) -> None:
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert model.num_parameters() == _num_parameters()
    card = (folder / "README.md").read_text()
    assert has_diloco_tag(folder / "README.md")
    assert f"({expected_bytes:,} bytes)" in card, card
    assert re.search(rf"\b{H}\b", card)


# ------------------------------------------------------------------------------------------------ one process


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    out = tmp_path_factory.mktemp("dropin_1")
    _run(out / "hf")
    _run(out / "diloco", *DILOCO)
    return out


@pytest.mark.timeout(500)
def test_one_process_swap_runs_like_the_trainer(one_process):
    hf, diloco = one_process / "hf", one_process / "diloco"
    # The same callbacks fire at the same steps; DiLoCo's logs carry the same keys plus diloco/*.
    hf_events, dl_events = _events(hf), _events(diloco)
    shape = [(e["event"], e["step"], e.get("metrics")) for e in hf_events if e["event"] != "log"]
    assert shape == [(e["event"], e["step"], e.get("metrics")) for e in dl_events if e["event"] != "log"]
    evaluations = [e for e in dl_events if e["event"] == "evaluate"]
    assert [e["step"] for e in evaluations] == [4, 8, 12]  # written at train end, before the final evaluate
    assert "eval_accuracy" in evaluations[0]["metrics"], "compute_metrics with preprocess_logits_for_metrics"
    train_logs = [e["keys"] for e in dl_events if e["event"] == "log" and "loss" in e["keys"]]
    assert len(train_logs) == STEPS // 2 and "diloco/compute_utilization" in train_logs[0]
    hf_train_logs = [e["keys"] for e in hf_events if e["event"] == "log" and "loss" in e["keys"]]
    assert set(hf_train_logs[0]) <= set(train_logs[0])
    # save_total_limit and load_best_model_at_end (the best checkpoint is kept on top of the newest).
    for folder in (hf, diloco):
        best = _best_step(folder)
        assert best < STEPS and _checkpoints(folder) == [best, STEPS]
        _assert_same_weights(folder / "model.safetensors", folder / f"checkpoint-{best}" / "model.safetensors")
    # One worker sends nothing across workers; the card says so and the folder loads.
    _check_saved_folder(diloco, expected_bytes=0)
    assert not (hf / "README.md").exists() or not has_diloco_tag(hf / "README.md")
    for step in _checkpoints(diloco):
        assert has_diloco_tag(diloco / f"checkpoint-{step}" / "README.md")


@pytest.mark.timeout(500)
def test_tensorboard_shows_diloco_scalars(one_process):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    [run] = list((one_process / "diloco" / "runs").iterdir())
    accumulator = EventAccumulator(str(run))
    accumulator.Reload()
    tags = accumulator.Tags()["scalars"]
    for name in ("outer_steps", "bytes_sent", "sync_wait_seconds", "compute_utilization", "pseudo_grad_norm"):
        assert f"train/diloco/{name}" in tags, tags
    assert "train/diloco/local_global_drift" in tags
    outer_steps = [event.value for event in accumulator.Scalars("train/diloco/outer_steps")]
    assert outer_steps == [step // H for step in range(2, STEPS + 1, 2)]
    utilization = [event.value for event in accumulator.Scalars("train/diloco/compute_utilization")]
    assert all(0 < value <= 1 for value in utilization)


# ------------------------------------------------------------------------------------------------ two processes


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    out = tmp_path_factory.mktemp("dropin_2")
    _run(out / "full", *DILOCO, processes=2)
    _run(out / "resumed", *DILOCO, "--stop_at_step", str(STOP_AT), processes=2)
    checkpoint = out / "resumed" / f"checkpoint-{STOP_AT}"
    _run(out / "resumed", *DILOCO, "--resume_from_checkpoint", str(checkpoint), processes=2)
    return out


@pytest.mark.timeout(900)
def test_two_processes_end_identical_and_save_loadable_folder_with_card(two_processes):
    numel = _num_parameters()
    # Per sync: the 24-byte schedule tag, the 4-byte norm robust clipping gathers, then the fp32 all_to_all and
    # all_gather of halves.
    expected_bytes = STEPS // H * (24 + 4 + 2 * (2 - 1) * 4 * -(-numel // 2))
    for run in ("full", "resumed"):
        folder = two_processes / run
        first, second = _params(folder, 0), _params(folder, 1)
        assert first.keys() == second.keys()
        for name in first:
            assert torch.equal(first[name], second[name]), (run, name)
        _check_saved_folder(folder, expected_bytes)
        saved = load_file(folder / "model.safetensors")
        for name, value in first.items():
            assert torch.equal(saved[name].float(), value), name
        best = _best_step(folder)
        assert best < STEPS and _checkpoints(folder) == [best, STEPS]
        _assert_same_weights(folder / "model.safetensors", folder / f"checkpoint-{best}" / "model.safetensors")
    assert _events(two_processes / "full", 0) != [] and _events(two_processes / "full", 1) != []


@pytest.mark.timeout(900)
def test_two_processes_resume_from_checkpoint_continues_exactly(two_processes):
    """Stopped after step 8 and resumed from checkpoint-8, the run's step-12 checkpoint (theta_g) and its logged
    losses after step 8 equal those of the uninterrupted run."""
    full, resumed = two_processes / "full", two_processes / "resumed"
    _assert_same_weights(full / "checkpoint-12" / "model.safetensors", resumed / "checkpoint-12" / "model.safetensors")

    def losses(folder):
        state = json.loads((folder / "trainer_state.json").read_text())
        return {e["step"]: e["loss"] for e in state["log_history"] if "loss" in e and e["step"] > STOP_AT}

    assert losses(full) == losses(resumed) and len(losses(full)) == (STEPS - STOP_AT) // 2
    resumed_events = _events(resumed, 1)
    assert [e["step"] for e in resumed_events if e["event"] == "step_end"] == list(range(STOP_AT + 1, STEPS + 1))


# ------------------------------------------------------------------------------------------------ push_to_hub


@pytest.mark.timeout(300)
def test_push_to_hub_uploads_global_model_and_diloco_card(tmp_path, fake_hub, monkeypatch):  # noqa: F811
    monkeypatch.setattr(transformers.utils.hub, "_hf_api", HfApi(endpoint=fake_hub["endpoint"]))
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16,
    )  # fmt: skip
    ids = torch.randint(0, 128, (32, 16), generator=torch.Generator().manual_seed(0)).tolist()
    args = DiLoCoTrainingArguments(
        output_dir=str(tmp_path / "out"), use_cpu=True, max_steps=6, per_device_train_batch_size=4, inner_steps=4,
        report_to=[], save_strategy="steps", save_steps=4, hub_model_id="someone/tiny-diloco", hub_token="hf_fake",
        disable_tqdm=True,
    )  # fmt: skip
    trainer = DiLoCoTrainer(
        model=LlamaForCausalLM(config), args=args, train_dataset=Dataset.from_dict({"input_ids": ids, "labels": ids})
    )
    trainer.train()
    trainer.push_to_hub(tags=["tiny"])

    [created] = fake_hub["created"]
    assert (created["organization"], created["name"]) == ("someone", "tiny-diloco")
    [commit] = fake_hub["commits"]
    uploaded = {
        op["value"]["path"]: base64.b64decode(op["value"]["content"])
        for op in commit["lines"][1:]
        if op["key"] == "file"
    }
    assert {"config.json", "model.safetensors", "README.md"} <= set(uploaded)
    # What a user publishes, not the training state around it (checkpoint-4 and training_args.bin are in the folder).
    assert (tmp_path / "out" / "checkpoint-4").is_dir() and (tmp_path / "out" / "training_args.bin").is_file()
    assert not [name for name in uploaded if name.startswith("checkpoint-") or name.endswith((".bin", ".pt", ".pth"))]
    weights = load(uploaded["model.safetensors"])
    theta_g = trainer.diloco.global_parameters()
    for name, value in theta_g.items():
        assert torch.equal(weights[name], value), name
    card = uploaded["README.md"].decode()
    front = yaml.safe_load(card.split("---\n")[1])
    assert "diloco" in front["tags"] and "tiny" in front["tags"]
    assert "# tiny-diloco" in card and "| eval_loss" not in card
    assert 'from_pretrained("someone/tiny-diloco")' in card
