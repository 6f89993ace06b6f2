"""`DiLoCoTrainingArguments` + `DiLoCoTrainer`; defined in `hf_diloco.integrations.trainer`, one file per concern."""

from .integrations.rank_state import RANK_STATE_NAME as DILOCO_STATE_NAME
from .integrations.trainer import DiLoCoTrainer, DiLoCoTrainingArguments, PipelinedDiLoCoTrainer

__all__ = ["DILOCO_STATE_NAME", "DiLoCoTrainer", "DiLoCoTrainingArguments", "PipelinedDiLoCoTrainer"]
