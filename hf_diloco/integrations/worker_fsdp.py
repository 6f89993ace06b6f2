"""FSDP2 inside a DiLoCo worker for the front-ends: the model sharded over the worker's data-parallel ranks, never
across workers.

Accelerate's own FSDP shards over every process of the run (its mesh is the world), so its outer exchange would
cross workers at every step, and it is switched off on CPU (`use_cpu`). The front-ends therefore shard the model
themselves, on CPU and GPU alike: every block of the block stack (or every module of the classes the user names),
then the root, `fully_shard`-ed over `hf_diloco.worker_mesh(config)`, before the inner optimizer is created; the
Accelerator is built without an FSDP plugin and leaves the sharded model unwrapped. FSDP2's reduce-scatter then
averages the gradients over the worker's D ranks as DDP would, and the engine keeps 1/D of the outer state per rank.

A whole tensor is only ever needed to save a normal folder: `full_state_dict` gathers it inside the worker, and
`load_full_state_dict` cuts each rank's rows out of a folder's tensors without any collective.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from ..core.layout.fragments import find_block_stack
from ..core.settings.config import DiLoCoConfig
from ..parallel.fsdp import worker_mesh


@dataclasses.dataclass(frozen=True)
class WorkerFSDPSettings:
    """How to shard a worker's model, from the Trainer's `fsdp_config`.

    Attributes:
        reshard_after_forward: free the gathered weights after each forward (FSDP2's `reshard_after_forward`).
        cpu_offload: keep the shards and their gradients on the CPU (`CPUOffloadPolicy`).
        wrap_classes: class names whose modules are sharded as units; empty: the blocks of the block stack.
    """

    reshard_after_forward: bool = True
    cpu_offload: bool = False
    wrap_classes: tuple[str, ...] = ()

    @classmethod
    def from_plugin_args(cls, plugin_args: Mapping[str, Any], config: DiLoCoConfig) -> WorkerFSDPSettings:
        """Read `TrainingArguments.fsdp_plugin_args` (what `fsdp` / `fsdp_config` became), refusing what cannot be
        honoured inside a worker with a `ValueError` that names the setting."""
        if config.pipeline_stages > 1:
            raise ValueError(
                f"fsdp with pipeline_stages={config.pipeline_stages}: DiLoCoTrainer does not shard pipeline stages. "
                "Use pipeline stages (each holds 1/S of the model) or fsdp (each of the D ranks holds 1/D), not both; "
                "at the engine level a stage can be fully_shard-ed over hf_diloco.worker_mesh(config)."
            )
        refused = {
            "fsdp_version": (1, "FSDP1 is not supported: set fsdp_config['version'] = 2 (the default)"),
            "cpu_ram_efficient_loading": (
                True,
                "cpu_ram_efficient_loading loads the weights on rank 0 and broadcasts them over every process: leave "
                "it off (every worker's ranks start from the same weights, which the engine checks)",
            ),
            "activation_checkpointing": (
                True,
                "fsdp_config['activation_checkpointing'] is Accelerate's: use the gradient_checkpointing argument",
            ),
        }
        for key, (value, message) in refused.items():
            if plugin_args.get(key) == value:
                raise ValueError(f"{message}.")
        if "SHARDED_STATE_DICT" in str(plugin_args.get("state_dict_type", "")):
            raise ValueError(
                "fsdp_config['state_dict_type'] = SHARDED_STATE_DICT: DiLoCoTrainer keeps each rank's shards in its "
                "own DiLoCo state file and saves the model as one normal folder; leave state_dict_type unset."
            )
        names = plugin_args.get("transformer_cls_names_to_wrap") or ""
        return cls(
            reshard_after_forward=bool(plugin_args.get("reshard_after_forward", True)),
            cpu_offload=bool(plugin_args.get("cpu_offload", False)),
            wrap_classes=tuple(name.strip() for name in names.split(",") if name.strip()),
        )


def holds_shards(model: nn.Module) -> bool:
    """Whether `model` holds FSDP2 (DTensor) parameters."""
    return any(isinstance(param, DTensor) for param in model.parameters())


def shard_worker_model(model: nn.Module, config: DiLoCoConfig, settings: WorkerFSDPSettings) -> nn.Module:
    """`fully_shard` `model` in place over this rank's worker mesh: its units (see `WorkerFSDPSettings`), then the
    root. Every rank calls it at the same point (it creates the worker meshes); returns `model`.

    Call it on the model where it was built (the CPU), not after moving it whole to the accelerator: `fully_shard`
    moves each unit to the mesh's device as it cuts it and keeps only this rank's shard there, so the device never
    holds more than the shards plus the unit being cut.

    Raises:
        ValueError: `wrap_classes` names no module of the model, or the model has no block stack to shard by.
    """
    units = _units(model, settings.wrap_classes)
    mesh = worker_mesh(config, model=model)
    options: dict[str, Any] = {
        "mesh": mesh,
        "offload_policy": CPUOffloadPolicy() if settings.cpu_offload else OffloadPolicy(),
    }
    for unit in units:
        fully_shard(unit, reshard_after_forward=settings.reshard_after_forward, **options)
    fully_shard(model, **options)
    return model


def _units(model: nn.Module, wrap_classes: tuple[str, ...]) -> list[nn.Module]:
    if wrap_classes:
        units = [module for module in model.modules() if type(module).__name__ in wrap_classes]
        if not units:
            raise ValueError(
                f"fsdp_config['transformer_layer_cls_to_wrap'] = {list(wrap_classes)} names no module of "
                f"{type(model).__name__}: name its block classes, or leave it unset to shard block by block."
            )
        # Innermost first: a module sharded before its parent is its own unit, and the parent leaves its parameters.
        return [unit for unit in reversed(units) if unit is not model and not isinstance(unit, FSDPModule)]
    stack = find_block_stack(model)
    if stack is None:
        raise ValueError(
            f"{type(model).__name__} has no block stack (a module list of config.num_hidden_layers blocks) to shard "
            "block by block: name the classes to shard in fsdp_config['transformer_layer_cls_to_wrap']."
        )
    return list(model.get_submodule(stack).children())


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole state dict of a sharded model on the CPU, gathered inside the worker: every rank of the worker
    calls it at the same point."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


@torch.no_grad()
def load_full_state_dict(model: nn.Module, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Copy whole tensors (a saved folder's, read by every rank) into a sharded model: each rank keeps its own rows,
    with no collective. Persistent buffers and unsharded parameters are copied whole."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()  # the next forward gathers from the shards written here
    saved = set(model.state_dict())  # the parameters and persistent buffers, as `save_pretrained` names them
    targets = {name: tensor for name, tensor in [*model.named_parameters(), *model.named_buffers()] if name in saved}
    missing = sorted(set(targets) - set(state_dict))
    if missing:
        raise KeyError(f"the saved state has no tensor named {missing[:5]}: it was written for another model.")
    for name, target in targets.items():
        if isinstance(target, DTensor):
            local = target.to_local()
            value = state_dict[name].to(device=local.device, dtype=local.dtype)
            local.copy_(distribute_tensor(value, target.device_mesh, target.placements, src_data_rank=None).to_local())
        else:
            target.copy_(state_dict[name])
