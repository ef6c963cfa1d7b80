"""The cluster's worker set: which workers exist, their states, and elastic groups' sizes.

Runs inside the cluster controller (``controller.ClusterController``), one
per cluster. It adopts the workers ``bootstrap.start`` started (each group's
``count``, or ``autoscaling.min_replicas``); for an elastic group it then asks
a ``ScalingPolicy`` twice a second how many workers the load wants and acts:

- **Growing** creates worker actors with the group's resources. When no
  node has those resources, the actor waits and Ray's autoscaler adds a
  node for it (its pending resource demand is what the autoscaler reads);
  there is no node management here. The worker loads its model, registers
  with the KV manager and becomes ``ready`` once it answers ``info``;
  handles then route to it.
- **Shrinking** cancels starting workers first, then marks the chosen ready
  workers ``draining`` and calls ``Worker.drain``: handles stop routing to
  them and the KV manager migrates their running sequences to other
  workers. A drained worker goes once it has no request, no unfetched
  migration export and no block in use; then it leaves the KV manager's
  accounting and its actor is killed, so Ray's autoscaler can remove the
  idle node.

States: ``starting`` -> ``ready`` -> ``draining`` -> ``dead``; a ready
worker whose heartbeats fail or go unanswered is ``dead`` until one answers
again (Ray restarts it). A ready worker's load is what its last heartbeat
said; only a draining worker is asked its ``drain_status``. Handles read
``membership`` (versioned) to follow changes.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from pagedserve.workers.process.background_loop import BackgroundLoop

from .config import ClusterConfig, WorkerGroup
from .kv_relay import node_relay
from .placement import remove_worker_placement, worker_actor_options
from .scaling_policy import ScalingPolicy

logger = logging.getLogger("pagedserve.cluster")

STATES = ("starting", "ready", "draining", "dead")
CONTROL_INTERVAL_S = 0.5
# A draining worker stays at least this long, so that every handle has seen it
# leave the routing set before its actor goes.
DRAIN_GRACE_S = 2.0
# How long a worker that never became ready is taken out of the KV manager again, tick by
# tick: its constructor sends its first snapshot, which may land after the first removal.
LATE_SNAPSHOT_GRACE_S = 10.0
# An elastic group stops replacing workers that fail to start after this many in a row.
MAX_START_FAILURES = 3
START_FAILED = "could not start"


def group_engine_options(config: ClusterConfig, group: WorkerGroup):
    """The cluster's engine options with ``group``'s overrides (its ``tensor_parallel_size`` too)."""
    overrides = dict(group.engine)
    if group.tensor_parallel_size is not None:
        overrides["tensor_parallel_size"] = group.tensor_parallel_size
    if not overrides:
        return config.engine
    return type(config.engine).model_validate({**config.engine.model_dump(), **overrides})


def group_engine_config(config: ClusterConfig, group: WorkerGroup, model_path: str) -> dict:
    """The engine config (a plain dict) of a worker of ``group``: the cluster's engine
    options with the group's overrides; a worker of several ranks starts them as Ray actors
    in its placement group."""
    options = group_engine_options(config, group)
    if options.tensor_parallel_size > 1:
        options = type(options).model_validate({**options.model_dump(), "distributed_executor_backend": "ray"})
    return options.to_engine_config(model_path, trust_remote_code=config.model.trust_remote_code).model_dump()


def group_tensor_parallel_size(config: ClusterConfig, group: WorkerGroup) -> int:
    """Ranks per worker of ``group``."""
    return group_engine_options(config, group).tensor_parallel_size


def worker_actor_name(index: int) -> str:
    """The named actor of worker ``worker-<index>``."""
    return f"pagedserve-worker-{index}"


def actor_name_of(worker_id: str) -> str:
    """``worker-3`` -> its actor's name."""
    return worker_actor_name(int(worker_id.rsplit("-", 1)[1]))


@dataclass
class WorkerRecord:
    """One worker as the pool knows it. Plain data but for ``actor``."""

    worker_id: str
    group: int
    role: str
    state: str = "starting"
    actor: Any = None
    created_at: float = field(default_factory=time.time)
    state_since: float = field(default_factory=time.time)
    node_id: str | None = None
    reason: str | None = None              # why dead, or the last error
    num_ongoing: int = 0                   # requests on it at the last poll
    num_drain_migrations: int = 0          # sequences it handed over while draining
    is_drained: bool = False               # draining, and nothing left on it at the last poll
    is_gone: bool = False                  # drained, cancelled or failed to start: never back
    info: dict | None = None

    def public(self) -> dict:
        data = asdict(self)
        del data["actor"], data["info"]
        return data


class WorkerPool:
    """The worker set of one pagedserve cluster, with its control loop (a daemon thread).

    ``config`` is a ``ClusterConfig`` dump, ``model_path`` the head node's
    local copy (for engine configs), ``model_source`` what each worker
    resolves on its own node, ``kv_manager`` the central KV manager's handle (for the
    pool's own calls) and ``kv_manager_name`` its name in ``namespace`` (what new workers
    look up). ``workers`` are the ready workers ``start``
    brought up (id -> actor) and ``groups`` their group indices.
    ``on_ready(worker_id, actor, role)`` and ``on_gone(worker_id)`` tell the
    owner (the controller's heartbeat monitor) when workers join and leave;
    ``read_liveness()`` is that monitor's view (``health.WorkerHealth.snapshot``), from
    which the pool takes each ready worker's load and whether it answers.
    """

    def __init__(self, config: dict, model_path: str, model_source: dict, kv_manager, kv_manager_name: str,
                 namespace: str, workers: dict, groups: dict[str, int],
                 on_ready: Callable[[str, Any, str], None] = lambda *_: None,
                 on_gone: Callable[[str], None] = lambda _: None,
                 read_liveness: Callable[[], dict[str, dict]] = dict,
                 control_interval_s: float = CONTROL_INTERVAL_S) -> None:
        import ray

        from pagedserve.workers.actor.worker import Worker

        self.config = ClusterConfig.model_validate(config)
        self.model_path = model_path
        self.model_source = model_source
        self.kv_manager = kv_manager
        self.kv_manager_name = kv_manager_name
        self.namespace = namespace
        self.on_ready = on_ready
        self.on_gone = on_gone
        self.read_liveness = read_liveness
        self.control_interval_s = control_interval_s
        self.worker_cls = ray.remote(Worker)
        self.records: dict[str, WorkerRecord] = {}
        self.version = 0
        self.policies = {index: ScalingPolicy(group.autoscaling)
                         for index, group in enumerate(self.config.workers) if group.autoscaling}
        self.num_start_failures = {index: 0 for index in range(len(self.config.workers))}
        self.decisions: list[dict] = []
        self._info_refs: dict[str, Any] = {}
        self._status_refs: dict[str, Any] = {}   # draining worker -> its drain_status in flight
        self._kv_leaves_pending: set[str] = set()   # gone workers the KV manager still lists
        self._late_leaves: dict[str, float] = {}     # never-ready gone worker -> leave again until
        self._lock = threading.RLock()
        for worker_id, actor in workers.items():
            group = groups.get(worker_id, 0)
            self.records[worker_id] = WorkerRecord(worker_id, group, self.config.workers[group].role,
                                                   state="ready", actor=actor)
        self._next_index = len(workers)
        self._loop = BackgroundLoop("pagedserve-worker-pool", self.control_step, control_interval_s)
        self._loop.start()

    # ---- queries (what handles, bootstrap and status read) ---------------------------------
    def membership(self, known_version: int = -1) -> dict | None:
        """Workers that started and are not gone (ready, draining, or dead while Ray restarts
        them), with actor handles and states; None if nothing changed since ``known_version``."""
        with self._lock:
            if known_version == self.version:
                return None
            return {"version": self.version,
                    "workers": {w: {"actor": r.actor, "role": r.role, "state": r.state, "info": r.info}
                                for w, r in self.records.items() if r.state != "starting" and not r.is_gone}}

    def status(self) -> dict:
        """Every worker with its state (plain data), per-state counts and recent decisions."""
        with self._lock:
            workers = {w: r.public() for w, r in self.records.items()}
            counts = {state: sum(1 for r in self.records.values() if r.state == state) for state in STATES}
            return {"version": self.version, "workers": workers, "counts": counts,
                    "decisions": list(self.decisions[-20:])}

    # ---- the control loop (a ``BackgroundLoop`` tick) ------------------------------------
    def control_step(self) -> None:
        """Notice started workers, poll the others' load, scale elastic groups, retire drained ones."""
        self._collect_started()
        self._poll_load()
        now = time.monotonic()
        for index, policy in self.policies.items():
            with self._lock:
                mine = [r for r in self.records.values() if r.group == index]
                ongoing = {r.worker_id: r.num_ongoing for r in mine if r.state in ("ready", "draining")}
                starting = [r.worker_id for r in mine if r.state == "starting"]
                draining = [r.worker_id for r in mine if r.state == "draining"]
            decision = policy.tick(now, ongoing, starting, draining)
            if decision.is_noop:
                continue
            self._note_decision(index, decision)
            if self.num_start_failures[index] >= MAX_START_FAILURES and decision.num_to_start:
                logger.error("worker pool: group %d: %d workers failed to start in a row; not starting more",
                             index, self.num_start_failures[index])
            else:
                for _ in range(decision.num_to_start):
                    self._start_worker(index)
            for worker_id in decision.to_remove:
                self._remove(worker_id)
        self._retry_kv_leaves()
        self._retire_drained()

    def _note_decision(self, group: int, decision) -> None:
        entry = {"time": time.time(), "group": group, "num_current": decision.num_current,
                 "num_desired": decision.num_desired, "num_to_start": decision.num_to_start,
                 "to_remove": list(decision.to_remove)}
        logger.info("worker pool: group %d: %s", group, entry)
        with self._lock:
            self.decisions.append(entry)
            del self.decisions[:-100]

    def _start_worker(self, group_index: int) -> str:
        group = self.config.workers[group_index]
        engine_dict = group_engine_config(self.config, group, self.model_path)
        with self._lock:
            index = self._free_index()
            worker_id = f"worker-{index}"
            self._kv_leaves_pending.discard(worker_id)   # the id is taken again
            self._late_leaves.pop(worker_id, None)
            actor = self.worker_cls.options(**worker_actor_options(
                group, group_tensor_parallel_size(self.config, group), worker_actor_name(index), self.namespace),
            ).remote(worker_id, engine_dict, self.kv_manager_name, group.role, self.config.step_timeout_s,
                     model_source=self.model_source, kv_events=self.config.kv_events.model_dump(),
                     kv_relay=node_relay, namespace=self.namespace)
            self.records[worker_id] = WorkerRecord(worker_id, group_index, group.role, actor=actor)
            self._info_refs[worker_id] = actor.info.remote()
        logger.info("worker pool: starting %s (group %d)", worker_id, group_index)
        return worker_id

    def _free_index(self) -> int:
        """The next worker index whose actor name is free (a restarted controller may find
        workers it started before still running)."""
        import ray

        while True:
            index = self._next_index
            self._next_index += 1
            try:
                ray.get_actor(worker_actor_name(index), namespace=self.namespace)
            except ValueError:
                return index

    def _set_state(self, record: WorkerRecord, state: str, reason: str | None = None,
                   is_gone: bool = False) -> None:
        with self._lock:
            record.is_gone = record.is_gone or is_gone
            record.state = state
            record.state_since = time.time()
            if reason is not None:
                record.reason = reason
            self.version += 1

    def _collect_started(self) -> None:
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        with self._lock:
            pending = dict(self._info_refs)
        if not pending:
            return
        ready, _ = ray.wait(list(pending.values()), num_returns=len(pending), timeout=0)
        by_ref = {ref: w for w, ref in pending.items()}
        for ref in ready:
            worker_id = by_ref[ref]
            with self._lock:
                self._info_refs.pop(worker_id, None)
                record = self.records[worker_id]
            if record.state != "starting":
                continue  # cancelled meanwhile
            try:
                info = ray.get(ref)
            except (RayActorError, RayTaskError) as exc:
                self.num_start_failures[record.group] += 1
                self._set_state(record, "dead", f"{START_FAILED}: {_last_line(exc)}", is_gone=True)
                logger.error("worker pool: %s could not start: %s", worker_id, record.reason)
                self._leave_late(worker_id)
                continue
            self.num_start_failures[record.group] = 0
            with self._lock:
                record.info = info
                record.node_id = info.get("node_id")
            self._set_state(record, "ready")
            self.on_ready(worker_id, record.actor, record.role)
            logger.info("worker pool: %s ready on node %s", worker_id, record.node_id)

    def _poll_load(self) -> None:
        """Each worker's load and state: a ready (or dead) one's from the controller's heartbeats
        (``read_liveness``), at no call of its own; a draining one's from its ``drain_status``
        (sent last tick, the next sent now), which alone says what exports it still holds."""
        with self._lock:
            live = {w: r for w, r in self.records.items() if r.state != "starting" and not r.is_gone}
        liveness = self.read_liveness()
        draining = {}
        for worker_id, record in live.items():
            if record.state == "draining":
                draining[worker_id] = record
                continue
            beat = liveness.get(worker_id)
            if beat is None:
                continue  # not watched yet
            if not beat["is_answering"]:
                if record.state == "ready":
                    self._set_state(record, "dead", beat["failure_reason"])
                continue
            with self._lock:
                record.num_ongoing = beat["num_unfinished"]
            if record.state == "dead" and beat["is_alive"]:
                record.reason = None
                self._set_state(record, "ready")  # Ray restarted it
        self._poll_drain_status(draining)

    def _poll_drain_status(self, draining: dict[str, WorkerRecord]) -> None:
        import ray

        for worker_id in set(self._status_refs) - set(draining):
            del self._status_refs[worker_id]   # no longer draining: its answer is not needed
        probes = {w: self._status_refs[w] for w in draining if w in self._status_refs}
        done = set(ray.wait(list(probes.values()), num_returns=len(probes), timeout=0)[0]) if probes else set()
        for worker_id, record in draining.items():
            ref = probes.get(worker_id)
            if ref is not None:
                if ref not in done:
                    continue
                try:
                    status = ray.get(ref)
                except Exception:   # dead or restarting: asked again below
                    pass
                else:
                    with self._lock:
                        record.num_ongoing = status["num_unfinished"]
                        record.num_drain_migrations = status["num_drain_migrations"]
                        record.is_drained = (status["is_draining"] and status["num_unfinished"] == 0
                                             and status["num_held_exports"] == 0)
            self._status_refs[worker_id] = record.actor.drain_status.remote()

    def _remove(self, worker_id: str) -> None:
        """Cancel a starting worker, or start draining a ready one."""
        import ray

        with self._lock:
            record = self.records[worker_id]
        if record.state == "starting":
            with self._lock:
                self._info_refs.pop(worker_id, None)
            self._set_state(record, "dead", "cancelled while starting", is_gone=True)
            ray.kill(record.actor, no_restart=True)
            remove_worker_placement(actor_name_of(worker_id), self.namespace)
            self._leave_late(worker_id)
            logger.info("worker pool: cancelled %s", worker_id)
            return
        record.is_drained = False
        self._set_state(record, "draining")
        record.actor.drain.remote()
        logger.info("worker pool: draining %s (%d ongoing requests)", worker_id, record.num_ongoing)

    def _leave_kv_manager(self, worker_id: str) -> None:
        """Take a gone worker out of the central KV index; one that fails (a busy or
        restarting manager) is tried again on the next tick."""
        import ray

        try:
            ray.get(self.kv_manager.remove_worker.remote(worker_id), timeout=self.config.step_timeout_s)
            self._kv_leaves_pending.discard(worker_id)
        except Exception as exc:
            self._kv_leaves_pending.add(worker_id)
            logger.warning("worker pool: %s: could not leave the KV manager yet (%r)", worker_id, exc)

    def _leave_late(self, worker_id: str) -> None:
        """Take a worker that never became ready out of the KV manager, now and on every
        tick for ``LATE_SNAPSHOT_GRACE_S`` (its first snapshot may still be on its way)."""
        self._late_leaves[worker_id] = time.time() + LATE_SNAPSHOT_GRACE_S
        self._leave_kv_manager(worker_id)

    def _retry_kv_leaves(self) -> None:
        """Leaves that failed, and the late leaves of workers that never became ready."""
        for worker_id in list(self._kv_leaves_pending):
            self._leave_kv_manager(worker_id)
        now = time.time()
        for worker_id, until in list(self._late_leaves.items()):
            self._leave_kv_manager(worker_id)
            if now >= until:
                del self._late_leaves[worker_id]

    def _retire_drained(self) -> None:
        """Drained workers with nothing left leave the KV manager's accounting and go."""
        import ray

        with self._lock:
            done = [r for r in self.records.values() if r.state == "draining" and r.is_drained
                    and time.time() - r.state_since >= DRAIN_GRACE_S]
        for record in done:
            try:
                num_used = ray.get(record.actor.num_used_blocks.remote(), timeout=self.config.step_timeout_s)
            except Exception as exc:  # busy or restarting: look again next tick
                logger.warning("worker pool: %s did not say what it holds (%r)", record.worker_id, exc)
                continue
            if num_used:
                logger.warning("worker pool: %s drained but holds %d blocks; waiting", record.worker_id, num_used)
                continue
            ray.kill(record.actor, no_restart=True)
            remove_worker_placement(actor_name_of(record.worker_id), self.namespace)
            self._leave_kv_manager(record.worker_id)
            self._status_refs.pop(record.worker_id, None)
            self._set_state(record, "dead", "drained", is_gone=True)
            self.on_gone(record.worker_id)
            logger.info("worker pool: %s drained (%d sequences migrated) and stopped",
                        record.worker_id, record.num_drain_migrations)

    # ---- tests and tear-down ------------------------------------------------------------------
    def drain(self, worker_id: str) -> bool:
        """Drain one ready worker now (tests, maintenance); False if it is not ready."""
        with self._lock:
            record = self.records.get(worker_id)
            if record is None or record.state != "ready":
                return False
        self._remove(worker_id)
        return True

    def shutdown(self) -> None:
        """Stop the loop and every worker."""
        import ray

        self._loop.stop()
        with self._lock:
            records = list(self.records.values())
        for record in records:
            if not record.is_gone:
                try:
                    ray.kill(record.actor, no_restart=True)
                except Exception:
                    pass
                remove_worker_placement(actor_name_of(record.worker_id), self.namespace)


def _last_line(exc: Exception) -> str:
    import re

    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc))
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__
