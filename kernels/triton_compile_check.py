"""Compile every Triton kernel for real NVIDIA targets, with no GPU needed (triton ships ptxas).

This catches what the interpreter cannot: compile-time type errors, tl.dot shape limits, and
shared-memory use. It checks nothing numerical. Targets: every generation a launcher file names
(``gpu_targets.GPU_TARGETS``: sm_75, sm_80, sm_86, sm_89, sm_90). A variant that compiles but
cannot run on a target (bf16 before sm_80; more shared memory per block than the target
offers) is listed as ``refused``: a worker refuses it at model load. The attention kernels are
compiled plain and with every variant on (sliding window, logit soft-cap, sinks: ``+variants``),
each variant flag being a constexpr and so a separate compilation. The LoRA shrink and expand
are compiled for the layer shapes of ``LORA_SHAPES``. Run it with the interpreter off:

    TRITON_INTERPRET=0 python -m pagedserve.kernels.triton_compile_check [--quick] [--arch 86 ...]
"""

import argparse
import sys
from collections import Counter

import torch
import triton
from triton.backends.compiler import GPUTarget

from . import triton_attention_kernels as attention_kernels
from .gpu_targets import GPU_TARGETS
from .triton_compile import compile_kernel, kernel_configs, kernel_label, lora_kernel_configs

# LoRA layers (max_rank, in, out): a llama-1b MLP projection, a GQA K/V projection of rank 8
# (one rank tile, half masked), rank 64 down_proj, and rank 128 (two rank tiles).
LORA_SHAPES = ((16, 2048, 5632), (8, 4096, 1024), (64, 5632, 2048), (128, 4096, 4096))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="one fp16 config (attention and LoRA) on every target, plus fp32 head_dim 256 "
                             "(refused on sm_86)")
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
    lora_cases = [(dtype, max_rank, in_features, out_features)
                  for dtype in (torch.float16, torch.bfloat16, torch.float32)
                  for max_rank, in_features, out_features in LORA_SHAPES]
    outcomes = Counter()
    for arch in archs:
        spec = GPU_TARGETS[arch]
        target = GPUTarget("cuda", arch, 32)
        cases, lora = full, lora_cases
        if args.quick:
            cases = [(torch.float16, 128, 8, 16)] + ([(torch.float32, 256, 4, 64)] if arch == 86 else [])
            lora = [(torch.float16, *LORA_SHAPES[0])]
        configs = [(f"{dtype} head_dim={head_dim} group={group} block={block_size}", dtype, config)
                   for dtype, head_dim, group, block_size in cases
                   for config in kernel_configs(dtype, head_dim, group, block_size)]
        configs += [(f"{dtype} lora rank={max_rank} in={in_features} out={out_features}", dtype, config)
                    for dtype, max_rank, in_features, out_features in lora
                    for piece in (None, 256)
                    for config in lora_kernel_configs(dtype, max_rank, in_features, out_features, piece)]
        for case, dtype, (kernel, arg_types, constexprs, num_warps) in configs:
            label = f"sm_{arch} {case} {kernel_label(kernel, constexprs)}"
            outcomes[_check(label, spec, target, dtype, kernel, arg_types, constexprs, num_warps)] += 1
    num_ok, num_refused, num_failures = outcomes["ok"], outcomes["refused"], outcomes["failure"]
    print(f"{num_ok} ok, {num_refused} refused at load on their target, {num_failures} failure(s)")
    return 1 if num_failures else 0


def _check(label, spec, target, dtype, kernel, arg_types, constexprs, num_warps) -> str:
    """Compile one config for ``target`` and print what became of it: ok, refused or failure."""
    try:
        compiled = compile_kernel(kernel, arg_types, constexprs, target, num_warps)
    except Exception as error:  # report every failing config, not just the first
        print(f"FAIL    {label}: {error!r}")
        return "failure"
    shared = compiled.metadata.shared
    if dtype == torch.bfloat16 and not spec.has_bf16:
        print(f"refused {label}: no bf16 arithmetic on sm_{spec.arch} ({spec.examples})")
        return "refused"
    if shared > spec.max_shared_bytes:
        print(f"refused {label}: shared {shared} B > {spec.max_shared_bytes} B on sm_{spec.arch} ({spec.examples})")
        return "refused"
    print(f"ok      {label}: shared {shared} B")
    return "ok"


if __name__ == "__main__":
    sys.exit(main())
