"""Compile every Triton kernel for real NVIDIA targets, with no GPU needed (triton ships ptxas).

This catches what the interpreter cannot: compile-time type errors, tl.dot shape limits, and
shared-memory use. It checks nothing numerical. Targets: every generation a launcher file names
(``gpu_targets.GPU_TARGETS``: sm_75, sm_80, sm_86, sm_89, sm_90). A variant that compiles but
cannot run on a target (bf16 before sm_80; more shared memory per block than the target
offers) is listed as ``refused``: a worker refuses it at model load. Run it with the interpreter off:

    TRITON_INTERPRET=0 python -m pagedserve.kernels.triton_compile_check [--quick] [--arch 86 ...]
"""

import argparse
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from . import triton_attention_kernels as attention_kernels
from . import triton_cache_kernels as cache_kernels
from .gpu_targets import GPU_TARGETS

_TYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32",
               torch.int32: "i32", torch.int64: "i64"}


def compile_kernel(kernel, arg_types: dict, constexprs: dict, target: GPUTarget, num_warps: int):
    """Compile ``kernel`` down to a cubin. Pointer arguments are given as torch dtypes, scalars as Triton type names."""
    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.startswith("stride"):
            signature[name] = "i32"
        else:
            value = arg_types[name]
            signature[name] = "*" + _TYPE_NAMES[value] if isinstance(value, torch.dtype) else value
    source = ASTSource(kernel, signature, constexprs=constexprs)
    return triton.compile(source, target=target, options={"num_warps": num_warps})


def kernel_configs(dtype, head_dim, num_q_per_kv, block_size, index_dtype=torch.int32):
    """(kernel, arg types, constexprs, num_warps) as ``triton_ops`` would launch them."""
    block_d = triton.next_power_of_2(head_dim)
    block_g = triton.next_power_of_2(num_q_per_kv)
    tile = 64 if block_d <= 128 and dtype != torch.float32 else 32
    precision = "ieee" if dtype == torch.float32 else "tf32"
    decode_block_n = 64 if block_d <= 128 else 32
    f32 = torch.float32
    yield (attention_kernels.paged_prefill_kernel,
           dict(q_ptr=dtype, k_cache_ptr=dtype, v_cache_ptr=dtype, block_tables_ptr=index_dtype,
                cu_seqlens_q_ptr=index_dtype, seq_lens_ptr=index_dtype, out_ptr=dtype, scale_log2="fp32",
                num_seqs="i32"),
           dict(NUM_Q_PER_KV=num_q_per_kv, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_G=block_g,
                BLOCK_Q=max(1, tile // block_g), BLOCK_D=block_d, BLOCK_N=tile, DOT_PRECISION=precision),
           4 if block_d <= 128 else 8)
    for is_split in (False, True):
        yield (attention_kernels.paged_decode_kernel,
               dict(q_ptr=dtype, k_cache_ptr=dtype, v_cache_ptr=dtype, block_tables_ptr=index_dtype,
                    seq_lens_ptr=index_dtype, out_ptr=dtype, part_acc_ptr=f32, part_max_ptr=f32, part_sum_ptr=f32,
                    scale_log2="fp32", split_len="i32", num_splits="i32"),
               dict(NUM_HEADS=4 * num_q_per_kv, NUM_Q_PER_KV=num_q_per_kv, HEAD_DIM=head_dim,
                    BLOCK_SIZE=block_size, BLOCK_G=max(16, block_g), BLOCK_D=block_d, BLOCK_N=decode_block_n,
                    IS_SPLIT=is_split, DOT_PRECISION=precision),
               4)
    yield (attention_kernels.paged_decode_reduce_kernel,
           dict(out_ptr=dtype, part_acc_ptr=f32, part_max_ptr=f32, part_sum_ptr=f32, num_splits="i32"),
           dict(NUM_HEADS=4 * num_q_per_kv, HEAD_DIM=head_dim, BLOCK_SPLITS=4, BLOCK_D=block_d),
           4)
    yield (cache_kernels.write_kv_kernel,
           dict(key_ptr=dtype, value_ptr=dtype, k_cache_ptr=dtype, v_cache_ptr=dtype, slot_mapping_ptr=torch.int64),
           dict(NUM_KV_HEADS=4, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_H=4, BLOCK_D=block_d),
           4)
    yield (cache_kernels.copy_blocks_kernel,
           dict(src_addrs_ptr=torch.int64, dst_addrs_ptr=torch.int64, dtype_ref_ptr=dtype,
                block_pairs_ptr=torch.int64, block_numel="i32"),
           dict(BLOCK=1024),
           4)


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
                label = f"sm_{arch} {dtype} head_dim={head_dim} group={group} block={block_size} {kernel.__name__}"
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
