"""One elastic site of two data-parallel ranks for tests/test_elastic_ddp_sites.py, launched as a site is:

    torchrun --standalone --nproc_per_node 2 tests/scripts/elastic_ddp_site.py LIGHTHOUSE SITE SLOT OUT STEPS \
        [WAIT_AT [BREAK_AT]]

Each rank trains a tiny Llama under DDP (gloo) on half of its site's batch (`tests.engine_common.batch_for(slot, step)`
at the job's inner step), with the membership `EngineSession.start` builds from the config (`lighthouse`, `site`,
`data_parallel_per_worker` 2), until the engine's inner step reaches STEPS. With WAIT_AT the site waits before that
inner step until OUT/go exists (at most 120 s; 0: no wait). With BREAK_AT the site breaks inside the exchange at that
inner step, after its group was formed: rank 1 exits, and rank 0 takes part 3 s later in one collective of the exchange
and then stops itself (SIGSTOP), so that the other sites' rank 1 fails at once while their rank 0 waits out the bound
of its next collective on a peer that is alive but silent, reaching the site's commit vote ~13 s after its rank 1.
Each rank writes its events to OUT/events_SITE_rRANK.jsonl (`bound` once its Manager heartbeats to the Lighthouse,
`joined`, a `step` per inner step, `waiting`, `breaking`) and, at the end, the whole θg and its membership summary and
metrics to OUT/final_SITE_rRANK.pt.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from hf_diloco import DiLoCoConfig
from hf_diloco.backends.torchft_membership import TorchftMembership
from hf_diloco.core.layout.topology import Topology
from hf_diloco.integrations.engine_session import EngineSession
from tests.engine_common import BATCH, batch_for, tiny_model


def main() -> None:
    lighthouse, site, slot, out, steps = (
        sys.argv[1],
        sys.argv[2],
        int(sys.argv[3]),
        Path(sys.argv[4]),
        int(sys.argv[5]),
    )
    wait_at = int(sys.argv[6]) if len(sys.argv) > 6 else 0
    break_at = int(sys.argv[7]) if len(sys.argv) > 7 else 0
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    events = (out / f"events_{site}_r{rank}.jsonl").open("a")

    def event(**fields: object) -> None:
        events.write(json.dumps({"time": time.time(), **fields}) + "\n")
        events.flush()

    bind = TorchftMembership.bind

    def bind_and_say(self: TorchftMembership, *args: object) -> None:
        bind(self, *args)  # from here on the Lighthouse waits for this site before it forms a quorum
        event(kind="bound", pid=os.getpid())

    TorchftMembership.bind = bind_and_say
    config = DiLoCoConfig(
        inner_steps=2,
        data_parallel_per_worker=2,
        sync_timeout_seconds=30,
        lighthouse=lighthouse,
        site=site,
        site_host="127.0.0.1",
        start_workers=2,
        min_workers_timeout=60,
        membership_sync_timeout=5,
    )
    topology = Topology.from_default_group(1, 2, config.sync_timeout_seconds)
    model = tiny_model(seed=slot)  # each site its own initial weights: the first group makes them start alike
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    engine = EngineSession.start(model, optimizer, config, topology, total_steps=steps).engine
    event(kind="joined", step=engine.inner_step)
    if break_at:
        launch = engine.exchange.launch

        def launch_or_break(*args: object, **kwargs: object) -> object:
            if engine.inner_step == break_at:
                event(kind="breaking", step=engine.inner_step)
                if rank == 1:
                    os._exit(1)
                signal.signal(signal.SIGTERM, signal.SIG_IGN)  # torchrun's SIGTERM at rank 1's exit: a hung rank
                time.sleep(3)  # the peer's rank 1 has long failed when this rank joins the first collective
                dist.all_reduce = _stop_after(dist.all_reduce)
            return launch(*args, **kwargs)

        engine.exchange.launch = launch_or_break
    ddp = DistributedDataParallel(model, process_group=topology.data_parallel_group)
    half = slice(rank * BATCH // 2, (rank + 1) * BATCH // 2)
    while engine.inner_step < steps:
        if wait_at and engine.inner_step == wait_at:
            event(kind="waiting", step=engine.inner_step)
            deadline = time.monotonic() + 120
            while not (out / "go").exists() and time.monotonic() < deadline:
                time.sleep(0.1)
        batch = batch_for(slot, engine.inner_step)
        ddp(input_ids=batch["input_ids"][half], labels=batch["labels"][half]).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        engine.step()
        event(kind="step", step=engine.inner_step)
    engine.close()
    result = {
        "global": engine.global_parameters(),  # the whole θg: gathered from the site's two ranks
        "summary": engine.elastic.log.summary(),
        "metrics": engine.metrics(),
    }
    torch.save(result, out / f"final_{site}_r{rank}.pt")
    event(kind="closed", step=engine.inner_step)
    dist.destroy_process_group()


def _stop_after(all_reduce):
    """`all_reduce` that stops this process (SIGSTOP) once it has taken part in one: from then on it is alive and
    silent until torchrun's SIGKILL ends it."""

    def once_then_stop(*args: object, **kwargs: object) -> object:
        result = all_reduce(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGSTOP)
        return result

    return once_then_stop


if __name__ == "__main__":
    main()
