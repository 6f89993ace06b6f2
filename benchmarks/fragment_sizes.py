"""Peak per-sync bytes of Streaming DiLoCo on real model shapes: each fragment's share of the model.

    python -m benchmarks.fragment_sizes --num_fragments 4 --patterns strided balanced

Builds each model on the meta device (no memory, no download: the shapes are written below from the published
configs), partitions it exactly as the engine does (`core/layout/fragments.py`: `strided` and `sequential` put every parameter
outside the block stack in fragment 0, `balanced` cuts those matrices into P row pieces) with each `--patterns` and
prints each fragment's share of the parameters. With one codec
for the whole model, a sync's bytes are proportional to its fragment's parameters (per-block scales and padding
scale with it), so `P x largest share` is the peak per-sync bytes in units of "1/P of the model's".
"""

from __future__ import annotations

import argparse
import math

import torch

from hf_diloco.core.settings.config import FRAGMENT_PATTERNS


def decoder(model_type: str, vocab: int, hidden: int, layers: int, heads: int, kv_heads: int, mlp: int, tied: bool):
    """Config fields of a Llama-style decoder (the fields that decide its parameter count)."""
    return dict(
        model_type=model_type,
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=mlp,
        tie_word_embeddings=tied,
    )


# From each model's published config.json.
SHAPES = {
    "bench model (benchmarks.comm)": decoder("llama", 4096, 128, 4, 4, 4, 384, tied=True),
    "bench --long model (benchmarks.quality)": decoder("llama", 1024, 64, 4, 4, 4, 128, tied=True),
    "GPT-2 (124M)": dict(model_type="gpt2", vocab_size=50257, n_embd=768, n_layer=12, n_head=12),
    "Qwen2-0.5B": decoder("qwen2", 151936, 896, 24, 14, 2, 4864, tied=True),
    "Llama-2-7B": decoder("llama", 32000, 4096, 32, 32, 32, 11008, tied=False),
    "Llama-3-8B": decoder("llama", 128256, 4096, 32, 32, 8, 14336, tied=False),
    "Llama-3-70B": decoder("llama", 128256, 8192, 80, 64, 8, 28672, tied=False),
}


def fragment_shares(fields: dict, num_fragments: int, pattern: str = "strided") -> tuple[int, list[float]]:
    """(parameter count, share of each fragment) of a randomly shaped model on the meta device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from hf_diloco.core.layout.fragments import find_block_stack, partition_fragments

    fields = dict(fields)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}  # tied weights are listed once
    fragments = partition_fragments(shapes, num_fragments, pattern, find_block_stack(model))
    total = sum(math.prod(shape) for shape in shapes.values())
    return total, [sum(math.prod(piece.shape(shapes[piece.name])) for piece in pieces) / total for pieces in fragments]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num_fragments", type=int, default=4)
    parser.add_argument(
        "--patterns", nargs="+", choices=list(FRAGMENT_PATTERNS), default=["strided"], help="fragment_pattern values"
    )
    args = parser.parse_args(argv)
    p = args.num_fragments
    print(f"| model | parameters | pattern | share per fragment (P = {p}) | peak sync / (model / P) |")
    print("|---|---|---|---|---|")
    for name, fields in SHAPES.items():
        for pattern in args.patterns:
            total, shares = fragment_shares(fields, p, pattern)
            listed = ", ".join(f"{share:.1%}" for share in shares)
            print(f"| {name} | {total / 1e6:,.2f} M | {pattern} | {listed} | {p * max(shares):.2f}x |")


if __name__ == "__main__":
    main()
