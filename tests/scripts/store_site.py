"""One site of a store job (tests/test_store_sites.py): a small model trained in a raw loop with `DiLoCo(...,
store=open_store(url))`, one process or a torchrun of D DDP ranks, and nothing else connecting it to the other sites.

It records, per rank, θg of this rank's share after every round it applies (with the round's number) and an event
log. The test's own parts are pacing (`--step_seconds`) and, for the fault tests, a kill point: with `--hold_upload
N` the site writes `upload-N` into its folder just before it writes its share of its N-th contribution and waits
there a few seconds, so that the test can kill it mid-upload."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from hf_diloco import DiLoCo, DiLoCoConfig, Topology, open_store


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--site", required=True)
    parser.add_argument("--store_url", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--step_seconds", type=float, default=0.05)
    parser.add_argument("--config", default="{}", help="DiLoCoConfig fields as JSON")
    parser.add_argument("--hold_upload", type=int, default=0)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    topology = None
    if world > 1:
        dist.init_process_group("gloo")
        topology = Topology.from_default_group(1, world, 120)
    torch.manual_seed(sum(map(ord, args.site)))  # every site starts from its own weights: round 0's snapshot decides
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 8), nn.Tanh(), nn.Linear(8, 4))
    settings = {"inner_steps": 4, "outer_lr": 0.7, "outer_momentum": 0.9, "compression": "none",
                "compression_block_size": 8, "exchange_pattern": "all_gather", "quorum": 2, "grace_seconds": 1.0,
                "round_deadline_seconds": 30.0, "snapshot_every": 1000, **json.loads(args.config)}  # fmt: skip
    config = DiLoCoConfig(exchange="store", store_url=args.store_url, site=args.site, data_parallel_per_worker=world,
                          **settings)  # fmt: skip
    store = open_store(args.store_url)
    if args.hold_upload:
        store = HeldUpload(store, out, args.hold_upload)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    log = (out / f"events-{rank}.jsonl").open("a")
    started = time.time()
    engine = DiLoCo(model, optimizer, config, topology=topology, store=store)
    log.write(json.dumps({"event": "joined", "step": engine.inner_step, "time": time.time() - started}) + "\n")
    rounds: list[dict] = []
    fragment = engine.fragments[0]
    engine.add_observer(lambda record: rounds.append({
        "round": engine.store.applied[record.fragment], "final": record.final,
        "theta": engine.fragments[record.fragment].theta_g.tolist(),
    }))  # fmt: skip
    trained = (
        model if world == 1 else nn.parallel.DistributedDataParallel(model, process_group=topology.data_parallel_group)
    )
    data = torch.Generator().manual_seed(sum(map(ord, args.site)) * 100 + rank)
    while engine.inner_step < args.steps and not engine.job_finished:
        inputs, targets = torch.randn(16, 8, generator=data), torch.randn(16, 4, generator=data)
        loss = nn.functional.mse_loss(trained(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        engine.step()
        log.write(json.dumps({"event": "step", "step": engine.inner_step, "time": time.time() - started}) + "\n")
        log.flush()
        time.sleep(args.step_seconds)
    engine.close()
    summary = engine.store.summary()
    result = {"rounds": rounds, "theta": fragment.theta_g.tolist(), "segments": engine.store.segments[0],
              "steps": engine.inner_step, "summary": summary, "stats": dict(engine.stats)}  # fmt: skip
    (out / f"result-{rank}.json").write_text(json.dumps(result))
    log.write(json.dumps({"event": "done", "time": time.time() - started}) + "\n")
    log.close()


class HeldUpload:
    """The site's real store, holding the `hold`-th share it writes for a few seconds once it has said so."""

    def __init__(self, store, out: Path, hold: int):
        self.store, self.url, self.out, self.hold, self.shares = store, store.url, out, hold, 0

    def put(self, key: str, data, create_only: bool = False) -> bool:
        if "/c/" in key and key.rsplit("/", 1)[-1].startswith("s"):
            self.shares += 1
            if self.shares == self.hold:
                (self.out / f"upload-{self.hold}").write_text(key)
                time.sleep(10)
        return self.store.put(key, data, create_only)

    def __getattr__(self, name):
        return getattr(self.store, name)


if __name__ == "__main__":
    main()
