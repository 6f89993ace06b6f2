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

Deliberate global points (collectives over the world are allowed there): start (process groups, the check that the
settings every rank must share agree, the engine's initial broadcast and config check), evaluation (the Trainer's
usual gathers of predictions and losses, on theta_g, which is identical on every rank) and saving (bounded barriers
before, inside and after each checkpoint; see `hf_diloco.global_points`). Every wait for the other ranks at these
points, and every outer exchange, fails within `sync_timeout_seconds` naming the point and the missing ranks;
evaluation's gathers are the Trainer's own and are bounded by `ddp_timeout`.
"""

from __future__ import annotations

import contextlib
import copy
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
from transformers import Trainer, TrainerCallback, TrainerState, TrainingArguments
from transformers.modelcard import extract_hyperparameters_from_trainer
from transformers.trainer import SCHEDULER_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, TrainOutput
from transformers.utils import CONFIG_NAME, logging
from transformers.utils.hub import hf_api

from .checkpointing import (
    CheckpointError,
    checkpoint_to_resume,
    make_way_for_checkpoint,
    read_trainer_state,
    rotate_checkpoints,
    save_failure,
    verify_checkpoint,
    write_manifest,
)
from .config import DiLoCoConfig
from .core.diloco import DiLoCo
from .core.topology import Topology
from .global_points import PeerTimeoutError, check_ranks_agree, global_point_group, wait_for_all_ranks
from .hub import push_folder_to_hub
from .launch import init_process_group_for_restart
from .model_card import has_diloco_tag, write_model_card
from .modeling import architecture, describe_architecture_change
from .monitoring import ComputeUtilization
from .pipeline_trainer import PipelineTrainerMixin
from .run_summary import check_processes_joined, run_summary

logger = logging.get_logger(__name__)

DILOCO_STATE_NAME = "diloco_state_rank{rank}.pt"
ALL_RESULTS_NAME = "all_results.json"
# DiLoCo settings each node may choose for itself (where theta_g lives, how long it waits for peers).
_NODE_LOCAL_DILOCO_FIELDS = frozenset({"global_copy_device", "sync_timeout_seconds"})


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

    def __getstate__(self) -> dict[str, Any]:
        # The Trainer pickles its arguments into `training_args.bin` in every checkpoint and in the saved model, which
        # may be pushed: every `*_token` (a Hub token given on the command line) is left out of the pickle.
        return {name: None if name.endswith("_token") else value for name, value in self.__dict__.items()}

    def __copy__(self) -> DiLoCoTrainingArguments:
        clone = self.__class__.__new__(self.__class__)
        clone.__dict__.update(self.__dict__)
        return clone

    def __deepcopy__(self, memo: dict[int, Any]) -> DiLoCoTrainingArguments:
        # Copies keep their tokens (only the pickle leaves them out).
        clone = self.__class__.__new__(self.__class__)
        memo[id(self)] = clone
        clone.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return clone


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
        self.resumed_a_finished_run = False  # set by train(): the checkpoint it resumed from was at the last step
        self._settings_that_must_agree: dict[str, Any] = {}
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

    # ---- atomic checkpoints, resume and the global points ----

    def train(self, resume_from_checkpoint: str | bool | None = None, *args, **kwargs):
        """
        `Trainer.train`, with these guarantees about checkpoints and the other ranks:

        - `resume_from_checkpoint=True` picks the newest *complete* checkpoint in `output_dir`; when the folder holds
          checkpoints but none verifies it raises `CheckpointError` (naming each one's problem) instead of starting
          over; a named checkpoint is verified against its manifest first.
        - A checkpoint written by another number of processes or for another model architecture is refused before
          anything is loaded.
        - Before any work, every rank checks with one all-gather that the settings which must agree do
          (`settings_that_must_agree`); each global point waits at most `sync_timeout_seconds` for the other ranks
          and then fails naming the ranks that did not arrive.
        - Resuming from a checkpoint at or past the last step trains nothing and writes nothing: `trainer.model`
          gets the checkpoint's (global) weights, `resumed_a_finished_run` is set and the output folder is left as
          it is.
        """
        self.resumed_a_finished_run = False
        checkpoint = self._checkpoint_to_resume(resume_from_checkpoint)
        if checkpoint is not None:
            self._check_checkpoint_fits(checkpoint)
        self._check_ranks_agree(checkpoint)
        if checkpoint is not None and self._run_was_finished(checkpoint):
            return self._leave_finished_run(checkpoint)
        return super().train(checkpoint, *args, **kwargs)

    def require_agreement(self, name: str, value: Any) -> None:
        """
        Add a setting that must be equal on every rank to the start-of-training check (for example the main job's
        tokenizer and data fingerprints). `value` must be JSON-serialisable; give a large one as
        `hf_diloco.global_points.fingerprint(value)`.
        """
        self._settings_that_must_agree[name] = value

    def settings_that_must_agree(self, checkpoint: str | None = None) -> dict[str, Any]:
        """
        The settings every rank must share, checked at the start of `train()`: a difference would make ranks meet
        at different steps (a hang) or train different things silently. The schedule (steps, saving, evaluation,
        logging, gradient accumulation), the seeds, the whole model config, the DiLoCo settings, the checkpoint
        resumed from, and whatever `require_agreement` added. Subclasses may add more.
        """
        args = self.args
        settings: dict[str, Any] = {
            "world_size": args.world_size,
            "max_steps": args.max_steps,
            "gradient_accumulation_steps": args.gradient_accumulation_steps,
            "save": [str(args.save_strategy), args.save_steps, args.save_only_model, args.save_on_each_node],
            "evaluation": [str(args.eval_strategy), args.eval_steps, args.eval_on_start, args.eval_delay],
            "eval_batch": [args.per_device_eval_batch_size, args.eval_accumulation_steps, _length(self.eval_dataset)],
            "logging": [str(args.logging_strategy), args.logging_steps, args.logging_first_step],
            "best_model": [args.load_best_model_at_end, args.metric_for_best_model],
            "seeds": [args.seed, args.data_seed, args.full_determinism],
            "diloco": {k: v for k, v in args.diloco_dict().items() if k not in _NODE_LOCAL_DILOCO_FIELDS},
            "resume_from_step": None if checkpoint is None else read_trainer_state(checkpoint).get("global_step"),
        }
        if args.max_steps <= 0:  # the schedule then follows the data
            settings["epochs"] = [args.num_train_epochs, _length(self.train_dataset)]
        config = getattr(self.model, "config", None)
        if config is not None and hasattr(config, "to_dict"):
            settings["model_config"] = architecture(config)
        settings.update(self._settings_that_must_agree)
        return settings

    def _checkpoint_to_resume(self, resume_from_checkpoint: str | bool | os.PathLike | None) -> str | None:
        if resume_from_checkpoint is True:
            checkpoint = checkpoint_to_resume(
                self.args.output_dir,
                start_over="call train() without resume_from_checkpoint (or pass --auto_resume false)",
            )
            if checkpoint is None:
                raise ValueError(f"No checkpoint found in output_dir {self.args.output_dir} to resume from.")
            return checkpoint
        if isinstance(resume_from_checkpoint, (str, os.PathLike)):
            verify_checkpoint(resume_from_checkpoint)
            return str(resume_from_checkpoint)
        return None

    def _check_checkpoint_fits(self, checkpoint: str) -> None:
        """Refuse a checkpoint of another world size or model architecture before anything is loaded from it."""
        writers = [name for name in os.listdir(checkpoint) if name.startswith("diloco_state_rank")]
        way_out = (
            "or start a new run in another --output_dir (or pass --auto_resume false / call train() without "
            "resume_from_checkpoint to start over in this one)"
        )
        if writers and len(writers) != self.args.world_size:
            raise CheckpointError(
                f"{checkpoint} was written by {len(writers)} processes, this run has {self.args.world_size}: DiLoCo "
                f"state is per process. Resume with {len(writers)} processes, {way_out}."
            )
        config_path = os.path.join(checkpoint, CONFIG_NAME)
        config = getattr(self.model, "config", None)
        if not os.path.isfile(config_path) or config is None or not hasattr(config, "to_dict"):
            return
        saved = type(config).from_json_file(config_path)
        change = describe_architecture_change(architecture(saved), architecture(config))
        if change:
            raise CheckpointError(
                f"{checkpoint} holds another model than this run builds ({change}; checkpoint -> this run). Resume "
                f"with the model settings it was saved with (`model:` in the config), {way_out}."
            )

    def _check_ranks_agree(self, checkpoint: str | None) -> None:
        check_ranks_agree(
            self.settings_that_must_agree(checkpoint),
            self._global_points,
            self.args.sync_timeout_seconds,
            point="the start of training",
        )

    @functools.cached_property
    def _global_points(self) -> dist.ProcessGroup | None:
        """The gloo group of all ranks for the bounded global points, made at the first (at the start of `train()`)."""
        self._get_topology()  # the process groups exist before this one, in the same order on every rank
        return global_point_group(self.args.sync_timeout_seconds)

    def wait_for_all_ranks(self, point: str) -> None:
        """
        Wait until every rank has reached `point` (a global point, e.g. the end of the job), at most
        `sync_timeout_seconds`; then raise `PeerTimeoutError` naming the point and the ranks that did not arrive.
        Every rank must call it, in the same order as the trainer's other global points.
        """
        wait_for_all_ranks(self._global_points, point, self.args.sync_timeout_seconds)

    @contextlib.contextmanager
    def _bounded_trainer_barrier(self, point: str) -> Iterator[None]:
        """Inside, the Trainer's own `dist.barrier()` (while saving with a tracked best metric) is one of ours: bounded
        by `sync_timeout_seconds` and naming the ranks that do not arrive, instead of silence until `ddp_timeout`."""
        original = dist.barrier

        def barrier(*args, **kwargs):
            if args or kwargs:  # a barrier on a particular group is not the Trainer's
                return original(*args, **kwargs)
            return self.wait_for_all_ranks(f"the Trainer's barrier in {point}")

        dist.barrier = barrier
        try:
            yield
        finally:
            dist.barrier = original

    def _run_was_finished(self, checkpoint: str) -> bool:
        state = read_trainer_state(checkpoint)
        if self.args.max_steps > 0:
            return state["global_step"] >= self.args.max_steps
        # An epoch-based run: finished if it reached its last step and this run asks for no more epochs.
        return state["global_step"] >= state.get("max_steps", 0) > 0 and (
            self.args.num_train_epochs <= state.get("num_train_epochs", 0)
        )

    def _leave_finished_run(self, checkpoint: str) -> TrainOutput:
        """Resuming at or past the last step: load the checkpoint's weights (theta_g, or the best checkpoint's with
        `load_best_model_at_end`, as the finished run ended with), train and write nothing."""
        self.state = TrainerState.load_from_json(os.path.join(checkpoint, "trainer_state.json"))
        best = self.state.best_model_checkpoint
        use_best = self.args.load_best_model_at_end and best is not None and os.path.isdir(best)
        self._load_from_checkpoint(best if use_best else checkpoint)
        self._model_is_global = True
        self.resumed_a_finished_run = True
        if self.is_world_process_zero():
            logger.warning(
                f"{checkpoint} is at step {self.state.global_step} and this run ends at step "
                f"{self.args.max_steps if self.args.max_steps > 0 else self.state.max_steps}: the run has already "
                "finished. Nothing is trained, and nothing in the output folder is written or deleted; trainer.model "
                "holds the checkpoint's global weights. To train further raise max_steps; to train a new model use "
                "another output_dir."
            )
        losses = [entry["loss"] for entry in self.state.log_history if "loss" in entry]
        return TrainOutput(self.state.global_step, sum(losses) / len(losses) if losses else float("nan"), {})

    def _save_checkpoint(self, model: nn.Module, trial: Any) -> None:
        run_dir = self._get_output_dir(trial=trial)
        folder = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        name = os.path.basename(folder)
        if self.args.should_save:
            make_way_for_checkpoint(folder)  # a refused checkpoint in the way is moved aside, never written over
        self.wait_for_all_ranks(f"the start of saving {name}")
        # Rotation is postponed until the new checkpoint is complete, and then deletes only complete checkpoints.
        limit = self.args.save_total_limit
        try:
            with _attribute(self.args, "save_total_limit", None), self._bounded_trainer_barrier(f"saving {name}"):
                super()._save_checkpoint(model, trial)
            self.wait_for_all_ranks(f"the end of writing {name} (every rank's files written)")
            if self.args.should_save:
                write_manifest(folder)
        except PeerTimeoutError:
            raise
        except Exception as error:
            raise save_failure(folder, error, self.args.process_index) from error
        if self.args.should_save:
            rotate_checkpoints(run_dir, limit, keep=[self.state.best_model_checkpoint])
        # Nobody resumes or rotates against a checkpoint still being published.
        self.wait_for_all_ranks(f"the publication of {name} (its manifest written)")

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
        # The Trainer's end-of-training clean-up (save_total_limit=1 with a best model) would delete every other
        # checkpoint, refused ones included: only complete ones are deleted, here.
        limit = self.args.save_total_limit
        with _attribute(self.args, "save_total_limit", None):
            output = super()._finalize_training(trial, num_train_samples, start_time)
        if self.args.should_save and limit == 1 and self.state.best_model_checkpoint is not None:
            rotate_checkpoints(
                self._get_output_dir(trial), 1, keep=[self.state.best_model_checkpoint], keep_newest=False
            )
        return output

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
                    f"(this run has {self.args.world_size}); resume with the same number, or start a new run in "
                    "another --output_dir."
                )
            logger.warning(f"{checkpoint} has no DiLoCo state: starting the outer loop afresh from its weights.")
            return
        state = torch.load(path, map_location="cpu", weights_only=True)
        if state["world_size"] != self.args.world_size:
            raise ValueError(
                f"{checkpoint} was written by {state['world_size']} processes, this run has {self.args.world_size}: "
                f"resume with {state['world_size']} processes, or start a new run in another --output_dir."
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


def _length(dataset: Any) -> int | None:
    try:
        return len(dataset)
    except TypeError:
        return None


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
