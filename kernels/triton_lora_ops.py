"""Triton backend of the batched LoRA products (CUDA; CPU only under Triton's interpreter).

The same interface as the torch path (``pagedserve.workers.lora.punica``): ``build_segments``
once per step, shared by every layer, then per adapted layer one ``lora_shrink`` and one
``lora_expand``, one kernel launch each, whatever the number of adapters in the step.

Weights are slot-indexed: ``lora_a`` ``[slots, R, in]``, ``lora_b`` ``[slots, R, out]``
(scaling folded into B, zero past an adapter's own rank), or ``PagedLoRAWeights`` of the
same shape in pages of the KV cache (``lora_pages``). Host code never reads device values,
so these ops do not synchronise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from . import triton_lora_kernels as lora_kernels
from .lora_pages import PagedLoRAWeights
from .triton_lora_kernels import TILE_TOKENS

LoRAWeights = torch.Tensor | PagedLoRAWeights


@dataclass
class SGMVSegments:
    """A step's adapted tokens sorted by slot, each slot's run (its segment) cut into tiles of
    at most ``TILE_TOKENS`` tokens.

    ``token_order[p]`` is the token at sorted position ``p``; tile ``i`` covers positions
    ``tile_starts[i]:tile_ends[i]``, all of slot ``tile_slots[i]``. The four are int32 rows
    of one tensor on the model's device (one copy per step, each row 16-byte aligned), valid
    up to ``num_adapted`` and ``num_tiles`` entries. ``slot_bits`` has bit ``s`` set for each
    slot in the step.
    """

    token_order: torch.Tensor
    tile_starts: torch.Tensor
    tile_ends: torch.Tensor
    tile_slots: torch.Tensor
    num_adapted: int
    num_tiles: int
    slot_bits: int


# ``SGMVSegments.slot_bits`` of static segments: every layer that holds slots runs its products.
ALL_SLOTS = -1


def build_segments(token_slots: torch.Tensor, device: torch.device) -> SGMVSegments | None:
    """The segments of a step whose token ``t`` uses slot ``token_slots[t]`` (int64, CPU;
    -1: the base model); None when no token uses an adapter. Tensor ops on the host, then
    one copy to ``device``."""
    adapted = (token_slots >= 0).nonzero().squeeze(1)
    num_adapted = adapted.numel()
    if num_adapted == 0:
        return None
    table, num_tiles, used = _segment_table(token_slots, adapted)
    if device.type == "cuda":
        table = table.pin_memory()  # queued behind the stream's work, never waited for
    table = table.to(device, non_blocking=True)
    return SGMVSegments(table[0], table[1], table[2], table[3], num_adapted, num_tiles,
                        sum(1 << slot for slot in used.tolist()))


class StaticSegments:
    """Segments of fixed shapes, for a forward CUDA graphs capture: ``max_tokens`` sorted
    positions and as many tiles as the most segments of that many tokens over ``num_slots``
    slots can need, on static device buffers. ``fill`` writes a step's (tiles past its own
    cover nothing: start = end), and every layer that holds slots runs (``ALL_SLOTS``), so a
    graph's kernels are launched whatever the step's adapters."""

    def __init__(self, max_tokens: int, num_slots: int, device: torch.device) -> None:
        self.max_tokens = max_tokens
        self.num_tiles = -(-max_tokens // TILE_TOKENS) + num_slots
        self.width = -(-max(max_tokens, self.num_tiles) // 4) * 4
        # Two host tables, alternating: a step never writes the one the step before may still be copying.
        self.hosts = [torch.zeros((4, self.width), dtype=torch.int32, pin_memory=device.type == "cuda")
                      for _ in range(2)]
        self.num_fills = 0
        self.table = torch.zeros((4, self.width), dtype=torch.int32, device=device)
        self.segments = SGMVSegments(self.table[0], self.table[1], self.table[2], self.table[3], max_tokens,
                                     self.num_tiles, ALL_SLOTS)

    def fill(self, token_slots: torch.Tensor | None) -> SGMVSegments:
        """The segments of a step whose token ``t`` (of at most ``max_tokens``) uses slot
        ``token_slots[t]`` (None: no token uses an adapter), written into the buffers."""
        host = self.hosts[self.num_fills % 2]
        self.num_fills += 1
        host.zero_()
        if token_slots is not None:
            adapted = (token_slots >= 0).nonzero().squeeze(1)
            if adapted.numel():
                table, _, _ = _segment_table(token_slots, adapted)
                host[:, :table.shape[1]] = table
        self.table.copy_(host, non_blocking=True)
        return self.segments


def _segment_table(token_slots: torch.Tensor, adapted: torch.Tensor) -> tuple[torch.Tensor, int, torch.Tensor]:
    """The host table of ``SGMVSegments`` (token order, tile starts, ends and slots as int32
    rows), its tile count, and the slots used."""
    num_adapted = adapted.numel()
    slots, order = torch.sort(token_slots.index_select(0, adapted), stable=True)
    counts = torch.bincount(slots)
    used = counts.nonzero().squeeze(1)
    lengths = counts.index_select(0, used)
    segment_ends = torch.cumsum(lengths, 0)
    tiles_per_segment = (lengths + TILE_TOKENS - 1) // TILE_TOKENS
    num_tiles = int(tiles_per_segment.sum())
    tile_segment = torch.repeat_interleave(tiles_per_segment)
    first_tile = torch.cumsum(tiles_per_segment, 0) - tiles_per_segment
    tile_in_segment = torch.arange(num_tiles) - first_tile.index_select(0, tile_segment)
    tile_segment_ends = segment_ends.index_select(0, tile_segment)
    tile_starts = tile_segment_ends - lengths.index_select(0, tile_segment) + tile_in_segment * TILE_TOKENS
    width = -(-max(num_adapted, num_tiles) // 4) * 4
    table = torch.zeros((4, width), dtype=torch.int32)
    table[0, :num_adapted] = adapted.index_select(0, order)
    table[1, :num_tiles] = tile_starts
    table[2, :num_tiles] = torch.minimum(tile_starts + TILE_TOKENS, tile_segment_ends)
    table[3, :num_tiles] = used.index_select(0, tile_segment)
    return table, num_tiles, used


def lora_shrink(x: torch.Tensor, lora_a: LoRAWeights, segments: SGMVSegments) -> torch.Tensor:
    """``x`` ``[tokens, in]`` through each adapted token's A (``lora_a`` ``[slots, R, in]``):
    ``h`` ``[num_adapted, R]`` in float32, rows in the segments' sorted order."""
    _check_operands("lora_shrink", x, lora_a, segments)
    max_rank, in_features = lora_a.shape[1:]
    h = torch.empty((segments.num_adapted, max_rank), dtype=torch.float32, device=x.device)
    weights, slot_strides, table, table_strides, piece = _weight_args(lora_a, segments)
    tiles = lora_kernels.lora_tiles(max_rank, piece)
    lora_kernels.lora_shrink_kernel[(segments.num_tiles, triton.cdiv(max_rank, tiles.block_r))](
        x, weights, h, segments.token_order, segments.tile_starts, segments.tile_ends, segments.tile_slots, table,
        x.stride(0), *slot_strides, h.stride(0), *table_strides,
        IN_FEATURES=in_features, MAX_RANK=max_rank, BLOCK_M=TILE_TOKENS, BLOCK_R=tiles.block_r,
        BLOCK_K=tiles.block_k, DOT_PRECISION=_dot_precision(x.dtype), PAGED=piece is not None, PIECE=piece or 1,
        num_warps=tiles.num_warps,
    )
    return h


def lora_expand(y: torch.Tensor, h: torch.Tensor, lora_b: LoRAWeights, segments: SGMVSegments) -> None:
    """Add each adapted token's ``h @ B`` (``h`` from ``lora_shrink``; ``lora_b``
    ``[slots, R, out]``, scaling folded in) to its row of ``y`` ``[tokens, out]``, in place."""
    _check_operands("lora_expand", y, lora_b, segments)
    max_rank, out_features = lora_b.shape[1:]
    if h.shape != (segments.num_adapted, max_rank) or h.dtype != torch.float32 or h.stride(1) != 1:
        raise ValueError(f"lora_expand: h must be lora_shrink's float32 [{segments.num_adapted}, {max_rank}], "
                         f"got {h.dtype} {tuple(h.shape)}")
    weights, slot_strides, table, table_strides, piece = _weight_args(lora_b, segments)
    tiles = lora_kernels.lora_tiles(max_rank, piece)
    lora_kernels.lora_expand_kernel[(segments.num_tiles, triton.cdiv(out_features, tiles.block_n))](
        h, weights, y, segments.token_order, segments.tile_starts, segments.tile_ends, segments.tile_slots, table,
        h.stride(0), *slot_strides, y.stride(0), *table_strides,
        OUT_FEATURES=out_features, MAX_RANK=max_rank, BLOCK_M=TILE_TOKENS, BLOCK_N=tiles.block_n,
        BLOCK_R=tiles.block_r, DOT_PRECISION=_dot_precision(lora_b.dtype), PAGED=piece is not None,
        PIECE=piece or 1, num_warps=tiles.num_warps,
    )


def _weight_args(weights: LoRAWeights, segments: SGMVSegments):
    """(weight pointer tensor, its slot and rank strides, table, the table's strides, piece) as
    the kernels take them: a slot tensor's own, or the pages' storage and table (piece None:
    not paged; the table argument is then an unread stand-in)."""
    if isinstance(weights, PagedLoRAWeights):
        table = weights.table
        return weights.storage, (0, 0), table, (table.stride(0), table.stride(1)), weights.piece
    return weights, (weights.stride(0), weights.stride(1)), segments.token_order, (0, 0), None


def _check_operands(op_name: str, rows: torch.Tensor, weights: LoRAWeights, segments: SGMVSegments) -> None:
    """``rows`` ``[tokens, features]`` and slot weights ``[slots, R, features]``: one dtype, one
    device (the segments' too), the features contiguous; CUDA, or CPU under the interpreter."""
    if rows.dim() != 2 or len(weights.shape) != 3 or rows.shape[1] != weights.shape[2]:
        raise ValueError(f"{op_name}: need [tokens, features] and [slots, R, features], "
                         f"got {tuple(rows.shape)} and {tuple(weights.shape)}")
    if rows.dtype != weights.dtype:
        raise TypeError(f"{op_name}: activations are {rows.dtype}, the adapter weights {weights.dtype}")
    paged = isinstance(weights, PagedLoRAWeights)
    if rows.stride(1) != 1 or (not paged and weights.stride(2) != 1):
        raise ValueError(f"{op_name}: the feature dimension must be contiguous")
    if paged and (weights.table.dtype != torch.int32 or weights.table.stride(2) != 1
                  or weights.piece & (weights.piece - 1) or weights.piece < 16):
        raise ValueError(f"{op_name}: paged weights need a contiguous int32 table and pieces of a power of "
                         f"two of at least 16 elements, got {weights.table.dtype} and {weights.piece}")
    device = rows.device
    if weights.device != device or segments.token_order.device != device:
        raise ValueError(f"{op_name}: tensors on {device}, {weights.device} and {segments.token_order.device}")
    if device.type != "cuda" and isinstance(lora_kernels.lora_shrink_kernel, triton.JITFunction):
        raise RuntimeError(f"{op_name}: the Triton kernels need CUDA tensors, got {device}; use the torch path "
                           "(pagedserve.workers.lora.punica), or TRITON_INTERPRET=1 before triton is imported")


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # no silent TF32 dots on fp32 inputs
