"""The DiLoCo engine: launch, apply and merge of fragment-wise outer syncs.

Sources: DiLoCo (Douillard et al. 2023, arXiv 2311.08105), Streaming DiLoCo (Douillard et al. 2025,
arXiv 2501.18512), DiLoCoX (arXiv 2506.21263, one-step delay) and Eager updates (Kale et al. 2025,
arXiv 2502.12996). The exact update rules of every overlap mode are written in `DiLoCo`'s docstring.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..config import DiLoCoConfig
from . import exchange as exchange_module
from .adaptive import CODEC_BITS, WindowEnergyPolicy, policy_compressions
from .codecs import make_codec
from .exchange import ExchangeResult, OuterExchange, PendingExchange
from .fragments import Piece, find_block_stack, fragments_launched_at, launch_offset, partition_fragments
from .lowrank import LowRankCompressor
from .topology import Topology


@dataclass
class _InFlight:
    pending: PendingExchange
    apply_at: int  # inner step after which the exchange is applied
    sent: torch.Tensor | None = None  # own pseudo-gradient as sent (eager needs it next round)
    weights: list[float] | None = None  # fitted eager: per piece, the w of the estimate w·sent applied at launch


class DiLoCo:
    """DiLoCo outer loop around any model and inner optimizer.

    Call `step()` after every inner optimizer step (t counts them from 1) and `close()` at the end.

    Notation for fragment p: θg the fp32 global copy (identical on every worker), θm this worker's parameters,
    OuterOpt the outer optimizer (Nesterov SGD by default), avg the fp32 mean over workers of what they sent, H the
    inner steps, P the fragments, τ `sync_delay`, α `merge_alpha`. Fragment p is launched after step t when
    `t % H == ((p + 1) * H // P) % H`.

    overlap="streaming" (Streaming DiLoCo; P = 1, τ = 0 is plain DiLoCo):
        launch at t: send Δm = θg - θm(t).
        apply at t + τ: θg <- OuterOpt(θg, avg); θm <- θg if τ = 0 else α·θm + (1 - α)·θg.
    overlap="delayed" (DiLoCoX one-step delay): a round's average is applied one round later, hidden by it.
        at launch r: send Δm^r = θg - θm; then wait for round r-1, θg <- OuterOpt(θg, avg^{r-1}); θm <- θg.
        Each round starts from a global model that lacks the previous round's update (hence its loss penalty).
    overlap="eager" (Kale et al.): own contribution fresh, the others one round stale, corrected a round later.
        Each worker runs its own trajectory a_m (its start point of every round) with its own outer optimizer state
        OuterOpt_m (same settings as OuterOpt), fed Δ~ every round:
        at launch r: send Δm^r = a_m - θm; wait for round r-1 and apply the true average to θg,
        θg <- OuterOpt(θg, avg^{r-1}); then Δ~ = avg^{r-1} + (Δm^r - Δm^{r-1}) / M
        (= (1/M)·Δm^r + (1/M)·sum_{k≠m} Δk^{r-1}); θm <- a_m <- OuterOpt_m(a_m, Δ~).
        Summed over rounds, a_m has received every worker's contribution exactly once (its own at once, the others'
        one round later; the -Δm^{r-1}/M is the correction of the round before). θg, which is evaluated and saved,
        only ever sees true averages and is identical on every worker; a_m is per worker. In the first round, and
        after a round skipped on every worker, a_m and OuterOpt_m restart from θg and its state, and Δ~ = Δm^r / M.
        That is `eager_estimate="own_share"`. In general Δ~ = avg^{r-1} - w^{r-1}·Δm^{r-1} + w^r·Δm^r: the estimate
        w^r·Δm^r of round r's average is applied at once and swapped for the true average a round later (own_share:
        w = 1/M). `eager_estimate="fitted"`: one w per parameter (row piece), w^r = <Δm^{r-1}, avg^{r-1}> /
        <Δm^{r-1}, Δm^{r-1}> over its values, clipped to [1/M, 1]: the least-squares share of the last average this
        worker's own pseudo-gradient explains (1/M in a first or restarted round). Workers that start a round together
        move alike, so w is near 1 when they agree and 1/M when they do not; the correction makes any w lose nothing
        over the rounds; per parameter, the estimate does not depend on how parameters are grouped into fragments or
        pipeline stages.
    `close()` waits for what is in flight and applies it at once, then syncs each fragment's tail (steps since its
    last launch) by a plain average, θg <- θg - avg (no outer step), so θg holds every inner step; θm <- θg. The tail
    also carries every error-feedback residual not yet sent.

    With `lowrank_rank` > 0, the exchange averages a PowerSGD approximation of Δm instead (see `lowrank.py`; its error
    feedback is always on), and with `adaptive_compression` a policy picks rank and codec per sync (`adaptive.py`;
    pluggable: assign another `CompressionPolicy` to `engine.exchange.policy`, choices in `engine.exchange.choices`).

    A non-finite average (some worker produced NaN/inf) is skipped by every worker alike: θg and the outer state
    stay as they were, θm <- θg, and `stats["skipped_nonfinite"]` counts it.
    """

    def __init__(
        self,
        model: nn.Module,
        inner_optimizer: torch.optim.Optimizer | None,
        config: DiLoCoConfig,
        topology: Topology | None = None,
        num_blocks: int | None = None,
    ):
        self.config = config
        self.model = model
        self.inner_optimizer = inner_optimizer
        self.topology = topology or Topology.from_default_group(
            config.pipeline_stages, config.data_parallel_per_worker, config.sync_timeout_seconds
        )
        self._check_topology_matches_config()
        self._params = dict((name, p) for name, p in model.named_parameters() if p.requires_grad)
        self._fragments = partition_fragments(
            {name: tuple(p.shape) for name, p in self._params.items()},
            config.num_fragments,
            config.fragment_pattern,
            find_block_stack(model),
            num_blocks,
        )
        self._check_workers_agree()
        self._broadcast_initial_parameters()
        self._device = torch.device(config.global_copy_device)
        self._global = [self._flatten_local(p).to(self._device) for p in range(config.num_fragments)]
        self._anchor = [g.clone() for g in self._global] if config.overlap == "eager" else None
        self._outer_optimizer = self._make_outer_optimizer(self._global)
        self._anchor_optimizer = None if self._anchor is None else self._make_outer_optimizer(self._anchor)
        self._residual: list[torch.Tensor | None] = [None] * config.num_fragments
        self._in_flight: dict[int, _InFlight] = {}
        self.exchange = OuterExchange(
            self.topology,
            make_codec(config.compression, config.compression_block_size, config.compression_scale_dtype),
            config.sync_timeout_seconds,
            keep_residual=config.error_feedback,
            clip_factor=config.robust_clip_factor,
            entropy_coding=config.entropy_coding,
            pattern=config.exchange_pattern,
        )
        self._lowrank = self._make_lowrank()
        self._step_seconds: float | None = None
        self._step_ended: float | None = None
        self.inner_step = 0
        self.stats: dict[str, float] = {
            "outer_steps": 0,
            "final_syncs": 0,
            "final_sync_bytes": 0,
            "max_sync_bytes": 0,
            "bytes_sent": 0,
            "bytes_sent_intra_worker": 0,
            "sync_wait_seconds": 0.0,
            "skipped_nonfinite": 0,
            "inner_state_resets": 0,
            "clipped_contributions": 0,
            "pseudo_grad_norm": 0.0,
        }
        if self._lowrank is not None:
            self.stats["lowrank_rank"] = config.lowrank_rank
            self.stats["compression_bits"] = CODEC_BITS[config.compression]

    # ----------------------------------------------------------------------------------------------- public API

    def step(self) -> None:
        """Advance the schedule by one completed inner optimizer step."""
        self._clock_step()
        self.inner_step += 1
        t = self.inner_step
        for fragment, flight in sorted(self._in_flight.items(), key=lambda item: item[1].apply_at):
            if self.config.overlap == "streaming" and flight.apply_at == t:
                self._apply_streaming(fragment)
        for fragment in fragments_launched_at(t, self.config.inner_steps, self.config.num_fragments):
            self._launch(fragment)
        self._step_ended = time.perf_counter()

    def close(self) -> None:
        """Apply everything still in flight (in launch order), then sync the steps no round has covered yet.

        A fragment trained for k > 0 steps since its last launch (the tail of a run whose length is not a multiple of
        its schedule, e.g. fragment 0 of Streaming DiLoCo, last launched H - H/P steps before the end) sends that
        tail's pseudo-gradient once more, blocking, and θg_p takes the plain average (θg_p <- θg_p - mean_m Δm, no
        outer optimizer step: the outer momentum would extrapolate a partial round). Without it the final θg, which
        is what gets evaluated and saved, would drop up to H - H/P steps of training. Every worker has the same step
        count, so every worker syncs the same fragments. Afterwards θm <- θg on every worker.

        Error feedback loses nothing here either: with delayed/eager the drain brings the last round's residual while
        the one before it is still unsent, so both are kept, and a tail carries them. With outer lr 1 and no momentum,
        θg minus the workers' mean residual still held then equals θ0 minus the mean of every pseudo-gradient they
        produced (a test).
        """
        streaming = self.config.overlap == "streaming"
        tails = self._tail_fragments()
        # delayed/eager: how far θm moved since the round started, measured before the drain resets θm.
        moved = {} if streaming else {p: self._moved(p) for p in tails}
        unsent = list(self._residual)
        for fragment in sorted(self._in_flight, key=lambda p: self._in_flight[p].apply_at):
            if streaming:
                self._apply_streaming(fragment, tau_override=0)
            else:
                self._finish_round(fragment, self._in_flight.pop(fragment))
                self._write_local(fragment, self._global[fragment])
        if not streaming:
            self._residual = [_sum_of_residuals(a, b) for a, b in zip(unsent, self._residual)]
        for fragment in tails:
            delta = self._pseudo_gradient(fragment) if streaming else self._with_residual(fragment, moved[fragment])
            self._sync_tail(fragment, delta)
        if self._anchor is not None:  # θm = θg now; training after close() starts from there
            for fragment in range(self.config.num_fragments):
                self._restart_eager_trajectory(fragment)
        self.exchange.close()

    def fragment_names(self) -> list[list[str]]:
        """Parameter names per fragment (with `balanced`, a matrix cut by rows is named in every fragment)."""
        return [self._names_in(fragment) for fragment in range(len(self._fragments))]

    def fragment_pieces(self) -> list[list[Piece]]:
        """Per fragment, the (name, start row, stop row) pieces it syncs, in the order of its flat buffer."""
        return [list(pieces) for pieces in self._fragments]

    def global_parameters(self) -> dict[str, torch.Tensor]:
        """fp32 θg by parameter name (views of the flat per-fragment buffers; a copy for a parameter cut by rows)."""
        rows: dict[str, list[tuple[int, torch.Tensor]]] = {}
        for fragment in range(len(self._fragments)):
            for piece, values in self._unflatten(fragment, self._global[fragment]):
                rows.setdefault(piece.name, []).append((piece.start, values))
        return {
            name: parts[0][1]
            if len(parts) == 1
            else torch.cat([values for _, values in sorted(parts, key=lambda part: part[0])])
            for name, parts in rows.items()
        }

    @contextlib.contextmanager
    def global_weights(self) -> Iterator[nn.Module]:
        """Temporarily load θg into the model (to evaluate or save the global model); the local weights come back."""
        saved = [self._flatten_local(p) for p in range(len(self._fragments))]
        try:
            for fragment in range(len(self._fragments)):
                self._write_local(fragment, self._global[fragment])
            yield self.model
        finally:
            for fragment, values in enumerate(saved):
                self._write_local(fragment, values)

    def metrics(self) -> dict[str, float]:
        """`diloco/*` scalars for logging; computed from local state only (no collective)."""
        drift = self._relative_drift()
        logs = {f"diloco/{key}": float(value) for key, value in self.stats.items()}
        logs["diloco/local_global_drift"] = drift
        logs["diloco/inner_step"] = float(self.inner_step)
        return logs

    def state_dict(self) -> dict:
        """Everything needed to continue bitwise: waits for in-flight exchanges but does not apply them."""
        pending = {}
        for fragment, flight in self._in_flight.items():
            result = self._wait(flight.pending)
            flight.pending = PendingExchange.completed(result)
            pending[fragment] = {
                "apply_at": flight.apply_at,
                "average": result.average,
                "residual": result.residual,
                "bytes_sent": result.bytes_sent,
                "bytes_sent_intra_worker": result.bytes_sent_intra_worker,
                "sent": flight.sent,
                "estimate_weights": flight.weights,
            }
        return {
            "fingerprint": self.config.fingerprint(),
            "inner_step": self.inner_step,
            "global": [g.clone() for g in self._global],
            "local": [self._flatten_local(p) for p in range(len(self._fragments))],
            "anchor": None if self._anchor is None else [a.clone() for a in self._anchor],
            "outer_optimizer": self._outer_optimizer.state_dict(),
            "anchor_optimizer": None if self._anchor_optimizer is None else self._anchor_optimizer.state_dict(),
            "inner_optimizer": None if self.inner_optimizer is None else self.inner_optimizer.state_dict(),
            "residual": list(self._residual),
            "pending": pending,
            "stats": dict(self.stats),
            "lowrank": None if self._lowrank is None else [c.state_dict() for c in self._lowrank],
        }

    def load_state_dict(self, state: dict) -> None:
        if state["fingerprint"] != self.config.fingerprint():
            raise ValueError(
                "This DiLoCo checkpoint was written with different DiLoCo settings (fingerprint "
                f"{state['fingerprint']} != {self.config.fingerprint()}); resume with the settings it was saved with."
            )
        if len(state["global"]) != len(self._global) or any(
            a.shape != b.shape for a, b in zip(state["global"], self._global)
        ):
            raise ValueError("This DiLoCo checkpoint does not match the model's parameters (fragment sizes differ).")
        self.inner_step = int(state["inner_step"])
        self._global = [g.to(self._device).clone() for g in state["global"]]
        self._outer_optimizer = self._make_outer_optimizer(self._global)
        self._outer_optimizer.load_state_dict(state["outer_optimizer"])
        if state["anchor"] is not None:
            self._anchor = [a.to(self._device).clone() for a in state["anchor"]]
            self._anchor_optimizer = self._make_outer_optimizer(self._anchor)
            if state.get("anchor_optimizer") is not None:
                self._anchor_optimizer.load_state_dict(state["anchor_optimizer"])
        for fragment, values in enumerate(state["local"]):
            self._write_local(fragment, values)
        if self.inner_optimizer is not None and state["inner_optimizer"] is not None:
            self.inner_optimizer.load_state_dict(state["inner_optimizer"])
        self._residual = list(state["residual"])
        self._in_flight = {}
        for fragment, item in state["pending"].items():
            result = ExchangeResult(
                item["average"], item["residual"], item["bytes_sent"], item["bytes_sent_intra_worker"]
            )
            self._in_flight[int(fragment)] = _InFlight(
                PendingExchange.completed(result), item["apply_at"], item["sent"], item.get("estimate_weights")
            )
        self.stats = dict(state["stats"])
        for compressor, saved in zip(self._lowrank or [], state.get("lowrank") or []):
            compressor.load_state_dict(saved)

    # ----------------------------------------------------------------------------------------------- schedule

    def _pseudo_gradient(self, fragment: int) -> torch.Tensor:
        """Δm = (where this round started) - θm, plus the error-feedback residual not yet sent."""
        return self._with_residual(fragment, self._moved(fragment))

    def _moved(self, fragment: int) -> torch.Tensor:
        start = self._anchor[fragment] if self.config.overlap == "eager" else self._global[fragment]
        return start - self._flatten_local(fragment).to(self._device)

    def _with_residual(self, fragment: int, delta: torch.Tensor) -> torch.Tensor:
        if self._residual[fragment] is not None:
            delta += self._residual[fragment].to(self._device)
        return delta

    def _tail_fragments(self) -> list[int]:
        """Fragments with inner steps since their last launch (or never launched, after at least one step)."""
        t, inner_steps = self.inner_step, self.config.inner_steps
        tails = []
        for fragment in range(self.config.num_fragments):
            offset = launch_offset(fragment, inner_steps, self.config.num_fragments)
            first_launch = offset or inner_steps
            since_launch = t if t < first_launch else (t - offset) % inner_steps
            if since_launch > 0:
                tails.append(fragment)
        return tails

    def _sync_tail(self, fragment: int, delta: torch.Tensor) -> None:
        description = (
            f"final outer sync of fragment {fragment} at inner step {self.inner_step} "
            f"with peers {self.topology.outer_peers()}"
        )
        compressor = None if self._lowrank is None else self._lowrank[fragment]
        pending = self.exchange.launch(
            delta.cpu(), description, blocking=True, compressor=compressor, context=self._launch_context(fragment)
        )
        bytes_before = self.stats["bytes_sent"]
        average = self._collect(fragment, _InFlight(pending, self.inner_step))
        self.stats["final_sync_bytes"] = (
            self.stats.get("final_sync_bytes", 0) + self.stats["bytes_sent"] - bytes_before
        )
        if average is not None:
            self._global[fragment] -= average
            self.stats["final_syncs"] = self.stats.get("final_syncs", 0) + 1  # older checkpoints lack the key
        self._write_local(fragment, self._global[fragment])

    def _launch(self, fragment: int) -> None:
        mode = self.config.overlap
        delta = self._pseudo_gradient(fragment)
        self.stats["pseudo_grad_norm"] = float(delta.norm())
        blocking = mode == "streaming" and self.config.sync_delay == 0
        description = f"outer sync of fragment {fragment} at inner step {self.inner_step} with peers {self.topology.outer_peers()}"
        compressor = None if self._lowrank is None else self._lowrank[fragment]
        pending = self.exchange.launch(
            delta.cpu(), description, blocking=blocking, compressor=compressor, context=self._launch_context(fragment)
        )
        if mode == "streaming":
            self._in_flight[fragment] = _InFlight(pending, self.inner_step + self.config.sync_delay)
            if self.config.sync_delay == 0:
                self._apply_streaming(fragment)
            return
        previous = self._in_flight.pop(fragment, None)
        flight = _InFlight(pending, self.inner_step + self.config.inner_steps, sent=delta)
        self._in_flight[fragment] = flight
        average = self._finish_round(fragment, previous) if previous is not None else None
        if mode == "delayed":
            self._write_local(fragment, self._global[fragment])
            return
        flight.weights = self._eager_update(fragment, delta, previous, average)

    def _eager_update(
        self, fragment: int, delta: torch.Tensor, previous: _InFlight | None, average: torch.Tensor | None
    ) -> list[float] | None:
        """a_m <- OuterOpt_m(a_m, Δ~) and θm <- a_m (the exact rule is in the class docstring); returns w^r."""
        estimate, weights = self._eager_estimate(fragment, delta, previous, average)
        finite = bool(torch.isfinite(estimate).all())
        # Restart from the agreed θg in the first round, after a round skipped everywhere, and when this worker's own
        # Δm is non-finite (its round will be skipped everywhere, so it must not enter the trajectory).
        if average is None or not finite:
            self._restart_eager_trajectory(fragment)
        if finite:
            self._optimizer_step(self._anchor_optimizer, self._anchor, fragment, estimate)
        self._write_local(fragment, self._anchor[fragment])
        return weights

    def _eager_estimate(
        self, fragment: int, delta: torch.Tensor, previous: _InFlight | None, average: torch.Tensor | None
    ) -> tuple[torch.Tensor, list[float] | None]:
        """Δ~ and w^r per piece (None: 1/M for all): w^r·Δm^r for round r, plus what avg^{r-1} adds to last round's
        w^{r-1}·Δm^{r-1} (nothing to add in a first or restarted round)."""
        workers = self.topology.num_workers
        if average is None:
            return delta / workers, None
        if self.config.eager_estimate == "own_share":
            return average + (delta - previous.sent) / workers, None
        sizes = [math.prod(shape) for shape in self._piece_shapes(fragment)]
        own_pieces = previous.sent.split(sizes)
        weights = [fitted_estimate_weight(own, mean, workers) for own, mean in zip(own_pieces, average.split(sizes))]
        applied = previous.weights or [1.0 / workers] * len(weights)
        estimate = average.clone()
        for out, sent, fresh, before, now in zip(
            estimate.split(sizes), own_pieces, delta.split(sizes), applied, weights
        ):
            out.add_(sent, alpha=-before).add_(fresh, alpha=now)
        self.stats["eager_estimate_weight"] = sum(w * n for w, n in zip(weights, sizes)) / max(1, sum(sizes))
        return estimate, weights

    def _apply_streaming(self, fragment: int, tau_override: int | None = None) -> None:
        flight = self._in_flight.pop(fragment)
        applied = self._finish_round(fragment, flight)
        tau = self.config.sync_delay if tau_override is None else tau_override
        if applied is None or tau == 0:
            self._write_local(fragment, self._global[fragment])
            return
        alpha = self.config.merge_alpha
        local = self._flatten_local(fragment).to(self._device)
        self._write_local(fragment, alpha * local + (1 - alpha) * self._global[fragment])

    def _finish_round(self, fragment: int, flight: _InFlight) -> torch.Tensor | None:
        """Wait for a round's exchange and take the outer step on θg; returns the average (None if skipped)."""
        average = self._collect(fragment, flight)
        if average is not None:
            self._outer_step(fragment, average)
            self.stats["outer_steps"] += 1
        return average

    def _collect(self, fragment: int, flight: _InFlight) -> torch.Tensor | None:
        """Wait for an exchange and account for it; returns the average, or None when it is non-finite (skipped)."""
        result = self._wait(flight.pending)
        self.stats["bytes_sent"] += result.bytes_sent
        self.stats["max_sync_bytes"] = max(self.stats.get("max_sync_bytes", 0), result.bytes_sent)
        self.stats["bytes_sent_intra_worker"] += result.bytes_sent_intra_worker
        if self.config.num_fragments > 1:  # per-fragment counters, logged as diloco/fragment{p}_*
            self.stats[f"fragment{fragment}_syncs"] = self.stats.get(f"fragment{fragment}_syncs", 0) + 1
            self.stats[f"fragment{fragment}_bytes_sent"] = (
                self.stats.get(f"fragment{fragment}_bytes_sent", 0) + result.bytes_sent
            )
        self._residual[fragment] = result.residual
        if result.choice is not None:
            self.stats["lowrank_rank"] = result.choice["rank"]
            self.stats["compression_bits"] = CODEC_BITS[result.choice["compression"]]
        self.stats["clipped_contributions"] += int(result.clipped)
        average = result.average.to(self._device)
        if not bool(torch.isfinite(average).all()):
            # Every worker decodes the same bytes, so every worker skips this round alike.
            self.stats["skipped_nonfinite"] += 1
            self._residual[fragment] = None
            self._reset_nonfinite_inner_state(fragment)
            return None
        return average

    def _launch_context(self, fragment: int) -> dict:
        """What an adaptive policy needs to know about this launch (how much compute the exchange can hide behind)."""
        overlap_steps = self.config.sync_delay
        if self.config.overlap != "streaming":
            overlap_steps = self.config.inner_steps // self.config.num_fragments
        return {
            "step": self.inner_step,
            "fragment": fragment,
            "step_seconds": self._step_seconds,
            "overlap_steps": overlap_steps,
        }

    def _clock_step(self) -> None:
        """Average compute time of one inner step: time between two `step()` calls, outside the engine."""
        if self._step_ended is None:
            return
        elapsed = time.perf_counter() - self._step_ended
        self._step_seconds = elapsed if self._step_seconds is None else 0.9 * self._step_seconds + 0.1 * elapsed

    def _make_lowrank(self) -> list[LowRankCompressor] | None:
        """One PowerSGD compressor per fragment (the initial Q is seeded by the fragment index on every worker)."""
        config = self.config
        if not config.lowrank_rank:
            return None
        adaptive = config.adaptive_compression
        if adaptive:
            self.exchange.policy = WindowEnergyPolicy(
                config.lowrank_rank,
                config.lowrank_min_rank,
                policy_compressions(config.compression),
                config.adaptive_energy_threshold,
                dense=config.adaptive_dense,
            )
            self.exchange.codec_factory = functools.partial(
                make_codec, block_size=config.compression_block_size, scale_dtype=config.compression_scale_dtype
            )
            self.exchange.assumed_link_bytes_per_second = config.adaptive_link_bytes_per_second or None
        return [
            LowRankCompressor(
                self._piece_shapes(fragment),
                config.lowrank_rank,
                seed=fragment,
                track_energy=adaptive,
                compression=config.compression,
            )
            for fragment in range(len(self._fragments))
        ]

    def _reset_nonfinite_inner_state(self, fragment: int) -> None:
        """A worker that produced NaN/inf would keep doing so from poisoned Adam moments: drop only those states."""
        if self.inner_optimizer is None:
            return
        for name in self._names_in(fragment):
            state = self.inner_optimizer.state.get(self._params[name])
            if state and any(torch.is_tensor(v) and not bool(torch.isfinite(v).all()) for v in state.values()):
                self.inner_optimizer.state[self._params[name]] = {}
                self.stats["inner_state_resets"] += 1

    def _wait(self, pending: PendingExchange) -> ExchangeResult:
        started = time.perf_counter()
        result = pending.wait()
        self.stats["sync_wait_seconds"] += time.perf_counter() - started
        return result

    # ----------------------------------------------------------------------------------------------- outer optimizer

    def _make_outer_optimizer(self, tensors: list[torch.Tensor]) -> torch.optim.Optimizer:
        momentum = self.config.outer_momentum
        return torch.optim.SGD(
            tensors,
            lr=self.config.outer_lr,
            momentum=momentum,
            nesterov=self.config.outer_nesterov and momentum > 0,
        )

    def _outer_step(self, fragment: int, gradient: torch.Tensor) -> None:
        self._optimizer_step(self._outer_optimizer, self._global, fragment, gradient)

    @staticmethod
    def _optimizer_step(
        optimizer: torch.optim.Optimizer, tensors: list[torch.Tensor], fragment: int, gradient: torch.Tensor
    ) -> None:
        """One optimizer step on `tensors[fragment]` alone (the other fragments' tensors have no gradient)."""
        for index, tensor in enumerate(tensors):
            tensor.grad = gradient if index == fragment else None
        optimizer.step()
        tensors[fragment].grad = None

    def _restart_eager_trajectory(self, fragment: int) -> None:
        """a_m <- θg and OuterOpt_m's state <- OuterOpt's, for one fragment (in place: the optimizer holds a_m)."""
        anchor, glob = self._anchor[fragment], self._global[fragment]
        anchor.data.copy_(glob)
        state = self._outer_optimizer.state.get(glob, {})
        self._anchor_optimizer.state[anchor] = {k: v.clone() if torch.is_tensor(v) else v for k, v in state.items()}

    # ----------------------------------------------------------------------------------------------- parameters

    def _flatten_local(self, fragment: int) -> torch.Tensor:
        pieces = [self._local_piece(piece) for piece in self._fragments[fragment]]
        if not pieces:
            return torch.zeros(0, dtype=torch.float32, device=self._device_or_cpu())
        return torch.cat([p.detach().reshape(-1).to("cpu", torch.float32) for p in pieces])

    def _write_local(self, fragment: int, values: torch.Tensor) -> None:
        with torch.no_grad():
            for piece, chunk in self._unflatten(fragment, values):
                local = self._local_piece(piece)
                local.copy_(chunk.to(local.device, local.dtype))

    def _names_in(self, fragment: int) -> list[str]:
        """Names of the parameters the fragment holds rows of, once each."""
        return list(dict.fromkeys(piece.name for piece in self._fragments[fragment]))

    def _local_piece(self, piece: Piece) -> torch.Tensor:
        """The parameter's rows the piece covers (a view, so writes reach the parameter)."""
        param = self._params[piece.name]
        return param if param.dim() == 0 else param[piece.start : piece.stop]

    def _piece_shapes(self, fragment: int) -> list[tuple[int, ...]]:
        """The shape of each piece of `fragment`, in the order they lie in its flat vector."""
        return [piece.shape(self._params[piece.name].shape) for piece in self._fragments[fragment]]

    def _unflatten(self, fragment: int, flat: torch.Tensor) -> list[tuple[Piece, torch.Tensor]]:
        out, offset = [], 0
        for piece, shape in zip(self._fragments[fragment], self._piece_shapes(fragment)):
            size = math.prod(shape)
            out.append((piece, flat[offset : offset + size].view(shape)))
            offset += size
        return out

    def _device_or_cpu(self) -> torch.device:
        return getattr(self, "_device", torch.device("cpu"))

    def _relative_drift(self) -> float:
        squared_diff, squared_norm = 0.0, 0.0
        for fragment in range(len(self._fragments)):
            local = self._flatten_local(fragment).to(self._device)
            squared_diff += float((local - self._global[fragment]).pow(2).sum())
            squared_norm += float(self._global[fragment].pow(2).sum())
        return (squared_diff / squared_norm) ** 0.5 if squared_norm > 0 else 0.0

    # ----------------------------------------------------------------------------------------------- start-up checks

    def _check_topology_matches_config(self) -> None:
        layout = self.topology.layout
        if (layout.pipeline_stages, layout.data_parallel) != (
            self.config.pipeline_stages,
            self.config.data_parallel_per_worker,
        ):
            raise ValueError(
                f"The topology has pipeline_stages={layout.pipeline_stages}, data_parallel={layout.data_parallel} "
                f"but the config says pipeline_stages={self.config.pipeline_stages}, "
                f"data_parallel_per_worker={self.config.data_parallel_per_worker}."
            )

    def _check_workers_agree(self) -> None:
        """Invariant 7: a config or model mismatch between ranks is an error at start, never a hang later."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return
        shapes = ";".join(self._describe(piece) for pieces in self._fragments for piece in pieces)
        config_hash = int(self.config.fingerprint(), 16) & (2**62 - 1)
        mine = torch.tensor(
            [exchange_module.WIRE_FORMAT, config_hash, _stable_hash(shapes), self.topology.stage_index],
            dtype=torch.int64,
        )
        if dist.get_backend() == "nccl":
            mine = mine.cuda()
        everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, mine)
        formats = [int(t[0]) for t in everyone]
        if len(set(formats)) != 1:
            raise ValueError(
                f"Ranks use different outer-exchange wire formats ({formats}, by rank): they run different hf_diloco "
                "versions. Install the same hf_diloco version on every node."
            )
        configs = [int(t[1]) for t in everyone]
        if len(set(configs)) != 1:
            odd = [r for r, c in enumerate(configs) if c != configs[0]]
            raise ValueError(
                f"DiLoCo settings differ between ranks (ranks {odd} disagree with rank 0): every worker must use the "
                "same inner_steps, num_fragments, compression, ... Check the config and DILOCO_* variables on each node."
            )
        stage = self.topology.stage_index
        same_stage = [r for r, t in enumerate(everyone) if int(t[3]) == stage]
        models = {int(everyone[r][2]) for r in same_stage}
        if len(models) != 1:
            raise ValueError(
                f"Ranks {same_stage} hold different model shapes for pipeline stage {stage}; every worker must "
                "train the same architecture."
            )

    def _describe(self, piece: Piece) -> str:
        shape = tuple(self._params[piece.name].shape)
        rows = "" if piece.shape(shape) == shape else f"[{piece.start}:{piece.stop}]"
        return f"{piece.name}{rows}:{shape}"

    def _broadcast_initial_parameters(self) -> None:
        """Start every worker from the same weights: worker 0's, passed along the outer group, then inside the worker."""
        topo = self.topology
        with torch.no_grad():
            for group, source in ((topo.outer_group, topo.outer_peers()[0]), (topo.data_parallel_sync_group, None)):
                if group is None:
                    continue
                if source is None:
                    source = topo.layout.rank_at(topo.worker_index, 0, topo.stage_index)
                for param in self._params.values():
                    buffer = param.detach().to("cpu").contiguous()
                    dist.broadcast(buffer, src=source, group=group)
                    param.copy_(buffer.to(param.device))


def fitted_estimate_weight(own: torch.Tensor, average: torch.Tensor, workers: int) -> float:
    """The w in [1/M, 1] minimising ||average - w·own||: how much of a round's average this worker's own
    pseudo-gradient explains (about (1 + (M - 1)·c) / M when the workers' pseudo-gradients have cosine c)."""
    energy = float(torch.dot(own, own))
    fit = float(torch.dot(own, average)) / energy if energy > 0 else 0.0
    return min(1.0, max(1.0 / workers, fit)) if math.isfinite(fit) else 1.0 / workers


def _sum_of_residuals(first: torch.Tensor | None, second: torch.Tensor | None) -> torch.Tensor | None:
    if first is None or second is None:
        return second if first is None else first
    return first + second


def _stable_hash(text: str) -> int:
    import hashlib

    return int(hashlib.sha256(text.encode()).hexdigest()[:15], 16)
