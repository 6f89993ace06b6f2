"""Run examples/accelerate_loop.py's `train` twice under torchrun (uninterrupted, then resumed from its mid-round
`accelerator.save_state`) and dump each rank's theta_g, local parameters and DiLoCo stats for tests/test_plugin.py."""

import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "examples"))

from accelerate_loop import parse_args, train  # noqa: E402


def snapshot(plugin) -> dict:
    return {
        "global": {k: v.clone() for k, v in plugin.global_parameters().items()},
        "local": {k: v.detach().clone() for k, v in plugin.engine.model.named_parameters()},
        "stats": dict(plugin.engine.stats),
        "inner_step": plugin.inner_step,
    }


def main() -> None:
    out, save_at, *common = sys.argv[1:]
    full = train(parse_args([*common, "--output_dir", f"{out}/full", "--save_state_at", save_at]))
    resumed = train(
        parse_args([*common, "--output_dir", f"{out}/resumed", "--resume_from", f"{out}/full/state-{save_at}"])
    )
    rank = full._accelerator.process_index
    torch.save({"full": snapshot(full), "resumed": snapshot(resumed)}, Path(out) / f"rank{rank}.pt")
    full._accelerator.end_training()


if __name__ == "__main__":
    main()
