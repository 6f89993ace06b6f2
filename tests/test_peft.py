"""LoRA (peft) under DiLoCoTrainer on 2 torchrun processes, through the run_clm-style script (`--use_lora`): only the
adapters are exchanged (bytes match the LoRA parameter count), the frozen base stays as it was, every rank ends with
the same adapters, and the saved adapter folder loads with `peft.PeftModel.from_pretrained`."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from hf_diloco.publish.model_card import has_diloco_tag
from tests.test_dropin import DILOCO, STEPS, H, _best_step, _params, _run

PeftModel = pytest.importorskip("peft", reason="LoRA needs the peft extra: pip install 'hf_diloco[peft]'").PeftModel

HIDDEN, LAYERS, HEADS, KV_HEADS, RANK = 32, 2, 4, 2, 4  # the script's model and LoRA settings


def _base_model() -> LlamaForCausalLM:
    torch.manual_seed(0)  # the script seeds with --seed 0 before building the model
    config = LlamaConfig(
        vocab_size=128, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=16,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def _lora_numel() -> int:
    """LoRA on q_proj (hidden -> hidden) and v_proj (hidden -> kv_heads * head_dim): A is r x in, B is out x r."""
    head_dim = HIDDEN // HEADS
    per_layer = RANK * HIDDEN + HIDDEN * RANK + RANK * HIDDEN + KV_HEADS * head_dim * RANK
    return LAYERS * per_layer


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("lora") / "run"
    _run(out, *DILOCO, "--use_lora", processes=2)
    return out


@pytest.mark.timeout(600)
def test_only_adapters_are_exchanged_and_ranks_agree(lora_run):
    first, second = _params(lora_run, 0), _params(lora_run, 1)
    for name in first:
        assert torch.equal(first[name], second[name]), name
    base = {f"base_model.model.{n}": p.detach() for n, p in _base_model().named_parameters()}
    lora = {n: v for n, v in first.items() if "lora_" in n}
    assert sum(v.numel() for v in lora.values()) == _lora_numel()
    for name, value in first.items():
        if "lora_" not in name:
            assert torch.equal(value, base[name.replace(".base_layer", "")]), f"frozen {name} changed"
    assert any(v.abs().sum() > 0 for n, v in lora.items() if "lora_B" in n), "LoRA B starts at zero and must train"
    # Bytes: per outer sync, the 24-byte schedule tag, the 4-byte norm robust clipping gathers, then all_to_all +
    # all_gather of fp32 halves of the LoRA parameters only.
    expected = STEPS // H * (24 + 4 + 2 * (2 - 1) * 4 * -(-_lora_numel() // 2))
    card = (lora_run / "README.md").read_text()
    assert has_diloco_tag(lora_run / "README.md") and f"({expected:,} bytes)" in card, card


@pytest.mark.timeout(600)
def test_saved_adapters_load_with_peft(lora_run):
    final = _params(lora_run, 0)
    for folder in (lora_run, lora_run / f"checkpoint-{_best_step(lora_run)}"):
        saved = load_file(folder / "adapter_model.safetensors")
        assert len(saved) == 4 * LAYERS and all("lora_" in name for name in saved)
        model = PeftModel.from_pretrained(_base_model(), folder)
        loaded = {n: p.detach() for n, p in model.named_parameters()}
        # The final folder holds the best checkpoint's adapters (load_best_model_at_end), as the ranks do.
        for name, value in final.items():
            assert torch.equal(loaded[name], value), name
