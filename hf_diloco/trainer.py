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
import os
from collections.abc import Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from accelerate.utils import DistributedDataParallelKwargs, DistributedType
from torch import nn
from transformers import Trainer, TrainerCallback, TrainerState, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, TrainOutput
from transformers.utils import CONFIG_NAME, logging

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
from .launch import init_process_group_for_restart
from .model_card import write_model_card
from .modeling import architecture, describe_architecture_change
from .monitoring import ComputeUtilization
from .pipeline_trainer import PipelineTrainerMixin

logger = logging.get_logger(__name__)

DILOCO_STATE_NAME = "diloco_state_rank{rank}.pt"
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
          and grad scaler. Workers differ in all the local parts, and the Trainer's own `optimizer.pt` is rank 0's.
          Resuming needs the same number of processes.
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
        self.resumed_a_finished_run = False  # set by train(): the checkpoint it resumed from was at the last step
        self._settings_that_must_agree: dict[str, Any] = {}
        self._utilization: ComputeUtilization | None = None
        self._model_is_global = False  # after train(): the model holds theta_g (or the best checkpoint's)
        super().__init__(model, args, *pos, **kwargs)
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            raise ValueError(
                "DiLoCoTrainer needs full parameters on every process: DeepSpeed and FSDP are not supported."
            )
        self.add_callback(_DiLoCoStepCallback(self))

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
        warning = config.short_run_warning(max_steps)
        if warning and self.args.should_log:
            logger.warning(warning)
        self._utilization = ComputeUtilization(lambda: self.diloco.stats["sync_wait_seconds"])
        self._model_is_global = False
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
            return super().evaluate(*args, **kwargs)

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
        Write the DiLoCo model card (`hf_diloco.model_card`, with the `diloco` tag, the DiLoCo settings and the
        measured communication) to `output_dir/README.md`, instead of the Trainer's generic card. `push_to_hub` calls
        it before uploading. `language`, `license`, `tasks`, `dataset_tags` and `dataset_args` are not used.
        """
        if not self.is_world_process_zero():
            return
        extra_tags = [tags] if isinstance(tags, str) else list(tags or [])
        datasets = [dataset] if isinstance(dataset, str) else dataset
        self._write_model_card(
            self.args.output_dir,
            model_name=model_name,
            base_model=finetuned_from,
            extra_tags=extra_tags,
            datasets=datasets,
        )

    def _write_model_card(self, folder: str, **overrides: Any) -> None:
        topology = self._get_topology()
        stats = self.diloco.stats if self.diloco is not None else {}
        # What this rank exchanges (one pipeline stage when pipelined), the same parameters DDP would all-reduce here.
        exchanged = sum(p.numel() for p in self.diloco_module.parameters() if p.requires_grad)
        results = {}
        for entry in self.state.log_history:
            results.update({k: v for k, v in entry.items() if k.startswith("eval_") and isinstance(v, (int, float))})
        kwargs = {
            "settings": {**self.args.diloco_dict(), "num_workers": topology.num_workers},
            "communication": {
                "bytes_sent": stats.get("bytes_sent", 0),
                "steps": self.diloco.inner_step if self.diloco is not None else 0,
                "num_parameters": exchanged,
                "outer_steps": stats.get("outer_steps", 0),
                "sync_wait_seconds": stats.get("sync_wait_seconds", 0.0),
            },
            "data_description": _describe_dataset(self.train_dataset),
            "base_model": _base_model_id(self.model),
            "training_results": results or None,
            "model_name": Path(folder).name if overrides.get("model_name") is None else overrides["model_name"],
            "repo_id": self.args.hub_model_id,
        }
        kwargs.update({k: v for k, v in overrides.items() if v is not None and k != "model_name"})
        write_model_card(folder, **kwargs)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        super()._save_optimizer_and_scheduler(output_dir)
        if self.diloco is None:
            return
        os.makedirs(output_dir, exist_ok=True)
        scaler = getattr(self.accelerator, "scaler", None)
        state = {
            "engine": self.diloco.state_dict(),  # theta_g, this rank's parameters, outer and inner optimizer
            "buffers": {k: v.detach().cpu().clone() for k, v in self.model.named_buffers()},
            "scaler": scaler.state_dict() if scaler is not None else None,
            "world_size": self.args.world_size,
        }
        torch.save(state, os.path.join(output_dir, DILOCO_STATE_NAME.format(rank=self.args.process_index)))

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
        with self._gather_within_worker():
            return super()._get_num_items_in_batch(batch_samples, device)

    def _track_num_input_tokens(self, inputs: dict[str, Any]) -> None:
        with self._gather_within_worker():
            super()._track_num_input_tokens(inputs)

    @contextlib.contextmanager
    def _gather_within_worker(self) -> Iterator[None]:
        # The Trainer's per-step counts call `accelerator.gather` over the world; route them to the worker's group.
        self.accelerator.gather = self._worker_gather
        try:
            yield
        finally:
            del self.accelerator.gather

    def _worker_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.reshape(1) if tensor.dim() == 0 else tensor
        group = self._get_topology().data_parallel_group
        if group is None:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        return torch.cat(parts)

    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, torch.Tensor | Any],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, Any]:
        # With the token count summed over the worker, DDP's gradient mean must be undone by the worker's size, not
        # the world's (which the Trainer would use).
        rescale = (
            self.args.average_tokens_across_devices
            and (self.model_accepts_loss_kwargs or self.compute_loss_func is not None)
            and num_items_in_batch is not None
        )
        with _attribute(self.args, "average_tokens_across_devices", False):
            result = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        scale = self._get_topology().data_parallel_size
        if not rescale or scale == 1:
            return result
        if return_outputs:
            loss, outputs = result
            return loss * scale, outputs
        return result * scale

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
