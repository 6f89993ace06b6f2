"""`DiLoCoTrainingArguments` + `DiLoCoTrainer`: DiLoCo as a drop-in for `TrainingArguments` / `Trainer`.

The Trainer keeps doing what it does (data, inner AdamW and LR schedule, logging, checkpoints); this module only
makes sure that nothing it does crosses workers between outer syncs, and hands every real inner optimizer step to the
`DiLoCo` engine (DiLoCo, Douillard et al. 2023, arXiv 2311.08105; Streaming DiLoCo, arXiv 2501.18512).

The default process group stays the whole world, so the Trainer's rank-based file names, `should_save` on global
rank 0 and Accelerate's data sharding by world rank keep working (with `pipeline_stages == 1` world-rank sharding
gives every (worker, data-parallel replica) pair its own shard; pipeline stages are `pipeline_trainer.py`'s). What
changes:

- DDP runs over the worker's data-parallel group only, and not at all when a worker is one process.
- The token count of `average_tokens_across_devices`, the logged loss and `num_input_tokens_seen` are summed or
  averaged inside the worker; `total_flos` is estimated without a collective.
- Evaluation and saving use the global parameters theta_g; each rank writes its DiLoCo state next to the Trainer's
  checkpoint files, and resuming restores it so training continues bitwise as if it had never stopped.

Deliberate global points (collectives over the world are allowed there): start (process groups, the engine's
initial broadcast and config check), evaluation (the Trainer's usual gathers of predictions and losses, on theta_g,
which is identical on every rank) and saving when the best metric is tracked (the Trainer's barrier).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from accelerate.utils import DistributedDataParallelKwargs, DistributedType, recursively_apply
from torch import nn
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.modelcard import extract_hyperparameters_from_trainer
from transformers.trainer import SCHEDULER_NAME
from transformers.utils import logging
from transformers.utils.hub import hf_api

from .checkpointing import last_complete_checkpoint, verify_checkpoint, write_manifest
from .config import DiLoCoConfig
from .core.diloco import DiLoCo
from .core.topology import Topology
from .hub import push_folder_to_hub
from .launch import init_process_group_for_restart
from .model_card import has_diloco_tag, write_model_card
from .monitoring import ComputeUtilization
from .pipeline_trainer import PipelineTrainerMixin
from .run_summary import check_processes_joined, run_summary

logger = logging.get_logger(__name__)

DILOCO_STATE_NAME = "diloco_state_rank{rank}.pt"
ALL_RESULTS_NAME = "all_results.json"


@dataclass(repr=False)
class DiLoCoTrainingArguments(TrainingArguments, DiLoCoConfig):
    """
    [`~transformers.TrainingArguments`] that also take every [`DiLoCoConfig`] field by name, as keyword arguments and
    on the command line through [`~transformers.HfArgumentParser`] (each field is defined once, in `DiLoCoConfig`).

    Parameters:
        All of [`~transformers.TrainingArguments`] and all of [`DiLoCoConfig`] (`inner_steps`, `outer_lr`,
        `outer_momentum`, `num_fragments`, `sync_delay`, `compression`, `data_parallel_per_worker`, ...).

    Differences from `TrainingArguments`:
        - DiLoCo fields are validated first, before any device or process group is set up, and a bad value raises a
          `ValueError` naming the field.
        - `average_tokens_across_devices` averages the token count over the processes of one worker only (the
          processes whose gradients DDP averages); workers never exchange it.
        - `accelerator_config.dispatch_batches` defaults to `False` (dispatching would broadcast every batch from
          rank 0 across workers) and `True` is refused; `accelerator_config.use_seedable_sampler=False` is refused
          (Accelerate would broadcast the sampler's seed across workers at every epoch).
    """

    def __post_init__(self) -> None:
        DiLoCoConfig.validate_diloco(self)
        init_process_group_for_restart(self.use_cpu, self.ddp_timeout or 1800)
        super().__post_init__()
        self._check_accelerator_config()

    def _check_accelerator_config(self) -> None:
        config = self.accelerator_config
        if config.dispatch_batches is None:
            config.dispatch_batches = False
        elif config.dispatch_batches:
            raise ValueError(
                "accelerator_config.dispatch_batches=True makes rank 0 read every batch and broadcast it to all ranks, "
                "a collective across workers at every step. DiLoCo needs every rank to read its own shard: leave it "
                "unset or False."
            )
        if not config.use_seedable_sampler:
            raise ValueError(
                "accelerator_config.use_seedable_sampler=False makes Accelerate broadcast the sampler's random state "
                "across all ranks at every epoch. DiLoCo needs the seedable sampler (the default): set it to True."
            )

    def diloco_config(self) -> DiLoCoConfig:
        """The DiLoCo fields as a plain [`DiLoCoConfig`]."""
        return DiLoCoConfig(**self.diloco_dict())


@dataclass
class _WorkerDDPKwargs(DistributedDataParallelKwargs):
    """Accelerate's DDP kwargs plus the process group DDP averages gradients over (the worker's, not the world)."""

    process_group: Any = None

    def to_dict(self, ignore_keys: tuple[str, ...] = ("comm_hook", "comm_wrapper", "comm_state_option")) -> dict:
        # The parent deep-copies every field; a ProcessGroup cannot be copied, and must not be.
        group = self.__dict__.pop("process_group")
        try:
            values = super().to_dict(ignore_keys)
        finally:
            self.__dict__["process_group"] = group
        values["process_group"] = group
        return values


class _DiLoCoStepCallback(TrainerCallback):
    """Hands every inner optimizer step that really happened to the engine, and times the steps."""

    def __init__(self, trainer: DiLoCoTrainer):
        self._trainer = trainer

    def on_step_begin(self, args, state, control, **kwargs) -> None:
        if self._trainer._utilization is not None:
            self._trainer._utilization.step_begin()

    def on_optimizer_step(self, args, state, control, **kwargs) -> None:
        self._trainer._diloco_step()
        if self._trainer._utilization is not None:
            self._trainer._utilization.step_end()


class DiLoCoTrainer(PipelineTrainerMixin, Trainer):
    """
    A [`~transformers.Trainer`] that trains with DiLoCo: every worker runs the Trainer's own inner optimizer and LR
    schedule on its shard of the data, and the `DiLoCo` engine averages the workers' progress every `inner_steps`
    steps. Takes exactly the arguments of `Trainer`; `args` must be a [`DiLoCoTrainingArguments`].

    Attributes:
        diloco (`DiLoCo` or `None`): the engine of the current (or last) `train()` call.
        diloco_topology (`Topology`): this rank's worker, data-parallel index and process groups.

    Notes:
        - The model that `evaluate`, `predict`, `save_model` and checkpoints see is the global model theta_g; after
          `train()`, `trainer.model` holds theta_g.
        - Checkpoints hold, besides the Trainer's files, `diloco_state_rank{rank}.pt` per rank: the engine state
          (theta_g, outer optimizer, this rank's local parameters and inner optimizer, exchanges in flight), buffers
          and grad scaler. Workers differ in all the local parts, so the inner optimizer and grad scaler are stored
          there only (no `optimizer.pt` / `scaler.pt`); `scheduler.pt` holds the LR schedule, the same on every rank.
          Resuming needs the same number of processes.
        - The model card (`README.md` of every saved folder) quotes only evaluations of the weights in that folder:
          after `train()`, those of `evaluate()` calls on the final model, and `save_metrics` keeps it equal to
          `all_results.json`. Arguments of `create_model_card` (and `push_to_hub`) are kept in `model_card_kwargs`
          for every later card.
        - Composes with other `Trainer` subclasses (e.g. TRL's `SFTTrainer`) in either base-class order: the loss
          scale and the per-step gathers stay inside the worker whatever `compute_loss` / `training_step` the class
          ends with.
        - Logged `loss` is the worker's loss (averaged over its data-parallel processes), `num_input_tokens_seen`
          counts the worker's tokens, and `diloco/*` metrics come from the engine.
        - With `pipeline_stages` > 1 each rank trains, syncs and keeps the state of its own pipeline stage only
          (`trainer.pipeline_runner.stage_module`; the other stages' parameters in `trainer.model` are freed); see
          [`~hf_diloco.pipeline_trainer.PipelineTrainerMixin`] for what changes.
    """

    def __init__(self, model: nn.Module | None = None, args: DiLoCoTrainingArguments | None = None, *pos, **kwargs):
        if args is None:
            args = DiLoCoTrainingArguments(output_dir="tmp_trainer")
        if not isinstance(args, DiLoCoTrainingArguments):
            raise TypeError(
                f"DiLoCoTrainer needs DiLoCoTrainingArguments, got {type(args).__name__}: build them with the same "
                "keywords plus the DiLoCo fields."
            )
        self.diloco: DiLoCo | None = None
        self.diloco_topology: Topology | None = None
        self.model_card_kwargs: dict[str, Any] = {}
        self._utilization: ComputeUtilization | None = None
        self._model_is_global = False  # after train(): the model holds theta_g (or the best checkpoint's)
        self._final_metrics: dict[str, float] = {}  # evaluations of the model as train() left it
        super().__init__(model, args, *pos, **kwargs)
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            raise ValueError(
                "DiLoCoTrainer needs full parameters on every process: DeepSpeed and FSDP are not supported."
            )
        self.add_callback(_DiLoCoStepCallback(self))
        # Instance attributes wrap whichever compute_loss / training_step the class hierarchy ends with, so a class
        # that also derives from another Trainer subclass (TRL's SFTTrainer, ...) keeps the worker's loss scale and
        # per-step gathers in either base-class order.
        self.compute_loss = self._with_worker_loss_scale(self.compute_loss)
        self.training_step = self._with_collectives_in_worker(self.training_step)

    # ---- process groups and model wrapping ----

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        # Accelerate passes `ddp_handler.to_kwargs()` to DistributedDataParallel: add the worker's group to it.
        handler = self.accelerator.ddp_handler or DistributedDataParallelKwargs()
        values = {f.name: getattr(handler, f.name) for f in fields(handler)}
        group = self._get_topology().data_parallel_group
        self.accelerator.ddp_handler = _WorkerDDPKwargs(**values, process_group=group)

    def _get_topology(self) -> Topology:
        if self.diloco_topology is None:
            _ = self.args.device  # initializes the default process group when launched distributed
            check_processes_joined(
                self.args.world_size,
                "On a machine without GPUs pass --use_cpu (DiLoCoTrainingArguments(use_cpu=True)) or set "
                "ACCELERATE_USE_CPU=1; to train one worker, launch one process.",
            )
            self.diloco_topology = Topology.from_default_group(
                pipeline_stages=self.args.pipeline_stages,
                data_parallel_per_worker=self.args.data_parallel_per_worker,
                timeout_seconds=self.args.sync_timeout_seconds,
            )
        return self.diloco_topology

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader: Any = None) -> nn.Module:
        unwrapped = self.accelerator.unwrap_model(model, keep_torch_compile=False) is model
        if training and unwrapped and self._worker_is_one_process():
            # A one-process worker has nobody to average gradients with: Accelerate's evaluation mode applies
            # mixed precision, device placement and compilation without the DDP wrap, and marks the model prepared
            # so the Trainer's `accelerator.prepare(model, optimizer)` keeps it as is.
            return self.accelerator.prepare_model(model, evaluation_mode=True)
        return super()._wrap_model(model, training=training, dataloader=dataloader)

    def _worker_is_one_process(self) -> bool:
        return (
            self.accelerator.distributed_type != DistributedType.NO
            and self._get_topology().data_parallel_group is None
        )

    # ---- atomic checkpoints ----

    def train(self, resume_from_checkpoint: str | bool | None = None, *args, **kwargs):
        """`Trainer.train`; `resume_from_checkpoint=True` picks the newest *complete* checkpoint, and a named one is
        verified against its manifest first (an incomplete or corrupt checkpoint raises `CheckpointError`)."""
        if resume_from_checkpoint is True:
            resume_from_checkpoint = last_complete_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(f"No complete checkpoint found in output_dir {self.args.output_dir} to resume from.")
        elif isinstance(resume_from_checkpoint, (str, os.PathLike)):
            verify_checkpoint(resume_from_checkpoint)
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def _save_checkpoint(self, model: nn.Module, trial: Any) -> None:
        # Rotation is postponed until the new checkpoint is complete, so a crash while saving never leaves only a
        # half-written checkpoint behind.
        limit = self.args.save_total_limit
        self.args.save_total_limit = None
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self.args.save_total_limit = limit
        if dist.is_available() and dist.is_initialized():
            dist.barrier()  # every rank has written its files
        if self.args.should_save:
            from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

            run_dir = self._get_output_dir(trial=trial)
            write_manifest(os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"))
            rotate_checkpoints(
                output_dir=run_dir,
                save_total_limit=limit,
                best_model_checkpoint=self.state.best_model_checkpoint,
                use_mtime=True,
            )
        if dist.is_available() and dist.is_initialized():
            dist.barrier()  # nobody resumes or rotates against a checkpoint still being published

    # ---- engine lifecycle ----

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        model, train_dataloader = super()._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)
        if self.diloco is not None:
            self.diloco.close()
        config = self.args.diloco_config()
        self.diloco = DiLoCo(
            self.diloco_module,
            self.optimizer,
            config,
            topology=self._get_topology(),
            num_blocks=self.diloco_num_blocks,
        )
        if self.is_world_process_zero():
            logger.warning(run_summary(self.diloco, max_steps))
        warning = config.short_run_warning(max_steps)
        if warning and self.args.should_log:
            logger.warning(warning)
        self._utilization = ComputeUtilization(lambda: self.diloco.stats["sync_wait_seconds"])
        self._model_is_global = False
        self._final_metrics = {}
        if resume_from_checkpoint is not None:
            self._load_diloco_state(resume_from_checkpoint)
        return model, train_dataloader

    def _diloco_step(self) -> None:
        if self.diloco is not None and not self.accelerator.optimizer_step_was_skipped:
            self.diloco.step()

    def _finalize_training(self, trial, num_train_samples, start_time):
        if self.diloco is not None:
            self.diloco.close()
            self._copy_global_parameters_into_model()
            self._model_is_global = True
        return super()._finalize_training(trial, num_train_samples, start_time)

    @torch.no_grad()
    def _copy_global_parameters_into_model(self) -> None:
        params = dict(self.diloco_module.named_parameters())
        for name, value in self.diloco.global_parameters().items():
            params[name].copy_(value)

    def _global_weights(self) -> contextlib.AbstractContextManager:
        # After training the model already holds theta_g, or the best checkpoint's weights with
        # `load_best_model_at_end`, which swapping in the engine's last theta_g would silently replace.
        if self.diloco is None or self._model_is_global:
            return contextlib.nullcontext()
        return self.diloco.global_weights()

    # ---- evaluation and saving use theta_g ----

    def evaluate(self, *args, **kwargs) -> dict[str, float]:
        with self._global_weights():
            metrics = super().evaluate(*args, **kwargs)
        if self._model_is_global:
            self._final_metrics.update({k: v for k, v in metrics.items() if k.startswith("eval_")})
        return metrics

    def predict(self, *args, **kwargs):
        with self._global_weights():
            return super().predict(*args, **kwargs)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Save the global model theta_g and, on the saving process, its DiLoCo model card as `README.md`."""
        # Pipeline stages all take part: each one's theta_g is gathered to the rank that writes.
        takes_part = self.args.should_save or self.pipeline_runner is not None
        context = self._global_weights() if takes_part else contextlib.nullcontext()
        with context:
            super().save_model(output_dir, _internal_call=_internal_call)
        if self.args.should_save:
            self._write_model_card(output_dir or self.args.output_dir)

    def create_model_card(
        self,
        language: str | None = None,
        license: str | None = None,
        tags: str | list[str] | None = None,
        model_name: str | None = None,
        finetuned_from: str | None = None,
        tasks: str | list[str] | None = None,
        dataset_tags: str | list[str] | None = None,
        dataset: str | list[str] | None = None,
        dataset_args: str | list[str] | None = None,
    ) -> None:
        """
        Write the DiLoCo model card (`hf_diloco.model_card`: the `diloco` tag, the DiLoCo settings, the measured
        communication, the inner hyperparameters, the training log and the evaluation of the saved weights) to
        `output_dir/README.md`, instead of the Trainer's generic card. `push_to_hub` calls it before uploading.

        Every argument is honoured as in `Trainer.create_model_card` (front matter `language`, `license`, `tags`,
        `base_model` from `finetuned_from`, `datasets` from `dataset_tags`; `model_name` is the title; `tasks` the
        task of `model-index`; `dataset` / `dataset_args` name the evaluation data) and kept in `model_card_kwargs`
        for the cards written later (every `save_model`).
        """
        given = dict(
            language=language,
            license=license,
            tags=tags,
            model_name=model_name,
            finetuned_from=finetuned_from,
            tasks=tasks,
            dataset_tags=dataset_tags,
            dataset=dataset,
            dataset_args=dataset_args,
        )
        self.model_card_kwargs.update({key: value for key, value in given.items() if value is not None})
        if self.is_world_process_zero():
            self._write_model_card(self.args.output_dir)

    def save_metrics(self, split: str, metrics: dict[str, float], combined: bool = True) -> None:
        """`Trainer.save_metrics`; after training, the card in `output_dir` then quotes `all_results.json`."""
        super().save_metrics(split, metrics, combined)
        folder = Path(self.args.output_dir)
        results_file, card = folder / ALL_RESULTS_NAME, folder / "README.md"
        if not (self.is_world_process_zero() and self._model_is_global and results_file.is_file()):
            return
        results = {k: v for k, v in json.loads(results_file.read_text()).items() if k.startswith("eval_")}
        if results and has_diloco_tag(card):
            self._final_metrics = results
            self._write_model_card(folder)

    def _write_model_card(self, folder: str) -> None:
        write_model_card(folder, **self._model_card_arguments(folder))

    def _model_card_arguments(self, folder: str) -> dict[str, Any]:
        """What `render_model_card` needs, from the run and from `model_card_kwargs`."""
        topology = self._get_topology()
        stats = self.diloco.stats if self.diloco is not None else {}
        # What this rank exchanges (one pipeline stage when pipelined), the same parameters DDP would all-reduce here.
        exchanged = sum(p.numel() for p in self.diloco_module.parameters() if p.requires_grad)
        options = self.model_card_kwargs
        results, evaluated = self._card_results()
        tasks = _as_list(options.get("tasks"))
        return {
            "settings": {**self.args.diloco_dict(), "num_workers": topology.num_workers},
            "communication": {
                "bytes_sent": stats.get("bytes_sent", 0),
                "steps": self.diloco.inner_step if self.diloco is not None else 0,
                "num_parameters": exchanged,
                "outer_steps": stats.get("outer_steps", 0),
                "sync_wait_seconds": stats.get("sync_wait_seconds", 0.0),
            },
            "data_description": options.get("data_description") or _describe_dataset(self.train_dataset),
            "base_model": options.get("finetuned_from") or _base_model_id(self.model),
            "training_results": results,
            "evaluated": evaluated,
            "model_name": options.get("model_name") or self._card_title(),
            "repo_id": self.hub_model_id or self.args.hub_model_id or str(folder),
            "extra_tags": _as_list(options.get("tags")),
            "datasets": _as_list(options.get("dataset_tags")) or None,
            "dataset_name": _dataset_name(options.get("dataset"), options.get("dataset_args")),
            "license": options.get("license"),
            "language": options.get("language"),
            "task": tasks[0] if tasks else "text-generation",
            "hyperparameters": extract_hyperparameters_from_trainer(self),
            "training_log": _training_log(self.state.log_history),
            "tokens_seen": self.state.num_input_tokens_seen * topology.num_workers,
        }

    def _card_results(self) -> tuple[dict[str, float], str]:
        """Metrics of an evaluation of exactly the weights being saved, and when it was taken."""
        if self._model_is_global:
            return dict(self._final_metrics), "after training"
        # During training a checkpoint holds theta_g of its step, which an evaluation at that step scored.
        step, results = self.state.global_step, {}
        for entry in self.state.log_history:
            if entry.get("step") == step:
                results.update({k: v for k, v in entry.items() if k.startswith("eval_")})
        return results, f"at step {step}"

    def _card_title(self) -> str:
        if self.args.hub_model_id:
            return self.args.hub_model_id.rstrip("/").split("/")[-1]
        if self.args.run_name and self.args.run_name != self.args.output_dir:
            return self.args.run_name
        return Path(self.args.output_dir).name

    def push_to_hub(
        self,
        commit_message: str | None = "End of training",
        blocking: bool = True,
        token: str | None = None,
        revision: str | None = None,
        private: bool | None = None,
        include_logs: bool | None = None,
        **kwargs: Any,
    ):
        """
        `Trainer.push_to_hub`, uploading what a user publishes ([`hf_diloco.hub.files_to_publish`]): the global
        weights, config, generation config, tokenizer, the DiLoCo card and the results files; not the checkpoints,
        optimizer, RNG or DiLoCo state or `training_args.bin`.

        Args:
            include_logs (`bool`, *optional*): also upload the TensorBoard logs under `runs/` (default: when
                `report_to` includes tensorboard).
            **kwargs: passed to [`~DiLoCoTrainer.create_model_card`].
        """
        self.callback_handler.on_push_begin(self.args, self.state, self.control)
        token = token if token is not None else self.args.hub_token
        if self.hub_model_id is None:
            self.init_hf_repo(token=token, private=private)
        self.save_model(_internal_call=True)
        if not self.is_world_process_zero():
            return None
        tags = _as_list(kwargs.pop("tags", None)) + list(getattr(self.model, "model_tags", None) or [])
        self.create_model_card(tags=list(dict.fromkeys(tags)) or None, **kwargs)
        self._finish_current_push()
        if include_logs is None:
            include_logs = "tensorboard" in (self.args.report_to or [])
        return push_folder_to_hub(
            self.args.output_dir,
            self.hub_model_id,
            token=token,
            commit_message=commit_message,
            include_logs=include_logs,
            revision=revision if revision is not None else self.args.hub_revision,
            run_as_future=not blocking,
            api=hf_api(),
            create_repo=False,  # init_hf_repo created it
        )

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if self.diloco is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        # Each rank's inner optimizer and grad scaler go into its DiLoCo state file only (workers differ in both);
        # the LR schedule, the same on every rank, into the Trainer's scheduler.pt.
        os.makedirs(output_dir, exist_ok=True)
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))
        scaler = getattr(self.accelerator, "scaler", None)
        state = {
            "engine": self.diloco.state_dict(),  # theta_g, this rank's parameters, outer and inner optimizer
            "buffers": {k: v.detach().cpu().clone() for k, v in self.model.named_buffers()},
            "scaler": scaler.state_dict() if scaler is not None else None,
            "world_size": self.args.world_size,
        }
        torch.save(state, self._diloco_state_path(output_dir))
        return None

    def _save_scaler(self, output_dir: str) -> None:
        if self.diloco is None:
            super()._save_scaler(output_dir)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None or not os.path.isfile(self._diloco_state_path(checkpoint)):
            return super()._load_optimizer_and_scheduler(checkpoint)
        # This rank's inner optimizer comes back with its DiLoCo state (`_load_diloco_state`).
        path = os.path.join(checkpoint, SCHEDULER_NAME)
        if os.path.isfile(path):
            self.lr_scheduler.load_state_dict(torch.load(path, weights_only=True))
        return None

    def _diloco_state_path(self, folder: str) -> str:
        return os.path.join(folder, DILOCO_STATE_NAME.format(rank=self.args.process_index))

    def _load_diloco_state(self, checkpoint: str) -> None:
        path = os.path.join(checkpoint, DILOCO_STATE_NAME.format(rank=self.args.process_index))
        if not os.path.isfile(path):
            if any(name.startswith("diloco_state_rank") for name in os.listdir(checkpoint)):
                raise FileNotFoundError(
                    f"{path} is missing: the checkpoint was written by a run with a different number of processes "
                    f"(this run has {self.args.world_size}); resume with the same number."
                )
            logger.warning(f"{checkpoint} has no DiLoCo state: starting the outer loop afresh from its weights.")
            return
        state = torch.load(path, map_location="cpu", weights_only=True)
        if state["world_size"] != self.args.world_size:
            raise ValueError(
                f"{checkpoint} was written by {state['world_size']} processes, this run has {self.args.world_size}."
            )
        self.diloco.load_state_dict(state["engine"])
        with torch.no_grad():
            for name, buffer in self.model.named_buffers():
                buffer.copy_(state["buffers"][name])
        scaler = getattr(self.accelerator, "scaler", None)
        if scaler is not None and state["scaler"] is not None:
            scaler.load_state_dict(state["scaler"])

    # ---- keep every per-step collective inside the worker ----

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
        accelerator = self.accelerator
        if "gather" in vars(accelerator):  # already routed by an enclosing call
            yield
            return
        accelerator.gather = self._worker_gather
        accelerator.gather_for_metrics = self._worker_gather_for_metrics
        try:
            yield
        finally:
            del accelerator.gather, accelerator.gather_for_metrics

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
            with _attribute(self.args, "average_tokens_across_devices", False):
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
        logs: dict[str, float] = {"loss": loss_scalar / (self.state.global_step - self._globalstep_last_logged)}
        if grad_norm is not None:
            logs["grad_norm"] = grad_norm.item() if isinstance(grad_norm, torch.Tensor) else grad_norm
        logs["learning_rate"] = lr if lr is not None else self._get_learning_rate()
        if self.diloco is not None:
            logs.update(self.diloco.metrics())
            logs["diloco/compute_utilization"] = self._utilization.value()
        self._total_loss_scalar += loss_scalar
        self._globalstep_last_logged = self.state.global_step
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


def _training_log(log_history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per evaluation during training, as the Trainer's cards show them (last training loss, epoch, step,
    the validation metrics)."""
    rows, training_loss = [], "No log"
    for entry in log_history:
        if "train_loss" in entry:  # the summary of a finished train(); later entries are not during training
            break
        training_loss = entry.get("loss", training_loss)
        if "eval_loss" not in entry:
            continue
        row = {"Training Loss": training_loss, "Epoch": entry.get("epoch"), "Step": entry.get("step")}
        for key, value in entry.items():
            if key.startswith("eval_") and not key.endswith(("_runtime", "_per_second")):
                name = (
                    "Validation Loss" if key == "eval_loss" else " ".join(p.capitalize() for p in key.split("_")[1:])
                )
                row[name] = value
        rows.append(row)
    return rows


def _as_list(value: str | list[str] | None) -> list[str]:
    return [value] if isinstance(value, str) else list(value or [])


def _dataset_name(dataset: str | list[str] | None, dataset_args: str | list[str] | None) -> str | None:
    names, configs = _as_list(dataset), _as_list(dataset_args)
    if not names:
        return None
    return ", ".join(
        f"{name} ({config})" if config else name for name, config in zip(names, configs + [""] * len(names))
    )


def _describe_dataset(dataset: Any) -> str:
    if dataset is None:
        return "Not recorded."
    info = getattr(dataset, "info", None)
    name = getattr(info, "dataset_name", None) or getattr(info, "builder_name", None)
    try:
        size = f"{len(dataset):,} training examples"
    except TypeError:
        size = "a streamed dataset"
    return f"`{name}`, {size}." if name else f"{size[0].upper()}{size[1:]}."


def _base_model_id(model: nn.Module) -> str | None:
    # A Hub id the training started from; not a random initialisation (empty) or a local folder.
    name = getattr(getattr(model, "config", None), "_name_or_path", "") or ""
    return name if name and not os.path.isdir(name) and not os.path.isabs(name) else None


@contextlib.contextmanager
def _attribute(obj: Any, name: str, value: Any) -> Iterator[None]:
    previous = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, previous)
