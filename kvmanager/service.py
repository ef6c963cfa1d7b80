"""The KV manager as a service: msgpack on the wire, one object for the cluster.

``pagedserve.cluster`` runs this class as the named, restartable Ray actor;
it has no Ray (or torch) import itself, so it stays testable in-process.
"""

from __future__ import annotations

import time
import uuid

import msgpack

from .kv_manager import KVManager, PoolConfig
from .step import StepInput, from_wire, to_wire


class KVManagerService:
    """Wire-level front of a ``KVManager`` shared by every worker of a cluster.

    A fresh ``incarnation`` id on every start lets workers notice a restart
    (the state is then empty) and re-register what they hold.
    """

    def __init__(self) -> None:
        self.manager = KVManager()
        self.incarnation = uuid.uuid4().hex
        self.num_steps = 0
        self.step_seconds = 0.0
        self.started_at = time.time()

    def get_incarnation(self) -> str:
        return self.incarnation

    def node_id(self) -> str | None:
        """The Ray node this service runs on; None when it runs in-process without Ray."""
        try:
            import ray
        except ImportError:
            return None
        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None

    def register_worker(self, worker_id: str, config: dict, sequences: list[dict] | None = None) -> str:
        """Add (or replace) a worker's accounting; returns the incarnation id."""
        self.manager.restore_worker(worker_id, PoolConfig(**config), sequences or [])
        return self.incarnation

    def remove_worker(self, worker_id: str) -> bool:
        if worker_id not in self.manager.workers:
            return False
        self.manager.remove_worker(worker_id)
        return True

    def worker_ids(self) -> list[str]:
        return list(self.manager.workers)

    def step(self, packed_input: bytes) -> bytes:
        """One worker's step: msgpack(StepInput wire dict) -> msgpack(StepOutput wire dict)."""
        start = time.perf_counter()
        step_input = from_wire(StepInput, msgpack.unpackb(packed_input))
        output = self.manager.step(step_input)
        packed = msgpack.packb(to_wire(output))
        self.step_seconds += time.perf_counter() - start
        self.num_steps += 1
        return packed

    def longest_prefix(self, token_ids: list[int], extra_key: str | None = None) -> dict[str, int]:
        return self.manager.longest_prefix(token_ids, extra_key)

    def stats(self) -> dict:
        return {
            "incarnation": self.incarnation,
            "num_steps": self.num_steps,
            "mean_step_ms": 1e3 * self.step_seconds / self.num_steps if self.num_steps else 0.0,
            "workers": {w: self.manager.stats(w) for w in self.manager.workers},
        }

    def block_map(self, worker_id: str, max_cells: int = 4096) -> dict:
        return self.manager.block_map(worker_id, max_cells)

    def block_maps(self, max_cells: int = 4096) -> dict[str, dict]:
        return {w: self.manager.block_map(w, max_cells) for w in self.manager.workers}

    def check_integrity(self) -> bool:
        self.manager.check_integrity()
        return True

    def num_used_blocks(self, worker_id: str | None = None) -> int:
        if worker_id is None:
            return self.manager.num_used_blocks()
        bm = self.manager.block_manager(worker_id)
        return bm.device.num_used_blocks + bm.host.num_used_blocks
