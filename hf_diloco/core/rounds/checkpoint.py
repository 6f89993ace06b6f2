"""The engine's checkpoint: what `DiLoCo.state_dict()` writes and `load_state_dict()` reads.

The layout is a mapping of lists with one entry per fragment (θg, θm, eager's a_m, residuals, low-rank warm starts),
the exchanges in flight by fragment, and the outer optimizers' states merged as one optimizer over all fragments would
write them (parameter p = fragment p). It is the layout the engine wrote before it kept one outer optimizer per
fragment, plus `divergence_guard` and `shard`; states written then still load and continue bitwise (tests/fixtures/).

Every rank writes its own state. With D data-parallel ranks per worker, each per-fragment tensor holds that rank's
owned share (`shard.py`), so a rank's state is about 1/D of the outer state; `shard` records which share, and a state
is only loaded into the same share (the same data-parallel index, D and kind of sharding).

A state is read with `map_location="cpu"` whatever device wrote it, so loading puts every tensor where the running
engine keeps it: θg, a_m, the optimizers' states and the pseudo-gradient sent with an exchange in flight on the
fragment's device (`global_copy_device`, resolved to this process's accelerator); the exchange's results (average,
residual) and the low-rank warm start on the host, where the exchange produces them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..exchange.pending import ExchangeResult, PendingExchange
from ..layout.devices import placed
from ..settings.settings_check import check_same_settings
from .fragment import Fragment, InFlight
from .overlap import in_flight_order
from .stats import EngineStats

if TYPE_CHECKING:
    from ..settings.config import DiLoCoConfig
    from .round_policy import RoundPolicy
    from .rounds import DivergenceGuard, RoundKeeper


@dataclass(frozen=True)
class CheckpointedParts:
    """The parts of an engine that its checkpoint holds; each serialises itself and `engine_state` composes them.

    Attributes:
        config: the settings (their fingerprint is written, and compared on loading).
        fragments: every fragment, in index order.
        rounds: waits for the exchanges in flight.
        saves_sent: whether the overlap mode reads what it sent later (eager), so an exchange in flight keeps it.
        inner_optimizer: saved with the engine's state; None: nothing to save.
        guard: the divergence guard.
        round_policy: the round policy (its state is written under `balanced` only).
        shard: which share of the outer state this rank holds (`shard_description`).
    """

    config: DiLoCoConfig
    fragments: Sequence[Fragment]
    rounds: RoundKeeper
    saves_sent: bool
    inner_optimizer: torch.optim.Optimizer | None
    guard: DivergenceGuard
    round_policy: RoundPolicy
    shard: dict


def engine_state(parts: CheckpointedParts, inner_step: int, stats: EngineStats) -> dict:
    """Everything needed to continue bitwise; waits for the exchanges in flight but does not apply them."""
    fragments = parts.fragments
    pending = _flights_state(fragments, parts.rounds, parts.saves_sent)  # first: every exchange in flight is done
    return {
        **shared_state(parts.config, inner_step, fragments, parts.guard, copy=True),
        **_own_state(fragments),
        "inner_optimizer": None if parts.inner_optimizer is None else parts.inner_optimizer.state_dict(),
        "pending": pending,
        "stats": dict(stats),
        "lowrank": [f.compressor.state_dict() for f in fragments] if parts.config.lowrank_rank else None,
        "shard": parts.shard,
        **({"round_policy": parts.round_policy.state_dict()} if parts.round_policy.balanced else {}),
    }


def load_engine_state(parts: CheckpointedParts, state: dict) -> tuple[int, EngineStats]:
    """Restore `engine_state`'s mapping into the parts (refused when the settings or fragment sizes differ); returns
    the inner step and the statistics the engine continues from."""
    _check_compatible(parts, state)
    inner_step = load_shared_state(parts.fragments, parts.guard, state)
    _load_own_state(parts.fragments, state)
    if parts.inner_optimizer is not None and state["inner_optimizer"] is not None:
        parts.inner_optimizer.load_state_dict(state["inner_optimizer"])
    _load_flights(parts.fragments, state["pending"])
    for fragment, saved in zip(parts.fragments, state.get("lowrank") or []):
        fragment.compressor.load_state_dict(saved)
    parts.round_policy.load_state_dict(state.get("round_policy"))
    return inner_step, EngineStats.from_dict(state["stats"])


def shared_state(
    config: DiLoCoConfig, inner_step: int, fragments: Sequence[Fragment], guard: DivergenceGuard, copy: bool
) -> dict:
    """What every worker holds alike: the settings, the inner step, θg, the outer optimizers' states and the
    divergence guard. A checkpoint starts with it, and a worker behind the others receives it from a live peer
    (`elastic.py`). `copy`: θg cloned (a checkpoint outlives the step it was taken at)."""
    return {
        "fingerprint": config.fingerprint(),
        "settings": config.shared_settings(),
        "inner_step": inner_step,
        "global": [f.theta_g.clone() if copy else f.theta_g for f in fragments],
        "outer_optimizer": merged_optimizer_state([f.outer_optimizer for f in fragments]),
        "divergence_guard": guard.state_dict(),
    }


def load_shared_state(fragments: Sequence[Fragment], guard: DivergenceGuard, state: dict) -> int:
    """Restore `shared_state`'s θg, outer optimizers and guard (the model and what was in flight are the caller's);
    returns the inner step."""
    for fragment, saved in zip(fragments, state["global"]):
        fragment.theta_g.copy_(saved)
        fragment.flight = None
    load_merged_optimizer_state([f.outer_optimizer for f in fragments], state["outer_optimizer"])
    guard.load_state_dict(state.get("divergence_guard"))
    return int(state["inner_step"])


def shard_description(data_parallel_index: int, data_parallel_size: int, sharded_model: bool) -> dict:
    """Which share of the outer state a rank holds."""
    kind = "fsdp" if sharded_model else "replicated"
    return {"index": data_parallel_index, "count": data_parallel_size, "kind": kind}


def _own_state(fragments: Sequence[Fragment]) -> dict:
    """What is this worker's own: its parameters θm, eager's start points a_m and their optimizers, the residuals."""
    trajectories = [f.trajectory for f in fragments if f.trajectory is not None]
    return {
        "local": [f.local() for f in fragments],
        "anchor": [t.values.clone() for t in trajectories] if trajectories else None,
        "anchor_optimizer": merged_optimizer_state([t.optimizer for t in trajectories]) if trajectories else None,
        "residual": [f.residual for f in fragments],
    }


def _load_own_state(fragments: Sequence[Fragment], state: dict) -> None:
    for fragment, local, residual in zip(fragments, state["local"], state["residual"]):
        fragment.write_local(local)
        fragment.residual = residual
    if state["anchor"] is not None:
        trajectories = [f.trajectory for f in fragments]
        for trajectory, saved in zip(trajectories, state["anchor"]):
            trajectory.values.data.copy_(saved)
            trajectory.optimizer.state.clear()
        if state.get("anchor_optimizer") is not None:
            load_merged_optimizer_state([t.optimizer for t in trajectories], state["anchor_optimizer"])


def _flights_state(fragments: Sequence[Fragment], rounds: RoundKeeper, saves_sent: bool) -> dict:
    """The exchanges in flight by fragment, completed (waited for) but not applied."""
    pending = {}
    for fragment in in_flight_order(fragments):
        flight = fragment.flight
        result = rounds.wait(flight)
        flight.pending = PendingExchange.completed(result)
        pending[fragment.index] = {
            "apply_at": flight.apply_at,
            "average": result.average.clone(),  # may be a view of a longer buffer
            "residual": result.residual,
            "bytes_sent": result.bytes_sent,
            "bytes_sent_intra_worker": result.bytes_sent_intra_worker,
            "sent": flight.sent.clone() if saves_sent else None,  # may be a view of a longer buffer
            "estimate_weights": flight.weights,
            **({"scale": flight.scale} if flight.scale != 1.0 else {}),  # `round_policy: balanced` only
        }
    return pending


def _load_flights(fragments: Sequence[Fragment], pending: dict) -> None:
    for index, item in pending.items():
        result = ExchangeResult(item["average"], item["residual"], item["bytes_sent"], item["bytes_sent_intra_worker"])
        fragment = fragments[int(index)]
        sent = placed(item["sent"], fragment.device)  # eager subtracts it from the next Δm, which lives there
        fragment.flight = InFlight(
            PendingExchange.completed(result),
            item["apply_at"],
            sent,
            item.get("estimate_weights"),
            item.get("scale", 1.0),
        )


def _check_compatible(parts: CheckpointedParts, state: dict) -> None:
    check_same_settings(
        parts.config, state, "This DiLoCo checkpoint was written", "resume with the settings it was saved with"
    )
    saved, mine = state.get("shard"), parts.shard
    if mine["count"] > 1 and saved != mine:
        raise ValueError(
            f"This DiLoCo checkpoint holds the outer-state share {saved} (data-parallel index, ranks per worker, "
            f"sharding) but this rank holds {mine}: load each rank's own state file, into the same sharding (FSDP or "
            "replicated) it was written with."
        )
    if len(state["global"]) != len(parts.fragments) or any(
        saved.shape != f.theta_g.shape for saved, f in zip(state["global"], parts.fragments)
    ):
        raise ValueError("This DiLoCo checkpoint does not match the model's parameters (fragment sizes differ).")


def merged_optimizer_state(optimizers: Sequence[torch.optim.Optimizer]) -> dict:
    """The per-fragment optimizers' states as one optimizer over all fragments would save it (param p = fragment p)."""
    states = [optimizer.state_dict() for optimizer in optimizers]
    merged = {p: state["state"][0] for p, state in enumerate(states) if 0 in state["state"]}
    groups = [{**states[0]["param_groups"][0], "params": list(range(len(states)))}]
    return {"state": merged, "param_groups": groups}


def load_merged_optimizer_state(optimizers: Sequence[torch.optim.Optimizer], merged: dict) -> None:
    """Inverse of `merged_optimizer_state`."""
    group = merged["param_groups"][0]
    for p, optimizer in enumerate(optimizers):
        state = {0: merged["state"][p]} if p in merged["state"] else {}
        optimizer.load_state_dict({"state": state, "param_groups": [{**group, "params": [0]}]})
