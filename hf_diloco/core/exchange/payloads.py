"""Entropy coding of the payloads that cross workers: 1 MiB pieces deflated in parallel when that is shorter
(`entropy_coding`), and their bounded, validated inflation."""

from __future__ import annotations

import functools
import itertools
import struct
import zlib
from collections.abc import Callable
from concurrent.futures import Executor

import torch

LENGTH_BYTES = 8  # one int64 payload length per peer and all_to_all, with entropy coding
_PIECE_BYTES = 1 << 20  # deflated independently, so that threads share the work (zlib releases the GIL)
_deflate_piece = functools.partial(zlib.compress, level=1)


def deflate_payload(payload: torch.Tensor, pool: Executor | None = None) -> torch.Tensor:
    """The payload's 1 MiB pieces deflated (a little-endian uint32 length per piece, then the zlib streams), when
    that is shorter than the payload; else the payload itself (what `entropy_coding` sends).

    Args:
        payload (`torch.Tensor`): 1-D uint8, an encoded payload.
        pool (`Executor`, *optional*): threads that deflate pieces in parallel (zlib releases the GIL); the bytes are
            the same without it.
    """
    raw = memoryview(payload.contiguous().numpy())
    pieces = [raw[start : start + _PIECE_BYTES] for start in range(0, len(raw), _PIECE_BYTES)]
    streams = _map(pool, _deflate_piece, pieces)
    packed = struct.pack(f"<{len(streams)}I", *map(len, streams)) + b"".join(streams)
    if len(packed) >= len(raw):
        return payload
    return torch.frombuffer(bytearray(packed), dtype=torch.uint8)


def inflate_payload(received: torch.Tensor, nbytes: int, worker: int, pool: Executor | None = None) -> torch.Tensor:
    """Undo `deflate_payload`: a payload of exactly `nbytes` arrived raw, a shorter one deflated.

    Args:
        received (`torch.Tensor`): 1-D uint8, what arrived from `worker`.
        nbytes (`int`): the encoded payload's length.
        worker (`int`): the sender, named in the error.
        pool (`Executor`, *optional*): threads that inflate pieces in parallel.

    Raises:
        `ValueError` when the bytes are neither the payload nor its deflated form (a peer with other settings).
    """
    if received.numel() == nbytes:
        return received
    sizes = [min(_PIECE_BYTES, nbytes - start) for start in range(0, nbytes, _PIECE_BYTES)]
    data = memoryview(received.contiguous().numpy())
    header = 4 * len(sizes)
    if header <= len(data) < nbytes:
        bounds = list(itertools.accumulate(struct.unpack_from(f"<{len(sizes)}I", data), initial=header))
        if bounds[-1] == len(data):
            streams = [data[begin:end] for begin, end in zip(bounds, bounds[1:])]
            pieces = _map(pool, _inflate_piece, streams, sizes)
            if all(piece is not None for piece in pieces):
                return torch.frombuffer(bytearray(b"".join(pieces)), dtype=torch.uint8)
    raise ValueError(
        f"worker {worker} sent {received.numel()} bytes that are neither a {nbytes}-byte encoded payload nor its "
        "deflated form. Every worker must run the same hf_diloco version with the same compression and entropy_coding."
    )


def _map(pool: Executor | None, function: Callable, *iterables) -> list:
    return list(pool.map(function, *iterables) if pool is not None else map(function, *iterables))


def _inflate_piece(stream: memoryview, size: int) -> bytes | None:
    """The `size` bytes one complete zlib stream holds, or None when it holds anything else."""
    inflater = zlib.decompressobj()
    try:
        raw = inflater.decompress(stream, size)  # never more than size bytes, whatever the stream claims
    except zlib.error:
        return None
    return raw if len(raw) == size and inflater.eof and not inflater.unused_data else None
