"""Host data for the device: Python lists of ints as CPU tensors, fast (the step's inputs
are built as lists), and host tensors copied to the device without waiting for it."""

from __future__ import annotations

import array

import torch


def int64_tensor(values: list[int]) -> torch.Tensor:
    """A CPU int64 tensor of a list of ints (a C array's buffer: ~4x faster than ``torch.tensor``)."""
    if not values:
        return torch.empty(0, dtype=torch.int64)
    return torch.frombuffer(array.array("q", values), dtype=torch.int64)


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device``, copied without making the host wait for the device:
    to a CUDA device through pinned memory (the caching host allocator keeps the staging
    block until the copy is done), so the copy is queued, never waited for. A blocking
    copy (``.to(device)``) would wait for everything queued on the stream first."""
    if device.type == "cuda":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)
