"""One tier's pool of fixed-size KV blocks: allocation, ref counts, prefix index."""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Protocol, Sequence

from .errors import DoubleFreeError, IntegrityError, NoFreeBlocksError
from .hashing import BlockHash

# Called with (block_id, block_hash, token_ids) just before a cached block is
# reused for other data, so its owner can offload it to a lower tier.
EvictHook = Callable[[int, BlockHash, tuple], None]


class PoolListener(Protocol):
    """Told of every change to a pool's set of cached hashes (``events.EventLog``)."""

    def stored(self, tier: str, block_hash: BlockHash) -> None: ...

    def removed(self, tier: str, block_hash: BlockHash) -> None: ...

    def cleared(self, tier: str | None) -> None: ...


class BlockPool:
    """A pool of ``num_blocks`` blocks of ``block_size`` token slots each.

    Each block is in exactly one state:

    - free: ref count 0, holds no cached prefix; reused LIFO (warm memory);
    - cached-free: ref count 0 but keeps its hash, so a later request with
      the same prefix can take it back; evicted least recently freed first;
    - in use: ref count > 0, one per block table that holds it.

    ``allocate``, ``free`` and a cache hit's ``take_cached`` are O(1): the
    cached-free blocks sit in an insertion-ordered dict, which is a doubly
    linked list underneath, so a hit can unlink a block from the middle.
    """

    def __init__(self, num_blocks: int, block_size: int, tier: str = "device") -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.tier = tier
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[BlockHash | None] = [None] * num_blocks
        # The tokens behind each hash: the guard against hash collisions.
        self.block_tokens: list[tuple | None] = [None] * num_blocks
        self.block_parents: list[BlockHash | None] = [None] * num_blocks
        self.block_extra_keys: list[str | None] = [None] * num_blocks
        # Popping from the end hands out block 0 first on a fresh pool.
        self._free = list(range(num_blocks - 1, -1, -1))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._index: dict[BlockHash, int] = {}
        self.on_evict: EvictHook | None = None
        self.listener: PoolListener | None = None
        self.num_evictions = 0

    # ---- counts -------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now (free plus cached-free)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_free_blocks(self) -> int:
        return len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free) - len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks with a registered hash, in use or not."""
        return len(self._index)

    # ---- allocation ---------------------------------------------------------
    def allocate(self) -> int:
        """Take one block (ref count 1). Evicts the LRU cached block if needed."""
        if self._free:
            block = self._free.pop()
        elif self._evictable:
            block, _ = self._evictable.popitem(last=False)
            self._evict(block)
        else:
            raise NoFreeBlocksError(f"{self.tier} pool exhausted ({self.num_blocks} blocks)")
        self.ref_counts[block] = 1
        return block

    def allocate_many(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` blocks, or none at all if they are not free."""
        if num_blocks > self.num_free_blocks:
            raise NoFreeBlocksError(
                f"{self.tier} pool has {self.num_free_blocks} free blocks, {num_blocks} requested")
        return [self.allocate() for _ in range(num_blocks)]

    def free(self, block: int) -> None:
        """Drop one reference. At zero a hashed block stays cached, else it is free."""
        refs = self.ref_counts[block]
        if refs <= 0:
            raise DoubleFreeError(f"{self.tier} block {block} freed while not in use")
        self.ref_counts[block] = refs - 1
        if refs == 1:
            if self.block_hashes[block] is None:
                self._free.append(block)
            else:
                self._evictable[block] = None

    def incref(self, block: int) -> None:
        """Add a reference to a block that is in use (fork, sharing)."""
        if self.ref_counts[block] <= 0:
            raise DoubleFreeError(f"{self.tier} block {block} is not in use")
        self.ref_counts[block] += 1

    def claim(self, blocks: Sequence[int]) -> None:
        """Take a reference on each listed block, whatever its state (state rebuild).

        Blocks listed twice get two references. O(num_blocks): meant for
        restoring accounting after a restart, not for the hot path.
        """
        for block in blocks:
            if not 0 <= block < self.num_blocks:
                raise ValueError(f"{self.tier} block {block} is out of range [0, {self.num_blocks})")
        claimed = set()
        for block in blocks:
            if self.ref_counts[block] == 0:
                claimed.add(block)
            self.ref_counts[block] += 1
        if claimed:
            self._free = [b for b in self._free if b not in claimed]
            for block in claimed & set(self._evictable):
                del self._evictable[block]

    # ---- prefix cache -------------------------------------------------------
    def lookup(self, block_hash: BlockHash, token_ids: Sequence[int]) -> int | None:
        """The block caching exactly these tokens under this hash, or None."""
        block = self._index.get(block_hash)
        if block is None or self.block_tokens[block] != tuple(token_ids):
            return None  # a miss, or a hash collision: never share wrong data
        return block

    def cached_hashes(self) -> list[BlockHash]:
        """Every hash this pool caches (in use or cached-free)."""
        return list(self._index)

    def take_cached(self, block: int) -> None:
        """Reference a block found by ``lookup``, pulling it off the LRU list."""
        if self.ref_counts[block] == 0:
            del self._evictable[block]
        self.ref_counts[block] += 1

    def register(self, block: int, block_hash: BlockHash, token_ids: Sequence[int],
                 parent_hash: BlockHash | None, extra_key: str | None) -> bool:
        """Index a full, in-use block under its hash.

        Returns False (and leaves the block unhashed) if another block already
        caches the same prefix; the first copy stays the canonical one.
        """
        if self.block_hashes[block] is not None or block_hash in self._index:
            return False
        self._index[block_hash] = block
        self.block_hashes[block] = block_hash
        self.block_tokens[block] = tuple(token_ids)
        self.block_parents[block] = parent_hash
        self.block_extra_keys[block] = extra_key
        if self.listener is not None:
            self.listener.stored(self.tier, block_hash)
        return True

    def evict_all_cached(self) -> int:
        """Drop every cached-free block's hash (cache reset). Returns the count."""
        num = len(self._evictable)
        listener, self.listener = self.listener, None
        forgotten = []
        try:
            while self._evictable:
                block, _ = self._evictable.popitem(last=False)
                forgotten.append(self.block_hashes[block])
                self._forget(block)
                self._free.append(block)
        finally:
            self.listener = listener
        if listener is not None and forgotten:
            if self._index:
                for block_hash in forgotten:
                    listener.removed(self.tier, block_hash)
            else:
                listener.cleared(self.tier)
        return num

    def _evict(self, block: int) -> None:
        self.num_evictions += 1
        if self.on_evict is not None:
            self.on_evict(block, self.block_hashes[block], self.block_tokens[block])
        self._forget(block)

    def _forget(self, block: int) -> None:
        block_hash = self.block_hashes[block]
        del self._index[block_hash]
        if self.listener is not None:
            self.listener.removed(self.tier, block_hash)
        self.block_hashes[block] = None
        self.block_tokens[block] = None
        self.block_parents[block] = None
        self.block_extra_keys[block] = None

    # ---- checks -------------------------------------------------------------
    def state_of(self, block: int) -> str:
        """'free', 'cached' (cached-free) or 'used'."""
        if self.ref_counts[block] > 0:
            return "used"
        return "cached" if self.block_hashes[block] is not None else "free"

    def check_integrity(self, expected_refs: dict[int, int]) -> None:
        """Verify the pool against the ref counts its block tables imply."""
        from .hashing import hash_block

        name = f"{self.tier} pool"
        free = set(self._free)
        cached = set(self._evictable)
        if len(free) != len(self._free):
            raise IntegrityError(f"{name}: a block is on the free list twice")
        if free & cached:
            raise IntegrityError(f"{name}: blocks both free and cached: {sorted(free & cached)[:8]}")
        used = [b for b in range(self.num_blocks) if self.ref_counts[b] > 0]
        if len(free) + len(cached) + len(used) != self.num_blocks:
            raise IntegrityError(
                f"{name}: free {len(free)} + cached {len(cached)} + used {len(used)} "
                f"!= total {self.num_blocks}")
        for block in range(self.num_blocks):
            refs = self.ref_counts[block]
            if refs != expected_refs.get(block, 0):
                raise IntegrityError(
                    f"{name}: block {block} has ref count {refs}, "
                    f"but {expected_refs.get(block, 0)} block tables hold it")
            if refs == 0 and (block in free) == (block in cached):
                raise IntegrityError(f"{name}: unreferenced block {block} is lost")
            if block in cached and self.block_hashes[block] is None:
                raise IntegrityError(f"{name}: cached-free block {block} has no hash")
            if block in free and self.block_hashes[block] is not None:
                raise IntegrityError(f"{name}: free block {block} still has a hash")
        for block_hash, block in self._index.items():
            if self.block_hashes[block] != block_hash:
                raise IntegrityError(f"{name}: index entry points at block {block} with another hash")
            tokens = self.block_tokens[block]
            if tokens is None or len(tokens) != self.block_size:
                raise IntegrityError(f"{name}: hashed block {block} is not a full block")
            recomputed = hash_block(self.block_parents[block], tokens, self.block_extra_keys[block])
            if recomputed != block_hash:
                raise IntegrityError(f"{name}: block {block}'s hash does not match its tokens")
        num_hashed = sum(1 for h in self.block_hashes if h is not None)
        if num_hashed != len(self._index):
            raise IntegrityError(f"{name}: {num_hashed} hashed blocks but {len(self._index)} indexed")


class ContiguousBlockPool(BlockPool):
    """A pool that hands out runs of consecutive block ids, first fit.

    This is the per-request contiguous-buffer baseline: a sequence reserves
    its maximum length up front. It exists so benchmarks can compare it with
    paging on the same engine; it never caches prefixes.
    """

    def __init__(self, num_blocks: int, block_size: int, tier: str = "device") -> None:
        super().__init__(num_blocks, block_size, tier)
        self._is_free = bytearray(b"\x01" * num_blocks)

    def allocate_run(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` consecutive blocks (lowest start that fits)."""
        start = self._is_free.find(b"\x01" * num_blocks) if num_blocks > 0 else 0
        if start < 0:
            raise NoFreeBlocksError(
                f"{self.tier} pool has no run of {num_blocks} free blocks "
                f"({self.num_free_blocks} free in total: external fragmentation)")
        run = list(range(start, start + num_blocks))
        taken = set(run)
        self._free = [b for b in self._free if b not in taken]
        for block in run:
            self._is_free[block] = 0
            self.ref_counts[block] = 1
        return run

    def can_allocate_run(self, num_blocks: int) -> bool:
        return num_blocks == 0 or self._is_free.find(b"\x01" * num_blocks) >= 0

    def allocate(self) -> int:
        return self.allocate_run(1)[0]

    def free(self, block: int) -> None:
        super().free(block)
        if self.ref_counts[block] == 0:
            self._is_free[block] = 1

    def register(self, *args, **kwargs) -> bool:
        return False
