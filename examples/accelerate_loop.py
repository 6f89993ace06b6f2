"""A raw Accelerate training loop with DiLoCo: the only additions to an ordinary loop are the three `plugin` lines.

Every process is one DiLoCo worker by default; the DiLoCo settings come from `DILOCO_*` environment variables (or
`--diloco_config file.yaml`), so the launcher configures them:

    DILOCO_INNER_STEPS=10 torchrun --nproc_per_node 2 examples/accelerate_loop.py --use_cpu
    DILOCO_INNER_STEPS=10 accelerate launch --multi_gpu --num_processes 2 examples/accelerate_loop.py --use_cpu

(`accelerate launch --cpu --num_processes 2` starts a single process, which the plugin refuses.) The model is a tiny
random Llama and the data random token ids, so it runs anywhere without downloads; replace both with yours. Needs
hf_diloco installed (`make setup` installs the checkout).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader
from transformers import LlamaConfig, LlamaForCausalLM

from hf_diloco import DiLoCoPlugin, write_model_card

VOCAB, SEQ = 128, 16


def build_model(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
    )
    return LlamaForCausalLM(config)


def random_token_rows(num_rows: int, seed: int = 1234) -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(0, VOCAB, (num_rows, SEQ), generator=torch.Generator().manual_seed(seed))
    return [{"input_ids": row, "labels": row} for row in ids]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", default="outputs/accelerate_loop")
    parser.add_argument("--max_steps", type=int, default=40, help="Inner optimizer steps per process.")
    parser.add_argument("--batch_size", type=int, default=4, help="Per process and micro-batch.")
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
    parser.add_argument("--learning_rate", type=float, default=3e-3)
    parser.add_argument("--num_rows", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--diloco_config", default=None, help="YAML of DiLoCo fields (below DILOCO_* in precedence).")
    parser.add_argument("--save_state_at", type=int, default=None, help="accelerator.save_state after this step.")
    parser.add_argument("--resume_from", default=None, help="A folder written by accelerator.save_state.")
    parser.add_argument("--use_cpu", action="store_true")
    return parser.parse_args(argv)


def train(args: argparse.Namespace) -> DiLoCoPlugin:
    """Train and save the global model to `output_dir/final`; returns the (closed) plugin."""
    accelerator = Accelerator(cpu=args.use_cpu, gradient_accumulation_steps=args.gradient_accumulation_steps)
    plugin = DiLoCoPlugin(yaml_file=args.diloco_config)
    model = build_model(args.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate)
    # Unshuffled, so tests/test_plugin.py can replay which rows each worker reads; shuffle=True works as well (the
    # plugin shuffles every worker's loader alike, without a collective at each epoch).
    loader = DataLoader(random_token_rows(args.num_rows), batch_size=args.batch_size)
    model, optimizer, loader = plugin.prepare(accelerator, model, optimizer, loader, max_steps=args.max_steps)

    if args.resume_from:
        accelerator.load_state(args.resume_from)  # restores this rank's DiLoCo state too
    step = plugin.inner_step
    model.train()
    while step < args.max_steps and not plugin.job_finished:
        skip = step * args.gradient_accumulation_steps % len(loader)
        for batch in accelerator.skip_first_batches(loader, skip) if skip else loader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                optimizer.step()  # also the DiLoCo step, after each real inner step
                optimizer.zero_grad()
            if not accelerator.sync_gradients:
                continue
            # The plugin's count, not `step += 1`: under elastic membership a site that heals from a live one takes
            # over the job's step, and the loop ends with the others.
            step = plugin.inner_step
            if step % 10 == 0 or step == args.max_steps:
                # Local values only: logging must not become a collective across workers.
                print(f"[rank {accelerator.process_index}] step {step} loss {loss.item():.4f} {plugin.metrics()}")
            if step == args.save_state_at:
                accelerator.save_state(Path(args.output_dir) / f"state-{step}")
            if step >= args.max_steps or plugin.job_finished:  # sites through a store end with the job's end
                break

    plugin.close()  # the model now holds the global parameters theta_g, identical on every rank
    if accelerator.is_main_process:
        save_global_model(accelerator, model, plugin, Path(args.output_dir) / "final")
    return plugin


def save_global_model(accelerator: Accelerator, model: torch.nn.Module, plugin: DiLoCoPlugin, folder: Path) -> None:
    accelerator.unwrap_model(model).save_pretrained(folder)
    stats = plugin.engine.stats
    exchanged = sum(p.numel() for p in plugin.global_parameters().values())
    workers = accelerator.num_processes // plugin.data_parallel_per_worker
    write_model_card(
        folder,
        settings={**plugin.diloco_dict(), "num_workers": workers},
        communication={
            "bytes_sent": stats["bytes_sent"],
            "steps": plugin.inner_step,
            "num_parameters": exchanged,
            "outer_steps": stats["outer_steps"],
            "sync_wait_seconds": stats["sync_wait_seconds"],
        },
        data_description="Random token ids (an example run).",
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    train(args)
    Accelerator().end_training()


if __name__ == "__main__":
    main()
