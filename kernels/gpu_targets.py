"""The NVIDIA GPU generations pagedserve's launcher files name, and what the Triton kernels need of them.

Two things make a kernel unable to run on a GPU it compiles for:

* **bf16 before sm_80.** Turing (sm_75, the T4) has no bf16 arithmetic: Triton
  compiles bf16 kernels for it, but they would run emulated, if at all. bf16
  is refused there; fp16 is the dtype to use.
* **Shared memory.** A kernel whose tiles need more shared memory per block than
  the GPU offers fails at launch (Triton's ``OutOfResources``). The limit differs
  by generation: an A100 (sm_80) offers 163 KiB, an A10G or L4 (sm_86, sm_89)
  only 99 KiB, so a variant that fits an A100 can fail on an A10G.

``check_dtype`` and ``shared_memory_overruns`` say so at model load, and
``python -m pagedserve.kernels.triton_compile_check`` lists every such variant
for every target offline (no GPU needed).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class UnsupportedOnDeviceError(ValueError):
    """A kernel variant cannot run on this GPU; the message says which and what to do."""


@dataclass(frozen=True)
class GPUTarget:
    """One compute capability: its name, shared memory per block (opt-in maximum) and bf16 support."""

    arch: int                 # compute capability as major * 10 + minor
    examples: str
    max_shared_bytes: int
    has_bf16: bool


# Shared memory per block (opt-in): CUDA C Programming Guide, "Technical Specifications per
# Compute Capability" (cudaDevAttrMaxSharedMemoryPerBlockOptin).
GPU_TARGETS: dict[int, GPUTarget] = {target.arch: target for target in (
    GPUTarget(75, "T4, RTX 20xx (Turing)", 64 * 1024, False),
    GPUTarget(80, "A100, A30 (Ampere)", 163 * 1024, True),
    GPUTarget(86, "A10G, A10, RTX 30xx (Ampere)", 99 * 1024, True),
    GPUTarget(89, "L4, L40S, RTX 40xx (Ada)", 99 * 1024, True),
    GPUTarget(90, "H100, H200 (Hopper)", 227 * 1024, True),
)}


def arch_of(capability: tuple[int, int]) -> int:
    major, minor = capability
    return 10 * major + minor


def target_for(capability: tuple[int, int]) -> GPUTarget:
    """The known target of ``capability``; an unknown one borrows the nearest older known
    generation's limits (a newer GPU is not assumed to offer more)."""
    arch = arch_of(capability)
    if arch in GPU_TARGETS:
        return GPU_TARGETS[arch]
    older = [a for a in GPU_TARGETS if a <= arch]
    if not older:
        raise UnsupportedOnDeviceError(
            f"sm_{arch} is older than any GPU the Triton kernels support (sm_75 and newer); "
            "use engine.kernel_backend: torch")
    base = GPU_TARGETS[max(older)]
    return GPUTarget(arch, f"sm_{arch} (treated as sm_{base.arch})", base.max_shared_bytes, base.has_bf16)


def check_dtype(capability: tuple[int, int], dtype: torch.dtype) -> None:
    """Refuse bf16 on a GPU without bf16 arithmetic (before sm_80)."""
    target = target_for(capability)
    if dtype == torch.bfloat16 and not target.has_bf16:
        raise UnsupportedOnDeviceError(
            f"bfloat16 needs sm_80 or newer; this GPU is sm_{target.arch} ({target.examples}), which has "
            "no bf16 arithmetic. Set engine.dtype: float16 (or leave it unset: auto picks float16 here)")


def shared_memory_overruns(capability: tuple[int, int], dtype: torch.dtype, head_dim: int,
                           num_q_per_kv: int, block_size: int) -> list[tuple[str, int]]:
    """The kernels (name, shared bytes) that ``triton_ops`` would launch for this model and
    that need more shared memory than this GPU offers. Compiles them for the GPU's
    architecture with Triton's bundled ptxas (seconds; Triton caches the result)."""
    from triton.backends.compiler import GPUTarget as TritonTarget

    from .triton_compile import compile_kernel, kernel_configs, kernel_label

    target = target_for(capability)
    triton_target = TritonTarget("cuda", target.arch, 32)
    overruns = []
    for kernel, arg_types, constexprs, num_warps in kernel_configs(dtype, head_dim, num_q_per_kv, block_size):
        shared = compile_kernel(kernel, arg_types, constexprs, triton_target, num_warps).metadata.shared
        if shared > target.max_shared_bytes:
            overruns.append((kernel_label(kernel, constexprs), shared))
    return overruns


def check_shared_memory(capability: tuple[int, int], dtype: torch.dtype, head_dim: int,
                        num_q_per_kv: int, block_size: int) -> None:
    """Refuse a model whose kernels would not fit this GPU's shared memory, naming them."""
    overruns = shared_memory_overruns(capability, dtype, head_dim, num_q_per_kv, block_size)
    if overruns:
        target = target_for(capability)
        kernels = ", ".join(f"{name} needs {shared} B" for name, shared in overruns)
        raise UnsupportedOnDeviceError(
            f"the Triton kernels for {str(dtype).removeprefix('torch.')}, head_dim {head_dim}, "
            f"{num_q_per_kv} query heads per KV head and block_size {block_size} do not fit sm_{target.arch} "
            f"({target.examples}): {kernels} of shared memory per block, which offers "
            f"{target.max_shared_bytes} B. Use float16 or bfloat16, or engine.kernel_backend: torch")
