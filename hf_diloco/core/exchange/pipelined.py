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
from typing import TYPE_CHECKING

import torch

from ..compression.codecs import Codec

if TYPE_CHECKING:
    from .transport import Transport

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
    transport: Transport,
    divisor: int,
    pool: Executor | None,
    residual_of: Callable[[list[torch.Tensor]], torch.Tensor | None],
    scratch: Callable[[int], torch.Tensor],
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """The average over the workers of the shard `chunks` splits, every worker's chunk j going to worker j, then each
    average to every worker, in `out` (fp32, the shard's length) or a fresh vector; the residual `residual_of`
    computes from this worker's own encoded pieces; the bytes sent. `scratch(n)`: n reusable bytes.

    Codec `none` sends fp32 as it lies: its payload is the values' own bytes, so the pieces leave from the shard, the
    average is summed straight into `out` and sent from there, and the peers' averages land in `out` too; no payload
    is copied, and the host's passes are the sum's alone. Other codecs receive into scratch and decode at the end."""
    workers, me = len(chunks), transport.rank
    numel = chunks[0].numel() // pieces
    nbytes = codec.encoded_nbytes(numel)
    peers = [j for j in range(workers) if j != me]
    out = torch.empty(workers * pieces * numel, dtype=torch.float32) if out is None else out
    as_sent = codec.payload_is_values
    out_pieces = [part.split(numel) for part in out.split(chunks[0].numel())]  # [worker][piece], views of `out`
    keys = [(j, k) for j in peers for k in range(pieces)]  # (peer, piece), in the order messages are posted
    arriving = dict(zip(keys, scratch(len(keys) * nbytes).split(nbytes)))
    if as_sent:
        averaged = {(j, k): _as_payload(out_pieces[j][k]) for j, k in keys}
    else:
        averaged = dict(zip(keys, scratch(len(keys) * nbytes).split(nbytes)))
    receives = {
        key: transport.receive(buffer, key[0]) for key, buffer in arriving.items()
    }  # phase 1 first, for every peer
    later = [transport.receive(buffer, j) for (j, _), buffer in averaged.items()]
    encode = _as_payload if as_sent else (lambda values: codec.encode(values, pool))
    sends, encoded = [], [[] for _ in chunks]
    for k in range(pieces):  # piece k leaves while piece k + 1 is encoded
        for j, chunk in enumerate(chunks):
            encoded[j].append(encode(chunk[k * numel : (k + 1) * numel]))
        sends += [transport.send(encoded[j][k], j) for j in peers]
    residual = residual_of([payload for row in encoded for payload in row])  # while the pieces travel
    own_average = []
    for k in range(pieces):
        for j in peers:
            receives[j, k].wait()
        contributions = [encoded[me][k] if j == me else arriving[j, k] for j in range(workers)]
        average = codec.decode_sum(contributions, numel, pool, out=out_pieces[me][k]).div_(divisor)
        own_average.append(encode(average))
        sends += [transport.send(own_average[k], j) for j in peers]
    for work in later + sends:
        work.wait()
    if not as_sent:  # every worker's average as the others decode it, this worker's own too
        for j in range(workers):
            for k in range(pieces):
                payload = own_average[k] if j == me else averaged[j, k]
                codec.decode(payload, numel, out=out_pieces[j][k], pool=pool)
    return out, residual, 2 * len(peers) * pieces * nbytes


def _as_payload(values: torch.Tensor) -> torch.Tensor:
    """The bytes of contiguous fp32 `values`, which codec `none` sends, as a view."""
    return values.view(torch.uint8)
