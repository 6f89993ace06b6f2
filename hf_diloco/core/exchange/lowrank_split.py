"""Low-rank (PowerSGD) rounds with a fragment split between the D data-parallel ranks of a worker.

Each rank holds a share of the fragment's flat pseudo-gradient (a `ShardLayout`). PowerSGD multiplies whole
matrices, so each compressed matrix is factored by one rank, its owner (`matrix_owners`: the largest matrix first,
each to the rank that holds the most of it among those it leaves within the average load plus the largest matrix;
the same on every worker, whose rank k therefore owns the same matrices as rank k of every other worker). One round on rank k of worker i:

1. One `all_to_all` on the worker's data-parallel group moves every piece of a matrix that k holds but does not own
   to the owner, which assembles its matrices M (each value that is not on its owner's share crosses once).
2. The owner computes P = M Q and averages `[P of its matrices ++ the rest of its share]` across workers with the
   ranks k of the other workers; P^ = orthonormalize(P avg), Q_i = M^T P^, and it averages `[Q of its matrices]`
   the same way: Q' (its warm start for the next round). The rest is every value of the share outside a compressed
   matrix (1-D tensors, matrices too small to shrink).
3. A second `all_to_all` sends each rank that holds part of a matrix the factors of the rows its pieces cover:
   P^[rows], Q' and (with error feedback) the Q it transmitted, Q_i minus what quantizing Q_i dropped. Every rank
   computes its share of the average P^ Q'^T and of its residual M - P^ Q_sent^T from them.

So no rank holds the whole fragment, every multiplication is done by one rank of the worker, and each rank keeps
the residual of its own share, quantization included (a rank knows what encoding its own vectors dropped). With
adaptive compression, each rank measures the energy of its matrices and the worker sums the terms
(`energy_terms`) over its data-parallel group, so every rank records the whole worker's spectrum. A dense round
(rank 0) averages the share as it is.

Intra-worker bytes per rank (fp32): the pieces it sends to owners, plus, for each piece another rank holds of a
matrix it owns, `(rows covered + cols x (1 + error feedback)) x rank` values; plus `(D - 1) x 8 x (2 + max_rank)`
for the energy terms with `track_energy`.
"""

from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..compression.lowrank import (
    Averager,
    LowRankCompressor,
    LowRankResult,
    Matrix,
    captured_share,
    energy_terms,
    orthonormalize,
)
from ..layout.shard import ShardLayout


@dataclass(frozen=True)
class Piece:
    """A stretch of one matrix that one rank holds."""

    matrix: int  # the matrix's index in the compressor's list
    start: int  # first value, counted in the matrix's flat values
    length: int
    at: int  # where it lies in the holder's share

    def rows(self, cols: int) -> tuple[int, int]:
        """The rows [first, stop) the stretch touches."""
        return self.start // cols, -(-(self.start + self.length) // cols)


@dataclass(frozen=True)
class SplitPlan:
    """Who factors which matrix and which pieces of the matrices each rank holds (the same on every worker)."""

    owners: tuple[int, ...]
    pieces: tuple[tuple[Piece, ...], ...]  # per rank, in the order of its share
    rest: torch.Tensor  # this rank's positions in its share outside every matrix

    def sent_to(self, holder: int, owner: int) -> list[Piece]:
        """The pieces `holder` holds of matrices `owner` factors."""
        return [piece for piece in self.pieces[holder] if self.owners[piece.matrix] == owner]


def matrix_owners(sizes: list[int], held: list[list[int]]) -> tuple[int, ...]:
    """Each matrix to one rank: the largest first, to the rank that holds the most of it (`held[j][k]`: values of
    matrix j on rank k) among those it leaves within the average load plus the largest matrix (LPT scheduling's own
    bound), ties to the less loaded rank, then the lower. So few values move to their owner, the loads stay balanced,
    and every worker assigns alike."""
    ranks = len(held[0]) if held else 1
    bound = sum(sizes) / ranks + max(sizes, default=0)
    owners, load = [0] * len(sizes), [0] * ranks
    for index in sorted(range(len(sizes)), key=lambda j: (-sizes[j], j)):
        fits = [k for k in range(ranks) if load[k] + sizes[index] <= bound] or list(range(ranks))
        owner = min(fits, key=lambda k: (-held[index][k], load[k], k))
        owners[index] = owner
        load[owner] += sizes[index]
    return tuple(owners)


@functools.lru_cache(maxsize=64)
def split_plan(matrices: tuple[Matrix, ...], layout: ShardLayout, me: int) -> SplitPlan:
    """The plan for a fragment's `matrices` split by `layout` between its ranks, seen from rank `me`."""
    starts = [m.offset for m in matrices]
    pieces: list[tuple[Piece, ...]] = []
    for runs in layout.runs:
        held, at = [], 0
        for offset, length in runs:
            first = max(0, bisect.bisect_right(starts, offset) - 1)
            for index in range(first, len(matrices)):
                matrix = matrices[index]
                if matrix.offset >= offset + length:
                    break
                lo, hi = max(offset, matrix.offset), min(offset + length, matrix.offset + matrix.numel)
                if lo < hi:
                    held.append(Piece(index, lo - matrix.offset, hi - lo, at + lo - offset))
            at += length
        pieces.append(tuple(held))
    held = [[0] * len(layout.runs) for _ in matrices]
    for rank, pieces_of_rank in enumerate(pieces):
        for piece in pieces_of_rank:
            held[piece.matrix][rank] += piece.length
    owners = matrix_owners([m.numel for m in matrices], held)
    outside = torch.ones(layout.length(me), dtype=torch.bool)
    for piece in pieces[me]:
        outside[piece.at : piece.at + piece.length] = False
    return SplitPlan(owners, tuple(pieces), outside.nonzero().reshape(-1))


def assign_owners(compressor: LowRankCompressor, layout: ShardLayout, me: int) -> None:
    """Tell `compressor` which matrices each rank factors, so that rank `me` keeps only its own warm starts (and
    refuses a state that lacks one of them when it is loaded)."""
    compressor.assign_owners(split_plan(tuple(compressor.matrices), layout, me).owners, me)


class SplitLowRank:
    """One low-rank round of rank `me` of a worker whose fragment is split by `layout` (see the module docstring).

    Args:
        compressor: the fragment's compressor; keeps the warm starts of the matrices this rank owns.
        layout: which runs of the fragment each data-parallel rank holds.
        me: this rank's index among the worker's data-parallel ranks.
        group: the worker's data-parallel group (the exchange thread's).
    """

    def __init__(self, compressor: LowRankCompressor, layout: ShardLayout, me: int, group: dist.ProcessGroup | None):
        if layout.numel != compressor.numel:
            raise ValueError(f"The layout covers {layout.numel} values; the compressor's fragment {compressor.numel}.")
        self.compressor, self.layout, self.me, self.group = compressor, layout, me, group
        self.plan = split_plan(tuple(compressor.matrices), layout, me)
        compressor.assign_owners(self.plan.owners, me)
        self.mine = [j for j, owner in enumerate(self.plan.owners) if owner == me]
        self.intra = 0  # bytes this rank sent inside the worker

    def run(self, share: torch.Tensor, average: Averager, rank: int | None = None) -> LowRankResult:
        """Average this rank's `share` (fp32) across workers at `rank`: its share of the averaged approximation and
        its residual. `average` averages a vector of this rank's own across workers (the same-index ranks)."""
        lr = self.compressor
        if share.numel() != self.layout.length(self.me):
            raise ValueError(
                f"expected this rank's share of {self.layout.length(self.me)} values, got {share.numel()}."
            )
        if rank is not None and rank != lr.rank:
            lr.set_rank(rank)
        share = share.detach().to(torch.float32)
        if lr.rank == 0:
            if lr.track_energy and lr.matrices:
                self._measure_spectrum(self._owned_matrices(share))
            averaged, dropped = average(share)
            return LowRankResult(averaged, dropped if lr.error_feedback else None)
        lr.redraw_dead_columns()
        matrices = self._owned_matrices(share)
        rest = share[self.plan.rest]
        p_parts = [matrix @ lr.q[j] for j, matrix in zip(self.mine, matrices)]
        p_avg, dropped = _averaged(average, torch.cat([p.reshape(-1) for p in p_parts] + [rest]))
        rest_avg = p_avg[p_avg.numel() - rest.numel() :]
        rest_dropped = None if dropped is None else dropped[dropped.numel() - rest.numel() :]
        p_hats = [orthonormalize(p) for p in self._split(p_avg, "rows")]
        q_parts = [matrix.T @ p_hat for matrix, p_hat in zip(matrices, p_hats)]
        q_avg, q_dropped = _averaged(average, _cat([q.reshape(-1) for q in q_parts]))
        for j, q in zip(self.mine, self._split(q_avg, "cols")):
            lr.q[j] = q.clone()
        if q_dropped is not None:
            q_parts = [q - d for q, d in zip(q_parts, self._split(q_dropped, "cols"))]
        if lr.track_energy:
            self._record_energy(matrices, q_parts)
        lr.rounds += 1
        factors = self._factors_of_my_pieces(p_hats, q_parts)
        return self._finish(share, factors, rest_avg, rest_dropped)

    # ------------------------------------------------------------------------------------------------ steps

    def _owned_matrices(self, share: torch.Tensor) -> list[torch.Tensor]:
        """The whole matrices this rank owns: its own pieces, and the others' moved here by one `all_to_all`."""
        plan, matrices = self.plan, self.compressor.matrices
        ranks = len(plan.pieces)
        outgoing = [_cat([share[p.at : p.at + p.length] for p in plan.sent_to(self.me, k)]) for k in range(ranks)]
        received = self._all_to_all(outgoing, [sum(p.length for p in plan.sent_to(k, self.me)) for k in range(ranks)])
        whole = {}
        for piece in plan.sent_to(self.me, self.me):
            if piece.length == matrices[piece.matrix].numel:  # held whole here: used where it lies, not copied
                whole[piece.matrix] = share[piece.at : piece.at + piece.length]
        for j in self.mine:
            whole.setdefault(j, torch.empty(matrices[j].numel, dtype=torch.float32))
        for holder in range(ranks):
            source, at = (share, None) if holder == self.me else (received[holder], 0)
            for piece in plan.sent_to(holder, self.me):
                if piece.length == matrices[piece.matrix].numel and holder == self.me:
                    continue
                begin = piece.at if at is None else at
                whole[piece.matrix][piece.start : piece.start + piece.length] = source[begin : begin + piece.length]
                at = None if at is None else at + piece.length
        return [whole[j].view(matrices[j].rows, matrices[j].cols) for j in self.mine]

    def _factors_of_my_pieces(
        self, p_hats: list[torch.Tensor], q_sent: list[torch.Tensor]
    ) -> dict[Piece, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
        """For each piece of a matrix this rank holds: P^ of the rows it touches, Q' and the Q its worker sent (None
        without error feedback), from the owner (a second `all_to_all`, or locally)."""
        plan, lr, rank = self.plan, self.compressor, self.compressor.rank
        ef = lr.error_feedback
        by_matrix = {j: (p_hat, lr.q[j], q) for j, p_hat, q in zip(self.mine, p_hats, q_sent)}

        def factors(piece: Piece) -> list[torch.Tensor]:
            p_hat, q_avg, q = by_matrix[piece.matrix]
            first, stop = piece.rows(lr.matrices[piece.matrix].cols)
            return [p_hat[first:stop], q_avg] + ([q] if ef else [])

        ranks = len(plan.pieces)
        outgoing = [
            _cat([f.reshape(-1) for piece in plan.sent_to(k, self.me) for f in factors(piece)])
            if k != self.me
            else torch.zeros(0)
            for k in range(ranks)
        ]
        arriving = [
            sum(self._factor_numel(piece, rank) for piece in plan.sent_to(self.me, k)) if k != self.me else 0
            for k in range(ranks)
        ]
        received = self._all_to_all(outgoing, arriving)
        out: dict[Piece, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = {}
        for owner in range(ranks):
            at = 0
            for piece in plan.sent_to(self.me, owner):
                if owner == self.me:
                    parts = factors(piece)
                else:
                    cols = lr.matrices[piece.matrix].cols
                    first, stop = piece.rows(cols)
                    shapes = [(stop - first, rank), (cols, rank)] + ([(cols, rank)] if ef else [])
                    parts = []
                    for shape in shapes:
                        parts.append(received[owner][at : at + shape[0] * shape[1]].view(shape))
                        at += shape[0] * shape[1]
                out[piece] = (parts[0], parts[1], parts[2] if ef else None)
        return out

    def _finish(
        self,
        share: torch.Tensor,
        factors: dict[Piece, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]],
        rest_avg: torch.Tensor,
        rest_dropped: torch.Tensor | None,
    ) -> LowRankResult:
        """This rank's share of the averaged approximation and of its residual, row block by row block."""
        lr = self.compressor
        out = torch.empty_like(share)
        out[self.plan.rest] = rest_avg
        residual = torch.zeros_like(share) if lr.error_feedback else None
        for piece, (p_rows, q_avg, q_sent) in factors.items():
            cols = lr.matrices[piece.matrix].cols
            skip = piece.start - piece.rows(cols)[0] * cols
            into = slice(piece.at, piece.at + piece.length)
            out[into] = (p_rows @ q_avg.T).reshape(-1)[skip : skip + piece.length]
            if residual is not None and q_sent is not None:
                kept = (p_rows @ q_sent.T).reshape(-1)[skip : skip + piece.length]
                residual[into] = share[into] - kept
        if residual is not None and rest_dropped is not None:
            residual[self.plan.rest] = rest_dropped
        return LowRankResult(out, residual)

    # ------------------------------------------------------------------------------------------------ energy

    def _measure_spectrum(self, matrices: list[torch.Tensor]) -> None:
        """A dense round's spectrum: one power iteration from the warm start on this worker's own matrices, each on
        its owner, the warm start left as it is."""
        lr = self.compressor
        p_hats = [orthonormalize(matrix @ lr.q[j]) for j, matrix in zip(self.mine, matrices)]
        self._record_energy(matrices, [matrix.T @ p_hat for matrix, p_hat in zip(matrices, p_hats)])

    def _record_energy(self, matrices: list[torch.Tensor], q_parts: list[torch.Tensor]) -> None:
        """The worker's captured energy: every rank's terms for its own matrices, summed in rank order."""
        terms = energy_terms(matrices, q_parts, self.compressor.max_rank)
        ranks = len(self.plan.pieces)
        if ranks > 1 and self.group is not None:
            everyone = [torch.empty_like(terms) for _ in range(ranks)]
            dist.all_gather(everyone, terms, group=self.group)
            self.intra += (ranks - 1) * terms.nbytes
            terms = everyone[0].clone()
            for other in everyone[1:]:
                terms[0] += other[0]
                terms[1] = torch.maximum(terms[1], other[1])
                terms[2:] += other[2:]
        self.compressor.captured_energy = captured_share(terms)

    # ------------------------------------------------------------------------------------------------ helpers

    def _factor_numel(self, piece: Piece, rank: int) -> int:
        cols = self.compressor.matrices[piece.matrix].cols
        first, stop = piece.rows(cols)
        return (stop - first + cols * (2 if self.compressor.error_feedback else 1)) * rank

    def _split(self, vector: torch.Tensor, side: str) -> list[torch.Tensor]:
        """`vector` cut into one (rows or cols) x rank factor per matrix this rank owns."""
        parts, at, rank = [], 0, self.compressor.rank
        for j in self.mine:
            size = getattr(self.compressor.matrices[j], side)
            parts.append(vector[at : at + size * rank].view(size, rank))
            at += size * rank
        return parts

    def _all_to_all(self, outgoing: list[torch.Tensor], arriving: list[int]) -> list[torch.Tensor]:
        """`outgoing[k]` (fp32) to data-parallel rank k; what each rank sent here (`arriving[k]` values from rank k).
        Nothing is sent to this rank itself."""
        sizes = [0 if k == self.me else part.numel() for k, part in enumerate(outgoing)]
        arriving = [0 if k == self.me else n for k, n in enumerate(arriving)]
        received = torch.empty(sum(arriving), dtype=torch.float32)
        if self.group is not None and len(outgoing) > 1:
            send = _cat([part for k, part in enumerate(outgoing) if k != self.me])
            dist.all_to_all_single(
                received, send, output_split_sizes=arriving, input_split_sizes=sizes, group=self.group
            )
            self.intra += 4 * sum(sizes)
        return list(received.split(arriving))


def _averaged(average: Averager, vector: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`average(vector)`, skipped when this rank has nothing (neither has the same rank of any other worker)."""
    if vector.numel() == 0:
        return vector, None
    return average(vector)


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float32)
