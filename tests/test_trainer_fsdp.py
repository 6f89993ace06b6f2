"""`DiLoCoTrainer` with the Trainer's `fsdp` arguments: FSDP2 over each worker's data-parallel ranks, never across
workers, on real gloo processes running the real Trainer (2 workers x D = 2, tiny Llama, CPU).

The golden run is the same trainer without `fsdp` (the worker's two ranks replicated under DDP over the worker's
group), on the same per-rank batches: FSDP2's reduce-scatter averages the same gradients, so θg agrees to float
rounding. One launch runs the replicated run, the sharded run with a mid-round checkpoint, its final `save_model`,
and the resume from that checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from datasets import Dataset
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from transformers import AutoModelForCausalLM

from hf_diloco.integrations.trainer import DiLoCoTrainer, DiLoCoTrainingArguments
from hf_diloco.integrations.worker_fsdp import WorkerFSDPSettings, full_state_dict
from tests.dist_utils import run_on_processes
from tests.engine_common import assert_resumed_bitwise, cpu_trainer_args, tiny_llama
from tests.placement_recorder import module_bytes, record_placements

VOCAB, SEQ, SAMPLES = 128, 16, 96
H, STEPS, MID_ROUND_CHECKPOINT = 4, 12, 6
WORKERS, RANKS = 2, 2
# Two fragments, one step of delay: at the checkpoint (step 6) fragment 0's exchange is in flight.
DILOCO = dict(inner_steps=H, num_fragments=2, sync_delay=1, data_parallel_per_worker=RANKS)


def _dataset(samples: int = SAMPLES, seed: int = 1234) -> Dataset:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (samples, SEQ), generator=generator).tolist()
    return Dataset.from_dict({"input_ids": ids, "labels": ids})


def _train(output_dir: Path, resume: Path | None = None, **fsdp) -> DiLoCoTrainer:
    args = DiLoCoTrainingArguments(
        **cpu_trainer_args(
            output_dir,
            per_device_train_batch_size=2,
            max_steps=STEPS,
            save_strategy="steps",
            save_steps=MID_ROUND_CHECKPOINT,
            **fsdp,
        ),
        **DILOCO,
    )
    model = tiny_llama(VOCAB, layers=2, max_positions=SEQ, tie_word_embeddings=True)
    with record_placements(args.device) as placements:  # construction and training: every start-up placement
        trainer = DiLoCoTrainer(model=model, args=args, train_dataset=_dataset(), eval_dataset=_dataset(8, seed=99))
        trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    trainer.placed_peak_bytes = placements.peak_bytes
    return trainer


def _record(trainer: DiLoCoTrainer) -> dict:
    params = list(trainer.model.parameters())
    return {
        "global": {name: value.clone() for name, value in trainer.diloco.global_parameters().items()},
        "losses": {entry["step"]: entry["loss"] for entry in trainer.state.log_history if "loss" in entry},
        "outer_state_bytes": trainer.diloco.stats["outer_state_bytes"],
        "sharded": all(isinstance(p, DTensor) for p in params),
        "mesh": sorted({tuple(p.device_mesh.mesh.tolist()) for p in params if isinstance(p, DTensor)}),
        "local_numel": sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in params),
        "is_ddp": isinstance(trainer.model_wrapped, DistributedDataParallel),
        "placed_peak_bytes": trainer.placed_peak_bytes,
        "eval_loss": trainer.evaluate()["eval_loss"],
    }


def _runs(rank: int, world: int, out_dir: str) -> dict:
    out = Path(out_dir)
    results = {"replicated": _record(_train(out / "replicated"))}
    sharded = _train(out / "sharded", fsdp=True)
    results["sharded"] = _record(sharded)
    sharded.save_model(str(out / "final"))
    model = {name: value.clone() for name, value in full_state_dict(sharded.model).items()}
    results["sharded"]["model"] = model
    resumed = _train(out / "resumed", resume=out / "sharded" / f"checkpoint-{MID_ROUND_CHECKPOINT}", fsdp=True)
    results["resumed"] = _record(resumed)
    results["resumed"]["model"] = {name: value.clone() for name, value in full_state_dict(resumed.model).items()}
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp_runs")
    return out, run_on_processes(_runs, WORKERS * RANKS, str(out), timeout_seconds=600)


@pytest.mark.timeout(900)
def test_fsdp_shards_over_the_worker_and_equals_the_replicated_worker(runs):
    """Every rank holds half of the model (tied embeddings), sharded over its own worker's two ranks (no DDP around
    it); θg equals the replicated run's within 1e-4 and is bitwise the same on all four ranks; the losses and the
    evaluation of θg after training agree within 1e-5; the outer state is 1/D as replicated."""
    _, results = runs
    whole = sum(value.numel() for value in results[0]["replicated"]["global"].values())
    for rank, result in enumerate(results):
        sharded, replicated = result["sharded"], result["replicated"]
        worker = rank // RANKS
        assert sharded["sharded"] and not sharded["is_ddp"] and replicated["is_ddp"]
        assert sharded["mesh"] == [tuple(range(worker * RANKS, (worker + 1) * RANKS))], "shards cross workers"
        assert sharded["local_numel"] <= whole // RANKS + 64  # FSDP pads each parameter to a multiple of D rows
        assert sharded["outer_state_bytes"] == replicated["outer_state_bytes"]
        for name, value in replicated["global"].items():
            torch.testing.assert_close(sharded["global"][name], value, atol=1e-4, rtol=0)
            assert torch.equal(sharded["global"][name], results[0]["sharded"]["global"][name]), (rank, name)
        for step, loss in replicated["losses"].items():
            assert sharded["losses"][step] == pytest.approx(loss, abs=1e-5), (rank, step)
        assert sharded["eval_loss"] == pytest.approx(replicated["eval_loss"], abs=1e-5)
    assert results[0]["sharded"]["losses"] != results[RANKS]["sharded"]["losses"], "workers read other shards"


@pytest.mark.timeout(900)
def test_no_rank_places_more_than_its_shard_and_one_unit_on_the_training_device(runs):
    """Every parameter and buffer the Trainer, Accelerate and FSDP2 place on the training device, counted while it
    stays alive (`tests.placement_recorder`, the CPU standing in for the GPU): a sharded rank never holds more than
    its half of the model plus the largest unit being cut (a block, or the root's embedding and norm), from
    construction through training and the resume; the replicated run places the whole model, so the record sees the
    Trainer's placements."""
    _, results = runs
    model = tiny_llama(VOCAB, layers=2, max_positions=SEQ, tie_word_embeddings=True)
    whole = module_bytes(model)
    largest_unit = max(
        [module_bytes(block) for block in model.model.layers]
        + [whole - sum(module_bytes(block) for block in model.model.layers)]
    )
    padding = 4 * 64  # FSDP pads each parameter to a multiple of D rows
    bound = whole // RANKS + padding + largest_unit
    assert bound < whole, "the bound must exclude a whole copy"
    for rank, result in enumerate(results):
        assert result["replicated"]["placed_peak_bytes"] >= whole, rank
        for run in ("sharded", "resumed"):
            placed = result[run]["placed_peak_bytes"]
            assert whole // RANKS <= placed <= bound, (rank, run, placed, bound, whole)


@pytest.mark.timeout(900)
def test_fsdp_resume_from_mid_round_checkpoint_is_bitwise(runs):
    """Resuming the sharded run at step 6 (mid-round, fragment 0 in flight) from each rank's DiLoCo state continues
    bitwise: θg, the model after training, and the losses of the steps it ran itself."""
    _, results = runs
    for result in results:
        assert_resumed_bitwise(result["sharded"], result["resumed"], MID_ROUND_CHECKPOINT, STEPS)


@pytest.mark.timeout(900)
def test_fsdp_save_model_writes_one_normal_folder_of_the_global_model(runs):
    """`save_model` gathers the shards inside the worker into one `save_pretrained` folder that loads with
    `AutoModelForCausalLM` and holds θg, which the model holds too after training."""
    out, results = runs
    saved = AutoModelForCausalLM.from_pretrained(out / "final")
    for name, param in saved.named_parameters():
        assert torch.equal(param.detach(), results[0]["sharded"]["global"][name]), name
        assert torch.equal(results[0]["sharded"]["model"][name], results[0]["sharded"]["global"][name]), name
    assert not list((out / "final").glob("*fsdp*")), "no FSDP-specific files"


@pytest.mark.parametrize(
    ("plugin_args", "diloco", "named"),
    [
        ({"fsdp_version": 2}, {"pipeline_stages": 2}, "pipeline_stages"),
        ({"fsdp_version": 1}, {}, "version"),
        ({"fsdp_version": 2, "cpu_ram_efficient_loading": True}, {}, "cpu_ram_efficient_loading"),
        ({"fsdp_version": 2, "activation_checkpointing": True}, {}, "gradient_checkpointing"),
        ({"fsdp_version": 2, "state_dict_type": "SHARDED_STATE_DICT"}, {}, "state_dict_type"),
    ],
)
def test_fsdp_settings_that_cannot_hold_inside_a_worker_are_refused(plugin_args, diloco, named):
    from hf_diloco import DiLoCoConfig

    with pytest.raises(ValueError, match=named):
        WorkerFSDPSettings.from_plugin_args(plugin_args, DiLoCoConfig(**diloco))


def test_fsdp_settings_follow_the_trainer_arguments(tmp_path):
    args = DiLoCoTrainingArguments(
        **cpu_trainer_args(tmp_path),
        fsdp=True,
        fsdp_config={"reshard_after_forward": False, "transformer_layer_cls_to_wrap": "LlamaDecoderLayer"},
    )
    settings = WorkerFSDPSettings.from_plugin_args(args.fsdp_plugin_args, args.diloco_config())
    assert settings == WorkerFSDPSettings(reshard_after_forward=False, wrap_classes=("LlamaDecoderLayer",))


def _one_process_checks(rank: int, world: int) -> dict:
    from accelerate import Accelerator
    from torch.distributed.fsdp import FSDPModule

    from hf_diloco import DiLoCoConfig, DiLoCoPlugin
    from hf_diloco.integrations.worker_fsdp import shard_worker_model

    config = DiLoCoConfig()
    result = {}
    try:
        shard_worker_model(tiny_llama(VOCAB, 2, SEQ), config, WorkerFSDPSettings(wrap_classes=("NoSuchLayer",)))
    except ValueError as error:
        result["unknown_class"] = str(error)
    model = tiny_llama(VOCAB, layers=2, max_positions=SEQ)
    shard_worker_model(model, config, WorkerFSDPSettings(wrap_classes=("LlamaDecoderLayer", "LlamaRMSNorm")))
    result["units"] = sorted(type(m).__name__ for m in model.modules() if isinstance(m, FSDPModule))
    try:
        DiLoCoPlugin(environ={}).prepare(Accelerator(cpu=True), model, torch.optim.AdamW(model.parameters()))
    except ValueError as error:
        result["plugin"] = str(error)
    return result


@pytest.mark.timeout(120)
def test_units_follow_fsdp_config_and_the_accelerate_plugin_refuses_a_sharded_model():
    """`transformer_layer_cls_to_wrap` names the units sharded before the root (a name matching nothing is refused);
    `DiLoCoPlugin` cannot save or load a sharded model through `accelerator.save_state`: it says so and what to use
    instead, before any engine starts."""
    (result,) = run_on_processes(_one_process_checks, 1, timeout_seconds=100)
    assert "NoSuchLayer" in result["unknown_class"] and "names no module" in result["unknown_class"]
    # 2 decoder layers, their 2 norms each and the final norm, and the root.
    assert result["units"] == sorted(
        ["FSDPLlamaDecoderLayer"] * 2 + ["FSDPLlamaRMSNorm"] * 5 + ["FSDPLlamaForCausalLM"]
    )
    assert "sharded with FSDP" in result["plugin"] and "DiLoCoTrainer" in result["plugin"]
