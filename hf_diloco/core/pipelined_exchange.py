"""The `reduce_scatter` exchange of a long shard in pieces, so that the link never waits for the host.

Unpipelined, one exchange of M workers is: encode every chunk, send each to its owner, wait for all of them, sum
the received chunks, encode the average, send it to every worker, wait, decode. The link idles while the host
encodes, sums and encodes again between the two transfers (at 1 Gbit/s that was a quarter of the exchange:
`benchmarks.link_rate`). Here each worker's chunk is cut into K equal pieces, every receive of both phases is posted
first, and piece k's average is summed, encoded and sent as soon as piece k of every peer has arrived, while the
later pieces are still on the wire; the residual of error feedback is computed while the first pieces travel. The
values are the same bits as unpipelined: each codec codes whole blocks (`align`), a piece is a whole number of them,
and the sum adds the workers' values in worker order either way; the bytes are the same too (K payloads of a piece
hold what one payload of the chunk holds, in another order).

Messages between two workers are matched in the order they are posted (gloo's pairs are ordered, and every message
here has tag 0): each worker posts its receives as phase 1 pieces 0..K-1, then phase 2 pieces 0..K-1, and sends in
that order (a phase-2 piece only after every phase-1 send is posted).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Executor

import torch
import torch.distributed as dist

from .codecs import Codec

PIECE_VALUES = 1 << 18  # values of one piece at the least: 1 MB of fp32, well above a message's fixed cost
MAX_PIECES = 16


def pipeline_pieces(chunk_numel: int, align: int) -> int:
    """K: how many equal pieces of whole codec blocks a chunk of `chunk_numel` values is exchanged in (1: not cut)."""
    for pieces in range(MAX_PIECES, 1, -1):
        if chunk_numel % (pieces * align) == 0 and chunk_numel // pieces >= PIECE_VALUES:
            return pieces
    return 1


def pipelined_reduce_scatter(
    chunks: list[torch.Tensor],
    pieces: int,
    codec: Codec,
    group: dist.ProcessGroup,
    me: int,
    divisor: int,
    pool: Executor | None,
    residual_of: Callable[[list[torch.Tensor]], torch.Tensor | None],
) -> tuple[list[torch.Tensor], torch.Tensor | None, int]:
    """The average over the workers of `chunks[me]`, every worker's chunk j going to worker j, then each average to
    every worker: the payloads of the averaged shard (worker-major, piece-minor: consecutive equal parts of the
    shard), the residual `residual_of` computes from this worker's own encoded pieces, and the bytes sent."""
    workers = len(chunks)
    numel = chunks[0].numel() // pieces
    nbytes = codec.encoded_nbytes(numel)
    peers = [j for j in range(workers) if j != me]
    arriving = {(j, k): torch.empty(nbytes, dtype=torch.uint8) for j in peers for k in range(pieces)}
    averaged = {(j, k): torch.empty(nbytes, dtype=torch.uint8) for j in peers for k in range(pieces)}
    receives = {
        key: dist.irecv(buffer, group=group, group_src=key[0]) for key, buffer in arriving.items()
    }  # phase 1 first, for every peer
    later = [dist.irecv(buffer, group=group, group_src=j) for (j, _), buffer in averaged.items()]
    sends, encoded = [], [[] for _ in chunks]
    for k in range(pieces):  # piece k leaves while piece k + 1 is encoded
        for j, chunk in enumerate(chunks):
            encoded[j].append(codec.encode(chunk[k * numel : (k + 1) * numel], pool))
        sends += [dist.isend(encoded[j][k], group=group, group_dst=j) for j in peers]
    residual = residual_of([payload for row in encoded for payload in row])  # while the pieces travel
    own_average = []
    for k in range(pieces):
        for j in peers:
            receives[j, k].wait()
        contributions = [encoded[me][k] if j == me else arriving[j, k] for j in range(workers)]
        average = codec.decode_sum(contributions, numel, pool).div_(divisor)
        own_average.append(codec.encode(average, pool))
        sends += [dist.isend(own_average[k], group=group, group_dst=j) for j in peers]
    for work in later + sends:
        work.wait()
    payloads = [own_average[k] if j == me else averaged[j, k] for j in range(workers) for k in range(pieces)]
    return payloads, residual, 2 * len(peers) * pieces * nbytes
