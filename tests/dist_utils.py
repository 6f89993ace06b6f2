"""Run a function on N real processes joined by a gloo process group (free port per call)."""

from __future__ import annotations

import datetime
import os
import socket
import tempfile
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# The ranks start from a fork server that imported torch, transformers and the package once: each rank then starts in
# a fraction of a second instead of importing them again (a fresh interpreter, like spawn's, not a fork of pytest).
_PRELOAD = ["torch", "torch.distributed", "transformers", "hf_diloco", "tests.engine_common"]


def run_on_processes(fn, world_size: int, *args, timeout_seconds: float = 120.0) -> list:
    """`fn(rank, world_size, *args)` on `world_size` processes; returns each rank's return value."""
    port = free_port()
    mp.get_context("forkserver").set_forkserver_preload(_PRELOAD)
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            _entry,
            args=(fn, world_size, port, tmp, timeout_seconds, args),
            nprocs=world_size,
            join=True,
            start_method="forkserver",
        )
        return [torch.load(Path(tmp) / f"rank{rank}.pt", weights_only=False) for rank in range(world_size)]


def _entry(rank, fn, world_size, port, out_dir, timeout_seconds, args):
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_seconds)
    )
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    except Exception:
        traceback.print_exc()
        raise
    finally:
        dist.destroy_process_group()
