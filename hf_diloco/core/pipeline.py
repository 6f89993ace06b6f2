"""Pipeline parallelism inside one worker (DiLoCoX, arXiv 2506.21263).

A Hugging Face causal LM with a decoder block stack is cut into `num_stages` contiguous, balanced block ranges. Stage
0 owns the token (and position) embeddings, the last stage the final norm, the head and the loss. Every stage is a
plain `nn.Module` whose `named_parameters()` keep the original Hugging Face names (`model.layers.3.mlp.up_proj.weight`,
`lm_head.weight`), so fragments, the global copy and checkpoints map a stage's parameters onto the full model.

The micro-batch schedule (GPipe or 1F1B) comes from `torch.distributed.pipelining`. What that library leaves to us and
this module adds:

- attention masks: every stage builds the same 4-D additive mask (causal, padding, sliding window where the model has
  one) from the 2-D `attention_mask`, which every stage receives as a keyword argument, so padded batches give the
  unsplit model's result;
- a token-weighted loss: the sum of per-token cross entropy over labels that are not -100, divided by
  `num_items_in_batch` (or by the batch's token count), so micro-batching changes nothing; the loss is broadcast to
  every rank of the pipeline;
- tied embeddings: the first and the last stage each hold a copy of the shared matrix and swap their partial
  gradients after backward, so both copies get the same summed gradient and stay identical;
- gradient clipping by the norm of the whole model, counted across stages (the tied matrix once);
- averaging of the stage gradients over an optional data-parallel group (the stage's replicas inside the worker);
- `gather_state_dict` / `load_stage_state` to write one normal model folder and to reload it into any stage count.

This module is pure torch: Hugging Face models are recognised by their attribute layout, never by importing
`transformers`. Dropout draws different random numbers than the unsplit model would; train with dropout 0 when the
two must match.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

IGNORE_INDEX = -100
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
# Decoder layers of these model types take (hidden, attention_mask, position_ids, position_embeddings) and need
# nothing else from their model's forward (no embedding scaling, no logit soft-capping).
_LLAMA_LIKE_TYPES = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class DecoderParts:
    """Attribute paths (as in `model.get_submodule`) of the pieces of a decoder-only causal LM.

    Args:
        family: `"llama"` (Llama, Mistral, Qwen2), `"gpt2"`, `"gpt_neox"` or `"opt"`; selects how embeddings and
            positions are computed.
        embed_tokens: token embedding.
        layers: the `nn.ModuleList` of decoder blocks.
        final_norm: final normalisation, `None` when the model has none.
        head: output projection to the vocabulary.
        num_layers: number of blocks that the model's forward runs.
        tied: whether `head.weight` is the same tensor as `embed_tokens.weight`.
        embed_positions: learned position embedding (GPT-2, OPT).
        rotary_emb: rotary embedding module producing `(cos, sin)` (Llama family, GPT-NeoX).
        embed_dropout: dropout applied right after the embeddings.
        project_in: projection applied to token embeddings (OPT with `word_embed_proj_dim != hidden_size`).
        project_out: projection applied after the final norm (same OPT case).
    """

    family: str
    embed_tokens: str
    layers: str
    final_norm: str | None
    head: str
    num_layers: int
    tied: bool
    embed_positions: str | None = None
    rotary_emb: str | None = None
    embed_dropout: str | None = None
    project_in: str | None = None
    project_out: str | None = None

    def first_stage_paths(self) -> list[str]:
        paths = [self.embed_tokens, self.embed_positions, self.project_in, self.embed_dropout]
        return [p for p in paths if p is not None]

    def last_stage_paths(self) -> list[str]:
        return [p for p in (self.final_norm, self.project_out, self.head) if p is not None]


def _maybe_submodule(model: nn.Module, path: str) -> nn.Module | None:
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


def _existing(model: nn.Module, path: str) -> str | None:
    return path if _maybe_submodule(model, path) is not None else None


def find_decoder_parts(model: nn.Module) -> DecoderParts:
    """Locate the embeddings, the block stack, the final norm, the head and the rotary embedding of `model`.

    Supported: Llama, Mistral, Qwen2 (`model.model.layers`), GPT-2 (`transformer.h`), GPT-NeoX (`gpt_neox.layers`)
    and OPT (`model.decoder.layers`) causal LMs.

    Raises:
        ValueError: when the model is not one of those layouts.
    """
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type in _LLAMA_LIKE_TYPES and _existing(model, "model.layers") and _existing(model, "lm_head"):
        parts = dict(
            family="llama",
            embed_tokens="model.embed_tokens",
            layers="model.layers",
            final_norm="model.norm",
            head="lm_head",
            rotary_emb=_existing(model, "model.rotary_emb"),
        )
    elif model_type == "gpt2" and _existing(model, "transformer.h") and _existing(model, "lm_head"):
        parts = dict(
            family="gpt2",
            embed_tokens="transformer.wte",
            embed_positions="transformer.wpe",
            embed_dropout="transformer.drop",
            layers="transformer.h",
            final_norm="transformer.ln_f",
            head="lm_head",
        )
    elif model_type == "gpt_neox" and _existing(model, "gpt_neox.layers"):
        parts = dict(
            family="gpt_neox",
            embed_tokens="gpt_neox.embed_in",
            embed_dropout=_existing(model, "gpt_neox.emb_dropout"),
            layers="gpt_neox.layers",
            final_norm="gpt_neox.final_layer_norm",
            head=_existing(model, "lm_head") or "embed_out",
            rotary_emb=_existing(model, "gpt_neox.rotary_emb"),
        )
    elif model_type == "opt" and _existing(model, "model.decoder.layers") and _existing(model, "lm_head"):
        if getattr(model.get_submodule("model.decoder"), "layerdrop", 0.0) > 0:
            raise ValueError("OPT with layerdrop > 0 cannot be pipelined: stages would drop blocks independently.")
        parts = dict(
            family="opt",
            embed_tokens="model.decoder.embed_tokens",
            embed_positions="model.decoder.embed_positions",
            project_in=_existing(model, "model.decoder.project_in"),
            layers="model.decoder.layers",
            final_norm=_existing(model, "model.decoder.final_layer_norm"),
            project_out=_existing(model, "model.decoder.project_out"),
            head="lm_head",
        )
    else:
        raise ValueError(
            f"Cannot pipeline a {type(model).__name__} (model_type={model_type!r}): supported are causal LMs of "
            f"type {', '.join(_LLAMA_LIKE_TYPES)}, gpt2, gpt_neox and opt."
        )
    layers = model.get_submodule(parts["layers"])
    num_layers = min(len(layers), getattr(config, "num_hidden_layers", len(layers)) or len(layers))
    tied = model.get_submodule(parts["head"]).weight is model.get_submodule(parts["embed_tokens"]).weight
    return DecoderParts(num_layers=num_layers, tied=tied, **parts)


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


def _attach(root: nn.Module, path: str, module: nn.Module) -> None:
    """Register `module` under the dotted `path` of `root`, creating empty containers on the way."""
    *parents, leaf = path.split(".")
    node = root
    for name in parents:
        if name not in node._modules:
            node.add_module(name, nn.Module())
        node = node._modules[name]
    node.add_module(leaf, module)


def _attention_mask(
    attention_mask: torch.Tensor | None,
    seq_len: int,
    dtype: torch.dtype,
    device: torch.device,
    window: int | None,
    boolean: bool,
) -> torch.Tensor:
    """The 4-D `(batch or 1, 1, seq, seq)` mask that Hugging Face's `create_causal_mask` builds.

    Boolean (True = attend) for SDPA, whose fully masked rows (queries on left padding) give a zero output; additive
    float for eager attention (0 or the dtype's minimum, which keeps fully masked rows finite). The two differ only
    on those rows, and there each must match what the unsplit model computes with the same attention kernel.
    """
    query = torch.arange(seq_len, device=device)[:, None]
    key = torch.arange(seq_len, device=device)[None, :]
    allowed = key <= query
    if window is not None:
        allowed = allowed & (key > query - window)
    allowed = allowed[None, None]
    if attention_mask is not None:
        allowed = allowed & attention_mask[:, None, None, :].to(device=device, dtype=torch.bool)
    if boolean:
        return allowed
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min)


class PipelineStageModule(nn.Module):
    """One stage of a decoder-only causal LM, sharing its parameters with the model it was cut from.

    The stage mirrors the model's attribute paths with only its own pieces present (blocks sit in an `nn.ModuleDict`
    keyed by their original index), so `named_parameters()` yields the original Hugging Face names.

    `forward(x, attention_mask=None, position_ids=None)`: `x` is `input_ids` on the first stage and the hidden
    states elsewhere; the last stage returns logits, the others hidden states.

    Attributes:
        layer_indices: the original indices of this stage's blocks.
        tied_copy_names: names of parameters that duplicate another stage's parameter (the head of a tied model on
            the last stage); gradient clipping counts them once.
    """

    def __init__(self, model: nn.Module, parts: DecoderParts, stage_index: int, num_stages: int):
        super().__init__()
        self.parts = parts
        self.is_first = stage_index == 0
        self.is_last = stage_index == num_stages - 1
        self.layer_indices = list(stage_layer_ranges(parts.num_layers, num_stages)[stage_index])
        self.config = getattr(model, "config", None)
        attn = getattr(self.config, "_attn_implementation", None) or "eager"
        if attn not in ("eager", "sdpa"):
            raise ValueError(
                f"attn_implementation={attn!r} is not supported with pipeline stages; use 'sdpa' or 'eager'."
            )
        self._boolean_mask = attn == "sdpa"
        paths = parts.first_stage_paths() if self.is_first else []
        if parts.rotary_emb is not None:
            paths.append(parts.rotary_emb)
        if self.is_last:
            paths += parts.last_stage_paths()
        for path in paths:
            _attach(self, path, model.get_submodule(path))
        layers = model.get_submodule(parts.layers)
        _attach(self, parts.layers, nn.ModuleDict({str(i): layers[i] for i in self.layer_indices}))
        shares_head = parts.tied and self.is_last and not self.is_first
        self.tied_copy_names: tuple[str, ...] = (f"{parts.head}.weight",) if shares_head else ()

    def _module(self, path: str | None) -> nn.Module | None:
        return None if path is None else self.get_submodule(path)

    def _position_ids(self, attention_mask: torch.Tensor | None, batch: int, seq_len: int, device) -> torch.Tensor:
        if self.parts.family == "opt":
            # OPT numbers positions by counting real tokens (left padding shifts them), as OPTDecoder does.
            mask = torch.ones(batch, seq_len, device=device) if attention_mask is None else attention_mask
            return (torch.cumsum(mask, dim=1) * mask - 1).long()
        return torch.arange(seq_len, device=device).unsqueeze(0)

    def _embed(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor):
        parts = self.parts
        hidden = self._module(parts.embed_tokens)(input_ids)
        if parts.project_in is not None:
            hidden = self._module(parts.project_in)(hidden)
        if parts.family == "gpt2":
            hidden = hidden + self._module(parts.embed_positions)(position_ids)
        elif parts.family == "opt":
            mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
            hidden = hidden + self._module(parts.embed_positions)(mask, 0, position_ids=position_ids)
        if parts.embed_dropout is not None:
            hidden = self._module(parts.embed_dropout)(hidden)
        return hidden

    def _layer_window(self, index: int) -> int | None:
        window = getattr(self.config, "sliding_window", None) if self.parts.family == "llama" else None
        if not window:
            return None
        layer_types = getattr(self.config, "layer_types", None)
        if layer_types is not None:
            return window if layer_types[index] == "sliding_attention" else None
        return window

    def forward(
        self,
        x: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        batch, seq_len = x.shape[:2]
        if position_ids is None:
            position_ids = self._position_ids(attention_mask, batch, seq_len, x.device)
        hidden = self._embed(x, attention_mask, position_ids) if self.is_first else x
        layer_kwargs = {"position_ids": position_ids}
        if self.parts.rotary_emb is not None:
            layer_kwargs["position_embeddings"] = self._module(self.parts.rotary_emb)(hidden, position_ids)
        masks: dict[int | None, torch.Tensor] = {}
        layers = self._module(self.parts.layers)
        for index in self.layer_indices:
            window = self._layer_window(index)
            if window not in masks:
                masks[window] = _attention_mask(
                    attention_mask, seq_len, hidden.dtype, hidden.device, window, self._boolean_mask
                )
            out = layers[str(index)](hidden, attention_mask=masks[window], **layer_kwargs)
            hidden = out[0] if isinstance(out, tuple) else out
        if self.is_last:
            for path in self.parts.last_stage_paths():
                hidden = self._module(path)(hidden)
        return hidden


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

    Every rank of the pipeline group builds the same model (or loads it), creates its runner with its own stage
    index and calls `train_step` with the *same* batch; the optimizer step is the caller's, on
    `runner.stage_module.parameters()`. The stage index must equal the rank inside `group` (ranks of a pipeline are
    ordered by stage).

    Args:
        model: the full causal LM; the stage shares its parameters, the rest can be freed.
        stage_index: this rank's stage.
        num_stages: number of stages.
        group: the pipeline group (the stages of one replica); `None` is the default group.
        schedule: `"1f1b"` (needs `n_microbatches >= num_stages`) or `"gpipe"`.
        n_microbatches: micro-batches per step; must divide the batch size.
        data_parallel_group: replicas of this stage inside the worker; gradients are averaged over it (as DDP does).
        device: where the stage runs; defaults to the device of the model's parameters.
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
        self.parts = find_decoder_parts(model)
        self.stage_index, self.num_stages, self.group = stage_index, num_stages, group
        self.schedule_name, self.n_microbatches = schedule, n_microbatches
        self.data_parallel_group = data_parallel_group
        self.stage_module = PipelineStageModule(model, self.parts, stage_index, num_stages)
        if device is None:
            device = next(self.stage_module.parameters()).device
        self.device = torch.device(device)
        self._schedules: dict[tuple, object] = {}

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
        kwargs = {k: batch[k].to(self.device) for k in ("attention_mask", "position_ids") if batch.get(k) is not None}
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
            return self._run_unsplit(args[0], kwargs, labels, loss_kwargs["divisor"], train)
        schedule = self._schedule(train, tuple(batch["input_ids"].shape), sorted(kwargs))
        losses: list[torch.Tensor] = []
        target = labels if self.is_last else None
        run = schedule.step if train else schedule.eval
        run(*args, target=target, losses=losses, loss_kwargs=loss_kwargs, **kwargs)
        loss = torch.stack([x.detach().float() for x in losses]).sum() if self.is_last else torch.zeros(())
        return self._broadcast_loss(loss)

    def _run_unsplit(self, input_ids, kwargs: dict, labels, divisor: float, train: bool) -> torch.Tensor:
        """One stage: the micro-batches run one after another in this process, no schedule or communication."""
        n = self.n_microbatches
        kwarg_chunks = {k: torch.tensor_split(v, n) for k, v in kwargs.items()}
        total = torch.zeros(())
        for i, (ids, target) in enumerate(zip(torch.tensor_split(input_ids, n), torch.tensor_split(labels, n))):
            logits = self.stage_module(ids, **{k: v[i] for k, v in kwarg_chunks.items()})
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

    def _tied_parameter(self) -> nn.Parameter | None:
        if not self.parts.tied or self.num_stages == 1 or not (self.is_first or self.is_last):
            return None
        path = self.parts.embed_tokens if self.is_first else self.parts.head
        return self.stage_module.get_submodule(path).weight

    def sync_tied_gradients(self) -> None:
        """Give both copies of a tied embedding the sum of the first and the last stage's partial gradients.

        The two stages swap their partial gradients point to point inside the pipeline group (no extra process
        group is needed) and each adds the other's; `a + b == b + a` exactly, so the copies stay bitwise equal.
        """
        param = self._tied_parameter()
        if param is None:
            return
        own = param.grad if param.grad is not None else torch.zeros_like(param)
        other = torch.empty_like(own)
        peer = self._global_rank(self.num_stages - 1 if self.is_first else 0)
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

        A tied head missing from the dict (safetensors checkpoints store the shared matrix once) is read from the
        embedding's entry.

        Raises:
            KeyError: naming the tensors of this stage that the state dict lacks.
        """
        aliases = {f"{self.parts.head}.weight": f"{self.parts.embed_tokens}.weight"} if self.parts.tied else {}
        own = self.stage_module.state_dict(keep_vars=True)
        missing = [k for k in own if k not in full_state_dict and aliases.get(k) not in full_state_dict]
        if missing:
            raise KeyError(f"state dict lacks tensors of pipeline stage {self.stage_index}: {missing}")
        for name, tensor in own.items():
            source = full_state_dict[name] if name in full_state_dict else full_state_dict[aliases[name]]
            tensor.copy_(source.to(device=tensor.device, dtype=tensor.dtype))
