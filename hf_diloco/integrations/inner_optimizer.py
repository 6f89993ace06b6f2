"""The inner optimizer a front-end builds when asked for one other than the Trainer's own: `inner_optimizer: muon`.

MuLoCo (arXiv 2505.23725) trains each DiLoCo worker with Muon inside. `torch.optim.Muon` orthogonalises the update of a
2-D weight matrix; embeddings, norms, biases and the output head are not matrices of that kind (Keller Jordan's Muon,
and Moonshot's "Muon is Scalable", arXiv 2502.16982, leave them to AdamW). So:

- Muon (`torch.optim.Muon`, Nesterov momentum 0.95, 5 Newton-Schulz steps, `adjust_lr_fn="match_rms_adamw"`): every
  2-D weight inside the block stack (`model.layers`, `transformer.h`, ... as `core.fragments.find_block_stack` finds
  it). With Moonshot's adjustment the update's RMS matches AdamW's, so Muon takes the run's `learning_rate` and
  `weight_decay` as they are, the rule the Muon literature prescribes for reusing AdamW's settings.
- AdamW (the run's betas, epsilon, and weight decay where the Trainer would decay): everything else, i.e. the
  embeddings, the head, every norm and bias.

Both live in one `torch.optim.Optimizer` (`MuonWithAdamW`) whose param groups and state are the two optimizers' own,
so the Trainer's LR scheduler, GradScaler, checkpoints (`state_dict`) and the DiLoCo engine see one ordinary optimizer.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..core.layout.fragments import find_block_stack

INNER_OPTIMIZERS = ("adamw", "muon")


@dataclass
class InnerOptimizerSettings:
    """The front-ends' choice of inner optimizer (a `DiLoCoTrainingArguments` field, a key of the main job's
    `training:` section and a flag of `hf-diloco pretrain`)."""

    inner_optimizer: str = field(
        default="adamw",
        metadata={
            "help": "adamw: the Trainer's optimizer (`optim`); muon: torch.optim.Muon for the 2-D weights of the block "
            "stack and AdamW for embeddings, head, norms and biases, both at learning_rate (MuLoCo)."
        },
    )

    def check_inner_optimizer(self) -> None:
        if self.inner_optimizer not in INNER_OPTIMIZERS:
            raise ValueError(
                f"inner_optimizer must be one of {', '.join(INNER_OPTIMIZERS)}, got {self.inner_optimizer!r}."
            )


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon over `muon_groups` and AdamW over `adamw_groups`, as one optimizer: `param_groups` are Muon's groups then
    AdamW's (the same dicts, so a scheduler's learning rate reaches both) and `state` is shared by both."""

    def __init__(self, muon_groups: list[dict[str, Any]], adamw_groups: list[dict[str, Any]], **adamw_defaults: Any):
        lr = adamw_defaults["lr"]
        muon_groups = [group for group in muon_groups if group["params"]]
        adamw_groups = [group for group in adamw_groups if group["params"]]
        self._muon = torch.optim.Muon(muon_groups, lr=lr, adjust_lr_fn="match_rms_adamw") if muon_groups else None
        self._adamw = torch.optim.AdamW(adamw_groups, **adamw_defaults) if adamw_groups else None
        parts = [part for part in (self._muon, self._adamw) if part is not None]
        super().__init__([group for part in parts for group in part.param_groups], defaults={"lr": lr})
        self._share_groups_and_state()
        self.register_load_state_dict_post_hook(lambda optimizer: optimizer._share_groups_and_state())

    def _share_groups_and_state(self) -> None:
        """Point both optimizers at this one's param groups (Muon's first) and state: `load_state_dict` replaces
        them with new objects."""
        index = 0
        for part in (self._muon, self._adamw):
            if part is None:
                continue
            part.param_groups = self.param_groups[index : index + len(part.param_groups)]
            part.state = self.state
            index += len(part.param_groups)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for part in (self._muon, self._adamw):
            if part is not None:
                part.step()
        return loss


def muon_parameter_names(model: nn.Module) -> set[str]:
    """The parameters Muon takes: the 2-D weights inside the block stack."""
    stack = find_block_stack(model)
    if stack is None:
        return set()
    prefix = stack + "."
    return {name for name, param in model.named_parameters() if name.startswith(prefix) and param.dim() == 2}


def build_muon_with_adamw(
    model: nn.Module, learning_rate: float, weight_decay: float, decay_names: Iterable[str], adamw_kwargs: dict
) -> MuonWithAdamW:
    """Muon for the block stack's matrices, AdamW (with `adamw_kwargs`: betas, eps) for the rest, weight decay where
    `decay_names` says (Muon's matrices always decay, as in Moonshot's recipe)."""
    muon_names, decay = muon_parameter_names(model), set(decay_names)
    if not muon_names:
        raise ValueError(
            "inner_optimizer: muon found no block stack of 2-D weights in this model (model.layers, transformer.h, "
            "...): use inner_optimizer: adamw for it."
        )
    trained = [(name, param) for name, param in model.named_parameters() if param.requires_grad]
    muon = [param for name, param in trained if name in muon_names]
    decayed = [param for name, param in trained if name not in muon_names and name in decay]
    plain = [param for name, param in trained if name not in muon_names and name not in decay]
    return MuonWithAdamW(
        [{"params": muon, "weight_decay": weight_decay}],
        [{"params": decayed, "weight_decay": weight_decay}, {"params": plain, "weight_decay": 0.0}],
        lr=learning_rate,
        **adamw_kwargs,
    )
