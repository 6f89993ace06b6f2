"""The engine's life inside `DiLoCoTrainer`: the rank grid, the model prepared for its worker, the engine started
with each `train()`, stepped after every real inner optimizer step, and closed at the end with theta_g in the model.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import TrainerCallback

from ...core.diloco import DiLoCo
from ...core.layout.topology import Topology
from ...core.store.objects import StoreUnreachableError
from ..accelerate_worker import needs_no_ddp, prepare_without_ddp, route_ddp_to_worker, worker_topology
from ..engine_session import EngineSession


class EngineLifecycle:
    """
    Mixin of [`DiLoCoTrainer`]: process groups, model wrapping and the engine of each `train()` call.

    Writes `diloco_run.topology`, `session`, `model_is_global` and empties `final_metrics` (`run_state.py`). Calls
    `_settings_fingerprint`, `_naming_disagreements` and `_make_global_point_group` (`RankAgreement`),
    `_load_diloco_state` (`Checkpoints`), `_start_at_the_jobs_step`, `_logged_at` and, from its step callback,
    `_follow_the_round` (`RoundSchedule`).

    Attributes:
        diloco_topology (`Topology`): this rank's worker, data-parallel index and process groups.
    """

    @property
    def diloco(self) -> DiLoCo | None:
        """The engine of the current (or last) `train()` call, `None` before the first."""
        session = self.diloco_run.session
        return None if session is None else session.engine

    @property
    def diloco_topology(self) -> Topology | None:
        """This rank's worker, data-parallel index and process groups (made in `Trainer.__init__`)."""
        return self.diloco_run.topology

    @property
    def diloco_module(self) -> nn.Module:
        """The module whose parameters the engine syncs (the whole model; a pipelined trainer's stage)."""
        return self.model

    @property
    def diloco_num_blocks(self) -> int | None:
        """Length of the whole block stack when `diloco_module` holds part of it (a pipeline stage), else `None`."""
        return None

    # ---- process groups and model wrapping ----

    def _get_topology(self) -> Topology:
        run = self.diloco_run
        if run.topology is None:
            _ = self.args.device  # initializes the default process group when launched distributed
            run.topology = worker_topology(
                self.args,
                self.args.world_size,
                "On a machine without GPUs pass --use_cpu (DiLoCoTrainingArguments(use_cpu=True)) or set "
                "ACCELERATE_USE_CPU=1; to train one worker, launch one process.",
            )
            self._make_global_point_group()
        return run.topology

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        route_ddp_to_worker(self.accelerator, self._get_topology())

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader: Any = None) -> nn.Module:
        unwrapped = self.accelerator.unwrap_model(model, keep_torch_compile=False) is model
        if training and unwrapped and needs_no_ddp(self.accelerator, self._get_topology(), model):
            return prepare_without_ddp(self.accelerator, model)
        return super()._wrap_model(model, training=training, dataloader=dataloader)

    # ---- the engine of one train() call ----

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        model, train_dataloader = super()._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)
        run = self.diloco_run
        if run.session is not None:
            run.session.engine.close()
        with self._naming_disagreements(resume_from_checkpoint):
            run.session = EngineSession.start(
                self.diloco_module,
                self.optimizer,
                self.args.diloco_config(),
                self._get_topology(),
                total_steps=max_steps,
                announce=self.is_world_process_zero(),
                num_blocks=self.diloco_num_blocks,
                extra_fingerprint=self._settings_fingerprint(resume_from_checkpoint),
                tokens_per_step=self._sequences_per_step(),
            )
        run.model_is_global = False
        run.final_metrics = {}
        if resume_from_checkpoint is not None:
            self._load_diloco_state(resume_from_checkpoint)
        self._start_at_the_jobs_step()
        self._logged_at()
        return model, train_dataloader

    def _save_before_stopping(self) -> None:
        """The store did not answer within its bound: save this site's checkpoint (its own state, the store keeps
        the job's) so that the same command resumes here once the store answers again."""
        # This step was trained: the Trainer counts it, and steps its schedule, only after the callbacks.
        self.state.global_step += 1
        if not isinstance(self.lr_scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            self.lr_scheduler.step()
        self._save_checkpoint(self.model, trial=None)

    def _sequences_per_step(self) -> float:
        """The sequences one inner step of this site trains (every data-parallel rank's batches): the weight of its
        contributions through a store, next to sites of other batch sizes."""
        args = self.args
        return float(
            args.per_device_train_batch_size * args.gradient_accumulation_steps * args.data_parallel_per_worker
        )

    def _finalize_training(self, trial, num_train_samples, start_time):
        if self.diloco_run.session is not None:
            self._close_engine()
            self.diloco_run.model_is_global = True
        return super()._finalize_training(trial, num_train_samples, start_time)

    def _close_engine(self) -> None:
        """Apply what is in flight, sync the tails and copy theta_g into the model."""
        self.diloco_run.session.close()


class EngineStepCallback(TrainerCallback):
    """Hands every inner optimizer step that really happened to the engine, and times the steps."""

    def __init__(self, trainer: EngineLifecycle):
        self._trainer = trainer

    def on_step_begin(self, args, state, control, **kwargs) -> None:
        session = self._trainer.diloco_run.session
        if session is not None:
            session.step_begin()

    def on_optimizer_step(self, args, state, control, **kwargs) -> None:
        session = self._trainer.diloco_run.session
        if session is not None:
            try:
                session.step_end(skipped=self._trainer.accelerator.optimizer_step_was_skipped)
            except StoreUnreachableError:
                self._trainer._save_before_stopping()  # every rank of the site stops here, together
                raise
            self._trainer._follow_the_round(state)
            if session.engine.job_finished:  # through a store, the job's final round came: every site stops here
                control.should_training_stop = True
