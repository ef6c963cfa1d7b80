"""Host memory: allocator tuning for running models on the CPU, and whether KV pools fit."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import platform

logger = logging.getLogger(__name__)

GiB = 1 << 30

# mallopt parameter numbers from glibc's malloc.h.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def retain_freed_host_memory(mmap_threshold: int = 32 << 20, trim_threshold: int = 1 << 30) -> bool:
    """Make glibc malloc reuse freed activation buffers instead of unmapping them.

    By default glibc serves large allocations with ``mmap`` and unmaps them on free,
    so every activation tensor of a CPU forward pass is page-faulted and zeroed by the
    kernel anew; that costs about a tenth of a CPU engine step. Allocations up to
    ``mmap_threshold`` bytes (at most 32 MiB on 64-bit glibc) then come from the heap,
    and up to ``trim_threshold`` bytes of free heap are kept for reuse.

    The setting is process-wide and idempotent; it only changes how much freed memory
    the process keeps. Returns False, changing nothing, where the C library is not glibc.
    """
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    is_set = bool(mallopt(_M_MMAP_THRESHOLD, int(mmap_threshold)))
    return bool(mallopt(_M_TRIM_THRESHOLD, int(trim_threshold))) and is_set


def host_memory_info() -> dict[str, int] | None:
    """``MemAvailable`` and ``SwapFree`` of ``/proc/meminfo``, in bytes; None where it cannot
    be read (not Linux)."""
    try:
        with open("/proc/meminfo") as meminfo:
            lines = meminfo.read().splitlines()
    except OSError:
        return None
    info = {}
    for line in lines:
        name, _, value = line.partition(":")
        fields = value.split()
        if name in ("MemAvailable", "SwapFree") and fields and fields[0].isdigit():
            info[name] = int(fields[0]) * 1024
    return info if "MemAvailable" in info else None


def check_pools_fit_host(num_bytes: int, pools: str, info: dict[str, int] | None = None) -> None:
    """Refuse KV pools of ``num_bytes`` in host memory (``pools`` says which, by their settings)
    that this host cannot hold even with its free swap: the pools are zeroed as they are made,
    so the kernel's OOM killer would end the process with no message. Warn where they fit only
    with swap. ``info``: ``host_memory_info()``'s (read now if None; nothing is checked where
    there is none)."""
    info = host_memory_info() if info is None else info
    if info is None:
        return
    available, swap_free = info["MemAvailable"], info.get("SwapFree", 0)
    if num_bytes > available + swap_free:
        raise ValueError(f"the KV pools would take {num_bytes / GiB:.2f} GiB of host memory ({pools}), more than "
                         f"the {available / GiB:.2f} GiB this node has available"
                         + (f" and its {swap_free / GiB:.2f} GiB of free swap" if swap_free else "") + ": lower them")
    if num_bytes > available:
        logger.warning("the KV pools take %.2f GiB of host memory (%s), more than the %.2f GiB available: "
                       "part of them will be in swap", num_bytes / GiB, pools, available / GiB)
