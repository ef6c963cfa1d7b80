"""The cluster controller: one actor per cluster that watches the workers, and the view of
it that every ingress replica keeps.

Only the controller probes heartbeats and restarts stalled or hung workers
(``health.WorkerHealth`` runs in its process), so the number of ingress
replicas never multiplies the monitors that may kill a worker. It is a named,
restartable actor on the head node, started by ``bootstrap.start`` next to the
KV manager and owned by the same driver as the workers, so it lives and dies
with the cluster. Its state is soft: after a restart it rebuilds liveness from
the next heartbeats.

An ingress replica (anything holding a ``ClusterHandle``) keeps a ``HealthView``:
it reads the controller's ``HealthReport`` a few times a second and applies it to
its own router, and it reports request failures back. A failure a replica saw
keeps the worker out of that replica's rotation until the controller has had a
heartbeat answered after it. While the controller is unreachable a replica keeps
its last report (it never restarts anything itself).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Callable

from pagedserve.workers.process.background_loop import BackgroundLoop

from .health import WorkerHealth
from .router import Router
from .runtime_adapters import RuntimeAdapterRegistry
from .worker_pool import WorkerPool

logger = logging.getLogger("pagedserve.cluster")

CONTROLLER_NAME = "pagedserve-controller"
REPORT_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class HealthReport:
    """The controller's liveness judgement, as plain data for the ingress replicas."""

    alive_workers: frozenset[str]
    liveness: dict[str, dict]   # worker id -> ``health.WorkerLiveness`` fields
    controller_pid: int
    reported_at: float          # the controller's clock
    adapters_version: int = 0   # of the run-time LoRA adapters (``lora_adapters``)


class ClusterController:
    """One per cluster: the only process that probes worker heartbeats and restarts workers.

    Run as a Ray actor (``bootstrap.start``). Methods are the API that ingress
    replicas, ``pagedserve status`` and scaling logic use; every argument and
    result is plain data (worker actor handles aside).

    ``workers`` maps each worker id to its actor's name in ``namespace``; the
    controller looks them up (and the KV manager, ``pool["kv_manager_name"]``):
    actor handles as constructor arguments would live in the object store, and
    Ray could not restart the controller once they were lost.
    """

    def __init__(self, workers: dict[str, str], roles: dict[str, str], stall_timeout_s: float,
                 probe_interval_s: float = 0.25, pool: dict | None = None, namespace: str | None = None) -> None:
        import ray

        handles = {worker_id: ray.get_actor(name, namespace=namespace) for worker_id, name in workers.items()}
        self.roles = dict(roles)
        self.health = WorkerHealth(handles, None, stall_timeout_s, probe_interval_s)
        self.health.start()
        # The worker set and elastic groups' scaling (``worker_pool.WorkerPool``): ``pool`` holds
        # its arguments. Workers it adds or retires are watched or forgotten here.
        self.pool = None
        if pool is not None:
            kv_manager = ray.get_actor(pool["kv_manager_name"], namespace=namespace)
            self.pool = WorkerPool(**pool, kv_manager=kv_manager, namespace=namespace, workers=handles,
                                   on_ready=self.add_worker, on_gone=self.remove_worker,
                                   read_liveness=self.health.snapshot)
        self.adapters = RuntimeAdapterRegistry(namespace)

    def report(self) -> HealthReport:
        """Which workers are routable now, and what is known of each."""
        return HealthReport(frozenset(self.health.alive_workers()), self.health.snapshot(), os.getpid(),
                            time.time(), self.adapters.version)

    def note_failure(self, worker_id: str, reason: str) -> None:
        """A replica saw a request fail on ``worker_id``: unroutable until its next good heartbeat."""
        if worker_id in self.health.workers:
            self.health.note_failure(worker_id, reason)

    def add_worker(self, worker_id: str, worker, role: str) -> None:
        """Start watching a worker actor (an elastic group grew)."""
        self.roles[worker_id] = role
        self.health.add_worker(worker_id, worker)

    def remove_worker(self, worker_id: str) -> None:
        """Stop watching a worker (it was drained and is going away); never restarts it."""
        self.roles.pop(worker_id, None)
        self.health.remove_worker(worker_id)

    def workers(self) -> dict[str, str]:
        """Worker id -> role, for every worker watched."""
        return dict(self.roles)

    def ping(self) -> int:
        return os.getpid()

    # ---- the worker set (``worker_pool.WorkerPool``) ----------------------------------------
    def membership(self, known_version: int = -1) -> dict | None:
        """Workers that take or hold requests, with states; None if unchanged since ``known_version``."""
        return self.pool.membership(known_version) if self.pool else None

    def worker_states(self) -> dict:
        """Every worker (starting, ready, draining, dead) with its state; counts; recent scaling decisions."""
        return self.pool.status() if self.pool else {"workers": {}, "counts": {}, "decisions": []}

    def drain_worker(self, worker_id: str) -> bool:
        """Drain one ready worker now (tests, maintenance): its sequences migrate, then it goes."""
        return self.pool.drain(worker_id) if self.pool else False

    # ---- LoRA adapters loaded at run time (``runtime_adapters``) -------------------------------
    def lora_adapters(self) -> tuple[int, dict[str, tuple[int, str]]]:
        """(version, name -> (lora_int_id, path)) of the run-time adapters."""
        return self.adapters.snapshot()

    def load_lora(self, name: str, lora_int_id: int, path: str) -> tuple[int, dict] | None:
        """Register a run-time adapter: the new (version, adapters); None if ``name`` is taken."""
        return self.adapters.add(name, lora_int_id, path)

    def unload_lora(self, name: str) -> tuple[int, dict, int] | None:
        """Forget a run-time adapter: (version, adapters, its id); None if there is none by ``name``."""
        return self.adapters.remove(name)

    def shutdown(self) -> None:
        """Stop watching and stop every worker the pool started."""
        self.health.stop()
        if self.pool is not None:
            self.pool.shutdown()


class HealthView:
    """An ingress replica's copy of the controller's liveness, applied to its router.

    Offers what the handle asks of a monitor (``start``, ``stop``,
    ``alive_workers``, ``snapshot``, ``note_failure``, ``stall_timeout_s``) without
    probing or restarting anything itself.
    """

    def __init__(self, controller, workers: list[str], router: Router, stall_timeout_s: float,
                 poll_interval_s: float = 0.25, on_adapters: Callable[[int, dict], None] | None = None) -> None:
        self.controller = controller
        # Called with the run-time LoRA adapters (version, name -> (id, path)) when they changed.
        self.on_adapters = on_adapters
        self._adapters_version = 0
        self.router = router
        self.stall_timeout_s = stall_timeout_s
        self.poll_interval_s = poll_interval_s
        self._alive = set(workers)
        self._liveness: dict[str, dict] = {}
        self._noted: dict[str, float] = {}  # worker -> when this replica saw it fail (controller clock)
        self._clock_offset = 0.0            # controller clock minus ours, from the last report
        self._is_reachable = True
        self._lock = threading.Lock()
        self._loop = BackgroundLoop("pagedserve-health-view", self.refresh, poll_interval_s, tick_at_start=True)

    def start(self) -> None:
        """Read reports in a daemon thread (idempotent)."""
        self._loop.start()

    def stop(self) -> None:
        self._loop.stop()

    def refresh(self) -> None:
        """Read one report and apply it; keep the last one if the controller does not answer."""
        import ray

        try:
            report: HealthReport = ray.get(self.controller.report.remote(), timeout=REPORT_TIMEOUT_S)
        except Exception as exc:
            if self._is_reachable:
                logger.warning("cluster controller unreachable (%r); routing on its last report", exc)
            self._is_reachable = False
            return
        if not self._is_reachable:
            logger.info("cluster controller reachable again (pid %d)", report.controller_pid)
        self._is_reachable = True
        self.apply(report)
        if self.on_adapters is not None and report.adapters_version != self._adapters_version:
            try:
                version, adapters = ray.get(self.controller.lora_adapters.remote(), timeout=REPORT_TIMEOUT_S)
            except Exception as exc:
                logger.warning("could not read the run-time LoRA adapters from the controller: %r", exc)
                return
            self.on_adapters(version, adapters)
            self._adapters_version = version

    def apply(self, report: HealthReport) -> None:
        with self._lock:
            self._clock_offset = report.reported_at - time.time()
            for worker_id, noted_at in list(self._noted.items()):
                if report.liveness.get(worker_id, {}).get("last_beat", 0.0) > noted_at:
                    del self._noted[worker_id]  # answered after the failure this replica saw
            alive = set(report.alive_workers) - set(self._noted)
            changed = {w: w in alive for w in set(self._alive) | alive if (w in alive) != (w in self._alive)}
            self._alive = alive
            self._liveness = report.liveness
        for worker_id, is_alive in changed.items():
            self.router.mark_dead(worker_id, is_alive=is_alive)

    def note_failure(self, worker_id: str, reason: str = "request failed") -> None:
        """A request here saw the worker fail: out of this replica's rotation at once, and told
        to the controller (which alone decides about restarts)."""
        with self._lock:
            self._noted[worker_id] = time.time() + self._clock_offset
            self._alive.discard(worker_id)
        self.router.mark_dead(worker_id)
        try:
            self.controller.note_failure.remote(worker_id, reason)
        except Exception as exc:
            logger.warning("could not tell the cluster controller that %s failed: %r", worker_id, exc)

    def alive_workers(self) -> set[str]:
        with self._lock:
            return set(self._alive)

    def snapshot(self) -> dict:
        """The controller's per-worker liveness as of the last report."""
        with self._lock:
            return {w: dict(state) for w, state in self._liveness.items()}
