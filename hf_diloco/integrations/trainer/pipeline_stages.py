"""Pipeline-parallel workers inside `DiLoCoTrainer` (DiLoCoX, arXiv 2506.21263).

With `pipeline_stages` = S > 1 a worker is S x `data_parallel_per_worker` = D processes: the stages of one replica
form a pipeline (`hf_diloco.parallel.pipeline.PipelineRunner`), D pipelines train side by side inside the worker, and M
workers sync through the outer loop (world = M x D x S). Every rank holds only its own stage: its parameters (those
of the other stages are freed after the stage is cut), the inner optimizer state of the stage, and the stage's part
of theta_g and of the outer optimizer state (DiLoCoX's dual optimizer policy). The model stays where it was built
(the CPU) through the pipeline's plan and start-up check; the other stages are then freed and only this rank's stage
is moved to the training device, so no rank ever places the whole model there. The outer exchange of a stage runs
among the same-stage ranks of all workers only.

`DiLoCoTrainer(...)` with `pipeline_stages` > 1 builds a `PipelinedDiLoCoTrainer` (of a subclass: the same class
with `PipelineTrainerMixin` in front), decided once at construction. `PipelineTrainerMixin` holds every override
this needs:

- the inner optimizer is the Trainer's (`create_optimizer`, AdamW and LR schedule by default) over the stage's
  parameters;
- a training step is `PipelineRunner.train_step` (forward and backward through the 1F1B or GPipe schedule, tied
  embeddings, gradient mean over the worker's data-parallel replicas; there is no DDP wrap), the loss is the same on
  every rank of a pipeline, and clipping uses the norm of the whole model across stages;
- data: Accelerate shards by world rank, which would hand the stages of one pipeline different batches; the
  dataloaders are sharded by `Topology.data_shard` instead, one shard per (worker, data-parallel replica);
- evaluation reports the loss only (logits stay on the last stage): each pipeline evaluates its shard, and the
  sums are added over the world once at the end (a global point, bounded by `sync_timeout_seconds`);
- saving gathers theta_g of the stages inside each worker (fast link only) and rank 0 writes one normal
  `save_pretrained` folder; loading reads only the stage's tensors from a folder written with any stage count.

Not supported with S > 1 (a `ValueError` at construction says so): `fp16` (its loss scaling happens outside the
schedule; use `bf16`), `gradient_accumulation_steps > 1` (the pipeline already accumulates over
`pipeline_microbatches`; raise the batch size instead) and `compute_metrics` (no logits on most ranks).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from accelerate.data_loader import prepare_data_loader
from safetensors import safe_open
from torch import nn
from torch.utils.data import DataLoader
from transformers import TrainerCallback
from transformers.trainer_utils import EvalLoopOutput
from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME

from ...parallel.pipeline import IGNORE_INDEX, PipelineRunner, count_loss_tokens
from ..accelerate_worker import prepare_without_ddp
from ..global_points import wait_for_all_ranks
from .attributes import temporarily_set


class PipelineTrainerMixin:
    """Pipeline-parallel training for [`DiLoCoTrainer`] (see the module docstring); mix in before `DiLoCoTrainer`.

    Relies on the trainer's `_get_topology()` for this rank's stage, data shard and process groups; writes
    `diloco_run.pipeline_runner` and `every_rank_saves_the_model`, and reads `global_points`. Overrides
    `_close_engine` (`EngineLifecycle`) and `_inner_state_is_per_rank` (`Checkpoints`).

    Attributes:
        pipeline_runner (`PipelineRunner`): this rank's stage.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._setup_pipeline()

    def _setup_pipeline(self) -> None:
        args = self.args
        if args.fp16:
            raise ValueError("fp16 is not supported with pipeline_stages > 1 (loss scaling); use bf16 instead.")
        if args.gradient_accumulation_steps != 1:
            raise ValueError(
                f"gradient_accumulation_steps={args.gradient_accumulation_steps} with pipeline_stages > 1: the "
                "pipeline already accumulates gradients over pipeline_microbatches; raise per_device_train_batch_size "
                "(and pipeline_microbatches) instead."
            )
        if self.compute_metrics is not None:
            raise ValueError(
                "compute_metrics is not supported with pipeline_stages > 1: the logits only exist on the last stage. "
                "Evaluation reports the loss (eval_loss)."
            )
        topology = self._get_topology()
        runner = self.diloco_run.pipeline_runner = PipelineRunner.for_worker(self.model, topology, args, args.device)
        # The plan and the start-up check ran where the model was built (the Trainer left it there, see
        # `_move_model_to_device`); only this rank's stage reaches the training device.
        runner.place_own_stage()
        self.diloco_run.every_rank_saves_the_model = True  # each stage's theta_g is gathered to the rank that writes
        self._tied_pair = bool(runner.tied_parameters())
        self._engine_module = _without(runner.stage_module, runner.stage_module.tied_copy_names)
        if self._tied_pair:
            self.add_callback(_TiedCopyCallback(self))

    def _move_model_to_device(self, model: nn.Module, device: torch.device) -> None:
        # The Trainer moves the whole model in its `__init__`, before the stages exist: that move waits for
        # `place_own_stage`, which moves this rank's stage only. Later moves find the other stages freed.
        if self.pipeline_runner is not None:
            super()._move_model_to_device(model, device)

    # ---- what the DiLoCo engine trains ----

    @property
    def diloco_module(self) -> nn.Module:
        """The module whose parameters the engine syncs: this rank's stage (its tied copy excepted)."""
        return self._engine_module

    @property
    def diloco_num_blocks(self) -> int:
        """Length of the whole block stack, so fragments follow global block indices on every stage."""
        return self.pipeline_runner.plan.num_layers

    # ---- tied parameters: the first stage's copy is the one the outer loop syncs ----
    #
    # A tied matrix (input and output embedding) lives on the first and the last stage. Inner steps keep the two
    # copies identical (summed gradients, same optimizer), but two outer syncs would not: each stage quantizes and
    # low-rank-compresses its own flat vector, so the copies would drift apart. Only the first stage's copy is synced;
    # the last stage receives it after every step (and at start and end), and around evaluation and saving, where it
    # must be theta_g.

    def _sync_tied_copy(self) -> None:
        """Copy the first stage's tied parameters into the last stage's copies (point to point inside the pipeline)."""
        runner = self.pipeline_runner
        if not self._tied_pair:
            return
        group = self._get_topology().pipeline_group
        for param in runner.tied_parameters():
            if runner.is_first:
                dist.send(
                    param.detach().contiguous(), dst=dist.get_global_rank(group, runner.num_stages - 1), group=group
                )
                continue
            received = torch.empty_like(param)
            dist.recv(received, src=dist.get_global_rank(group, 0), group=group)
            with torch.no_grad():
                param.copy_(received)

    @contextlib.contextmanager
    def _tied_copy_from_first_stage(self) -> Iterator[None]:
        """While the stages hold theta_g (evaluation, saving), the last stage's tied copies are theta_g too."""
        runner = self.pipeline_runner
        if not self._tied_pair or runner.is_first:
            self._sync_tied_copy()
            yield
            return
        copies = runner.tied_parameters()
        saved = [param.detach().clone() for param in copies]
        self._sync_tied_copy()
        try:
            yield
        finally:
            with torch.no_grad():
                for param, value in zip(copies, saved):
                    param.copy_(value)

    def _close_engine(self) -> None:
        super()._close_engine()
        self._sync_tied_copy()  # theta_g was just copied into the stages

    # ---- optimizer, model wrapping, training step, clipping ----

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        return super().create_optimizer(self.pipeline_runner.stage_module if model is None else model)

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader: Any = None) -> nn.Module:
        if training and self.accelerator.unwrap_model(model, keep_torch_compile=False) is model:
            # The runner averages gradients over the data-parallel replicas itself: no DDP.
            return prepare_without_ddp(self.accelerator, model)
        return model

    def training_step(
        self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: torch.Tensor | int | None = None
    ) -> torch.Tensor:
        model.train()
        batch = self._pipeline_batch(self._prepare_inputs(inputs))
        divisor = self._pipeline_divisor(batch["labels"], num_items_in_batch)
        with self.accelerator.autocast():
            loss = self.pipeline_runner.train_step(batch, divisor)
        return loss.to(self.args.device)

    def _pipeline_divisor(self, labels: torch.Tensor, num_items_in_batch: torch.Tensor | int | None) -> float:
        """The divisor of the summed token losses that gives the gradient the unsplit model would get.

        With `average_tokens_across_devices` the Trainer's count covers the worker's D replicas, and the unsplit
        trainer multiplies its loss by D before DDP's mean; the runner's mean over replicas needs the count over D.
        """
        if num_items_in_batch is None:
            return float(max(count_loss_tokens(labels), 1))
        divisor = float(num_items_in_batch)
        if self.args.average_tokens_across_devices:
            divisor /= self._get_topology().data_parallel_size
        return divisor

    def _pipeline_batch(self, inputs: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """The runner's inputs, with rows appended so the batch splits into `pipeline_microbatches` equal parts.

        An appended row repeats the first row with every label ignored: it adds nothing to the loss, the token count
        or the gradients (a short last batch of an epoch needs it).
        """
        batch = {"input_ids": inputs["input_ids"], "labels": inputs.get("labels", inputs["input_ids"])}
        batch.update({k: inputs[k] for k in ("attention_mask", "position_ids") if inputs.get(k) is not None})
        missing = -batch["input_ids"].shape[0] % self.args.pipeline_microbatches
        if missing == 0:
            return batch
        padded = {}
        for key, tensor in batch.items():
            extra = tensor[:1].expand(missing, *tensor.shape[1:])
            if key == "labels":
                extra = torch.full_like(extra, IGNORE_INDEX)
            padded[key] = torch.cat([tensor, extra])
        return padded

    def _clip_grad_norm(self, model: nn.Module) -> torch.Tensor:
        return self.pipeline_runner.clip_grad_norm_(self.args.max_grad_norm)

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Any:
        if grad_norm is None:
            # An infinite bound scales every gradient by exactly 1: the norm of the whole pipeline, nothing clipped.
            grad_norm = self.pipeline_runner.clip_grad_norm_(float("inf"))
        return grad_norm

    # ---- data: one shard per pipeline ----

    def get_train_dataloader(self) -> DataLoader:
        with self._shard_per_pipeline(even_batches=None):
            return super().get_train_dataloader()

    def get_eval_dataloader(self, eval_dataset: Any = None) -> DataLoader:
        with self._shard_per_pipeline(even_batches=False):  # no repeated samples: the loss sums are exact
            return super().get_eval_dataloader(eval_dataset)

    def get_test_dataloader(self, test_dataset: Any) -> DataLoader:
        with self._shard_per_pipeline(even_batches=False):
            return super().get_test_dataloader(test_dataset)

    @contextlib.contextmanager
    def _shard_per_pipeline(self, even_batches: bool | None) -> Iterator[None]:
        # The Trainer hands its DataLoader to `accelerator.prepare`, which shards by world rank.
        self.accelerator.prepare = functools.partial(self._prepare_pipeline_dataloader, even_batches=even_batches)
        try:
            yield
        finally:
            del self.accelerator.prepare

    def _prepare_pipeline_dataloader(self, dataloader: DataLoader, even_batches: bool | None) -> DataLoader:
        accelerator = self.accelerator
        index, count = self._get_topology().data_shard
        prepared = prepare_data_loader(
            dataloader,
            accelerator.device,
            num_processes=count,
            process_index=index,
            split_batches=accelerator.split_batches,
            put_on_device=accelerator.device_placement,
            rng_types=list(accelerator.rng_types),
            dispatch_batches=False,
            even_batches=accelerator.even_batches if even_batches is None else even_batches,
            use_seedable_sampler=accelerator.use_seedable_sampler,
            data_seed=accelerator.dataloader_config.data_seed,
            non_blocking=accelerator.non_blocking,
            use_stateful_dataloader=accelerator.use_stateful_dataloader,
        )
        accelerator._dataloaders.append(prepared)
        return prepared

    # ---- evaluation: loss only ----

    def evaluation_loop(
        self,
        dataloader: DataLoader,
        description: str,
        prediction_loss_only: bool | None = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
    ) -> EvalLoopOutput:
        """The Trainer's loss (the mean over samples of each batch's token-mean loss) through the pipeline."""
        with self._tied_copy_from_first_stage():
            totals = self._pipeline_eval_sums(dataloader)
        if self._get_topology().stage_index != 0:
            totals.zero_()  # every stage of a pipeline saw the same loss: count each pipeline once
        group = self.diloco_run.global_points
        if group is not None:
            wait_for_all_ranks(group, f"the end of evaluation ({description})", self.args.sync_timeout_seconds)
            dist.all_reduce(totals, group=group)
        samples = int(totals[1])
        metrics = {f"{metric_key_prefix}_loss": float(totals[0] / totals[1]) if samples else float("nan")}
        return EvalLoopOutput(predictions=None, label_ids=None, metrics=metrics, num_samples=samples)

    def _pipeline_eval_sums(self, dataloader: DataLoader) -> torch.Tensor:
        self.model.eval()
        totals = torch.zeros(2, dtype=torch.float64)  # sum of batch_size * batch loss, number of samples
        for inputs in dataloader:
            inputs = self._prepare_inputs(inputs)
            divisor = self._local_num_items(inputs)
            with self.accelerator.autocast():
                loss = self.pipeline_runner.eval_loss(self._pipeline_batch(inputs), divisor)
            rows = inputs["input_ids"].shape[0]
            totals += torch.tensor([rows * float(loss), rows], dtype=torch.float64)
            self.control = self.callback_handler.on_prediction_step(self.args, self.state, self.control)
        return totals

    def _local_num_items(self, inputs: dict[str, Any]) -> torch.Tensor | int | None:
        """The Trainer's token count of one batch (its own rule: shifted labels or not), without any collective.

        Eval shards may hold different numbers of batches (no repeated samples), so nothing may be gathered per batch.
        """
        with temporarily_set(self.args, "average_tokens_across_devices", False):
            return self._get_num_items_in_batch([inputs], self.args.device)

    # ---- saving and loading ----

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        if state_dict is not None:
            return super()._save(output_dir, state_dict=state_dict)
        # Every pipeline gathers on its first stage (inside the worker only); the rank that writes is one of those.
        with self._tied_copy_from_first_stage():
            state_dict = self.pipeline_runner.gather_state_dict(dst=0)
        if not self.args.should_save:
            return None
        if state_dict is None:
            raise ValueError(
                f"Rank {self.args.process_index} should save but is stage {self.pipeline_runner.stage_index} of its "
                "pipeline, not stage 0: with pipeline_stages > 1 save from the first rank of each worker "
                "(save_on_each_node needs whole workers per node)."
            )
        # The gathered stages hold two copies of a tied matrix; one tensor under both names lets `save_pretrained`
        # drop the alias as it does for the whole model, so the file has the tensors a plain save writes.
        for first, last in self.pipeline_runner.plan.tied:
            state_dict[last] = state_dict[first]
        return super()._save(output_dir, state_dict=state_dict)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        self.pipeline_runner.load_stage_state(SafetensorsFolder(resume_from_checkpoint))
        return None

    def _load_best_model(self) -> None:
        self.pipeline_runner.load_stage_state(SafetensorsFolder(self.state.best_model_checkpoint))
        return None

    def _inner_state_is_per_rank(self, checkpoint: str) -> bool:
        # The Trainer's optimizer.pt would be rank 0's stage only: each rank's inner optimizer state comes back from
        # its own DiLoCo state file, never from there.
        return True


class _TiedCopyCallback(TrainerCallback):
    """Keeps the last stage's tied head equal to the first stage's embedding (see `_sync_tied_copy`)."""

    def __init__(self, trainer: PipelineTrainerMixin):
        self._trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs) -> None:
        self._trainer._sync_tied_copy()  # after a resume, the head came from the folder, the embedding from the state

    def on_step_end(self, args, state, control, **kwargs) -> None:
        self._trainer._sync_tied_copy()  # the outer sync may just have written the embedding


class SafetensorsFolder(Mapping):
    """Read-only, lazy mapping from tensor name to tensor over a `save_pretrained` folder (one file or sharded).

    A pipeline stage looks up only its own tensors, so loading never materialises the whole model on one rank.
    """

    def __init__(self, folder: str):
        index, single = os.path.join(folder, SAFE_WEIGHTS_INDEX_NAME), os.path.join(folder, SAFE_WEIGHTS_NAME)
        if os.path.isfile(index):
            with open(index) as handle:
                weight_map = json.load(handle)["weight_map"]
            self._files = {name: os.path.join(folder, file) for name, file in weight_map.items()}
        elif os.path.isfile(single):
            with safe_open(single, framework="pt") as handle:
                self._files = dict.fromkeys(handle.keys(), single)
        else:
            raise FileNotFoundError(
                f"{folder} has neither {SAFE_WEIGHTS_NAME} nor {SAFE_WEIGHTS_INDEX_NAME}: pipeline stages load "
                "safetensors checkpoints (save_pretrained's default)."
            )

    def __getitem__(self, name: str) -> torch.Tensor:
        with safe_open(self._files[name], framework="pt") as handle:
            return handle.get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._files)

    def __len__(self) -> int:
        return len(self._files)


def _without(module: nn.Module, names: tuple[str, ...]) -> nn.Module:
    """A view of `module` (same parameter and buffer names, same block containers) without the parameters `names`.

    Modules on the way to an excluded parameter are replaced by plain containers holding everything else they hold.
    """
    if not names:
        return module
    view = nn.Module()
    for child_name, child in module.named_children():
        inner = tuple(name[len(child_name) + 1 :] for name in names if name.startswith(f"{child_name}."))
        view.add_module(child_name, _without(child, inner) if inner else child)
    for name, param in module.named_parameters(recurse=False):
        if name not in names:
            view.register_parameter(name, param)
    for name, buffer in module.named_buffers(recurse=False):
        view.register_buffer(name, buffer, persistent=name not in module._non_persistent_buffers_set)
    return view
