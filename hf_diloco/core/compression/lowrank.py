"""PowerSGD-style low-rank compression of a fragment's pseudo-gradient, with warm start and error feedback.

Source: PowerSGD (Vogels et al. 2019, arXiv 1905.13727), as used for the outer sync by DiLoCoX (arXiv 2506.21263).

A fragment's flat pseudo-gradient is the concatenation of its parameters (in the fragment's order). Every parameter
with two or more dimensions is viewed as a matrix `M` of shape `(shape[0], numel // shape[0])`; it is compressed when
rank `max_rank` saves bytes, i.e. `(rows + cols) * max_rank < rows * cols`. Everything else (1-D tensors, small
matrices) goes into a flat "rest" vector that is averaged as it is. One round on worker i, rank r:

    M_i   = Δ_i + e_i                      (pseudo-gradient plus this worker's error feedback, per matrix)
    P_i   = M_i Q                          (Q: (cols, r), identical on every worker)
    P     = avg_i P_i      rest = avg_i rest_i           (first averaging call: [P of every matrix ++ rest])
    P^    = orthonormalize(P)              (modified Gram-Schmidt in fp32, two passes; identical on every worker)
    Q_i   = M_i^T P^
    Q'    = avg_i Q_i                                    (second averaging call: [Q of every matrix])
    out   = P^ Q'^T                        (the averaged approximation, identical on every worker)
    e_i   = M_i - P^ (Q_i - q_i)^T         (q_i: what quantization dropped from this worker's Q_i, 0 if unknown)
    e_i  += r_i on the rest positions      (r_i: what quantization dropped from this worker's rest, 0 if unknown)
    Q     <- Q' for the next round         (warm start)

Because the average is linear, `avg_i (M_i - e_i)` is exactly what was transmitted (up to the re-quantization of
the averaged chunks), so error feedback carries everything the rank-r approximation missed into the next round and
nothing is lost over time. The first Q of matrix j is `torch.randn(cols_j, max_rank, generator=g)[:, :rank]` with
`g = torch.Generator().manual_seed(seed)` drawn for the matrices in order, so all workers start from the same Q.
A Q column that is zero or non-finite (e.g. after an all-zero round) is redrawn from a generator seeded with
`seed + 1000003 * round + matrix index`, the same on every worker.

Rank 0 means a dense round: the whole flat vector is averaged as it is (no factorisation), the residual is only what
quantization dropped, and the warm start Q is kept for the next factorised round. With `track_energy` a dense round
still measures the spectrum, locally: one power iteration from Q on this worker's own matrices. An adaptive policy
picks it when the whole vector fits the window (`adaptive_dense`).

Changing the rank between rounds keeps the best subspace: shrinking to k keeps the top-k left singular directions of
Q (scaled by their singular values), growing appends freshly drawn columns.

With a fragment split between the D data-parallel ranks of a worker, each matrix is factored by one rank, its owner
(`lowrank_split.py`): `assign_owners` keeps the warm start of this rank's matrices only (None for the others').
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

# Averages a flat fp32 vector across workers; returns (average, what quantization dropped from this worker's copy or
# None). Supplied by the exchange, so P, Q and the rest are quantized by the configured codec.
Averager = Callable[[torch.Tensor], tuple[torch.Tensor, "torch.Tensor | None"]]

_REDRAW_STRIDE = 1000003
_DEPENDENT_COLUMN = 1e-5  # a column whose norm fell below this fraction by projection is treated as dependent


@dataclass(frozen=True)
class Matrix:
    offset: int
    rows: int
    cols: int

    @property
    def numel(self) -> int:
        return self.rows * self.cols


@dataclass
class LowRankResult:
    average: torch.Tensor  # flat averaged approximation, identical on every worker
    residual: torch.Tensor | None  # this worker's error feedback for the next round (None without error feedback)


def orthonormalize(matrix: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns spanning `matrix`'s columns, in order (modified Gram-Schmidt, two passes, fp32).

    Deterministic: the same input gives the same bits. A column that is (numerically) dependent on the previous ones,
    zero or non-finite comes back as zeros instead of amplified round-off.
    """
    basis = matrix.detach().to(torch.float32).clone()
    for i in range(basis.shape[1]):
        column = basis[:, i]
        original = column.norm()
        for _ in range(2):  # "twice is enough": the second pass removes what round-off left of the first
            if i:
                column -= basis[:, :i] @ (basis[:, :i].T @ column)
        norm = column.norm()
        if not bool(torch.isfinite(norm)) or norm <= _DEPENDENT_COLUMN * original or norm == 0:
            column.zero_()
        else:
            column /= norm
    return basis


class LowRankCompressor:
    """Low-rank (PowerSGD) averaging of one fragment's flat pseudo-gradient; see the module docstring for the rule.

    Args:
        shapes: the fragment's parameter shapes, in the order of the flat vector.
        rank: the rank to start with (at most `max_rank`).
        max_rank: the largest rank that may ever be used; decides which matrices are compressed. Defaults to `rank`.
        seed: seed of the initial Q, the same on every worker.
        error_feedback: keep `e_i` and return it as `residual` (without it the rank-r truncation is lost for good).
        track_energy: after each round, record how the pseudo-gradient's energy spreads over the ranks
            (`captured_energy`), for adaptive policies.
        compression: the codec P, Q and the rest are averaged with (the exchange updates it after each round).
    """

    def __init__(
        self,
        shapes: Sequence[Sequence[int]],
        rank: int,
        max_rank: int | None = None,
        seed: int = 0,
        error_feedback: bool = True,
        track_energy: bool = False,
        compression: str = "none",
    ):
        self.max_rank = rank if max_rank is None else max_rank
        if not 1 <= rank <= self.max_rank:
            raise ValueError(f"lowrank_rank must be in [1, {self.max_rank}], got {rank}.")
        self.rank = rank
        self.seed = seed
        self.error_feedback = error_feedback
        self.track_energy = track_energy
        self.compression = compression
        self.rounds = 0
        self.numel = 0
        self.matrices: list[Matrix] = []
        self._rest_mask_parts: list[tuple[int, int]] = []
        for shape in shapes:
            numel = int(torch.Size(shape).numel())
            rows = int(shape[0]) if len(shape) >= 2 else 0
            cols = numel // rows if rows else 0
            if rows and (rows + cols) * self.max_rank < numel:
                self.matrices.append(Matrix(self.numel, rows, cols))
            else:
                self._rest_mask_parts.append((self.numel, numel))
            self.numel += numel
        self.rest_numel = sum(n for _, n in self._rest_mask_parts)
        self._rest_index = self._build_rest_index()
        self.q: list[torch.Tensor | None] = self._initial_q()  # None: a matrix another rank owns
        self.owners: tuple[int, ...] | None = None  # per matrix, the data-parallel rank that factors it (split)
        self.owner_index = 0  # with `owners`: this rank's index among the worker's data-parallel ranks
        self.captured_energy: list[float] | None = None  # entry k-1: share of ||M||^2 captured by the top k ranks

    # ------------------------------------------------------------------------------------------------ sizes

    def vector_lengths(self, rank: int | None = None) -> list[int]:
        """Lengths of the vectors one round averages at `rank`: `[P of every matrix ++ rest, Q of every matrix]`
        (rank 0, a dense round: `[numel]`)."""
        rank = self.rank if rank is None else rank
        if rank == 0:
            return [self.numel]
        if not self.matrices:
            return [self.rest_numel]
        rows = sum(m.rows for m in self.matrices)
        cols = sum(m.cols for m in self.matrices)
        return [rows * rank + self.rest_numel, cols * rank]

    # ------------------------------------------------------------------------------------------------ one round

    def run(self, flat: torch.Tensor, average: Averager, rank: int | None = None) -> LowRankResult:
        """Average `flat` (this worker's pseudo-gradient, fp32, length `numel`) across workers at `rank`."""
        if flat.numel() != self.numel:
            raise ValueError(f"expected a flat pseudo-gradient of {self.numel} values, got {flat.numel()}.")
        if self.owners is not None:
            raise ValueError("This compressor's matrices are split between data-parallel ranks: use lowrank_split.")
        if rank is not None and rank != self.rank:
            self.set_rank(rank)
        flat = flat.detach().to(torch.float32)
        if self.rank == 0:
            if self.track_energy and self.matrices:
                self._measure_spectrum_locally(flat)
            average_of_all, dropped = average(flat)
            return LowRankResult(average_of_all, dropped if self.error_feedback else None)
        rest = flat[self._rest_index]
        if not self.matrices:
            rest_avg, rest_dropped = average(rest)
            return self._finish(flat, [], [], [], rest_avg, rest_dropped)
        self.redraw_dead_columns()
        matrices = self._matrix_views(flat)
        p_parts = [matrix @ q for matrix, q in zip(matrices, self.q)]
        p_avg, rest_dropped = average(torch.cat([p.reshape(-1) for p in p_parts] + [rest]))
        p_hats = [orthonormalize(p) for p in self._split(p_avg, [m.rows for m in self.matrices])]
        rest_avg = p_avg[p_avg.numel() - self.rest_numel :]
        if rest_dropped is not None:
            rest_dropped = rest_dropped[rest_dropped.numel() - self.rest_numel :]
        q_parts = [matrix.T @ p_hat for matrix, p_hat in zip(matrices, p_hats)]
        q_avg, q_dropped = average(torch.cat([q.reshape(-1) for q in q_parts]))
        self.q = [q.clone() for q in self._split(q_avg, [m.cols for m in self.matrices])]
        if q_dropped is not None:
            dropped = self._split(q_dropped, [m.cols for m in self.matrices])
            q_parts = [q - d for q, d in zip(q_parts, dropped)]
        if self.track_energy:
            self._record_energy(matrices, q_parts)
        self.rounds += 1
        return self._finish(flat, matrices, p_hats, q_parts, rest_avg, rest_dropped)

    def _finish(
        self,
        flat: torch.Tensor,
        matrices: list[torch.Tensor],
        p_hats: list[torch.Tensor],
        q_sent: list[torch.Tensor],
        rest_avg: torch.Tensor,
        rest_dropped: torch.Tensor | None,
    ) -> LowRankResult:
        out = torch.empty_like(flat)
        out[self._rest_index] = rest_avg
        residual = torch.zeros_like(flat) if self.error_feedback else None
        for slot, matrix, p_hat, q_mine, q_avg in zip(self.matrices, matrices, p_hats, q_sent, self.q):
            out[slot.offset : slot.offset + slot.numel] = (p_hat @ q_avg.T).reshape(-1)
            if residual is not None:
                residual[slot.offset : slot.offset + slot.numel] = (matrix - p_hat @ q_mine.T).reshape(-1)
        if residual is not None and rest_dropped is not None:
            residual[self._rest_index] = rest_dropped
        return LowRankResult(out, residual)

    # ------------------------------------------------------------------------------------------------ rank and Q

    def set_rank(self, rank: int) -> None:
        """Change the rank for the next round, keeping the best directions of the current warm start (rank 0: a dense
        round, which leaves the warm start as it is)."""
        if not 0 <= rank <= self.max_rank:
            raise ValueError(f"rank must be in [0, {self.max_rank}], got {rank}.")
        self.rank = rank
        if rank == 0:
            return
        resized: list[torch.Tensor | None] = []
        for index, q in enumerate(self.q):
            if q is None:
                resized.append(None)
                continue
            if rank < q.shape[1]:
                u, s, _ = torch.linalg.svd(q, full_matrices=False)
                q = u[:, :rank] * s[:rank]
            elif rank > q.shape[1]:
                fresh = torch.randn(q.shape[0], rank - q.shape[1], generator=self._redraw_generator(index))
                q = torch.cat([q, fresh], dim=1)
            resized.append(q.contiguous())
        self.q = resized

    def _initial_q(self) -> list[torch.Tensor]:
        generator = torch.Generator().manual_seed(self.seed)
        return [torch.randn(m.cols, self.max_rank, generator=generator)[:, : self.rank].clone() for m in self.matrices]

    def assign_owners(self, owners: Sequence[int], me: int) -> None:
        """Matrix j is factored by data-parallel rank `owners[j]`; this rank (`me`) keeps only its own matrices' warm
        starts. The same owners again change nothing."""
        owners = tuple(owners)
        if len(owners) != len(self.matrices):
            raise ValueError(f"expected an owner for each of the {len(self.matrices)} matrices, got {len(owners)}.")
        missing = [j for j, (q, owner) in enumerate(zip(self.q, owners)) if owner == me and q is None]
        if missing:
            raise ValueError(
                f"This low-rank state lacks the warm start of matrices {missing[:3]}, which data-parallel rank {me} "
                "factors: load each rank's own state file, with the same data_parallel_per_worker."
            )
        self.owners, self.owner_index = owners, me
        self.q = [q if owner == me else None for q, owner in zip(self.q, owners)]

    def redraw_dead_columns(self) -> None:
        """Redraw every zero or non-finite column of the warm starts this rank keeps (see the module docstring)."""
        for index, q in enumerate(self.q):
            if q is None:
                continue
            norms = q.norm(dim=0)
            dead = ~torch.isfinite(norms) | (norms == 0)
            if bool(dead.any()):
                fresh = torch.randn(q.shape, generator=self._redraw_generator(index))
                self.q[index] = torch.where(dead[None, :], fresh, q)

    def _redraw_generator(self, index: int) -> torch.Generator:
        return torch.Generator().manual_seed(self.seed + _REDRAW_STRIDE * (self.rounds + 1) + index)

    # ------------------------------------------------------------------------------------------------ helpers

    def _matrix_views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[m.offset : m.offset + m.numel].view(m.rows, m.cols) for m in self.matrices]

    def _measure_spectrum_locally(self, flat: torch.Tensor) -> None:
        """A dense round's spectrum: one power iteration from the warm start on this worker's own matrices, with no
        communication and Q left as it is (it must stay identical on every worker)."""
        matrices = self._matrix_views(flat)
        p_hats = [orthonormalize(matrix @ q) for matrix, q in zip(matrices, self.q)]
        self._record_energy(matrices, [matrix.T @ p_hat for matrix, p_hat in zip(matrices, p_hats)])

    def _record_energy(self, matrices: list[torch.Tensor], q_parts: list[torch.Tensor]) -> None:
        """Share of this worker's ||M||^2 captured by the best rank-k part of its approximation, k = 1..rank."""
        self.captured_energy = captured_share(energy_terms(matrices, q_parts, self.max_rank))

    def _build_rest_index(self) -> torch.Tensor:
        if not self._rest_mask_parts:
            return torch.zeros(0, dtype=torch.long)
        return torch.cat([torch.arange(start, start + n) for start, n in self._rest_mask_parts])

    def _split(self, vector: torch.Tensor, leading: list[int]) -> list[torch.Tensor]:
        parts, offset = [], 0
        for size in leading:
            parts.append(vector[offset : offset + size * self.rank].view(size, self.rank))
            offset += size * self.rank
        return parts

    # ------------------------------------------------------------------------------------------------ state

    def state_dict(self) -> dict:
        """The warm start of the matrices this rank keeps (None for another rank's), the rank and the round count."""
        return {
            "rank": self.rank,
            "compression": self.compression,
            "rounds": self.rounds,
            "q": [None if q is None else q.clone() for q in self.q],
            "captured_energy": self.captured_energy,
        }

    def load_state_dict(self, state: dict) -> None:
        if len(state["q"]) != len(self.matrices):
            raise ValueError("This low-rank state does not match the fragment's matrices.")
        self.rank = int(state["rank"])
        self.compression = state["compression"]
        self.rounds = int(state["rounds"])
        self.q = [None if q is None else q.clone() for q in state["q"]]
        if self.owners is not None:
            self.assign_owners(self.owners, self.owner_index)
        self.captured_energy = state["captured_energy"]


def energy_terms(matrices: Sequence[torch.Tensor], q_parts: Sequence[torch.Tensor], max_rank: int) -> torch.Tensor:
    """What `captured_share` needs of some matrices, in float64: `[sum ||M||^2, k, e_1 .. e_max_rank]`, with e_i the
    squared i-th singular values of the approximations summed over the matrices and k the rank they were made at.
    Terms of disjoint sets of matrices add up (`max` for k: the data-parallel ranks of a worker sum theirs)."""
    terms = torch.zeros(2 + max_rank, dtype=torch.float64)
    terms[0] = sum(float(m.pow(2).sum()) for m in matrices) + 0.0
    # P^ has orthonormal columns, so the singular values of P^ Q_i^T are those of Q_i.
    for q in q_parts:
        values = torch.linalg.svdvals(q).to(torch.float64).pow(2)
        terms[1] = max(float(terms[1]), q.shape[1])
        terms[2 : 2 + values.numel()] += values
    return terms


def captured_share(terms: torch.Tensor) -> list[float] | None:
    """Entry k-1: the share of ||M||^2 the best rank-k part captured, k = 1..rank (None: no energy, or not finite)."""
    total = float(terms[0])
    if not total > 0 or not torch.isfinite(torch.tensor(total)):
        return None
    per_rank = terms[2 : 2 + int(terms[1])]
    return (per_rank.cumsum(0) / total).clamp(max=1.0).tolist()
