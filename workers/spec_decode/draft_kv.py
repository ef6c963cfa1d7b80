"""The KV of a proposer's own layers (a draft model's, an EAGLE head's), kept in the target's
blocks, and the scratch blocks its proposals are written to.

Block b of the pool holds the target's K/V in the target's cache and the proposer's in this
one, so the proposer reads a sequence's context through the target's block table rows, and
the KV manager's swaps and copies apply to both (``execute_copies``). Past the pool's blocks
this cache has scratch blocks: a proposing sequence's positions from its last known token on
have no slots when the proposer runs (the plan gives them slots once the proposals are
known), so the proposer writes them into scratch, after copying in the filled part of the
block that holds the first of them (``ScratchBatch``).
"""

from __future__ import annotations

from typing import Callable

import torch

from pagedserve import kernels

from ..model.attention import PagedAttentionMetadata
from ..model.block_tables import BlockTableRows
from ..model.host_lists import int64_tensor, to_device
from ..model.kv_cache import CacheShape, KVCache


def scratch_blocks_per_seq(block_size: int, num_positions: int) -> int:
    """Scratch blocks for ``num_positions`` positions from any offset of a block (the block's
    filled part, up to ``block_size - 1`` tokens, comes first)."""
    return -(-(block_size - 1 + num_positions) // block_size)


class DraftKV:
    """A proposer's cache: ``shape`` per block in the pool's ``num_device_blocks`` (and the
    host pool's), then ``max_num_seqs`` sequences' scratch."""

    def __init__(self, shape: CacheShape, num_device_blocks: int, num_host_blocks: int, max_num_seqs: int,
                 num_scratch_positions: int, block_tables: BlockTableRows,
                 make_cache: Callable[[int, int], KVCache]) -> None:
        """``make_cache(num_device_blocks, num_host_blocks)`` allocates the cache."""
        self.shape = shape
        self.block_tables = block_tables
        self.num_pool_blocks = num_device_blocks
        self.blocks_per_seq = scratch_blocks_per_seq(shape.block_size, num_scratch_positions)
        self.num_scratch_blocks = max_num_seqs * self.blocks_per_seq
        self.cache = make_cache(num_device_blocks + self.num_scratch_blocks, num_host_blocks)

    @staticmethod
    def scratch_bytes(shape: CacheShape, max_num_seqs: int, num_scratch_positions: int) -> int:
        return max_num_seqs * scratch_blocks_per_seq(shape.block_size, num_scratch_positions) * shape.bytes_per_block

    def execute_copies(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]],
                       copy_on_write: list[tuple[int, int]]) -> None:
        self.cache.execute_copies(swap_out, swap_in, copy_on_write)

    def stats(self, model: str, num_parameters: int, num_kv_tokens: int) -> dict:
        """The proposer's part of the engine's stats: its checkpoint, size and KV
        (``num_kv_tokens``: tokens whose KV it computed into their slots)."""
        return {"spec_decode_draft_model": model,
                "spec_decode_draft_parameters": num_parameters,
                "spec_decode_draft_kv_bytes_per_block": self.shape.bytes_per_block,
                "spec_decode_draft_scratch_blocks": self.num_scratch_blocks,
                "spec_decode_draft_kv_tokens": num_kv_tokens}

    def scratch_batch(self, rows: list[int], first_positions: list[int]) -> "ScratchBatch":
        """Scratch for sequences in block table ``rows`` whose positions from
        ``first_positions[i]`` on are to be written (the filled part of each one's block is
        copied in now)."""
        if len(rows) * self.blocks_per_seq > self.num_scratch_blocks:
            raise RuntimeError(f"{len(rows)} proposing sequences, scratch for "
                               f"{self.num_scratch_blocks // self.blocks_per_seq}")
        return ScratchBatch(self, int64_tensor(rows), int64_tensor(first_positions))


class ScratchBatch:
    """One proposal pass: each sequence's table (its own blocks, then its scratch) and the
    slots of its positions ``first + step``."""

    def __init__(self, kv: DraftKV, rows: torch.Tensor, first: torch.Tensor) -> None:
        block_size = kv.shape.block_size
        self.kv = kv
        self.first = first
        self.offsets = first % block_size                # filled tokens of each first block
        first_column = first // block_size
        num = len(rows)
        self.scratch = kv.num_pool_blocks + torch.arange(num, dtype=torch.int64) * kv.blocks_per_seq
        width = int(first_column.max()) + kv.blocks_per_seq
        host = kv.block_tables.host
        own = host.index_select(0, rows)[:, :min(width, host.shape[1])].to(torch.int64)
        if own.shape[1] < width:
            own = torch.cat([own, own.new_zeros((num, width - own.shape[1]))], dim=1)
        from_scratch = torch.arange(width, dtype=torch.int64)[None, :] - first_column[:, None]
        scratch_ids = (self.scratch[:, None] + from_scratch).clamp(max=kv.cache.num_device_blocks - 1)
        tables = torch.where(from_scratch >= 0, scratch_ids, own).to(torch.int32)
        device = kv.cache.device
        partly_filled = (self.offsets > 0).nonzero().flatten()
        if len(partly_filled):
            pairs = torch.stack([own[partly_filled, first_column[partly_filled]], self.scratch[partly_filled]], dim=1)
            caches = kv.cache.device_caches
            kernels.copy_blocks([k for k, _ in caches], [v for _, v in caches], to_device(pairs, device))
        self.tables = to_device(tables, device)
        self.cu_seqlens = to_device(torch.arange(num + 1, dtype=torch.int32), device)

    def metadata(self, step: int, backend: str | None, plan_window: int | None) -> tuple[PagedAttentionMetadata,
                                                                                         torch.Tensor]:
        """The attention metadata of a decode forward at positions ``first + step`` (one
        token a sequence), and those positions (on the device)."""
        block_size = self.kv.shape.block_size
        device = self.kv.cache.device
        positions = self.first + step
        in_scratch = self.offsets + step
        slots = (self.scratch + in_scratch // block_size) * block_size + in_scratch % block_size
        meta = PagedAttentionMetadata(
            slot_mapping=to_device(slots, device), block_tables=self.tables, cu_seqlens_q=self.cu_seqlens,
            seq_lens=to_device((positions + 1).to(torch.int32), device), is_decode_only=True,
            kv_caches=self.kv.cache.device_caches, backend=backend, plan_window=plan_window)
        return meta, to_device(positions, device)
