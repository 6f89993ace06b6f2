"""FSDP2 inside a worker: shard the model over the worker's data-parallel ranks, never across workers.

    mesh = hf_diloco.worker_mesh(config)
    for block in model.model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    engine = DiLoCo(model, torch.optim.AdamW(model.parameters()), config)

The engine then works on each rank's local shards: θg, the outer optimizer state, eager's trajectory and the residuals
exist for those rows only, the outer exchange runs between the ranks holding the same rows in every worker, and
nothing is gathered inside the worker except where a whole tensor is needed (`DiLoCo.global_parameters()`, saving).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..core.config import DiLoCoConfig
from ..core.topology import RankLayout


def worker_mesh(config: DiLoCoConfig, device_type: str | None = None) -> DeviceMesh:
    """The 1-D `DeviceMesh` of the calling rank's worker: its `data_parallel_per_worker` ranks (with pipeline stages,
    the data-parallel ranks of this rank's stage), for `fully_shard(model, mesh=...)`.

    Every rank must call it at the same point (it creates one process group per worker and stage, on the default
    group's backend). No group it creates crosses workers.

    Args:
        config: the DiLoCo settings (`pipeline_stages`, `data_parallel_per_worker`).
        device_type: the mesh's device type; by default `cuda` when the default process group is NCCL, else `cpu`.

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
        device_type = "cuda" if dist.get_backend() == "nccl" and torch.cuda.is_available() else "cpu"
    return DeviceMesh.from_group(mine, device_type, mesh_dim_names=("data_parallel",))
