"""What the engine checks and shares once at start-up, before any round: that every rank agrees on what must agree
(invariant 7 of docs/design.md), and the same initial weights on every worker.

Both fail within `sync_timeout_seconds` with an error that names the point and the ranks: the check first meets on
the topology's gloo control group with `monitored_barrier(wait_all_ranks=True)`, which names the ranks that did not
arrive, and the broadcasts run on the gloo groups `Topology.from_default_group` created with that timeout.
"""

from __future__ import annotations

import datetime
import hashlib
import json
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..exchange import exchange as exchange_module
from ..exchange.pending import OuterSyncError
from ..layout.fragments import Piece
from ..layout.topology import Topology
from ..settings.config import DiLoCoConfig

# Entries of a model's config that may differ between ranks of one run (paths, library versions, kernels chosen
# for the local hardware); every other entry (e.g. hidden_act, rope_scaling) must agree.
_LOCAL_MODEL_SETTINGS = ("transformers_version",)


def check_topology_matches(topology: Topology, config: DiLoCoConfig) -> None:
    layout = topology.layout
    if (layout.pipeline_stages, layout.data_parallel) != (config.pipeline_stages, config.data_parallel_per_worker):
        raise ValueError(
            f"The topology has pipeline_stages={layout.pipeline_stages}, data_parallel={layout.data_parallel} "
            f"but the config says pipeline_stages={config.pipeline_stages}, "
            f"data_parallel_per_worker={config.data_parallel_per_worker}."
        )


def describe_pieces(fragments: Sequence[Sequence[Piece]], params: Mapping[str, nn.Parameter]) -> str:
    """`name[rows]:shape` of every piece of every fragment: what the ranks of one stage must agree on."""
    described = []
    for pieces in fragments:
        for piece in pieces:
            shape = tuple(params[piece.name].shape)
            rows = "" if piece.shape(shape) == shape else f"[{piece.start}:{piece.stop}]"
            described.append(f"{piece.name}{rows}:{shape}")
    return ";".join(described)


def model_settings(model: nn.Module) -> str:
    """The model's configuration as text (a Hugging Face `model.config`, private `_*` entries left out; "" without)."""
    to_dict = getattr(getattr(model, "config", None), "to_dict", None)
    if not callable(to_dict):
        return ""
    settings = {k: v for k, v in to_dict().items() if not k.startswith("_") and k not in _LOCAL_MODEL_SETTINGS}
    return json.dumps(settings, sort_keys=True, default=str)


def check_workers_agree(
    topology: Topology,
    config_fingerprint: str,
    shapes: str,
    settings: str,
    extra_fingerprint: str,
    timeout_seconds: float,
) -> None:
    """Raise on every rank when ranks disagree on the wire format, the DiLoCo settings, the caller's
    `extra_fingerprint` (e.g. training schedule, tokenizer, data) or, among the ranks of one pipeline stage, the
    model's parameter `shapes` or its `settings` (`model_settings`). One exchange of a few short values
    (`gather_values`); nothing when alone."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    group = topology.control_group
    mine = {
        "wire_format": exchange_module.WIRE_FORMAT,
        "settings": config_fingerprint,
        "shapes": _stable_hash(shapes),
        "stage": topology.stage_index,
        "model": _stable_hash(settings),
        "extra": _stable_hash(extra_fingerprint),
    }
    point = f"the start-up check of the DiLoCo settings across all {dist.get_world_size()} ranks"
    device = None
    try:
        if group is not None or dist.get_backend() == "gloo":
            timeout = datetime.timedelta(seconds=timeout_seconds)
            dist.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=True)
        elif dist.get_backend() == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        everyone = gather_values(mine, group, device)
    except RuntimeError as error:
        raise OuterSyncError(
            f"{point} did not complete within sync_timeout_seconds={timeout_seconds:g}: {error}. Every rank must "
            "create its DiLoCo engine at about the same time; a rank that died or stalls before it holds the others."
        ) from error
    _compare(topology, everyone)


def gather_values(values: Mapping, group: dist.ProcessGroup | None, device: torch.device | None = None) -> list[dict]:
    """Every rank's `values` (JSON: never a pickle a peer could make run code), in the order of the ranks of `group`
    (None: the default group). The one way ranks show each other what must agree: the engine's start-up check and the
    front-ends' global points (`integrations/global_points.py`)."""
    return [json.loads(text) for text in all_gather_text(json.dumps(values, sort_keys=True), group, device)]


def all_gather_text(text: str, group: dist.ProcessGroup | None, device: torch.device | None = None) -> list[str]:
    """Every rank's `text`, by rank of `group`: the lengths, then the UTF-8 bytes padded to the longest."""
    data = torch.tensor(list(text.encode()), dtype=torch.uint8, device=device)
    size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, size, group=group)
    longest = int(max(sizes))
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: data.numel()] = data
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded, group=group)
    return [bytes(part[: int(n)].tolist()).decode() for part, n in zip(parts, sizes)]


def _compare(topology: Topology, everyone: list[dict]) -> None:
    formats = [row["wire_format"] for row in everyone]
    if len(set(formats)) != 1:
        raise ValueError(
            f"Ranks use different outer-exchange wire formats ({formats}, by rank): they run different hf_diloco "
            "versions. Install the same hf_diloco version on every node."
        )
    odd = _disagreeing(everyone, "settings")
    if odd:
        raise ValueError(
            f"DiLoCo settings differ between ranks (ranks {odd} disagree with rank 0): every worker must use the "
            "same inner_steps, num_fragments, compression, ... Check the config and DILOCO_* variables on each node."
        )
    odd = _disagreeing(everyone, "extra")
    if odd:
        raise ValueError(
            f"The training script's fingerprint differs between ranks (ranks {odd} disagree with rank 0): the "
            "settings it covers (training schedule, tokenizer, data, ...) must be the same on every worker."
        )
    stage = topology.stage_index
    same_stage = [r for r, row in enumerate(everyone) if row["stage"] == stage]
    if len({everyone[r]["shapes"] for r in same_stage}) != 1:
        raise ValueError(
            f"Ranks {same_stage} hold different model shapes for pipeline stage {stage}; every worker must "
            "train the same architecture."
        )
    if len({everyone[r]["model"] for r in same_stage}) != 1:
        raise ValueError(
            f"Ranks {same_stage} hold models with different configurations for pipeline stage {stage} (the same "
            "shapes, but e.g. another hidden_act or rope_scaling in model.config); every worker must train the "
            "same model."
        )


def _disagreeing(everyone: list[dict], key: str) -> list[int]:
    return [rank for rank, row in enumerate(everyone) if row[key] != everyone[0][key]]


def broadcast_initial_parameters(
    topology: Topology, params: Mapping[str, nn.Parameter], sharded_model: bool = False
) -> None:
    """Start every worker from the same weights: worker 0's, along the outer group, then inside the worker. A model
    sharded with FSDP broadcasts each rank's local shards along its outer group only (the same rows in every worker)."""
    steps = (
        (topology.outer_group, topology.outer_peers()[0], topology.outer_peers()),
        (
            None if sharded_model else topology.data_parallel_sync_group,
            None,
            topology.layout.data_parallel_ranks(topology.worker_index, topology.stage_index),
        ),
    )
    with torch.no_grad():
        for group, source, peers in steps:
            if group is None:
                continue
            if source is None:
                source = topology.layout.rank_at(topology.worker_index, 0, topology.stage_index)
            try:
                for param in params.values():
                    local = param.to_local() if sharded_model else param
                    buffer = local.detach().to("cpu").contiguous()
                    dist.broadcast(buffer, src=source, group=group)
                    local.copy_(buffer.to(local.device))
            except RuntimeError as error:
                raise OuterSyncError(
                    f"the initial broadcast of rank {source}'s parameters to peers {peers} failed: {error}. A peer "
                    "died or stalls at start-up (gloo gives up after sync_timeout_seconds)."
                ) from error


def _stable_hash(text: str) -> int:
    return int(hashlib.sha256(text.encode()).hexdigest()[:15], 16)
