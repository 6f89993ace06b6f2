"""The `TrainingArguments` of the main job's plain data-parallel baseline (`trainer: ddp`), in a module of its own so
that `hf-diloco pretrain --help` reads the config without importing transformers."""

from __future__ import annotations

import dataclasses

from transformers import TrainingArguments

from ..integrations.inner_optimizer import InnerOptimizerSettings
from ..integrations.trainer import DiLoCoTrainingArguments


@dataclasses.dataclass(repr=False)
class BaselineTrainingArguments(TrainingArguments, InnerOptimizerSettings):
    """The `TrainingArguments` of the plain data-parallel baseline (`trainer: ddp`). Like `DiLoCoTrainingArguments`,
    its pickle (`training_args.bin`, in every checkpoint and saved folder) leaves out every `*_token`. It takes
    `inner_optimizer` so that one config file serves both trainers, and refuses `muon`."""

    def __post_init__(self) -> None:
        self.check_inner_optimizer()
        if self.inner_optimizer == "muon":
            raise ValueError(
                "inner_optimizer: muon runs with trainer: diloco. For data-parallel training with Muon, use "
                "trainer: diloco with inner_steps: 1, outer_lr: 1, outer_momentum: 0 and compression: none, which "
                "is plain data-parallel training step for step."
            )
        super().__post_init__()

    __getstate__ = DiLoCoTrainingArguments.__getstate__
    __copy__ = DiLoCoTrainingArguments.__copy__
    __deepcopy__ = DiLoCoTrainingArguments.__deepcopy__
