"""`auto` as the value of `learning_rate`, `per_device_train_batch_size` or `outer_lr` in the main job.

Each `auto` becomes the DiLoCo scaling laws' value (`hf_diloco.core.settings.scaling_rules`) once the model exists, from its
parameter count N, the run's workers M, H and the block size; the start-up line prints each value and its source,
and every way the run lies outside the fitted range. `auto` is taken out of the config, the flags and the
`DILOCO_*` variables before the arguments are parsed (their types are numbers), so the rest of the job sees numbers.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from ..core.settings.config import ENV_PREFIX
from ..job.config_file import LoadedConfig

AUTO = "auto"
# The keys that take `auto`, and the section of the config each belongs to.
AUTO_KEYS = {"learning_rate": "training", "per_device_train_batch_size": "training", "outer_lr": "diloco"}


@dataclasses.dataclass(frozen=True)
class AutoRequest:
    """The keys set to `auto`, and where (for the messages)."""

    keys: dict[str, str]  # key -> where it was set

    def __bool__(self) -> bool:
        return bool(self.keys)


def take_auto_values(
    config: LoadedConfig, argv: Sequence[str], environ: Mapping[str, str]
) -> tuple[LoadedConfig, list[str], dict[str, str], AutoRequest]:
    """
    Remove every `auto` of `AUTO_KEYS` from the config's sections, the flags (`--learning_rate auto` or `=auto`) and
    the variables (`DILOCO_OUTER_LR=auto`); returns what is left of each and the keys that asked for `auto`.
    """
    keys: dict[str, str] = {}
    values = {
        name: (dict(content) if isinstance(content, dict) else content) for name, content in config.values.items()
    }
    for key, section in AUTO_KEYS.items():
        if _is_auto((values.get(section) or {}).get(key)):
            del values[section][key]
            keys[key] = config.source
    rest, tokens = [], list(argv)
    while tokens:
        token = tokens.pop(0)
        flag, has_value, value = token.partition("=")
        key = flag[2:] if flag.startswith("--") else None
        if key in AUTO_KEYS and not has_value and tokens and _is_auto(tokens[0]):
            tokens.pop(0)
            keys[key] = f"--{key}"
        elif key in AUTO_KEYS and has_value and _is_auto(value):
            keys[key] = f"--{key}"
        else:
            rest.append(token)
    variables = dict(environ)
    for key, section in AUTO_KEYS.items():
        name = f"{ENV_PREFIX}{key.upper()}"
        if section == "diloco" and _is_auto(variables.get(name)):
            del variables[name]
            keys.setdefault(key, name)
    return dataclasses.replace(config, values=values), rest, variables, AutoRequest(keys)


def resolve_auto_values(request: AutoRequest, args: Any, model: Any, block_size: int, trainer: str) -> list[str]:
    """
    Set each `auto` key of `args` from the scaling laws for `model`; returns the start-up lines saying what each
    became and why (and the extrapolation warnings).

    Raises:
        `ValueError`: `auto` with `trainer: ddp` (the laws are DiLoCo's).
    """
    from ..core.settings.scaling_rules import scaling_law_settings

    if not request:
        return []
    if trainer != "diloco":
        refuse_auto_for(trainer, request)
    num_parameters = sum(parameter.numel() for parameter in model.parameters())
    ranks_per_worker = args.pipeline_stages * args.data_parallel_per_worker
    workers = max(1, args.world_size // ranks_per_worker)
    rules = scaling_law_settings(num_parameters, workers, args.inner_steps, block_size, args.max_steps or None)
    lines = [f"auto settings for N={num_parameters:,} parameters, M={workers} worker(s), H={args.inner_steps}:"]
    if "learning_rate" in request.keys:
        args.learning_rate = rules.inner_learning_rate.value
        lines.append(f"  learning_rate={args.learning_rate:.4g} ({rules.inner_learning_rate.source})")
    if "per_device_train_batch_size" in request.keys:
        sequences = rules.global_batch_sequences.value
        shares = workers * args.data_parallel_per_worker * args.gradient_accumulation_steps
        args.per_device_train_batch_size = max(1, round(sequences / shares))
        lines.append(
            f"  per_device_train_batch_size={args.per_device_train_batch_size} (global batch "
            f"{rules.global_batch_tokens.value:,.0f} tokens = {sequences:.1f} sequences of {block_size} over "
            f"{workers} worker(s) x {args.data_parallel_per_worker} rank(s) x {args.gradient_accumulation_steps} "
            f"accumulation step(s); {rules.global_batch_tokens.source})"
        )
    if "outer_lr" in request.keys:
        args.outer_lr = rules.outer_learning_rate.value
        lines.append(f"  outer_lr={args.outer_lr:.4g} ({rules.outer_learning_rate.source})")
    lines.extend(f"  warning: {warning}" for warning in rules.warnings)
    return lines


def refuse_auto_for(trainer: str, request: AutoRequest) -> None:
    """`auto` with the DDP baseline: the laws are DiLoCo's."""
    where = ", ".join(sorted(set(request.keys.values())))
    raise ValueError(
        f"{', '.join(f'{key}: auto' for key in request.keys)} (in {where}): auto values come from the DiLoCo scaling "
        f"laws, and this run has trainer: {trainer}. Give the baseline the values of the DiLoCo run it is compared "
        "with."
    )


def say(lines: list[str]) -> None:
    for line in lines:
        print(line, file=sys.stderr)


def _is_auto(value: Any) -> bool:
    return isinstance(value, str) and value.strip().lower() == AUTO
