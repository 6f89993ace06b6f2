"""A DiLoCo worker's processes under Accelerate: joined into one run, and averaging gradients among themselves only.

Accelerate (and the Trainer on top of it) would wrap the model in DDP over every process, so every backward pass
would all-reduce across workers. Here:

- `worker_topology` refuses a launch whose processes Accelerate did not join into one run, then builds the rank grid
  and its process groups (`Topology.from_default_group`);
- `prepare_worker_model` prepares the model for the loop: a one-process worker has nobody to average gradients with
  and is not wrapped in DDP at all, nor is a model `fully_shard`-ed over its worker (FSDP2 averages the gradients
  over the worker's ranks itself, see `worker_fsdp`); a worker of several processes is otherwise wrapped in DDP over
  its own group (`route_ddp_to_worker`, which hands Accelerate a `WorkerDDPKwargs`). Accelerate's own FSDP, which
  shards over every process, is refused.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from accelerate.utils import DistributedDataParallelKwargs, DistributedType
from torch import nn

from ..core.layout.topology import Topology
from ..core.settings.config import DiLoCoConfig
from .run_summary import check_processes_joined
from .worker_fsdp import holds_shards

ACCELERATE_FSDP_REFUSED = (
    "Accelerate's FSDP (an FSDP plugin, `accelerate launch --use_fsdp`, ACCELERATE_USE_FSDP) shards the model over "
    "every process, so every step would exchange weights and gradients across workers. Shard inside each worker "
    "instead: with DiLoCoTrainer pass the Trainer's `fsdp` / `fsdp_config` arguments; in an Accelerate loop call "
    "`fully_shard(model, mesh=hf_diloco.worker_mesh(config))` (its blocks first) before `prepare`, and create the "
    "Accelerator without an FSDP plugin."
)


@dataclasses.dataclass
class WorkerDDPKwargs(DistributedDataParallelKwargs):
    """Accelerate's DDP kwargs plus the process group DDP averages gradients over (the worker's, not the world)."""

    process_group: Any = None

    def to_dict(self, ignore_keys: tuple[str, ...] = ("comm_hook", "comm_wrapper", "comm_state_option")) -> dict:
        # The parent deep-copies every field; a ProcessGroup cannot be copied, and must not be.
        group = self.__dict__.pop("process_group")
        try:
            values = super().to_dict(ignore_keys)
        finally:
            self.__dict__["process_group"] = group
        values["process_group"] = group
        return values


def worker_topology(config: DiLoCoConfig, processes_in_run: int, how_to_fix: str) -> Topology:
    """
    This rank's worker and process groups, after checking that the launcher's processes form one run.

    Args:
        config (`DiLoCoConfig`): `pipeline_stages`, `data_parallel_per_worker` and `sync_timeout_seconds`.
        processes_in_run (`int`): the processes Accelerate (or the Trainer) counts in this run.
        how_to_fix (`str`): what to change in the caller's terms when they do not (see `check_processes_joined`).
    """
    check_processes_joined(processes_in_run, how_to_fix)
    return Topology.from_default_group(
        pipeline_stages=config.pipeline_stages,
        data_parallel_per_worker=config.data_parallel_per_worker,
        timeout_seconds=config.sync_timeout_seconds,
    )


def route_ddp_to_worker(accelerator: Any, topology: Topology) -> None:
    """Make the DDP wrap Accelerate applies average over the worker's processes only."""
    handler = accelerator.ddp_handler or DistributedDataParallelKwargs()
    values = {f.name: getattr(handler, f.name) for f in dataclasses.fields(handler)}
    values["process_group"] = topology.data_parallel_group
    accelerator.ddp_handler = WorkerDDPKwargs(**values)


def worker_is_one_process(accelerator: Any, topology: Topology) -> bool:
    """A distributed run whose workers are single processes: nothing to average gradients with inside a worker."""
    return accelerator.distributed_type != DistributedType.NO and topology.data_parallel_group is None


def needs_no_ddp(accelerator: Any, topology: Topology, model: nn.Module) -> bool:
    """Nothing for DDP to do: the worker is one process, or the model is sharded over the worker (FSDP2 averages
    its gradients over the worker's ranks itself)."""
    return worker_is_one_process(accelerator, topology) or holds_shards(model)


def refuse_accelerate_fsdp(accelerator: Any) -> None:
    """Raise `ValueError` when Accelerate would shard the model over the whole run (`ACCELERATE_FSDP_REFUSED`)."""
    if accelerator.distributed_type == DistributedType.FSDP:
        raise ValueError(ACCELERATE_FSDP_REFUSED)


def prepare_without_ddp(accelerator: Any, model: nn.Module) -> nn.Module:
    """Accelerate's evaluation mode: mixed precision, device placement and compilation without the DDP wrap; the
    model is marked prepared, so a later `accelerator.prepare(model, optimizer)` keeps it as it is."""
    return accelerator.prepare_model(model, evaluation_mode=True)


def prepare_worker_model(accelerator: Any, model: nn.Module, topology: Topology) -> nn.Module:
    """`accelerator.prepare_model` for a DiLoCo worker: DDP over the worker's processes, or none for one process or
    a model sharded over the worker. Refuses Accelerate's FSDP (`ACCELERATE_FSDP_REFUSED`)."""
    refuse_accelerate_fsdp(accelerator)
    if needs_no_ddp(accelerator, topology, model):
        return prepare_without_ddp(accelerator, model)
    route_ddp_to_worker(accelerator, topology)
    return accelerator.prepare_model(model)
