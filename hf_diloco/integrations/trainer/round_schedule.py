"""`round_policy: balanced` inside `DiLoCoTrainer`: the Trainer's global step is the run's position, not this worker's
own count of steps.

Under `balanced` a slower worker runs fewer inner steps per round (`hf_diloco/core/rounds/round_policy.py`). The Trainer's
`global_step`, which its schedules, logging, checkpoint names, evaluation and `max_steps` count, then follows
`engine.global_step`: the fastest worker's steps, H x R on every worker at the end of round R. A worker of h steps per
round advances it by about H / h per inner step, and its LR scheduler is stepped as often, so every worker is at the
same point of the schedule when a round ends. What must happen on every worker at once (a checkpoint, an
evaluation, the end) happens at a round's end: `max_steps`, `save_steps` and `eval_steps` are refused unless they are
multiples of `inner_steps`, and epoch-based saving or evaluation is refused (a slower worker ends its epochs in other
rounds). Logging is this worker's own and may fall at any step; its loss is averaged over the worker's own steps.

Resuming: the checkpoint names every worker's own inner steps (`diloco_worker_steps.json`), and each worker skips the
batches it trained, not the global step's.

Under elastic membership (`round_policy: steps`) a worker that heals from a live peer takes the job's step with θg
(`core/membership/elastic.py`): the Trainer follows it the same way. `global_step` and the LR scheduler jump to the job's step,
the steps this worker missed count neither in its logged loss nor as trained, and it skips as many batches of its own
data, so it reads at step t the batches it would have read at step t had it never left: what it missed is skipped,
as in the raw loop, not trained late. `max_steps`, `save_steps` and `eval_steps` count the job's steps: a healed
worker ends, saves and evaluates with the others, and skips what fell while it was away.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator

import torch

logger = logging.getLogger(__name__)

WORKER_STEPS_NAME = "diloco_worker_steps.json"


def check_balanced_schedule(args, max_steps: int) -> None:
    """Refuse, before training, a schedule whose shared events could fall inside a round under `balanced`."""
    if args.round_policy != "balanced":
        return
    inner = args.inner_steps
    problems = []
    if max_steps % inner:
        problems.append(f"max_steps ({max_steps}, from the arguments or the epochs) is not a multiple of it")
    for strategy, steps in (("save_strategy", "save_steps"), ("eval_strategy", "eval_steps")):
        value = str(getattr(getattr(args, strategy), "value", getattr(args, strategy)))
        if value == "epoch":
            problems.append(f"{strategy} is 'epoch' (a slower worker ends its epochs in other rounds; use 'steps')")
        count = getattr(args, steps)
        if value == "steps" and count and (count < 1 or round(count) % inner):
            problems.append(f"{steps} ({count}) is not a multiple of it")
    if problems:
        raise ValueError(
            f"round_policy 'balanced' ends runs, saves and evaluates at the end of a round, every inner_steps "
            f"({inner}) global steps: " + "; ".join(problems) + ". Set these to multiples of inner_steps."
        )


class RoundSchedule:
    """
    Mixin of [`DiLoCoTrainer`]: the Trainer's global step, LR schedule and data position under `round_policy:
    balanced` and after an elastic heal (see the module docstring). Otherwise it changes nothing.

    Calls `_get_topology` (`EngineLifecycle`); `EngineLifecycle` calls its `_start_at_the_jobs_step`, `_logged_at`
    and `_follow_the_round`, `WorkerCollectives` its `_logged_at` and `_steps_since_last_log`.
    """

    _inner_step_at_last_log: int | None = None
    _batches_to_skip: int = 0  # a healed worker's batches of the steps it missed, skipped at its next batch

    def _init_training_state(
        self, max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint, trial
    ):
        check_balanced_schedule(self.args, max_steps)
        epochs, batches = super()._init_training_state(
            max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint, trial
        )
        own = self._own_steps_in(resume_from_checkpoint) if resume_from_checkpoint is not None else None
        if own is None:
            return epochs, batches
        epochs = own // num_update_steps_per_epoch
        batches = 0 if self.args.ignore_data_skip else own % num_update_steps_per_epoch
        return epochs, batches * self.args.gradient_accumulation_steps

    def _follow_the_round(self, state) -> None:
        """After this worker's inner step (the Trainer adds 1 to `global_step` and steps the scheduler once next):
        move both on to the engine's global step (under `balanced`, or after a heal under elastic membership)."""
        engine = self.diloco
        if engine is not None and (engine.round_policy.balanced or _joins(engine)):
            self._move_on(state, engine.global_step - state.global_step - 1)

    def _start_at_the_jobs_step(self) -> None:
        """Once the engine has started (and, elastic, joined the job): a worker that healed when it joined starts
        at the job's step, not at its own."""
        engine = self.diloco
        if engine is not None and _joins(engine) and not engine.round_policy.balanced:
            self._move_on(self.state, engine.global_step - self.state.global_step)

    def _move_on(self, state, extra: int) -> None:
        """Add `extra` steps to `global_step` and the LR scheduler; after a heal, skip the data of those steps."""
        if extra <= 0:
            return
        if not self.diloco.round_policy.balanced:  # a heal: this worker missed those steps
            self._skip_the_missed_steps(state.global_step, extra)
        state.global_step += extra
        if not isinstance(self.lr_scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            for _ in range(extra):
                self.lr_scheduler.step()

    def _skip_the_missed_steps(self, own_step: int, missed: int) -> None:
        """The steps a heal moved the engine past: their batches are skipped, and they count in no logged loss."""
        self._batches_to_skip += missed * self.args.gradient_accumulation_steps
        # Mid-run; at the start of train() the Trainer sets it from `global_step` after this.
        self._globalstep_last_logged = getattr(self, "_globalstep_last_logged", 0) + missed
        if self.is_world_process_zero():
            logger.warning(
                f"Healed from a live worker after {own_step} step(s) of its own: this worker continues at the job's "
                f"step {own_step + missed} and skips the {missed} step(s) of data it missed."
            )

    def _run_epoch(self, **kwargs):
        """One epoch, unless a heal skips every batch of it: the Trainer ends training after an epoch in which it
        trained nothing, so an epoch the job ran without this worker is passed over here, not run empty."""
        batches = kwargs["steps_in_epoch"]
        if kwargs["epoch"] == kwargs["epochs_trained"] and kwargs["resume_from_checkpoint"] is not None:
            batches -= kwargs["steps_trained_in_current_epoch"]
        if 0 < batches <= self._batches_to_skip:
            self._batches_to_skip -= batches
            return None
        return super()._run_epoch(**kwargs)

    def get_batch_samples(self, epoch_iterator: Iterator, num_batches: int, device: torch.device):
        """The Trainer's next batches, after the batches of the steps a heal skipped (an epoch's end stops the skip;
        the rest is skipped from the next epoch on)."""
        while self._batches_to_skip > 0:
            try:
                next(epoch_iterator)
            except StopIteration:
                return [], None
            self._batches_to_skip -= 1
        return super().get_batch_samples(epoch_iterator, num_batches, device)

    def _steps_since_last_log(self) -> int:
        """Inner steps this worker trained since its last log (its loss is summed over them)."""
        engine = self.diloco
        if engine is None or not engine.round_policy.balanced or self._inner_step_at_last_log is None:
            return self.state.global_step - self._globalstep_last_logged
        return max(1, engine.inner_step - self._inner_step_at_last_log)

    def _logged_at(self) -> None:
        engine = self.diloco
        self._inner_step_at_last_log = None if engine is None else engine.inner_step

    def _write_worker_steps(self, folder: str) -> None:
        """Every worker's own inner steps at this checkpoint (a round's end), for the data each skips on resume."""
        engine = self.diloco
        if engine is None or not engine.round_policy.balanced:
            return
        with open(os.path.join(folder, WORKER_STEPS_NAME), "w") as handle:
            json.dump({"inner_steps_per_worker": engine.round_policy.steps_done}, handle)

    def _own_steps_in(self, checkpoint: str) -> int | None:
        path = os.path.join(checkpoint, WORKER_STEPS_NAME)
        if self.args.round_policy != "balanced" or not os.path.isfile(path):
            return None
        with open(path) as handle:
            steps = json.load(handle)["inner_steps_per_worker"]
        return int(steps[self._get_topology().worker_index])


def _joins(engine) -> bool:
    """Whether the engine can join a job at its step (elastic membership, or through a store)."""
    return engine.elastic is not None or engine.store is not None
