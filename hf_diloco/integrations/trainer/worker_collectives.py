"""Keeping every per-step collective of the Trainer inside the worker.

Between outer syncs nothing may cross workers (invariant 4 of docs/design.md), but the Trainer gathers and reduces
over the world at every step: the token count of `average_tokens_across_devices`, `num_input_tokens_seen`, the
logged loss, the FLOs, and a subclass's own per-step metrics (TRL's token accuracy). Here those run over the worker's
data-parallel group, and the loss scale follows the worker's size instead of the world's. `compute_loss` and
`training_step` are wrapped per instance, so a class that also derives from another Trainer subclass (TRL's
`SFTTrainer`, ...) keeps this in either base-class order.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import accelerate.accelerator
import torch
import torch.distributed as dist
from accelerate.utils import recursively_apply
from torch import nn

from .attributes import temporarily_set


class WorkerCollectives:
    """Mixin of [`DiLoCoTrainer`]: the Trainer's per-step gathers, loss scale, logging and FLOs inside the worker.

    Reads `diloco_run.global_points` and `session`. Calls `_get_topology` (`EngineLifecycle`), `_steps_since_last_log`
    and `_logged_at` (`RoundSchedule`).
    """

    def _keep_collectives_in_worker(self) -> None:
        """Wrap whichever `compute_loss` / `training_step` the class hierarchy ends with (call once, in `__init__`)."""
        self.compute_loss = self._with_worker_loss_scale(self.compute_loss)
        self.training_step = self._with_collectives_in_worker(self.training_step)

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device) -> torch.Tensor | int | None:
        with self._gathers_within_worker():
            return super()._get_num_items_in_batch(batch_samples, device)

    def _track_num_input_tokens(self, inputs: dict[str, Any]) -> None:
        with self._gathers_within_worker():
            super()._track_num_input_tokens(inputs)

    @contextlib.contextmanager
    def _gathers_within_worker(self) -> Iterator[None]:
        # The Trainer's per-step counts (and a subclass's per-step metrics, e.g. TRL's token accuracy) call
        # `accelerator.gather` / `gather_for_metrics` over the world; route them to the worker's group.
        # Inside an evaluation (whose own gathers run on the global points' group) the per-batch token count still
        # belongs to the worker: the routing of the evaluation is put back afterwards.
        accelerator = self.accelerator
        if getattr(accelerator.gather, "__func__", None) is WorkerCollectives._worker_gather:  # an enclosing call
            yield
            return
        saved = {
            name: vars(accelerator)[name] for name in ("gather", "gather_for_metrics") if name in vars(accelerator)
        }
        accelerator.gather = self._worker_gather
        accelerator.gather_for_metrics = self._worker_gather_for_metrics
        try:
            yield
        finally:
            del accelerator.gather, accelerator.gather_for_metrics
            for name, value in saved.items():
                setattr(accelerator, name, value)

    @contextlib.contextmanager
    def _gathers_on_global_points(self) -> Iterator[None]:
        """
        `evaluate` / `predict`: the evaluation loop gathers over every rank (the evaluation data is sharded over all
        of them). Inside, those gathers and the padding that precedes them run on the gloo group of the global
        points, bounded by `sync_timeout_seconds`, instead of the accelerator's default group: on GPUs that is an
        NCCL communicator across the workers, which cannot reach across sites (invariant 4 of docs/design.md).
        """
        group, accelerator = self.diloco_run.global_points, self.accelerator
        if group is None or "pad_across_processes" in vars(accelerator):  # one process, or already routed
            yield
            return
        saved_gather_function, saved_gather_object = self.gather_function, accelerate.accelerator.gather_object
        accelerator.gather = functools.partial(gather_on, group)
        accelerator.pad_across_processes = functools.partial(pad_across_on, group)
        accelerate.accelerator.gather_object = functools.partial(gather_objects_on, group)
        # The Trainer captured the accelerator's bound method at construction; this one reads the routed `gather`.
        self.gather_function = functools.partial(
            type(accelerator).gather_for_metrics, accelerator, use_gather_object=self.args.eval_use_gather_object
        )
        try:
            yield
        finally:
            del accelerator.gather, accelerator.pad_across_processes
            accelerate.accelerator.gather_object = saved_gather_object
            self.gather_function = saved_gather_function

    def _worker_gather(self, data: Any) -> Any:
        return recursively_apply(self._worker_gather_tensor, data, error_on_other_type=True)

    def _worker_gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        if use_gather_object or not _only_tensors(input_data):
            return self._worker_gather_objects(input_data)
        return self._worker_gather(input_data)

    def _worker_gather_objects(self, value: Any) -> list:
        """Like `accelerator.gather_object`, over the worker's processes: their values (lists concatenated)."""
        group = self._get_topology().data_parallel_group
        parts = [value]
        if group is not None:
            parts = [None] * dist.get_world_size(group)
            dist.all_gather_object(parts, value, group=group)
        return [item for part in parts for item in (part if isinstance(part, list) else [part])]

    def _worker_gather_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.reshape(1) if tensor.dim() == 0 else tensor
        group = self._get_topology().data_parallel_group
        if group is None:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        return torch.cat(parts)

    def _with_collectives_in_worker(self, training_step: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        @functools.wraps(training_step)
        def step_within_worker(*args: Any, **kwargs: Any) -> torch.Tensor:
            with self._gathers_within_worker():
                return training_step(*args, **kwargs)

        return step_within_worker

    def _with_worker_loss_scale(self, compute_loss: Callable[..., Any]) -> Callable[..., Any]:
        """`compute_loss` with the token count of `average_tokens_across_devices` taken over the worker."""

        @functools.wraps(compute_loss)
        def compute_worker_loss(
            model: nn.Module,
            inputs: dict[str, torch.Tensor | Any],
            return_outputs: bool = False,
            num_items_in_batch: torch.Tensor | int | None = None,
        ) -> torch.Tensor | tuple[torch.Tensor, Any]:
            # With the token count summed over the worker, DDP's gradient mean must be undone by the worker's size,
            # not the world's (which the Trainer, and subclasses following it, would use).
            rescale = (
                self.args.average_tokens_across_devices
                and (self.model_accepts_loss_kwargs or self.compute_loss_func is not None)
                and num_items_in_batch is not None
            )
            with temporarily_set(self.args, "average_tokens_across_devices", False):
                result = compute_loss(
                    model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
                )
            scale = self._get_topology().data_parallel_size
            if not rescale or scale == 1:
                return result
            if return_outputs:
                loss, outputs = result
                return loss * scale, outputs
            return result * scale

        return compute_worker_loss

    def _maybe_log_save_evaluate(
        self, tr_loss, grad_norm, model, trial, epoch, ignore_keys_for_eval, start_time, **kw
    ):
        if self.control.should_log and self.state.global_step > self._globalstep_last_logged:
            # Logged here, inside the worker; the Trainer's version would all-gather the loss over the world. It then
            # sees nothing new to log and only evaluates and saves.
            self._log_within_worker(tr_loss, grad_norm, start_time, kw.get("learning_rate"))
        super()._maybe_log_save_evaluate(
            tr_loss, grad_norm, model, trial, epoch, ignore_keys_for_eval, start_time, **kw
        )

    def _log_within_worker(self, tr_loss: torch.Tensor, grad_norm: Any, start_time: float, lr: float | None) -> None:
        loss = tr_loss.detach().clone()
        group = self._get_topology().data_parallel_group
        if group is not None:
            dist.all_reduce(loss, group=group)
            loss /= dist.get_world_size(group)
        loss_scalar = loss.item()
        tr_loss -= tr_loss
        logs: dict[str, float] = {"loss": loss_scalar / self._steps_since_last_log()}
        if grad_norm is not None:
            logs["grad_norm"] = grad_norm.item() if isinstance(grad_norm, torch.Tensor) else grad_norm
        logs["learning_rate"] = lr if lr is not None else self._get_learning_rate()
        session = self.diloco_run.session
        if session is not None:
            logs.update(session.metrics())
        self._total_loss_scalar += loss_scalar
        self._globalstep_last_logged = self.state.global_step
        self._logged_at()
        self.store_flos()
        self.log(logs, start_time)

    def store_flos(self) -> None:
        # The Trainer sums FLOs over the world with a collective at every log and save. Every process runs the same
        # batch shapes, so this rank's FLOs times the world size is the total, without talking to other workers.
        self.state.total_flos += self.current_flos * self.args.world_size
        self.current_flos = 0


def _only_tensors(data: Any) -> bool:
    try:
        recursively_apply(lambda tensor: tensor, data, error_on_other_type=True)
    except TypeError:
        return False
    return True


def gather_on(group: dist.ProcessGroup, data: Any) -> Any:
    """`accelerator.gather` over the gloo `group`: each tensor through the host, back on its own device."""

    def gather_tensor(tensor: torch.Tensor) -> torch.Tensor:
        host = (tensor.reshape(1) if tensor.dim() == 0 else tensor).detach().to("cpu").contiguous()
        parts = [torch.empty_like(host) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, host, group=group)
        return torch.cat(parts).to(tensor.device)

    return recursively_apply(gather_tensor, data, error_on_other_type=True)


def gather_objects_on(group: dist.ProcessGroup, value: Any) -> list:
    """`accelerate.utils.gather_object` over `group`: every rank's values, lists concatenated."""
    parts: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, value, group=group)
    return [item for part in parts for item in (part if isinstance(part, list) else [part])]


def pad_across_on(group: dist.ProcessGroup, data: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False):
    """`accelerator.pad_across_processes` over `group`: each tensor padded along `dim` to the longest of the ranks."""

    def pad(tensor: torch.Tensor) -> torch.Tensor:
        if dim >= tensor.dim():
            return tensor
        length = torch.tensor([tensor.shape[dim]], dtype=torch.int64)
        lengths = [torch.zeros_like(length) for _ in range(dist.get_world_size(group))]
        dist.all_gather(lengths, length, group=group)
        longest = int(max(lengths))
        if longest == tensor.shape[dim]:
            return tensor
        shape = list(tensor.shape)
        shape[dim] = longest
        padded = tensor.new_full(shape, pad_index)
        where = [slice(None)] * tensor.dim()
        start = longest - tensor.shape[dim] if pad_first else 0
        where[dim] = slice(start, start + tensor.shape[dim])
        padded[tuple(where)] = tensor
        return padded

    return recursively_apply(pad, data, error_on_other_type=True)
