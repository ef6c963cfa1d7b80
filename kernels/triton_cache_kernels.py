"""Triton kernels for KV-cache maintenance: writing new tokens and copying whole blocks."""

import triton
import triton.language as tl


@triton.jit
def write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_ckb, stride_ckt, stride_ckh, stride_ckd,
    stride_cvb, stride_cvt, stride_cvh, stride_cvd,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Scatter one token's K and V (BLOCK_H heads of it) into its cache slot.

    Grid: (num_tokens, cdiv(num_kv_heads, BLOCK_H)). Slot -1 means "do not store" (padding).
    """
    token = tl.program_id(0).to(tl.int64)
    head_tile = tl.program_id(1)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    in_block = slot % BLOCK_SIZE

    offs_h = head_tile * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h < NUM_KV_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]

    k = tl.load(key_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd,
                mask=mask)
    v = tl.load(value_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd,
                mask=mask)
    k_dst = block * stride_ckb + in_block * stride_ckt + offs_h[:, None] * stride_ckh + offs_d[None, :] * stride_ckd
    v_dst = block * stride_cvb + in_block * stride_cvt + offs_h[:, None] * stride_cvh + offs_d[None, :] * stride_cvd
    tl.store(k_cache_ptr + k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def copy_blocks_kernel(
    src_addrs_ptr, dst_addrs_ptr, dtype_ref_ptr, block_pairs_ptr, block_numel,
    BLOCK: tl.constexpr,
):
    """Copy whole blocks between caches given by raw addresses.

    Grid: (num_caches, num_pairs). Program (c, p) copies block ``block_pairs[p, 0]`` of cache
    ``src_addrs[c]`` onto block ``block_pairs[p, 1]`` of cache ``dst_addrs[c]``. Every cache
    holds ``dtype_ref_ptr``'s element type and is contiguous with ``block_numel`` elements per
    block. Passing addresses lets one launch cover every layer's K and V caches.
    """
    cache = tl.program_id(0)
    pair = tl.program_id(1).to(tl.int64)
    element_ptr_type = tl.pointer_type(dtype_ref_ptr.dtype.element_ty)
    src_base = tl.load(src_addrs_ptr + cache).to(element_ptr_type)
    dst_base = tl.load(dst_addrs_ptr + cache).to(element_ptr_type)
    src_block = tl.load(block_pairs_ptr + 2 * pair).to(tl.int64)
    dst_block = tl.load(block_pairs_ptr + 2 * pair + 1).to(tl.int64)
    src_first = src_block * block_numel
    dst_first = dst_block * block_numel
    for start in range(0, block_numel, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < block_numel
        chunk = tl.load(src_base + src_first + offs, mask=mask)
        tl.store(dst_base + dst_first + offs, chunk, mask=mask)
