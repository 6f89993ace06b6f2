"""Pipeline parallelism inside one worker (DiLoCoX, arXiv 2506.21263) for any causal LM with a block stack.

A causal LM whose forward runs a stack of `config.num_hidden_layers` blocks (an `nn.ModuleList`; the blocks' classes
may differ, as in hybrid models) is cut into `num_stages` contiguous, balanced block ranges. Every stage runs the
model's *own* forward, with the parts that belong to other stages standing in:

- on every stage but the first, the modules that the forward calls before the blocks and whose parameters belong to
  the first stage (token and position embeddings, ...) return zeros of their output's shape (worked out on the meta
  device), and the blocks before the stage's range return the hidden state received from the previous stage;
- on every stage but the last, the forward stops as soon as the stage's last block returns: that block's hidden state
  is the stage's output;
- the last stage's forward runs to its end and returns the model's logits.

So whatever a family computes outside its blocks (embedding scales, rotary embeddings per layer type, padding and
sliding-window masks, ALiBi, MoE routing inside the blocks, a final logit soft-cap, logit scaling) is computed by the
family's own code where the model computes it, and every block receives exactly the arguments of the unsplit forward.
Tracing the model into one graph per stage (`torch.distributed.pipelining.pipeline`) was the alternative: an exported
graph is fixed to the micro-batch shape it was traced with (another sequence length or batch size needs a new trace),
and on the installed transformers it could not trace a Llama called with a padding mask. The eager forward takes any
shape, data-dependent control flow and attention implementation, and shares its parameters with the model.

Which stage holds what is found by structure and by one probe forward on a small padded batch, never by model class:

- the block stack is the `nn.ModuleList` of `num_hidden_layers` modules that holds the most parameters; the forward
  must run each block once, in index order;
- every other module that holds parameters is held by the first stage when the forward calls it before the blocks (or
  never), by the last stage when it calls it after them, by both when it calls it before and after;
- parameters set directly on a module that contains the block stack (not in one of its children) are held by the
  first and the last stage;
- a parameter held by two stages (a tied input and output embedding, recognised by identity: the same tensor) can only
  be shared by the first and the last stage; both keep a copy, their partial gradients are summed, and the outer loop
  syncs the first stage's copy. Any other parameter shared across stages, or a module with parameters that the forward
  calls between blocks, is refused with an error that names it.

Every stage's `named_parameters()` keep the model's names (`model.layers.3.mlp.up_proj.weight`, `lm_head.weight`), so
fragments, the global copy and checkpoints map a stage's parameters onto the full model.

A start-up check (`check_stages`, run by `build_stages`) chains the stages on the probe batch, each stage with the
parameters of the others released exactly as a real pipeline releases them, and compares the logits with the unsplit
model's on the real (unpadded) tokens; a difference beyond a tight tolerance, or a stage that fails, raises
`PipelineMismatchError` naming the model and the difference: a split is never silently wrong.

The micro-batch schedule (GPipe or 1F1B) comes from `torch.distributed.pipelining`. `PipelineRunner` adds a
token-weighted loss (the sum of per-token cross entropy over labels that are not -100, divided by `num_items_in_batch`
or by the batch's token count, so micro-batching changes nothing; broadcast to every rank of the pipeline), the tied
gradient sum, gradient clipping by the norm of the whole model (the tied matrix counted once), averaging over an
optional data-parallel group, and `gather_state_dict` / `load_stage_state` to write one normal model folder and to
reload it into any stage count.

Limits: a model whose output carries an auxiliary loss (MoE routers with `output_router_logits=True`) is refused, as
the router logits of the other stages never reach the last stage that would add that loss; set
`output_router_logits=False` (the default) to train on the language-model loss alone. `layerdrop` > 0 is refused
(stages would drop blocks independently). Dropout draws other random numbers than the unsplit model would: train with
dropout 0 when the two must match. The probe and the check run in eval mode.

This module is pure torch: it never imports `transformers`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.utils._pytree import tree_map_only

from ..core.fragments import config_value, layer_stacks

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


def _block_stack_candidates(model: nn.Module) -> list[str]:
    """Paths of the `nn.ModuleList`s of `config.num_hidden_layers` modules, the most parameters first."""
    name = type(model).__name__
    num_layers = config_value(model, "num_hidden_layers")
    if not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"Cannot pipeline a {name}: its config has no num_hidden_layers to find its block stack by.")
    stacks = layer_stacks(model, num_layers)
    if not stacks:
        raise ValueError(
            f"Cannot pipeline a {name}: it has no nn.ModuleList of num_hidden_layers={num_layers} blocks (no block "
            "stack to cut between stages)."
        )
    return stacks


def find_block_stack(model: nn.Module, inputs: Mapping[str, torch.Tensor] | None = None) -> str:
    """Path of the block stack: the `nn.ModuleList` of `config.num_hidden_layers` blocks with the most parameters.

    With several such lists (a vision tower beside the text decoder), `inputs` decide: the largest list whose blocks
    the forward on `inputs` runs once each, in index order.

    Raises:
        ValueError: when the model has no `config.num_hidden_layers` or no such list.
    """
    candidates = _block_stack_candidates(model)
    if len(candidates) == 1 or inputs is None:
        return candidates[0]
    orders: dict[str, list[int]] = {path: [] for path in candidates}
    handles = [
        block.register_forward_pre_hook(lambda module, args, path=path, index=index: orders[path].append(index))
        for path in candidates
        for index, block in enumerate(model.get_submodule(path))
    ]
    try:
        with _eval_mode(model):
            model(**inputs, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    ran = [path for path in candidates if orders[path] == list(range(len(model.get_submodule(path))))]
    return ran[0] if ran else candidates[0]


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


@contextlib.contextmanager
def _eval_mode(model: nn.Module) -> Iterator[None]:
    """Eval mode without gradients; every module gets its own mode back."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for module, training in modes:
            module.training = training


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
        with _eval_mode(model):
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
    _block_stack_candidates(model)
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


# ---------------------------------------------------------------------------------------------------- stand-ins


def _container(root: nn.Module, path: str) -> tuple[nn.Module, str]:
    """The module of `root` that holds the last part of the dotted `path` (created empty on the way), and that part."""
    *parents, leaf = path.split(".")
    node = root
    for name in parents:
        if name not in node._modules:
            node.add_module(name, nn.Module())
        node = node._modules[name]
    return node, leaf


def _attach(root: nn.Module, path: str, module: nn.Module) -> None:
    """Register `module` under the dotted `path` of `root`."""
    node, leaf = _container(root, path)
    node.add_module(leaf, module)


def _attach_tensor(root: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Register a parameter or a persistent buffer under the dotted `name` of `root`."""
    node, leaf = _container(root, name)
    if isinstance(tensor, nn.Parameter):
        node.register_parameter(leaf, tensor)
    else:
        node.register_buffer(leaf, tensor)


def _swap_forward(module: nn.Module, forward: Callable) -> Callable[[], None]:
    """Make `module(...)` call `forward` (hooks still run); returns the function that undoes it."""
    previous = module.__dict__.get("forward")
    module.forward = forward

    def restore() -> None:
        if previous is None:
            del module.forward
        else:
            module.forward = previous

    return restore


class _Zeros:
    """Forward of a module whose parameters live on another stage: zeros shaped like its output.

    The output's shape and dtype come from running the module's own forward on the meta device with meta tensors of
    its parameters' shapes (recorded while they still existed), so no data of those parameters is needed.
    """

    def __init__(self, module: nn.Module):
        self.module = module
        self.meta_parameters = {
            name: torch.empty(p.shape, dtype=p.dtype, device="meta")
            for name, p in module.named_parameters(remove_duplicate=False)
        }
        self.real_forward = module.__dict__.get("forward") or type(module).forward.__get__(module)
        self.inside = False

    def __call__(self, *args, **kwargs):
        if self.inside:  # `functional_call` below calls the module, whose forward is this object
            return self.real_forward(*args, **kwargs)
        tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
        device = tensors[0].device if tensors else torch.device("cpu")
        state = {**self.meta_parameters}
        state.update({name: b.to("meta") for name, b in self.module.named_buffers(remove_duplicate=False)})
        meta_args, meta_kwargs = tree_map_only(torch.Tensor, lambda t: t.to("meta"), (args, kwargs))
        self.inside = True
        try:
            output = torch.func.functional_call(self.module, state, meta_args, meta_kwargs, strict=False)
        finally:
            self.inside = False
        return tree_map_only(torch.Tensor, lambda t: torch.zeros(t.shape, dtype=t.dtype, device=device), output)


def _pass_received(received: torch.Tensor, output_format: int | None) -> Callable:
    """Forward of a block of an earlier stage: returns the received hidden state in the block's output format."""
    output = received if output_format is None else (received, *([None] * (output_format - 1)))
    return lambda *args, **kwargs: output


def _raise_boundary(module: nn.Module, args, output) -> None:
    raise _StageBoundary(output if isinstance(output, torch.Tensor) else output[0])


class PipelineStageModule(nn.Module):
    """One stage of a causal LM, sharing its parameters with the model it was cut from (see the module docstring).

    The stage mirrors the model's attribute paths with only its own modules present (blocks sit in an `nn.ModuleDict`
    keyed by their original index), so `named_parameters()` yields the model's names.

    `forward(x, input_ids=None, attention_mask=None, position_ids=None)`: `x` is `input_ids` on the first stage and the
    previous stage's hidden state elsewhere (where `input_ids` should be passed too: the model's forward reads them
    before the blocks); the last stage returns logits, the others hidden states.

    Attributes:
        plan (`PipelinePlan`): the cut this stage belongs to.
        layer_indices: the original indices of this stage's blocks.
        tied_copy_names: names of parameters that duplicate another stage's parameter (the head of a tied model on
            the last stage); gradient clipping counts them once and the outer loop leaves them out.
    """

    def __init__(self, model: nn.Module, plan: PipelinePlan, stage_index: int):
        super().__init__()
        if not 0 <= stage_index < plan.num_stages:
            raise ValueError(f"stage_index {stage_index} is outside 0..{plan.num_stages - 1}.")
        self.plan = plan
        self.stage_index = stage_index
        self.is_first = stage_index == 0
        self.is_last = stage_index == plan.num_stages - 1
        self.layer_indices = list(plan.ranges[stage_index])
        self._model = (model,)  # a tuple, so that the model's parameters do not all become the stage's
        paths = set(plan.stage_paths(stage_index)) | {plan.blocks}
        stack = model.get_submodule(plan.blocks)
        for path, module in model.named_modules(remove_duplicate=False):
            if path == plan.blocks:
                _attach(self, path, nn.ModuleDict({str(i): stack[i] for i in self.layer_indices}))
            elif path in paths and not path.startswith(f"{plan.blocks}."):
                _attach(self, path, module)
        direct = dict(model.named_parameters(remove_duplicate=False))
        for name in plan.stage_direct_parameters(stage_index):
            _attach_tensor(self, name, direct[name])
        if self.is_first:
            buffers = dict(model.named_buffers(remove_duplicate=False))
            for name in plan.direct_buffers:
                _attach_tensor(self, name, buffers[name])
        self.tied_copy_names: tuple[str, ...] = (
            tuple(last for _, last in plan.tied) if self.is_last and not self.is_first else ()
        )
        self._zeros = {
            path: _Zeros(model.get_submodule(path))
            for path in plan.before_blocks
            if not self.is_first and stage_index not in plan.outer_stages.get(path, ())
        }

    @property
    def full_model(self) -> nn.Module:
        """The full model whose forward every stage runs."""
        return self._model[0]

    def reattach_buffers(self) -> None:
        """Hold the full model's current buffers again (after `full_model.to(...)` replaced them)."""
        if self.is_first:
            buffers = dict(self.full_model.named_buffers(remove_duplicate=False))
            for name in self.plan.direct_buffers:
                _attach_tensor(self, name, buffers[name])

    @contextlib.contextmanager
    def _standing_in(self, received: torch.Tensor | None) -> Iterator[None]:
        stack = self.full_model.get_submodule(self.plan.blocks)
        undo: list[Callable[[], None]] = []
        try:
            if received is not None:
                for path, zeros in self._zeros.items():
                    undo.append(_swap_forward(self.full_model.get_submodule(path), zeros))
                for index in range(self.layer_indices[0]):
                    passing = _pass_received(received, self.plan.block_outputs[index])
                    undo.append(_swap_forward(stack[index], passing))
            if not self.is_last:
                undo.append(stack[self.layer_indices[-1]].register_forward_hook(_raise_boundary).remove)
            yield
        finally:
            for restore in reversed(undo):
                restore()

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor | None = None, **inputs) -> torch.Tensor:
        if self.is_first:
            input_ids = x
        elif input_ids is None:
            input_ids = torch.zeros(x.shape[:2], dtype=torch.long, device=x.device)
        with self._standing_in(None if self.is_first else x):
            try:
                output = self.full_model(input_ids=input_ids, use_cache=False, **inputs)
            except _StageBoundary as boundary:
                return boundary.hidden
        if not self.is_last:
            raise RuntimeError(
                f"The forward of {self.plan.model_name} returned without running block {self.layer_indices[-1]}, the "
                f"last block of pipeline stage {self.stage_index}."
            )
        return _logits(output)


# ------------------------------------------------------------------------------------------------ start-up check


@contextlib.contextmanager
def _released_except(model: nn.Module, stage: nn.Module) -> Iterator[None]:
    """The parameters that `stage` does not hold lose their storage, as on a rank that runs only `stage`."""
    own = {id(p) for p in stage.parameters()}
    saved = []
    for param in model.parameters():
        if id(param) not in own:
            saved.append((param, param.data))
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)
    try:
        yield
    finally:
        for param, data in saved:
            param.data = data


def free_other_stages(model: nn.Module, stage: nn.Module) -> None:
    """Release the storage of every parameter of `model` that `stage` does not hold (a tied copy it holds stays)."""
    own = {id(p) for p in stage.parameters()}
    with torch.no_grad():
        for param in model.parameters():
            if id(param) not in own:
                param.data = torch.empty(0, dtype=param.dtype, device=param.device)


def _tolerance(dtype: torch.dtype) -> float:
    return max(1e-6, 4 * torch.finfo(dtype).eps)


def check_stages(
    stages: list[PipelineStageModule], inputs: Mapping[str, torch.Tensor], expected: torch.Tensor
) -> float:
    """Chain `stages` on `inputs` in this process and compare the logits with the unsplit model's (`expected`).

    Each stage runs with the other stages' parameters released, as on a rank that holds only that stage; the logits
    are compared on the real tokens (`attention_mask` 1).

    Returns:
        The largest absolute difference.

    Raises:
        PipelineMismatchError: when a stage fails or the difference exceeds `max(1e-6, 4 eps)` of the logits' dtype
            times `1 + max |expected|`.
    """
    model = stages[0].full_model
    plan = stages[0].plan
    what = f"{plan.num_stages} pipeline stages of {plan.model_name} (blocks {[list(r) for r in plan.ranges]})"
    try:
        with _eval_mode(model):
            hidden = inputs["input_ids"]
            for stage in stages:
                with _released_except(model, stage):
                    hidden = stage(hidden, **inputs)
    except Exception as error:
        raise PipelineMismatchError(
            f"{what} failed when chained on a check batch ({type(error).__name__}: {error}); this family cannot be "
            "pipelined by the generic cut: train it with pipeline_stages=1."
        ) from error
    real = inputs["attention_mask"].bool() if inputs.get("attention_mask") is not None else ...
    got, want = hidden[real].float(), expected[real].float()
    if got.shape != want.shape:
        raise PipelineMismatchError(
            f"{what} return logits of shape {tuple(hidden.shape)}, the model {expected.shape}."
        )
    difference = float((got - want).abs().max()) if got.numel() else 0.0
    bound = _tolerance(expected.dtype) * (1 + float(want.abs().max()))
    if not difference <= bound:  # also refuses NaN
        raise PipelineMismatchError(
            f"{what} do not reproduce the unsplit model: their logits differ by up to {difference:.3g} on a check "
            f"batch (allowed {bound:.2g}). The family passes something between its blocks besides the hidden state, "
            "or reads another stage's parameters: train it with pipeline_stages=1."
        )
    return difference


def build_stages(
    model: nn.Module, num_stages: int, inputs: Mapping[str, torch.Tensor] | None = None
) -> list[PipelineStageModule]:
    """Cut `model` into `num_stages` stages and verify that chained they reproduce the unsplit model.

    Every rank of a pipeline calls this on its own copy of the full model (no communication), where the whole model
    fits (the CPU, not the training accelerator: the probe and the check run the unsplit forward), keeps its stage and
    may then free the other stages' parameters (`PipelineRunner.place_own_stage` frees them, then moves the stage).

    Args:
        model: the full causal LM.
        num_stages: number of stages.
        inputs: probe and check batch (`input_ids`, `attention_mask`); default `check_batch(model)`.

    Raises:
        ValueError: when the model cannot be cut (see `plan_pipeline`).
        PipelineMismatchError: when the chained stages do not reproduce the model (see `check_stages`).
    """
    _block_stack_candidates(model)  # a model without a block stack fails here, before any forward
    inputs = check_batch(model) if inputs is None else inputs
    plan, expected = plan_pipeline(model, num_stages, inputs)
    stages = [PipelineStageModule(model, plan, stage) for stage in range(num_stages)]
    if num_stages > 1:
        check_stages(stages, inputs, expected)
    return stages


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, divisor: float | torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross entropy over labels that are not -100, divided by `divisor` (computed in fp32)."""
    logits = logits[:, :-1].float()
    labels = labels[:, 1:].to(logits.device)
    total = F.cross_entropy(
        logits.reshape(-1, logits.size(-1)), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    return total / divisor


def count_loss_tokens(labels: torch.Tensor) -> int:
    """Number of (shifted) label positions that the causal LM loss counts."""
    return int((labels[:, 1:] != IGNORE_INDEX).sum())


def _group_size(group: dist.ProcessGroup | None) -> int:
    """Size of `group`, where `None` is the default group (or a single process without one)."""
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def _flat_all_reduce(tensors: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    """Sum `tensors` over `group` with one collective."""
    if not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


def clip_grad_norm_(
    stage_module: nn.Module,
    max_norm: float,
    group: dist.ProcessGroup | None = None,
    norm_type: float = 2.0,
    exclude: Iterable[str] | None = None,
) -> torch.Tensor:
    """Clip the gradients of one stage by the norm of the gradients of every stage of the pipeline.

    Same formula as `torch.nn.utils.clip_grad_norm_` on the unsplit model: the squared (or max) norms are combined
    over `group`, a parameter duplicated on two stages (a tied head, listed in `stage_module.tied_copy_names` or
    `exclude`) counts once, then every gradient is scaled by `min(1, max_norm / (total_norm + 1e-6))`.

    Returns:
        The total norm, identical on every rank of `group`.
    """
    return _clip_grad_norm(stage_module, max_norm, group, norm_type, exclude, reduce=True)


def _clip_grad_norm(stage_module, max_norm, group, norm_type, exclude, reduce: bool) -> torch.Tensor:
    if norm_type not in (2.0, math.inf):
        raise ValueError(f"norm_type must be 2.0 or inf, got {norm_type}.")
    skip = set(getattr(stage_module, "tied_copy_names", ())) | set(exclude or ())
    named_grads = [(name, p.grad) for name, p in stage_module.named_parameters() if p.grad is not None]
    device = next(stage_module.parameters()).device
    total = torch.zeros(1, device=device)
    for name, grad in named_grads:
        if name in skip:
            continue
        if norm_type == math.inf:
            total = torch.maximum(total, grad.detach().abs().max().float())
        else:
            total += grad.detach().float().pow(2).sum()
    if reduce and _group_size(group) > 1:
        dist.all_reduce(total, op=dist.ReduceOp.MAX if norm_type == math.inf else dist.ReduceOp.SUM, group=group)
    total = total[0] if norm_type == math.inf else total[0].sqrt()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for _, grad in named_grads:
        grad.mul_(coef.to(grad.dtype))
    return total


class PipelineRunner:
    """Runs one rank's stage of a pipeline-parallel worker: forward, backward, loss, clipping, saving.

    Every rank of the pipeline group builds the same model (or loads it) on the CPU, creates its runner with its own
    stage index and the training `device`, calls `place_own_stage()` (the other stages freed, this one moved to
    `device`: the whole model never reaches the accelerator) and calls `train_step` with the *same* batch; the
    optimizer step is the caller's, on `runner.stage_module.parameters()`. The stage index must equal the rank inside `group` (ranks of a pipeline are
    ordered by stage).

    Args:
        model: the full causal LM, where the plan and the start-up check run (the CPU, or wherever it fits); the
            stage shares its parameters, the rest can be freed (`place_own_stage`).
        stage_index: this rank's stage.
        num_stages: number of stages.
        group: the pipeline group (the stages of one replica); `None` is the default group.
        schedule: `"1f1b"` (needs `n_microbatches >= num_stages`) or `"gpipe"`.
        n_microbatches: micro-batches per step; must divide the batch size.
        data_parallel_group: replicas of this stage inside the worker; gradients are averaged over it (as DDP does).
        device: where the stage runs (`place_own_stage` moves it there); defaults to the device of the model's
            parameters.
        check_inputs: probe and start-up check batch (`input_ids`, `attention_mask`); default `check_batch(model)`.

    Attributes:
        plan (`PipelinePlan`): the cut (block stack, stage ranges, tied parameters).
        stage_module (`PipelineStageModule`): this rank's stage.
    """

    def __init__(
        self,
        model: nn.Module,
        stage_index: int,
        num_stages: int,
        group: dist.ProcessGroup | None = None,
        schedule: str = "1f1b",
        n_microbatches: int = 1,
        data_parallel_group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        check_inputs: Mapping[str, torch.Tensor] | None = None,
    ):
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {sorted(SCHEDULES)}, got {schedule!r}.")
        if n_microbatches < 1:
            raise ValueError(f"n_microbatches must be >= 1, got {n_microbatches}.")
        if schedule == "1f1b" and n_microbatches < num_stages:
            raise ValueError(
                f"schedule='1f1b' needs n_microbatches >= pipeline_stages ({n_microbatches} < {num_stages})."
            )
        if not 0 <= stage_index < num_stages:
            raise ValueError(f"stage_index {stage_index} is outside 0..{num_stages - 1}.")
        if num_stages > 1 and dist.get_rank(group) != stage_index:
            raise ValueError(
                f"stage_index {stage_index} differs from this rank's index {dist.get_rank(group)} in the pipeline "
                "group: order the group's ranks by stage."
            )
        self.stage_index, self.num_stages, self.group = stage_index, num_stages, group
        self.schedule_name, self.n_microbatches = schedule, n_microbatches
        self.data_parallel_group = data_parallel_group
        self.stage_module = build_stages(model, num_stages, check_inputs)[stage_index]
        self.plan = self.stage_module.plan
        self._aliases = _parameter_aliases(model)
        if device is None:
            device = next(self.stage_module.parameters()).device
        self.device = torch.device(device)
        self._schedules: dict[tuple, object] = {}

    def place_own_stage(self) -> None:
        """Free every parameter of the full model that this stage does not hold, then move what is left to `device`:
        this stage's parameters and the model's buffers (every stage runs the model's own forward, which may read
        any of them). Nothing of another stage ever reaches `device`."""
        model = self.stage_module.full_model
        free_other_stages(model, self.stage_module)
        model.to(self.device)
        self.stage_module.reattach_buffers()  # `Module.to` replaced the model's buffers by moved ones

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    def _global_rank(self, stage: int) -> int:
        return stage if self.group is None else dist.get_global_rank(self.group, stage)

    def _schedule(self, train: bool, shape: tuple[int, ...], kwarg_names: Iterable[str]):
        key = (train, shape, tuple(kwarg_names))
        if key not in self._schedules:
            stage = PipelineStage(self.stage_module, self.stage_index, self.num_stages, self.device, group=self.group)
            cls = SCHEDULES[self.schedule_name] if train else ScheduleGPipe
            self._schedules[key] = cls(stage, self.n_microbatches, loss_fn=causal_lm_loss, scale_grads=False)
        return self._schedules[key]

    def _split_batch(self, batch: Mapping[str, torch.Tensor]) -> tuple[tuple, dict, torch.Tensor]:
        input_ids = batch["input_ids"]
        if input_ids.shape[0] % self.n_microbatches:
            raise ValueError(
                f"batch size {input_ids.shape[0]} is not divisible by n_microbatches={self.n_microbatches}."
            )
        keys = ("input_ids", "attention_mask", "position_ids")
        kwargs = {k: batch[k].to(self.device) for k in keys if batch.get(k) is not None}
        args = (input_ids.to(self.device),) if self.is_first else ()
        labels = batch.get("labels")
        labels = (input_ids if labels is None else labels).to(self.device)
        return args, kwargs, labels

    def _divisor(self, labels: torch.Tensor, num_items_in_batch: int | torch.Tensor | None) -> float:
        if num_items_in_batch is None:
            return float(max(count_loss_tokens(labels), 1))
        return float(num_items_in_batch)

    def _run(self, batch: Mapping[str, torch.Tensor], num_items_in_batch, train: bool) -> torch.Tensor:
        args, kwargs, labels = self._split_batch(batch)
        loss_kwargs = {"divisor": self._divisor(labels, num_items_in_batch)}
        if self.num_stages == 1:
            return self._run_unsplit(kwargs, labels, loss_kwargs["divisor"], train)
        schedule = self._schedule(train, tuple(batch["input_ids"].shape), sorted(kwargs))
        losses: list[torch.Tensor] = []
        target = labels if self.is_last else None
        run = schedule.step if train else schedule.eval
        run(*args, target=target, losses=losses, loss_kwargs=loss_kwargs, **kwargs)
        loss = torch.stack([x.detach().float() for x in losses]).sum() if self.is_last else torch.zeros(())
        return self._broadcast_loss(loss)

    def _run_unsplit(self, kwargs: dict, labels, divisor: float, train: bool) -> torch.Tensor:
        """One stage: the micro-batches run one after another in this process, no schedule or communication."""
        n = self.n_microbatches
        kwarg_chunks = {k: torch.tensor_split(v, n) for k, v in kwargs.items()}
        total = torch.zeros(())
        for i, target in enumerate(torch.tensor_split(labels, n)):
            chunk = {k: v[i] for k, v in kwarg_chunks.items()}
            logits = self.stage_module(chunk["input_ids"], **chunk)
            loss = causal_lm_loss(logits, target, divisor)
            if train:
                loss.backward()
            total = total + loss.detach().float().cpu()
        return total

    def _broadcast_loss(self, loss: torch.Tensor) -> torch.Tensor:
        if self.num_stages == 1:
            return loss
        loss = loss.reshape(1).to(self.device)
        dist.broadcast(loss, src=self._global_rank(self.num_stages - 1), group=self.group)
        return loss[0].cpu()

    def train_step(
        self, batch: Mapping[str, torch.Tensor], num_items_in_batch: int | torch.Tensor | None = None
    ) -> torch.Tensor:
        """Forward and backward of one batch through the schedule; gradients accumulate into the stage's `.grad`.

        Args:
            batch: `input_ids`, optional `attention_mask`, `position_ids` (both `(batch, seq)`) and `labels`
                (default: `input_ids`); every rank of the pipeline passes the same batch.
            num_items_in_batch: divisor of the summed token losses (default: the batch's own token count).

        Returns:
            The batch loss, the same value on every rank of the pipeline group (the local replica's loss when there
            is data parallelism).
        """
        loss = self._run(batch, num_items_in_batch, train=True)
        self.sync_tied_gradients()
        self.average_data_parallel_gradients()
        return loss

    @torch.no_grad()
    def eval_loss(
        self, batch: Mapping[str, torch.Tensor], num_items_in_batch: int | torch.Tensor | None = None
    ) -> torch.Tensor:
        """Forward-only loss of `batch`, the same value on every rank of the pipeline group."""
        return self._run(batch, num_items_in_batch, train=False)

    def tied_parameters(self) -> list[nn.Parameter]:
        """This stage's copies of the parameters shared by the first and the last stage (empty elsewhere)."""
        if self.num_stages == 1 or not (self.is_first or self.is_last):
            return []
        params = dict(self.stage_module.named_parameters())
        return [params[first if self.is_first else last] for first, last in self.plan.tied]

    def sync_tied_gradients(self) -> None:
        """Give both copies of each tied parameter the sum of the first and the last stage's partial gradients.

        The two stages swap their partial gradients point to point inside the pipeline group (no extra process
        group is needed) and each adds the other's; `a + b == b + a` exactly, so the copies stay bitwise equal.
        """
        peer = self._global_rank(self.num_stages - 1 if self.is_first else 0)
        for param in self.tied_parameters():
            own = param.grad if param.grad is not None else torch.zeros_like(param)
            other = torch.empty_like(own)
            ops = [dist.P2POp(dist.isend, own, peer, self.group), dist.P2POp(dist.irecv, other, peer, self.group)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            param.grad = own + other

    def average_data_parallel_gradients(self) -> None:
        """Average the stage's gradients over the data-parallel replicas of this stage."""
        if self.data_parallel_group is None:
            return
        size = _group_size(self.data_parallel_group)
        if size == 1:
            return
        grads = [p.grad for p in self.stage_module.parameters() if p.grad is not None]
        _flat_all_reduce(grads, self.data_parallel_group)
        for g in grads:
            g.div_(size)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """`clip_grad_norm_` over the whole pipeline; call it after `train_step`, before the optimizer step."""
        # A single stage must not reduce over `group=None`, which would mean the whole default group.
        return _clip_grad_norm(self.stage_module, max_norm, self.group, norm_type, None, reduce=self.num_stages > 1)

    def gather_state_dict(self, dst: int = 0) -> dict[str, torch.Tensor] | None:
        """Collect every stage's state on stage `dst` as one full state dict with the original names (CPU tensors).

        Returns:
            The full state dict on stage `dst`, `None` on the other stages.
        """
        local = {k: v.detach().cpu().clone() for k, v in self.stage_module.state_dict().items()}
        if self.num_stages == 1:
            return local
        gathered: list | None = [None] * self.num_stages if self.stage_index == dst else None
        dist.gather_object(local, gathered, dst=self._global_rank(dst), group=self.group)
        if gathered is None:
            return None
        full: dict[str, torch.Tensor] = {}
        for part in gathered:
            full.update(part)
        return full

    @torch.no_grad()
    def load_stage_state(self, full_state_dict: Mapping[str, torch.Tensor]) -> None:
        """Copy this stage's tensors out of a full model state dict (from any stage count, or `save_pretrained`).

        A tied parameter missing from the dict under one of its names (safetensors checkpoints store a shared matrix
        once) is read under another.

        Raises:
            KeyError: naming the tensors of this stage that the state dict lacks.
        """
        own = self.stage_module.state_dict(keep_vars=True)
        sources = {name: self._source_name(name, full_state_dict) for name in own}
        missing = [name for name, source in sources.items() if source is None]
        if missing:
            raise KeyError(f"state dict lacks tensors of pipeline stage {self.stage_index}: {missing}")
        for name, tensor in own.items():
            tensor.copy_(full_state_dict[sources[name]].to(device=tensor.device, dtype=tensor.dtype))

    def _source_name(self, name: str, full_state_dict: Mapping[str, torch.Tensor]) -> str | None:
        for candidate in (name, *self._aliases.get(name, ())):
            if candidate in full_state_dict:
                return candidate
        return None


def _parameter_aliases(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """Each name of a tied parameter -> the other names of the same tensor (safetensors files keep one of them)."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return {name: tuple(n for n in group if n != name) for group in names.values() if len(group) > 1 for name in group}
