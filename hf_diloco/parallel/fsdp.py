"""FSDP2 inside a worker: shard the model over the worker's data-parallel ranks, never across workers.

    mesh = hf_diloco.worker_mesh(config, model=model)
    for block in model.model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    engine = DiLoCo(model, torch.optim.AdamW(model.parameters()), config)

The engine then works on each rank's local shards: θg, the outer optimizer state, eager's trajectory and the residuals
exist for those rows only, the outer exchange runs between the ranks holding the same rows in every worker, and
nothing is gathered inside the worker except where a whole tensor is needed (`DiLoCo.global_parameters()`, saving).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..core.layout.topology import RankLayout
from ..core.settings.config import DiLoCoConfig


def worker_mesh(config: DiLoCoConfig, device_type: str | None = None, model: nn.Module | None = None) -> DeviceMesh:
    """The 1-D `DeviceMesh` of the calling rank's worker: its `data_parallel_per_worker` ranks (with pipeline stages,
    the data-parallel ranks of this rank's stage), for `fully_shard(model, mesh=...)`.

    Every rank must call it at the same point (it creates one process group per worker and stage, on the default
    group's backend). No group it creates crosses workers.

    Args:
        config: the DiLoCo settings (`pipeline_stages`, `data_parallel_per_worker`).
        device_type: the mesh's device type; by default that of `model`'s parameters (`mesh_device_type`).
        model: the model to be sharded over the mesh: its parameters' device decides the mesh's device type (a model
            still on `meta` decides nothing, and the default process group's backends do).

    Raises:
        RuntimeError: when no default process group is initialised.
        ValueError: when the world size is not a multiple of `pipeline_stages x data_parallel_per_worker`.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "worker_mesh needs the default process group: call torch.distributed.init_process_group first (torchrun "
            "and accelerate launch set up what it needs)."
        )
    layout = RankLayout(dist.get_world_size(), config.pipeline_stages, config.data_parallel_per_worker)
    rank = dist.get_rank()
    mine = None
    for worker in range(layout.num_workers):
        for stage in range(layout.pipeline_stages):
            ranks = layout.data_parallel_ranks(worker, stage)
            group = dist.new_group(ranks)  # every rank creates every group, in the same order
            if rank in ranks:
                mine = group
    if device_type is None:
        devices = [] if model is None else [param.device for param in model.parameters()]
        device_type = mesh_device_type(devices, dist.get_backend_config(), torch.cuda.is_available())
    return DeviceMesh.from_group(mine, device_type, mesh_dim_names=("data_parallel",))


def mesh_device_type(parameter_devices: Iterable[torch.device], backend_config: str, cuda_available: bool) -> str:
    """The device type of a worker's mesh for parameters on `parameter_devices`, given the default group's backends
    (`dist.get_backend_config()`, e.g. `"cpu:gloo,cuda:nccl"`; `"cpu:gloo,cuda:gloo"` for gloo; `"cuda:nccl"`).

    The parameters decide: an accelerator among their devices (FSDP2's CPU offload may have put others on the host),
    else `cpu`, provided the default group has a backend for that type (NCCL has none for `cpu`: a model still on the
    CPU under an NCCL-only group is about to be moved to the GPU). Without such parameters (no model, or all on
    `meta`): `cuda` when CUDA is available and the default group has a GPU backend other than gloo for it (NCCL
    from `init_process_group("nccl")`, `"cpu:gloo,cuda:nccl"`, or no backend named on a CUDA machine), else `cpu`.
    """
    backends = dict(entry.split(":", 1) for entry in backend_config.split(",") if ":" in entry)
    types = [device.type for device in parameter_devices if device.type != "meta"]
    wanted = next((kind for kind in types if kind != "cpu"), "cpu" if types else None)
    if wanted is not None and wanted in backends:
        return wanted
    return "cuda" if cuda_available and backends.get("cuda", "gloo") != "gloo" else "cpu"
