"""`DiLoCoTrainer`: DiLoCo as a drop-in for `Trainer`, assembled from one mixin per concern.

The Trainer keeps doing what it does (data, inner AdamW and LR schedule, logging, checkpoints); the glue makes sure
that nothing it does crosses workers between outer syncs, and hands every real inner optimizer step to the `DiLoCo`
engine (DiLoCo, Douillard et al. 2023, arXiv 2311.08105; Streaming DiLoCo, arXiv 2501.18512). Where each part lives:

- `engine_lifecycle.py`: process groups, the model wrapped for its worker, the engine of each `train()`;
- `worker_collectives.py`: the Trainer's per-step gathers, loss scale, logging and FLOs inside the worker (TRL too);
- `worker_sharding.py`: the Trainer's `fsdp` settings, FSDP2 over each worker's ranks (never across workers);
- `checkpoints.py`: atomic checkpoints with each rank's DiLoCo state, resume, the run that was already finished;
- `rank_agreement.py`: the settings every rank must share, and the bounded global points;
- `global_model.py`: evaluation and saving on theta_g, the model card, the push to the Hub;
- `round_schedule.py`: the global step and LR schedule under `round_policy: balanced` (workers of unequal speed);
- `pipeline_stages.py`: the pipelined trainer (`pipeline_stages` > 1), chosen here at construction;
- `run_state.py`: `TrainerRunState`, the one object through which the mixins share data (`trainer.diloco_run`).

What one mixin writes and another reads lives in `trainer.diloco_run`, made here before `Trainer.__init__` runs: the
topology and global-point group, the engine's session, whether the model holds theta_g, the final evaluations, the
settings `require_agreement` added, the card's arguments and the pipeline runner, each field naming who writes it and
when. A mixin keeps on `self` only what it alone reads (`tests/test_trainer_structure.py`); `diloco`,
`diloco_topology`, `pipeline_runner` and `model_card_kwargs` are properties over the state. Mixins still call some
of each other's private methods (`_get_topology`, `_logged_at`, ...): each mixin's docstring names those it calls.

The default process group stays the whole world, so the Trainer's rank-based file names, `should_save` on global
rank 0 and Accelerate's data sharding by world rank keep working (with `pipeline_stages == 1` world-rank sharding
gives every (worker, data-parallel replica) pair its own shard).
"""

from __future__ import annotations

import functools
from typing import Any

from torch import nn
from transformers import Trainer

from ...parallel.pipeline import PipelineRunner
from ..accelerate_worker import refuse_accelerate_fsdp
from ..output_lock import hold_output_folder
from .arguments import DiLoCoTrainingArguments
from .checkpoints import Checkpoints
from .engine_lifecycle import EngineLifecycle, EngineStepCallback
from .global_model import GlobalModel
from .pipeline_stages import PipelineTrainerMixin
from .rank_agreement import RankAgreement
from .round_schedule import RoundSchedule
from .run_state import TrainerRunState
from .worker_collectives import WorkerCollectives
from .worker_sharding import WorkerSharding


class DiLoCoTrainer(
    EngineLifecycle,
    WorkerSharding,
    Checkpoints,
    RankAgreement,
    GlobalModel,
    WorkerCollectives,
    RoundSchedule,
    Trainer,
):
    """
    A [`~transformers.Trainer`] that trains with DiLoCo: every worker runs the Trainer's own inner optimizer and LR
    schedule on its shard of the data, and the `DiLoCo` engine averages the workers' progress every `inner_steps`
    steps. Takes exactly the arguments of `Trainer`; `args` must be a [`DiLoCoTrainingArguments`].

    Attributes:
        diloco (`DiLoCo` or `None`): the engine of the current (or last) `train()` call.
        diloco_topology (`Topology`): this rank's worker, data-parallel index and process groups.
        pipeline_runner (`PipelineRunner` or `None`): this rank's pipeline stage, `None` when `pipeline_stages` is 1.
        diloco_run (`TrainerRunState`): what the mixins share (`run_state.py`); the attributes above read it.

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
        - With the Trainer's `fsdp` arguments (`fsdp=True`, `--fsdp`, `fsdp_config`) the model is `fully_shard`-ed
          over each worker's `data_parallel_per_worker` ranks (`hf_diloco.worker_mesh`), never across workers, on
          CPU and GPU alike; every rank keeps 1/D of the model, its inner optimizer and the outer state. Saving
          gathers the model inside the worker into one normal folder. Not with `pipeline_stages` > 1.
        - With `pipeline_stages` > 1 the trainer built is a `PipelinedDiLoCoTrainer` (of a subclass: the subclass
          with [`~.pipeline_stages.PipelineTrainerMixin`] in front): each rank trains, syncs and keeps the
          state of its own pipeline stage only (`trainer.pipeline_runner.stage_module`; the other stages' parameters
          in `trainer.model` are freed).
    """

    @property
    def pipeline_runner(self) -> PipelineRunner | None:
        """This rank's pipeline stage, `None` when `pipeline_stages` is 1."""
        return self.diloco_run.pipeline_runner

    def __new__(cls, *args: Any, **kwargs: Any) -> DiLoCoTrainer:
        arguments = kwargs.get("args", args[1] if len(args) > 1 else None)
        if getattr(arguments, "pipeline_stages", 1) > 1:
            cls = _pipelined(cls)
        return super().__new__(cls)

    def __init__(self, model: nn.Module | None = None, args: DiLoCoTrainingArguments | None = None, *pos, **kwargs):
        if args is None:
            args = DiLoCoTrainingArguments(output_dir="tmp_trainer")
        if not isinstance(args, DiLoCoTrainingArguments):
            raise TypeError(
                f"DiLoCoTrainer needs DiLoCoTrainingArguments, got {type(args).__name__}: build them with the same "
                "keywords plus the DiLoCo fields."
            )
        self.diloco_run = TrainerRunState()  # what the mixins share (`run_state.py`)
        super().__init__(model, args, *pos, **kwargs)
        self._get_topology()  # the global-point group, for the lock's verdict on every rank
        # One job per output folder, from before anything is written to the process's exit.
        hold_output_folder(
            args.output_dir, args.process_index == 0, self.diloco_run.global_points, args.sync_timeout_seconds
        )
        if self.is_deepspeed_enabled:
            raise ValueError(
                "DiLoCoTrainer does not support DeepSpeed (it shards over every process, across workers); to shard "
                "the model inside each worker pass the Trainer's fsdp arguments."
            )
        refuse_accelerate_fsdp(self.accelerator)
        self._shard_model_over_worker()
        self.add_callback(EngineStepCallback(self))
        self._keep_collectives_in_worker()


class PipelinedDiLoCoTrainer(PipelineTrainerMixin, DiLoCoTrainer):
    """The [`DiLoCoTrainer`] that `DiLoCoTrainer(...)` builds when `args.pipeline_stages` > 1 (see
    `hf_diloco.integrations.trainer.pipeline_stages`)."""


@functools.cache
def _pipelined(cls: type) -> type:
    """`cls` with the pipeline stages in front: made once per class, and never twice."""
    if issubclass(cls, PipelineTrainerMixin):
        return cls
    if cls is DiLoCoTrainer:
        return PipelinedDiLoCoTrainer
    return type(f"Pipelined{cls.__name__}", (PipelineTrainerMixin, cls), {"__module__": cls.__module__})
