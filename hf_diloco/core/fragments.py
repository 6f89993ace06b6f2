"""Fragment partition and schedule (Streaming DiLoCo, Douillard et al. 2025, arXiv 2501.18512).

The repeated block stack (decoder layers) of L blocks is split into P fragments: `strided` puts block i in
fragment i mod P, `sequential` puts contiguous runs together. Parameters outside the stack (embeddings, final
norm, head) belong to fragment 0. `balanced` evens out the fragments' sizes, which `strided` leaves unequal when the
embeddings are large (fragment 0 holds them on top of its blocks): blocks are taken in index order and each goes to
the fragment with the fewest parameters so far (ties to the lowest index), fragment 0 starting with the parameters
outside the stack. With no such parameters and equal blocks that is `strided`. A model without a recognisable stack
is split by its parameter list, in order.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from torch import nn


def find_block_stack(model: nn.Module) -> str | None:
    """Qualified name of the largest container of identical blocks (e.g. `model.layers`, `transformer.h`)."""
    best_name, best_size = None, 0
    for name, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.ModuleDict)) or len(module) == 0:
            continue
        children = list(module.children())
        if len({type(child) for child in children}) != 1 or not all(
            key.isdigit() for key, _ in module.named_children()
        ):
            continue
        size = sum(p.numel() for p in module.parameters())
        if size > best_size:
            best_name, best_size = name, size
    return best_name


def block_index(param_name: str, block_prefix: str) -> int | None:
    match = re.match(re.escape(block_prefix) + r"\.(\d+)\.", param_name)
    return int(match.group(1)) if match else None


def partition_fragments(
    names: list[str],
    num_fragments: int,
    pattern: str = "strided",
    block_prefix: str | None = None,
    num_blocks: int | None = None,
    sizes: Mapping[str, int] | None = None,
) -> list[list[str]]:
    """Assign every parameter name to one of `num_fragments` fragments, keeping the order of `names`.

    `num_blocks` is the length of the whole stack; pass it when `names` hold only part of it (a pipeline stage).
    `sizes` (elements per name) is needed by the `balanced` pattern only.
    """
    if block_prefix is None or all(block_index(n, block_prefix) is None for n in names):
        return _split_in_order(names, num_fragments)
    indices = [block_index(n, block_prefix) for n in names]
    total = num_blocks if num_blocks is not None else max(i for i in indices if i is not None) + 1
    if total < num_fragments:
        raise ValueError(
            f"num_fragments ({num_fragments}) exceeds the number of blocks in '{block_prefix}' ({total}); "
            f"use num_fragments <= {total}."
        )
    balanced = _balanced_blocks(names, indices, num_fragments, sizes) if pattern == "balanced" else {}
    fragments: list[list[str]] = [[] for _ in range(num_fragments)]
    for name, index in zip(names, indices):
        if index is None:
            fragment = 0
        elif pattern == "balanced":
            fragment = balanced[index]
        elif pattern == "strided":
            fragment = index % num_fragments
        else:
            fragment = index * num_fragments // total
        fragments[fragment].append(name)
    return fragments


def _balanced_blocks(
    names: list[str], indices: list[int | None], num_fragments: int, sizes: Mapping[str, int] | None
) -> dict[int, int]:
    """Block index -> fragment: each block, in index order, to the fragment with the fewest elements so far."""
    if sizes is None:
        raise ValueError("fragment_pattern='balanced' needs the parameter sizes.")
    loads = [0] * num_fragments
    block_sizes: dict[int, int] = {}
    for name, index in zip(names, indices):
        if index is None:
            loads[0] += sizes[name]
        else:
            block_sizes[index] = block_sizes.get(index, 0) + sizes[name]
    assignment = {}
    for index in sorted(block_sizes):
        lightest = min(range(num_fragments), key=lambda fragment: (loads[fragment], fragment))
        assignment[index] = lightest
        loads[lightest] += block_sizes[index]
    return assignment


def _split_in_order(names: list[str], num_fragments: int) -> list[list[str]]:
    if len(names) < num_fragments:
        raise ValueError(
            f"num_fragments ({num_fragments}) exceeds the number of trainable parameters ({len(names)}) of a model "
            "without a recognisable block stack; lower num_fragments."
        )
    bounds = [len(names) * k // num_fragments for k in range(num_fragments + 1)]
    return [names[bounds[k] : bounds[k + 1]] for k in range(num_fragments)]


def launch_offset(fragment: int, inner_steps: int, num_fragments: int) -> int:
    """Fragment p is launched after step t when t % H == ((p + 1) * H // P) % H."""
    return ((fragment + 1) * inner_steps // num_fragments) % inner_steps


def fragments_launched_at(step: int, inner_steps: int, num_fragments: int) -> list[int]:
    return [p for p in range(num_fragments) if step % inner_steps == launch_offset(p, inner_steps, num_fragments)]
