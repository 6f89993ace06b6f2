"""One elastic site of examples/accelerate_loop.py, unchanged, paced by `--pace` seconds per forward pass so a test can
lose it mid-run: its DiLoCo settings (the Lighthouse, the site's name, H) come from `DILOCO_*` variables, as a user's
launcher sets them. After the run it saves the global model (the example's `final/`) and the plugin's membership
stats to `--output_dir/stats.pt`. Run with the repository root on PYTHONPATH, as tests/test_elastic_plugin.py does."""

import argparse
import time
from pathlib import Path

import torch

import examples.accelerate_loop as loop

pacing = argparse.ArgumentParser(add_help=False)
pacing.add_argument("--pace", type=float, default=0.0)
PACE, argv = pacing.parse_known_args()
PACE = PACE.pace
unpaced = loop.build_model


def paced_model(seed: int = 0):
    model = unpaced(seed)
    model.register_forward_pre_hook(lambda module, args: time.sleep(PACE))
    return model


loop.build_model = paced_model
args = loop.parse_args(argv)
plugin = loop.train(args)
torch.save({"stats": dict(plugin.engine.stats), "inner_step": plugin.inner_step}, Path(args.output_dir) / "stats.pt")
