"""The pipeline's token-weighted loss and gradient clipping by the whole model's norm (the tied matrix counted once)."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .plan import IGNORE_INDEX


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
