"""The Trainer's `fsdp` settings in `DiLoCoTrainer`: FSDP2 over each worker's data-parallel ranks, never across
workers (`hf_diloco.integrations.worker_fsdp`).

With `fsdp` set (`--fsdp`, `fsdp=True` or a legacy string, with or without `fsdp_config`) the trainer

- builds the Accelerator without the FSDP plugin the Trainer would hand it (its mesh is the whole run; on CPU
  Accelerate switches FSDP off altogether), so the same route runs on CPU and GPU;
- `fully_shard`s the model over `hf_diloco.worker_mesh(config)` once, in `__init__`, before the inner optimizer
  exists, and leaves it unwrapped (no DDP: FSDP2 averages the gradients over the worker's ranks);
- keeps the model where it was built (the CPU) until then: the Trainer's own move of the whole model waits for the
  sharding, and `fully_shard` moves each unit to the mesh's device as it cuts it, keeping this rank's shard there, so
  a rank's accelerator never holds more than its shards plus the unit being cut;
- saves by gathering the full state dict inside each worker (every rank takes part; the saving rank writes one
  normal `save_pretrained` folder) and loads a folder by cutting each rank's rows out of it, with no collective.

Checkpoints keep each rank's shards of everything in its `diloco_state_rank{rank}.pt`, as without sharding, and the
engine keeps 1/D of the outer state on every rank.
"""

from __future__ import annotations

import torch
from torch import nn

from ..worker_fsdp import WorkerFSDPSettings, full_state_dict, holds_shards, load_full_state_dict, shard_worker_model
from .attributes import temporarily_set
from .pipeline_stages import SafetensorsFolder


class WorkerSharding:
    """Mixin of [`DiLoCoTrainer`]: the Trainer's `fsdp` settings shard the model over each worker (see the module
    docstring).

    Sets `diloco_run.every_rank_saves_the_model` when sharding. Calls `_get_topology` (`EngineLifecycle`).

    Attributes:
        worker_fsdp (`WorkerFSDPSettings` or `None`): how the model is sharded, `None` when `fsdp` is not set.
    """

    worker_fsdp: WorkerFSDPSettings | None = None

    def create_accelerator_and_postprocess(self) -> None:
        with temporarily_set(self.args, "fsdp_plugin_args", None):
            super().create_accelerator_and_postprocess()

    def _move_model_to_device(self, model: nn.Module, device: torch.device) -> None:
        # The Trainer moves the whole model in its `__init__` (no FSDP plugin, so `place_model_on_device` is True),
        # which would put a whole copy on every accelerator before `fully_shard`: the model stays where it was built
        # until it is sharded. Once sharded, a move moves this rank's shards only.
        if self.args.fsdp_plugin_args is None or holds_shards(model):
            super()._move_model_to_device(model, device)

    def _shard_model_over_worker(self) -> None:
        """`fully_shard` the model over this rank's worker when `fsdp` is set (every rank, once, in `__init__`)."""
        if self.args.fsdp_plugin_args is None:
            return
        config = self.args.diloco_config()
        self.worker_fsdp = WorkerFSDPSettings.from_plugin_args(self.args.fsdp_plugin_args, config)
        self._get_topology()  # the worker groups exist before the worker meshes
        shard_worker_model(self.model, config, self.worker_fsdp)
        self.diloco_run.every_rank_saves_the_model = True  # the full state dict is gathered inside every worker

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        if self.worker_fsdp is None or state_dict is not None:
            return super()._save(output_dir, state_dict=state_dict)
        state_dict = full_state_dict(self.model)
        if not self.args.should_save:
            return None
        return super()._save(output_dir, state_dict=state_dict)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        if self.worker_fsdp is None:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        load_full_state_dict(self.model, SafetensorsFolder(resume_from_checkpoint))
        return None

    def _load_best_model(self) -> None:
        if self.worker_fsdp is None:
            return super()._load_best_model()
        load_full_state_dict(self.model, SafetensorsFolder(self.state.best_model_checkpoint))
        return None
