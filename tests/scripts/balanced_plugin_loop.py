"""A raw Accelerate loop under `round_policy: balanced`, one worker slowed 2x; ends at a round (tests/test_round_policy.py).

    torchrun --nproc_per_node 2 tests/scripts/balanced_plugin_loop.py OUT ROUNDS [--save_at_round K] [--resume DIR]

Every worker runs its own loop, its steps paced to a fixed length (`tests.engine_common.pace`), the slowed one's twice
as long. The loop ends at
`plugin.outer_rounds == ROUNDS` (each worker a different number of inner steps) and writes OUT/rank{r}.pt.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader

from examples.accelerate_loop import build_model, random_token_rows
from hf_diloco import DiLoCoPlugin
from tests.engine_common import pace


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("rounds", type=int)
    parser.add_argument("--save_at_round", type=int, default=None)
    parser.add_argument("--resume", default=None)
    args = parser.parse_args()
    accelerator = Accelerator(cpu=True)
    plugin = DiLoCoPlugin(inner_steps=8, round_policy="balanced", outer_lr=1.0, outer_momentum=0.0)
    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = DataLoader(random_token_rows(512), batch_size=4)
    model, optimizer, loader = plugin.prepare(accelerator, model, optimizer, loader)
    if args.resume:
        accelerator.load_state(args.resume)
    slowed = accelerator.process_index == 1
    steps_per_round: list[int] = []  # this worker's steps in each round this process completed
    waits: list[float] = []  # the engine's share of each such round's wall time
    completed = plugin.outer_rounds
    while plugin.outer_rounds < args.rounds:
        for batch in accelerator.skip_first_batches(loader, plugin.inner_step % len(loader)):
            began = time.perf_counter()
            accelerator.backward(model(**batch).loss)
            pace(began, slowed)  # the step's compute takes its paced time; the DiLoCo step (and sync) comes after
            optimizer.step()  # also the DiLoCo step
            optimizer.zero_grad()
            if plugin.outer_rounds > completed:
                completed = plugin.outer_rounds
                steps_per_round.append(int(plugin.metrics()["diloco/round_steps"]))
                waits.append(float(plugin.metrics()["diloco/wait_fraction"]))
                if completed == args.save_at_round:  # a round's end: the same point on every worker
                    accelerator.save_state(Path(args.out) / f"round-{completed}")
            if completed == args.rounds:
                break
    plugin.close()
    result = {
        "inner_step": plugin.inner_step,
        "outer_rounds": plugin.outer_rounds,
        "steps_per_round": steps_per_round,
        "wait_fractions": waits,
        "global": {name: value.clone() for name, value in plugin.global_parameters().items()},
    }
    Path(args.out).mkdir(parents=True, exist_ok=True)
    torch.save(result, Path(args.out) / f"rank{accelerator.process_index}.pt")


if __name__ == "__main__":
    main()
