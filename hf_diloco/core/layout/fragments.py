"""Fragment partition and schedule (Streaming DiLoCo, Douillard et al. 2025, arXiv 2501.18512).

The repeated block stack (decoder layers) of L blocks is split into P fragments: `strided` puts block i in
fragment i mod P, `sequential` puts contiguous runs together. Parameters outside the stack (embeddings, final
norm, head) belong to fragment 0. `balanced` evens out the fragments' sizes, which `strided` leaves unequal when the
embeddings are large (fragment 0 holds them on top of its blocks): every matrix outside the stack (embeddings, an
untied head) with at least P rows is cut by rows into P pieces, rows [k R / P, (k + 1) R / P) in fragment k; the other
parameters outside the stack stay in fragment 0; then the blocks, in index order, each go to the fragment with the
fewest elements so far (ties to the lowest index). Without parameters outside the stack and with equal blocks that is
`strided`. A model without a recognisable stack is split by its parameter list, in order.

A fragment is a list of `Piece`s: a parameter's rows [start, stop) (its first dimension; a 0-d parameter has one
row). Only `balanced` cuts parameters; every other piece is a whole parameter. The outer update is elementwise, so
a piece is synced exactly as a whole parameter would be.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import NamedTuple

import torch
from torch import nn


class Piece(NamedTuple):
    """Rows [start, stop) of parameter `name` (the whole parameter when they are all its rows)."""

    name: str
    start: int
    stop: int

    def shape(self, full_shape: Sequence[int]) -> tuple[int, ...]:
        return (self.stop - self.start, *full_shape[1:]) if len(full_shape) else ()


def num_rows(shape: Sequence[int]) -> int:
    return shape[0] if len(shape) else 1


def config_value(model: nn.Module, name: str):
    """`model.config.<name>` of a Hugging Face model, or of its text config (multimodal models); None without one."""
    config = getattr(model, "config", None)
    value = getattr(config, name, None)
    if value is None and hasattr(config, "get_text_config"):
        value = getattr(config.get_text_config(), name, None)
    return value


def layer_stacks(model: nn.Module, num_layers: int) -> list[str]:
    """Paths of the `nn.ModuleList`s of `num_layers` modules (whose classes may differ, as in hybrid models), the most
    parameters first."""
    sizes = {
        path: _numel(module)
        for path, module in model.named_modules()
        if isinstance(module, nn.ModuleList) and len(module) == num_layers
    }
    return sorted(sizes, key=lambda path: -sizes[path])


def find_block_stack(model: nn.Module, inputs: Mapping[str, torch.Tensor] | None = None) -> str | None:
    """Qualified name of the block stack (e.g. `model.layers`, `transformer.h`), the one finder of the engine's
    fragments, FSDP's units and the pipeline's cut:

    - the `nn.ModuleList` of `config.num_hidden_layers` blocks, of any classes (hybrid models such as Jamba mix
      attention and Mamba blocks in one stack), with the most parameters; with several such lists (a vision tower
      beside the text decoder) and `inputs`, the largest whose blocks the forward on `inputs` runs once each, in index
      order;
    - without one, the container with the most parameters among the `nn.ModuleDict`s keyed by block index (a pipeline
      stage holds its part of the stack so, and thus finds the same stack as the whole model: their fragments agree)
      and the `nn.ModuleList`s of blocks of one class (a model without a Hugging Face config).

    None without any.
    """
    num_layers = config_value(model, "num_hidden_layers")
    stacks = layer_stacks(model, num_layers) if isinstance(num_layers, int) and num_layers > 0 else []
    if len(stacks) > 1 and inputs is not None:
        return _stack_that_runs(model, stacks, inputs)
    return stacks[0] if stacks else _largest_indexed_container(model)


def _largest_indexed_container(model: nn.Module) -> str | None:
    best_name, best_size = None, 0
    for name, module in model.named_modules():
        indexed = isinstance(module, nn.ModuleDict) and len(module) and all(key.isdigit() for key in module.keys())
        one_class = isinstance(module, nn.ModuleList) and len(module) and len({type(child) for child in module}) == 1
        if (indexed or one_class) and _numel(module) > best_size:
            best_name, best_size = name, _numel(module)
    return best_name


def _stack_that_runs(model: nn.Module, stacks: list[str], inputs: Mapping[str, torch.Tensor]) -> str:
    """The first of `stacks` whose blocks one forward on `inputs` runs once each, in index order (else the first)."""
    orders: dict[str, list[int]] = {path: [] for path in stacks}
    handles = [
        block.register_forward_pre_hook(lambda module, args, path=path, index=index: orders[path].append(index))
        for path in stacks
        for index, block in enumerate(model.get_submodule(path))
    ]
    try:
        with eval_mode(model):
            model(**inputs, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    ran = [path for path in stacks if orders[path] == list(range(len(model.get_submodule(path))))]
    return ran[0] if ran else stacks[0]


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """Eval mode without gradients; every module gets its own mode back."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for module, training in modes:
            module.training = training


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def block_index(param_name: str, block_prefix: str) -> int | None:
    match = re.match(re.escape(block_prefix) + r"\.(\d+)\.", param_name)
    return int(match.group(1)) if match else None


def partition_fragments(
    shapes: Mapping[str, Sequence[int]],
    num_fragments: int,
    pattern: str = "strided",
    block_prefix: str | None = None,
    num_blocks: int | None = None,
) -> list[list[Piece]]:
    """Assign every parameter (or, with `balanced`, its row pieces) to one of `num_fragments` fragments.

    `shapes` maps each parameter name to its shape, in model order; each fragment keeps that order. `num_blocks` is
    the length of the whole stack; pass it when `shapes` hold only part of it (a pipeline stage).
    """
    names = list(shapes)
    whole = {name: Piece(name, 0, num_rows(shape)) for name, shape in shapes.items()}
    if block_prefix is None or all(block_index(n, block_prefix) is None for n in names):
        return [[whole[n] for n in part] for part in _split_in_order(names, num_fragments)]
    indices = [block_index(n, block_prefix) for n in names]
    total = num_blocks if num_blocks is not None else max(i for i in indices if i is not None) + 1
    if total < num_fragments:
        raise ValueError(
            f"num_fragments ({num_fragments}) exceeds the number of blocks in '{block_prefix}' ({total}); "
            f"use num_fragments <= {total}."
        )
    if pattern == "balanced":
        return _balanced(shapes, indices, num_fragments, whole)
    fragments: list[list[Piece]] = [[] for _ in range(num_fragments)]
    for name, index in zip(names, indices):
        if index is None:
            fragment = 0
        elif pattern == "strided":
            fragment = index % num_fragments
        else:
            fragment = index * num_fragments // total
        fragments[fragment].append(whole[name])
    return fragments


def _balanced(
    shapes: Mapping[str, Sequence[int]], indices: list[int | None], num_fragments: int, whole: Mapping[str, Piece]
) -> list[list[Piece]]:
    """Matrices outside the stack cut into P row pieces, then each block to the fragment with the fewest elements."""
    placed: dict[str, list[tuple[int, Piece]]] = {}  # (fragment, piece) of every parameter outside the stack
    loads = [0] * num_fragments
    block_sizes: dict[int, int] = {}
    for name, index in zip(shapes, indices):
        if index is not None:
            block_sizes[index] = block_sizes.get(index, 0) + math.prod(shapes[name])
            continue
        pieces = _row_pieces(name, shapes[name], num_fragments)
        placed[name] = list(enumerate(pieces)) if pieces else [(0, whole[name])]
        for fragment, piece in placed[name]:
            loads[fragment] += math.prod(piece.shape(shapes[name]))
    owner = {}
    for index in sorted(block_sizes):
        lightest = min(range(num_fragments), key=lambda fragment: (loads[fragment], fragment))
        owner[index] = lightest
        loads[lightest] += block_sizes[index]
    fragments: list[list[Piece]] = [[] for _ in range(num_fragments)]
    for name, index in zip(shapes, indices):
        for fragment, piece in placed[name] if index is None else [(owner[index], whole[name])]:
            fragments[fragment].append(piece)
    return fragments


def _row_pieces(name: str, shape: Sequence[int], num_fragments: int) -> list[Piece] | None:
    """P row ranges of a matrix with at least P rows; None for anything else (kept whole)."""
    rows = num_rows(shape)
    if len(shape) < 2 or rows < num_fragments:
        return None
    return [Piece(name, k * rows // num_fragments, (k + 1) * rows // num_fragments) for k in range(num_fragments)]


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


def steps_since_launch(fragment: int, step: int, inner_steps: int, num_fragments: int) -> int:
    """Inner steps fragment p trained after its last launch (all `step` of them before its first launch): the tail
    `close()` still has to sync."""
    offset = launch_offset(fragment, inner_steps, num_fragments)
    first_launch = offset or inner_steps
    return step if step < first_launch else (step - offset) % inner_steps
