"""Compile every Triton kernel for real NVIDIA targets, with no GPU needed (triton ships ptxas).

This catches what the interpreter cannot: compile-time type errors, tl.dot shape limits, and
shared-memory use. It checks nothing numerical. Targets: every generation a launcher file names
(``gpu_targets.GPU_TARGETS``: sm_75, sm_80, sm_86, sm_89, sm_90). A variant that compiles but
cannot run on a target (bf16 before sm_80; more shared memory per block than the target
offers) is listed as ``refused``: a worker refuses it at model load. The attention kernels are
compiled plain and with every variant on (sliding window, logit soft-cap, sinks: ``+variants``),
each variant flag being a constexpr and so a separate compilation. Run it with the interpreter off:

    TRITON_INTERPRET=0 python -m pagedserve.kernels.triton_compile_check [--quick] [--arch 86 ...]
"""

import argparse
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget

from . import triton_attention_kernels as attention_kernels
from .gpu_targets import GPU_TARGETS
from .triton_compile import compile_kernel, kernel_configs, kernel_label


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="one fp16 config on every target, plus fp32 head_dim 256 (refused on sm_86)")
    parser.add_argument("--arch", type=int, action="append", choices=sorted(GPU_TARGETS),
                        help="only this target (repeatable; default: all)")
    args = parser.parse_args(argv)
    if not isinstance(attention_kernels.paged_decode_kernel, triton.JITFunction):
        print("the kernels were built for the interpreter; run with TRITON_INTERPRET=0", file=sys.stderr)
        return 2
    archs = tuple(args.arch or sorted(GPU_TARGETS))
    full = [(dtype, head_dim, group, block_size)
            for dtype in (torch.float16, torch.bfloat16, torch.float32)
            for head_dim, group, block_size in ((128, 8, 16), (80, 1, 8), (256, 4, 64), (96, 2, 32), (64, 4, 16))]
    num_ok = num_refused = num_failures = 0
    for arch in archs:
        spec = GPU_TARGETS[arch]
        target = GPUTarget("cuda", arch, 32)
        cases = full
        if args.quick:
            cases = [(torch.float16, 128, 8, 16)] + ([(torch.float32, 256, 4, 64)] if arch == 86 else [])
        for dtype, head_dim, group, block_size in cases:
            for kernel, arg_types, constexprs, num_warps in kernel_configs(dtype, head_dim, group, block_size):
                label = (f"sm_{arch} {dtype} head_dim={head_dim} group={group} block={block_size} "
                         f"{kernel_label(kernel, constexprs)}")
                try:
                    compiled = compile_kernel(kernel, arg_types, constexprs, target, num_warps)
                except Exception as error:  # report every failing config, not just the first
                    num_failures += 1
                    print(f"FAIL    {label}: {error!r}")
                    continue
                shared = compiled.metadata.shared
                if dtype == torch.bfloat16 and not spec.has_bf16:
                    num_refused += 1
                    print(f"refused {label}: no bf16 arithmetic on sm_{arch} ({spec.examples})")
                elif shared > spec.max_shared_bytes:
                    num_refused += 1
                    print(f"refused {label}: shared {shared} B > {spec.max_shared_bytes} B on sm_{arch} "
                          f"({spec.examples})")
                else:
                    num_ok += 1
                    print(f"ok      {label}: shared {shared} B")
    print(f"{num_ok} ok, {num_refused} refused at load on their target, {num_failures} failure(s)")
    return 1 if num_failures else 0


if __name__ == "__main__":
    sys.exit(main())
