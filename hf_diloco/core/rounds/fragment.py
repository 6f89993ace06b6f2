"""One fragment's state: its pieces of the model, its slice of θg and outer optimizer, its error-feedback residual,
its low-rank compressor, its exchange in flight and (eager) its own trajectory.

A fragment's values form one flat fp32 vector: its pieces (`fragments.Piece`, a parameter's rows) concatenated in
order. With D data-parallel ranks per worker each rank owns runs of it (`shard.py`; all of it when D = 1), and every
per-fragment tensor below (θg, the residual, a pseudo-gradient, an average, eager's trajectory) holds this rank's
owned values only, its runs concatenated in order.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.optim.optimizer as optimizer_module
from torch import nn
from torch.distributed.tensor import DTensor

from ..compression.lowrank import LowRankCompressor
from ..exchange.pending import PendingExchange
from ..layout.buffers import BufferPool
from ..layout.fragments import Piece
from ..layout.shard import Values, Worker
from ..settings.outer_schedule import before_step

OptimizerFactory = Callable[[torch.Tensor], torch.optim.Optimizer]


@dataclass
class InFlight:
    """A launched exchange of one fragment, and what its round needs when it completes.

    Attributes:
        pending: the exchange (holds its buffers until it is done).
        apply_at: the inner step after which it is applied (streaming: launch + τ; delayed/eager: a round later).
        sent: this worker's pseudo-gradient as it was sent.
        weights: fitted eager, per piece: the w of the estimate w·sent applied at launch (None: 1/M each).
        scale: what Δm was multiplied by before it was sent (`round_policy: balanced`: M w_m / Σ w); the residual the
            exchange returns is divided by it, so error feedback carries it in Δm's own units.
    """

    pending: PendingExchange
    apply_at: int
    sent: torch.Tensor | None = None
    weights: list[float] | None = None
    scale: float = 1.0


class Trajectory:
    """Eager's per-worker start point a_m of a fragment, with its own outer optimizer OuterOpt_m (same settings)."""

    def __init__(self, start: torch.Tensor, make_optimizer: OptimizerFactory):
        self.values = start.clone()
        self.optimizer = make_optimizer(self.values)

    def restart_from(self, fragment: Fragment) -> None:
        """a_m <- θg and OuterOpt_m's state <- OuterOpt's (in place: the optimizer holds a_m)."""
        self.values.data.copy_(fragment.theta_g)
        state = fragment.outer_optimizer.state.get(fragment.theta_g, {})
        self.optimizer.state[self.values] = {k: v.clone() if torch.is_tensor(v) else v for k, v in state.items()}

    def step(self, update: torch.Tensor) -> None:
        optimizer_step(self.optimizer, self.values, update)


class Fragment:
    """Fragment `index` of the model: the pieces it syncs and everything its outer rounds keep, for this rank's share.

    Args:
        index: p, the fragment's position in the schedule.
        pieces: the (parameter, rows) pieces it syncs, in the order of its flat vector.
        params: the model's trainable parameters by name.
        device: where θg, its outer optimizer state and the trajectory live (`global_copy_device`).
        make_optimizer: builds an outer optimizer over one tensor.
        values: reads and writes this rank's owned values of the model (`shard.py`).
        compressor: its PowerSGD compressor when `lowrank_rank` > 0.
        buffers: where the pseudo-gradient is written when θg lives on the CPU (None: a fresh vector every round).

    Attributes:
        theta_g: θg of the fragment over this rank's runs (fp32, identical on every worker).
        outer_optimizer: OuterOpt over `theta_g` alone.
        residual: error feedback: what the last exchange did not send, added to the next pseudo-gradient.
        flight: the exchange in flight, if any.
        trajectory: `overlap="eager"` only, this worker's a_m.
        sizes: values per piece of the whole fragment; `owned_sizes`: of them, how many this rank owns.
    """

    def __init__(
        self,
        index: int,
        pieces: Sequence[Piece],
        params: dict[str, nn.Parameter],
        device: torch.device,
        make_optimizer: OptimizerFactory,
        values: Values,
        compressor: LowRankCompressor | None = None,
        buffers: BufferPool | None = None,
    ):
        self.index = index
        self.pieces = list(pieces)
        self._params = params
        self.device = device
        self.values = values
        self.shapes = [piece.shape(params[piece.name].shape) for piece in self.pieces]
        self.sizes = tuple(math.prod(shape) for shape in self.shapes)
        self.owned_sizes = values.owned_sizes()
        self.theta_g = self.local().to(device)
        self.outer_optimizer = make_optimizer(self.theta_g)
        self.residual: torch.Tensor | None = None
        self.compressor = compressor
        self.flight: InFlight | None = None
        self.trajectory: Trajectory | None = None
        self.buffers = buffers
        # (||θm - θg||², ||θg||²) over this rank's runs at the fragment's last launch (None: not launched yet).
        self.drift: tuple[float, float] | None = None

    def names(self) -> list[str]:
        """Names of the parameters the fragment holds rows of, once each."""
        return list(dict.fromkeys(piece.name for piece in self.pieces))

    def local(self) -> torch.Tensor:
        """θm: this worker's current values of the fragment over this rank's runs, as a fresh flat fp32 CPU vector."""
        return self.values.read()

    def write_local(self, values: torch.Tensor) -> None:
        """θm <- values over this rank's runs; the worker's other ranks write theirs at the same point, and every rank
        of the worker then holds the whole update (a collective among them when D > 1)."""
        self.values.write(values)

    def merge_local(self, alpha: float) -> None:
        """θm <- α·θm + (1 - α)·θg."""
        self.write_local(alpha * self.local().to(self.device) + (1 - alpha) * self.theta_g)

    def whole(self, owned: torch.Tensor) -> torch.Tensor:
        """The fragment's whole flat vector of an owned one (θg, say), gathered inside the worker when D > 1."""
        return self.values.gather(owned)

    def unflatten(self, flat: torch.Tensor) -> list[tuple[Piece, torch.Tensor]]:
        """(piece, view of the whole flat vector `flat` in the piece's shape) for every piece."""
        views = flat.split(self.sizes) if self.pieces else ()
        return [(piece, view.view(shape)) for piece, view, shape in zip(self.pieces, views, self.shapes)]

    def pseudo_gradient(self, start: torch.Tensor) -> torch.Tensor:
        """Δm = start - θm (start: where the round began), plus the error-feedback residual not yet sent."""
        return self.with_residual(self.moved_from(start))

    def record_drift(self, moved: torch.Tensor, start: torch.Tensor) -> float | None:
        """Keep ||θm - θg||² and ||θg||² from `moved` = start - θm, just read at a launch, so that logging the drift
        never reads the model: with start = θg (streaming, delayed) ||θm - θg|| is ||moved||; eager's start a_m is
        not θg, and θg - θm = moved - (a_m - θg) is summed piece by piece, on the host vectors only. Returns
        ||moved||² where it was computed (start = θg), so that the caller need not read `moved` again for it."""
        moved_squared = None
        with torch.no_grad():
            if start is self.theta_g:
                difference = moved_squared = float(torch.dot(moved, moved))
            else:
                difference = 0.0
                for first in range(0, moved.numel(), _STEP_PIECE):
                    piece = slice(first, first + _STEP_PIECE)
                    gap = moved[piece] - start[piece] + self.theta_g[piece]
                    difference += float(torch.dot(gap, gap))
            self.drift = (difference, float(torch.dot(self.theta_g, self.theta_g)))
        return moved_squared

    def moved_from(self, start: torch.Tensor) -> torch.Tensor:
        """start - θm, in a buffer of `buffers` when there is one and θg lives on the CPU. Over parameters narrower
        than fp32, `start` rounded to their dtype first: θm started there (`shard.concatenated`)."""
        if not self.uses_buffers:
            return self.values.rounded(start) - self.local().to(self.device)
        return self.values.read(out=self.buffers.take(sum(self.owned_sizes)), subtracted_from=start)

    def average_buffer(self) -> torch.Tensor | None:
        """Where the exchange writes this round's average: a buffer of `buffers` when θg lives on the CPU."""
        return self.buffers.take(sum(self.owned_sizes)) if self.uses_buffers else None

    @property
    def uses_buffers(self) -> bool:
        return self.buffers is not None and self.device.type == "cpu"

    def with_residual(self, delta: torch.Tensor) -> torch.Tensor:
        if self.residual is not None:
            delta += self.residual.to(self.device)
        return delta

    def outer_step(self, average: torch.Tensor) -> None:
        """θg <- OuterOpt(θg, average)."""
        optimizer_step(self.outer_optimizer, self.theta_g, average)

    def reset_nonfinite_inner_state(self, inner_optimizer: torch.optim.Optimizer | None, worker: Worker) -> int:
        """Drop the inner optimizer state of this fragment's parameters that holds NaN/inf on any rank of the worker
        (its shards, with FSDP); returns how many."""
        if inner_optimizer is None:
            return 0
        names = self.names()
        poisoned = worker.max([float(_nonfinite(inner_optimizer.state.get(self._params[name]))) for name in names])
        for name, flag in zip(names, poisoned):
            if flag:
                inner_optimizer.state[self._params[name]] = {}
        return sum(1 for flag in poisoned if flag)

    def held_tensors(self) -> list[torch.Tensor]:
        """Every tensor the fragment keeps beyond the model and the inner optimizer (an exchange in flight: what it
        sent; its result is `outer_state_bytes`'s to count)."""
        held = [self.theta_g, *_state_tensors(self.outer_optimizer)]
        if self.residual is not None:
            held.append(self.residual)
        if self.trajectory is not None:
            held += [self.trajectory.values, *_state_tensors(self.trajectory.optimizer)]
        if self.compressor is not None:
            held += [q for q in self.compressor.q if q is not None]  # the warm starts of the matrices it owns
        if self.flight is not None and self.flight.sent is not None:
            held.append(self.flight.sent)
        return held


def outer_state_bytes(
    fragments: Sequence[Fragment], results_per_exchange: int, buffers: Sequence[torch.Tensor] = ()
) -> int:
    """Bytes of what the fragments keep beyond the model and the inner optimizer (each storage counted once): θg, the
    outer optimizer state, eager's trajectory and its optimizer state, the error-feedback residual, the low-rank warm
    start, the exchanges in flight: what each sent and the `results_per_exchange` fp32 vectors of its share
    (average, residual) it returns, counted from its launch so that the figure does not depend on when it completes,
    and the reused `buffers` (`BufferPool.tensors()`)."""
    storages: dict[int, int] = {}
    results = 0
    for fragment in fragments:
        for tensor in [*fragment.held_tensors(), *buffers]:
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        if fragment.flight is not None:
            results += results_per_exchange * sum(fragment.owned_sizes) * 4
    return sum(storages.values()) + results


def _state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [value for state in optimizer.state.values() for value in state.values() if torch.is_tensor(value)]


def _nonfinite(state: dict | None) -> bool:
    return bool(state) and any(
        torch.is_tensor(v) and not bool(torch.isfinite(_local(v)).all()) for v in state.values()
    )


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


# Values per piece of a pieced SGD step: its Nesterov term stays in a core's cache.
_STEP_PIECE = 1 << 18


def optimizer_step(optimizer: torch.optim.Optimizer, tensor: torch.Tensor, gradient: torch.Tensor) -> None:
    """One step of `optimizer` (over `tensor` alone) with `gradient` as the gradient.

    The engine's outer optimizer, plain `torch.optim.SGD` on the CPU, is stepped here piece by piece with the same
    operations `SGD.step()` runs, so the bits are the same (`tests/test_buffers.py`); unpieced, its Nesterov term
    `gradient + momentum · buffer` is a fresh vector of the tensor's size every round. Any other optimizer steps as
    itself."""
    before_step(optimizer, tensor)  # the outer learning rate's schedule, where one is set
    if _steps_in_pieces(optimizer, tensor, gradient):
        _sgd_step_in_pieces(optimizer, tensor, gradient)
        return
    tensor.grad = gradient
    optimizer.step()
    tensor.grad = None


def _steps_in_pieces(optimizer: torch.optim.Optimizer, tensor: torch.Tensor, gradient: torch.Tensor) -> bool:
    """Whether `optimizer` is an SGD whose step `_sgd_step_in_pieces` runs exactly: one fp32 CPU tensor, no weight
    decay, maximize, fused, foreach or differentiable step, a number (not a tensor) as learning rate, no step hooks."""
    if type(optimizer) is not torch.optim.SGD or len(optimizer.param_groups) != 1:
        return False
    group = optimizer.param_groups[0]
    plain = (
        group["weight_decay"] == 0
        and not group["maximize"]
        and not group.get("fused")
        and not group.get("foreach")
        and not group.get("differentiable")
        and isinstance(group["lr"], (int, float))
        and not isinstance(group["lr"], bool)
    )
    hooks = (
        optimizer._optimizer_step_pre_hooks,
        optimizer._optimizer_step_post_hooks,
        optimizer_module._global_optimizer_pre_hooks,
        optimizer_module._global_optimizer_post_hooks,
    )
    return (
        plain
        and not any(hooks)
        and group["params"] == [tensor]
        and tensor.device.type == gradient.device.type == "cpu"
        and tensor.dtype == gradient.dtype == torch.float32
        and tensor.shape == gradient.shape
        and tensor.is_contiguous()
        and gradient.is_contiguous()
    )


def _sgd_step_in_pieces(optimizer: torch.optim.SGD, tensor: torch.Tensor, gradient: torch.Tensor) -> None:
    """`SGD.step()` (torch's one-tensor path) over pieces of `tensor`, its momentum buffer and `gradient`."""
    group = optimizer.param_groups[0]
    lr, momentum, dampening, nesterov = group["lr"], group["momentum"], group["dampening"], group["nesterov"]
    # SGD keeps state only with momentum (`optimizer.state` makes an entry on first access).
    buffer = optimizer.state[tensor].get("momentum_buffer") if momentum != 0 else None
    first = momentum != 0 and buffer is None
    with torch.no_grad():
        if first:
            buffer = optimizer.state[tensor]["momentum_buffer"] = gradient.detach().clone()
        flat, grad = tensor.view(-1), gradient.view(-1)
        moment = None if buffer is None else buffer.view(-1)
        term = torch.empty(min(_STEP_PIECE, flat.numel()), dtype=torch.float32) if nesterov else None
        for start in range(0, flat.numel(), _STEP_PIECE):
            stop = min(start + _STEP_PIECE, flat.numel())
            step = grad[start:stop]
            if moment is not None:
                piece = moment[start:stop]
                if not first:
                    piece.mul_(momentum).add_(step, alpha=1 - dampening)
                step = torch.add(step, piece, alpha=momentum, out=term[: stop - start]) if nesterov else piece
            flat[start:stop].add_(step, alpha=-lr)
