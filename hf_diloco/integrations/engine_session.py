"""One DiLoCo engine inside a training loop, run the same way by every front-end.

`EngineSession.start` creates the engine (whose start-up check all-gathers, once, what every rank must agree on) and
has the main process say what the run is about to do (`run_summary`, and the short-run warning of the outer
momentum). The loop then reports the start and the end of every inner step (`step_begin` / `step_end`): the engine
steps after each inner optimizer step call, whether a GradScaler skipped the update or not (every worker then counts
the same steps), and the time between the two, less the outer-sync wait inside it, is the
`diloco/compute_utilization` that `metrics()` adds to the engine's own. `close()` applies what is in flight and
copies theta_g into the model; where the run's length was not known at the start (a raw loop that decides its epochs
itself), the short-run warning is given there, from the rounds the whole run had.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from ..core.diloco import DiLoCo
from ..core.layout.topology import Topology
from ..core.settings.config import DiLoCoConfig
from .monitoring import ComputeUtilization
from .run_summary import closing_summary, run_summary

logger = logging.getLogger(__name__)


def check_one_process_per_site(config: DiLoCoConfig, processes: int) -> None:
    """Refuse a launch of sites (elastic: `config.lighthouse` set; or through a store: `exchange: store`) that is not
    one site: one process, or the `pipeline_stages` x `data_parallel_per_worker` ranks of one worker."""
    ranks = config.pipeline_stages * config.data_parallel_per_worker
    sites = (
        f"lighthouse is set ({config.lighthouse})"
        if config.lighthouse
        else f"exchange is 'store' ({config.store_url})"
    )
    if (config.lighthouse or config.exchange == "store") and processes > 1 and processes != ranks:
        raise ValueError(
            f"{sites} but this launch has {processes} processes with pipeline_stages x data_parallel_per_worker = "
            f"{config.pipeline_stages} x {config.data_parallel_per_worker}: one launch is one site, of one process or "
            f"of one worker's ranks. Set data_parallel_per_worker (times pipeline_stages) to {processes} to make these "
            "processes one site (every site of the job with as many), or launch one process per site (`torchrun "
            "--nproc_per_node 1`, or plain `python`/`hf-diloco pretrain`) with its own `site`."
        )


def store_from_config(config: DiLoCoConfig, topology: Topology) -> Any:
    """The store of `config.store_url` when `exchange: store` (`hf_diloco.backends.object_store`), else None."""
    if config.exchange != "store":
        return None
    check_one_process_per_site(config, topology.num_workers * topology.layout.worker_size)
    from ..backends.object_store import open_store

    return open_store(config.store_url)


def membership_from_config(config: DiLoCoConfig, topology: Topology) -> Any:
    """
    The `TorchftMembership` of this site when `config.lighthouse` is set, else `None` (a fixed membership).

    Under membership one launch is one site: one process, or the ranks of `topology`'s one worker (its pipeline stages
    and data-parallel ranks; rank k of this site exchanges with rank k of the others). The sites find each other through the
    Lighthouse, not through the launcher, so a launch of several sites is refused before anything connects.
    """
    if not config.lighthouse:
        return None
    check_one_process_per_site(config, topology.num_workers * topology.layout.worker_size)
    from ..backends.torchft_membership import TorchftMembership

    return TorchftMembership(
        config.lighthouse,
        replica_id=config.site,
        min_workers=config.min_workers,
        start_workers=config.start_workers,
        min_workers_timeout=config.min_workers_timeout,
        sync_timeout=config.membership_sync_timeout,
        host=config.site_host or None,
        site_rank=topology.rank % topology.layout.worker_size,
        site_size=topology.layout.worker_size,
        site_group=topology.control_group,
        insecure_no_secret=config.insecure_no_secret,
    )


class EngineSession:
    """
    A started [`DiLoCo`] engine and the timing of the inner steps around it.

    Args:
        engine (`DiLoCo`): the engine (see `EngineSession.start`).

    Attributes:
        engine (`DiLoCo`): the engine.
        utilization (`ComputeUtilization`): the share of wall time spent computing inner steps.
        skipped_steps (`int`): inner steps whose optimizer step a GradScaler skipped (still counted by the engine).
        announce (`bool`): this process speaks for the run: `close()` logs the closing summary.
        warn_at_close (`bool`): `close()` gives the short-run warning, from the steps the run took (the main process
            of a run whose length was unknown at the start).
    """

    def __init__(self, engine: DiLoCo, warn_at_close: bool = False, announce: bool = False):
        self.engine = engine
        self.utilization = ComputeUtilization(lambda: engine.stats["sync_wait_seconds"])
        self.skipped_steps = 0
        self.warn_at_close = warn_at_close
        self.announce = announce

    @classmethod
    def start(
        cls,
        model: nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        config: DiLoCoConfig,
        topology: Topology,
        total_steps: int,
        steps_label: str = "steps",
        announce: bool = False,
        num_blocks: int | None = None,
        extra_fingerprint: str = "",
        tokens_per_step: float = 1.0,
    ) -> EngineSession:
        """
        Create the engine and, when `announce`, log the start-up line and the short-run warning.

        Args:
            model, inner_optimizer, config, topology, num_blocks, extra_fingerprint: passed to [`DiLoCo`].
            total_steps (`int`): the inner steps the run will take (0 when unknown).
            steps_label (`str`, *optional*): what the start-up line calls those steps; any other label than `steps`
                (e.g. one epoch's) says that they are not the whole run's, whose short-run warning then waits for
                `close()`.
            announce (`bool`, *optional*): whether this process speaks for the run (the main process).
            tokens_per_step (`float`, *optional*): the tokens one inner step of this site trains (all its ranks): a
                store round weighs each site's contribution by them (1: by steps).
        """
        # A decaying outer schedule spans the run: its rounds from the steps the run will take, where they are known.
        config = config.with_outer_schedule_length(total_steps if steps_label == "steps" else 0)
        membership = membership_from_config(config, topology)
        engine = DiLoCo(
            model,
            inner_optimizer,
            config,
            topology=topology,
            num_blocks=num_blocks,
            extra_fingerprint=extra_fingerprint,
            membership=membership,
            store=store_from_config(config, topology),
        )
        engine.tokens_per_step = tokens_per_step
        whole_run = steps_label == "steps" and total_steps > 0
        if announce:
            logger.warning(run_summary(engine, total_steps, steps_label))
            warning = config.short_run_warning(total_steps) if whole_run else None
            if warning:
                logger.warning(warning)
        return cls(engine, warn_at_close=announce and not whole_run, announce=announce)

    def step_begin(self) -> None:
        """An inner step starts (repeated calls before `step_end`, one per micro-batch, keep the first)."""
        self.utilization.step_begin()

    def step_end(self, skipped: bool) -> None:
        """An inner step ended; `skipped`: its optimizer step did not happen (a GradScaler skipped it).

        The engine steps either way: workers skip different steps (each scaler sees its own gradients), so a schedule
        that only counted the applied ones would drift apart between workers, and their outer exchanges with it.
        A skipped step left theta_m where it was, so the pseudo-gradient the schedule sends is still right.
        """
        if skipped:
            self.skipped_steps += 1
        self.engine.step()
        self.utilization.step_end()

    def metrics(self) -> dict[str, float]:
        """`diloco/*` scalars, computed locally (no collective)."""
        logs = self.engine.metrics()
        logs["diloco/compute_utilization"] = self.utilization.value()
        return logs

    def close(self) -> None:
        """Apply every exchange in flight and sync the tails (`DiLoCo.close`), then copy theta_g into the model."""
        self.engine.close()
        self.engine.load_global_weights()
        steps = self.engine.inner_step
        warning = self.engine.config.short_run_warning(steps) if self.warn_at_close and steps > 0 else None
        if warning:
            logger.warning(warning)
        if self.announce:
            for line in closing_summary(self.engine):
                logger.warning("DiLoCo run summary: %s.", line)
