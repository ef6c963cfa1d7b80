"""The central KV manager's view of the cluster, fed by the workers' KV events.

``ClusterIndex`` holds, per worker, the set of block-hash keys it caches on
each tier (a ``keyset.KeySet``: 8-byte keys inline, no object per key), its
occupancy per tier and the seq of its next event. A batch is applied as
``events.decode_batch`` gives it, with one set operation per event, straight
from the wire's packed keys (``add_packed``, ``discard_packed``, ``clear``:
C speed per key, no int per key; occupancy is decoded only when read): no
Python work per key, no object per event, and only
per-worker structures are touched (a global key -> holders map would cost
~0.5 us per changed key in cache misses alone, measured at 32 workers).

``longest_prefix`` asks, per block of the prompt, which workers cache it.
Those answers are memoised (``_holders``: key -> one bit per worker), so a
popular prefix costs one dictionary lookup per block, and O(workers) only the
first time a key is asked about (the memo holds at most ``max_memoised_keys``);
applying a batch keeps the memo exact by looking its keys up in the memo (only
while the memo is not empty; C speed, Python work only for memoised keys that
changed). A resync or a removed worker clears the memo.

It is soft state: every worker is the source of truth for its own pool, and the
index can always be rebuilt from their snapshots (``resync``). A batch that
does not follow the previous one (a gap, an unknown worker or incarnation)
is refused with "resync"; the index keeps the worker's old entries as hints
until the snapshot arrives. Hints may be stale: they steer routing, never
correctness.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import IntegrityError, UnknownWorkerError
from .events import (ALL_TIERS, STORED, REMOVED, TIERS, KVEventBatch, KVSnapshot, PackedKeys, TierOccupancy,
                     WireBatch, decode_batch, occupancy_from_wire)
from .hashing import block_hash_key, hash_prefix_blocks
from .keyset import KeySet, keys_in


@dataclass(slots=True)
class WorkerView:
    """What the index knows of one worker."""

    worker_id: str
    pool_config: dict
    incarnation: str | None = None
    next_seq: int = 0
    needs_resync: bool = True
    # Per tier, or a batch's flat wire counts, decoded to ``TierOccupancy`` when first read.
    occupancy_source: dict[str, TierOccupancy] | tuple[int, ...] = field(default_factory=dict, repr=False)
    keys: dict[str, KeySet] = field(default_factory=lambda: {tier: KeySet() for tier in TIERS})
    last_update_at: float = 0.0
    is_draining: bool = False
    slot: int = 0    # its bit in the holders memo: 1 << slot

    @property
    def occupancy(self) -> dict[str, TierOccupancy]:
        """Per tier, as last published (empty until the first snapshot)."""
        source = self.occupancy_source
        if type(source) is tuple:
            source = self.occupancy_source = occupancy_from_wire(source)
        return source

    def caches(self, key: int) -> bool:
        """Whether any tier of this worker caches ``key``."""
        return any(key in keys for keys in self.keys.values())

    @property
    def block_size(self) -> int:
        return int(self.pool_config.get("block_size", 16))


@dataclass(slots=True)
class ApplyResult:
    """``status``: "ok", "duplicate" (already applied) or "resync"; ``reason`` says why."""

    status: str
    expected_seq: int = 0
    reason: str = ""


def _key_set(hashes: list[int] | PackedKeys) -> KeySet:
    if type(hashes) is PackedKeys:
        keys = KeySet()
        keys.add_packed(hashes.data)
        return keys
    return KeySet(hashes)


MAX_REMOVED_WORKERS = 4096   # removed workers remembered, so their late snapshots are refused


class ClusterIndex:
    """Per worker: cached block-hash keys per tier, occupancy and event seqs."""

    def __init__(self, max_memoised_keys: int = 1 << 16) -> None:
        self.workers: dict[str, WorkerView] = {}
        self.max_memoised_keys = max_memoised_keys
        self._holders: dict[int, int] = {}          # memo: key -> bits of the workers caching it
        self._slot_owners: list[str | None] = []    # slot -> worker id (None: free)
        self._removed: dict[str, str] = {}          # removed worker -> its incarnation then
        self.num_batches = 0
        self.num_events = 0
        self.num_resyncs = 0
        self.num_refused = 0

    # ---- membership -------------------------------------------------------------
    def register(self, worker_id: str, pool_config: dict) -> None:
        """Know of a worker (no entries yet: its first snapshot brings them)."""
        self._removed.pop(worker_id, None)
        view = self.workers.get(worker_id)
        if view is None:
            owners = self._slot_owners
            slot = owners.index(None) if None in owners else len(owners)
            if slot == len(owners):
                owners.append(None)
            owners[slot] = worker_id
            self.workers[worker_id] = WorkerView(worker_id, dict(pool_config), slot=slot)
        else:
            view.pool_config = dict(pool_config)

    def remove_worker(self, worker_id: str) -> bool:
        """Forget a worker and everything it cached. False if it was unknown."""
        view = self.workers.pop(worker_id, None)
        if view is None:
            return False
        # A message the worker sent before it went may still be queued: its snapshot
        # must not bring the worker back (a new incarnation of the id may).
        if view.incarnation is not None:
            self._removed[worker_id] = view.incarnation
        while len(self._removed) > MAX_REMOVED_WORKERS:
            del self._removed[next(iter(self._removed))]
        self._slot_owners[view.slot] = None
        self._holders.clear()
        return True

    # ---- feeding ----------------------------------------------------------------
    def apply(self, batch: WireBatch | KVEventBatch, now: float = 0.0) -> ApplyResult:
        """Apply one worker's batch (as ``events.decode_batch`` gives it; a ``KVEventBatch``
        is packed and decoded first) in order, or say why a resync is needed."""
        if type(batch) is not WireBatch:
            batch = decode_batch(batch.pack())
        view = self.workers.get(batch.worker_id)
        if view is None:
            return self._refuse(0, "unknown worker")
        if view.incarnation != batch.worker_incarnation:
            view.needs_resync = True
            return self._refuse(view.next_seq, "unknown incarnation")
        if view.needs_resync:
            return self._refuse(view.next_seq, "waiting for a snapshot")
        first_seq, events = batch.first_seq, batch.events
        next_seq = first_seq + len(events)
        if first_seq != view.next_seq:
            if first_seq < view.next_seq and next_seq <= view.next_seq:
                return ApplyResult("duplicate", view.next_seq)  # sent before the last snapshot
            view.needs_resync = True
            problem = "overlap" if first_seq < view.next_seq else "gap"
            return self._refuse(view.next_seq, f"{problem}: expected seq {view.next_seq}, got {first_seq}")
        keys, memo = view.keys, self._holders
        for kind, tier, packed in events:
            if kind == STORED:
                keys[TIERS[tier]].add_packed(packed)
                if memo:
                    self._memo_stored(view, keys_in(packed, memo))
            elif kind == REMOVED:
                keys[TIERS[tier]].discard_packed(packed)
                if memo:
                    self._memo_removed(view, keys_in(packed, memo))
            else:
                for name in (TIERS if tier == ALL_TIERS else (TIERS[tier],)):
                    touched = keys[name].intersection(memo) if memo else ()
                    keys[name].clear()
                    self._memo_removed(view, touched)
        view.next_seq = next_seq
        view.occupancy_source = batch.occupancy
        view.is_draining = batch.is_draining
        view.last_update_at = now
        self.num_batches += 1
        self.num_events += len(events)
        return ApplyResult("ok", next_seq)

    def resync(self, snapshot: KVSnapshot, now: float = 0.0) -> ApplyResult:
        """Replace everything known of a worker by its snapshot (registers it if new,
        unless this incarnation of it was removed)."""
        if self._removed.get(snapshot.worker_id) == snapshot.worker_incarnation:
            return self._refuse(0, "removed worker")
        self.register(snapshot.worker_id, snapshot.pool_config)
        view = self.workers[snapshot.worker_id]
        view.keys = {tier: _key_set(snapshot.block_hashes.get(tier, ())) for tier in TIERS}
        self._holders.clear()
        view.incarnation = snapshot.worker_incarnation
        view.next_seq = snapshot.next_seq
        view.occupancy_source = dict(snapshot.occupancy)
        view.needs_resync = False
        view.last_update_at = now
        self.num_resyncs += 1
        return ApplyResult("ok", view.next_seq)

    def _refuse(self, expected_seq: int, reason: str) -> ApplyResult:
        self.num_refused += 1
        return ApplyResult("resync", expected_seq, reason)

    def _memo_stored(self, view: WorkerView, memoised: set[int]) -> None:
        bit = 1 << view.slot
        for key in memoised:
            self._holders[key] |= bit

    def _memo_removed(self, view: WorkerView, memoised) -> None:
        """``memoised``: keys the worker dropped from one tier (it may hold them on another)."""
        keep = ~(1 << view.slot)
        for key in memoised:
            if not view.caches(key):
                self._holders[key] &= keep

    def _memoise(self, keys: list[int]) -> dict[int, int]:
        """The memo, holding (at least) ``keys``: a key not memoised yet costs, per worker
        and tier, a C-speed set intersection, then Python work per worker caching it."""
        memo = self._holders
        if len(memo) + len(keys) > self.max_memoised_keys:
            memo.clear()
        missing = set(keys).difference(memo)
        if missing:
            found = dict.fromkeys(missing, 0)
            for view in self.workers.values():
                bit = 1 << view.slot
                for tier_keys in view.keys.values():
                    if tier_keys:
                        for key in tier_keys.intersection(missing):
                            found[key] |= bit
            memo.update(found)
        return memo

    # ---- queries ------------------------------------------------------------------
    def longest_prefix(self, token_ids: list[int], extra_key: str | None = None,
                       block_size: int | None = None) -> dict[str, int]:
        """Cached prefix length in tokens per worker (device or host tier; 0 if none).

        Uses the hash chain of ``hashing.hash_prefix_blocks`` over the blocks
        before the last token (whose logits are always computed). Only
        workers of ``block_size`` are considered when it is given. Costs the
        prompt's hashing, a dictionary lookup and a few integer operations per
        matched block, and a little per worker; blocks not asked about since
        the memo was last cleared cost one set lookup per worker and tier (C
        speed) plus a little per worker caching them.
        """
        result: dict[str, int] = {}
        by_size: dict[int, int] = {}   # block size -> bits of its workers
        for worker_id, view in self.workers.items():
            bs = view.block_size
            if block_size in (None, bs):
                result[worker_id] = 0
                by_size[bs] = by_size.get(bs, 0) | 1 << view.slot
        for bs, alive in by_size.items():
            num_blocks = (len(token_ids) - 1) // bs if token_ids else 0
            chain = [block_hash_key(h) for h in hash_prefix_blocks(token_ids, bs, extra_key, num_blocks)]
            num_matched, chunk = 0, 16
            while alive and num_matched < len(chain):   # memoise in doubling chunks, not far past the match
                part = chain[num_matched:num_matched + chunk]
                memo = self._memoise(part)
                for key in part:
                    still = alive & memo[key]
                    if still != alive:
                        self._set_lengths(result, alive & ~still, num_matched * bs)
                        alive = still
                        if not alive:
                            break
                    num_matched += 1
                chunk *= 2
            self._set_lengths(result, alive, num_matched * bs)
        return result

    def _set_lengths(self, result: dict[str, int], slots: int, num_tokens: int) -> None:
        """``result[worker] = num_tokens`` for each worker whose bit is set in ``slots``."""
        while slots:
            low = slots & -slots
            result[self._slot_owners[low.bit_length() - 1]] = num_tokens
            slots ^= low

    def occupancy(self, worker_id: str) -> dict[str, TierOccupancy]:
        view = self.workers.get(worker_id)
        if view is None:
            raise UnknownWorkerError(f"unknown worker {worker_id!r}")
        return view.occupancy

    def num_cached_blocks(self, worker_id: str, tier: str = "device") -> int:
        return len(self.workers[worker_id].keys[tier])

    def num_entries(self) -> int:
        """Cached (worker, tier, hash key) entries, all workers together."""
        return sum(len(keys) for view in self.workers.values() for keys in view.keys.values())

    # ---- checks -------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Each worker's view is well formed (one key set per tier, never more cached keys
        on a tier than its pool has blocks: each cached hash holds a block, its own slot),
        and every memoised answer equals the workers' key sets'."""
        for worker_id, view in self.workers.items():
            if set(view.keys) != set(TIERS) or not all(type(k) is KeySet for k in view.keys.values()):
                raise IntegrityError(f"cluster index: worker {worker_id!r} has key sets "
                                     f"{ {t: type(k).__name__ for t, k in view.keys.items()} }")
            if view.next_seq < 0:
                raise IntegrityError(f"cluster index: worker {worker_id!r} at seq {view.next_seq}")
            for tier, occupancy in view.occupancy.items():
                if len(view.keys.get(tier, ())) > occupancy.num_total:
                    raise IntegrityError(f"cluster index: worker {worker_id!r} caches {len(view.keys[tier])} "
                                         f"keys on {tier}, which has {occupancy.num_total} blocks")
            if self._slot_owners[view.slot] != worker_id:
                raise IntegrityError(f"cluster index: worker {worker_id!r}'s slot {view.slot} is "
                                     f"{self._slot_owners[view.slot]!r}'s")
        wrong = [key for key, bits in self._holders.items()
                 if bits != sum(1 << v.slot for v in self.workers.values() if v.caches(key))]
        if wrong:
            raise IntegrityError(f"cluster index: {len(wrong)} memoised keys' holders disagree with the "
                                 f"workers' key sets, e.g. {wrong[:3]}")

    def check_consistency_with(self, snapshots: list[KVSnapshot], exact_workers: bool = True) -> None:
        """Raise ``IntegrityError`` unless the index holds exactly what the workers'
        snapshots say (keys per tier, occupancy, next seq). With ``exact_workers``
        the index must know no other workers."""
        self.check_integrity()
        by_id = {s.worker_id: s for s in snapshots}
        if exact_workers and set(by_id) != set(self.workers):
            raise IntegrityError(f"cluster index knows workers {sorted(self.workers)}, "
                                 f"the snapshots are of {sorted(by_id)}")
        for worker_id, snapshot in by_id.items():
            view = self.workers.get(worker_id)
            if view is None:
                raise IntegrityError(f"cluster index does not know worker {worker_id!r}")
            if view.needs_resync:
                raise IntegrityError(f"worker {worker_id!r} is waiting for a resync")
            if view.incarnation != snapshot.worker_incarnation or view.next_seq != snapshot.next_seq:
                raise IntegrityError(f"worker {worker_id!r}: index at {view.incarnation}/{view.next_seq}, "
                                     f"worker at {snapshot.worker_incarnation}/{snapshot.next_seq}")
            for tier in TIERS:
                have, want = view.keys[tier], set(snapshot.block_hashes.get(tier, ()))
                if have != want:
                    have = have.to_set()
                    raise IntegrityError(
                        f"worker {worker_id!r} {tier}: index has {len(have - want)} keys the pool lacks "
                        f"and lacks {len(want - have)} it caches")
                if view.occupancy.get(tier) != snapshot.occupancy.get(tier):
                    raise IntegrityError(f"worker {worker_id!r} {tier}: index occupancy "
                                         f"{view.occupancy.get(tier)} != pool {snapshot.occupancy.get(tier)}")

