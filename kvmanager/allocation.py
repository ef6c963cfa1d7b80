"""Allocation policies: how a sequence's device block table grows.

``paged`` takes one block at a time from anywhere in the pool and shares
blocks (forks, prefix cache). ``contiguous`` is the baseline that per-request
buffers give: each sequence reserves ``ceil(max_model_len / block_size)``
consecutive blocks up front, first fit, and shares nothing.
"""

from __future__ import annotations

from collections.abc import Iterable

from .block_pool import BlockPool, ContiguousBlockPool
from .sequence import SequenceBlocks


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def detach_table(seq: SequenceBlocks) -> None:
    """Give a released sequence a new, empty table. The old list is left as it was:
    a plan handed it out live (``ScheduledSeq.block_table``), and its holder may still
    read it, e.g. the worker exporting a migrated sequence's KV after this step's plan."""
    seq.block_table = []
    seq.first_changed_block = 0


def _cut_table(seq: SequenceBlocks, num_blocks: int) -> None:
    """Drop the table's entries past ``num_blocks``; the worker rewrites them when they return."""
    del seq.block_table[num_blocks:]
    if seq.first_changed_block > num_blocks:
        seq.first_changed_block = num_blocks


class PagedAllocation:
    name = "paged"
    supports_sharing = True

    def __init__(self, pool: BlockPool, max_model_len: int) -> None:
        self.pool = pool

    def num_blocks_to_admit(self, seq: SequenceBlocks, num_total_blocks: int) -> int:
        """Free blocks needed to hold ``num_total_blocks`` for a new sequence."""
        return num_total_blocks - len(seq.block_table)

    def can_grow(self, seq: SequenceBlocks, num_blocks: int) -> bool:
        return num_blocks <= self.pool.num_free_blocks

    def grow(self, seq: SequenceBlocks, num_blocks: int) -> None:
        """Append ``num_blocks`` blocks to the table (caller checked ``can_grow``)."""
        allocate = self.pool.allocate
        table = seq.block_table
        if len(table) < seq.first_changed_block:
            seq.first_changed_block = len(table)
        table.extend([allocate() for _ in range(num_blocks)])

    def shrink(self, seq: SequenceBlocks, num_blocks: int) -> None:
        """Free the table's entries past its first ``num_blocks`` (tail first): blocks that held
        only rejected proposals."""
        free = self.pool.free
        table = seq.block_table
        for i in range(len(table) - 1, num_blocks - 1, -1):
            free(table[i])
        _cut_table(seq, num_blocks)

    def release(self, seq: SequenceBlocks) -> None:
        """Free the table tail first, so a sequence's tail is evicted before its head.
        Entries freed out of the window (-1) were returned already."""
        free = self.pool.free
        table = seq.block_table
        for i in range(len(table) - 1, seq.num_freed_blocks - 1, -1):
            free(table[i])
        detach_table(seq)
        seq.num_freed_blocks = 0

    def held_blocks(self, seq: SequenceBlocks) -> list[int]:
        return seq.block_table[seq.num_freed_blocks:]

    def num_untabled_blocks(self, seqs: Iterable[SequenceBlocks]) -> int:
        """Blocks the sequences hold outside their tables' entries: none, a table holds its own."""
        return 0


class ContiguousAllocation:
    name = "contiguous"
    supports_sharing = False

    def __init__(self, pool: ContiguousBlockPool, max_model_len: int) -> None:
        self.pool = pool
        self.num_reserved_blocks = cdiv(max_model_len, pool.block_size)

    def num_blocks_to_admit(self, seq: SequenceBlocks, num_total_blocks: int) -> int:
        return 0 if seq.reserved else self.num_reserved_blocks

    def can_grow(self, seq: SequenceBlocks, num_blocks: int) -> bool:
        if seq.reserved:
            return len(seq.block_table) + num_blocks <= len(seq.reserved)
        return (num_blocks <= self.num_reserved_blocks
                and self.pool.can_allocate_run(self.num_reserved_blocks))

    def grow(self, seq: SequenceBlocks, num_blocks: int) -> None:
        if not seq.reserved:
            seq.reserved = self.pool.allocate_run(self.num_reserved_blocks)
        start = len(seq.block_table)
        if start < seq.first_changed_block:
            seq.first_changed_block = start
        seq.block_table.extend(seq.reserved[start:start + num_blocks])

    def shrink(self, seq: SequenceBlocks, num_blocks: int) -> None:
        """Cut the table to its first ``num_blocks`` entries; the reservation keeps the rest."""
        _cut_table(seq, num_blocks)

    def release(self, seq: SequenceBlocks) -> None:
        for block in reversed(seq.reserved):
            self.pool.free(block)
        seq.reserved = []
        detach_table(seq)

    def held_blocks(self, seq: SequenceBlocks) -> list[int]:
        return seq.reserved

    def num_untabled_blocks(self, seqs: Iterable[SequenceBlocks]) -> int:
        """Blocks the sequences hold outside their tables' entries: each reservation's unused
        tail (a table is a prefix of its reservation). O(sequences)."""
        return sum(len(seq.reserved) - len(seq.block_table) for seq in seqs if seq.reserved)


ALLOCATION_POLICIES = {"paged": PagedAllocation, "contiguous": ContiguousAllocation}
