"""Where each part of a causal LM runs once cut into stages: the block stack, the probe forward, the plan."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

from ...core.layout.fragments import config_value, eval_mode, find_block_stack, layer_stacks

IGNORE_INDEX = -100
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
BEFORE, BETWEEN, AFTER = "before the blocks", "between blocks", "after the blocks"


class PipelineMismatchError(ValueError):
    """The chained pipeline stages do not reproduce the unsplit model (raised at start-up, before any training)."""


class _StageBoundary(Exception):
    """Stops the model's forward after the last block of a stage, carrying that block's hidden state."""

    def __init__(self, hidden: torch.Tensor):
        super().__init__("pipeline stage boundary")
        self.hidden = hidden


@dataclass(frozen=True)
class PipelinePlan:
    """Where each part of a causal LM runs once it is cut into pipeline stages (see the module docstring).

    Attributes:
        model_name: class name of the model (for messages).
        num_stages: number of stages.
        blocks: path of the block stack (as in `model.get_submodule`), e.g. `model.layers` or `transformer.h`.
        num_layers: number of blocks.
        ranges: the block indices of each stage.
        outer_stages: path of every module outside the block stack that holds parameters or persistent buffers -> the
            stages that hold it.
        before_blocks: paths of the modules with parameters that the forward calls before the blocks; a stage that
            does not hold one lets it return zeros.
        block_outputs: per block, `None` when it returns a tensor, else the length of the tuple it returns (the hidden
            state first).
        direct_parameters: names of parameters set directly on the modules that contain the block stack (not in a
            child module); the first and the last stage both hold them.
        direct_buffers: names of persistent buffers set directly on those modules; the first stage saves them.
        tied: `(name on the first stage, name on the last stage)` of every parameter that both hold.
    """

    model_name: str
    num_stages: int
    blocks: str
    num_layers: int
    ranges: tuple[range, ...]
    outer_stages: Mapping[str, tuple[int, ...]]
    before_blocks: tuple[str, ...]
    block_outputs: tuple[int | None, ...]
    direct_parameters: tuple[str, ...]
    direct_buffers: tuple[str, ...]
    tied: tuple[tuple[str, str], ...]

    def stage_paths(self, stage: int) -> list[str]:
        """Paths of the modules that `stage` holds: outer modules and its blocks (`<blocks>.<index>`)."""
        outer = [path for path, stages in self.outer_stages.items() if stage in stages]
        return outer + [f"{self.blocks}.{index}" for index in self.ranges[stage]]

    def stage_direct_parameters(self, stage: int) -> tuple[str, ...]:
        return self.direct_parameters if stage in (0, self.num_stages - 1) else ()


def stage_layer_ranges(num_layers: int, num_stages: int) -> list[range]:
    """Contiguous block ranges, one per stage, whose sizes differ by at most one (earlier stages get the extra).

    Raises:
        ValueError: when there are fewer blocks than stages.
    """
    if num_stages < 1:
        raise ValueError(f"pipeline_stages must be >= 1, got {num_stages}.")
    if num_layers < num_stages:
        raise ValueError(
            f"The model has {num_layers} decoder blocks, fewer than pipeline_stages={num_stages}: every stage needs "
            "at least one block."
        )
    base, extra = divmod(num_layers, num_stages)
    ranges, start = [], 0
    for stage in range(num_stages):
        stop = start + base + (1 if stage < extra else 0)
        ranges.append(range(start, stop))
        start = stop
    return ranges


# ------------------------------------------------------------------------------------------------ finding the parts


def check_has_block_stack(model: nn.Module) -> None:
    """Refuse a model without an `nn.ModuleList` of `config.num_hidden_layers` blocks: no block stack to cut."""
    name = type(model).__name__
    num_layers = config_value(model, "num_hidden_layers")
    if not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"Cannot pipeline a {name}: its config has no num_hidden_layers to find its block stack by.")
    if not layer_stacks(model, num_layers):
        raise ValueError(
            f"Cannot pipeline a {name}: it has no nn.ModuleList of num_hidden_layers={num_layers} blocks (no block "
            "stack to cut between stages)."
        )


def _ancestors(path: str) -> list[str]:
    parts = path.split(".")
    return [".".join(parts[:i]) for i in range(len(parts))]


def _outer_modules(model: nn.Module, blocks: str) -> dict[str, nn.Module]:
    """The modules beside the block stack: children of the stack's ancestors that neither contain nor are the stack."""
    ancestors = _ancestors(blocks)
    outer = {}
    for ancestor in ancestors:
        for name, child in model.get_submodule(ancestor).named_children():
            path = f"{ancestor}.{name}" if ancestor else name
            if path != blocks and path not in ancestors:
                outer[path] = child
    return outer


def _has_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _holds_state(module: nn.Module) -> bool:
    """Whether `module` has parameters or buffers that a state dict saves."""
    return _has_parameters(module) or any(True for _ in module.state_dict(keep_vars=True))


def _direct_state(model: nn.Module, blocks: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Names of the parameters and of the persistent buffers set directly on the modules that contain the stack."""
    parameters, buffers = [], []
    for ancestor in _ancestors(blocks):
        module = model.get_submodule(ancestor)
        prefix = f"{ancestor}." if ancestor else ""
        parameters += [prefix + name for name, _ in module.named_parameters(recurse=False)]
        buffers += [prefix + name for name in module._buffers if name not in module._non_persistent_buffers_set]
    return tuple(parameters), tuple(buffers)


def _output_format(output, block: int, model_name: str) -> int | None:
    if isinstance(output, torch.Tensor):
        return None
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return len(output)
    raise ValueError(
        f"Cannot pipeline a {model_name}: block {block} returns a {type(output).__name__}, not the hidden state (a "
        "tensor, or a tuple that starts with it)."
    )


@dataclass
class _Probe:
    """What one unsplit forward showed: when each outer module ran, the blocks' order and outputs, the logits."""

    phases: dict[str, set[str]]
    block_order: list[int]
    block_outputs: list[int | None]
    logits: torch.Tensor


def check_batch(model: nn.Module, batch: int = 2, seq_len: int = 8) -> dict[str, torch.Tensor]:
    """A small padded micro-batch for the probe and the start-up check: row 0 right-padded, row 1 left-padded."""
    vocab = config_value(model, "vocab_size")
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    vocab = getattr(embeddings, "num_embeddings", None) or vocab
    if not isinstance(vocab, int):
        raise ValueError(
            f"No vocabulary size found for {type(model).__name__} (no input embedding, no config.vocab_size): pass "
            "the batch for the pipeline's start-up check explicitly."
        )
    positions = config_value(model, "max_position_embeddings")
    seq_len = min(seq_len, positions) if isinstance(positions, int) and positions > 2 else seq_len
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, vocab, (batch, seq_len), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, -2:] = 0
    attention_mask[-1, :2] = 0
    return {"input_ids": input_ids.to(device), "attention_mask": attention_mask.to(device)}


def _logits(output) -> torch.Tensor:
    logits = getattr(output, "logits", None)
    return output[0] if logits is None else logits


def _probe(
    model: nn.Module, blocks: str, outer: Mapping[str, nn.Module], inputs: Mapping[str, torch.Tensor]
) -> _Probe:
    stack = model.get_submodule(blocks)
    model_name = type(model).__name__
    phases: dict[str, set[str]] = {path: set() for path in outer}
    order: list[int] = []
    outputs: list[int | None] = [None] * len(stack)
    finished = [0]

    def phase() -> str:
        if not order:
            return BEFORE
        return AFTER if finished[0] == len(stack) else BETWEEN

    def record_call(path: str) -> Callable:
        return lambda module, args: phases[path].add(phase())

    def record_start(index: int) -> Callable:
        return lambda module, args: order.append(index)

    def record_output(index: int) -> Callable:
        def hook(module, args, output):
            outputs[index] = _output_format(output, index, model_name)
            finished[0] += 1

        return hook

    handles = []
    try:
        for path, module in outer.items():
            handles += [sub.register_forward_pre_hook(record_call(path)) for sub in module.modules()]
        for index, block in enumerate(stack):
            handles.append(block.register_forward_pre_hook(record_start(index)))
            handles.append(block.register_forward_hook(record_output(index)))
        with eval_mode(model):
            output = model(**inputs, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    if getattr(output, "aux_loss", None) is not None:
        raise _auxiliary_loss_error(model_name)
    return _Probe(phases, order, outputs, _logits(output).detach())


def _auxiliary_loss_error(model_name: str) -> ValueError:
    return ValueError(
        f"Cannot pipeline a {model_name} that adds an auxiliary loss (MoE router logits, output_router_logits=True): "
        "the last stage would compute it from its own blocks' routers only. Set output_router_logits=False in the "
        "model config to train on the language-model loss alone, or use pipeline_stages=1."
    )


def _stage_names(model: nn.Module, plan: PipelinePlan, stage: int) -> dict[int, str]:
    """`id(parameter) -> name` as `stage` names the parameters it holds (the first of their names in model order)."""
    prefixes = tuple(f"{path}." for path in plan.stage_paths(stage))
    direct = set(plan.stage_direct_parameters(stage))
    names: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if name.startswith(prefixes) or name in direct:
            names.setdefault(id(param), name)
    return names


def _block_parameter_ids(model: nn.Module, blocks: str) -> set[int]:
    return {id(p) for p in model.get_submodule(blocks).parameters()}


def _tied_pairs(model: nn.Module, plan: PipelinePlan) -> tuple[tuple[str, str], ...]:
    """The `(first-stage name, last-stage name)` of each parameter held by both; refuses any other sharing."""
    names = [_stage_names(model, plan, stage) for stage in range(plan.num_stages)]
    in_blocks = _block_parameter_ids(model, plan.blocks)
    holders: dict[int, list[int]] = {}
    for stage, stage_names in enumerate(names):
        for key in stage_names:
            holders.setdefault(key, []).append(stage)
    last = plan.num_stages - 1
    tied = []
    for key, stages in holders.items():
        if len(stages) == 1:
            continue
        where = [names[s][key] for s in stages]
        if stages != [0, last] or key in in_blocks:
            raise ValueError(
                f"Cannot pipeline a {type(model).__name__} into {last + 1} stages: one parameter is shared by "
                f"{where} on stages {stages}; only the first and the last stage can share a parameter outside the "
                "block stack (a tied embedding)."
            )
        tied.append((where[0], where[1]))
    return tuple(tied)


def _outer_stages(
    model: nn.Module, outer: Mapping[str, nn.Module], phases: Mapping[str, set[str]], num_stages: int
) -> dict[str, tuple[int, ...]]:
    last = num_stages - 1
    stages = {}
    for path, module in outer.items():
        if not _holds_state(module):
            continue
        ran = phases[path]
        if BETWEEN in ran and _has_parameters(module):
            raise ValueError(
                f"Cannot pipeline a {type(model).__name__}: '{path}' holds parameters and runs between blocks, so it "
                "belongs to no single stage."
            )
        held = {0} if BEFORE in ran or AFTER not in ran else set()
        if AFTER in ran:
            held.add(last)
        stages[path] = tuple(sorted(held))
    return stages


def plan_pipeline(
    model: nn.Module, num_stages: int, inputs: Mapping[str, torch.Tensor] | None = None
) -> tuple[PipelinePlan, torch.Tensor]:
    """Find the block stack and where every other part runs, with one probe forward on `inputs`.

    Args:
        model: the full causal LM.
        num_stages: number of pipeline stages.
        inputs: the probe batch (`input_ids`, `attention_mask`); default `check_batch(model)`.

    Returns:
        The plan, and the unsplit model's logits on `inputs` (eval mode) for the start-up check.

    Raises:
        ValueError: naming what prevents a split (no block stack, blocks run out of order, parameters shared across
            stages, an auxiliary loss, `layerdrop` > 0, fewer blocks than stages).
    """
    name = type(model).__name__
    check_has_block_stack(model)
    inputs = check_batch(model) if inputs is None else inputs
    blocks = find_block_stack(model, inputs)
    num_layers = len(model.get_submodule(blocks))
    ranges = stage_layer_ranges(num_layers, num_stages)
    if (config_value(model, "layerdrop") or 0) > 0:
        raise ValueError(f"Cannot pipeline a {name} with layerdrop > 0: stages would drop blocks independently.")
    if config_value(model, "output_router_logits"):
        raise _auxiliary_loss_error(name)
    outer = _outer_modules(model, blocks)
    probe = _probe(model, blocks, outer, inputs)
    if probe.block_order != list(range(num_layers)):
        raise ValueError(
            f"Cannot pipeline a {name}: its forward runs the blocks of '{blocks}' in the order {probe.block_order}; "
            "a pipeline needs every block once, in index order."
        )
    direct_parameters, direct_buffers = _direct_state(model, blocks)
    plan = PipelinePlan(
        model_name=name,
        num_stages=num_stages,
        blocks=blocks,
        num_layers=num_layers,
        ranges=tuple(ranges),
        outer_stages=_outer_stages(model, outer, probe.phases, num_stages),
        before_blocks=tuple(
            path for path, module in outer.items() if BEFORE in probe.phases[path] and _has_parameters(module)
        ),
        block_outputs=tuple(probe.block_outputs),
        direct_parameters=direct_parameters,
        direct_buffers=direct_buffers,
        tied=(),
    )
    tied = _tied_pairs(model, plan) if num_stages > 1 else ()
    return dataclasses.replace(plan, tied=tied), probe.logits
