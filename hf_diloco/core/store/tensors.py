"""A snapshot's tensors in the safetensors format (a little-endian uint64 header length, a JSON header naming each
tensor's dtype, shape and byte range, then the bytes), written and read with torch alone, so that the core needs no
library beyond torch and `safetensors.torch.load` opens a snapshot as it is. Reading is bounded: the header, every
dtype, shape and range are checked against the bytes present before a tensor is made."""

from __future__ import annotations

import json
import math
import struct

import torch

_DTYPES = {torch.float32: "F32", torch.int64: "I64"}
_NAMES = {name: dtype for dtype, name in _DTYPES.items()}
MAX_HEADER = 1 << 20


def to_safetensors(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> bytes:
    """The bytes of a `.safetensors` file holding `tensors` (fp32 or int64, any shape) and string `metadata`."""
    header: dict = {"__metadata__": dict(metadata or {})}
    blobs, offset = [], 0
    for name, tensor in tensors.items():
        data = tensor.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy().tobytes()
        header[name] = {
            "dtype": _DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + len(data)],
        }
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + b"".join(blobs)


def from_safetensors(
    data: bytes | memoryview, expected: dict[str, int] | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors and metadata of `.safetensors` bytes; `expected` names tensors and their element counts that must
    be there. `ValueError` on anything malformed, before a tensor is allocated."""
    data = memoryview(data)
    if len(data) < 8:
        raise ValueError("not a safetensors file: shorter than its header length")
    (length,) = struct.unpack_from("<Q", data, 0)
    if length > MAX_HEADER or 8 + length > len(data):
        raise ValueError(f"not a safetensors file: a header of {length} bytes in {len(data)}")
    header = json.loads(bytes(data[8 : 8 + length]))
    metadata = header.pop("__metadata__", {}) or {}
    body = data[8 + length :]
    tensors = {}
    for name, entry in header.items():
        dtype = _NAMES.get(entry.get("dtype"))
        shape, (begin, end) = entry.get("shape"), entry.get("data_offsets", (-1, -1))
        if dtype is None or not all(isinstance(size, int) and size >= 0 for size in shape):
            raise ValueError(f"tensor {name!r}: unsupported dtype or shape {entry}")
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if not (0 <= begin <= end <= len(body)) or end - begin != nbytes:
            raise ValueError(f"tensor {name!r}: byte range {begin}-{end} does not hold its {nbytes} bytes")
        tensors[name] = torch.frombuffer(bytearray(body[begin:end]), dtype=dtype).reshape(shape)
    for name, numel in (expected or {}).items():
        if name not in tensors or tensors[name].numel() != numel:
            raise ValueError(f"tensor {name!r} of {numel} values is missing or has another size")
    return tensors, {str(k): str(v) for k, v in metadata.items()}
