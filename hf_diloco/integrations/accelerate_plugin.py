"""`DiLoCoPlugin`: DiLoCo for a raw Accelerate training loop.

```python
from accelerate import Accelerator
from hf_diloco import DiLoCoPlugin

accelerator = Accelerator()
plugin = DiLoCoPlugin(inner_steps=100)  # fields not given come from DILOCO_* variables, then the defaults
model, optimizer, loader, scheduler = plugin.prepare(accelerator, model, optimizer, loader, scheduler)
for step, batch in enumerate(loader, start=1):
    with accelerator.accumulate(model):
        accelerator.backward(model(**batch).loss)
        optimizer.step()  # the DiLoCo step runs here after every real inner optimizer step
        scheduler.step()
        optimizer.zero_grad()
    accelerator.log(plugin.metrics(), step=step)  # diloco/* scalars, local values (no collective)
plugin.close()  # apply what is in flight; the model now holds the global parameters theta_g
```

What `prepare` does (DiLoCo, Douillard et al. 2023, arXiv 2311.08105; Streaming DiLoCo, arXiv 2501.18512):

- DDP runs over the worker's data-parallel group only, and not at all when a worker is one process, so nothing
  crosses workers between outer syncs. Accelerate's prepared dataloaders shard by world rank, which gives every
  (worker, data-parallel replica) pair its own shard.
- The prepared optimizer's `step()` also advances the DiLoCo engine, once per inner step: not on the
  micro-batches of gradient accumulation (`accelerator.sync_gradients` is False there). A step a GradScaler
  skipped (`accelerator.optimizer_step_was_skipped`) counts too, so every worker's schedule stays in step.
- A shuffled dataloader gets Accelerate's seedable sampler (with one seed, agreed at start-up, on every process),
  so its shuffle needs no collective at each epoch and every worker still reads its own shard.
- `accelerator.save_state(dir)` also writes `diloco_state_rank{rank}.pt` per rank (theta_g, outer optimizer, this
  rank's parameters and inner optimizer, exchanges in flight) and `accelerator.load_state(dir)` restores it after
  Accelerate's own files, so training continues bitwise. Resuming needs the same number of processes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..core.diloco import DiLoCo
from ..core.settings.config import DiLoCoConfig
from .accelerate_worker import prepare_worker_model, worker_topology
from .engine_session import EngineSession
from .rank_state import RANK_STATE_NAME as STATE_NAME
from .rank_state import load_rank_state, save_rank_state
from .settings import DiLoCoSettings
from .worker_fsdp import holds_shards


@dataclasses.dataclass(init=False, repr=False, eq=False)
class DiLoCoPlugin(DiLoCoSettings):
    """
    A [`DiLoCoConfig`] for a raw Accelerate loop: fills the fields it is not given from `DILOCO_*` environment
    variables (so `accelerate launch` and cluster launchers can configure it) or a YAML file, and prepares a model and
    optimizer so that the DiLoCo step happens inside `optimizer.step()`.

    Each field is set from the first of: an explicit keyword argument > its environment variable (`DILOCO_` + the
    field name in upper case, e.g. `DILOCO_INNER_STEPS=50`, `DILOCO_COMPRESSION=int8`, `DILOCO_OUTER_NESTEROV=false`)
    > the YAML file (`yaml_file=` or [`DiLoCoPlugin.from_yaml`]) > the field's default.

    Args:
        yaml_file (`str` or `Path`, *optional*): a YAML file of DiLoCo fields (flat, or under a `diloco:` key).
        environ (`Mapping[str, str]`, *optional*): where to read `DILOCO_*` from; defaults to `os.environ`.
        **fields: any [`DiLoCoConfig`] field.

    Raises:
        `ValueError`: a variable does not parse as its field's type (the message names the variable and the field),
            a `DILOCO_*` variable or a YAML key names no field (the message names the closest one), or a value is
            invalid (the message names the field and where its value came from). Raised before any process group or
            model work.

    Attributes:
        engine (`DiLoCo` or `None`): the engine, once [`~DiLoCoPlugin.prepare`] has run.
        sources (`dict[str, str]`): where each field's value came from (`argument`, `DILOCO_X`, the YAML path or
            `default`).
    """

    def __init__(
        self, *, yaml_file: str | Path | None = None, environ: Mapping[str, str] | None = None, **fields: Any
    ) -> None:
        values, self.sources = DiLoCoConfig.layered_fields(
            fields, os.environ if environ is None else environ, yaml_file
        )
        for name, value in values.items():
            setattr(self, name, value)
        self._session: EngineSession | None = None
        self._accelerator = None
        self._load_dir: str | None = None
        try:
            self.validate_diloco()
        except ValueError as error:
            origins = ", ".join(f"{n} from {s}" for n, s in self.sources.items() if s != "default")
            raise ValueError(f"{error} (values not at their default: {origins or 'none'})") from None

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides: Any) -> DiLoCoPlugin:
        """Fields from a YAML file, below `DILOCO_*` variables and explicit `overrides` in precedence."""
        return cls(yaml_file=path, **overrides)

    def __repr__(self) -> str:
        return f"DiLoCoPlugin({', '.join(f'{k}={v!r}' for k, v in self.diloco_dict().items())})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DiLoCoConfig) and self.diloco_dict() == other.diloco_dict()

    __hash__ = None

    @property
    def engine(self) -> DiLoCo | None:
        return None if self._session is None else self._session.engine

    # ------------------------------------------------------------------------------------------------ preparing

    def prepare(
        self,
        accelerator: Any,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *others: Any,
        max_steps: int | None = None,
    ) -> tuple:
        """
        Prepare a model and its inner optimizer (and, like `accelerator.prepare`, any dataloaders and schedulers) for
        DiLoCo training.

        Args:
            accelerator (`accelerate.Accelerator`): the loop's accelerator (it sets up the process group).
            model (`nn.Module`): the model, not yet prepared.
            optimizer (`torch.optim.Optimizer`): the inner optimizer over the model's parameters, not yet prepared.
            *others: dataloaders, schedulers, ... passed on to `accelerator.prepare`. Shuffled dataloaders get the
                seedable sampler (see the module docstring).
            max_steps (`int`, *optional*): inner steps the loop will run, for the start-up summary (without it
                the summary counts one epoch of the first dataloader, and says so).

        Returns:
            `tuple`: the prepared `(model, optimizer, *others)`, in the order given.

        Raises:
            `RuntimeError`: the launcher started several processes that Accelerate did not join into one run.
            `ValueError`: `pipeline_stages` > 1, a model sharded with FSDP, or an Accelerator with Accelerate's FSDP.
        """
        if self._session is not None:
            raise RuntimeError("This DiLoCoPlugin has already prepared a model; create one plugin per model.")
        if self.pipeline_stages != 1:
            raise ValueError(
                f"pipeline_stages={self.pipeline_stages}: DiLoCoPlugin trains one full model replica per process; "
                "use pipeline_stages=1."
            )
        if holds_shards(model):
            raise ValueError(
                "DiLoCoPlugin does not take a model sharded with FSDP: accelerator.save_state / load_state would write "
                "and read its shards as whole tensors. Pass the Trainer's fsdp arguments to DiLoCoTrainer, or drive "
                "DiLoCo(model, optimizer, config) directly on a model fully_shard-ed over hf_diloco.worker_mesh(config)."
            )
        topology = worker_topology(
            self,
            accelerator.num_processes,
            "Create the Accelerator with cpu=True (or set ACCELERATE_USE_CPU=1) on a machine without GPUs, or launch "
            "with accelerate launch --multi_gpu --cpu ... / torchrun; to train one worker, launch one process.",
        )
        self._accelerator = accelerator
        prepared_model = prepare_worker_model(accelerator, model, topology)
        prepared_optimizer = accelerator.prepare_optimizer(optimizer)
        with _seedable_shuffling(accelerator, others, topology.control_group):
            prepared_others = accelerator.prepare(*others) if others else ()
        prepared_others = prepared_others if isinstance(prepared_others, tuple) else (prepared_others,)
        for obj in prepared_others:
            _check_loader(obj)
        unwrapped = accelerator.unwrap_model(prepared_model, keep_torch_compile=False)
        total_steps, steps_label = _planned_steps(max_steps, accelerator, prepared_others)
        self._session = EngineSession.start(
            unwrapped,
            prepared_optimizer.optimizer,
            self.diloco_config(),
            topology,
            total_steps=total_steps,
            steps_label=steps_label,
            announce=accelerator.is_main_process,
        )
        self._hook_training_step(unwrapped, prepared_optimizer)
        self._hook_checkpointing(accelerator)
        return (prepared_model, prepared_optimizer, *prepared_others)

    def _hook_training_step(self, model: nn.Module, optimizer: Any) -> None:
        """Advance the engine after each inner step, skipped by a GradScaler or not; time it for `compute_utilization`."""
        inner_step, session = optimizer.step, self._session

        def step(*args: Any, **kwargs: Any) -> Any:
            result = inner_step(*args, **kwargs)
            if optimizer.gradient_state.sync_gradients:
                session.step_end(skipped=optimizer.step_was_skipped)
            return result

        def mark_step_begin(module: nn.Module, args: Any) -> None:
            if torch.is_grad_enabled():  # a training forward, not evaluation
                session.step_begin()

        optimizer.step = step
        model.register_forward_pre_hook(mark_step_begin)

    def _hook_checkpointing(self, accelerator: Any) -> None:
        plugin = self

        def save_hook(models: list, weights: list, output_dir: str) -> None:
            plugin.save_state(output_dir)

        def load_hook(models: list, input_dir: str) -> None:
            plugin._load_dir = input_dir

        class _RestoreAfterAccelerate:
            # Accelerate loads registered objects last, after the model, optimizer and scheduler (which hold rank 0's
            # state on every rank): the per-rank DiLoCo state then overwrites the parts that differ between ranks.
            def state_dict(self) -> dict:
                return {"per_rank_file": STATE_NAME}

            def load_state_dict(self, state: dict) -> None:
                plugin.load_state(plugin._load_dir)

        accelerator.register_save_state_pre_hook(save_hook)
        accelerator.register_load_state_pre_hook(load_hook)
        accelerator.register_for_checkpointing(_RestoreAfterAccelerate())

    # ------------------------------------------------------------------------------------------------ using it

    @property
    def inner_step(self) -> int:
        """Inner optimizer steps completed (restored by `load_state`, so a resumed loop knows where it is)."""
        return self._require_session().engine.inner_step

    @property
    def outer_rounds(self) -> int:
        """Completed outer rounds, the same on every worker: with `round_policy: balanced`, where workers run
        different numbers of inner steps per round, end the loop at a round (`while plugin.outer_rounds < R`)."""
        return self._require_session().engine.outer_rounds

    @property
    def job_finished(self) -> bool:
        """Through a store (`exchange: store`): the job's final round was applied (the first site to finish ended the
        job); end the loop and call `close()`. Always False otherwise."""
        return self._require_session().engine.job_finished

    def global_parameters(self) -> dict[str, torch.Tensor]:
        """fp32 theta_g by parameter name (identical on every rank)."""
        return self._require_session().engine.global_parameters()

    def global_weights(self) -> contextlib.AbstractContextManager[nn.Module]:
        """Context manager that loads theta_g into the model (to evaluate or save it); the local weights come back."""
        return self._require_session().engine.global_weights()

    def metrics(self) -> dict[str, float]:
        """`diloco/*` scalars for `accelerator.log`, computed locally (no collective)."""
        return self._require_session().metrics()

    def close(self) -> None:
        """Apply every exchange in flight and load theta_g into the model (call it after the loop)."""
        self._require_session().close()

    def save_state(self, output_dir: str | Path) -> Path:
        """Write this rank's DiLoCo state to `output_dir` (`accelerator.save_state` calls it by itself)."""
        engine = self._require_session().engine
        return save_rank_state(output_dir, self._accelerator.process_index, self._accelerator.num_processes, engine)

    def load_state(self, input_dir: str | Path) -> None:
        """Restore this rank's DiLoCo state (`accelerator.load_state` calls it by itself, after its own files)."""
        engine = self._require_session().engine
        load_rank_state(input_dir, self._accelerator.process_index, self._accelerator.num_processes, engine)

    def _require_session(self) -> EngineSession:
        if self._session is None:
            raise RuntimeError("Call plugin.prepare(accelerator, model, optimizer) first.")
        return self._session


def _planned_steps(max_steps: int | None, accelerator: Any, prepared: tuple) -> tuple[int, str]:
    if max_steps is not None:
        return max_steps, "steps"
    loaders = [obj for obj in prepared if isinstance(obj, torch.utils.data.DataLoader) and hasattr(obj, "__len__")]
    if not loaders:
        return 0, "steps (pass max_steps to prepare for the count)"
    # The loop decides how many epochs it runs: the line states one epoch's steps as that, not as the run's length.
    per_epoch = len(loaders[0]) // accelerator.gradient_accumulation_steps
    return per_epoch, "steps per epoch of the first dataloader (pass max_steps to prepare for the whole run)"


@contextlib.contextmanager
def _seedable_shuffling(accelerator: Any, objects: tuple, group: Any) -> Iterator[None]:
    """
    While `objects` are prepared: the seedable sampler for shuffled dataloaders, seeded alike on every process.

    Without it Accelerate would broadcast the sampler's random state across all processes at every epoch, a
    collective across workers. The seed is rank 0's (one broadcast at start-up, on `group`: the topology's gloo
    control group of every rank, bounded by `sync_timeout_seconds`, so no communicator of the accelerator's backend
    spans the workers), so processes seeded differently still shuffle alike and read disjoint shards.
    """
    config = accelerator.dataloader_config
    shuffled = any(isinstance(getattr(obj, "sampler", None), torch.utils.data.RandomSampler) for obj in objects)
    if not shuffled or config.use_seedable_sampler:
        yield
        return
    saved = config.use_seedable_sampler, config.data_seed
    config.use_seedable_sampler = True
    if config.data_seed is None:
        config.data_seed = _seed_of_rank_zero(group)
    try:
        yield
    finally:
        config.use_seedable_sampler, config.data_seed = saved


def _seed_of_rank_zero(group: Any) -> int:
    seed = torch.tensor([torch.initial_seed() % 2**62], dtype=torch.int64)  # on the host: the group is gloo
    if group is not None:
        torch.distributed.broadcast(seed, src=torch.distributed.get_global_rank(group, 0), group=group)
    return int(seed.item())


def _check_loader(obj: Any) -> None:
    """Refuse dataloader settings that make every epoch or batch a collective across workers."""
    from accelerate.data_loader import DataLoaderDispatcher

    if isinstance(obj, DataLoaderDispatcher):
        raise ValueError(
            "The accelerator dispatches batches (rank 0 reads every batch and broadcasts it across workers). DiLoCo "
            "needs every rank to read its own shard: use Accelerator(dataloader_config=DataLoaderConfiguration("
            "dispatch_batches=False))."
        )
    if getattr(obj, "rng_types", None):
        raise ValueError(
            f"This dataloader synchronizes the random state {obj.rng_types} across all ranks at every epoch (a "
            "collective across workers). Use Accelerator(dataloader_config=DataLoaderConfiguration("
            "use_seedable_sampler=True)) for a shuffled loader, or Accelerator(rng_types=[])."
        )
