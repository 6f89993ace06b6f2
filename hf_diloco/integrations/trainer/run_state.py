"""`TrainerRunState`: everything the mixins of `DiLoCoTrainer` share, in one object (`trainer.diloco_run`).

A mixin keeps to itself what only it uses; what one mixin writes and another reads lives here, each field naming its
writer and when it is written, so a reader sees the whole of the shared state in one place
(`tests/test_trainer_structure.py` holds the mixins to it). The documented attributes `trainer.diloco`,
`trainer.diloco_topology`, `trainer.pipeline_runner` and `trainer.model_card_kwargs` are properties over it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch.distributed as dist

    from ...core.layout.topology import Topology
    from ...parallel.pipeline import PipelineRunner
    from ..engine_session import EngineSession


@dataclass(eq=False)
class TrainerRunState:
    """What the mixins of one `DiLoCoTrainer` share; made once, in `DiLoCoTrainer.__init__`, before `Trainer`'s."""

    # ---- set at construction ----
    # EngineLifecycle._get_topology, on first use inside Trainer.__init__ (the Accelerator's creation); read by all.
    topology: Topology | None = None
    # RankAgreement._make_global_point_group, with the topology; read by the global points, the output-folder lock,
    # WorkerCollectives (evaluation gathers) and PipelineTrainerMixin (evaluation sums). None with one process.
    global_points: dist.ProcessGroup | None = None
    # PipelineTrainerMixin._setup_pipeline, after DiLoCoTrainer.__init__; None when pipeline_stages is 1.
    pipeline_runner: PipelineRunner | None = None
    # WorkerSharding (with fsdp) and PipelineTrainerMixin at construction; read by GlobalModel.save_model: every
    # rank takes part in writing the model (it gathers shards or stages), not only the saving rank.
    every_rank_saves_the_model: bool = False

    # ---- set before or between train() calls ----
    # RankAgreement.require_agreement (the main job's tokenizer and data fingerprints); read by RankAgreement into
    # settings_that_must_agree and settings_to_resume_with.
    required_settings: dict[str, Any] = field(default_factory=dict)
    # GlobalModel.create_model_card / push_to_hub and the caller (`trainer.model_card_kwargs`); read by every card.
    model_card_kwargs: dict[str, Any] = field(default_factory=dict)

    # ---- set by each train() ----
    # EngineLifecycle._prepare_for_training (the previous one closed first); read by the step callback, RoundSchedule,
    # WorkerCollectives (logged metrics), Checkpoints and GlobalModel through `trainer.diloco`.
    session: EngineSession | None = None
    # False from EngineLifecycle._prepare_for_training, True from its _finalize_training or Checkpoints'
    # _leave_finished_run; read by GlobalModel: the model holds theta_g (or the best checkpoint's) after train().
    model_is_global: bool = False
    # Emptied by EngineLifecycle._prepare_for_training; filled by GlobalModel.evaluate / save_metrics once
    # model_is_global: the evaluations of the model as train() left it, which its card quotes.
    final_metrics: dict[str, float] = field(default_factory=dict)
