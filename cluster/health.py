"""Worker liveness: heartbeats, stall detection, restarts. One per cluster: it runs in the
cluster controller (``controller.ClusterController``), never in an ingress replica.

Every worker is probed with ``Worker.heartbeat`` about four times a second,
without blocking: a probe is sent, and its answer is read on a later poll.
A heartbeat also carries the worker's unfinished requests: the worker pool's
load figure (``worker_pool.WorkerPool``), so the pool asks nothing of a ready worker.
A worker is routable once it answers without being stalled. It stops being
routable at its first failure: an actor error (killed, node lost), a
heartbeat that says the engine is stalled (or its loop ended), or a
heartbeat left unanswered for the stall timeout. A stalled incarnation is
killed once with ``no_restart=False``, so Ray restarts it (on another node if
its node is gone), and it becomes routable again when its new incarnation
answers; that holds too when a request saw the worker fail first (a request
meets a failed engine loop before the next heartbeat does).
An unanswered heartbeat leads to a restart only while Ray reports the actor
ALIVE in the same process that last answered: one that is restarting (or
already runs a new incarnation) is left alone. If Ray's actor state cannot be
read at all, the monitor says so (a warning, ``state_unknown`` in its
snapshot) and restarts the worker anyway, once per incarnation that answered,
so a hung worker never stays hung because a query failed.
Requests on a killed worker fail with an actor error and resume elsewhere.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from pagedserve.workers.process.background_loop import BackgroundLoop

from . import ray_compat
from .router import Router

logger = logging.getLogger("pagedserve.cluster")


@dataclass
class WorkerLiveness:
    """What the monitor knows of one worker."""

    is_alive: bool = True
    pid: int | None = None
    actor_id: str | None = None      # from the heartbeat, for Ray's actor state
    last_beat: float = 0.0           # time of the last heartbeat answered
    is_answering: bool = True        # its last heartbeat came back (stalled or not), neither failed nor overdue
    num_unfinished: int = 0          # the worker's requests at its last heartbeat (the pool's load)
    last_failure: float | None = None
    failure_reason: str | None = None  # of the last failure
    num_failures: int = 0
    num_restarts_requested: int = 0  # kills sent because the worker stalled
    state_unknown: bool = False      # Ray's actor state could not be read at the last check
    blind_restart_pid: int | None = None  # the incarnation restarted without knowing its state
    restarted_pid: int | None = None     # the incarnation last killed to be restarted


class WorkerHealth:
    """Heartbeat monitor of a set of worker actors, feeding a router's liveness (if given)."""

    def __init__(self, workers: dict, router: Router | None, stall_timeout_s: float,
                 probe_interval_s: float = 0.25) -> None:
        self.workers = workers
        self.router = router
        self.stall_timeout_s = stall_timeout_s
        self.probe_interval_s = probe_interval_s
        self.liveness = {w: WorkerLiveness() for w in workers}
        self._probes: dict[str, tuple[object, float]] = {}
        self._last_sent: dict[str, float] = {}
        self._lock = threading.Lock()
        self._loop = BackgroundLoop("pagedserve-health", self.poll, probe_interval_s / 2)

    # ---- the background loop --------------------------------------------------------
    def start(self) -> None:
        """Poll in a daemon thread (idempotent)."""
        self._loop.start()

    def stop(self) -> None:
        self._loop.stop()

    # ---- probing ------------------------------------------------------------------------
    def poll(self) -> None:
        """Read answered probes, judge overdue ones, send new ones. Never blocks on a worker:
        one ``ray.wait`` for every probe in flight, so a poll costs little per worker."""
        import ray

        now = time.time()
        with self._lock:
            workers = list(self.workers.items())
            probes = {w: self._probes[w] for w, _ in workers if w in self._probes}
        answered = set()
        if probes:
            refs = [ref for ref, _ in probes.values()]
            answered, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            answered = set(answered)
        for worker_id, worker in workers:
            probe = probes.get(worker_id)
            if probe is None:
                if now - self._last_sent.get(worker_id, 0.0) >= self.probe_interval_s:
                    self._send_probe(worker_id, worker, now)
                continue
            ref, sent_at = probe
            if ref in answered:
                self._read_probe(worker_id, ref)
            elif now - sent_at > self.stall_timeout_s:
                self._drop_probe(worker_id, ref)
                self._note_answer(worker_id, None)
                self._fail(worker_id, "heartbeat unanswered", restart=self._is_hung(worker_id, worker))

    def _send_probe(self, worker_id: str, worker, now: float) -> None:
        with self._lock:
            self._probes[worker_id] = (worker.heartbeat.remote(), now)
            self._last_sent[worker_id] = now

    def _is_hung(self, worker_id: str, worker) -> bool:
        """Alive for Ray, and still the process that answered last: it hangs.

        When Ray's state cannot be read, an incarnation that answered before is
        taken as hung once (it may be restarting; a second blind restart waits
        until a new incarnation has answered, so a slow start is never killed in a loop).
        """
        with self._lock:
            liveness = self.liveness.get(worker_id)
            if liveness is None:
                return False  # removed meanwhile
            last_pid, actor_id = liveness.pid, liveness.actor_id
        if last_pid is None:
            return False  # never answered: still starting
        status = ray_compat.actor_status(actor_id) if actor_id else None
        with self._lock:
            liveness.state_unknown = status is None
            if status is None:
                is_hung = liveness.blind_restart_pid != last_pid
                if is_hung:
                    liveness.blind_restart_pid = last_pid
        if status is None:
            logger.warning("worker %s: Ray's actor state is unreadable (state API and GCS table); %s",
                           worker_id, "restarting it on its unanswered heartbeat" if is_hung
                           else "already restarted once without it; waiting for a new incarnation")
            return is_hung
        return status.state == "ALIVE" and status.pid is not None and status.pid == last_pid

    def _drop_probe(self, worker_id: str, ref) -> bool:
        with self._lock:
            probe = self._probes.get(worker_id)
            if probe is None or probe[0] is not ref:
                return False
            del self._probes[worker_id]
            return True

    def _read_probe(self, worker_id: str, ref) -> None:
        import ray

        if not self._drop_probe(worker_id, ref):
            return  # superseded by a failure noted meanwhile
        try:
            beat = ray.get(ref, timeout=0)
        except Exception as exc:
            self._note_answer(worker_id, None)
            self._fail(worker_id, f"heartbeat failed: {type(exc).__name__}", restart=False)
            return
        self._note_answer(worker_id, beat)
        if beat["is_stalled"]:
            self._fail(worker_id, f"stalled for {beat['seconds_since_progress']:.1f} s", restart=True,
                       pid=beat.get("pid"))
        else:
            self._revive(worker_id, beat)

    def _note_answer(self, worker_id: str, beat: dict | None) -> None:
        """A heartbeat came back (``beat``), or failed or was overdue (None)."""
        with self._lock:
            state = self.liveness.get(worker_id)
            if state is None:
                return  # removed meanwhile
            state.is_answering = beat is not None
            if beat is not None:
                state.num_unfinished = beat["num_unfinished"]

    # ---- the set of workers -------------------------------------------------------------
    def add_worker(self, worker_id: str, worker) -> None:
        """Watch one more worker (routable until its first failure, like the initial ones)."""
        with self._lock:
            self.workers[worker_id] = worker
            self.liveness.setdefault(worker_id, WorkerLiveness())

    def remove_worker(self, worker_id: str) -> None:
        """Stop watching a worker; a probe in flight is dropped unread."""
        with self._lock:
            self.workers.pop(worker_id, None)
            self.liveness.pop(worker_id, None)
            self._probes.pop(worker_id, None)
            self._last_sent.pop(worker_id, None)

    # ---- state changes -------------------------------------------------------------------
    def note_failure(self, worker_id: str, reason: str = "request failed") -> None:
        """A request saw the worker fail: not routable until its next good heartbeat."""
        with self._lock:
            self._probes.pop(worker_id, None)
        self._fail(worker_id, reason, restart=False)

    def _fail(self, worker_id: str, reason: str, restart: bool, pid: int | None = None) -> None:
        """Not routable; with ``restart``, kill the incarnation (``pid``, else the one that last
        answered) for Ray to restart, unless it was killed for that already."""
        import ray

        with self._lock:
            state = self.liveness.get(worker_id)
            if state is None:
                return  # removed meanwhile
            was_alive = state.is_alive
            state.is_alive = False
            state.last_failure = time.time()
            state.failure_reason = reason
            state.num_failures += was_alive
            incarnation = pid if pid is not None else state.pid
            should_restart = restart and (was_alive or (incarnation is not None
                                                        and incarnation != state.restarted_pid))
            if should_restart:
                state.restarted_pid = incarnation
            state.num_restarts_requested += should_restart
            worker = self.workers[worker_id]
        if self.router is not None:
            self.router.mark_dead(worker_id)
        if was_alive or should_restart:
            logger.warning("worker %s is down (%s)%s", worker_id, reason,
                           "; restarting it" if should_restart else "")
        if should_restart:
            try:
                ray.kill(worker, no_restart=False)
            except Exception as exc:
                logger.warning("could not restart worker %s: %r", worker_id, exc)

    def _revive(self, worker_id: str, beat: dict) -> None:
        with self._lock:
            state = self.liveness.get(worker_id)
            if state is None:
                return  # removed meanwhile
            was_alive = state.is_alive
            state.is_alive = True
            state.pid = beat.get("pid")
            state.actor_id = beat.get("actor_id") or state.actor_id
            state.last_beat = time.time()
        if self.router is not None:
            self.router.mark_dead(worker_id, is_alive=True)
        if not was_alive:
            logger.info("worker %s is back (pid %s)", worker_id, state.pid)

    # ---- queries -------------------------------------------------------------------------
    def alive_workers(self) -> set[str]:
        with self._lock:
            return {w for w, state in self.liveness.items() if state.is_alive}

    def snapshot(self) -> dict:
        with self._lock:
            return {w: dict(vars(state)) for w, state in self.liveness.items()}
