"""The CPU runner's host allocator setting: safe to apply repeatedly, harmless to torch."""

import platform

import torch

from pagedserve.workers.model.host_memory import retain_freed_host_memory


def test_retain_freed_host_memory_is_idempotent_and_keeps_torch_working():
    first = retain_freed_host_memory()
    assert retain_freed_host_memory() is first
    if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
        assert first is True
    for _ in range(3):  # large buffers allocated and freed again come back intact
        x = torch.ones(2048, 1408)
        assert float(x.sum()) == 2048 * 1408
        del x
