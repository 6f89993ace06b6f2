"""`DiLoCoTrainer` with `pipeline_stages` > 1 (DiLoCoX workers) against the same training without a pipeline.

Same seed, model and data: 1 worker x 2 stages equals 1 worker x 1 stage, and 2 workers x 2 stages equals 2 workers
x 1 stage (final theta_g within 1e-4, same logged losses and eval loss), for Llama (untied, padded batches) and GPT-2
(tied head, a batch size that the micro-batches do not divide). The references run the ordinary `DiLoCoTrainer` on
whole models. Saving a pipelined run gives one normal folder that `AutoModelForCausalLM` loads with theta_g of the
stages; a mid-round checkpoint resumes bitwise.
"""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from safetensors import safe_open
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

from hf_diloco.integrations.trainer import DiLoCoTrainer, DiLoCoTrainingArguments
from hf_diloco.integrations.trainer.pipeline_stages import SafetensorsFolder
from hf_diloco.parallel.pipeline import PipelineRunner
from tests.engine_common import cpu_trainer_args, tiny_llama
from tests.pipeline_grid import run_grid
from tests.placement_recorder import module_bytes, record_placements

VOCAB, SEQ, SAMPLES = 96, 12, 48
H, STEPS, CHECKPOINT = 4, 8, 6
ATOL = 1e-4


def _model(arch: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if arch == "llama":
        model = tiny_llama(VOCAB, layers=4, max_positions=SEQ, tie_word_embeddings=False)
    else:
        config = GPT2Config(
            vocab_size=VOCAB,
            n_embd=32,
            n_layer=4,
            n_head=4,
            n_positions=SEQ,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            tie_word_embeddings=True,
        )
        model = GPT2LMHeadModel(config)
    model.config._attn_implementation = "sdpa"
    return model


def _dataset(padded: bool, seed: int = 1234) -> Dataset:
    """Random tokens; with `padded`, every third row is right-padded and every fifth left-padded (labels -100)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=generator)
    mask = torch.ones_like(ids)
    if padded:
        mask[::3, SEQ - 4 :] = 0
        mask[1::5, :3] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": mask.tolist(), "labels": labels.tolist()})


# name -> (architecture, padded data, batch size, DiLoCo fields shared by the pipelined run and its reference)
SCENARIOS = {
    "llama": ("llama", True, 4, dict(num_fragments=2, fragment_pattern="strided")),
    "gpt2": ("gpt2", False, 3, dict(num_fragments=1)),
    # Sequential fragments: stage 0 (blocks 0-1 + embeddings) has nothing of fragment 1 (blocks 2-3). Fitted eager
    # fits one weight per parameter, so each stage's fits are the unpipelined run's.
    "llama_2w": (
        "llama",
        True,
        4,
        dict(num_fragments=2, fragment_pattern="sequential", overlap="eager", eager_estimate="fitted"),
    ),
}
PIPELINE = {"llama": dict(pipeline_schedule="1f1b"), "gpt2": dict(pipeline_schedule="gpipe")}


def _args(out: str, batch: int, **overrides) -> DiLoCoTrainingArguments:
    pipeline_run = dict(
        per_device_train_batch_size=batch,
        per_device_eval_batch_size=5,  # the eval batches do not split evenly into micro-batches either
        max_steps=STEPS,
        max_grad_norm=0.5,
        inner_steps=H,
        outer_lr=0.7,
        outer_momentum=0.9,
        pipeline_microbatches=2,
    )
    return DiLoCoTrainingArguments(**cpu_trainer_args(out, **{**pipeline_run, **overrides}))


class _Subclass(DiLoCoTrainer):
    """A user's subclass: with pipeline stages it is built with the pipeline in front of it."""


def _train(
    scenario: str, out: str, resume: str | None = None, trainer_class: type = DiLoCoTrainer, **overrides
) -> DiLoCoTrainer:
    arch, padded, batch, diloco = SCENARIOS[scenario]
    args = _args(out, batch, **{**diloco, **overrides})
    with record_placements(args.device) as placements:  # construction and training: every start-up placement
        trainer = trainer_class(
            model=_model(arch),
            args=args,
            train_dataset=_dataset(padded),
            eval_dataset=_dataset(padded, seed=99).select(range(13)),
        )
        trainer.train(resume_from_checkpoint=resume)
    trainer.placed_peak_bytes = placements.peak_bytes
    return trainer


def _summary(trainer: DiLoCoTrainer) -> dict:
    return {
        "global": {name: value.clone() for name, value in trainer.diloco.global_parameters().items()},
        "losses": {entry["step"]: entry["loss"] for entry in trainer.state.log_history if "loss" in entry},
        "eval_loss": trainer.evaluate()["eval_loss"],
        "fragments": trainer.diloco.fragment_names(),
        "optimizer_params": sum(p.numel() for group in trainer.optimizer.param_groups for p in group["params"]),
        "model_numel": sum(p.numel() for p in trainer.model.parameters()),
        "classes": [cls.__name__ for cls in type(trainer).__mro__[:3]],
        "placed_peak_bytes": trainer.placed_peak_bytes,
        "stage_bytes": module_bytes(trainer.pipeline_runner.stage_module) if trainer.pipeline_runner else None,
    }


def _two_processes(rank: int, world: int, out: str) -> dict:
    results = {}
    for scenario, pipeline in PIPELINE.items():
        trainer = _train(scenario, f"{out}/{scenario}", pipeline_stages=2, **pipeline)
        results[scenario] = _summary(trainer)
        trainer.save_model(f"{out}/{scenario}_saved")
    # Resume the Llama pipeline from a mid-round checkpoint (step 6, H = 4).
    _train("llama", f"{out}/ckpt", pipeline_stages=2, save_strategy="steps", save_steps=CHECKPOINT)
    checkpoint = f"{out}/ckpt/checkpoint-{CHECKPOINT}"
    resumed = _train("llama", f"{out}/resumed", resume=checkpoint, trainer_class=_Subclass, pipeline_stages=2)
    results["resumed"] = _summary(resumed)
    results["reference_2w"] = _summary(_train("llama_2w", f"{out}/reference_2w"))
    return results


def _four_processes(rank: int, world: int, out: str) -> dict:
    trainer = _train("llama_2w", f"{out}/pipeline_2w", pipeline_stages=2)
    results = {"pipeline_2w": _summary(trainer), "stage": trainer.pipeline_runner.stage_index}
    # Tied head, lossy outer sync (fp4 + delayed overlap), the tied embedding (and the position embedding) cut into
    # two row pieces synced at different steps: the stages' copies of the tied matrix must stay equal.
    lossy = _train(
        "gpt2",
        f"{out}/lossy",
        pipeline_stages=2,
        pipeline_schedule="gpipe",
        compression="fp4",
        overlap="delayed",
        num_fragments=2,
        fragment_pattern="balanced",
    )
    results["lossy_pieces"] = lossy.diloco.fragment_pieces()
    lossy.save_model(f"{out}/lossy_saved")
    stage = dict(lossy.pipeline_runner.stage_module.named_parameters())
    results["tied"] = stage["transformer.wte.weight" if rank % 2 == 0 else "lm_head.weight"].detach().clone()
    results["tied_in_engine"] = "lm_head.weight" in lossy.diloco.global_parameters()
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("pipeline_trainer")
    two, four, single = run_grid(
        _two_processes,
        _four_processes,
        lambda: {scenario: _summary(_train(scenario, str(out / f"single_{scenario}"))) for scenario in PIPELINE},
        str(out),
        two_timeout=400,
    )
    return out, two, four, single


def _merged(stages: list[dict]) -> dict[str, torch.Tensor]:
    merged: dict[str, torch.Tensor] = {}
    for stage in stages:
        assert not merged.keys() & stage.keys() - {"lm_head.weight"}, "stages must not share parameters"
        merged.update(stage)
    return merged


def _assert_same_training(pipelined: list[dict], reference: dict, arch: str, same_eval: bool = True) -> None:
    merged = _merged([rank["global"] for rank in pipelined])
    assert set(reference["global"]) <= set(merged)
    initial = dict(_model(arch).named_parameters())
    for name, value in reference["global"].items():
        assert not torch.equal(value, initial[name].detach()), f"{name} did not train"
        torch.testing.assert_close(merged[name], value, rtol=0, atol=ATOL, msg=name)
    if "lm_head.weight" in merged and "lm_head.weight" not in reference["global"]:  # tied: head = embedding
        embedding = "transformer.wte.weight" if "transformer.wte.weight" in merged else "model.embed_tokens.weight"
        assert torch.equal(merged["lm_head.weight"], merged[embedding])
    for rank in pipelined:
        assert rank["losses"].keys() == reference["losses"].keys()
        for step, loss in reference["losses"].items():
            assert rank["losses"][step] == pytest.approx(loss, abs=ATOL), step
        if same_eval:
            assert rank["eval_loss"] == pytest.approx(reference["eval_loss"], abs=ATOL)


def _eval_loss_of(state: dict[str, torch.Tensor], arch: str, padded: bool, batch: int = 5) -> float:
    """The Trainer's eval loss without repeated samples: each batch's HF loss, weighted by its number of rows."""
    model = _model(arch).eval()
    model.load_state_dict(state, strict=False)
    data = _dataset(padded, seed=99).select(range(13))
    tensors = {key: torch.tensor(data[key]) for key in ("input_ids", "attention_mask", "labels")}
    total = 0.0
    with torch.no_grad():
        for start in range(0, len(data), batch):
            loss = model(**{key: value[start : start + batch] for key, value in tensors.items()}).loss
            total += float(loss) * len(tensors["input_ids"][start : start + batch])
    return total / len(data)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("scenario", list(PIPELINE))
def test_one_worker_two_stages_equals_no_pipeline(runs, scenario):
    _, two, _, single = runs
    _assert_same_training([two[0][scenario], two[1][scenario]], single[scenario], SCENARIOS[scenario][0])
    # Dual optimizer policy: each stage's inner optimizer and theta_g cover its own parameters only.
    for rank in two:
        run = rank[scenario]
        own = sum(value.numel() for value in run["global"].values())
        # GPT-2's last stage trains its copy of the tied head, but the outer loop syncs the first stage's copy only.
        tied_copy = VOCAB * 32 if scenario == "gpt2" and rank is two[1] else 0
        assert ("lm_head.weight" in run["global"]) == (scenario == "llama" and rank is two[1])
        assert run["optimizer_params"] == own + tied_copy < sum(v.numel() for v in single[scenario]["global"].values())
        assert run["model_numel"] == own + tied_copy, "the other stages' parameters must be freed"
        # Pipelining is decided once, at construction: DiLoCoTrainer(...) built the pipelined class.
        assert run["classes"] == ["PipelinedDiLoCoTrainer", "PipelineTrainerMixin", "DiLoCoTrainer"]
    assert single[scenario]["classes"][:2] == ["DiLoCoTrainer", "EngineLifecycle"]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("scenario", list(PIPELINE))
def test_no_stage_places_more_than_itself_and_one_unit_on_the_training_device(runs, scenario):
    """Every parameter and buffer placed on the training device while it stays alive, from construction through
    training (`tests.placement_recorder`, the CPU standing in for the GPU): a stage's rank holds at most its own stage
    plus the largest unit (a block, or the embeddings and head), never the whole model, also when resumed; the
    unpipelined trainer places the whole model, so the record sees the Trainer's placements."""
    _, two, four, single = runs
    model = _model(SCENARIOS[scenario][0])
    whole = module_bytes(model)
    blocks = model.get_submodule("model.layers" if scenario == "llama" else "transformer.h")
    largest_unit = max([module_bytes(block) for block in blocks] + [whole - sum(map(module_bytes, blocks))])
    assert single[scenario]["placed_peak_bytes"] >= whole
    runs_of_stages = [rank[scenario] for rank in two]
    if scenario == "llama":
        runs_of_stages += [rank["resumed"] for rank in two] + [rank["pipeline_2w"] for rank in four]
    for run in runs_of_stages:
        bound = run["stage_bytes"] + largest_unit
        assert bound < whole, "the bound must exclude a whole copy"
        assert run["stage_bytes"] <= run["placed_peak_bytes"] <= bound, (run["placed_peak_bytes"], bound, whole)


@pytest.mark.timeout(900)
def test_two_workers_two_stages_equal_two_workers_one_stage(runs):
    _, two, four, _ = runs
    reference = two[0]["reference_2w"]
    assert reference["losses"] != two[1]["reference_2w"]["losses"], "the workers must read different shards"
    for worker in range(2):
        ranks = [four[worker * 2]["pipeline_2w"], four[worker * 2 + 1]["pipeline_2w"]]
        assert [four[worker * 2 + s]["stage"] for s in range(2)] == [0, 1]
        # Evaluation differs on purpose: Accelerate's world sharding completes the last eval batch with repeated
        # samples (whose loss then counts), while the pipelines' eval shards hold every sample exactly once.
        _assert_same_training(ranks, two[worker]["reference_2w"], "llama", same_eval=False)
        expected = _eval_loss_of(_merged([rank["global"] for rank in ranks]), "llama", padded=True)
        for rank in ranks:
            assert rank["eval_loss"] == pytest.approx(expected, abs=1e-5)
    # Stage 0 holds none of fragment 1 (sequential fragments): an empty fragment syncs without a hang.
    assert four[0]["pipeline_2w"]["fragments"][1] == []
    for rank in (0, 1):  # workers end with bitwise-identical theta_g of each stage
        for name, value in four[rank]["pipeline_2w"]["global"].items():
            assert torch.equal(value, four[rank + 2]["pipeline_2w"]["global"][name]), name


@pytest.mark.timeout(900)
def test_tied_copies_stay_equal_through_lossy_outer_syncs(runs):
    """Only the first stage syncs the tied matrix; the last stage's head follows it (2 workers, fp4, delayed)."""
    out, _, four, _ = runs
    for worker in range(2):
        first, last = four[2 * worker], four[2 * worker + 1]
        assert torch.equal(first["tied"], last["tied"])
        assert not last["tied_in_engine"]
        wte = [
            [(p.start, p.stop) for p in pieces if p.name == "transformer.wte.weight"]
            for pieces in first["lossy_pieces"]
        ]
        assert wte == [[(0, VOCAB // 2)], [(VOCAB // 2, VOCAB)]]
    assert torch.equal(four[0]["tied"], four[2]["tied"])
    loaded = AutoModelForCausalLM.from_pretrained(out / "lossy_saved")
    assert torch.equal(loaded.lm_head.weight, loaded.transformer.wte.weight)
    assert torch.equal(loaded.transformer.wte.weight.detach(), four[0]["tied"])


@pytest.mark.timeout(900)
@pytest.mark.parametrize("scenario", list(PIPELINE))
def test_saved_pipelined_model_is_one_normal_folder(runs, scenario):
    out, two, _, _ = runs
    folder = out / f"{scenario}_saved"
    expected = _merged([two[0][scenario]["global"], two[1][scenario]["global"]])
    if "transformer.wte.weight" in expected:  # tied: the head is the embedding
        expected["lm_head.weight"] = expected["transformer.wte.weight"]
    loaded = AutoModelForCausalLM.from_pretrained(folder)
    state = loaded.state_dict()
    assert set(state) == set(expected)
    # The same tensors, under the same names, as `save_pretrained` of the model writes (a tied head not twice).
    loaded.save_pretrained(out / f"{scenario}_plain")
    with (
        safe_open(folder / "model.safetensors", "pt") as saved,
        safe_open(out / f"{scenario}_plain" / "model.safetensors", "pt") as plain,
    ):
        assert sorted(saved.keys()) == sorted(plain.keys())
    for name, tensor in state.items():
        assert torch.equal(tensor, expected[name]), name
    # The folder loads back into another stage count, reading only that stage's tensors.
    runner = PipelineRunner(_model(SCENARIOS[scenario][0]), 0, 1)
    runner.load_stage_state(SafetensorsFolder(str(folder)))
    for name, tensor in runner.stage_module.state_dict().items():
        assert torch.equal(tensor, state[name]), name


@pytest.mark.timeout(900)
def test_pipelined_run_resumes_bitwise_from_mid_round_checkpoint(runs):
    _, two, _, _ = runs
    for rank in two:
        full, resumed = rank["llama"], rank["resumed"]
        assert resumed["classes"] == ["Pipelined_Subclass", "PipelineTrainerMixin", "_Subclass"]
        for name, value in full["global"].items():
            assert torch.equal(resumed["global"][name], value), name
        ran = {step: loss for step, loss in resumed["losses"].items() if step > CHECKPOINT}
        assert ran == {step: loss for step, loss in full["losses"].items() if step > CHECKPOINT}
