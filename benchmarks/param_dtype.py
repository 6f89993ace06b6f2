"""bf16 parameters against fp32 parameters under bf16 autocast: the eval loss of DiLoCo with each, side by side.

    python -m benchmarks.param_dtype --seeds 0 1 2 --steps 200

M gloo workers train the same small Llama (`benchmarks.common`'s data and model flags) with DiLoCo, in three
settings: `fp32_autocast` (fp32 parameters and θm, forward and backward under CPU bf16 autocast), `bf16` (bf16
parameters; the pseudo-gradient measured from θg rounded to bf16, where θm started) and `bf16_fp32_start` (bf16
parameters, the pseudo-gradient measured from fp32 θg as before: it carries θg - bf16(θg), the same on every worker).
Each method's eval loss is that of θg after close(), evaluated in fp32.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks.common import (
    RESULTS_DIR,
    ShardBatches,
    add_run_arguments,
    command_line,
    evaluate,
    prepare_data,
    run_on_workers,
    with_defaults,
    write_results,
)

SETTINGS = ("fp32_autocast", "bf16", "bf16_fp32_start")
DEFAULTS = {
    "--steps": "200",
    "--lr": "3e-4",
    "--warmup": "20",
    "--batch_size": "8",
    "--block_size": "64",
    "--model": json.dumps({"hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128}),
    "--vocab_size": "1024",
}


def _train(rank: int, world: int, setting: str, seed: int, args: argparse.Namespace, folder: str) -> dict:
    from hf_diloco import DiLoCo, DiLoCoConfig
    from hf_diloco.core.layout import shard
    from hf_diloco.job.modeling import DEFAULT_MODEL_CONFIG, build_model

    if setting == "bf16_fp32_start":  # the earlier measurement: no stretch counts as narrower, θg is not rounded
        shard.narrower_float = lambda dtype: False
    data = torch.load(Path(folder) / "data.pt")
    spec = {"config": {**DEFAULT_MODEL_CONFIG, **json.loads(args.model)}}
    model = build_model(spec, data["vocab"], *data["ids"], seed=seed)
    if setting != "fp32_autocast":
        model = model.to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / args.warmup))
    engine = DiLoCo(model, optimizer, DiLoCoConfig(inner_steps=args.inner_steps))
    batches = ShardBatches(data["train"], seed, rank, world, args.batch_size)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if setting == "fp32_autocast" else contextlib.nullcontext()
    norms = []
    for step in range(1, args.steps + 1):
        ids = batches(step - 1)
        with autocast:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        engine.step()
        if step % args.inner_steps == 0:
            norms.append(engine.stats.pseudo_grad_norm)
    engine.close()
    with engine.global_weights():
        model.float()
        eval_loss = evaluate(model, data["eval"])
    return {"setting": setting, "seed": seed, "eval_loss": eval_loss, "pseudo_grad_norms": norms}


def main(argv: list[str] | None = None) -> None:
    parser = add_run_arguments(argparse.ArgumentParser(description=__doc__))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--inner_steps", type=int, default=25)
    parser.add_argument("--out", default=f"{RESULTS_DIR}/param_dtype")
    argv = with_defaults(list(sys.argv[1:] if argv is None else argv), DEFAULTS)
    args = parser.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory() as scratch:
        for seed in args.seeds:
            folder = str(Path(scratch) / f"seed{seed}")  # the seed's held-out files, tokenizer and blocks
            Path(folder).mkdir()
            prepare_data(Path(folder), args.block_size, args.train_files, args.vocab_size, seed)
            for setting in SETTINGS:
                runs = run_on_workers(_train, args.workers, setting, seed, args, folder, timeout_seconds=900)
                results.append(runs[0])
                print(setting, seed, runs[0]["eval_loss"], flush=True)
    table = _table(results, args.seeds)
    write_results(args.out, {"command": command_line("param_dtype", argv), "results": results}, table)


def _table(results: list[dict], seeds: list[int]) -> str:
    loss = {(r["setting"], r["seed"]): r["eval_loss"] for r in results}
    lines = ["| setting | " + " | ".join(f"seed {s}" for s in seeds) + " | mean | gap to fp32_autocast |"]
    lines.append("|---" * (len(seeds) + 3) + "|")
    base = statistics.mean(loss[("fp32_autocast", s)] for s in seeds)
    for setting in SETTINGS:
        values = [loss[(setting, s)] for s in seeds]
        mean = statistics.mean(values)
        cells = " | ".join(f"{v:.4f}" for v in values)
        lines.append(f"| {setting} | {cells} | {mean:.4f} | {mean / base - 1:+.2%} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
