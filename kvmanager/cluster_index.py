"""The central KV manager's view of the cluster, fed by the workers' KV events.

``ClusterIndex`` holds, per block-hash key, which workers cache it on which
tier; per worker its occupancy per tier and the seq of its next event. It is
soft state: every worker is the source of truth for its own pool, and the
index can always be rebuilt from their snapshots (``resync``). A batch that
does not follow the previous one (a gap, an unknown worker or incarnation)
is refused with "resync"; the index keeps the worker's old entries as hints
until the snapshot arrives. Hints may be stale: they steer routing, never
correctness.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import IntegrityError, UnknownWorkerError
from .events import (TIERS, AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, KVSnapshot,
                     TierOccupancy)
from .hashing import block_hash_key, hash_prefix_blocks

_TIER_BITS = {tier: 1 << i for i, tier in enumerate(TIERS)}


@dataclass(slots=True)
class WorkerView:
    """What the index knows of one worker."""

    worker_id: str
    pool_config: dict
    incarnation: str | None = None
    next_seq: int = 0
    needs_resync: bool = True
    occupancy: dict[str, TierOccupancy] = field(default_factory=dict)
    keys: dict[str, set[int]] = field(default_factory=lambda: {tier: set() for tier in TIERS})
    last_update_at: float = 0.0
    is_draining: bool = False

    @property
    def block_size(self) -> int:
        return int(self.pool_config.get("block_size", 16))


@dataclass(slots=True)
class ApplyResult:
    """``status``: "ok", "duplicate" (already applied) or "resync"; ``reason`` says why."""

    status: str
    expected_seq: int = 0
    reason: str = ""


class ClusterIndex:
    """Block-hash key -> {worker: tier bits}, occupancy and event seqs per worker."""

    def __init__(self) -> None:
        self.locations: dict[int, dict[str, int]] = {}
        self.workers: dict[str, WorkerView] = {}
        self.num_batches = 0
        self.num_events = 0
        self.num_resyncs = 0
        self.num_refused = 0

    # ---- membership -------------------------------------------------------------
    def register(self, worker_id: str, pool_config: dict) -> None:
        """Know of a worker (no entries yet: its first snapshot brings them)."""
        view = self.workers.get(worker_id)
        if view is None:
            self.workers[worker_id] = WorkerView(worker_id, dict(pool_config))
        else:
            view.pool_config = dict(pool_config)

    def remove_worker(self, worker_id: str) -> bool:
        """Forget a worker and everything it cached. False if it was unknown."""
        view = self.workers.pop(worker_id, None)
        if view is None:
            return False
        for tier, keys in view.keys.items():
            self._drop_keys(worker_id, tier, keys)
        return True

    # ---- feeding ----------------------------------------------------------------
    def apply(self, batch: KVEventBatch, now: float = 0.0) -> ApplyResult:
        """Apply one worker's batch in order, or say why a resync is needed."""
        view = self.workers.get(batch.worker_id)
        if view is None:
            return self._refuse(0, "unknown worker")
        if view.incarnation != batch.worker_incarnation:
            view.needs_resync = True
            return self._refuse(view.next_seq, "unknown incarnation")
        if view.needs_resync:
            return self._refuse(view.next_seq, "waiting for a snapshot")
        if batch.first_seq < view.next_seq:
            if batch.next_seq <= view.next_seq:
                return ApplyResult("duplicate", view.next_seq)  # sent before the last snapshot
            view.needs_resync = True
            return self._refuse(view.next_seq, f"overlap: expected seq {view.next_seq}, got {batch.first_seq}")
        if batch.first_seq > view.next_seq:
            view.needs_resync = True
            return self._refuse(view.next_seq, f"gap: expected seq {view.next_seq}, got {batch.first_seq}")
        worker_id = batch.worker_id
        for event in batch.events:
            if isinstance(event, BlockStored):
                bit = _TIER_BITS[event.medium]
                view.keys[event.medium].update(event.block_hashes)
                locations = self.locations
                for key in event.block_hashes:
                    holders = locations.get(key)
                    if holders is None:
                        locations[key] = {worker_id: bit}
                    else:
                        holders[worker_id] = holders.get(worker_id, 0) | bit
            elif isinstance(event, BlockRemoved):
                keys = view.keys[event.medium]
                keys.difference_update(event.block_hashes)
                self._drop_keys(worker_id, event.medium, event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                for tier in ([event.medium] if event.medium else TIERS):
                    self._drop_keys(worker_id, tier, view.keys[tier])
                    view.keys[tier] = set()
        view.next_seq = batch.next_seq
        if batch.occupancy:
            view.occupancy = dict(batch.occupancy)
        view.is_draining = batch.is_draining
        view.last_update_at = now
        self.num_batches += 1
        self.num_events += len(batch.events)
        return ApplyResult("ok", view.next_seq)

    def resync(self, snapshot: KVSnapshot, now: float = 0.0) -> ApplyResult:
        """Replace everything known of a worker by its snapshot (registers it if new)."""
        self.register(snapshot.worker_id, snapshot.pool_config)
        view = self.workers[snapshot.worker_id]
        for tier in TIERS:
            self._drop_keys(view.worker_id, tier, view.keys[tier])
            keys = set(snapshot.block_hashes.get(tier, ()))
            view.keys[tier] = keys
            bit = _TIER_BITS[tier]
            for key in keys:
                holders = self.locations.setdefault(key, {})
                holders[view.worker_id] = holders.get(view.worker_id, 0) | bit
        view.incarnation = snapshot.worker_incarnation
        view.next_seq = snapshot.next_seq
        view.occupancy = dict(snapshot.occupancy)
        view.needs_resync = False
        view.last_update_at = now
        self.num_resyncs += 1
        return ApplyResult("ok", view.next_seq)

    def _refuse(self, expected_seq: int, reason: str) -> ApplyResult:
        self.num_refused += 1
        return ApplyResult("resync", expected_seq, reason)

    def _drop_keys(self, worker_id: str, tier: str, keys) -> None:
        bit = _TIER_BITS[tier]
        locations = self.locations
        for key in keys:
            holders = locations.get(key)
            if holders is None:
                continue
            bits = holders.get(worker_id, 0) & ~bit
            if bits:
                holders[worker_id] = bits
            else:
                holders.pop(worker_id, None)
                if not holders:
                    del locations[key]

    # ---- queries ------------------------------------------------------------------
    def longest_prefix(self, token_ids: list[int], extra_key: str | None = None,
                       block_size: int | None = None) -> dict[str, int]:
        """Cached prefix length in tokens per worker (device or host tier; 0 if none).

        Uses the hash chain of ``hashing.hash_prefix_blocks`` over the blocks
        before the last token (whose logits are always computed). Only
        workers of ``block_size`` are considered when it is given.
        """
        result = {w: 0 for w, v in self.workers.items() if block_size in (None, v.block_size)}
        by_size: dict[int, list[str]] = {}
        for worker_id in result:
            by_size.setdefault(self.workers[worker_id].block_size, []).append(worker_id)
        for bs, worker_ids in by_size.items():
            num_blocks = (len(token_ids) - 1) // bs if token_ids else 0
            alive = set(worker_ids)
            num_matched = 0
            for block_hash in hash_prefix_blocks(token_ids, bs, extra_key, num_blocks):
                holders = self.locations.get(block_hash_key(block_hash))
                if not holders:
                    break
                still = {w for w in alive if w in holders}
                for worker_id in alive - still:
                    result[worker_id] = num_matched * bs
                alive = still
                if not alive:
                    break
                num_matched += 1
            for worker_id in alive:
                result[worker_id] = num_matched * bs
        return result

    def occupancy(self, worker_id: str) -> dict[str, TierOccupancy]:
        view = self.workers.get(worker_id)
        if view is None:
            raise UnknownWorkerError(f"unknown worker {worker_id!r}")
        return view.occupancy

    def num_cached_blocks(self, worker_id: str, tier: str = "device") -> int:
        return len(self.workers[worker_id].keys[tier])

    # ---- checks -------------------------------------------------------------------
    def check_integrity(self) -> None:
        """The location map and the per-worker key sets describe the same thing."""
        expected: dict[int, dict[str, int]] = {}
        for worker_id, view in self.workers.items():
            for tier, keys in view.keys.items():
                for key in keys:
                    holders = expected.setdefault(key, {})
                    holders[worker_id] = holders.get(worker_id, 0) | _TIER_BITS[tier]
        if expected != self.locations:
            wrong = [k for k in set(expected) | set(self.locations)
                     if expected.get(k) != self.locations.get(k)]
            raise IntegrityError(f"cluster index: {len(wrong)} keys disagree with the workers' key sets, "
                                 f"e.g. {wrong[:3]}")

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
                    raise IntegrityError(
                        f"worker {worker_id!r} {tier}: index has {len(have - want)} keys the pool lacks "
                        f"and lacks {len(want - have)} it caches")
                if view.occupancy.get(tier) != snapshot.occupancy.get(tier):
                    raise IntegrityError(f"worker {worker_id!r} {tier}: index occupancy "
                                         f"{view.occupancy.get(tier)} != pool {snapshot.occupancy.get(tier)}")
