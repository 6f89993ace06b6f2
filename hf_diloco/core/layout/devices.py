"""Which device this process means: `global_copy_device` resolved to this rank's accelerator, and where a restored
tensor goes.

`torch.device("cuda")` without an index is "the current device", which is GPU 0 in every process that has not called
`torch.cuda.set_device`: eight ranks of a node would then all keep θg and the outer optimizer state on GPU 0.
`resolve_device` gives a device without an index the index of this process's own accelerator instead. The rules are
a pure function of what the process knows (`resolve_device`), so they are tested without a GPU; `local_device` reads
those facts from torch and the environment.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch


def resolve_device(
    name: str | torch.device,
    parameter_devices: Iterable[torch.device] = (),
    local_rank: int | None = None,
    current_index: int | None = None,
    device_count: int = 0,
) -> torch.device:
    """The device `name` means for this process.

    A device with an index, or of a type without indices (`cpu`, `meta`), is itself. A device type without an index
    (`cuda`) is, in this order: the device of that type the model's parameters are on (the accelerator this process
    trains on); the `local_rank`-th of the `device_count` visible devices (torchrun's `LOCAL_RANK`, modulo the count:
    with one visible device per process that is device 0); the current device `current_index`; device 0.

    Args:
        name: the configured device (`global_copy_device`).
        parameter_devices: the devices of the model's parameters.
        local_rank: this process's rank on its node (`LOCAL_RANK`), if known.
        current_index: the current device of that type (`torch.cuda.current_device()`), if known.
        device_count: how many devices of that type this process sees.
    """
    device = torch.device(name)
    if device.index is not None or device.type in ("cpu", "meta"):
        return device
    for candidate in parameter_devices:
        if candidate.type == device.type and candidate.index is not None:
            return candidate
    if local_rank is not None and device_count > 0:
        return torch.device(device.type, local_rank % device_count)
    return torch.device(device.type, current_index or 0)


def local_device(name: str | torch.device, parameters: Iterable[torch.Tensor] = ()) -> torch.device:
    """`resolve_device` with this process's facts: its parameters, `LOCAL_RANK`, the current and visible CUDA
    devices (none are asked for unless `name` is a CUDA device without an index)."""
    device = torch.device(name)
    if device.type != "cuda" or device.index is not None:
        return device
    local_rank = os.environ.get("LOCAL_RANK")
    available = torch.cuda.is_available()
    return resolve_device(
        device,
        [parameter.device for parameter in parameters],
        local_rank=int(local_rank) if local_rank not in (None, "") else None,
        current_index=torch.cuda.current_device() if available else None,
        device_count=torch.cuda.device_count() if available else 0,
    )


def placed(tensor: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    """`tensor` on `device` (itself when it is there already; None stays None): what a restored checkpoint tensor
    needs, since a state is loaded with `map_location="cpu"` whatever device wrote it."""
    return tensor if tensor is None or tensor.device == device else tensor.to(device)
