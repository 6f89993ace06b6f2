"""Checkpoints and resume in `DiLoCoTrainer`: atomic checkpoints with each rank's DiLoCo state, and a resume that
either continues bitwise or refuses, before anything is loaded, with a message that says what to do.

Each rank writes `diloco_state_rank{rank}.pt` next to the Trainer's files: the engine state (theta_g, outer
optimizer, this rank's parameters and inner optimizer, exchanges in flight), buffers and grad scaler. Workers differ
in all the local parts, so the inner optimizer and grad scaler are stored there only (no `optimizer.pt` /
`scaler.pt`; with DDP inside a worker the inner optimizer once per worker, `rank_state.py`); `scheduler.pt` holds
the LR schedule, the same on every rank. A checkpoint counts once its manifest
is published (`hf_diloco.integrations.atomic_checkpoints`), and every wait for the other ranks while saving is bounded.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from torch import nn
from transformers import TrainerState
from transformers.trainer import SCHEDULER_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, TrainOutput
from transformers.utils import CONFIG_NAME, logging

from ...core.settings.settings_check import describe_changes, saved_values, setting_changes
from ..architecture import architecture, describe_architecture_change
from ..atomic_checkpoints import (
    CheckpointError,
    checkpoint_to_resume,
    load_checkpoint_file,
    make_way_for_checkpoint,
    read_trainer_state,
    refuse_foreign_pickles,
    rotate_checkpoints,
    save_failure,
    verify_checkpoint,
    write_manifest,
)
from ..global_points import PeerTimeoutError
from ..interruption import StoppedRun, resume_a_trainer, stop_on_signals
from ..rank_state import load_rank_state, rank_state_path, ranks_with_state, save_rank_state
from .attributes import temporarily_set

logger = logging.get_logger(__name__)

# The settings a resume must keep (`settings_to_resume_with`), by name, in every checkpoint.
RUN_SETTINGS_NAME = "diloco_run_settings.json"


class Checkpoints:
    """Mixin of [`DiLoCoTrainer`]: saving, resuming and the run that was already finished.

    Sets `diloco_run.model_is_global` for a finished run. Calls `_check_ranks_agree` and `_bounded_trainer_barrier`
    (`RankAgreement`) and `_write_worker_steps` (`RoundSchedule`); `PipelineTrainerMixin` overrides
    `_inner_state_is_per_rank`.

    Attributes:
        resumed_a_finished_run (`bool`): set by `train()`: the checkpoint it resumed from was at the last step.
    """

    resumed_a_finished_run = False

    def train(self, resume_from_checkpoint: str | bool | None = None, *args, **kwargs):
        """
        `Trainer.train`, with these guarantees about checkpoints and the other ranks:

        - `resume_from_checkpoint=True` picks the newest *complete* checkpoint in `output_dir`; when the folder holds
          checkpoints but none verifies it raises `CheckpointError` (naming each one's problem) instead of starting
          over; a named checkpoint is verified against its manifest first.
        - A checkpoint written by another number of processes, for another model architecture or with other settings
          (`settings_to_resume_with`: batch, seeds, DiLoCo fields, tokenizer and data) is refused before anything is
          loaded, naming each difference with both values.
        - Before the first step, the engine's start-up check (one all-gather) tells whether the settings that must
          agree (`settings_that_must_agree`) do; when they differ every rank raises `SettingsMismatchError` naming
          them. Each global point waits at most `sync_timeout_seconds` for the other ranks and then fails naming the
          ranks that did not arrive.
        - Resuming from a checkpoint at or past the last step trains nothing and writes nothing: `trainer.model`
          gets the checkpoint's (global) weights, `resumed_a_finished_run` is set and the output folder is left as
          it is (the settings are checked first, with one exchange: no engine starts).
        - SIGTERM and SIGINT (unless the program handles them itself) end the process at once with 143 and 130,
          rank 0 naming the last saved step and how to resume from it (`integrations/interruption.py`).
        """
        self.resumed_a_finished_run = False
        with stop_on_signals(StoppedRun("DiLoCoTrainer", self.args.output_dir, resume_a_trainer)):
            checkpoint = self._checkpoint_to_resume(resume_from_checkpoint)
            if checkpoint is not None:
                self._check_checkpoint_fits(checkpoint)
                if self._run_was_finished(checkpoint):
                    self._check_ranks_agree(checkpoint)
                    return self._leave_finished_run(checkpoint)
            return super().train(checkpoint, *args, **kwargs)

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
        """Refuse a checkpoint of another world size or model architecture, or one holding pickled objects, before
        anything is loaded from it."""
        refuse_foreign_pickles(checkpoint, self.args.output_dir)
        writers = ranks_with_state(checkpoint)
        way_out = (
            "or start a new run in another --output_dir (or pass --auto_resume false / call train() without "
            "resume_from_checkpoint to start over in this one)"
        )
        if writers and len(writers) != self.args.world_size:
            raise CheckpointError(
                f"{checkpoint} was written by {len(writers)} processes, this run has {self.args.world_size}: DiLoCo "
                f"state is per process. Resume with {len(writers)} processes, {way_out}."
            )
        self._check_same_settings_as(checkpoint, way_out)
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

    def _check_same_settings_as(self, checkpoint: str, way_out: str) -> None:
        """Refuse a checkpoint saved with another batch, seed, DiLoCo field, tokenizer or data than this run's, naming
        each (a checkpoint written before these were stored is checked by the engine's fingerprint only)."""
        path = os.path.join(checkpoint, RUN_SETTINGS_NAME)
        if not os.path.isfile(path):
            return
        with open(path) as handle:
            saved = json.load(handle)
        changes = setting_changes(saved, self.settings_to_resume_with())
        if changes:
            raise CheckpointError(
                f"{checkpoint} was saved with other settings than this run's ({describe_changes(changes)}). Resume "
                f"with the checkpoint's values ({saved_values(changes)}), {way_out}."
            )

    def _write_run_settings(self, folder: str) -> None:
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, RUN_SETTINGS_NAME), "w") as handle:
            json.dump(self.settings_to_resume_with(), handle, indent=1, sort_keys=True, default=str)

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
        self.diloco_run.model_is_global = True
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

    # ---- saving ----

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
            with temporarily_set(self.args, "save_total_limit", None), self._bounded_trainer_barrier(f"saving {name}"):
                super()._save_checkpoint(model, trial)
            if self.args.should_save:
                self._write_run_settings(folder)
                self._write_worker_steps(folder)
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

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if self.diloco is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        # Each rank's inner optimizer and grad scaler go into its DiLoCo state file only (workers differ in both);
        # the LR schedule, the same on every rank, into the Trainer's scheduler.pt.
        os.makedirs(output_dir, exist_ok=True)
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))
        scaler = getattr(self.accelerator, "scaler", None)
        extra = {
            "buffers": {k: v.detach().cpu().clone() for k, v in self.model.named_buffers()},
            "scaler": scaler.state_dict() if scaler is not None else None,
        }
        save_rank_state(output_dir, self.args.process_index, self.args.world_size, self.diloco, extra)
        return None

    def _save_scaler(self, output_dir: str) -> None:
        if self.diloco is None:
            super()._save_scaler(output_dir)

    def _finalize_training(self, trial, num_train_samples, start_time):
        # The Trainer's end-of-training clean-up (save_total_limit=1 with a best model) would delete every other
        # checkpoint, refused ones included: only complete ones are deleted, here.
        limit = self.args.save_total_limit
        with temporarily_set(self.args, "save_total_limit", None):
            output = super()._finalize_training(trial, num_train_samples, start_time)
        if self.args.should_save and limit == 1 and self.state.best_model_checkpoint is not None:
            rotate_checkpoints(
                self._get_output_dir(trial), 1, keep=[self.state.best_model_checkpoint], keep_newest=False
            )
        return output

    # ---- loading ----

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None or not self._inner_state_is_per_rank(checkpoint):
            return super()._load_optimizer_and_scheduler(checkpoint)
        # This rank's inner optimizer comes back with its DiLoCo state (`_load_diloco_state`); the LR schedule is the
        # same on every rank.
        path = os.path.join(checkpoint, SCHEDULER_NAME)
        if os.path.isfile(path):
            self.lr_scheduler.load_state_dict(load_checkpoint_file(path, self.args.output_dir))
        return None

    def _inner_state_is_per_rank(self, checkpoint: str) -> bool:
        """Whether this rank's inner optimizer state comes from its own DiLoCo state file, not the Trainer's."""
        return rank_state_path(checkpoint, self.args.process_index).is_file()

    def _load_diloco_state(self, checkpoint: str) -> None:
        state = load_rank_state(checkpoint, self.args.process_index, self.args.world_size, self.diloco, required=False)
        if state is None:
            logger.warning(f"{checkpoint} has no DiLoCo state: starting the outer loop afresh from its weights.")
            return
        with torch.no_grad():
            for name, buffer in self.model.named_buffers():
                buffer.copy_(state["buffers"][name])
        scaler = getattr(self.accelerator, "scaler", None)
        if scaler is not None and state["scaler"] is not None:
            scaler.load_state_dict(state["scaler"])
