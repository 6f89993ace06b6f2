"""Peak per-sync bytes of Streaming DiLoCo on real model shapes: each fragment's share of the model.

    python scripts/bench_fragment_sizes.py --num_fragments 4

Builds each model on the meta device (no memory, no download: the shapes are written below from the published
configs), partitions it exactly as the engine does (`core/fragments.py`: blocks strided over P fragments, every
parameter outside the block stack in fragment 0) and prints each fragment's share of the parameters. With one codec
for the whole model, a sync's bytes are proportional to its fragment's parameters (per-block scales and padding
scale with it), so `P x largest share` is the peak per-sync bytes in units of "1/P of the model's".
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# model_type and the fields that decide the parameter count, from each model's published config.json.
SHAPES = {
    "bench model (scripts/bench_comm.py)": dict(
        model_type="llama",
        vocab_size=4096,
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=384,
        tie_word_embeddings=True,
    ),
    "bench --long model (scripts/bench_quality.py)": dict(
        model_type="llama",
        vocab_size=1024,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=128,
        tie_word_embeddings=True,
    ),
    "GPT-2 (124M)": dict(model_type="gpt2", vocab_size=50257, n_embd=768, n_layer=12, n_head=12),
    "Qwen2-0.5B": dict(
        model_type="qwen2",
        vocab_size=151936,
        hidden_size=896,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=4864,
        tie_word_embeddings=True,
    ),
    "Llama-2-7B": dict(
        model_type="llama",
        vocab_size=32000,
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        intermediate_size=11008,
        tie_word_embeddings=False,
    ),
    "Llama-3-70B": dict(
        model_type="llama",
        vocab_size=128256,
        hidden_size=8192,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        intermediate_size=28672,
        tie_word_embeddings=False,
    ),
}


def fragment_shares(fields: dict, num_fragments: int, pattern: str = "strided") -> tuple[int, list[float]]:
    """(parameter count, share of each fragment) of a randomly shaped model on the meta device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from hf_diloco.core.fragments import find_block_stack, partition_fragments

    fields = dict(fields)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    sizes = {name: p.numel() for name, p in model.named_parameters()}  # tied weights are listed once
    fragments = partition_fragments(list(sizes), num_fragments, pattern, find_block_stack(model))
    total = sum(sizes.values())
    return total, [sum(sizes[name] for name in fragment) / total for fragment in fragments]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num_fragments", type=int, default=4)
    parser.add_argument("--pattern", choices=["strided", "sequential"], default="strided")
    args = parser.parse_args(argv)
    p = args.num_fragments
    print(f"| model | parameters | share per fragment (P = {p}) | peak sync / (model / P) |")
    print("|---|---|---|---|")
    for name, fields in SHAPES.items():
        total, shares = fragment_shares(fields, p, args.pattern)
        listed = ", ".join(f"{share:.1%}" for share in shares)
        print(f"| {name} | {total / 1e6:,.2f} M | {listed} | {p * max(shares):.2f}x |")


if __name__ == "__main__":
    main()
