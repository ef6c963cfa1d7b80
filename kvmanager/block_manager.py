"""One worker's KV blocks: device and host pools, block tables, prefix cache."""

from __future__ import annotations

from dataclasses import dataclass, field

from .allocation import ALLOCATION_POLICIES, cdiv
from .block_pool import BlockPool, ContiguousBlockPool
from .errors import KVManagerError, NoFreeBlocksError, UnknownSequenceError
from .hashing import BlockHash, hash_block, hash_blocks
from .sequence import SeqLocation, SequenceBlocks
from .step import PENDING_TOKEN
from .window import FREED, WindowFreeing


@dataclass(slots=True)
class PrefixMatch:
    """The longest cached chain of full blocks at the start of a sequence."""

    device_blocks: list[int] = field(default_factory=list)  # in chain order, may mix with host
    sources: list[str] = field(default_factory=list)        # "device" or "host" per block

    @property
    def num_blocks(self) -> int:
        return len(self.device_blocks)


@dataclass(slots=True)
class StepScratch:
    """Copies ordered during one step, plus host blocks held until it ends."""

    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    copy_on_write: list[tuple[int, int]] = field(default_factory=list)
    host_blocks_to_release: list[int] = field(default_factory=list)


@dataclass(slots=True)
class BlockManagerCounters:
    num_prefix_query_tokens: int = 0
    num_prefix_hit_tokens: int = 0
    num_preemptions_swap: int = 0
    num_preemptions_recompute: int = 0
    num_preemptions_migrate: int = 0
    num_blocks_swapped_out: int = 0
    num_blocks_swapped_in: int = 0
    num_blocks_offloaded: int = 0
    num_cow_copies: int = 0
    num_window_freed_blocks: int = 0


class BlockManager:
    """The block accounting of one worker: its device pool and host pool.

    Every public operation either succeeds or raises a ``KVManagerError``
    leaving the state as it was (check first, then act). Copies the worker
    must perform accumulate in ``scratch`` between ``begin_step`` and
    ``end_step``; see ``StepOutput`` for the order they must run in.

    ``sliding_window`` (every layer windowed, the widest window): blocks that fall
    wholly out of it are freed as sequences grow, their table entries set to -1
    (``window.py``). None keeps every block. Never with contiguous allocation.
    """

    def __init__(
        self,
        num_device_blocks: int,
        num_host_blocks: int = 0,
        block_size: int = 16,
        max_model_len: int = 2048,
        allocation: str = "paged",
        enable_prefix_caching: bool = True,
        watermark: float = 0.01,
        offload_evicted_to_host: bool = True,
        sliding_window: int | None = None,
    ) -> None:
        if allocation not in ALLOCATION_POLICIES:
            raise ValueError(f"allocation must be one of {sorted(ALLOCATION_POLICIES)}, got {allocation!r}")
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}")
        if max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
        pool_cls = ContiguousBlockPool if allocation == "contiguous" else BlockPool
        self.device = pool_cls(num_device_blocks, block_size, tier="device")
        self.host = BlockPool(num_host_blocks, block_size, tier="host")
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.policy = ALLOCATION_POLICIES[allocation](self.device, max_model_len)
        self.enable_prefix_caching = enable_prefix_caching and self.policy.supports_sharing
        self.window = (WindowFreeing(sliding_window, block_size)
                       if sliding_window is not None and self.policy.supports_sharing else None)
        self.watermark_blocks = int(watermark * num_device_blocks)
        self.offload_evicted_to_host = offload_evicted_to_host and num_host_blocks > 0
        self.seqs: dict[str, SequenceBlocks] = {}
        self.counters = BlockManagerCounters()
        self.scratch = StepScratch()
        # The last step's copies and imports, for dashboards: (device, host) pairs.
        self.last_swaps: list[tuple[int, int]] = []
        self.last_imported: set[int] = set()
        # Device blocks lent out as pages of other data (LoRA adapters' weights), by owner.
        self.pages: dict[str, list[int]] = {}
        if self.offload_evicted_to_host and self.enable_prefix_caching:
            self.device.on_evict = self._offload_evicted

    # ---- sequences ------------------------------------------------------------
    def get(self, seq_id: str) -> SequenceBlocks:
        seq = self.seqs.get(seq_id)
        if seq is None:
            raise UnknownSequenceError(f"unknown sequence {seq_id!r}")
        return seq

    def add_sequence(self, seq_id: str, token_ids: list[int], extra_key: str | None = None,
                     num_imported_tokens: int = 0, skip_prefix_cache: bool = False) -> SequenceBlocks:
        """Register a waiting sequence with its known tokens; takes no blocks."""
        if not 0 <= num_imported_tokens < max(len(token_ids), 1):
            raise KVManagerError(f"sequence {seq_id!r}: {num_imported_tokens} imported tokens "
                                 f"of {len(token_ids)} (at least one must be computed here)")
        if seq_id in self.seqs:
            raise KVManagerError(f"sequence {seq_id!r} already exists")
        if not token_ids:
            raise KVManagerError(f"sequence {seq_id!r} has no tokens")
        if len(token_ids) > self.max_model_len:
            raise KVManagerError(
                f"sequence {seq_id!r} has {len(token_ids)} tokens, max_model_len is {self.max_model_len}")
        seq = SequenceBlocks(seq_id, list(token_ids), extra_key, num_imported_tokens=num_imported_tokens,
                             skip_prefix_cache=skip_prefix_cache)
        self.seqs[seq_id] = seq
        return seq

    def append_tokens(self, seq_id: str, token_ids: list[int]) -> None:
        """Add sampled tokens; their KV is computed by a later step."""
        self.append_tokens_of([(seq_id, token_ids)])

    def append_tokens_of(self, appended: list[tuple[str, list[int]]]) -> None:
        """``append_tokens`` for each (sequence id, tokens) in turn: a step's sampled tokens.
        ``PENDING_TOKEN`` entries count as pending (their values come with ``resolve_tokens_of``);
        a known token after a pending one is an error."""
        seqs, max_model_len = self.seqs, self.max_model_len
        for seq_id, token_ids in appended:
            seq = seqs.get(seq_id) or self.get(seq_id)
            tokens = seq.token_ids
            if seq.num_speculative:
                raise KVManagerError(f"sequence {seq_id!r}: tokens appended after unsettled proposals")
            if len(tokens) + len(token_ids) > max_model_len:
                raise KVManagerError(f"sequence {seq_id!r} would exceed max_model_len {max_model_len}")
            if token_ids:
                if seq.num_pending or token_ids[-1] == PENDING_TOKEN or PENDING_TOKEN in token_ids:
                    num_pending = token_ids.count(PENDING_TOKEN)
                    if (num_pending != len(token_ids) if seq.num_pending else
                            token_ids[-num_pending:] != [PENDING_TOKEN] * num_pending):
                        raise KVManagerError(f"sequence {seq_id!r}: a known token appended after a pending one")
                    seq.num_pending += num_pending
                tokens += token_ids
                seq.is_protected = False

    def resolve_tokens_of(self, resolved: list[tuple[str, list[int]]]) -> None:
        """The values of each sequence's oldest pending tokens, in order."""
        for seq_id, values in resolved:
            seq = self.get(seq_id)
            if len(values) > seq.num_pending or PENDING_TOKEN in values:
                raise KVManagerError(f"sequence {seq_id!r}: {len(values)} values for its {seq.num_pending} "
                                     "pending tokens")
            start = len(seq.token_ids) - seq.num_pending
            seq.token_ids[start:start + len(values)] = values
            seq.num_pending -= len(values)

    def propose_tokens_of(self, proposed: list[tuple[str, list[int]]]) -> None:
        """Add each (sequence id, tokens) as proposed tokens after the sequence's known ones
        (speculative decoding): scheduled and computed like any, never indexed for the prefix
        cache, and settled by ``accept_tokens_of`` at the next step (dropped on preemption)."""
        seqs, max_model_len = self.seqs, self.max_model_len
        for seq_id, token_ids in proposed:
            seq = seqs.get(seq_id) or self.get(seq_id)
            if seq.location != SeqLocation.DEVICE or seq.num_pending or seq.num_speculative:
                raise KVManagerError(f"sequence {seq_id!r}: proposals need a running sequence whose tokens "
                                     "are all known and settled")
            if len(seq.token_ids) + len(token_ids) > max_model_len:
                raise KVManagerError(f"sequence {seq_id!r}: proposals would exceed max_model_len {max_model_len}")
            seq.token_ids += token_ids
            seq.num_speculative = len(token_ids)

    def accept_tokens_of(self, accepted: list[tuple[str, int]]) -> None:
        """Settle each (sequence id, number accepted) sequence's proposed tokens: the first ones
        accepted stay, with their KV, as known tokens; the rest are dropped, the computed count
        cut back to the tokens kept, the blocks left empty freed (tail first), and the blocks
        now full of accepted tokens indexed for the prefix cache."""
        bs = self.block_size
        for seq_id, num_accepted in accepted:
            seq = self.get(seq_id)
            if not 0 <= num_accepted <= seq.num_speculative:
                raise KVManagerError(f"sequence {seq_id!r}: {num_accepted} accepted of its "
                                     f"{seq.num_speculative} proposed tokens")
            num_kept = len(seq.token_ids) - seq.num_speculative + num_accepted
            if num_accepted and seq.num_computed < num_kept:
                raise KVManagerError(f"sequence {seq_id!r}: accepted proposals that were never computed")
            del seq.token_ids[num_kept:]
            seq.num_speculative = 0
            if seq.num_computed > num_kept:
                seq.num_computed = num_kept
                self.policy.shrink(seq, max(cdiv(num_kept, bs), seq.num_freed_blocks))
            if self.enable_prefix_caching and seq.location == SeqLocation.DEVICE:
                self._register_full_blocks(seq)

    def _drop_proposed(self, seq: SequenceBlocks) -> None:
        """Forget a sequence's proposed tokens before it is preempted (none is computed yet:
        proposals are settled before every step's scheduling)."""
        if seq.num_speculative:
            del seq.token_ids[len(seq.token_ids) - seq.num_speculative:]
            seq.num_speculative = 0
            if seq.num_computed > len(seq.token_ids):
                raise KVManagerError(f"sequence {seq.seq_id!r}: preempted with computed proposals")

    def fork(self, parent_id: str, child_id: str) -> None:
        """Make ``child_id`` a copy of ``parent_id`` sharing all its device blocks.

        Under a policy that shares nothing the child starts waiting, without
        KV, to be recomputed.
        """
        parent = self.get(parent_id)
        if parent.num_speculative:
            raise KVManagerError(f"cannot fork {parent_id!r} while it holds proposed tokens")
        if child_id in self.seqs:
            raise KVManagerError(f"sequence {child_id!r} already exists")
        if parent.location == SeqLocation.SWAPPED:
            raise KVManagerError(f"cannot fork swapped-out sequence {parent_id!r}")
        child = SequenceBlocks(child_id, list(parent.token_ids), parent.extra_key, num_pending=parent.num_pending)
        self.seqs[child_id] = child
        if parent.location != SeqLocation.DEVICE or not self.policy.supports_sharing:
            return
        for block in self.policy.held_blocks(parent):
            self.device.incref(block)
        child.block_table = list(parent.block_table)
        child.num_freed_blocks = parent.num_freed_blocks
        child.block_hashes = list(parent.block_hashes)
        child.num_indexed_blocks = parent.num_indexed_blocks
        child.num_computed = parent.num_computed
        child.location = SeqLocation.DEVICE

    def free_sequence(self, seq_id: str) -> None:
        """Return a finished or aborted sequence's blocks and forget it."""
        seq = self.get(seq_id)
        self._release_device(seq)
        for block in reversed(seq.host_table):
            if block != FREED:
                self.host.free(block)
        seq.host_table.clear()
        del self.seqs[seq_id]

    def restore_sequences(self, sequences: list[dict]) -> None:
        """Rebuild accounting from a worker's report after the manager restarted.

        Each entry has ``seq_id``, ``token_ids`` and, for a sequence whose KV
        is on the device, ``num_computed`` and ``block_table``; the rest come
        back waiting (their KV is recomputed). The manager must be empty.
        """
        if self.seqs:
            raise KVManagerError("restore_sequences needs an empty block manager")
        if not self.policy.supports_sharing:
            raise KVManagerError(f"{self.policy.name} allocation cannot be restored")
        all_blocks: list[int] = []
        for entry in sequences:
            seq = self.add_sequence(entry["seq_id"], entry["token_ids"], entry.get("extra_key"),
                                    skip_prefix_cache=bool(entry.get("skip_prefix_cache")))
            table = list(entry.get("block_table") or [])
            num_computed = int(entry.get("num_computed") or 0)
            if table and num_computed:
                if cdiv(num_computed, self.block_size) > len(table):
                    raise KVManagerError(f"{seq.seq_id!r}: {num_computed} tokens do not fit its table")
                num_freed = next((i for i, b in enumerate(table) if b != FREED), len(table))
                if FREED in table[num_freed:]:
                    raise KVManagerError(f"{seq.seq_id!r}: freed (-1) entries after held blocks")
                seq.block_table = table
                seq.num_freed_blocks = num_freed
                seq.num_computed = num_computed
                seq.location = SeqLocation.DEVICE
                all_blocks.extend(table[num_freed:])
        try:
            self.device.claim(all_blocks)
        except ValueError as exc:
            self.seqs.clear()
            raise KVManagerError(str(exc)) from None
        if self.enable_prefix_caching:
            for seq in self.seqs.values():
                if seq.location == SeqLocation.DEVICE:
                    self._register_full_blocks(seq)

    # ---- prefix cache ---------------------------------------------------------
    def match_prefix(self, seq: SequenceBlocks) -> PrefixMatch:
        """Find cached blocks for a waiting sequence without taking them.

        The last known token is always recomputed, since its logits are needed.
        """
        match = PrefixMatch()
        if not self.enable_prefix_caching or seq.skip_prefix_cache:
            return match
        bs = self.block_size
        num_blocks = (len(seq.token_ids) - 1) // bs
        self._extend_hashes(seq, num_blocks)
        for i in range(num_blocks):
            block_hash = seq.block_hashes[i]
            tokens = seq.token_ids[i * bs:(i + 1) * bs]
            block = self.device.lookup(block_hash, tokens)
            if block is not None:
                match.device_blocks.append(block)
                match.sources.append("device")
                continue
            block = self.host.lookup(block_hash, tokens) if self.host.num_blocks else None
            if block is None:
                break
            match.device_blocks.append(block)
            match.sources.append("host")
        return match

    def _extend_hashes(self, seq: SequenceBlocks, num_blocks: int) -> None:
        bs = self.block_size
        hashes = seq.block_hashes
        if len(hashes) < num_blocks:
            hashes += hash_blocks(hashes[-1] if hashes else None,
                                  seq.token_ids[len(hashes) * bs:num_blocks * bs], bs, seq.extra_key)

    def _register_full_blocks(self, seq: SequenceBlocks) -> None:
        """Index the blocks that are full now that ``num_computed`` tokens are planned (and
        whose tokens are all known)."""
        bs = self.block_size
        num_full = min(seq.num_computed, len(seq.token_ids) - seq.num_pending - seq.num_speculative) // bs
        if num_full <= seq.num_indexed_blocks:
            return
        first = max(seq.num_indexed_blocks, seq.num_freed_blocks)  # -1 entries: gone
        self._extend_hashes(seq, first)
        hashes, tokens, table, extra_key = seq.block_hashes, seq.token_ids, seq.block_table, seq.extra_key
        register = self.device.register
        for i in range(first, num_full):
            block_tokens = tokens[i * bs:(i + 1) * bs]
            parent = hashes[i - 1] if i else None
            if i == len(hashes):
                hashes.append(hash_block(parent, block_tokens, extra_key))
            register(table[i], hashes[i], block_tokens, parent, extra_key)
        seq.num_indexed_blocks = num_full

    # ---- admission and growth -------------------------------------------------
    def num_free_device_blocks(self) -> int:
        return self.device.num_free_blocks

    def can_admit(self, seq: SequenceBlocks, match: PrefixMatch) -> bool:
        """Admission control: the whole prompt plus the watermark must fit."""
        num_total = cdiv(len(seq.token_ids), self.block_size)
        if self.policy.supports_sharing:
            # Hit blocks on the device's LRU list count as free now but are
            # taken by this sequence; host hits need a new device block each.
            num_needed = num_total - match.sources.count("device")
            num_revived = sum(1 for b, src in zip(match.device_blocks, match.sources)
                              if src == "device" and self.device.ref_counts[b] == 0)
            return num_needed + self.watermark_blocks <= self.device.num_free_blocks - num_revived
        if num_total > self.policy.num_reserved_blocks:
            return False
        return self.policy.can_grow(seq, num_total)

    def admit_imported(self, seq: SequenceBlocks) -> int:
        """Admit a sequence whose first tokens' KV arrives by transfer. Returns that count.

        Takes fresh blocks for them (the caller checked ``can_admit``) and
        indexes the full ones: the worker writes the KV before the forward.
        """
        num_tokens = seq.num_imported_tokens
        self.policy.grow(seq, cdiv(num_tokens, self.block_size))
        seq.num_computed = num_tokens
        seq.location = SeqLocation.DEVICE
        seq.num_imported_tokens = 0
        if self.enable_prefix_caching:
            self._register_full_blocks(seq)
        return num_tokens

    def admit(self, seq: SequenceBlocks, match: PrefixMatch) -> int:
        """Take the prefix hit for a waiting sequence. Returns the hit tokens."""
        if seq.location != SeqLocation.WAITING:
            raise KVManagerError(f"sequence {seq.seq_id!r} is not waiting")
        # Pin every hit first: the allocations below may evict cached-free blocks
        # (and offload them over cached host blocks), which must not be this chain's.
        for block, source in zip(match.device_blocks, match.sources):
            (self.device if source == "device" else self.host).take_cached(block)
        for block, source in zip(match.device_blocks, match.sources):
            if source == "device":
                seq.block_table.append(block)
            else:
                self.scratch.host_blocks_to_release.append(block)
                device_block = self.device.allocate()
                self.scratch.swap_in.append((block, device_block))
                self.counters.num_blocks_swapped_in += 1
                i = len(seq.block_table)
                self.device.register(device_block, seq.block_hashes[i],
                                     seq.token_ids[i * self.block_size:(i + 1) * self.block_size],
                                     seq.block_hashes[i - 1] if i else None, seq.extra_key)
                seq.block_table.append(device_block)
        num_hit_tokens = match.num_blocks * self.block_size
        self.counters.num_prefix_query_tokens += len(seq.token_ids)
        self.counters.num_prefix_hit_tokens += num_hit_tokens
        seq.num_computed = num_hit_tokens
        seq.num_indexed_blocks = match.num_blocks
        seq.location = SeqLocation.DEVICE
        return num_hit_tokens

    def num_blocks_to_grow(self, seq: SequenceBlocks, num_tokens: int) -> int:
        """New device blocks needed to compute ``num_tokens`` more tokens.

        Includes one block for copy-on-write when the first write lands in a
        shared, partially filled block.
        """
        num_needed = cdiv(seq.num_computed + num_tokens, self.block_size) - len(seq.block_table)
        return max(num_needed, 0) + self._needs_cow(seq)

    def _needs_cow(self, seq: SequenceBlocks) -> int:
        offset = seq.num_computed % self.block_size
        if offset == 0 or not seq.block_table:
            return 0
        last = seq.block_table[seq.num_computed // self.block_size]
        return 1 if self.device.ref_counts[last] > 1 else 0

    def can_grow(self, seq: SequenceBlocks, num_tokens: int) -> bool:
        if seq.location != SeqLocation.DEVICE:
            return False
        return self.policy.can_grow(seq, self.num_blocks_to_grow(seq, num_tokens))

    def grow(self, seq: SequenceBlocks, num_tokens: int, free_out_of_window: bool = True) -> None:
        """Provide slots for ``num_tokens`` more tokens, or raise ``NoFreeBlocksError``."""
        if seq.location != SeqLocation.DEVICE or not self.try_grow(seq, num_tokens, free_out_of_window):
            raise NoFreeBlocksError(f"no room for {num_tokens} more tokens of {seq.seq_id!r}")

    def try_grow(self, seq: SequenceBlocks, num_tokens: int, free_out_of_window: bool = True) -> bool:
        """Provide slots for ``num_tokens`` more tokens of a device-resident
        sequence and mark them computed; False, changing nothing, if the pool
        cannot.

        Full blocks get indexed for the prefix cache as soon as they are
        planned: within one forward pass each layer writes the KV of every
        token before any token reads it. With a window, blocks before this
        step's first query's window are freed (unless ``free_out_of_window`` is
        False: a step whose KV arrives by copy or transfer). This is the
        per-step hot path.
        """
        bs = self.block_size
        computed = seq.num_computed
        end = computed + num_tokens
        table = seq.block_table
        num_new = (end + bs - 1) // bs - len(table)
        is_cow = computed % bs != 0 and self.device.ref_counts[table[computed // bs]] > 1
        num_needed = (num_new if num_new > 0 else 0) + is_cow
        if num_needed:
            if not self.policy.can_grow(seq, num_needed):
                return False
            if is_cow:
                i = computed // bs
                shared = table[i]
                fresh = self.device.allocate()
                self.device.free(shared)
                table[i] = fresh
                if i < seq.first_changed_block:
                    seq.first_changed_block = i
                self.scratch.copy_on_write.append((shared, fresh))
                self.counters.num_cow_copies += 1
            if num_new > 0:
                self.policy.grow(seq, num_new)
        seq.num_computed = end
        if end // bs > seq.num_indexed_blocks and self.enable_prefix_caching:
            self._register_full_blocks(seq)
        if self.window is not None and free_out_of_window:
            # This step's first query sits at ``computed``: blocks before its window are done.
            self._free_out_of_window(seq, computed)
        return True

    def _free_out_of_window(self, seq: SequenceBlocks, num_computed: int) -> None:
        """Return the blocks no query at a position >= ``num_computed`` reads (tail
        first, like every release); their entries become -1. A hashed block stays
        cached-free, findable by the prefix cache until it is evicted."""
        num_out = self.window.num_out_of_window(num_computed)
        first = seq.num_freed_blocks
        if num_out <= first:
            return
        table = seq.block_table
        free = self.device.free
        for i in range(num_out - 1, first - 1, -1):
            free(table[i])
            table[i] = FREED
        seq.num_freed_blocks = num_out
        if first < seq.first_changed_block:
            seq.first_changed_block = first
        self.counters.num_window_freed_blocks += num_out - first

    # ---- preemption and swapping ----------------------------------------------
    def can_swap_out(self, seq: SequenceBlocks) -> bool:
        return (seq.location == SeqLocation.DEVICE
                and len(seq.block_table) - seq.num_freed_blocks <= self.host.num_free_blocks)

    def swap_out(self, seq: SequenceBlocks) -> None:
        """Move a running sequence's KV to the host pool."""
        if not self.can_swap_out(seq):
            raise NoFreeBlocksError(f"cannot swap out {seq.seq_id!r}")
        self._drop_proposed(seq)
        seq.host_table.extend([FREED] * seq.num_freed_blocks)
        for block in seq.block_table[seq.num_freed_blocks:]:
            block_hash = self.device.block_hashes[block]
            cached = None
            if block_hash is not None:
                cached = self.host.lookup(block_hash, self.device.block_tokens[block])
            if cached is not None:
                self.host.take_cached(cached)
                seq.host_table.append(cached)
                continue
            host_block = self.host.allocate()
            self.scratch.swap_out.append((block, host_block))
            if block_hash is not None:
                self.host.register(host_block, block_hash, self.device.block_tokens[block],
                                   self.device.block_parents[block], self.device.block_extra_keys[block])
            seq.host_table.append(host_block)
        num_freed = seq.num_freed_blocks
        self.counters.num_blocks_swapped_out += len(seq.host_table) - num_freed
        self._release_device(seq)
        seq.num_freed_blocks = num_freed  # the host table keeps the -1 entries
        seq.location = SeqLocation.SWAPPED
        seq.num_preemptions += 1
        self.counters.num_preemptions_swap += 1

    def preempt_recompute(self, seq: SequenceBlocks) -> None:
        """Drop a sequence's KV; it is recomputed (hashed blocks stay cached)."""
        self._drop_proposed(seq)
        self._release_device(seq)
        seq.num_computed = 0
        seq.num_indexed_blocks = 0
        seq.num_imported_tokens = 0
        seq.location = SeqLocation.WAITING
        seq.num_preemptions += 1
        self.counters.num_preemptions_recompute += 1

    def migrate_out(self, seq: SequenceBlocks) -> None:
        """Forget a sequence whose KV the worker sends to another worker.

        Its hashed blocks stay cached here; the copy happens before this
        step's forward pass can reuse them.
        """
        self._drop_proposed(seq)
        self._release_device(seq)
        del self.seqs[seq.seq_id]
        self.counters.num_preemptions_migrate += 1

    def can_swap_in(self, seq: SequenceBlocks, num_tokens: int) -> bool:
        """Room for the swapped blocks, the next tokens and the watermark."""
        if seq.location != SeqLocation.SWAPPED:
            return False
        num_total = max(len(seq.host_table), cdiv(seq.num_computed + num_tokens, self.block_size))
        if not self.policy.supports_sharing:
            return self.policy.can_grow(seq, num_total)
        num_needed = num_total - seq.num_freed_blocks
        return num_needed + self.watermark_blocks <= self.device.num_free_blocks

    def swap_in(self, seq: SequenceBlocks) -> None:
        """Bring a swapped sequence's KV back to the device."""
        if seq.location != SeqLocation.SWAPPED:
            raise KVManagerError(f"sequence {seq.seq_id!r} is not swapped out")
        if not self.policy.supports_sharing:
            self.policy.grow(seq, len(seq.host_table))
            self.scratch.swap_in.extend(zip(seq.host_table, seq.block_table))
        else:
            seq.block_table.extend([FREED] * seq.num_freed_blocks)
            for host_block in seq.host_table[seq.num_freed_blocks:]:
                block_hash = self.host.block_hashes[host_block]
                cached = None
                if block_hash is not None:
                    cached = self.device.lookup(block_hash, self.host.block_tokens[host_block])
                if cached is not None:
                    self.device.take_cached(cached)
                    seq.block_table.append(cached)
                    continue
                block = self.device.allocate()
                self.scratch.swap_in.append((host_block, block))
                if block_hash is not None:
                    self.device.register(block, block_hash, self.host.block_tokens[host_block],
                                         self.host.block_parents[host_block],
                                         self.host.block_extra_keys[host_block])
                seq.block_table.append(block)
        self.counters.num_blocks_swapped_in += len(seq.host_table) - seq.num_freed_blocks
        # Host blocks stay held until the step ends: their copies run later.
        self.scratch.host_blocks_to_release.extend(seq.host_table[seq.num_freed_blocks:])
        seq.host_table = []
        seq.location = SeqLocation.DEVICE
        seq.is_protected = True

    def _release_device(self, seq: SequenceBlocks) -> None:
        if seq.location == SeqLocation.DEVICE:
            self.policy.release(seq)

    def _offload_evicted(self, block: int, block_hash: BlockHash, tokens: tuple) -> None:
        """Keep an evicted device block in the host cache, if the host has room."""
        if self.host.lookup(block_hash, tokens) is not None or self.host.num_free_blocks == 0:
            return
        host_block = self.host.allocate()
        self.host.register(host_block, block_hash, tokens,
                           self.device.block_parents[block], self.device.block_extra_keys[block])
        self.host.free(host_block)  # cached-free: a second-level prefix cache
        self.scratch.swap_out.append((block, host_block))
        self.counters.num_blocks_offloaded += 1

    # ---- steps ----------------------------------------------------------------
    # ---- pages lent to other data ----------------------------------------------
    @property
    def num_pages(self) -> int:
        """Device blocks lent out as pages (``reserve_pages``)."""
        return sum(len(pages) for pages in self.pages.values())

    @property
    def max_lendable_pages(self) -> int:
        """Device blocks ``reserve_pages`` could take with no sequence and no pages lent: the
        pool less its admission watermark."""
        return self.device.num_blocks - self.watermark_blocks

    @property
    def num_lendable_pages(self) -> int:
        """Device blocks ``reserve_pages`` may take now: the free and cached-free ones above the
        admission watermark."""
        return max(0, self.device.num_free_blocks - self.watermark_blocks)

    def reserve_pages(self, owner: str, num_pages: int) -> list[int]:
        """Lend ``num_pages`` device blocks to ``owner`` (a LoRA adapter's weights: unified
        paging), or raise ``NoFreeBlocksError`` changing nothing. They count as used until
        ``release_pages``; the admission watermark stays free for running sequences. Cached
        blocks they take are dropped from the prefix cache, not offloaded: this runs between
        steps, whose copies alone reach the worker."""
        if owner in self.pages:
            raise ValueError(f"{owner!r} already holds pages")
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        available = self.num_lendable_pages
        if num_pages > available:
            raise NoFreeBlocksError(f"device pool has {available} blocks to lend, {num_pages} requested")
        on_evict, self.device.on_evict = self.device.on_evict, None
        try:
            pages = self.device.allocate_many(num_pages)
        finally:
            self.device.on_evict = on_evict
        self.pages[owner] = pages
        return pages

    def release_pages(self, owner: str) -> int:
        """Take back ``owner``'s pages (free blocks again); returns how many."""
        pages = self.pages.pop(owner)
        for block in pages:
            self.device.free(block)
        return len(pages)

    def begin_step(self) -> None:
        self.scratch = StepScratch()

    def end_step(self) -> StepScratch:
        """Release host blocks held for this step's copies; return the copies."""
        scratch = self.scratch
        for block in scratch.host_blocks_to_release:
            self.host.free(block)
        scratch.host_blocks_to_release = []
        self.scratch = StepScratch()
        return scratch

    # ---- introspection --------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise ``IntegrityError`` unless every invariant holds."""
        from .errors import IntegrityError

        device_refs: dict[int, int] = {}
        host_refs: dict[int, int] = {}
        for seq in self.seqs.values():
            if seq.location == SeqLocation.DEVICE:
                for block in self.policy.held_blocks(seq):
                    device_refs[block] = device_refs.get(block, 0) + 1
                if len(seq.block_table) * self.block_size < seq.num_computed:
                    raise IntegrityError(f"{seq.seq_id!r}: {seq.num_computed} computed tokens "
                                         f"but only {len(seq.block_table)} blocks")
                if seq.first_changed_block > len(seq.block_table):
                    raise IntegrityError(f"{seq.seq_id!r}: first changed block {seq.first_changed_block} "
                                         f"is past its {len(seq.block_table)} blocks")
            elif seq.block_table or seq.reserved:
                raise IntegrityError(f"{seq.seq_id!r} is {seq.location.value} but holds device blocks")
            elif seq.first_changed_block:
                raise IntegrityError(f"{seq.seq_id!r} holds no device blocks but records unchanged ones")
            if seq.location == SeqLocation.SWAPPED:
                for block in seq.host_table[seq.num_freed_blocks:]:
                    host_refs[block] = host_refs.get(block, 0) + 1
            elif seq.host_table:
                raise IntegrityError(f"{seq.seq_id!r} is {seq.location.value} but holds host blocks")
            if seq.location == SeqLocation.WAITING and seq.num_computed:
                raise IntegrityError(f"waiting {seq.seq_id!r} claims computed tokens")
            num_known = len(seq.token_ids) - seq.num_pending
            if (seq.num_pending < 0 or PENDING_TOKEN in seq.token_ids[:num_known]
                    or seq.token_ids[num_known:] != [PENDING_TOKEN] * seq.num_pending):
                raise IntegrityError(f"{seq.seq_id!r}: {seq.num_pending} pending tokens, not exactly its last")
            if len(seq.block_hashes) * self.block_size > num_known:
                raise IntegrityError(f"{seq.seq_id!r}: a block holding a pending token is hashed")
            if seq.num_speculative:
                if seq.num_speculative < 0 or seq.num_pending or seq.location != SeqLocation.DEVICE:
                    raise IntegrityError(f"{seq.seq_id!r}: {seq.num_speculative} proposed tokens, but "
                                         f"{seq.num_pending} pending and {seq.location.value}")
                if len(seq.block_hashes) * self.block_size > num_known - seq.num_speculative:
                    raise IntegrityError(f"{seq.seq_id!r}: a block holding a proposed token is hashed")
            # The sequence's own hash chain must describe its tokens.
            bs = self.block_size
            parent = None
            for i, block_hash in enumerate(seq.block_hashes):
                parent = hash_block(parent, seq.token_ids[i * bs:(i + 1) * bs], seq.extra_key)
                if parent != block_hash:
                    raise IntegrityError(f"{seq.seq_id!r}: hash chain broken at block {i}")
            self._check_freed_entries(seq)
            for i, block in enumerate(seq.block_table):
                if i < seq.num_freed_blocks:
                    continue
                indexed = self.device.block_hashes[block]
                if indexed is not None and (i >= len(seq.block_hashes) or indexed != seq.block_hashes[i]):
                    raise IntegrityError(f"{seq.seq_id!r}: block {block} is indexed under another prefix")
        for block in self.scratch.host_blocks_to_release:
            host_refs[block] = host_refs.get(block, 0) + 1
        for pages in self.pages.values():
            for block in pages:
                device_refs[block] = device_refs.get(block, 0) + 1
        self.device.check_integrity(device_refs)
        self.host.check_integrity(host_refs)
        num_stored, num_walked = self.num_stored_tokens(), self._num_stored_tokens_by_walk()
        if num_stored != num_walked:
            raise IntegrityError(f"device blocks store {num_walked} tokens (every table entry read), "
                                 f"but num_stored_tokens says {num_stored}")

    def _check_freed_entries(self, seq: SequenceBlocks) -> None:
        """-1 entries: exactly the leading ``num_freed_blocks``, all out of the window."""
        from .errors import IntegrityError

        table = seq.host_table if seq.location == SeqLocation.SWAPPED else seq.block_table
        num_freed = seq.num_freed_blocks
        if not num_freed:
            if FREED in table:
                raise IntegrityError(f"{seq.seq_id!r}: -1 entries but no freed blocks recorded")
            return
        if self.window is None:
            raise IntegrityError(f"{seq.seq_id!r}: {num_freed} blocks freed without a sliding window")
        if seq.location == SeqLocation.WAITING:
            raise IntegrityError(f"waiting {seq.seq_id!r} records freed blocks")
        if table[:num_freed] != [FREED] * num_freed or FREED in table[num_freed:]:
            raise IntegrityError(f"{seq.seq_id!r}: -1 entries are not exactly its first {num_freed}")
        if num_freed > self.window.num_out_of_window(seq.num_computed):
            raise IntegrityError(f"{seq.seq_id!r}: a freed block is still inside the window of "
                                 f"{seq.num_computed} computed tokens")

    def kv_utilization(self) -> float:
        """Tokens stored / token slots of the device blocks in use: a block shared by
        several tables counts once, a block in use outside every table (a contiguous
        reservation's unused part) counts as empty. O(device sequences): see
        ``num_stored_tokens``."""
        num_slots = (self.device.num_used_blocks - self.num_pages) * self.block_size
        return self.num_stored_tokens() / num_slots if num_slots else 0.0

    def num_stored_tokens(self) -> int:
        """Tokens held by the device blocks in use, each block counted once, at its
        fullest holder's fill. Costs O(device sequences), not O(their blocks).

        Every block in use is held by a sequence, and a block's ref count is the number
        of held entries naming it (``check_integrity``); they are table entries but for
        the policy's ``num_untabled_blocks``, which store nothing. Each sequence's held
        entries before its first non-full one are full blocks, so only the entries from
        there on are read (its partial last block; more only in a restored table longer
        than its tokens). Such a block stores its largest fill among those entries,
        unless a holder has it full: then its ref count exceeds the entries read.
        ``check_integrity`` compares this with the walk over every entry.
        """
        bs = self.block_size
        device = SeqLocation.DEVICE
        ref_counts = self.device.ref_counts
        num_empty = 0                 # empty slots of the unshared blocks read
        fills: dict[int, int] = {}    # a shared block read -> its largest fill among those entries
        repeats: dict[int, int] = {}  # a shared block read more than once -> how many times
        for seq in self.seqs.values():
            if seq.location is not device:
                continue
            computed = seq.num_computed
            i = computed // bs
            if i < seq.num_freed_blocks:
                i = seq.num_freed_blocks
            table = seq.block_table
            while i < len(table):
                block = table[i]
                filled = computed - i * bs
                if filled < 0:
                    filled = 0
                if ref_counts[block] == 1:
                    num_empty += bs - filled
                else:
                    largest = fills.get(block)
                    if largest is None:
                        fills[block] = filled
                    else:
                        repeats[block] = repeats.get(block, 1) + 1
                        if filled > largest:
                            fills[block] = filled
                i += 1
        for block, filled in fills.items():
            if ref_counts[block] == repeats.get(block, 1):  # no holder has it full
                num_empty += bs - filled
        num_tabled = (self.device.num_used_blocks - self.num_pages
                      - self.policy.num_untabled_blocks(self.seqs.values()))
        return num_tabled * bs - num_empty

    def _num_stored_tokens_by_walk(self) -> int:
        """``num_stored_tokens`` by reading every held table entry: the reference."""
        fill: dict[int, int] = {}
        bs = self.block_size
        for seq in self.seqs.values():
            if seq.location != SeqLocation.DEVICE:
                continue
            for i, block in enumerate(seq.block_table):
                if i < seq.num_freed_blocks:
                    continue
                filled = min(bs, seq.num_computed - i * bs)
                if filled > fill.get(block, 0):
                    fill[block] = filled
        return sum(fill.values())
