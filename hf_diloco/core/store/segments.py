"""Shares laid out by parameter name and range, so that sites of different shapes exchange one model.

A rank's share of a fragment (its owned vector: θg, a pseudo-gradient, an average) is a sequence of runs of the
fragment's flat vector (`layout/shard.py`), and the flat vector is the fragment's pieces (rows of parameters)
concatenated. The same values, named by parameter and element range, are the same on every site whatever its number
of data-parallel ranks, its sharding (DDP's contiguous 1/D, or FSDP's rows) or its pipeline stages (a stage holds its
part of each fragment of the whole model). Every share a site writes states its segments; a reader takes from each
share the values its own segments overlap, so a site of one device and a site of 2 ranks x 2 stages train one model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..rounds.fragment import Fragment

Segment = tuple[str, int, int]  # (parameter name, its first element, how many), in the order of a share's values


def share_segments(fragment: Fragment) -> list[Segment]:
    """The segments of this rank's share of `fragment`, in the order of its owned vector."""
    starts, offset = [], 0
    for size in fragment.sizes:
        starts.append(offset)
        offset += size
    values = fragment.values
    segments: list[Segment] = []
    for run_start, run_length in values.layout.runs[values.worker.index]:
        run_stop = run_start + run_length
        for piece, piece_start, size in zip(fragment.pieces, starts, fragment.sizes):
            low, high = max(run_start, piece_start), min(run_stop, piece_start + size)
            if low < high:
                row = size // max(1, piece.stop - piece.start)
                segments.append((piece.name, piece.start * row + low - piece_start, high - low))
    return _merged(segments)


def overlaps(mine: Sequence[Segment], theirs: Sequence[Segment]) -> list[tuple[int, int, int]]:
    """(position in my share, position in theirs, length) of every range both hold, in my share's order."""
    positions: dict[str, list[tuple[int, int, int]]] = {}
    position = 0
    for name, start, length in theirs:
        positions.setdefault(name, []).append((start, length, position))
        position += length
    found, position = [], 0
    for name, start, length in mine:
        for their_start, their_length, their_position in positions.get(name, ()):
            low, high = max(start, their_start), min(start + length, their_start + their_length)
            if low < high:
                found.append((position + low - start, their_position + low - their_start, high - low))
        position += length
    return found


def covered(mine: Sequence[Segment], theirs: Sequence[Sequence[Segment]]) -> bool:
    """Whether the shares `theirs` together hold every value of `mine` exactly once."""
    held = sum(length for share in theirs for _, _, length in overlaps(mine, share))
    return held == sum(length for _, _, length in mine)


def _merged(segments: list[Segment]) -> list[Segment]:
    """Adjacent ranges of one parameter as one segment."""
    merged: list[Segment] = []
    for name, start, length in segments:
        if merged and merged[-1][0] == name and merged[-1][1] + merged[-1][2] == start:
            merged[-1] = (name, merged[-1][1], merged[-1][2] + length)
        else:
            merged.append((name, start, length))
    return merged


def model_map(fragments: Sequence[Fragment], shapes: dict[str, Sequence[int]]) -> dict[str, list]:
    """Per parameter this rank holds pieces of: its shape and (fragment, first row, stop row) of each piece."""
    described: dict[str, list] = {}
    for fragment in fragments:
        for piece in fragment.pieces:
            entry = described.setdefault(piece.name, [list(shapes[piece.name]), []])
            entry[1].append([fragment.index, piece.start, piece.stop])
    return {name: [shape, sorted(pieces)] for name, (shape, pieces) in sorted(described.items())}


def merge_maps(maps: Sequence[dict[str, list]]) -> dict[str, list]:
    """The model map of a whole site from its ranks' (each parameter once, its pieces once each)."""
    merged: dict[str, list] = {}
    for one in maps:
        for name, (shape, pieces) in one.items():
            entry = merged.setdefault(name, [shape, []])
            entry[1].extend(piece for piece in pieces if piece not in entry[1])
    return {name: [shape, sorted(pieces)] for name, (shape, pieces) in sorted(merged.items())}


def describe_difference(theirs: dict[str, list], mine: dict[str, list]) -> str:
    """The first parameter whose shape or fragment pieces differ between two model maps, in words."""
    for name in sorted(set(theirs) | set(mine)):
        if name not in mine:
            return f"the job's model has parameter {name}, this site's has not"
        if name not in theirs:
            return f"this site's model has parameter {name}, the job's has not"
        (their_shape, their_pieces), (my_shape, my_pieces) = theirs[name], mine[name]
        if their_shape != my_shape:
            return f"parameter {name} has shape {tuple(their_shape)} in the job's model and {tuple(my_shape)} here"
        if their_pieces != my_pieces:
            return f"parameter {name} is in fragments (fragment, rows) {their_pieces} in the job, {my_pieces} here"
    return "no parameter differs"
