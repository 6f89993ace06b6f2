"""What a checkpoint's model is: the settings of its config that define the architecture, and how two differ.

A resume compares the saved architecture with the model it is asked to continue, on every rank, before anything
loads (`trainer/checkpoints.py`, `trainer/rank_agreement.py`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from transformers import PretrainedConfig

_NOT_ARCHITECTURE = frozenset(
    {"transformers_version", "architectures", "dtype", "torch_dtype", "use_cache", "output_attentions",
     "output_hidden_states", "return_dict"}
)  # fmt: skip


def architecture(model_config: PretrainedConfig) -> dict[str, Any]:
    """
    The settings of `model_config` that define the model a checkpoint holds: its whole `to_dict()` but the keys that
    only say where it came from or how it runs (`_name_or_path`, `transformers_version`, `architectures`, `dtype`,
    `use_cache`, output flags, and every private `_...` key).
    """
    return {k: v for k, v in model_config.to_dict().items() if k not in _NOT_ARCHITECTURE and not k.startswith("_")}


def describe_architecture_change(saved: Mapping[str, Any], current: Mapping[str, Any], limit: int = 6) -> str | None:
    """`None` when two `architecture` dicts are equal, else "key: saved -> current; ..." for the keys that differ."""
    keys = sorted(k for k in set(saved) | set(current) if saved.get(k, "<not set>") != current.get(k, "<not set>"))
    if not keys:
        return None
    shown = "; ".join(f"{k}: {saved.get(k, '<not set>')!r} -> {current.get(k, '<not set>')!r}" for k in keys[:limit])
    return shown + (f" (and {len(keys) - limit} more)" if len(keys) > limit else "")
