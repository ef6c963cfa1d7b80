"""The worker-local KV manager: one worker's pools, in the worker's own process.

It is the same ``KVManager`` (and ``BlockManager``) code the offline engine
uses, holding exactly one worker, so a steady-state step (allocation, growth,
copy-on-write, prefix hits, freeing) makes no remote call. Two things are
added for the cluster:

- an ``EventLog`` that the pools feed, so the central KV manager learns what
  changed (``drain_events``) and can be rebuilt from ``snapshot``;
- a preemption policy object (``preemption.RemotePreemptionPolicy`` in a
  cluster): when the worker cannot grow, one blocking call asks the central
  manager how to preempt that step's victims.
"""

from __future__ import annotations

import time
from dataclasses import asdict

from .errors import KVManagerError
from .events import EventLog, KVEventBatch, KVSnapshot, TierOccupancy
from .block_manager import BlockManager
from .hashing import block_hash_key
from .kv_manager import KVManager, PoolConfig
from .preemption import LocalPreemptionPolicy, PreemptionPolicy


def pool_occupancy(manager: BlockManager) -> dict[str, TierOccupancy]:
    """The constant-size occupancy summary of a block manager's two tiers. Another thread (a
    publisher's tick) may read it mid-step: then the counts are clamped, never negative.

    Device blocks lent as pages of LoRA adapters' weights count as cached-free: like a cached
    prefix, an idle adapter gives its pages back when sequences need them, so a pool full of
    adapters is not a full pool to the router."""
    out = {}
    for pool in (manager.device, manager.host):
        cached = pool.num_cached_free_blocks
        lent = manager.num_pages if pool is manager.device else 0
        out[pool.tier] = TierOccupancy(max(0, pool.num_used_blocks - lent), cached + lent,
                                       max(0, pool.num_free_blocks - cached), pool.num_blocks)
    return out


class LocalKVManager(KVManager):
    """A ``KVManager`` for exactly one worker, with an optional ``EventLog``.

    ``preemption`` defaults to ``LocalPreemptionPolicy`` (swap while the host
    has room, else recompute). With ``event_log``, every change to the set of
    cached block hashes on either tier is recorded there.
    """

    def __init__(self, preemption: PreemptionPolicy | None = None,
                 event_log: EventLog | None = None) -> None:
        super().__init__(preemption or LocalPreemptionPolicy())
        self.event_log = event_log
        self.worker_id: str | None = None

    def add_worker(self, worker_id: str, config: PoolConfig) -> None:
        if self.workers:
            raise KVManagerError(f"a LocalKVManager holds one worker; it holds {self.worker_id!r}")
        if self.event_log is not None and self.event_log.worker_id != worker_id:
            raise KVManagerError(f"the event log is for worker {self.event_log.worker_id!r}, "
                                 f"not {worker_id!r}")
        super().add_worker(worker_id, config)
        self.worker_id = worker_id

    def restore_worker(self, worker_id: str, config: PoolConfig, sequences: list[dict]) -> None:
        raise KVManagerError("a worker's local KV manager is the source of truth; it is never restored")

    def _new_block_manager(self, config: PoolConfig) -> BlockManager:
        manager = super()._new_block_manager(config)
        if self.event_log is not None:
            manager.device.listener = self.event_log
            manager.host.listener = self.event_log
        return manager

    @property
    def block_manager_of_worker(self) -> BlockManager:
        if self.worker_id is None:
            raise KVManagerError("no worker added yet")
        return self.workers[self.worker_id]

    # ---- what the central manager hears ----------------------------------------------
    def occupancy(self) -> dict[str, TierOccupancy]:
        return pool_occupancy(self.block_manager_of_worker)

    def drain_events(self) -> KVEventBatch:
        """The changes since the last drain, with the occupancy now (needs an event log)."""
        if self.event_log is None:
            raise KVManagerError("this LocalKVManager has no event log")
        batch = self.event_log.drain(self.occupancy())
        batch.is_draining = self.worker_id in self.draining
        return batch

    def snapshot(self) -> KVSnapshot:
        """Every cached hash per tier and the occupancy, at the event log's next seq.

        Undrained events are discarded: the snapshot already includes them.
        """
        if self.event_log is None:
            raise KVManagerError("this LocalKVManager has no event log")
        manager = self.block_manager_of_worker
        self.event_log.discard_pending()
        return KVSnapshot(
            self.worker_id, self.event_log.incarnation, self.event_log.next_seq,
            asdict(self.configs[self.worker_id]),
            {pool.tier: [block_hash_key(h) for h in pool.cached_hashes()] for pool in (manager.device, manager.host)},
            pool_occupancy(manager), time.time())
