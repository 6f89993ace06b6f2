"""Which causal-LM families of the installed transformers can be cut into pipeline stages.

    python -m benchmarks.pipeline_families                   # every family, a markdown table
    python -m benchmarks.pipeline_families --families llama jamba --stages 3 --json out.json

Every model type of `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES` is built tiny from its own config class (the defaults, with
every size, layer count, vocabulary and expert count made small, dropout 0, random init, nothing downloaded), then
cut with `hf_diloco.parallel.pipeline.build_stages` (which chains the stages on a padded batch and compares them with
the unsplit model) and, if that passes, the chained stages are trained one step in this process: their loss and every
parameter's gradient must equal the unsplit model's. Each family ends in one status:

- `pipelines`: the cut model reproduces the unsplit one (loss within 1e-5, gradients within 1e-5);
- `cannot`: the model cannot be cut (the reason is the error `build_stages` raised);
- `mismatch`: the gradients of the chained stages differ from the unsplit model's (a defect: the start-up check
  compares logits only);
- `not built`: the tiny model could not be built or run on `input_ids` and `attention_mask` alone (extra inputs,
  a missing package, a config this recipe does not know how to shrink): nothing to pipeline.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import logging
import multiprocessing
import warnings
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

import torch

NUM_LAYERS = 4
SIZES = {
    "hidden": 32,
    "intermediate": 64,
    "heads": 4,
    "kv_heads": 2,
    "head_dim": 8,
    "experts": 4,
    "vocab": 128,
    "positions": 64,
}
# Integer config fields (exact names, or name endings) -> the small value they get.
EXACT = {
    "vocab_size": SIZES["vocab"],
    "hidden_size": SIZES["hidden"],
    "d_model": SIZES["hidden"],
    "n_embd": SIZES["hidden"],
    "embedding_size": SIZES["hidden"],
    "embed_dim": SIZES["hidden"],
    "word_embed_proj_dim": SIZES["hidden"],
    "num_hidden_layers": NUM_LAYERS,
    "n_layer": NUM_LAYERS,
    "num_layers": NUM_LAYERS,
    "decoder_layers": NUM_LAYERS,
    "encoder_layers": NUM_LAYERS,
    "num_attention_heads": SIZES["heads"],
    "n_head": SIZES["heads"],
    "num_heads": SIZES["heads"],
    "decoder_attention_heads": SIZES["heads"],
    "encoder_attention_heads": SIZES["heads"],
    "num_key_value_heads": SIZES["kv_heads"],
    "num_kv_heads": SIZES["kv_heads"],
    "multi_query_group_num": SIZES["kv_heads"],
    "head_dim": SIZES["head_dim"],
    "num_experts": SIZES["experts"],
    "num_local_experts": SIZES["experts"],
    "n_routed_experts": SIZES["experts"],
    "moe_num_experts": SIZES["experts"],
    "num_experts_per_tok": 2,
    "num_experts_per_token": 2,
    "moe_topk": 2,
    "moe_k": 2,
    "top_k": 2,
    "rotary_dim": 4,
    "n_group": 1,
    "num_expert_group": 1,
    "topk_group": 1,
    "n_shared_experts": 1,
    "max_position_embeddings": SIZES["positions"],
    "n_positions": SIZES["positions"],
    "n_ctx": SIZES["positions"],
    "max_seq_len": SIZES["positions"],
    "sliding_window": 4,
    "sliding_window_size": 4,
    "attention_window_size": 4,
    "kv_lora_rank": 16,
    "q_lora_rank": 16,
    "qk_nope_head_dim": SIZES["head_dim"],
    "qk_rope_head_dim": SIZES["head_dim"],
    "v_head_dim": SIZES["head_dim"],
    "qk_head_dim": 2 * SIZES["head_dim"],
    "mamba_d_state": 8,
    "state_size": 8,
    "ssm_state_size": 8,
    "mamba_n_heads": 4,
    "mamba_num_heads": 4,
    "mamba_head_dim": 16,
    "mamba_d_head": 16,
    "n_groups": 1,
    "mamba_n_groups": 1,
    "swa_head_dim": 2 * SIZES["head_dim"],
    "mamba_headdim": 16,
    "mamba_d_ssm": 64,
    "mamba_dt_rank": 4,
    "time_step_rank": 4,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": SIZES["head_dim"],
    "linear_value_head_dim": SIZES["head_dim"],
    "first_k_dense_replace": 1,
    "num_nextn_predict_layers": 0,
}
# Fields whose default is None but that a tiny model needs set.
UNSET = {
    "head_dim": SIZES["head_dim"],
    "num_key_value_heads": SIZES["heads"],
    "num_experts_per_tok": 2,
    "n_routed_experts": SIZES["experts"],
    "n_shared_experts": 1,
}
# Fields one family needs beyond the shrinking rules.
FAMILY_FIELDS: dict[str, dict[str, Any]] = {
    "reformer": {"is_decoder": True, "axial_pos_embds_dim": [16, 16], "axial_pos_shape": [4, 3]},
    "gemma3n_text": {"num_kv_shared_layers": 0},
    "lfm2_moe": {"layer_types": ["conv", "full_attention", "conv", "full_attention"], "num_dense_layers": 1},
    "zamba2": {
        "layers_block_type": ["mamba", "hybrid", "mamba", "hybrid"],
        "hybrid_layer_ids": [1, 3],
        "n_mamba_heads": 4,
        "mamba_headdim": 16,
        "attention_head_dim": 8,
        "num_key_value_heads": 4,
    },
}
MAXIMA = {
    "num_experts_per_tok",
    "num_experts_per_token",
    "moe_topk",
    "moe_k",
    "top_k",
    "n_group",
    "num_expert_group",
    "topk_group",
}
ENDINGS = {
    "intermediate_size": SIZES["intermediate"],
    "ffn_dim": SIZES["intermediate"],
    "ffn_hidden_size": SIZES["intermediate"],
    "n_inner": SIZES["intermediate"],
    "head_dim": SIZES["head_dim"],
}


def _small(key: str, value: Any, fields: dict[str, Any]) -> Any:
    """The tiny value of one config field (unchanged when the field is not a size)."""
    if value is None and key in UNSET:
        return UNSET[key]
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, float) and any(word in key for word in ("dropout", "pdrop", "layerdrop", "jitter")):
        return 0.0
    if isinstance(value, int):
        if key == "num_key_value_heads" and value == fields.get("num_attention_heads"):
            return SIZES["heads"]  # no grouped-query attention in this family (or multi-head latent attention)
        if key in EXACT:
            return min(value, EXACT[key]) if key in MAXIMA else EXACT[key]
        for ending, small in ENDINGS.items():
            if key.endswith(ending) and value > small:
                return small
        if key.endswith("_token_id") and value >= SIZES["vocab"]:
            return SIZES["vocab"] - 1
    old_layers = next((fields[k] for k in ("num_hidden_layers", "n_layer", "num_layers") if k in fields), None)
    if isinstance(value, list) and old_layers and len(value) == old_layers and old_layers != NUM_LAYERS:
        return value[:NUM_LAYERS]  # per-layer lists (layer types, window sizes, ...)
    if isinstance(value, dict) and value and all(str(k).isdigit() for k in value):
        return {k: v for k, v in value.items() if int(k) < NUM_LAYERS}  # per-layer settings
    if isinstance(value, dict):
        return {**value, **_shrink(value)}
    return value


def _shrink(fields: dict[str, Any]) -> dict[str, Any]:
    """The fields that change (nested dicts: their changed fields only), so that the config derives the rest."""
    changed = {}
    for key, value in fields.items():
        small = _small(key, value, fields)
        if small != value:
            changed[key] = small
    return changed


def _mamba_head_dims(fields: dict[str, Any], small: dict[str, Any]) -> None:
    """Mamba-2 mixers need heads x head size = expand x hidden size."""
    hidden = small.get("hidden_size", fields.get("hidden_size"))
    for heads, head_dim, expand in (
        ("num_heads", "head_dim", "expand"),
        ("mamba_n_heads", "mamba_d_head", "mamba_expand"),
    ):
        if all(key in fields for key in (heads, head_dim, expand)) and hidden:
            small[head_dim] = fields[expand] * hidden // small.get(heads, fields[heads])


def tiny_config(model_type: str, **overrides):
    """The config of a tiny `model_type`: its defaults with every size made small and dropout 0."""
    from transformers import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    defaults = config_class().to_dict()
    fields = _shrink(defaults)
    _mamba_head_dims(defaults, fields)
    fields.update(FAMILY_FIELDS.get(model_type, {}))
    fields.update(overrides)
    config = config_class(**fields)
    config._attn_implementation = "eager" if model_type in EAGER_ONLY else "sdpa"
    return config


# Families whose attention has no SDPA path in transformers.
EAGER_ONLY: set[str] = set()


def build_tiny(model_type: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """A tiny, randomly initialised causal LM of `model_type` (see `tiny_config`), in train mode."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(model_type, **overrides)
    torch.manual_seed(seed)
    try:
        model = AutoModelForCausalLM.from_config(config, attn_implementation=config._attn_implementation)
    except ValueError as error:  # no SDPA implementation for this family
        if "attention implementation" not in str(error):
            raise
        EAGER_ONLY.add(model_type)
        config._attn_implementation = "eager"
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    return model.train()


@dataclass
class FamilyResult:
    family: str
    status: str
    detail: str = ""
    blocks: str = ""
    tied: bool = False


def _one_line(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".replace("\n", " ")
    return text if len(text) < 400 else text[:397] + "..."


def _gradient_difference(stages, reference, inputs, labels) -> tuple[float, float]:
    """Loss and largest gradient difference between the chained stages and the unsplit model, in train mode."""
    from hf_diloco.parallel.pipeline import causal_lm_loss, count_loss_tokens

    divisor = count_loss_tokens(labels)
    hidden = inputs["input_ids"]
    for stage in stages:
        hidden = stage(hidden, **inputs)
    loss = causal_lm_loss(hidden, labels, divisor)
    loss.backward()
    expected = causal_lm_loss(reference(**inputs, use_cache=False).logits, labels, divisor)
    expected.backward()
    reference_params = dict(reference.named_parameters(remove_duplicate=False))
    worst = 0.0
    for stage in stages:
        for name, param in stage.named_parameters():
            mine, theirs = param.grad, reference_params[name].grad
            if mine is None and theirs is None:
                continue
            mine = torch.zeros_like(param) if mine is None else mine
            theirs = torch.zeros_like(param) if theirs is None else theirs
            worst = max(worst, float((mine - theirs).abs().max()))
    return abs(float(loss - expected)), worst


def check_family(family: str, num_stages: int = 2) -> FamilyResult:
    """Build a tiny `family`, cut it into `num_stages` stages and compare with the unsplit model (see the docstring)."""
    from hf_diloco.parallel.pipeline import build_stages, check_batch

    try:
        model = build_tiny(family)
        reference = copy.deepcopy(model)
        inputs = check_batch(model, batch=3, seq_len=12)
        with torch.no_grad():
            reference(**inputs, use_cache=False)
    except Exception as error:
        return FamilyResult(family, "not built", _one_line(error))
    try:
        stages = build_stages(model, num_stages, inputs)
    except Exception as error:
        return FamilyResult(family, "cannot", _one_line(error))
    plan = stages[0].plan
    labels = inputs["input_ids"].masked_fill(inputs["attention_mask"] == 0, -100)
    loss_difference, gradient_difference = _gradient_difference(stages, reference, inputs, labels)
    status = "pipelines" if loss_difference <= 1e-5 and gradient_difference <= 1e-5 else "mismatch"
    detail = f"loss {loss_difference:.1e}, gradients {gradient_difference:.1e}"
    return FamilyResult(family, status, detail, plan.blocks, bool(plan.tied))


def _quiet_check(family: str, num_stages: int) -> FamilyResult:
    with quiet():
        return check_family(family, num_stages)


def check_families(families: list[str], num_stages: int = 2, processes: int = 1) -> dict[str, FamilyResult]:
    """`check_family` of each family, in `processes` spawned processes of one thread each (the families are
    independent, so the results are the same in any number)."""
    if processes <= 1:
        return {family: _quiet_check(family, num_stages) for family in families}
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(processes, mp_context=context, initializer=torch.set_num_threads, initargs=(1,)) as pool:
        return dict(zip(families, pool.map(_quiet_check, families, [num_stages] * len(families), chunksize=4)))


def causal_lm_families() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


@contextlib.contextmanager
def quiet() -> Any:
    """Silence the warnings that tiny configs provoke (token ids, slow kernels)."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(logging.NOTSET)
        hf_logging.set_verbosity(verbosity)


def markdown(results: list[FamilyResult]) -> str:
    lines = ["| family | status | block stack | tied | detail |", "| --- | --- | --- | --- | --- |"]
    for r in results:
        detail = r.detail.replace("|", "\\|")
        lines.append(f"| {r.family} | {r.status} | {r.blocks} | {'yes' if r.tied else ''} | {detail} |")
    counts: dict[str, int] = {}
    for r in results:
        counts[r.status] = counts.get(r.status, 0) + 1
    lines.append("")
    lines.append(", ".join(f"{status}: {count}" for status, count in sorted(counts.items())))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", nargs="*", help="model types (default: every causal-LM family)")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--json", help="also write the results to this JSON file")
    parser.add_argument("--processes", type=int, default=1, help="families checked at once, one thread each")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    results = list(check_families(args.families or causal_lm_families(), args.stages, args.processes).values())
    for result in results:
        print(f"{result.family}: {result.status} {result.detail}", flush=True)
    print(markdown(results))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump([asdict(r) for r in results], handle, indent=1)


if __name__ == "__main__":
    main()
