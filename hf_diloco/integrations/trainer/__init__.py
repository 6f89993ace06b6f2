"""The Trainer glue: `DiLoCoTrainingArguments` and `DiLoCoTrainer`, one file per concern (see `diloco_trainer.py`)."""

from .arguments import DiLoCoTrainingArguments
from .diloco_trainer import DiLoCoTrainer, PipelinedDiLoCoTrainer
from .pipeline_stages import PipelineTrainerMixin, SafetensorsFolder

__all__ = [
    "DiLoCoTrainer",
    "DiLoCoTrainingArguments",
    "PipelineTrainerMixin",
    "PipelinedDiLoCoTrainer",
    "SafetensorsFolder",
]
