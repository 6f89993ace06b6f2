"""`PipelineRunner`: one rank's stage of a pipeline-parallel worker: forward, backward, loss, clipping, saving."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

from .loss import _clip_grad_norm, _flat_all_reduce, _group_size, causal_lm_loss, count_loss_tokens
from .plan import SCHEDULES
from .stages import build_stages, free_other_stages

if TYPE_CHECKING:
    from ...core.layout.topology import Topology
    from ...core.settings.config import DiLoCoConfig


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

    @classmethod
    def for_worker(
        cls, model: nn.Module, topology: Topology, config: DiLoCoConfig, device: torch.device | str | None
    ) -> PipelineRunner:
        """This rank's stage of a DiLoCo worker: its stage and groups from `topology`, the schedule from `config`."""
        return cls(
            model,
            stage_index=topology.stage_index,
            num_stages=config.pipeline_stages,
            group=topology.pipeline_group,
            schedule=config.pipeline_schedule,
            n_microbatches=config.pipeline_microbatches,
            data_parallel_group=topology.data_parallel_group,
            device=device,
        )

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
