"""Records, on CPU, what a start would place on the training device, as if that device were an accelerator.

On CPU the training device is the CPU, so every `.to(device)` moves nothing and no memory figure can show a whole
model landing on "the GPU". `record_placements(device)` records instead every placement toward `device` (it wraps
and never replaces the calls that place parameters and buffers) and keeps, per storage, whether it is still alive;
`peak_bytes` is the most bytes of placed storage alive at once, which is what the accelerator would hold:

- `nn.Module.to(device)`: every parameter and buffer of the module (a DTensor by its local shard);
- `Tensor.to(device)` of an `nn.Parameter` (FSDP2's and any helper's own moves);
- `fully_shard`'s move of a unit's parameters to the mesh's device before it cuts them (skipped on CPU, where they
  are there already; on a GPU that moves the whole unit), and the padded shard each `FSDPParam` then keeps.

A placed storage stops counting when no tensor holds it any more (weak references; a parameter whose `.data` was
replaced lets go of its old storage), as its memory would be returned; a copy that `.to` makes of a tensor already
on the device replaces it (an accelerator would return the tensor itself). Placements only add, so sampling after
each one gives the exact peak. The device is matched by type, and by index where both name one (`cpu` is `cpu:0`).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator

import torch
from torch import nn
from torch.distributed.fsdp._fully_shard import _fsdp_init, _fsdp_param
from torch.distributed.tensor import DTensor


class PlacementRecord:
    """Bytes placed on one device, storage by storage (see the module docstring)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._placed: dict[int, tuple[int, list[weakref.ref]]] = {}  # storage address -> (bytes, holders)
        self.peak_bytes = 0
        self.calls = 0

    def _alive(self, address: int) -> bool:
        holders = self._placed[address][1]
        holders[:] = [holder for holder in holders if _storage_address(holder()) == address]
        return bool(holders)

    def alive_bytes(self) -> int:
        total = 0
        for address in list(self._placed):
            if self._alive(address):
                total += self._placed[address][0]
            else:
                del self._placed[address]
        return total

    def place(self, tensors: Iterable[torch.Tensor]) -> None:
        self.calls += 1
        for tensor in tensors:
            local = _local(tensor)
            storage = local.untyped_storage()
            if storage.nbytes() == 0 or local.device.type == "meta":
                continue
            address = storage.data_ptr()
            if address in self._placed and not self._alive(address):
                del self._placed[address]  # a freed storage whose address the allocator gave to this one
            entry = self._placed.setdefault(address, (storage.nbytes(), []))
            # A DTensor is watched through its local tensor: `Module.to` swaps DTensor parameters
            # (`torch.utils.swap_tensors`), which refuses tensors with weak references.
            entry[1].append(weakref.ref(local if isinstance(tensor, DTensor) else tensor))
        self.peak_bytes = max(self.peak_bytes, self.alive_bytes())

    def forget(self, tensor: torch.Tensor) -> None:
        """Stop counting `tensor`'s storage (see `recording_tensor_to`)."""
        self._placed.pop(_storage_address(tensor), None)

    def targets(self, device: torch.device | str | int | None) -> bool:
        """Whether `device` is the recorded one; no index stands for any (`cpu` and the Trainer's `cpu:0` match)."""
        if device is None:
            return False
        device = torch.device(device)
        indices = {device.index, self.device.index} - {None}
        return device.type == self.device.type and len(indices) <= 1


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def _storage_address(tensor: torch.Tensor | None) -> int | None:
    """Where `tensor`'s storage lives now, `None` once it is gone (a parameter whose `.data` was replaced, as by
    freeing another pipeline stage, no longer holds its old storage)."""
    return None if tensor is None else _local(tensor).untyped_storage().data_ptr()


def _target_device(*args, **kwargs) -> torch.device | None:
    try:
        return torch._C._nn._parse_to(*args, **kwargs)[0]
    except (TypeError, RuntimeError):
        return None


@contextlib.contextmanager
def record_placements(device: torch.device | str) -> Iterator[PlacementRecord]:
    """Record every parameter and buffer placed on `device` while the block runs (see the module docstring)."""
    record = PlacementRecord(torch.device(device))
    module_to, tensor_to = nn.Module.to, torch.Tensor.to
    move_states, param_init = _fsdp_init._move_states_to_device, _fsdp_param.FSDPParam.__init__

    def recording_module_to(module, *args, **kwargs):
        result = module_to(module, *args, **kwargs)
        if record.targets(_target_device(*args, **kwargs)):
            record.place([*module.parameters(), *module.buffers()])
        return result

    def recording_tensor_to(tensor, *args, **kwargs):
        result = tensor_to(tensor, *args, **kwargs)
        if isinstance(tensor, nn.Parameter) and record.targets(_target_device(*args, **kwargs)):
            if result is not tensor:
                # On CPU `.to("cpu:0")` of a `cpu` tensor copies; on an accelerator a tensor already there is
                # returned as it is. Either way the placement is the same memory: count it once.
                record.forget(tensor)
            record.place([result])
        return result

    def recording_move_states(params, buffers, target):
        if record.targets(target):
            record.place([*params, *buffers])  # the whole unit, before it is cut
        return move_states(params, buffers, target)

    def recording_param_init(fsdp_param, *args, **kwargs):
        param_init(fsdp_param, *args, **kwargs)
        if record.targets(fsdp_param._sharded_param_data.device):
            record.place([fsdp_param.sharded_param])  # its local tensor views the padded shard

    tensor_to_overridden = "to" in vars(torch.Tensor)
    nn.Module.to, torch.Tensor.to = recording_module_to, recording_tensor_to
    _fsdp_init._move_states_to_device, _fsdp_param.FSDPParam.__init__ = recording_move_states, recording_param_init
    try:
        yield record
    finally:
        nn.Module.to = module_to
        if tensor_to_overridden:
            torch.Tensor.to = tensor_to
        else:
            del torch.Tensor.to  # back to the method torch.Tensor inherits
        _fsdp_init._move_states_to_device, _fsdp_param.FSDPParam.__init__ = move_states, param_init


def module_bytes(module: nn.Module, recurse: bool = True) -> int:
    """Bytes of `module`'s distinct parameters (DTensors by their local shard)."""
    seen: dict[int, int] = {}
    for param in module.parameters(recurse=recurse):
        local = _local(param)
        seen[id(param)] = local.numel() * local.element_size()
    return sum(seen.values())
