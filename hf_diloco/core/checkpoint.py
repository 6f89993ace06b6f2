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
from typing import TYPE_CHECKING

import torch

from .devices import placed
from .exchange import ExchangeResult, PendingExchange
from .fragment import InFlight
from .overlap import in_flight_order
from .settings_check import check_same_settings
from .stats import EngineStats

if TYPE_CHECKING:
    from .diloco import DiLoCo


def engine_state(engine: DiLoCo) -> dict:
    """Everything needed to continue bitwise; waits for the exchanges in flight but does not apply them."""
    pending = {}
    for fragment in in_flight_order(engine.fragments):
        flight = fragment.flight
        result = engine.rounds.wait(flight)
        flight.pending = PendingExchange.completed(result)
        pending[fragment.index] = {
            "apply_at": flight.apply_at,
            "average": result.average.clone(),  # may be a view of a longer buffer
            "residual": result.residual,
            "bytes_sent": result.bytes_sent,
            "bytes_sent_intra_worker": result.bytes_sent_intra_worker,
            "sent": flight.sent.clone() if engine.overlap.saves_sent else None,  # may be a view of a longer buffer
            "estimate_weights": flight.weights,
            **({"scale": flight.scale} if flight.scale != 1.0 else {}),  # `round_policy: balanced` only
        }
    fragments = engine.fragments
    trajectories = [f.trajectory for f in fragments if f.trajectory is not None]
    return {
        "fingerprint": engine.config.fingerprint(),
        "settings": engine.config.shared_settings(),
        "inner_step": engine.inner_step,
        "global": [f.theta_g.clone() for f in fragments],
        "local": [f.local() for f in fragments],
        "anchor": [t.values.clone() for t in trajectories] if trajectories else None,
        "outer_optimizer": merged_optimizer_state([f.outer_optimizer for f in fragments]),
        "anchor_optimizer": merged_optimizer_state([t.optimizer for t in trajectories]) if trajectories else None,
        "inner_optimizer": None if engine.inner_optimizer is None else engine.inner_optimizer.state_dict(),
        "residual": [f.residual for f in fragments],
        "pending": pending,
        "stats": dict(engine.stats),
        "lowrank": [f.compressor.state_dict() for f in fragments] if engine.config.lowrank_rank else None,
        "divergence_guard": engine.guard.state_dict(),
        "shard": shard_description(engine),
        **({"round_policy": engine.round_policy.state_dict()} if engine.round_policy.balanced else {}),
    }


def shard_description(engine: DiLoCo) -> dict:
    """Which share of the outer state this rank holds."""
    topology = engine.topology
    kind = "fsdp" if engine.sharded_model else "replicated"
    return {"index": topology.dp_index, "count": topology.data_parallel_size, "kind": kind}


def load_engine_state(engine: DiLoCo, state: dict) -> None:
    """Restore `engine_state`'s mapping into `engine` (refused when the settings or fragment sizes differ)."""
    _check_compatible(engine, state)
    engine.inner_step = int(state["inner_step"])
    for fragment, saved, local, residual in zip(engine.fragments, state["global"], state["local"], state["residual"]):
        fragment.theta_g.copy_(saved)
        fragment.write_local(local)
        fragment.residual = residual
        fragment.flight = None
    load_merged_optimizer_state([f.outer_optimizer for f in engine.fragments], state["outer_optimizer"])
    if state["anchor"] is not None:
        trajectories = [f.trajectory for f in engine.fragments]
        for trajectory, saved in zip(trajectories, state["anchor"]):
            trajectory.values.data.copy_(saved)
            trajectory.optimizer.state.clear()
        if state.get("anchor_optimizer") is not None:
            load_merged_optimizer_state([t.optimizer for t in trajectories], state["anchor_optimizer"])
    if engine.inner_optimizer is not None and state["inner_optimizer"] is not None:
        engine.inner_optimizer.load_state_dict(state["inner_optimizer"])
    for index, item in state["pending"].items():
        result = ExchangeResult(item["average"], item["residual"], item["bytes_sent"], item["bytes_sent_intra_worker"])
        fragment = engine.fragments[int(index)]
        sent = placed(item["sent"], fragment.device)  # eager subtracts it from the next Δm, which lives there
        fragment.flight = InFlight(
            PendingExchange.completed(result),
            item["apply_at"],
            sent,
            item.get("estimate_weights"),
            item.get("scale", 1.0),
        )
    engine.stats = engine.rounds.stats = EngineStats.from_dict(state["stats"])
    for fragment, saved in zip(engine.fragments, state.get("lowrank") or []):
        fragment.compressor.load_state_dict(saved)
    engine.guard.load_state_dict(state.get("divergence_guard"))
    engine.round_policy.load_state_dict(state.get("round_policy"))


def _check_compatible(engine: DiLoCo, state: dict) -> None:
    check_same_settings(
        engine.config, state, "This DiLoCo checkpoint was written", "resume with the settings it was saved with"
    )
    saved, mine = state.get("shard"), shard_description(engine)
    if mine["count"] > 1 and saved != mine:
        raise ValueError(
            f"This DiLoCo checkpoint holds the outer-state share {saved} (data-parallel index, ranks per worker, "
            f"sharding) but this rank holds {mine}: load each rank's own state file, into the same sharding (FSDP or "
            "replicated) it was written with."
        )
    if len(state["global"]) != len(engine.fragments) or any(
        saved.shape != f.theta_g.shape for saved, f in zip(state["global"], engine.fragments)
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
