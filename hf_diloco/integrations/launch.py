"""Process-group start-up that survives `torchrun --max-restarts`.

torch's `env://` rendezvous keeps one key space in the launcher's store across restart attempts, so a restarted worker
can read the dead attempt's gloo addresses and fail with "Gloo connectFullMesh failed ... Connection refused" (or wait
for them). On a restart (`TORCHELASTIC_RESTART_COUNT` > 0) we create the default process group ourselves on a store
prefixed by the attempt; Accelerate then uses the group that already exists.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist


def init_process_group_for_restart(use_cpu: bool, timeout_seconds: float = 1800.0) -> bool:
    """Initialise the default group on an attempt-prefixed store when this is a torchrun restart; True if it did."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if attempt == 0 or not dist.is_available() or dist.is_initialized() or "RANK" not in os.environ:
        return False
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = datetime.timedelta(seconds=timeout_seconds)
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size,
        is_master=not agent_hosts_store and rank == 0,
        timeout=timeout,
    )
    backend = "nccl" if torch.cuda.is_available() and not use_cpu else "gloo"
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"/hf_diloco/attempt_{attempt}", store),
        rank=rank,
        world_size=world_size,
        timeout=timeout,
    )
    return True
