"""Freeing blocks that fell out of every layer's sliding window.

With a sliding window ``W`` on every attention layer, a query at position ``p``
reads keys ``p - W < k <= p`` only. Once a sequence has computed ``n`` tokens,
every later query sits at ``p >= n``, so a block whose last position is at or
before ``n - W`` is never read again: its table entry becomes -1 and the block
goes back to its pool through ``BlockPool.free`` (a hashed block stays cached-free
and findable by the prefix cache until evicted, with the usual events). The
attention kernels never read a table entry before the window (kernels/README).

This holds only when *every* layer is windowed; the engine passes the widest
window then, and None (keep every block) when some layer attends globally.
vLLM's hybrid allocator does the same for all-windowed models.
"""

from __future__ import annotations

FREED = -1  # a block table entry whose block was freed out of the window


class WindowFreeing:
    """When a sequence's leading blocks may be freed, for one window and block size."""

    def __init__(self, sliding_window: int, block_size: int) -> None:
        if sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        self.sliding_window = sliding_window
        self.block_size = block_size

    def num_out_of_window(self, num_computed: int) -> int:
        """Leading blocks that no query at a position >= ``num_computed`` reads: those
        wholly before ``num_computed - sliding_window + 1``."""
        first_needed = num_computed - self.sliding_window + 1
        return first_needed // self.block_size if first_needed > 0 else 0
