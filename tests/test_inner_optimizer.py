"""`inner_optimizer: muon`: Muon for the block stack's matrices and AdamW for the rest, as one optimizer, against the
two torch optimizers stepped side by side; its state saved and resumed; through `DiLoCoTrainer` with a checkpoint;
and where the main job and the baseline take or refuse it."""

from __future__ import annotations

import copy

import pytest
import torch
from datasets import Dataset

from hf_diloco.integrations.inner_optimizer import MuonWithAdamW, build_muon_with_adamw, muon_parameter_names
from tests.engine_common import cpu_trainer_args, tiny_llama

VOCAB, SEQ = 64, 8
ADAMW = dict(betas=(0.9, 0.95), eps=1e-8)


def _model():
    return tiny_llama(VOCAB, layers=2, max_positions=SEQ, tie_word_embeddings=False)


def _batch(step: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(step))
    return {"input_ids": ids, "labels": ids}


def _decay_names(model) -> list[str]:
    return [name for name, param in model.named_parameters() if param.dim() >= 2]


def test_the_block_stacks_matrices_go_to_muon_and_the_rest_to_adamw():
    model = _model()
    muon = muon_parameter_names(model)
    assert muon and all(name.startswith("model.layers.") for name in muon)
    assert {"model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"} <= muon
    assert not muon & {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"}
    assert not any("layernorm" in name for name in muon)


def test_one_optimizer_steps_exactly_as_muon_and_adamw_side_by_side():
    """The reference: torch.optim.Muon (Moonshot's RMS matching) over the matrices and AdamW over the rest, each
    built directly, on a copy of the model with the same gradients; a learning-rate change reaches both."""
    model = _model()
    reference = copy.deepcopy(model)
    decay = _decay_names(model)
    ours = build_muon_with_adamw(model, 1e-2, 0.1, decay, ADAMW)
    muon_names = muon_parameter_names(reference)
    named = dict(reference.named_parameters())
    ref_muon = torch.optim.Muon(
        [named[n] for n in named if n in muon_names], lr=1e-2, weight_decay=0.1, adjust_lr_fn="match_rms_adamw"
    )
    rest = [n for n in named if n not in muon_names]
    ref_adamw = torch.optim.AdamW(
        [
            {"params": [named[n] for n in rest if n in decay], "weight_decay": 0.1},
            {"params": [named[n] for n in rest if n not in decay], "weight_decay": 0.0},
        ],
        lr=1e-2,
        **ADAMW,
    )
    for step in range(3):
        if step == 2:  # what an LR scheduler does
            for group in ours.param_groups:
                group["lr"] = 5e-3
            for group in ref_muon.param_groups + ref_adamw.param_groups:
                group["lr"] = 5e-3
        for net, optimizers in ((model, [ours]), (reference, [ref_muon, ref_adamw])):
            net(**_batch(step)).loss.backward()
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad()
    for name, param in model.named_parameters():
        assert torch.equal(param, named[name]), name
    assert len(ours.state) == len(named)  # every parameter has its state, in one place


def test_its_state_saved_and_loaded_continues_bitwise():
    def train(model, optimizer, steps):
        for step in steps:
            model(**_batch(step)).loss.backward()
            optimizer.step()
            optimizer.zero_grad()

    model = _model()
    optimizer = build_muon_with_adamw(model, 1e-2, 0.1, _decay_names(model), ADAMW)
    train(model, optimizer, range(2))
    saved_model, saved_state = copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict())
    train(model, optimizer, range(2, 4))
    resumed = _model()
    resumed.load_state_dict(saved_model)
    resumed_optimizer = build_muon_with_adamw(resumed, 1e-2, 0.1, _decay_names(resumed), ADAMW)
    resumed_optimizer.load_state_dict(saved_state)
    assert resumed_optimizer._muon.state is resumed_optimizer.state  # still one state after load_state_dict
    train(resumed, resumed_optimizer, range(2, 4))
    for (name, value), resumed_value in zip(model.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(value, resumed_value), name


def _dataset() -> Dataset:
    ids = torch.randint(0, VOCAB, (32, SEQ), generator=torch.Generator().manual_seed(5)).tolist()
    return Dataset.from_dict({"input_ids": ids, "labels": ids})


def _train(output_dir, resume=None):
    from hf_diloco import DiLoCoTrainer, DiLoCoTrainingArguments

    args = DiLoCoTrainingArguments(
        **cpu_trainer_args(
            output_dir, max_steps=8, per_device_train_batch_size=2, save_strategy="steps", save_steps=4
        ),
        inner_steps=2,
        inner_optimizer="muon",
    )
    trainer = DiLoCoTrainer(model=_model(), args=args, train_dataset=_dataset())
    trainer.train(resume_from_checkpoint=resume)
    return trainer


@pytest.mark.timeout(300)
def test_a_diloco_trainer_trains_with_muon_and_resumes_bitwise(tmp_path):
    full = _train(tmp_path / "full")
    assert isinstance(full.optimizer.optimizer, MuonWithAdamW)
    losses = [entry["loss"] for entry in full.state.log_history if "loss" in entry]
    assert len(losses) == 8 and all(torch.isfinite(torch.tensor(losses)))
    resumed = _train(tmp_path / "resumed_run", resume=str(tmp_path / "full" / "checkpoint-4"))
    for name, value in full.diloco.global_parameters().items():
        assert torch.equal(resumed.diloco.global_parameters()[name], value), name


def test_the_main_job_takes_it_in_training_and_the_baseline_refuses_it(tmp_path):
    from hf_diloco.cli.baseline_arguments import BaselineTrainingArguments
    from hf_diloco.job.config_file import section_keys

    assert "inner_optimizer" in section_keys()["training"]
    with pytest.raises(ValueError, match="inner_optimizer: muon runs with trainer: diloco"):
        BaselineTrainingArguments(output_dir=str(tmp_path), use_cpu=True, inner_optimizer="muon")
    from hf_diloco import DiLoCoTrainingArguments

    with pytest.raises(ValueError, match="inner_optimizer must be one of adamw, muon"):
        DiLoCoTrainingArguments(output_dir=str(tmp_path), use_cpu=True, inner_optimizer="lion")
