"""What every rank of a `DiLoCoTrainer` run must share, and the global points where all ranks meet.

The settings that must agree (`settings_that_must_agree`: schedule, seeds, model config, DiLoCo settings, the
checkpoint resumed from, and what `require_agreement` adds) reach the engine as its `extra_fingerprint`, so the
engine's start-up check, one all-gather, covers them. Only when that check finds the ranks disagreeing (a
`ValueError` on every rank alike) do the ranks exchange the settings themselves (`hf_diloco.integrations.global_points.
check_ranks_agree`), to name what differs and where.

Every other meeting of all ranks (saving a checkpoint, the Trainer's own barrier inside a save, the end of a job) is a
bounded `monitored_barrier` on a gloo group of all ranks: it fails within `sync_timeout_seconds` naming the ranks that
did not arrive.
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ...core.membership import agreement
from ..architecture import architecture
from ..atomic_checkpoints import read_trainer_state
from ..global_points import check_ranks_agree, fingerprint, global_point_group, wait_for_all_ranks


class RankAgreement:
    """Mixin of [`DiLoCoTrainer`]: the settings every rank must share and the bounded global points.

    Writes `diloco_run.global_points` (with the topology) and `required_settings`.
    """

    def require_agreement(self, name: str, value: Any) -> None:
        """
        Add a setting that must be equal on every rank to the start-of-training check (for example the main job's
        tokenizer and data fingerprints); a resume is also refused when it differs from the checkpoint's
        (`settings_to_resume_with`). `value` must be JSON-serialisable; give a large one as
        `hf_diloco.integrations.global_points.fingerprint(value)`.
        """
        self.diloco_run.required_settings[name] = value

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
            "diloco": args.shared_diloco_settings(),
            "resume_from_step": None if checkpoint is None else read_trainer_state(checkpoint).get("global_step"),
        }
        if args.max_steps <= 0:  # the schedule then follows the data
            settings["epochs"] = [args.num_train_epochs, _length(self.train_dataset)]
        config = getattr(self.model, "config", None)
        if config is not None and hasattr(config, "to_dict"):
            settings["model_config"] = architecture(config)
        settings.update(self.diloco_run.required_settings)
        return settings

    def settings_to_resume_with(self) -> dict[str, Any]:
        """
        The settings a resume must keep, by name: stored in every checkpoint (`RUN_SETTINGS_NAME`) and compared when
        resuming from it, so that a resume with another batch, seed, DiLoCo field, tokenizer or data is refused naming
        the setting instead of training on silently. The batch and gradient accumulation, the seeds, every DiLoCo
        field ranks share, and whatever `require_agreement` added (the main job's tokenizer and data fingerprints).
        The world size and the model config are checked on their own (`Checkpoints._check_checkpoint_fits`);
        `max_steps` and the saving, evaluation and logging schedule may change on a resume.
        """
        args = self.args
        return {
            "per_device_train_batch_size": args.per_device_train_batch_size,
            "gradient_accumulation_steps": args.gradient_accumulation_steps,
            "seed": args.seed,
            "data_seed": args.data_seed,
            **args.shared_diloco_settings(),
            **self.diloco_run.required_settings,
        }

    def _settings_fingerprint(self, checkpoint: str | None = None) -> str:
        """The fingerprint of `settings_that_must_agree(checkpoint)` that the engine's start-up check compares."""
        return fingerprint(self.settings_that_must_agree(checkpoint))

    def _check_ranks_agree(self, checkpoint: str | None = None) -> None:
        """Exchange `settings_that_must_agree` and raise `SettingsMismatchError` naming each one that differs."""
        check_ranks_agree(
            self.settings_that_must_agree(checkpoint),
            self.diloco_run.global_points,
            self.args.sync_timeout_seconds,
            point="the start of training",
        )

    @contextlib.contextmanager
    def _naming_disagreements(self, checkpoint: str | None) -> Iterator[None]:
        """Around the engine's start: when its start-up check finds that the ranks disagree, name what differs."""
        try:
            yield
        except ValueError as error:
            if _raised_by_the_start_up_check(error):
                self._check_ranks_agree(checkpoint)  # raises when a setting the trainer knows differs
            raise

    # ---- bounded global points ----

    def _make_global_point_group(self) -> None:
        """The gloo group of all ranks for the global points; made once, with the process groups of the topology."""
        self.diloco_run.global_points = global_point_group(self.args.sync_timeout_seconds)

    def wait_for_all_ranks(self, point: str) -> None:
        """
        Wait until every rank has reached `point` (a global point, e.g. the end of the job), at most
        `sync_timeout_seconds`; then raise `PeerTimeoutError` naming the point and the ranks that did not arrive.
        Every rank must call it, in the same order as the trainer's other global points.
        """
        wait_for_all_ranks(self.diloco_run.global_points, point, self.args.sync_timeout_seconds)

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


def _raised_by_the_start_up_check(error: ValueError) -> bool:
    # The engine's start-up check raises a ValueError on every rank alike when the all-gathered values differ; any
    # other ValueError of the engine's construction may be raised on some ranks only, which must not meet again.
    source = Path(agreement.__file__)
    return any(
        frame.name == agreement.check_workers_agree.__name__ and Path(frame.filename) == source
        for frame in traceback.extract_tb(error.__traceback__)
    )


def _length(dataset: Any) -> int | None:
    try:
        return len(dataset)
    except TypeError:
        return None
