"""Where a run's device time goes: ``torch.profiler`` over a run, its kernels by kind.

A run is host-bound where the device idles between kernels, and kernel-bound where it
does not. ``profile_kernels`` runs a callable under the profiler and sums the device time
of its kernels by kind (matmuls, paged attention, the K/V write, compiled fused kernels,
copies, the rest), against the run's wall time: what the device was busy with, and for
how much of the run. The profiler's own overhead slows the host, so the wall time here is
longer than an unprofiled run's; the kernel times are the device's own.
"""

from __future__ import annotations

import time
from typing import Callable

# Kernel kinds, tested in this order against the lowercased kernel name. Inductor's kernels
# are named triton_{poi,red,per,tem}_fused_<ops> ("_to_copy" among the ops); its templates
# (tem) are matmuls.
KERNEL_KINDS = (
    ("paged attention", ("paged_prefill", "paged_decode", "flash", "fmha")),
    ("K/V write", ("write_kv",)),
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "triton_tem_")),
    ("compiled fused", ("triton_",)),
    ("copy", ("memcpy", "memset", "copy")),
)


def kernel_kind(name: str) -> str:
    lowered = name.lower()
    for kind, markers in KERNEL_KINDS:
        if any(marker in lowered for marker in markers):
            return kind
    return "other"


def summarize_kernels(kernels: list[tuple[str, float, int]], wall_seconds: float) -> dict:
    """``kernels``: (name, device seconds, launches). Seconds and launches per kind, the
    busy fraction of ``wall_seconds``, and the kernels that took the most time."""
    kinds: dict[str, dict] = {}
    for name, seconds, count in kernels:
        entry = kinds.setdefault(kernel_kind(name), {"seconds": 0.0, "launches": 0})
        entry["seconds"] += seconds
        entry["launches"] += count
    busy = sum(seconds for _, seconds, _ in kernels)
    top = sorted(kernels, key=lambda kernel: -kernel[1])[:15]
    return {"wall_seconds": wall_seconds, "device_busy_seconds": busy,
            "device_busy_fraction": busy / wall_seconds if wall_seconds else 0.0,
            "kinds": dict(sorted(kinds.items(), key=lambda item: -item[1]["seconds"])),
            "top_kernels": [{"name": name, "seconds": seconds, "launches": count} for name, seconds, count in top]}


def profile_kernels(run: Callable[[], object], synchronize: Callable[[], None]) -> tuple[object, dict]:
    """Run ``run()`` under ``torch.profiler`` (CPU and, where there is one, CUDA); its result
    and ``summarize_kernels`` of its device kernels (none on a CPU)."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as profiler:
        start = time.perf_counter()
        result = run()
        synchronize()
        wall = time.perf_counter() - start
    kernels = [(event.key, event.self_device_time_total * 1e-6, event.count)
               for event in profiler.key_averages()
               if event.device_type == DeviceType.CUDA and event.self_device_time_total > 0]
    return result, summarize_kernels(kernels, wall)


def format_kernel_summary(summary: dict) -> str:
    lines = [f"device busy {summary['device_busy_seconds']:.3f} s of {summary['wall_seconds']:.3f} s "
             f"({summary['device_busy_fraction']:.1%}; wall time under the profiler)"]
    for kind, entry in summary["kinds"].items():
        lines.append(f"  {kind:16s} {entry['seconds']:8.3f} s {entry['launches']:8d} launches "
                     f"{entry['seconds'] / summary['wall_seconds']:6.1%} of the wall time")
    lines.append("  top kernels:")
    for kernel in summary["top_kernels"]:
        lines.append(f"    {kernel['seconds']:8.4f} s {kernel['launches']:7d}x  {kernel['name'][:110]}")
    return "\n".join(lines)
