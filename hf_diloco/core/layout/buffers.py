"""Flat fp32 CPU buffers that the outer rounds reuse instead of allocating a model-sized vector every round.

A vector larger than glibc's mmap threshold (32 MB, 8 M fp32 values) comes in fresh pages every time it is
allocated, and the kernel maps and zeroes each page on first touch: writing a fresh 128 MB vector costs several times
the CPU of writing the same bytes into a buffer already in memory. A round's pseudo-gradient and the average the
exchange decodes are such vectors, made once per round per fragment.

A buffer is handed out as a view of its own storage and is reused only once no tensor refers to that storage any more:
the exchange in flight, `InFlight.sent` and a completed average (kept for a round by the delayed and eager modes), a
checkpoint's state dict or an observer's `RoundRecord` each keep it taken for as long as they hold it, so reuse never
changes a value anyone can still read. What the pool keeps between rounds is memory the engine holds
(`outer_state_bytes` counts it). A vector handed out may be a view of a longer buffer: whoever saves or sends one keeps
a copy (`torch.save` and pickling write a view's whole storage), as the checkpoint and the elastic heal do.
"""

from __future__ import annotations

import torch

# How many tensors refer to a storage (C++ references to it, including views and aliases such as `x.cpu()`); without
# it nothing can be proven free, and every request gets a fresh tensor.
_storage_use_count = getattr(torch._C, "_storage_Use_Count", None)


class BufferPool:
    """Reusable flat host buffers (fp32 by default), shared by the fragments of an engine.

    A request is served from the smallest free buffer at least as long, as a view of its first values; when none is,
    a free shorter buffer gives way to a new one of the requested length, so that fragments of different lengths
    launched one after another keep a single buffer of the longest between them.

    Args:
        limit: buffers kept at most (those in use included); a request beyond it gets a fresh tensor that is not kept.
        dtype: the buffers' dtype.
        pin_memory: page-locked buffers, for asynchronous copies from a GPU (`shard.concatenated`); needs CUDA.
    """

    def __init__(self, limit: int, dtype: torch.dtype = torch.float32, pin_memory: bool = False) -> None:
        if limit < 1:
            raise ValueError(f"BufferPool needs a limit of at least 1 buffer, got {limit}.")
        self.limit = limit
        self.dtype, self.pin_memory = dtype, pin_memory
        self._buffers: list[tuple[torch.Tensor, int]] = []  # (buffer, its storage's use count while nothing holds it)

    def take(self, numel: int) -> torch.Tensor:
        """A flat host tensor of `numel` values, uninitialised (a view of a kept buffer, or a fresh tensor)."""
        free = [entry for entry in self._buffers if self._is_free(entry)]
        fitting = [buffer for buffer, _ in free if buffer.numel() >= numel]
        if fitting:
            return min(fitting, key=torch.Tensor.numel)[:numel]
        if free:  # a shorter free buffer gives way (compared by identity: `==` on tensors compares their values)
            self._buffers = [entry for entry in self._buffers if entry is not free[0]]
        elif _storage_use_count is None or len(self._buffers) >= self.limit:
            return self._fresh(numel)
        buffer = self._fresh(numel)
        self._buffers.append((buffer, _references(buffer)))
        return buffer[:numel]

    def _fresh(self, numel: int) -> torch.Tensor:
        return torch.empty(numel, dtype=self.dtype, pin_memory=self.pin_memory)

    def tensors(self) -> list[torch.Tensor]:
        """Every buffer the pool keeps, free or in use."""
        return [buffer for buffer, _ in self._buffers]

    @staticmethod
    def _is_free(entry: tuple[torch.Tensor, int]) -> bool:
        buffer, unused = entry
        return _references(buffer) == unused


def _references(tensor: torch.Tensor) -> int:
    return _storage_use_count(tensor.untyped_storage()._cdata)
