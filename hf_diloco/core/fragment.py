"""One fragment's state: its pieces of the model, its slice of θg and outer optimizer, its error-feedback residual,
its low-rank compressor, its exchange in flight and (eager) its own trajectory.

A fragment's values travel as one flat fp32 vector: its pieces (`fragments.Piece`, a parameter's rows) concatenated
in order. Every per-fragment tensor below (θg, the residual, a pseudo-gradient, an average) has that layout.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .exchange import PendingExchange
from .fragments import Piece
from .lowrank import LowRankCompressor

OptimizerFactory = Callable[[torch.Tensor], torch.optim.Optimizer]


@dataclass
class InFlight:
    """A launched exchange of one fragment, and what its round needs when it completes.

    Attributes:
        pending: the exchange (holds its buffers until it is done).
        apply_at: the inner step after which it is applied (streaming: launch + τ; delayed/eager: a round later).
        sent: this worker's pseudo-gradient as it was sent.
        weights: fitted eager, per piece: the w of the estimate w·sent applied at launch (None: 1/M each).
    """

    pending: PendingExchange
    apply_at: int
    sent: torch.Tensor | None = None
    weights: list[float] | None = None


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
    """Fragment `index` of the model: the pieces it syncs and everything its outer rounds keep.

    Args:
        index: p, the fragment's position in the schedule.
        pieces: the (parameter, rows) pieces it syncs, in the order of its flat vector.
        params: the model's trainable parameters by name.
        device: where θg, its outer optimizer state and the trajectory live (`global_copy_device`).
        make_optimizer: builds an outer optimizer over one tensor.
        compressor: its PowerSGD compressor when `lowrank_rank` > 0.

    Attributes:
        theta_g: θg of the fragment (fp32, identical on every worker).
        outer_optimizer: OuterOpt over `theta_g` alone.
        residual: error feedback: what the last exchange did not send, added to the next pseudo-gradient.
        flight: the exchange in flight, if any.
        trajectory: `overlap="eager"` only, this worker's a_m.
    """

    def __init__(
        self,
        index: int,
        pieces: Sequence[Piece],
        params: dict[str, nn.Parameter],
        device: torch.device,
        make_optimizer: OptimizerFactory,
        compressor: LowRankCompressor | None = None,
    ):
        self.index = index
        self.pieces = list(pieces)
        self._params = params
        self.device = device
        self.shapes = [piece.shape(params[piece.name].shape) for piece in self.pieces]
        self.sizes = tuple(math.prod(shape) for shape in self.shapes)
        self.theta_g = self.local().to(device)
        self.outer_optimizer = make_optimizer(self.theta_g)
        self.residual: torch.Tensor | None = None
        self.compressor = compressor
        self.flight: InFlight | None = None
        self.trajectory: Trajectory | None = None

    def names(self) -> list[str]:
        """Names of the parameters the fragment holds rows of, once each."""
        return list(dict.fromkeys(piece.name for piece in self.pieces))

    def local(self) -> torch.Tensor:
        """θm: this worker's current values of the fragment, as a fresh flat fp32 CPU vector."""
        if not self.pieces:
            return torch.zeros(0, dtype=torch.float32, device=self.device)
        return torch.cat([self._rows(piece).detach().reshape(-1).to("cpu", torch.float32) for piece in self.pieces])

    def write_local(self, values: torch.Tensor) -> None:
        """θm <- values."""
        with torch.no_grad():
            for piece, chunk in self.unflatten(values):
                local = self._rows(piece)
                local.copy_(chunk.to(local.device, local.dtype))

    def merge_local(self, alpha: float) -> None:
        """θm <- α·θm + (1 - α)·θg."""
        self.write_local(alpha * self.local().to(self.device) + (1 - alpha) * self.theta_g)

    def unflatten(self, flat: torch.Tensor) -> list[tuple[Piece, torch.Tensor]]:
        """(piece, view of `flat` in the piece's shape) for every piece."""
        views = flat.split(self.sizes) if self.pieces else ()
        return [(piece, view.view(shape)) for piece, view, shape in zip(self.pieces, views, self.shapes)]

    def pseudo_gradient(self, start: torch.Tensor) -> torch.Tensor:
        """Δm = start - θm (start: where the round began), plus the error-feedback residual not yet sent."""
        return self.with_residual(self.moved_from(start))

    def moved_from(self, start: torch.Tensor) -> torch.Tensor:
        return start - self.local().to(self.device)

    def with_residual(self, delta: torch.Tensor) -> torch.Tensor:
        if self.residual is not None:
            delta += self.residual.to(self.device)
        return delta

    def outer_step(self, average: torch.Tensor) -> None:
        """θg <- OuterOpt(θg, average)."""
        optimizer_step(self.outer_optimizer, self.theta_g, average)

    def reset_nonfinite_inner_state(self, inner_optimizer: torch.optim.Optimizer | None) -> int:
        """Drop the inner optimizer state of this fragment's parameters that holds NaN/inf; returns how many."""
        if inner_optimizer is None:
            return 0
        resets = 0
        for name in self.names():
            state = inner_optimizer.state.get(self._params[name])
            if state and any(torch.is_tensor(v) and not bool(torch.isfinite(v).all()) for v in state.values()):
                inner_optimizer.state[self._params[name]] = {}
                resets += 1
        return resets

    def _rows(self, piece: Piece) -> torch.Tensor:
        """The parameter's rows the piece covers (a view, so writes reach the parameter)."""
        param = self._params[piece.name]
        return param if param.dim() == 0 else param[piece.start : piece.stop]


def optimizer_step(optimizer: torch.optim.Optimizer, tensor: torch.Tensor, gradient: torch.Tensor) -> None:
    """One step of `optimizer` (over `tensor` alone) with `gradient` as the gradient."""
    tensor.grad = gradient
    optimizer.step()
    tensor.grad = None
