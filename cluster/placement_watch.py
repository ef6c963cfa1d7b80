"""Workers that wait for resources while a cluster starts: say which, and stop a hopeless wait.

``bootstrap.start`` calls ``PlacementWatch.check`` while it waits for its workers. A worker
whose resources Ray has not granted (its placement group pending, or a lease of its shape
waiting) is named on the log within ``GRACE_S``, with its group's ask and what each node has
free, and again every ``REMIND_S`` or when what it waits for changes. A worker that waits for
Ray's autoscaler (no node has its resources free) is named at once. Then:

- when Ray's autoscaler can add nodes, or has not said yet whether it can, the wait goes on
  (``worker_ready_timeout_s`` bounds it);
- when no node could ever hold the worker (their totals) and no autoscaler can add one, or on a
  private Ray (this machine alone, the rest of it held by this server's own actors), the start
  stops at once with ``PlacementError``;
- otherwise (a fixed cluster busy with other work) it stops after ``placement_timeout_s``.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Callable

from . import ray_compat
from .capacity import WorkerAsk, describe_free, fits

logger = logging.getLogger("pagedserve.cluster")

GRACE_S = 3.0     # a worker's lease or placement group is granted well within this when resources are free
REMIND_S = 30.0   # how often a wait that goes on is named again


class PlacementError(RuntimeError):
    """Workers that cannot be placed: the message names the group, its ask and what is free."""


@dataclass(frozen=True)
class PendingWorker:
    """A worker that is not ready yet: its group's ask, and its placement group's id (hex) when
    it has several ranks."""

    worker_id: str
    ask: WorkerAsk
    placement_group_id: str | None = None


def _same_shape(a: dict, b: dict) -> bool:
    names = {name for name, amount in {**a, **b}.items() if amount}
    return all(math.isclose(a.get(name, 0.0), b.get(name, 0.0), abs_tol=1e-6) for name in names)


def unplaced(waiting: list[PendingWorker], state: ray_compat.ResourceState) -> list[PendingWorker]:
    """The ``waiting`` workers whose resources Ray has not granted: a worker of several ranks
    whose placement group is pending; a worker of one rank while a lease of its shape waits
    (as many as wait, in order)."""
    found = [worker for worker in waiting
             if worker.placement_group_id and worker.placement_group_id in state.pending_placement_groups]
    leases = [[dict(bundle), count] for bundle, count in state.waiting_bundles]
    for worker in waiting:
        if worker.placement_group_id:
            continue
        for lease in leases:
            if lease[1] > 0 and _same_shape(lease[0], worker.ask.bundle):
                lease[1] -= 1
                found.append(worker)
                break
    return found


class PlacementWatch:
    """Follows the workers ``start`` waits for (worker id -> ``PendingWorker``); see the module
    docstring. ``is_private_ray``: the cluster is a private Ray this server started."""

    def __init__(self, workers: dict[str, PendingWorker], placement_timeout_s: float, ready_timeout_s: float,
                 is_private_ray: bool, notify: Callable[[str], None] = logger.warning,
                 resource_state: Callable[[], ray_compat.ResourceState] = ray_compat.resource_state,
                 autoscaler_adds_nodes: Callable[[], bool | None] = ray_compat.autoscaler_adds_nodes,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.workers = workers
        self.placement_timeout_s = placement_timeout_s
        self.ready_timeout_s = ready_timeout_s
        self.is_private_ray = is_private_ray
        self.notify = notify
        self.resource_state = resource_state
        self.autoscaler_adds_nodes = autoscaler_adds_nodes
        self.clock = clock
        self.started_at = clock()
        self._can_autoscale: bool | None = False if is_private_ray else None
        self._unplaced_since: dict[int, float] = {}   # group -> when its workers were first seen unplaced
        self._noted: dict[int, tuple[float, str]] = {}  # group -> when it was last named, and the verdict

    def check(self, waiting: set[str]) -> None:
        """Look at the workers (ids) still not ready; name the groups whose workers Ray has not
        placed, and raise ``PlacementError`` where waiting is hopeless."""
        now = self.clock()
        in_grace = now - self.started_at < GRACE_S
        if not waiting or (in_grace and self._can_autoscale is False):
            return
        try:
            state = self.resource_state()
        except Exception as exc:  # the GCS is busy: look again at the next check
            logger.debug("placement watch: no resource state: %r", exc)
            return
        groups: dict[int, list[PendingWorker]] = {}
        for worker in unplaced([self.workers[w] for w in sorted(waiting) if w in self.workers], state):
            groups.setdefault(worker.ask.group, []).append(worker)
        for group in list(self._unplaced_since):
            if group not in groups:
                del self._unplaced_since[group]
                self._noted.pop(group, None)
        if not groups:
            return
        if self._can_autoscale is None:
            self._can_autoscale = self.autoscaler_adds_nodes()
        for group, workers in sorted(groups.items()):
            if in_grace and not (self._can_autoscale and not self._fits_free(workers, state)):
                continue   # resources free now are granted in a moment; a wait for a node is named at once
            self._judge(group, workers, state, now)

    @staticmethod
    def _fits_free(workers: list[PendingWorker], state: ray_compat.ResourceState) -> bool:
        return fits(workers[0].ask, [node.free for node in state.nodes], len(workers))

    def _judge(self, group: int, workers: list[PendingWorker], state: ray_compat.ResourceState, now: float) -> None:
        ask = workers[0].ask
        since = self._unplaced_since.setdefault(group, now)
        waited = now - self.started_at
        what = (f"{ask.describe()}; {len(workers)} of its worker(s) not placed after {waited:.0f} s "
                f"({', '.join(w.worker_id for w in workers)}); free now: "
                f"{describe_free(state.nodes, ask.resource_names)}")
        can_ever_fit = fits(ask, [node.total for node in state.nodes])
        if self._can_autoscale:
            verdict = (f"waiting for Ray's autoscaler to add a node that holds it (up to "
                       f"worker_ready_timeout_s, {self.ready_timeout_s:.0f} s)")
        elif not can_ever_fit and self._can_autoscale is False:
            raise PlacementError(f"{what}. No node of this cluster has that much in all, and no autoscaler "
                                 f"can add one: lower the group's num_cpus, num_gpus, resources or "
                                 f"tensor_parallel_size, or serve on a cluster that has such nodes")
        elif self.is_private_ray:
            raise PlacementError(f"{what}. This private Ray has this machine's resources only, and this "
                                 f"server's own actors hold the rest: lower the group's num_cpus, num_gpus, "
                                 f"count or tensor_parallel_size, or join a larger cluster with --address "
                                 f"('pagedserve config validate' checks a file against this machine)")
        elif self._can_autoscale is None:
            verdict = (f"Ray's autoscaler has not said whether it can add nodes: waiting up to "
                       f"worker_ready_timeout_s ({self.ready_timeout_s:.0f} s)")
        elif now - since >= self.placement_timeout_s:
            raise PlacementError(f"{what}. Still not placed after placement_timeout_s "
                                 f"({self.placement_timeout_s:.0f} s) on a cluster without an autoscaler")
        else:
            verdict = (f"waiting up to placement_timeout_s ({self.placement_timeout_s:.0f} s) for these "
                       "resources to become free (no autoscaler can add nodes to this cluster)")
        last_at, last_verdict = self._noted.get(group, (None, None))
        if last_at is None or now - last_at >= REMIND_S or verdict != last_verdict:
            self._noted[group] = (now, verdict)
            self.notify(f"{what}. {verdict}")
