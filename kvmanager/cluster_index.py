"""The central KV manager's view of the cluster, fed by the workers' KV events.

``ClusterIndex`` holds, per worker, the set of block-hash keys it caches on
each tier, its occupancy per tier and the seq of its next event. A batch is
applied with one set operation per event (``update``, ``difference_update``,
``clear``: C speed per key), so the central CPU per batch grows with the keys
that changed at a few ns each, never with Python work per key. Queries walk
the workers instead: ``longest_prefix`` costs a few Python operations per
worker plus one C-speed set lookup per matched block. It is soft state: every worker is the source of truth for its own pool, and the
index can always be rebuilt from their snapshots (``resync``). A batch that
does not follow the previous one (a gap, an unknown worker or incarnation)
is refused with "resync"; the index keeps the worker's old entries as hints
until the snapshot arrives. Hints may be stale: they steer routing, never
correctness.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import islice, takewhile

from .errors import IntegrityError, UnknownWorkerError
from .events import (TIERS, AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, KVSnapshot,
                     TierOccupancy)
from .hashing import block_hash_key, hash_prefix_blocks


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
    """Per worker: cached block-hash keys per tier, occupancy and event seqs."""

    def __init__(self) -> None:
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
        return self.workers.pop(worker_id, None) is not None

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
        keys = view.keys
        for event in batch.events:
            if type(event) is BlockStored:
                keys[event.medium].update(event.block_hashes)
            elif type(event) is BlockRemoved:
                keys[event.medium].difference_update(event.block_hashes)
            elif type(event) is AllBlocksCleared:
                for tier in ([event.medium] if event.medium else TIERS):
                    keys[tier].clear()
            else:  # never from a decoded batch; the partial apply is dropped by a resync
                view.needs_resync = True
                raise TypeError(f"not a KV event: {event!r}")
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
        view.keys = {tier: set(snapshot.block_hashes.get(tier, ())) for tier in TIERS}
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

    # ---- queries ------------------------------------------------------------------
    def longest_prefix(self, token_ids: list[int], extra_key: str | None = None,
                       block_size: int | None = None) -> dict[str, int]:
        """Cached prefix length in tokens per worker (device or host tier; 0 if none).

        Uses the hash chain of ``hashing.hash_prefix_blocks`` over the blocks
        before the last token (whose logits are always computed). Only
        workers of ``block_size`` are considered when it is given. Costs the
        prompt's hashing, then per worker a few Python operations plus one
        C-speed set lookup per block of its match.
        """
        result: dict[str, int] = {}
        chains: dict[int, list[int]] = {}   # block size -> the prompt's keys
        for worker_id, view in self.workers.items():
            bs = view.block_size
            if block_size not in (None, bs):
                continue
            chain = chains.get(bs)
            if chain is None:
                num_blocks = (len(token_ids) - 1) // bs if token_ids else 0
                chain = chains[bs] = [block_hash_key(h)
                                      for h in hash_prefix_blocks(token_ids, bs, extra_key, num_blocks)]
            result[worker_id] = _num_leading_cached(chain, [k for k in view.keys.values() if k]) * bs
        return result

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
        """Each worker's view is well formed: one key set per tier, never more cached
        keys on a tier than its pool has blocks (each cached hash holds a block)."""
        for worker_id, view in self.workers.items():
            if set(view.keys) != set(TIERS) or not all(type(k) is set for k in view.keys.values()):
                raise IntegrityError(f"cluster index: worker {worker_id!r} has key sets "
                                     f"{ {t: type(k).__name__ for t, k in view.keys.items()} }")
            if view.next_seq < 0:
                raise IntegrityError(f"cluster index: worker {worker_id!r} at seq {view.next_seq}")
            for tier, occupancy in view.occupancy.items():
                if len(view.keys.get(tier, ())) > occupancy.num_total:
                    raise IntegrityError(f"cluster index: worker {worker_id!r} caches {len(view.keys[tier])} "
                                         f"keys on {tier}, which has {occupancy.num_total} blocks")

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


def _num_leading_cached(chain: list[int], tiers: list[set[int]]) -> int:
    """How many of ``chain``'s keys, from the first, are each in one of ``tiers``."""
    num_matched = 0
    while num_matched < len(chain):
        start = num_matched
        for keys in tiers:
            if num_matched < len(chain) and chain[num_matched] in keys:
                num_matched += len(list(takewhile(keys.__contains__, islice(chain, num_matched, None))))
        if num_matched == start:
            break
    return num_matched
