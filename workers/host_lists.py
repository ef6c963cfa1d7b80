"""Python lists of ints as CPU tensors, fast: the step's inputs are built as lists."""

from __future__ import annotations

import array

import torch


def int64_tensor(values: list[int]) -> torch.Tensor:
    """A CPU int64 tensor of a list of ints (a C array's buffer: ~4x faster than ``torch.tensor``)."""
    if not values:
        return torch.empty(0, dtype=torch.int64)
    return torch.frombuffer(array.array("q", values), dtype=torch.int64)
