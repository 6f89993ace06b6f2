"""The `TrainingArguments` of the main job's plain data-parallel baseline (`trainer: ddp`), in a module of its own so
that `hf-diloco pretrain --help` reads the config without importing transformers."""

from __future__ import annotations

import dataclasses

from transformers import TrainingArguments

from ..integrations.trainer import DiLoCoTrainingArguments


@dataclasses.dataclass(repr=False)
class BaselineTrainingArguments(TrainingArguments):
    """The `TrainingArguments` of the plain data-parallel baseline (`trainer: ddp`). Like `DiLoCoTrainingArguments`,
    its pickle (`training_args.bin`, in every checkpoint and saved folder) leaves out every `*_token`."""

    __getstate__ = DiLoCoTrainingArguments.__getstate__
    __copy__ = DiLoCoTrainingArguments.__copy__
    __deepcopy__ = DiLoCoTrainingArguments.__deepcopy__
