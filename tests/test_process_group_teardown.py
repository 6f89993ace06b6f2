"""Scripts that never call destroy_process_group() (most Trainer scripts) still exit with their groups torn down."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.dist_utils import free_port

REPO = Path(__file__).resolve().parent.parent

SCRIPT = textwrap.dedent(
    """
    import atexit, sys
    import torch.distributed as dist
    from pathlib import Path

    out = Path(sys.argv[1])
    # Registered first, so it runs last (atexit is LIFO): it sees what the package's teardown left.
    atexit.register(lambda: out.write_text(f"{dist.is_initialized()} {topology.outer_group is None}"))
    dist.init_process_group("gloo")
    from hf_diloco.core.layout.topology import Topology

    topology = Topology.from_default_group()  # kept alive in the globals, as a script keeps its trainer
    assert topology.outer_group is not None
    """
)


@pytest.mark.timeout(120)
def test_process_groups_are_destroyed_at_exit(tmp_path):
    port = free_port()
    procs = []
    for rank in range(2):
        env = dict(
            os.environ,
            PYTHONPATH=str(REPO),
            OMP_NUM_THREADS="1",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            WORLD_SIZE="2",
        )
        command = [sys.executable, "-c", SCRIPT, str(tmp_path / f"rank{rank}.txt")]
        procs.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    for proc in procs:
        output, _ = proc.communicate(timeout=100)
        assert proc.returncode == 0, output[-3000:]
    for rank in range(2):
        # Groups destroyed, and the topology no longer references them (they were freed before finalisation).
        assert (tmp_path / f"rank{rank}.txt").read_text() == "False True"
