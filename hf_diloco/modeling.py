"""Model building block for the main pretraining job (`scripts/pretrain.py`).

`build_model` turns the YAML `model:` section into a causal LM: by default a small randomly initialised Llama-style
model (about 1.4M parameters with a 4096-token vocabulary: a CPU runs hundreds of steps in minutes); otherwise any
`AutoModelForCausalLM` architecture from a config dict, a local config folder, or a checkpoint.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel, set_seed

__all__ = ["DEFAULT_MODEL_CONFIG", "MODEL_SPEC_KEYS", "build_model", "build_model_config", "check_vocab_size"]

DEFAULT_MODEL_CONFIG: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "intermediate_size": 384,
    "max_position_embeddings": 256,
    "tie_word_embeddings": True,
}

MODEL_SPEC_KEYS = frozenset({"config", "config_name", "model_name_or_path", "dtype"})


def build_model_config(
    spec: Mapping[str, Any] | None,
    vocab_size: int,
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
) -> PretrainedConfig:
    """
    Build the model config described by the YAML `model:` section, without building the model.

    Args:
        spec (`Mapping[str, Any]`, *optional*): the `model:` section (see `build_model`).
        vocab_size (`int`): the tokenizer's size (`len(tokenizer)`). A randomly initialised model gets exactly this
            vocabulary unless `config` sets `vocab_size` itself; a checkpoint keeps its own.
        bos_token_id (`int`, *optional*): the tokenizer's BOS id, written into the config of a new model.
        eos_token_id (`int`, *optional*): the tokenizer's EOS id, written into the config of a new model.
        pad_token_id (`int`, *optional*): the tokenizer's padding id, written into the config of a new model.

    Returns:
        `PretrainedConfig`: the config.
    """
    spec = dict(spec or {})
    unknown = sorted(set(spec) - MODEL_SPEC_KEYS)
    if unknown:
        raise ValueError(f"Unknown key(s) {unknown} in the `model:` section; allowed: {sorted(MODEL_SPEC_KEYS)}.")
    if spec.get("config_name") and spec.get("model_name_or_path"):
        raise ValueError("Set only one of model.config_name and model.model_name_or_path.")
    overrides = dict(spec.get("config") or {})
    source = spec.get("model_name_or_path") or spec.get("config_name")
    if source:
        overrides.pop("model_type", None)
        config = AutoConfig.from_pretrained(source, **overrides)
    else:
        config_kwargs = overrides if overrides else dict(DEFAULT_MODEL_CONFIG)
        if "model_type" not in config_kwargs:
            raise ValueError("model.config needs a `model_type` (for example 'llama', 'gpt2', 'qwen2').")
        model_type = config_kwargs.pop("model_type")
        config = AutoConfig.for_model(model_type, **config_kwargs)
        if "vocab_size" not in config_kwargs:
            config.vocab_size = vocab_size
    if not spec.get("model_name_or_path"):
        for name, value in (("bos_token_id", bos_token_id), ("eos_token_id", eos_token_id)):
            if value is not None:
                setattr(config, name, value)
        if pad_token_id is not None:
            config.pad_token_id = pad_token_id
    check_vocab_size(vocab_size, config.vocab_size)
    return config


def check_vocab_size(num_tokens: int, model_vocab_size: int) -> None:
    """
    Fail early when a tokenizer of `num_tokens` tokens can produce ids the model has no embedding for.

    Args:
        num_tokens (`int`): the tokenizer's size (`len(tokenizer)`).
        model_vocab_size (`int`): the model config's `vocab_size`.

    Raises:
        `ValueError`: when `num_tokens > model_vocab_size`, saying how to fix it.
    """
    if num_tokens > model_vocab_size:
        raise ValueError(
            f"The tokenizer has {num_tokens} tokens but the model's vocabulary has {model_vocab_size}. Use the "
            "tokenizer that belongs to the checkpoint (`tokenizer.path`), lower `tokenizer.vocab_size`, or raise "
            "the model's `vocab_size`."
        )


def build_model(
    spec: Mapping[str, Any] | None,
    vocab_size: int,
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
    seed: int | None = None,
) -> PreTrainedModel:
    """
    Build the causal LM described by the YAML `model:` section.

    Args:
        spec (`Mapping[str, Any]`, *optional*): the `model:` section. One of:

            - nothing: the default small Llama (`DEFAULT_MODEL_CONFIG`), randomly initialised;
            - `config`: a dict of config kwargs with a `model_type` (for example `{"model_type": "gpt2",
              "n_embd": 64, ...}`), randomly initialised;
            - `config_name`: a local config folder (or Hub name) read with `AutoConfig`, randomly initialised,
              with `config` as overrides;
            - `model_name_or_path`: a checkpoint loaded with `AutoModelForCausalLM.from_pretrained` (its weights
              and vocabulary are kept), with `config` as overrides.

            `dtype` (for example `"bfloat16"`) sets the parameters' dtype (default float32).
        vocab_size (`int`): the tokenizer's size (`len(tokenizer)`).
        bos_token_id (`int`, *optional*): the tokenizer's BOS id, written into the config of a new model.
        eos_token_id (`int`, *optional*): the tokenizer's EOS id, written into the config of a new model.
        pad_token_id (`int`, *optional*): the tokenizer's padding id, written into the config of a new model.
        seed (`int`, *optional*): when set, seeds every RNG (`transformers.set_seed`) before the random
            initialisation, so every process builds the same weights.

    Returns:
        `PreTrainedModel`: the model, in training mode.

    Raises:
        `ValueError`: on an unknown key, a config without `model_type`, or a model vocabulary smaller than
            `vocab_size`.
    """
    spec = dict(spec or {})
    config = build_model_config(spec, vocab_size, bos_token_id, eos_token_id, pad_token_id)
    dtype = spec.get("dtype")
    if seed is not None:
        set_seed(seed)
    if spec.get("model_name_or_path"):
        model = AutoModelForCausalLM.from_pretrained(spec["model_name_or_path"], config=config, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.train()
    return model
