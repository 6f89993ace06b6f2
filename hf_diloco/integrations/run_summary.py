"""What a run is about to do, said once at start-up, what it met, said at its end, and the launch mistake that would
make it something else.

`run_summary` is the line the main process logs when the engine starts (workers x data-parallel ranks x stages, H,
P, tau, overlap, codec, bytes per outer round, outer rounds). `closing_summary` is what the main process logs when
the engine closes and the model card states: the workers robust aggregation scaled down, the processes refused from
an elastic job, and an elastic site whose last rounds ran alone (its model is not the job's). `check_processes_joined` refuses a launch whose
processes are not joined into one run, where N one-worker jobs would train on the same data and write the same
output folder:

- a launcher said WORLD_SIZE = N, but Accelerate runs each process alone (on a machine without GPUs it joins them
  only when told to use the CPU);
- `accelerate launch` was asked for several CPU processes (a MULTI_CPU config, or `--cpu --num_processes N`): without
  `--mpirun_hostfile` it starts one process, with no rank or world size, however many were asked for.
"""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING

from accelerate.utils import str_to_bool

from .settings import overlap_label

if TYPE_CHECKING:  # the type only: the main job's --help reads this module without the engine
    from ..core.diloco import DiLoCo


def launched_processes() -> int:
    """The number of processes the launcher says it started (`WORLD_SIZE`, 1 when unset)."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def check_processes_joined(processes_in_run: int, how_to_fix: str) -> None:
    """
    Raise `RuntimeError` when the launcher started several processes but this run counts another number of them.

    Args:
        processes_in_run (`int`): the processes Accelerate (or the Trainer) sees in this run.
        how_to_fix (`str`): what to change in the caller's terms, appended to the message.
    """
    if _cpu_launch_without_ranks():
        raise RuntimeError(
            "accelerate launch was asked for several CPU processes (an accelerate config with distributed_type "
            "MULTI_CPU, or --cpu with --num_processes > 1) but started only this one: without --mpirun_hostfile it "
            "runs a single process with no rank, so each such launch would train alone and write the same output "
            "folder. Start several CPU processes with torchrun --nproc_per_node N, or accelerate launch --multi_gpu "
            f"--num_processes N; for one process, drop num_processes. {how_to_fix}"
        )
    launched = launched_processes()
    if launched > 1 and processes_in_run != launched:
        raise RuntimeError(
            f"The launcher started {launched} processes (WORLD_SIZE={launched}), but this one runs as a "
            f"{processes_in_run}-process job: Accelerate did not join them into one run. Each process would train "
            f"as its own one-worker DiLoCo job on the same data and write the same output folder. {how_to_fix}"
        )


def _cpu_launch_without_ranks() -> bool:
    # Accelerate's single-process launcher sets MASTER_ADDR only when more than one process was asked for.
    env = os.environ
    ranked = any(
        name in env for name in ("WORLD_SIZE", "RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")
    )
    return bool(str_to_bool(env.get("ACCELERATE_USE_CPU", "false"))) and "MASTER_ADDR" in env and not ranked


def bytes_per_round(engine: DiLoCo) -> int:
    """Cross-worker bytes this rank sends in one outer round (every fragment once), by the codec's fixed size."""
    shapes = {name: tuple(param.shape) for name, param in engine.model.named_parameters()}
    total = 0
    for pieces in engine.fragment_pieces():
        numel = sum((piece.stop - piece.start) * math.prod(shapes[piece.name][1:]) for piece in pieces)
        total += engine.exchange.wire_bytes(numel)
    return total


def run_summary(engine: DiLoCo, total_steps: int, steps_label: str = "steps") -> str:
    """One line: the rank grid, the schedule, the exchange and what the run will send in `total_steps` steps."""
    config, topology = engine.config, engine.topology
    workers = topology.num_workers
    grid = (
        f"{_count(workers, 'worker')} x {_count(topology.data_parallel_size, 'data-parallel rank')} x "
        f"{_count(topology.pipeline_stages, 'pipeline stage')} = "
        f"{_count(workers * topology.data_parallel_size * topology.pipeline_stages, 'process')}"
    )
    schedule = (
        f"H={config.inner_steps}, P={config.num_fragments}, tau={config.sync_delay}, "
        f"overlap={overlap_label(config.diloco_dict())}, "
        f"compression={config.compression}{' (adaptive)' if config.adaptive_compression else ''}"
    )
    rounds = f"{total_steps // config.inner_steps} outer round(s) in {total_steps} {steps_label}"
    if engine.elastic is not None:
        # The workers, and with them what one exchange sends, are the sites present at each exchange.
        parts = [(topology.data_parallel_size, "data-parallel rank"), (topology.pipeline_stages, "pipeline stage")]
        per_site = " x ".join(_count(count, name) for count, name in parts if count > 1) or "one process"
        grid = f"elastic, site {config.site}, min_workers {config.min_workers}: {per_site} per site"
        traffic = f"each exchange among the sites present then, found by the Lighthouse at {config.lighthouse}"
    elif engine.store is not None:
        parts = [(topology.data_parallel_size, "data-parallel rank"), (topology.pipeline_stages, "pipeline stage")]
        per_site = " x ".join(_count(count, name) for count, name in parts if count > 1) or "one process"
        grace = f"{config.grace_seconds:g} s" + (" at most, adaptive" if config.adaptive_grace else "")
        grid = (
            f"through the store {engine.store.bounded.url}, site {config.site}: {per_site} per site; a round closes "
            f"with quorum {config.quorum} after a grace window of {grace} (deadline {config.round_deadline_seconds:g} "
            f"s)"
        )
        traffic = (
            f"{_human_bytes(engine.store.bytes_per_round())} written per rank per outer round (each site reads the "
            "others')"
        )
    elif workers == 1:
        traffic = "nothing crosses workers (one worker: launch several processes for several workers)"
    else:
        traffic = f"{_human_bytes(bytes_per_round(engine))} sent per rank per outer round"
        if config.adaptive_compression:
            traffic += (
                f" at {config.compression} without low rank (the adaptive policy picks rank and codec each sync)"
            )
        elif config.lowrank_rank or config.entropy_coding:
            traffic = "at most " + traffic
    return f"DiLoCo run: {grid}; {schedule}; {traffic}; {rounds}."


def closing_summary(engine: DiLoCo) -> list[str]:
    """What the run met that its model card and its last log lines must say, one sentence each (none: nothing)."""
    lines = [
        f"robust aggregation scaled down the pseudo-gradient of {name} in {_count(count, 'exchange')} "
        f"(robust_clip_factor {engine.config.robust_clip_factor:g})"
        for name, count in sorted(engine.stats.clipped_workers.items())
    ]
    membership = engine.elastic.membership if engine.elastic is not None else None
    refused = getattr(membership, "refused", {})
    if refused:
        names = ", ".join(f"{name} (in {_count(count, 'group')})" for name, count in sorted(refused.items()))
        lines.append(
            f"refused {_count(len(refused), 'process')} outside the job, which did not prove its secret: {names}"
        )
    apart = engine.elastic.log.apart() if engine.elastic is not None else None
    if apart is not None:
        lines.append(trained_apart(engine.elastic.log.site, apart))
    return lines


def trained_apart(site: str, apart: dict) -> str:
    """What an elastic site whose last exchanges ran alone says of its model (`MembershipLog.apart`)."""
    return (
        f"{site} trained {_count(apart['rounds'], 'round')} alone from round {apart['from_round']} to its end: its "
        "model differs from the job's (no other site was in its exchanges since)"
    )


def _count(number: int, noun: str) -> str:
    plural = noun + ("es" if noun.endswith("s") else "s")
    return f"{number} {noun if number == 1 else plural}"


def _human_bytes(value: int) -> str:
    scaled = float(value)
    for unit in ("B", "KB", "MB", "GB"):
        if scaled < 1000 or unit == "GB":
            break
        scaled /= 1000
    return f"{value} B" if unit == "B" else f"{scaled:.3g} {unit}"
