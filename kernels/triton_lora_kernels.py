"""Triton kernels for the batched LoRA products of a step (Punica's SGMV shrink and expand).

A step's adapted tokens are sorted by adapter slot, once per step, and each slot's run of
tokens (its segment) is cut into tiles of at most ``BLOCK_M`` tokens. A program works on one
tile, so every token of a tile shares the tile's slot and one weight tile serves all its rows.
Tile ``i`` covers sorted positions ``tile_starts[i]:tile_ends[i]`` of slot ``tile_slots[i]``;
``token_order[p]`` is the token (row of ``x`` and ``y``) at sorted position ``p``.

Weights are slot-indexed: ``lora_a`` ``[slots, MAX_RANK, IN_FEATURES]`` and ``lora_b``
``[slots, MAX_RANK, OUT_FEATURES]``, zero past an adapter's own rank. With ``PAGED`` they lie
in pages of a KV cache tensor instead (``pagedserve.kernels.lora_pages``): the weight pointer
is the cache's, and an int32 table ``[slots, MAX_RANK, pieces]`` gives each rank-row's pieces
of ``PIECE`` elements; a tile of ``BLOCK_K`` (or ``BLOCK_N``) features lies within one piece. Feature and rank
sizes are constexprs (fixed per layer); the innermost dimension of every tensor is
contiguous. Products accumulate in fp32.
"""

import functools
from dataclasses import dataclass

import triton
import triton.language as tl


# Sorted tokens per tile: tl.dot's smallest M. Decode gives a few tokens per adapter, so larger
# tiles would mostly be masked rows; long prefill segments take more tiles.
TILE_TOKENS = 16


@dataclass(frozen=True)
class LoRATiles:
    """How the two kernels are launched for a layer: rank rows per tile (``block_r``), input
    features per step of the shrink's K loop (``block_k``), output features per expand
    program (``block_n``) and warps."""

    block_r: int
    block_k: int
    block_n: int
    num_warps: int


@functools.lru_cache(maxsize=None)
def lora_tiles(max_rank: int, piece: int | None = None) -> LoRATiles:
    """The default tiles for slots of ``max_rank`` rank rows: the rank padded to at least 16
    (tl.dot's minimum) and at most 64 per tile. Weights in pages of ``piece`` elements (a power
    of two, at least 16) take feature tiles of at most a piece."""
    block_k, block_n = 128, 64
    if piece is not None:
        block_k, block_n = min(block_k, piece), min(block_n, piece)
    return LoRATiles(block_r=min(64, max(16, triton.next_power_of_2(max_rank))), block_k=block_k,
                     block_n=block_n, num_warps=4)


@triton.jit
def _tile_rows(token_order_ptr, tile_starts_ptr, tile_ends_ptr, tile_slots_ptr, BLOCK_M: tl.constexpr):
    """This program's tile: (sorted positions, their tokens, which rows are real, the slot)."""
    tile = tl.program_id(0)
    start = tl.load(tile_starts_ptr + tile)
    end = tl.load(tile_ends_ptr + tile)
    slot = tl.load(tile_slots_ptr + tile).to(tl.int64)
    positions = start + tl.arange(0, BLOCK_M)
    row_mask = positions < end
    tokens = tl.load(token_order_ptr + positions, mask=row_mask, other=0).to(tl.int64)
    return positions, tokens, row_mask, slot


@triton.jit(do_not_specialize=["stride_ts", "stride_tr"])
def lora_shrink_kernel(
    x_ptr, lora_a_ptr, h_ptr, token_order_ptr, tile_starts_ptr, tile_ends_ptr, tile_slots_ptr, a_table_ptr,
    stride_xt, stride_as, stride_ar, stride_ht, stride_ts, stride_tr,
    IN_FEATURES: tl.constexpr, MAX_RANK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    PAGED: tl.constexpr, PIECE: tl.constexpr,
):
    """``h[p] = x[token_order[p]] @ lora_a[slot]ᵀ`` for the tile's sorted positions p, in fp32.

    Grid: (num_tiles, cdiv(MAX_RANK, BLOCK_R)); a K loop over the input features.
    ``h`` is ``[num_adapted, MAX_RANK]`` in sorted order.
    """
    positions, tokens, row_mask, slot = _tile_rows(token_order_ptr, tile_starts_ptr, tile_ends_ptr,
                                                   tile_slots_ptr, BLOCK_M)
    offs_r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_mask = offs_r < MAX_RANK
    x_rows = x_ptr + tokens[:, None] * stride_xt
    a_rows = lora_a_ptr + slot * stride_as + offs_r[None, :] * stride_ar
    table_rows = a_table_ptr + slot * stride_ts + offs_r * stride_tr
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for k_start in range(0, IN_FEATURES, BLOCK_K):
        offs_k = k_start + tl.arange(0, BLOCK_K)
        k_mask = offs_k < IN_FEATURES
        x = tl.load(x_rows + offs_k[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        if PAGED:
            pieces = tl.load(table_rows + k_start // PIECE, mask=r_mask, other=0).to(tl.int64)
            a_ptrs = lora_a_ptr + (pieces * PIECE + k_start % PIECE)[None, :] + tl.arange(0, BLOCK_K)[:, None]
        else:
            a_ptrs = a_rows + offs_k[:, None]
        a = tl.load(a_ptrs, mask=k_mask[:, None] & r_mask[None, :], other=0.0)  # [K, R]
        acc = tl.dot(x, a, acc, input_precision=DOT_PRECISION)
    h_offsets = positions[:, None] * stride_ht + offs_r[None, :]
    tl.store(h_ptr + h_offsets, acc, mask=row_mask[:, None] & r_mask[None, :])


@triton.jit(do_not_specialize=["stride_ts", "stride_tr"])
def lora_expand_kernel(
    h_ptr, lora_b_ptr, y_ptr, token_order_ptr, tile_starts_ptr, tile_ends_ptr, tile_slots_ptr, b_table_ptr,
    stride_ht, stride_bs, stride_br, stride_yt, stride_ts, stride_tr,
    OUT_FEATURES: tl.constexpr, MAX_RANK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, DOT_PRECISION: tl.constexpr,
    PAGED: tl.constexpr, PIECE: tl.constexpr,
):
    """``y[token_order[p]] += h[p] @ lora_b[slot]`` for the tile's sorted positions p, in place.

    Grid: (num_tiles, cdiv(OUT_FEATURES, BLOCK_N)); a loop over the rank. ``h`` (fp32) is
    rounded to the weights' dtype for the dot, as the torch path's ``h`` is; the sum with
    ``y`` is taken in fp32 and stored in y's dtype. Each (token, output tile) belongs to one
    program, so the update needs no atomics.
    """
    positions, tokens, row_mask, slot = _tile_rows(token_order_ptr, tile_starts_ptr, tile_ends_ptr,
                                                   tile_slots_ptr, BLOCK_M)
    n_start = tl.program_id(1) * BLOCK_N
    offs_n = n_start + tl.arange(0, BLOCK_N)
    n_mask = offs_n < OUT_FEATURES
    b_cols = lora_b_ptr + slot * stride_bs + offs_n[None, :]
    table_row = b_table_ptr + slot * stride_ts + n_start // PIECE
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for r_start in range(0, MAX_RANK, BLOCK_R):
        offs_r = r_start + tl.arange(0, BLOCK_R)
        r_mask = offs_r < MAX_RANK
        h = tl.load(h_ptr + positions[:, None] * stride_ht + offs_r[None, :],
                    mask=row_mask[:, None] & r_mask[None, :], other=0.0)
        if PAGED:
            pieces = tl.load(table_row + offs_r * stride_tr, mask=r_mask, other=0).to(tl.int64)
            b_ptrs = lora_b_ptr + (pieces * PIECE + n_start % PIECE)[:, None] + tl.arange(0, BLOCK_N)[None, :]
        else:
            b_ptrs = b_cols + offs_r[:, None] * stride_br
        b = tl.load(b_ptrs, mask=r_mask[:, None] & n_mask[None, :], other=0.0)
        acc = tl.dot(h.to(b.dtype), b, acc, input_precision=DOT_PRECISION)
    y_offsets = tokens[:, None] * stride_yt + offs_n[None, :]
    y_mask = row_mask[:, None] & n_mask[None, :]
    y = tl.load(y_ptr + y_offsets, mask=y_mask, other=0.0)
    tl.store(y_ptr + y_offsets, (y.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=y_mask)

