"""How the D data-parallel ranks of a worker share a fragment's outer state, and the collectives among them.

A fragment's values form one flat vector, its pieces concatenated (`fragment.py`). Rank k of the worker's D ranks
*owns* some runs of that vector and keeps θg, the outer optimizer state, eager's trajectory and the error-feedback
residual for those runs only; it exchanges only them across workers, with the ranks owning the same runs in every
worker (its outer group). So every rank holds 1/D of the outer state, and the D ranks together hold it once.

- **Replicated workers** (DDP, or D = 1; `ReplicatedValues`): every rank holds the whole model. Rank k owns the
  contiguous range `[k L, (k + 1) L)` of the vector, where `L` is the vector's length padded to a multiple of
  `D x M x block` (`granularity`), divided by D: the shards the exchange has always averaged. After an apply each
  rank converts its range to the parameters' dtype and the worker all-gathers the ranges on its training group
  (DDP's: NCCL on GPU, gloo on CPU), on the parameters' device, into the model's rows where a range lies in one
  piece (`Worker.share`, on the training thread), so every replica holds the same bits again before `step()` returns.
- **Sharded workers** (FSDP2, `fully_shard` over `hf_diloco.worker_mesh`; `ShardedValues`): rank k holds rows of every
  parameter, its DTensor's local shard. It owns exactly the values it holds, piece by piece, and writes them into its
  shards; nothing is gathered (FSDP gathers the weights for the forward). Before writing, every FSDP module is
  resharded, so the next forward all-gathers from the shards just written instead of reusing weights gathered
  earlier.

Every write, read and gather here is synchronous, on the training thread, and done before `step()` returns: the next
forward can only read weights whose gather has completed (invariant 6 of docs/design.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from .buffers import BufferPool
from .fragments import Piece
from .topology import Topology

Run = tuple[int, int]  # (offset in the fragment's flat vector, number of values)


@dataclass(frozen=True)
class ShardLayout:
    """Which runs of a fragment's flat vector each rank of a worker owns.

    Attributes:
        numel: the length of the fragment's flat vector.
        runs: per rank of the worker, its runs in the order of its owned vector (their values concatenated).
    """

    numel: int
    runs: tuple[tuple[Run, ...], ...]

    def length(self, rank: int) -> int:
        return sum(length for _, length in self.runs[rank])

    def assemble(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        """The whole flat vector from every rank's owned vector (`parts[k]` at least as long as rank k owns)."""
        full = torch.empty(self.numel, dtype=parts[0].dtype)
        for runs, part in zip(self.runs, parts):
            at = 0
            for offset, length in runs:
                full[offset : offset + length] = part[at : at + length]
                at += length
        return full

    def take(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank `rank`'s owned vector, cut from the whole flat vector."""
        parts = [full[offset : offset + length] for offset, length in self.runs[rank]]
        return torch.cat(parts) if parts else full[:0].clone()


class Worker:
    """Collectives among the D ranks of this rank's worker (same pipeline stage) that the engine runs on the training
    thread. The agreements and gathers of outer state run over `topology.shard_group` (gloo, CPU tensors); the updated
    parameters (`share`) over the training group DDP uses (`topology.data_parallel_group`), in their own dtype and on
    their device. Alone (D = 1) each is a local no-op.

    Args:
        topology: this rank's groups.
        count_bytes: told how many bytes each collective sent (`bytes_sent_intra_worker`).
    """

    def __init__(self, topology: Topology, count_bytes: Callable[[int], None]):
        self.size = topology.data_parallel_size
        self.index = topology.dp_index
        self.group = topology.shard_group
        self.training_group = topology.data_parallel_group
        self._count_bytes = count_bytes

    def parameter_carrier(self, device: torch.device) -> tuple[dist.ProcessGroup | None, torch.device]:
        """The group and device that carry parameters held on `device` among the worker's ranks: the training group
        on `device` itself when its backend takes tensors there (NCCL for CUDA, gloo for CPU), else the shard group
        on the CPU."""
        if self.training_group is not None and _backend_carries(self.training_group, device):
            return self.training_group, device
        return self.group, torch.device("cpu")

    def share(self, parts: Sequence[torch.Tensor], mine: torch.Tensor, group: dist.ProcessGroup | None) -> None:
        """`parts[k]` <- rank k's `mine` (all of one length, dtype and device), over `group` (`parameter_carrier`).

        Synchronous on the training thread: on NCCL the current stream waits for the gather before the next kernel
        reads `parts`, and no DDP collective is in flight between steps, so nothing interleaves with it."""
        dist.all_gather(list(parts), mine, group=group)
        self._count_bytes((self.size - 1) * mine.nbytes)

    @property
    def alone(self) -> bool:
        return self.size == 1 or self.group is None

    def all_gather(self, vector: torch.Tensor, lengths: Sequence[int]) -> list[torch.Tensor]:
        """Every rank's `vector` (rank k's of `lengths[k]` values), in rank order."""
        longest = max(lengths)
        if self.alone or longest == 0:
            return [vector] if self.alone else [vector[:0].clone() for _ in lengths]
        padded = torch.zeros(longest, dtype=vector.dtype)
        padded[: vector.numel()] = vector
        parts = [torch.empty_like(padded) for _ in range(self.size)]
        dist.all_gather(parts, padded, group=self.group)
        self._count_bytes((self.size - 1) * padded.nbytes)
        return [part[:length] for part, length in zip(parts, lengths)]

    def sum(self, values: Sequence[float]) -> list[float]:
        """Elementwise sums over the worker's ranks, added in rank order in float64 (the same bits on every rank)."""
        return [sum(column) for column in zip(*self._every_rank(values))]

    def max(self, values: Sequence[float]) -> list[float]:
        return [max(column) for column in zip(*self._every_rank(values))]

    def all(self, flag: bool) -> bool:
        """Whether `flag` holds on every rank of the worker."""
        return self.max([0.0 if flag else 1.0])[0] == 0.0

    def _every_rank(self, values: Sequence[float]) -> list[list[float]]:
        mine = torch.tensor(list(values), dtype=torch.float64)
        if self.alone:
            return [mine.tolist()]
        return [part.tolist() for part in self.all_gather(mine, [mine.numel()] * self.size)]


class ReplicatedValues:
    """This rank's owned values of a fragment when every rank of the worker holds the whole model.

    Args:
        pieces: the fragment's pieces, in the order of its flat vector.
        params: the model's trainable parameters by name.
        granularity: rank k owns `[k L, (k + 1) L)`, with L the vector's length padded to a multiple of `granularity`,
            divided by D (the exchange's own shards, so nothing is padded twice).
        worker: the worker's ranks.
    """

    # Values per rank and all-gather when the worker shares an update (bounds the transient buffer to D x this).
    share_window = 1 << 22

    def __init__(
        self, pieces: Sequence[Piece], params: dict[str, nn.Parameter], granularity: int, worker: Worker
    ) -> None:
        self.pieces, self._params, self.worker = list(pieces), params, worker
        shapes = [piece.shape(params[piece.name].shape) for piece in self.pieces]
        self._sizes = [math.prod(shape) for shape in shapes]
        self._offsets = [0]
        for size in self._sizes:
            self._offsets.append(self._offsets[-1] + size)
        numel = self._offsets[-1]
        self.span = max(1, -(-numel // granularity)) * granularity // worker.size
        runs = tuple(
            ((min(k * self.span, numel), max(0, min((k + 1) * self.span, numel) - k * self.span)),)
            for k in range(worker.size)
        )
        self.layout = ShardLayout(numel, runs)
        self._first, self._stop = runs[worker.index][0][0], sum(runs[worker.index][0])
        if not worker.alone:
            for piece in self.pieces:
                if not params[piece.name].is_contiguous():
                    raise ValueError(
                        f"Parameter {piece.name} is not contiguous in memory; with data_parallel_per_worker > 1 each "
                        "rank writes its share of the flat parameters in place. Make it contiguous before creating "
                        "the DiLoCo engine."
                    )

    def owned_sizes(self) -> tuple[int, ...]:
        """Per piece, how many of its values this rank owns."""
        return tuple(max(0, min(stop, self._stop) - max(start, self._first)) for start, stop in self._spans())

    def read(self, out: torch.Tensor | None = None, subtracted_from: torch.Tensor | None = None) -> torch.Tensor:
        """θm over this rank's runs as a flat fp32 CPU vector, or `subtracted_from - θm` (a vector of as many values,
        each first rounded to its parameter's dtype, see `concatenated`): written into `out` (as long as this rank
        owns), else into a fresh one."""
        return concatenated(self._owned_rows(), out, subtracted_from)

    def rounded(self, start: torch.Tensor) -> torch.Tensor:
        """`start` (θg over this rank's runs) as θm holds it once written: see `rounded_to_parts`."""
        return rounded_to_parts(start, self._owned_rows())

    def _owned_rows(self) -> list[torch.Tensor]:
        return [
            self._flat_rows(index)[lo - start : hi - start]
            for index, start, lo, hi in self._overlaps(self._first, self._stop)
        ]

    def write(self, owned: torch.Tensor) -> None:
        """θm <- `owned` over this rank's runs, and the other ranks' runs from them: each rank converts its runs to the
        parameters' dtype and the worker all-gathers them in windows (`Worker.share`), so every replica receives the
        bits the owner converted, and every rank writes its own runs from the same gathered bits."""
        if self.worker.alone:
            self._write_range(0, owned)
            return
        dtype, device = self._parameter_dtype_and_device()
        group, device = self.worker.parameter_carrier(device)
        lengths = [self.layout.length(k) for k in range(self.worker.size)]
        for begin in range(0, self.span, self.share_window):
            window = [max(0, min(self.share_window, length - begin)) for length in lengths]
            longest = max(window)
            if longest == 0:
                continue
            mine = torch.zeros(longest, dtype=dtype, device=device)
            mine[: window[self.worker.index]].copy_(owned[begin : begin + window[self.worker.index]])
            firsts = [rank * self.span + begin for rank in range(self.worker.size)]
            landings = [self._landing(first, longest, dtype, device) for first in firsts]
            parts = [torch.empty_like(mine) if rows is None else rows for rows in landings]
            self.worker.share(parts, mine, group)
            for first, part, length, rows in zip(firsts, parts, window, landings):
                if rows is None:
                    self._copy_rows(first, part[:length])

    def gather(self, owned: torch.Tensor) -> torch.Tensor:
        """The whole flat vector of an owned vector (θg, say) from every rank of the worker."""
        if self.worker.alone:
            return owned
        lengths = [self.layout.length(k) for k in range(self.worker.size)]
        return self.layout.assemble(self.worker.all_gather(owned, lengths))

    def _parameter_dtype_and_device(self) -> tuple[torch.dtype, torch.device]:
        """The dtype the worker shares updated values in, and where: the parameters' dtype (the widest of them if the
        fragment mixes dtypes, so each piece still gets a single rounding from fp32) and their device (the CPU if they
        lie on several)."""
        params = [self._params[piece.name] for piece in self.pieces]
        dtype = params[0].dtype if params else torch.float32
        for param in params[1:]:
            dtype = torch.promote_types(dtype, param.dtype)
        devices = {param.device for param in params}
        return dtype, devices.pop() if len(devices) == 1 else torch.device("cpu")

    def _landing(self, first: int, length: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        """The model's own flat rows for the values `[first, first + length)` when they lie in one piece of that dtype
        and device (the gather then writes them in place), else None."""
        for index, start, lo, hi in self._overlaps(first, first + length):
            param = self._params[self.pieces[index].name]
            if lo == first and hi == first + length and param.dtype == dtype and param.device == device:
                return self._flat_rows(index)[lo - start : hi - start]
        return None

    def _copy_rows(self, first: int, values: torch.Tensor) -> None:
        """θm <- `values` from flat offset `first`, converted to each piece's dtype and device (contiguous parameters:
        checked at construction when D > 1)."""
        with torch.no_grad():
            for index, start, lo, hi in self._overlaps(first, first + values.numel()):
                self._flat_rows(index)[lo - start : hi - start].copy_(values[lo - first : hi - first])

    def _spans(self) -> list[tuple[int, int]]:
        return list(zip(self._offsets, self._offsets[1:]))

    def _overlaps(self, first: int, stop: int) -> list[tuple[int, int, int, int]]:
        """(piece index, piece start, overlap start, overlap stop) in flat offsets, for the pieces [first, stop) meets."""
        return [
            (index, start, max(start, first), min(end, stop))
            for index, (start, end) in enumerate(self._spans())
            if max(start, first) < min(end, stop)
        ]

    def _rows(self, index: int) -> torch.Tensor:
        piece = self.pieces[index]
        param = self._params[piece.name]
        return param if param.dim() == 0 else param[piece.start : piece.stop]

    def _flat_rows(self, index: int) -> torch.Tensor:
        return self._rows(index).detach().reshape(-1)

    def _write_range(self, first: int, values: torch.Tensor) -> None:
        written = []
        with torch.no_grad():
            for index, start, lo, hi in self._overlaps(first, first + values.numel()):
                rows, chunk = self._rows(index), values[lo - first : hi - first]
                if hi - lo == self._sizes[index]:  # a whole piece: also right for a parameter that is not contiguous
                    written.append(write_rows(rows, chunk.view(rows.shape)))
                else:
                    written.append(write_rows(rows.view(-1)[lo - start : hi - start], chunk))
        writes_landed(written)


class ShardedValues:
    """This rank's owned values of a fragment when the model is `fully_shard`-ed over the worker's mesh: the rows of
    each piece that its DTensor local shards hold (FSDP2 shards dim 0 like `torch.chunk`).

    Args:
        pieces: the fragment's pieces, in the order of its flat vector.
        params: the model's trainable parameters by name (DTensors sharded over the worker).
        model: the model (its FSDP modules are resharded before a write).
        worker: the worker's ranks.
    """

    def __init__(self, pieces: Sequence[Piece], params: dict[str, nn.Parameter], model: nn.Module, worker: Worker):
        self.pieces, self._params, self._model, self.worker = list(pieces), params, model, worker
        runs: list[list[Run]] = [[] for _ in range(worker.size)]
        self._local_rows: list[tuple[int, int]] = []  # per piece: this rank's rows of it, in local-shard rows
        offset = 0
        for piece in self.pieces:
            shape = params[piece.name].shape
            row_numel = math.prod(shape[1:])
            for rank in range(worker.size):
                first, stop = _chunk_rows(shape[0], worker.size, rank)
                lo, hi = max(piece.start, first), min(piece.stop, stop)
                runs[rank].append((offset + (lo - piece.start) * row_numel, max(0, hi - lo) * row_numel))
                if rank == worker.index:
                    self._local_rows.append((lo - first, max(lo, hi) - first))
            offset += (piece.stop - piece.start) * row_numel
        self.layout = ShardLayout(offset, tuple(tuple(r) for r in runs))

    def owned_sizes(self) -> tuple[int, ...]:
        return tuple(length for _, length in self.layout.runs[self.worker.index])

    def read(self, out: torch.Tensor | None = None, subtracted_from: torch.Tensor | None = None) -> torch.Tensor:
        return concatenated(self._owned_rows(), out, subtracted_from)

    def rounded(self, start: torch.Tensor) -> torch.Tensor:
        return rounded_to_parts(start, self._owned_rows())

    def _owned_rows(self) -> list[torch.Tensor]:
        return [rows.detach().reshape(-1) for rows in self._rows()]

    def write(self, owned: torch.Tensor) -> None:
        """The local shards <- `owned`, after every FSDP module dropped its gathered weights."""
        reshard(self._model)
        with torch.no_grad():
            written = [
                write_rows(rows, chunk.view(rows.shape))
                for rows, chunk in zip(self._rows(), owned.split(self.owned_sizes()))
            ]
        writes_landed(written)

    def gather(self, owned: torch.Tensor) -> torch.Tensor:
        if self.worker.alone:
            return owned
        lengths = [self.layout.length(k) for k in range(self.worker.size)]
        return self.layout.assemble(self.worker.all_gather(owned, lengths))

    def _rows(self) -> list[torch.Tensor]:
        return [
            self._params[piece.name].to_local()[first:stop]
            for piece, (first, stop) in zip(self.pieces, self._local_rows)
        ]


Values = ReplicatedValues | ShardedValues


def write_rows(rows: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """rows <- values (host fp32) in one copy straight into the parameter; returns `rows`.

    For a CUDA parameter `copy_` is a blocking host-to-device copy: torch converts the dtype on the host (a host
    temporary of the piece in the parameter's dtype, half the bytes for bf16) and copies into `rows` itself when it
    is contiguous, so no GPU temporary of the piece's size is made (`.to(device, dtype)` first made one, then copied
    it again on the GPU). On the CPU the bits are those of `.to(dtype)` then copying: the same rounding."""
    return rows.copy_(values)


def writes_landed(written: Sequence[torch.Tensor]) -> None:
    """Return only once every write into a CUDA parameter among `written` has landed (invariant 6 of
    docs/design.md): each device's current stream, where the copies ran, is synchronised. A consumer that waits on
    less than the whole current stream (FSDP2 waiting only on a post-optimizer event, a forward on another stream)
    then starts after the copies in host order; the blocking copies have already landed, and this keeps it so if a
    copy ever becomes asynchronous. Nothing to do on the CPU."""
    for device in {tensor.device for tensor in written if tensor.device.type == "cuda"}:
        torch.cuda.current_stream(device).synchronize()


# Values read through pinned host buffers per synchronisation (128 MB of fp32; two kept per dtype, see `_staged`).
STAGING_WINDOW = 1 << 25
_staging_pools: dict[tuple[torch.dtype, bool], BufferPool] = {}


class HostTransfers:
    """Device-to-host copies into pinned buffers, issued asynchronously on each device's current stream, and the one
    synchronisation after which their results may be read."""

    def __init__(self) -> None:
        self._devices: set[torch.device] = set()

    def copy(self, host: torch.Tensor, part: torch.Tensor) -> None:
        host.copy_(part, non_blocking=True)
        self._devices.add(part.device)

    def wait(self) -> None:
        """Every copy issued so far has landed (nothing may read a staged buffer before this)."""
        for device in self._devices:
            if device.type == "cuda":
                torch.cuda.current_stream(device).synchronize()
        self._devices.clear()


def needs_staging(part: torch.Tensor) -> bool:
    """Whether a part is read through a pinned host buffer (it lives on an accelerator)."""
    return part.device.type != "cpu"


def staging_buffer(dtype: torch.dtype, numel: int, pinned: bool) -> torch.Tensor:
    """A host buffer of `numel` values of `dtype`, pinned for a CUDA source, reused across reads (`BufferPool`)."""
    key = (dtype, pinned)
    if key not in _staging_pools:
        _staging_pools[key] = BufferPool(limit=2, dtype=dtype, pin_memory=pinned)
    return _staging_pools[key].take(numel)


def concatenated(
    parts: Sequence[torch.Tensor], out: torch.Tensor | None = None, subtracted_from: torch.Tensor | None = None
) -> torch.Tensor:
    """The 1-D `parts` (any dtype and device) as one flat fp32 CPU vector, each converted while it is copied in, or
    `subtracted_from` (an fp32 CPU vector of their total length) minus it: written into `out` (a contiguous fp32 CPU
    vector of that length), else into a fresh one. A CPU part of fp32 or a narrower float is subtracted where it lies,
    in one pass: fp32 minus it converts it exactly first, so the bits are those of converting, then subtracting.

    Against a part narrower than fp32 (bf16, fp16) `subtracted_from` is first rounded to the part's dtype and back:
    θm started from θg rounded so (`write_rows`), and the pseudo-gradient is measured from that start, not from θg,
    whose rounding residue θg - round(θg) is the same on every worker and no training signal (docs/design.md,
    "Parameters narrower than fp32"). fp32 and wider parts are subtracted from `subtracted_from` as it is.

    A part on an accelerator is first copied, in its own dtype, into a pinned host buffer with `non_blocking=True`;
    the copies of up to `STAGING_WINDOW` values are issued together and waited for once (`HostTransfers.wait`)
    before any of them is read, and then treated as CPU parts: the same bits as a blocking copy per part, one
    synchronisation instead of one per part (invariant 6 of docs/design.md)."""
    total = sum(part.numel() for part in parts)
    if out is None:
        out = torch.empty(total, dtype=torch.float32)
    elif out.dtype != torch.float32 or out.device.type != "cpu" or out.shape != (total,) or not out.is_contiguous():
        raise ValueError(
            f"The values are read into a contiguous fp32 CPU vector of {total} values, got {out.dtype} "
            f"{tuple(out.shape)} on {out.device}."
        )
    at = 0
    for window in _staging_windows(parts):
        for part in _staged(window):
            into = out[at : at + part.numel()]
            start = None if subtracted_from is None else subtracted_from[at : at + part.numel()]
            if start is None:
                into.copy_(part)
            elif narrower_float(part.dtype):
                into.copy_(start.to(part.dtype)).sub_(part)  # exact conversions: round(start) - part in fp32
            elif part.device.type == "cpu" and part.dtype == torch.float32:
                torch.sub(start, part, out=into)
            else:
                torch.sub(start, into.copy_(part), out=into)
            at += part.numel()
    return out


def narrower_float(dtype: torch.dtype) -> bool:
    """Whether `dtype` is a floating dtype that holds fewer bits than fp32 (bf16, fp16, the fp8s)."""
    return dtype.is_floating_point and torch.finfo(dtype).bits < 32


def rounded_to_parts(start: torch.Tensor, parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """`start` (a flat fp32 vector as long as the 1-D `parts`, on any device) with each stretch under a part narrower
    than fp32 rounded to that part's dtype and back, as writing it into the part rounds it: `start` itself when no
    part is narrower (fp32 parameters, bitwise unchanged), else a fresh vector."""
    if not any(narrower_float(part.dtype) for part in parts):
        return start
    rounded = start.clone()
    at = 0
    for part in parts:
        if narrower_float(part.dtype):
            stretch = rounded[at : at + part.numel()]
            stretch.copy_(stretch.to(part.dtype))
        at += part.numel()
    return rounded


def _staging_windows(parts: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """`parts` in order, cut into windows holding at most `STAGING_WINDOW` values to stage (a longer part is sliced)."""
    windows: list[list[torch.Tensor]] = [[]]
    staged = 0
    for part in parts:
        if not needs_staging(part):
            windows[-1].append(part)
            continue
        for first in range(0, part.numel(), STAGING_WINDOW):
            piece = part[first : first + STAGING_WINDOW]
            if staged + piece.numel() > STAGING_WINDOW:
                windows.append([])
                staged = 0
            windows[-1].append(piece)
            staged += piece.numel()
    return windows


def _staged(window: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The window's parts with each part to stage replaced by its host copy, every copy landed."""
    staging = [part for part in window if needs_staging(part)]
    if not staging:
        return list(window)
    transfers = HostTransfers()
    hosts: dict[int, torch.Tensor] = {}
    for dtype in dict.fromkeys(part.dtype for part in staging):
        same = [part for part in staging if part.dtype == dtype]
        buffer = staging_buffer(dtype, sum(part.numel() for part in same), pinned=same[0].device.type == "cuda")
        at = 0
        for part in same:
            hosts[id(part)] = buffer[at : at + part.numel()]
            transfers.copy(hosts[id(part)], part)
            at += part.numel()
    transfers.wait()  # the one synchronisation: nothing below reads a staged buffer before its copy has landed
    return [hosts.get(id(part), part) for part in window]


def _backend_carries(group: dist.ProcessGroup, device: torch.device) -> bool:
    """Whether `group`'s backend all-gathers tensors on `device` ("cpu:gloo,cuda:nccl" carries both)."""
    wanted = {"cuda": "nccl", "cpu": "gloo"}.get(device.type)
    return wanted is not None and wanted in str(dist.get_backend(group))


def _chunk_rows(rows: int, ranks: int, rank: int) -> tuple[int, int]:
    """The rows [first, stop) that `Shard(0)` over `ranks` ranks gives `rank` (torch.chunk: ceil(rows / ranks) each)."""
    size = -(-rows // ranks)
    return min(rank * size, rows), min((rank + 1) * size, rows)


def reshard(model: nn.Module) -> None:
    """Free the weights every FSDP module of `model` holds gathered, so the next forward gathers the shards again."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def is_sharded(params: dict[str, nn.Parameter], topology: Topology) -> bool:
    """Whether the model is `fully_shard`-ed over this rank's worker (DTensor parameters); refuses any other sharding
    with an error that says what to do."""
    sharded = {name: isinstance(param, DTensor) for name, param in params.items()}
    if not any(sharded.values()):
        return False
    plain = [name for name, is_dtensor in sharded.items() if not is_dtensor]
    if plain:
        raise ValueError(
            f"Some parameters are DTensors and others ({plain[:3]}) are not: shard the whole model with "
            "fully_shard(model, mesh=hf_diloco.worker_mesh(config)) (after sharding its blocks, if you like)."
        )
    expected = topology.layout.data_parallel_ranks(topology.worker_index, topology.stage_index)
    for name, param in params.items():
        ranks = param.device_mesh.mesh.flatten().tolist()
        if param.device_mesh.ndim != 1 or tuple(param.placements) != (Shard(0),) or ranks != expected:
            raise ValueError(
                f"Parameter {name} is sharded as {tuple(param.placements)} over ranks {ranks}; DiLoCo needs FSDP2's "
                f"Shard(0) over exactly this rank's worker, ranks {expected} (data_parallel_per_worker="
                f"{topology.data_parallel_size}): fully_shard the model with mesh=hf_diloco.worker_mesh(config), "
                "never across workers."
            )
        local_rows = param.to_local().shape[0] if param.dim() else 0
        first, stop = _chunk_rows(param.shape[0], len(ranks), topology.dp_index) if param.dim() else (0, 0)
        if param.dim() == 0 or local_rows != stop - first:
            raise ValueError(
                f"Parameter {name} of shape {tuple(param.shape)} holds {local_rows} local rows on data-parallel rank "
                f"{topology.dp_index}; expected FSDP2's even split by rows ({stop - first}). Shard it with fully_shard "
                "and its default placement."
            )
    return True
