"""`DiLoCoTrainingArguments`: `TrainingArguments` that also take every `DiLoCoConfig` field."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
from transformers import TrainingArguments

from ..inner_optimizer import InnerOptimizerSettings
from ..launch import init_process_group_for_restart
from ..settings import DiLoCoSettings


@dataclass(repr=False)
class DiLoCoTrainingArguments(TrainingArguments, DiLoCoSettings, InnerOptimizerSettings):
    """
    [`~transformers.TrainingArguments`] that also take every [`DiLoCoConfig`] field by name, as keyword arguments and
    on the command line through [`~transformers.HfArgumentParser`] (each field is defined once, in `DiLoCoConfig`).

    It takes all of [`~transformers.TrainingArguments`] and all of [`DiLoCoConfig`] (`inner_steps`, `outer_lr`,
    `outer_momentum`, `num_fragments`, `sync_delay`, `compression`, `data_parallel_per_worker`, ...), and:

    Parameters:
        inner_optimizer (`str`): `adamw` (the Trainer's `optim`) or `muon` (Muon for the block stack's matrices,
            AdamW for the rest: `hf_diloco/integrations/inner_optimizer.py`).

    Differences from `TrainingArguments`:
        - DiLoCo fields are validated first, before any device or process group is set up, and a bad value raises a
          `ValueError` naming the field.
        - `average_tokens_across_devices` averages the token count over the processes of one worker only (the
          processes whose gradients DDP averages); workers never exchange it.
        - `accelerator_config.dispatch_batches` defaults to `False` (dispatching would broadcast every batch from
          rank 0 across workers) and `True` is refused; `accelerator_config.use_seedable_sampler=False` is refused
          (Accelerate would broadcast the sampler's seed across workers at every epoch).
    """

    def __post_init__(self) -> None:
        DiLoCoSettings.validate_diloco(self)
        self.check_inner_optimizer()
        super().__post_init__()
        self._check_accelerator_config()

    @cached_property
    def _setup_devices(self) -> torch.device:
        # `TrainingArguments` joins the default process group here (its `device`, first read by its own
        # `__post_init__`). On a torchrun restart that group must start on a store prefixed by the attempt, so the
        # restarted ranks do not meet the keys the failed attempt left; anywhere else this adds nothing.
        init_process_group_for_restart(self.use_cpu, self.ddp_timeout or 1800)
        return TrainingArguments._setup_devices.func(self)

    def _check_accelerator_config(self) -> None:
        config = self.accelerator_config
        if config.dispatch_batches is None:
            config.dispatch_batches = False
        elif config.dispatch_batches:
            raise ValueError(
                "accelerator_config.dispatch_batches=True makes rank 0 read every batch and broadcast it to all ranks, "
                "a collective across workers at every step. DiLoCo needs every rank to read its own shard: leave it "
                "unset or False."
            )
        if not config.use_seedable_sampler:
            raise ValueError(
                "accelerator_config.use_seedable_sampler=False makes Accelerate broadcast the sampler's random state "
                "across all ranks at every epoch. DiLoCo needs the seedable sampler (the default): set it to True."
            )

    def __getstate__(self) -> dict[str, Any]:
        # The Trainer pickles its arguments into `training_args.bin` in every checkpoint and in the saved model, which
        # may be pushed: every `*_token` (a Hub token given on the command line) is left out of the pickle.
        return {name: None if name.endswith("_token") else value for name, value in self.__dict__.items()}

    def __copy__(self) -> DiLoCoTrainingArguments:
        clone = self.__class__.__new__(self.__class__)
        clone.__dict__.update(self.__dict__)
        return clone

    def __deepcopy__(self, memo: dict[int, Any]) -> DiLoCoTrainingArguments:
        # Copies keep their tokens (only the pickle leaves them out).
        clone = self.__class__.__new__(self.__class__)
        memo[id(self)] = clone
        clone.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return clone
