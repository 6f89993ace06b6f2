"""Model building block for the main pretraining job (`scripts/pretrain.py`).

`build_model` turns the YAML `model:` section into a causal LM: by default a small randomly initialised Llama-style
model (about 1.4M parameters with a 4096-token vocabulary: a CPU runs hundreds of steps in minutes); otherwise any
`AutoModelForCausalLM` architecture from a config dict, a local config folder, or a checkpoint.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Mapping
from typing import Any

from transformers import CONFIG_MAPPING, AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel, set_seed

from ..core.settings.config import check_known_keys

__all__ = [
    "DEFAULT_MODEL_CONFIG",
    "MODEL_SPEC_KEYS",
    "build_model",
    "build_model_config",
    "check_block_size",
    "check_vocab_size",
    "model_positions",
]

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
# Names model configs give the longest sequence their position embeddings cover, in order of preference.
POSITION_ATTRIBUTES = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")


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
    check_known_keys(spec, sorted(MODEL_SPEC_KEYS), "the model: section")
    if spec.get("config_name") and spec.get("model_name_or_path"):
        raise ValueError("Set only one of model.config_name and model.model_name_or_path.")
    overrides = dict(spec.get("config") or {})
    source = spec.get("model_name_or_path") or spec.get("config_name")
    if source:
        overrides.pop("model_type", None)
        # `from_pretrained` drops keys it does not know without a word; it returns them when asked.
        config, unused = AutoConfig.from_pretrained(source, return_unused_kwargs=True, **overrides)
        _refuse_unknown_keys(sorted(unused), config)
    else:
        config_kwargs = overrides if overrides else dict(DEFAULT_MODEL_CONFIG)
        if "model_type" not in config_kwargs:
            raise ValueError("model.config needs a `model_type` (for example 'llama', 'gpt2', 'qwen2').")
        model_type = config_kwargs.pop("model_type")
        _check_model_type(model_type)
        config = AutoConfig.for_model(model_type, **config_kwargs)
        _check_config_keys(config_kwargs, config, AutoConfig.for_model(model_type))
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


def model_positions(model_config: PretrainedConfig) -> int | None:
    """The longest sequence the model's positions cover (`max_position_embeddings`, `n_positions`, ...), if stated."""
    found = _positions_attribute(model_config)
    return None if found is None else found[1]


def check_block_size(block_size: int, model_config: PretrainedConfig) -> None:
    """
    Fail early when blocks of `block_size` tokens are longer than the model's positions.

    Args:
        block_size (`int`): tokens per training block (`data.block_size`).
        model_config (`PretrainedConfig`): the model's config (its positions, under whatever name the architecture
            uses, e.g. GPT-2's `n_positions`; see `model_positions`).

    Raises:
        `ValueError`: when `block_size` exceeds the model's positions, saying both ways out. A model with learned
            positions would fail at its first step with an `IndexError`; one with rotary positions would silently
            train beyond the length it declares.
    """
    found = _positions_attribute(model_config)
    if found is not None and block_size > found[1]:
        name, positions = found
        raise ValueError(
            f"data.block_size is {block_size} tokens but the model has only {positions} positions (`{name}` of its "
            f"{model_config.model_type!r} config). Lower `data.block_size` to at most {positions}, or raise the "
            f"model's `{name}` in `model: config:` (a new model only: a checkpoint's learned positions cannot grow)."
        )


def _positions_attribute(model_config: PretrainedConfig) -> tuple[str, int] | None:
    """The config's own name for its number of positions, and the number."""
    for name in POSITION_ATTRIBUTES:
        value = getattr(model_config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return type(model_config).attribute_map.get(name, name), value
    return None


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


def _check_model_type(model_type: str) -> None:
    if model_type not in CONFIG_MAPPING:
        close = difflib.get_close_matches(str(model_type), list(CONFIG_MAPPING.keys()), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"Unknown model.config model_type {model_type!r}.{hint}")


def _check_config_keys(given: Mapping[str, Any], built: PretrainedConfig, default: PretrainedConfig) -> None:
    """Refuse keys of `model.config` that the config class does not know (a config keeps unknown kwargs as
    attributes without a word, so a misspelt `hiden_size` would leave the real setting at its default)."""
    # Legacy names the class converts (e.g. Llama's `rope_theta` into `rope_parameters`) are not kept as attributes.
    kept = set(built.to_dict())
    known = _known_keys(built, default)
    _refuse_unknown_keys(sorted(key for key in given if key not in known and key in kept), built)


def _known_keys(config: PretrainedConfig, default: PretrainedConfig | None = None) -> set[str]:
    config_class = type(config)
    known = set((default or config).to_dict()) | set(config_class.attribute_map)
    known |= {name for name in inspect.signature(config_class.__init__).parameters if name not in ("self", "kwargs")}
    return known - {"model_type"}


def _refuse_unknown_keys(unknown: list[str], config: PretrainedConfig) -> None:
    if not unknown:
        return
    known = sorted(_known_keys(config) - set(unknown))
    described = []
    for key in unknown:
        close = difflib.get_close_matches(key, known, n=1)
        described.append(f"{key!r} (did you mean {close[0]!r}?)" if close else repr(key))
    name = type(config).__name__
    raise ValueError(
        f"Unknown key(s) in the `model: config:` section for model_type {config.model_type!r}: "
        f"{', '.join(described)}. A {name} has no such setting; fix the spelling (valid keys are the arguments of "
        f"{name})."
    )
