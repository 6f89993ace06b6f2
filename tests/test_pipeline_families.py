"""Generic pipeline stages across the causal-LM families of the installed transformers.

In two processes, every family of `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES` is built tiny (`benchmarks/pipeline_families.py`),
cut into stages and compared with the unsplit model (loss and every gradient), and the families that cannot be cut
must be refused with the reason this file expects. With real gloo processes, `DiLoCoTrainer` trains
`TRAINED_FAMILIES` pipelined and unpipelined on the same padded data: 1 worker x 2 stages against 1 x 1 and 2 workers x
2 stages against 2 x 1 (codec `none`): final theta_g within 1e-4, every logged loss within 1e-5. One launch of each
world size trains the families one after another: every trained family in one worker, `ACROSS_WORKERS` in two.
"""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset

from benchmarks import pipeline_families as families
from hf_diloco.integrations.trainer import DiLoCoTrainer, DiLoCoTrainingArguments
from tests.engine_common import cpu_trainer_args
from tests.pipeline_grid import run_grid

VOCAB, SEQ, SAMPLES, BATCH = families.SIZES["vocab"], 10, 32, 4
STEPS, H = 4, 2
# family -> config fields that make what it computes outside its blocks matter (and its head tied or untied).
TRAINED_FAMILIES = {
    "llama": dict(tie_word_embeddings=False),
    "mistral": dict(sliding_window=4),
    "qwen2": dict(tie_word_embeddings=True),
    "qwen3": dict(tie_word_embeddings=False),
    "gpt2": dict(tie_word_embeddings=True),
    "gpt_neox": dict(tie_word_embeddings=False),
    "opt": dict(word_embed_proj_dim=16),
    "gemma2": dict(final_logit_softcapping=0.5, attn_logit_softcapping=2.0, sliding_window=4),
    "gemma3_text": dict(sliding_window=4, final_logit_softcapping=1.0),
    "cohere": dict(logit_scale=0.5),
    "granite": dict(embedding_multiplier=3.0, logits_scaling=0.25, residual_multiplier=0.5, attention_multiplier=0.3),
    "phi": dict(partial_rotary_factor=0.5),
    "phi3": dict(tie_word_embeddings=False),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=0),  # hybrid
    "falcon": dict(new_decoder_architecture=True, num_kv_heads=2),
    "bloom": dict(),
    "gpt_bigcode": dict(multi_query=True),
    "olmo2": dict(),
    "starcoder2": dict(sliding_window=4),
    "olmo3": dict(sliding_window=4),
    "qwen3_next": dict(),
}
# The 2-worker grid checks what crosses workers: each stage's fragments synced with the same stage of the other
# worker. A family changes that only through the parameters a stage holds (a tied head on both end stages, extra
# modules before or after the blocks, experts), so one family of each kind runs there; how each family's forward is cut
# is what the 1-worker grid checks for all of them.
ACROSS_WORKERS = ("llama", "qwen2", "opt", "gemma2", "mixtral", "jamba")
# family -> what the refusal says, for the families whose forward cannot be cut at block boundaries.
CANNOT = {
    "cpmant": "do not reproduce the unsplit model",
    "dory": "in the order [0, 1, 0, 1]",  # runs its blocks twice
    "gemma3n_text": "failed when chained",  # every block reads per-layer embeddings of the first stage
    "gemma4": "do not reproduce the unsplit model",  # the same
    "gemma4_text": "do not reproduce the unsplit model",
    "hrm_text": "no nn.ModuleList of num_hidden_layers",  # recurrent H and L modules, no stack
    "hy_v4": "Shared DSA layers require top-k indices",  # layers read another layer's indexer output
    "inkling2_loop_text": "do not reproduce the unsplit model",
    "inkling2_text": "do not reproduce the unsplit model",
    "longcat_flash": "no nn.ModuleList of num_hidden_layers",  # two sub-layers per listed block
    "mllama": "in the order [0, 1, 2]",  # skips its cross-attention blocks without images
    "prophetnet": "failed when chained",  # its n-gram stream reads the first stage's embeddings
    "reformer": "failed when chained",  # reversible two-stream blocks
    "roformer": "do not reproduce the unsplit model",  # the first stage's sinusoidal positions feed every block
    "xlm": "holds parameters and runs between blocks",  # attention, FFN and norms in parallel lists
    "zamba2": "one parameter is shared by",  # one transformer block shared by blocks on several stages
    "zaya": "do not reproduce the unsplit model",
}
# Families the tiny-config recipe does not build or run on `input_ids` and `attention_mask` alone.
NOT_BUILT = {
    "blt",  # byte patches from an entropy model
    "cohere_compass_text",
    "dbrx",
    "dots3_note",
    "dots3_note_text",
    "gemma3n",  # needs timm
    "gemma4_assistant",  # needs the main model's shared key/value states
    "gemma4_unified_assistant",
    "musicgen",  # audio codebooks and text-encoder states
    "musicgen_melody",
    "qwen4_exp",
    "qwen4_exp_text",
    "xmod",  # needs a language id
    "zamba",
}


# ------------------------------------------------------------------------------------------- in one process


@pytest.fixture(scope="module")
def family_results() -> dict:
    return families.check_families(families.causal_lm_families(), processes=2)  # two cores, one thread each


@pytest.mark.timeout(900)
def test_every_family_with_a_block_stack_pipelines_or_is_refused_with_its_reason(family_results):
    mismatched = {f: r.detail for f, r in family_results.items() if r.status == "mismatch"}
    assert not mismatched, f"stages passed the start-up check but their gradients differ: {mismatched}"
    refused = {f: r.detail for f, r in family_results.items() if r.status == "cannot"}
    assert refused.keys() == CANNOT.keys(), refused
    for family, reason in CANNOT.items():
        assert reason in refused[family], (family, refused[family])
    not_built = {f: r.detail for f, r in family_results.items() if r.status == "not built"}
    assert not_built.keys() <= NOT_BUILT, {f: d for f, d in not_built.items() if f not in NOT_BUILT}
    pipelined = [f for f, r in family_results.items() if r.status == "pipelines"]
    assert set(TRAINED_FAMILIES) <= set(pipelined)
    assert len(pipelined) >= 160, len(pipelined)


def test_ties_are_found_by_identity(family_results):
    assert family_results["gpt2"].tied and family_results["bloom"].tied
    assert not family_results["llama"].tied  # Llama's default head is untied
    assert family_results["jamba"].blocks == "model.layers"  # mixed block classes in one stack


# ------------------------------------------------------------------------------------------ real processes


def _model(family: str) -> torch.nn.Module:
    with families.quiet():
        return families.build_tiny(family, **TRAINED_FAMILIES[family])


def _dataset(seed: int = 1234) -> Dataset:
    """Random tokens; every third row right-padded, every fifth left-padded (labels -100 on padding)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=generator)
    mask = torch.ones_like(ids)
    mask[::3, SEQ - 3 :] = 0
    mask[1::5, :2] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": mask.tolist(), "labels": labels.tolist()})


def _train(family: str, out: str, pipeline_stages: int) -> dict:
    args = DiLoCoTrainingArguments(
        **cpu_trainer_args(
            out,
            per_device_train_batch_size=BATCH,
            learning_rate=5e-3,
            max_steps=STEPS,
            max_grad_norm=0.5,
            inner_steps=H,
            outer_lr=0.7,
            outer_momentum=0.5,
            num_fragments=2,
            compression="none",
            pipeline_stages=pipeline_stages,
            pipeline_microbatches=2,
        )
    )
    with families.quiet():
        trainer = DiLoCoTrainer(model=_model(family), args=args, train_dataset=_dataset())
        trainer.train()
    return {
        "global": {name: value.clone() for name, value in trainer.diloco.global_parameters().items()},
        "losses": {entry["step"]: entry["loss"] for entry in trainer.state.log_history if "loss" in entry},
    }


def _train_every_family(out: str, pipeline_stages: int, families: tuple[str, ...] = tuple(TRAINED_FAMILIES)) -> dict:
    results = {}
    for family in families:
        try:
            results[family] = _train(family, f"{out}/{family}_{pipeline_stages}", pipeline_stages)
        except Exception as error:  # report the family, then let the other families run
            results[family] = f"{type(error).__name__}: {error}"
    return results


def _two_processes(rank: int, world: int, out: str) -> dict:
    """1 worker x 2 stages, and the 2 workers x 1 stage reference."""
    return {"1x2": _train_every_family(f"{out}/1x2", 2), "2x1": _train_every_family(f"{out}/2x1", 1, ACROSS_WORKERS)}


def _four_processes(rank: int, world: int, out: str) -> dict:
    return {"2x2": _train_every_family(f"{out}/2x2", 2, ACROSS_WORKERS)}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("pipeline_families"))
    return run_grid(_two_processes, _four_processes, lambda: _train_every_family(f"{out}/1x1", 1), out)


def _check_same_training(family: str, stages: list, reference) -> list[str]:
    """What differs between a pipelined run (one result per stage) and its unpipelined reference."""
    for run in (*stages, reference):
        if isinstance(run, str):
            return [run]
    problems = []
    merged: dict[str, torch.Tensor] = {}
    for stage in stages:
        merged.update(stage["global"])
    initial = dict(_model(family).named_parameters())
    trained = [name for name, value in reference["global"].items() if not torch.equal(value, initial[name].detach())]
    if len(trained) < len(reference["global"]) / 2:
        problems.append(f"only {len(trained)} of {len(reference['global'])} parameters trained")
    for name, value in reference["global"].items():
        if name not in merged:
            problems.append(f"{name} is on no stage")
        elif not torch.allclose(merged[name], value, rtol=0, atol=1e-4):
            problems.append(f"{name} differs by {float((merged[name] - value).abs().max()):.2e}")
    for stage in stages:
        if stage["losses"].keys() != reference["losses"].keys():
            problems.append(f"logged steps {sorted(stage['losses'])} != {sorted(reference['losses'])}")
            continue
        for step, loss in reference["losses"].items():
            if abs(stage["losses"][step] - loss) > 1e-5:
                problems.append(f"loss at step {step}: {stage['losses'][step]} != {loss}")
    return problems


@pytest.mark.timeout(1200)
def test_one_worker_two_stages_equals_one_stage_for_every_trained_family(trained):
    two, _, single = trained
    problems = {}
    for family in TRAINED_FAMILIES:
        found = _check_same_training(family, [two[0]["1x2"][family], two[1]["1x2"][family]], single[family])
        if found:
            problems[family] = found[:3]
    assert not problems, problems


@pytest.mark.timeout(1200)
def test_two_workers_two_stages_equal_two_workers_one_stage_for_a_family_of_each_kind(trained):
    two, four, _ = trained
    problems = {}
    for family in ACROSS_WORKERS:
        for worker in range(2):
            stages = [four[2 * worker]["2x2"][family], four[2 * worker + 1]["2x2"][family]]
            found = _check_same_training(family, stages, two[worker]["2x1"][family])
            if found:
                problems[f"{family} worker {worker}"] = found[:3]
    assert not problems, problems
    # the two workers read different shards, and end with bitwise-equal theta_g
    assert two[0]["2x1"]["llama"]["losses"] != two[1]["2x1"]["llama"]["losses"]
    for family in ACROSS_WORKERS:
        for stage in range(2):
            ours, theirs = four[stage]["2x2"][family]["global"], four[2 + stage]["2x2"][family]["global"]
            assert all(torch.equal(ours[name], theirs[name]) for name in ours), family
