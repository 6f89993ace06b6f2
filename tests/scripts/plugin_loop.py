"""Run examples/accelerate_loop.py's `train` twice under torchrun (uninterrupted, then resumed from its mid-round
`accelerator.save_state`) and dump each rank's theta_g, local parameters and DiLoCo stats for tests/test_plugin.py.
Run with the repository root on PYTHONPATH (for `examples.accelerate_loop`), as tests/test_plugin.py does."""

import sys
from pathlib import Path

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from torch.utils.data import DataLoader

from examples.accelerate_loop import build_model, parse_args, random_token_rows, train
from hf_diloco import DiLoCoPlugin


def snapshot(plugin) -> dict:
    return {
        "global": {k: v.clone() for k, v in plugin.global_parameters().items()},
        "local": {k: v.detach().clone() for k, v in plugin.engine.model.named_parameters()},
        "stats": dict(plugin.engine.stats),
        "inner_step": plugin.inner_step,
    }


def prepare_shuffled(dataloader_config: DataLoaderConfiguration) -> str | None:
    """The error `DiLoCoPlugin.prepare` raises for a shuffled loader under this config, or None; the prepared loader
    must also shuffle without synchronizing a random state across processes."""
    model = build_model(0)
    loader = DataLoader(random_token_rows(8), batch_size=2, shuffle=True)
    accelerator = Accelerator(cpu=True, dataloader_config=dataloader_config)
    configured = dataloader_config.use_seedable_sampler
    # Every broadcast prepare makes (the shuffling seed) must run on a gloo group of ours, never the default group
    # (on GPUs an NCCL communicator across the workers).
    groups, broadcast = [], torch.distributed.broadcast

    def recorded(tensor, src=None, group=None, **kwargs):
        groups.append(group)
        return broadcast(tensor, src, group=group, **kwargs)

    torch.distributed.broadcast = recorded
    try:
        plugin = DiLoCoPlugin(environ={})
        _, _, prepared = plugin.prepare(accelerator, model, torch.optim.SGD(model.parameters(), lr=0.1), loader)
    except ValueError as error:
        return str(error)
    finally:
        torch.distributed.broadcast = broadcast
    if any(group is None or group is torch.distributed.group.WORLD for group in groups):
        return "prepare broadcast on the default group"
    if not configured and not groups:
        return "the shuffling seed was not broadcast"
    if prepared.rng_types:
        return f"the prepared loader synchronizes {prepared.rng_types} at every epoch"
    if accelerator.dataloader_config.use_seedable_sampler != configured:
        return "prepare changed the accelerator's dataloader configuration"
    return None


def main() -> None:
    out, save_at, *common = sys.argv[1:]
    full = train(parse_args([*common, "--output_dir", f"{out}/full", "--save_state_at", save_at]))
    resumed = train(
        parse_args([*common, "--output_dir", f"{out}/resumed", "--resume_from", f"{out}/full/state-{save_at}"])
    )
    rank = full._accelerator.process_index
    results = {"full": snapshot(full), "resumed": snapshot(resumed)}
    results["shuffled_default"] = prepare_shuffled(DataLoaderConfiguration())
    results["shuffled_seedable"] = prepare_shuffled(DataLoaderConfiguration(use_seedable_sampler=True))
    torch.save(results, Path(out) / f"rank{rank}.pt")
    full._accelerator.end_training()


if __name__ == "__main__":
    main()
