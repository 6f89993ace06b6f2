"""Every collective the engine issues fails within `sync_timeout_seconds`, naming the point and the peers.

Real processes on gloo: a peer that exits, or is stopped with SIGSTOP, at start-up, at the initial broadcast, at an
inline exchange (the default `sync_delay: 0`) and at `close()`'s tail sync. Each scenario is its own pair of
processes (a dead peer breaks the group for good), and the four pairs run at once (a stopped peer leaves rank 0
waiting, not computing); the test measures how long each rank 0 took to fail.
"""

from __future__ import annotations

import datetime
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.dist_utils import free_port
from tests.engine_common import INNER_LR, inner_step, tiny_model

TIMEOUT = 8.0  # sync_timeout_seconds of every scenario
SLACK = 20.0  # start-up of the failing call and error handling on a loaded 2-core machine


def _silence(rank: int, how: str) -> None:
    """Make rank 1 an absent peer: gone for good, or alive but stopped."""
    if rank != 1:
        return
    if how == "exit":
        os._exit(0)
    os.kill(os.getpid(), signal.SIGSTOP)


def _fail_at(rank: int, scenario: str, how: str) -> None:
    from hf_diloco import DiLoCo, DiLoCoConfig, Topology
    from hf_diloco.core.membership.agreement import broadcast_initial_parameters

    config = DiLoCoConfig(inner_steps=2, sync_timeout_seconds=TIMEOUT)
    model = tiny_model(layers=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=INNER_LR)
    topology = Topology.from_default_group(timeout_seconds=TIMEOUT)
    dist.barrier()  # both ranks arrive together; from here only the scenario's silence holds rank 0
    if scenario == "start":
        _silence(rank, how)
        DiLoCo(model, optimizer, config, topology=topology)
    elif scenario == "broadcast":
        _silence(rank, how)
        broadcast_initial_parameters(topology, dict(model.named_parameters()))
    engine = DiLoCo(model, optimizer, config, topology=topology)
    inner_step(model, optimizer, rank, 1)
    engine.step()
    inner_step(model, optimizer, rank, 2)
    if scenario == "exchange":
        _silence(rank, how)
    engine.step()  # the first sync, inline
    inner_step(model, optimizer, rank, 3)
    engine.step()
    if scenario == "close":
        _silence(rank, how)
    engine.close()  # one step of tail to sync


def _entry(rank: int, port: int, scenario: str, how: str, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120))
    started = time.perf_counter()
    try:
        _fail_at(rank, scenario, how)
        outcome = {"error": None, "message": ""}
    except Exception as error:  # noqa: BLE001 - reported to the test
        outcome = {"error": type(error).__name__, "message": str(error)}
    if rank == 0:
        queue.put(dict(outcome, seconds=time.perf_counter() - started))
    os._exit(0)  # a broken group must not hold the process at teardown


def _run_scenarios(scenarios: list[str], how: str) -> dict[str, dict]:
    """Each scenario's rank 0 outcome, every scenario's pair of processes started at once."""
    context = mp.get_context("spawn")
    queues = {scenario: context.SimpleQueue() for scenario in scenarios}
    pairs = {}
    for scenario in scenarios:
        port = free_port()
        pairs[scenario] = [
            context.Process(target=_entry, args=(rank, port, scenario, how, queues[scenario])) for rank in range(2)
        ]
        for process in pairs[scenario]:
            process.start()
    try:
        outcomes = {}
        deadline = time.monotonic() + 240
        while len(outcomes) < len(scenarios) and time.monotonic() < deadline:
            for scenario in (scenario for scenario in scenarios if scenario not in outcomes):
                exited = not pairs[scenario][0].is_alive()  # read before the queue: its report is there by then
                if not queues[scenario].empty():
                    outcomes[scenario] = queues[scenario].get()
                elif exited:
                    outcomes[scenario] = {"error": "rank 0 exited without reporting", "message": ""}
            time.sleep(0.2)
        missing = [scenario for scenario in scenarios if scenario not in outcomes]
        assert not missing, f"rank 0 reported nothing within 240 s ({missing}, {how})"
        return outcomes
    finally:
        for process in (process for pair in pairs.values() for process in pair):
            process.kill()
            process.join(timeout=30)


# (scenario, what rank 0's error must name)
POINTS = [
    ("start", ["start-up check", "sync_timeout_seconds=8", "Ranks 1 failed to pass monitoredBarrier"]),
    ("broadcast", ["initial broadcast", "peers [0, 1]"]),
    ("exchange", ["outer sync of fragment 0 at inner step 2 with peers [0, 1]"]),
    ("close", ["final outer sync of fragment 0 at inner step 3 with peers [0, 1]"]),
]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("how", ["exit", "stop"])
def test_a_dead_or_stopped_peer_fails_every_collective_within_the_timeout(how):
    outcomes = _run_scenarios([scenario for scenario, _ in POINTS], how)
    for scenario, names in POINTS:
        outcome = outcomes[scenario]
        assert outcome["error"] == "OuterSyncError", (scenario, outcome)
        assert all(name in outcome["message"] for name in names), (scenario, outcome)
        assert outcome["seconds"] < TIMEOUT + SLACK, (scenario, outcome)
        if how == "stop":  # a stopped peer holds the collective until the timeout the user set, not longer
            assert outcome["seconds"] > TIMEOUT - 1, (scenario, outcome)
