"""One elastic worker for tests/test_elastic.py: a tiny Llama trained with SGD under `TorchftMembership`.

    PYTHONPATH=. python tests/scripts/elastic_worker.py --lighthouse http://host:port --slot 0 --out DIR [...]

The worker's data is its slot's batches (`tests.engine_common.batch_for(slot, step)`), at the global inner step: a
worker that joins continues its slot where the job is. With `--stall_at STEP` the exchange launched at that inner
step first sleeps `--stall_seconds` (after writing `stalling` to its event log), so that the test can kill or stop
the worker while the others are inside that exchange; with `--wait_at STEP --wait_file F` it waits before that
inner step until F exists (the test restarts a worker meanwhile). With `--rounds R` it runs until R outer rounds are
done instead of `--steps`; with `--paced_seconds S` every inner step lasts S seconds (2 S with `--slowed`) whatever
the machine's load. With `--checkpoint_every N` it saves `engine.state_dict()` to DIR/checkpoint_<replica>.pt
every N inner steps, and with `--resume` it loads that file (when there) after joining. The event log (DIR/events_<replica>.jsonl) gets a line per
inner step and per exchange; DIR/final_<replica>.pt holds θg and the membership summary at the end. A worker whose
last exchanges ran alone in a job of several (its model is not the job's) says so and exits with status 3.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

import torch


def digest(tensors: list[torch.Tensor]) -> str:
    hasher = hashlib.sha256()
    for tensor in tensors:
        hasher.update(tensor.detach().contiguous().numpy().tobytes())
    return hasher.hexdigest()[:16]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lighthouse", required=True)
    parser.add_argument("--slot", type=int, required=True)
    parser.add_argument("--replica_id", default=None)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--inner_steps", type=int, default=4)
    parser.add_argument("--fragments", type=int, default=1)
    parser.add_argument("--compression", default="none")
    parser.add_argument("--overlap", default="streaming")
    parser.add_argument("--sync_delay", type=int, default=0)
    parser.add_argument("--merge_alpha", type=float, default=0.5)
    parser.add_argument("--error_feedback", action="store_true")
    parser.add_argument("--robust_clip_factor", type=float, default=None)  # None: the library's default
    parser.add_argument("--min_workers", type=int, default=1)
    parser.add_argument("--start_workers", type=int, default=1)
    parser.add_argument("--min_workers_timeout", type=float, default=60.0)
    parser.add_argument("--sync_timeout", type=float, default=10.0)
    parser.add_argument("--stall_at", type=int, default=0)
    parser.add_argument("--stall_seconds", type=float, default=0.0)
    parser.add_argument("--step_seconds", type=float, default=0.0)
    parser.add_argument("--round_policy", default="steps")
    parser.add_argument("--rounds", type=int, default=0)
    parser.add_argument("--paced_seconds", type=float, default=0.0)
    parser.add_argument("--slowed", action="store_true")
    parser.add_argument("--wait_at", type=int, default=0)
    parser.add_argument("--wait_file", default=None)
    parser.add_argument("--checkpoint_every", type=int, default=0)
    parser.add_argument("--resume", action="store_true")
    cli = parser.parse_args()
    replica = cli.replica_id or f"worker{cli.slot}"
    out = Path(cli.out)
    events = (out / f"events_{replica}.jsonl").open("a")

    def event(**fields: object) -> None:
        events.write(json.dumps({"time": time.time(), **fields}) + "\n")
        events.flush()

    from hf_diloco import DiLoCo, DiLoCoConfig
    from hf_diloco.backends.torchft_membership import TorchftMembership
    from tests.engine_common import inner_step, tiny_model

    model = tiny_model(seed=cli.slot)  # different on purpose: the first group makes every worker start alike
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    config = DiLoCoConfig(
        inner_steps=cli.inner_steps,
        num_fragments=cli.fragments,
        compression=cli.compression,
        overlap=cli.overlap,
        sync_delay=cli.sync_delay,
        merge_alpha=cli.merge_alpha,
        error_feedback=cli.error_feedback,
        **({} if cli.robust_clip_factor is None else {"robust_clip_factor": cli.robust_clip_factor}),
        compression_block_size=32,
        sync_timeout_seconds=cli.sync_timeout,
        round_policy=cli.round_policy,
    )
    membership = TorchftMembership(
        cli.lighthouse,
        replica,
        min_workers=cli.min_workers,
        start_workers=cli.start_workers,
        min_workers_timeout=cli.min_workers_timeout,
        sync_timeout=cli.sync_timeout,
        quorum_timeout=60.0,
        connect_timeout=20.0,
        poll_seconds=0.5,
    )
    bind = membership.bind

    def bind_and_say(*args: object, **kwargs: object) -> None:
        # From here on the Manager heartbeats to the Lighthouse, which then waits for this worker before it forms
        # the next quorum: a test that releases the others after this event knows they will find this worker.
        bind(*args, **kwargs)
        event(kind="bound", step=0)

    membership.bind = bind_and_say
    started = time.time()
    event(kind="starting", step=0)
    engine = DiLoCo(model, optimizer, config, membership=membership)
    globals_now = lambda: [f.theta_g for f in engine.fragments]  # noqa: E731
    event(kind="joined", step=engine.inner_step, theta_g=digest(globals_now()), seconds=time.time() - started,
          stats=dict(engine.stats))  # fmt: skip
    checkpoint = out / f"checkpoint_{replica}.pt"
    if cli.resume and checkpoint.exists():
        engine.load_state_dict(torch.load(checkpoint, weights_only=True))
        event(kind="resumed", step=engine.inner_step, theta_g=digest(globals_now()))

    stalled = []

    def stall() -> float:
        if cli.stall_at and engine.inner_step == cli.stall_at and not stalled:
            stalled.append(True)
            event(kind="stalling", step=engine.inner_step)
            return cli.stall_seconds
        return 0.0

    engine.exchange.delay_seconds = stall
    exchanges = 0

    def running() -> bool:
        return engine.outer_rounds < cli.rounds if cli.rounds else engine.inner_step < cli.steps

    while running():
        if cli.wait_at and engine.inner_step == cli.wait_at:  # until the test has restarted a worker, at most 120 s
            deadline = time.monotonic() + 120
            while not Path(cli.wait_file).exists() and time.monotonic() < deadline:
                time.sleep(0.1)
        began = time.perf_counter()
        inner_step(model, optimizer, cli.slot, engine.inner_step)
        time.sleep(cli.step_seconds)
        paced = cli.paced_seconds * (2 if cli.slowed else 1)
        time.sleep(max(0.0, paced - (time.perf_counter() - began)))
        rounds = engine.outer_rounds
        engine.step()
        event(kind="step", step=engine.inner_step)
        if cli.checkpoint_every and engine.inner_step % cli.checkpoint_every == 0:
            torch.save(engine.state_dict(), checkpoint.with_suffix(".tmp"))
            checkpoint.with_suffix(".tmp").replace(checkpoint)  # a kill never leaves half a checkpoint
            event(kind="saved", step=engine.inner_step, theta_g=digest(globals_now()))
        if engine.outer_rounds > rounds:
            metrics = engine.metrics()
            event(kind="round", step=engine.inner_step, rounds=engine.outer_rounds,
                  round_steps=metrics.get("diloco/round_steps"), wait_fraction=metrics.get("diloco/wait_fraction"))  # fmt: skip
        while exchanges < len(engine.elastic.log.rounds):
            entry = engine.elastic.log.rounds[exchanges]
            event(kind="exchange", theta_g=digest(globals_now()), **entry)
            exchanges += 1
    engine.close()
    summary = engine.elastic.log.summary()
    event(kind="closed", step=engine.inner_step, theta_g=digest(globals_now()), summary=summary)
    torch.save(
        {"global": engine.global_parameters(), "summary": summary, "rounds": engine.elastic.log.rounds,
         "metrics": engine.metrics()},
        out / f"final_{replica}.pt",
    )  # fmt: skip
    apart = engine.elastic.log.apart()
    if apart is not None:  # what a loop of its own does with a site that ended alone: say so and fail
        from hf_diloco.integrations.run_summary import trained_apart

        print(f"{trained_apart(replica, apart)}.", flush=True)
        sys.exit(3)


if __name__ == "__main__":
    main()
