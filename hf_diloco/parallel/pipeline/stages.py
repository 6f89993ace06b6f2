"""A stage's module: the model's own forward with the other stages' parts standing in, and the start-up check
that chained stages reproduce the unsplit model."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from ...core.layout.fragments import eval_mode
from .plan import (
    PipelineMismatchError,
    PipelinePlan,
    _logits,
    _StageBoundary,
    check_batch,
    check_has_block_stack,
    plan_pipeline,
)

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
        with eval_mode(model):
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
    check_has_block_stack(model)  # a model without a block stack fails here, before any forward
    inputs = check_batch(model) if inputs is None else inputs
    plan, expected = plan_pipeline(model, num_stages, inputs)
    stages = [PipelineStageModule(model, plan, stage) for stage in range(num_stages)]
    if num_stages > 1:
        check_stages(stages, inputs, expected)
    return stages
