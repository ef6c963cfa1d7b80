"""The central KV manager: the cluster's authority for what crosses workers.

``pagedserve.cluster`` runs ``KVManagerService`` as the named, restartable
Ray actor; it has no Ray (or torch) import at module level, so it stays
testable in-process. It is off every engine step's critical path:

- workers ``publish`` batches of KV events (fire and forget) and, when told
  to resync, a snapshot; the ``ClusterIndex`` answers prefix lookups
  (``longest_prefix``) and keeps per-worker occupancy;
- a worker that cannot grow asks ``decide_preemption`` once for that step's
  victims: migrate (to the worker with the most room), swap, or recompute;
- workers with LoRA ``report_adapters`` they hold (each report whole), and
  ``route_hints`` names a request's prefix per worker and its adapter's holders.

Its state is soft. A restarted service has a new ``incarnation`` and an empty
index; every worker's next publish is answered "resync", and the snapshots
rebuild it.
"""

from __future__ import annotations

import collections
import os
import time
import uuid
from dataclasses import asdict


from .cluster_index import ClusterIndex
from .errors import WireFormatError
from .events import AdapterReport, KVSnapshot, PublishAck, decode_batch, pack_ack
from .kv_manager import PoolConfig
from .preemption import MigrationTarget, PreemptionRequest, decide_preemption

# Room promised to a migration is held back from later decisions this long
# (until the target's own events show it).
MIGRATION_RESERVATION_S = 2.0
LAG_WINDOW = 8192


class KVManagerService:
    """Wire-level front of the cluster index and the preemption policy.

    Every method takes and returns plain data or msgpack bytes, and leaves
    the state unchanged when it refuses its input.
    """

    def __init__(self) -> None:
        self.index = ClusterIndex()
        # Per worker, the LoRA adapters it holds: (its incarnation, the report's version, adapter keys).
        self.worker_adapters: dict[str, tuple[str, int, frozenset[str]]] = {}
        self.incarnation = uuid.uuid4().hex[:16]
        self._incarnation_wire = self.incarnation.encode()   # the tail of every ack
        self.started_at = time.time()
        self._cpu_at_start = time.process_time()
        self.handler_cpu_s = 0.0
        self.num_publishes = 0
        self.num_snapshots = 0
        self.num_preemption_calls = 0
        self.bytes_in = 0
        self.bytes_out = 0
        self.preemptions_by_mode: collections.Counter[str] = collections.Counter()
        self._lags_s: collections.deque[float] = collections.deque(maxlen=LAG_WINDOW)
        self._deliveries_s: collections.deque[float] = collections.deque(maxlen=LAG_WINDOW)   # sent -> applied
        self._reservations: dict[str, list[tuple[int, float]]] = {}

    # ---- identity and membership ---------------------------------------------------
    def get_incarnation(self) -> str:
        return self.incarnation

    def node_id(self) -> str | None:
        """The Ray node this service runs on; None when it runs in-process without Ray."""
        try:
            import ray
        except ImportError:
            return None
        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None

    def register_worker(self, worker_id: str, config: dict) -> str:
        """Know of a worker and its ``PoolConfig`` (as a dict); returns the incarnation.

        Its entries arrive with its first snapshot (``resync``), which also
        registers it: workers need not call this.
        """
        PoolConfig(**config)  # refuse a malformed config before changing anything
        self.index.register(worker_id, config)
        return self.incarnation

    def remove_worker(self, worker_id: str) -> bool:
        """Forget a worker that left or died for good (a restarted one resyncs itself)."""
        self._reservations.pop(worker_id, None)
        self.worker_adapters.pop(worker_id, None)
        return self.index.remove_worker(worker_id)

    def worker_ids(self) -> list[str]:
        return list(self.index.workers)

    # ---- the event wire ---------------------------------------------------------------
    def publish(self, packed_batch: bytes) -> bytes:
        """Apply one worker's ``KVEventBatch``; returns a packed ``PublishAck``."""
        start = time.thread_time()   # as _timed, one call less per batch
        try:
            return self._publish(packed_batch, time.time())
        finally:
            self.handler_cpu_s += time.thread_time() - start

    def resync(self, packed_snapshot: bytes) -> bytes:
        """Replace a worker's entries by its ``KVSnapshot`` (registering it if new)."""
        return self._timed(self._resync, packed_snapshot)

    def report_adapters(self, packed_report: bytes) -> bytes:
        """Take a worker's ``AdapterReport``; returns a packed ``PublishAck`` ("ok")."""
        return self._timed(self._report_adapters, packed_report)

    def _timed(self, handler, payload: bytes) -> bytes:
        start = time.thread_time()
        try:
            return handler(payload, time.time())
        finally:
            self.handler_cpu_s += time.thread_time() - start

    def handle_events(self, messages: list[tuple[str, bytes]]) -> list[tuple[bool, bytes | None]]:
        """Apply a run of received messages in order, each ``("publish", packed batch)``,
        ``("quiet_publish", packed batch)`` or ``("resync", packed snapshot)``: per message
        ``(True, packed ack)``, ``(True, None)`` for a quiet publish that was applied (or was
        a duplicate: its sender counts it acknowledged by the next reply), or ``(False, error
        text)`` for refused input, which changes nothing (the worker then resyncs). One clock
        read for the run: the receiver calls this once per drain of its socket."""
        start = time.thread_time()
        now = time.time()
        replies: list[tuple[bool, bytes | None]] = []
        for method, payload in messages:
            try:
                if method == "publish" or method == "quiet_publish":
                    replies.append((True, self._publish(payload, now, method == "quiet_publish")))
                elif method == "resync":
                    replies.append((True, self._resync(payload, now)))
                elif method == "report_adapters":
                    replies.append((True, self._report_adapters(payload, now)))
                else:
                    raise WireFormatError(f"unknown KV event message kind {method!r}")
            except Exception as exc:  # refused input (or a bug): the worker resyncs
                replies.append((False, repr(exc).encode()))
        self.handler_cpu_s += time.thread_time() - start
        return replies

    def _publish(self, packed_batch: bytes, now: float, quiet: bool = False) -> bytes | None:
        batch = decode_batch(packed_batch)   # checked whole before it is applied
        result = self.index.apply(batch, now)
        if batch.events and result.status == "ok":
            self._lags_s.append(now - batch.oldest_event_at)
            self._deliveries_s.append(now - batch.created_at)
        self.num_publishes += 1
        self.bytes_in += len(packed_batch)
        if quiet and result.status != "resync":
            return None
        ack = pack_ack(result.status, result.expected_seq, self._incarnation_wire)
        self.bytes_out += len(ack)
        return ack

    def _report_adapters(self, packed_report: bytes, now: float) -> bytes:
        report = AdapterReport.unpack(packed_report)
        held = self.worker_adapters.get(report.worker_id)
        if held is None or held[0] != report.worker_incarnation or report.version > held[1]:
            self.worker_adapters[report.worker_id] = (report.worker_incarnation, report.version,
                                                      frozenset(report.adapter_keys))
        self.bytes_in += len(packed_report)
        return pack_ack("ok", 0, self._incarnation_wire)

    def _resync(self, packed_snapshot: bytes, now: float) -> bytes:
        snapshot = KVSnapshot.unpack(packed_snapshot, packed_keys=True)
        PoolConfig(**snapshot.pool_config)
        result = self.index.resync(snapshot, now)
        ack = PublishAck(result.status, self.incarnation, result.expected_seq).pack()
        self.num_snapshots += 1
        self.bytes_in += len(packed_snapshot)
        self.bytes_out += len(ack)
        return ack

    # ---- decisions ----------------------------------------------------------------------
    def decide_preemption(self, packed_request: bytes) -> bytes:
        """How to preempt a worker's candidates: a packed ``PreemptionDecision``."""
        start = time.thread_time()
        request = PreemptionRequest.unpack(packed_request)
        now = time.time()
        view = self.index.workers.get(request.worker_id)
        if view is not None and request.forced_mode == "migrate":
            view.is_draining = True  # until its next batch says otherwise
        decision = decide_preemption(request, self._migration_targets(now))
        likely = {c.seq_id: c.num_blocks for c in request.likely_victims}
        for choice in decision.choices:
            if choice.seq_id not in likely:
                continue  # decided in case the step needs it, probably never used
            self.preemptions_by_mode[choice.mode] += 1
            if choice.mode == "migrate":
                self._reservations.setdefault(choice.target_worker, []).append(
                    (likely[choice.seq_id] + 1, now + MIGRATION_RESERVATION_S))
        packed = decision.pack()
        self.num_preemption_calls += 1
        self.bytes_in += len(packed_request)
        self.bytes_out += len(packed)
        self.handler_cpu_s += time.thread_time() - start
        return packed

    def _migration_targets(self, now: float) -> list[MigrationTarget]:
        targets = []
        for worker_id, view in self.index.workers.items():
            config = view.pool_config
            device = view.occupancy.get("device")
            if view.needs_resync or view.is_draining or device is None or config.get("role") == "prefill":
                continue
            held = [(b, t) for b, t in self._reservations.get(worker_id, []) if t > now]
            self._reservations[worker_id] = held
            watermark = int(config.get("watermark", 0.0) * config.get("num_device_blocks", 0))
            free = device.num_available - watermark - sum(b for b, _ in held)
            targets.append(MigrationTarget(worker_id, free, view.block_size))
        return targets

    # ---- queries --------------------------------------------------------------------------
    def longest_prefix(self, token_ids: list[int], extra_key: str | None = None) -> dict[str, int]:
        """Cached prefix tokens per worker, from the index (hints: they may be stale)."""
        return self.index.longest_prefix(token_ids, extra_key)

    def route_hints(self, token_ids: list[int], extra_key: str | None, adapter_key: str
                    ) -> tuple[dict[str, int], list[str]]:
        """``longest_prefix``, and the workers whose last report holds adapter ``adapter_key``."""
        holders = sorted(w for w, (_, _, keys) in self.worker_adapters.items() if adapter_key in keys)
        return self.index.longest_prefix(token_ids, extra_key), holders

    def route_hints_many(self, queries: list[tuple[list[int], str | None, str | None]]
                         ) -> list[tuple[dict[str, int], list[str] | None]]:
        """``route_hints`` for each ``(token_ids, extra_key, adapter_key)`` of a handle's requests
        routed together; without an adapter, its holders are None (``longest_prefix``)."""
        return [(self.index.longest_prefix(token_ids, extra_key), None) if adapter_key is None
                else self.route_hints(token_ids, extra_key, adapter_key)
                for token_ids, extra_key, adapter_key in queries]

    def occupancy(self) -> dict[str, dict[str, dict]]:
        """Per worker and tier: used, cached-free, free and total blocks, as last published."""
        return {w: {tier: asdict(o) for tier, o in v.occupancy.items()} for w, v in self.index.workers.items()}

    def stats(self) -> dict:
        """Counters, CPU time and event lag of the service, plus per-worker pool figures.

        ``process_cpu_s`` is the whole process's CPU time since start (Ray's
        own threads included); ``handler_cpu_s`` only the time inside this
        service's wire methods. ``num_indexed_hashes`` counts (worker, tier,
        hash key) entries.
        """
        lags, deliveries = sorted(self._lags_s), sorted(self._deliveries_s)
        workers = {}
        for worker_id, view in self.index.workers.items():
            config = view.pool_config
            entry = {"worker_id": worker_id, "block_size": view.block_size,
                     "num_device_blocks": config.get("num_device_blocks", 0),
                     "num_host_blocks": config.get("num_host_blocks", 0), "role": config.get("role", "mixed"),
                     "is_draining": view.is_draining,
                     "needs_resync": view.needs_resync, "next_seq": view.next_seq,
                     "num_cached_device_hashes": len(view.keys["device"]),
                     "adapters": sorted(self.worker_adapters.get(worker_id, ("", 0, ()))[2]),
                     "num_cached_host_hashes": len(view.keys["host"])}
            for tier, o in view.occupancy.items():
                entry.update({f"num_{tier}_blocks": o.num_total, f"{tier}_blocks_used": o.num_used,
                              f"{tier}_blocks_cached": o.num_cached_free, f"{tier}_blocks_free": o.num_free})
            workers[worker_id] = entry
        return {
            "incarnation": self.incarnation,
            "pid": os.getpid(),
            "uptime_s": time.time() - self.started_at,
            "process_cpu_s": time.process_time() - self._cpu_at_start,
            "handler_cpu_s": self.handler_cpu_s,
            "num_publishes": self.num_publishes,
            "num_events": self.index.num_events,
            "num_snapshots": self.num_snapshots,
            "num_refused_batches": self.index.num_refused,
            "num_preemption_calls": self.num_preemption_calls,
            "preemptions_by_mode": dict(self.preemptions_by_mode),  # likely victims' decided modes
            "bytes_in": self.bytes_in,
            "bytes_out": self.bytes_out,
            "num_indexed_hashes": self.index.num_entries(),   # (worker, tier, hash) entries
            "event_lag_p50_ms": 1e3 * lags[len(lags) // 2] if lags else 0.0,
            "event_lag_p99_ms": 1e3 * lags[min(len(lags) - 1, int(0.99 * len(lags)))] if lags else 0.0,
            # Of it, from the batch's drain on the worker: the wire, the relay's and central's ticks.
            "event_delivery_p50_ms": 1e3 * deliveries[len(deliveries) // 2] if deliveries else 0.0,
            "event_delivery_p99_ms": (1e3 * deliveries[min(len(deliveries) - 1, int(0.99 * len(deliveries)))]
                                      if deliveries else 0.0),
            "workers": workers,
        }

    def reset_window(self) -> None:
        """Start a measurement window: zero the counters, CPU times and lag samples."""
        self._cpu_at_start = time.process_time()
        self.started_at = time.time()
        self.handler_cpu_s = 0.0
        self.num_publishes = self.num_snapshots = self.num_preemption_calls = 0
        self.bytes_in = self.bytes_out = 0
        self.preemptions_by_mode.clear()
        self._lags_s.clear()
        self._deliveries_s.clear()
        self.index.num_batches = self.index.num_events = self.index.num_resyncs = self.index.num_refused = 0

    def check_integrity(self) -> bool:
        """Raise ``IntegrityError`` unless the index is internally consistent."""
        self.index.check_integrity()
        return True

    def check_consistency(self, packed_snapshots: list[bytes], exact_workers: bool = True) -> bool:
        """Raise ``IntegrityError`` unless the index holds exactly what these workers'
        ``KVSnapshot``s say (take them after the workers flushed: ``Worker.kv_sync``)."""
        self.index.check_consistency_with([KVSnapshot.unpack(p) for p in packed_snapshots], exact_workers)
        return True
