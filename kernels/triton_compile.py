"""Compile the Triton kernels for a GPU architecture without a GPU (triton ships ptxas),
with the arguments ``triton_ops`` launches them with.

``kernel_configs`` lists the kernels a model would launch; ``compile_kernel`` builds
one to a cubin, whose ``metadata.shared`` is its shared memory per block. Used at
model load (``gpu_targets.shared_memory_overruns``) and by ``triton_compile_check``.
"""

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend

from . import triton_attention_kernels as attention_kernels
from . import triton_cache_kernels as cache_kernels
from . import triton_lora_kernels as lora_kernels

_TYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32",
               torch.int32: "i32", torch.int64: "i64"}


def compile_kernel(kernel, arg_types: dict, constexprs: dict, target: GPUTarget, num_warps: int):
    """Compile ``kernel`` down to a cubin, specialised as ``launch_specialisation`` says.
    Pointer arguments are given as torch dtypes, scalars as Triton type names."""
    signature, constants, attrs = launch_specialisation(kernel, arg_types, constexprs, target)
    source = ASTSource(kernel, signature, constexprs=constants, attrs=attrs)
    return triton.compile(source, target=target, options={"num_warps": num_warps})


def launch_specialisation(kernel, arg_types: dict, constexprs: dict, target: GPUTarget) -> tuple[dict, dict, dict]:
    """(signature, constants, attributes) as ``triton_ops``' launches get them.

    Triton makes an integer argument equal to 1 a constant and marks pointers and integers
    that are multiples of 16, and the code it generates (vectorised loads, pipelined K/V
    tiles), so its registers and shared memory, follows. At a launch the head-dim strides
    (``stride_*d``) are 1, every tensor is 16-byte aligned and every other stride is a
    multiple of 16 (all head dims are), but for the arguments the kernel leaves unspecialised."""
    names = list(kernel.arg_names)
    unspecialised = {names[i] if isinstance(i, int) else i for i in kernel.do_not_specialize}
    aligned = make_backend(target).parse_attr("D")
    signature, attrs, constants = {}, {}, dict(constexprs)
    for index, name in enumerate(names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.startswith("stride") and name.endswith("d"):
            signature[name], constants[name] = "constexpr", 1
        elif name.startswith("stride"):
            signature[name] = "i32"
        else:
            value = arg_types[name]
            signature[name] = "*" + _TYPE_NAMES[value] if isinstance(value, torch.dtype) else value
        if signature[name] != "constexpr" and name not in unspecialised and (
                name.startswith("stride") or signature[name].startswith("*")
                or (name == "window" and not constexprs.get("HAS_WINDOW", True))):
            attrs[(index,)] = aligned   # a kernel without a window is passed window=0
    return signature, constants, attrs


PLAIN = dict(HAS_WINDOW=False, HAS_SOFTCAP=False, HAS_SINKS=False)
ALL_VARIANTS = dict(HAS_WINDOW=True, HAS_SOFTCAP=True, HAS_SINKS=True)


def kernel_configs(dtype, head_dim, num_q_per_kv, block_size, index_dtype=torch.int32,
                   variants=(PLAIN, ALL_VARIANTS)):
    """(kernel, arg types, constexprs, num_warps) as ``triton_ops`` would launch them; the
    attention kernels once per entry of ``variants`` (their HAS_* flags: sliding window,
    logit soft-cap, sinks, each a separate compilation)."""
    block_d = triton.next_power_of_2(head_dim)
    block_g = triton.next_power_of_2(num_q_per_kv)
    prefill = attention_kernels.prefill_tiles(block_d, dtype == torch.float32)
    decode = attention_kernels.decode_tiles(block_d)
    precision = "ieee" if dtype == torch.float32 else "tf32"
    f32 = torch.float32
    variant_args = dict(sinks_ptr=dtype, window="i32", softcap_log2="fp32")
    for flags in variants:
        yield (attention_kernels.paged_prefill_kernel,
               dict(q_ptr=dtype, k_cache_ptr=dtype, v_cache_ptr=dtype, block_tables_ptr=index_dtype,
                    cu_seqlens_q_ptr=index_dtype, seq_lens_ptr=index_dtype, out_ptr=dtype, scale_log2="fp32",
                    num_seqs="i32", **variant_args),
               dict(NUM_Q_PER_KV=num_q_per_kv, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_G=block_g,
                    BLOCK_Q=max(1, prefill.block_m // block_g), BLOCK_D=block_d, BLOCK_N=prefill.block_n,
                    DOT_PRECISION=precision, **flags),
               prefill.num_warps)
        for is_split in (False, True):
            yield (attention_kernels.paged_decode_kernel,
                   dict(q_ptr=dtype, k_cache_ptr=dtype, v_cache_ptr=dtype, block_tables_ptr=index_dtype,
                        seq_lens_ptr=index_dtype, out_ptr=dtype, part_acc_ptr=f32, part_max_ptr=f32,
                        part_sum_ptr=f32, scale_log2="fp32", num_splits="i32", **variant_args),
                   dict(NUM_HEADS=4 * num_q_per_kv, NUM_Q_PER_KV=num_q_per_kv, HEAD_DIM=head_dim,
                        BLOCK_SIZE=block_size, BLOCK_G=max(16, block_g), BLOCK_D=block_d, BLOCK_N=decode.block_n,
                        IS_SPLIT=is_split, DOT_PRECISION=precision, **flags),
                   decode.num_warps)
    yield (attention_kernels.paged_decode_reduce_kernel,
           dict(out_ptr=dtype, part_acc_ptr=f32, part_max_ptr=f32, part_sum_ptr=f32, num_splits="i32"),
           dict(NUM_HEADS=4 * num_q_per_kv, HEAD_DIM=head_dim, BLOCK_SPLITS=attention_kernels.REDUCE_BLOCK_SPLITS,
                BLOCK_D=block_d),
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


def lora_kernel_configs(dtype, max_rank, in_features, out_features, piece: int | None = None):
    """(kernel, arg types, constexprs, num_warps) of the LoRA shrink and expand as
    ``triton_lora_ops`` launches them for a layer of these sizes: on slot tensors, or with
    ``piece`` on weights in pages of the KV cache (``lora_pages``)."""
    tiles = lora_kernels.lora_tiles(max_rank, piece)
    precision = "ieee" if dtype == torch.float32 else "tf32"
    segments = dict(token_order_ptr=torch.int32, tile_starts_ptr=torch.int32, tile_ends_ptr=torch.int32,
                    tile_slots_ptr=torch.int32)
    paged = dict(PAGED=piece is not None, PIECE=piece or 1)
    yield (lora_kernels.lora_shrink_kernel,
           dict(x_ptr=dtype, lora_a_ptr=dtype, h_ptr=torch.float32, a_table_ptr=torch.int32, **segments),
           dict(IN_FEATURES=in_features, MAX_RANK=max_rank, BLOCK_M=lora_kernels.TILE_TOKENS,
                BLOCK_R=tiles.block_r, BLOCK_K=tiles.block_k, DOT_PRECISION=precision, **paged),
           tiles.num_warps)
    yield (lora_kernels.lora_expand_kernel,
           dict(h_ptr=torch.float32, lora_b_ptr=dtype, y_ptr=dtype, b_table_ptr=torch.int32, **segments),
           dict(OUT_FEATURES=out_features, MAX_RANK=max_rank, BLOCK_M=lora_kernels.TILE_TOKENS,
                BLOCK_N=tiles.block_n, BLOCK_R=tiles.block_r, DOT_PRECISION=precision, **paged),
           tiles.num_warps)


def kernel_label(kernel, constexprs: dict) -> str:
    """The kernel's name, with ``+split`` / ``+variants`` / ``+paged`` for those specialisations."""
    return (kernel.__name__ + ("+split" if constexprs.get("IS_SPLIT") else "")
            + ("+variants" if constexprs.get("HAS_WINDOW") else "") + ("+paged" if constexprs.get("PAGED") else ""))
