"""The worker pool's view of its workers (``cluster.worker_pool.WorkerPool``) on real Ray
actors that stand in for workers (the real ``Worker`` scaling and draining is
``test_autoscaling.py``): a ready worker's load and state come from the heartbeat
monitor's view, with no call of the pool's own; only a draining worker is asked
``drain_status``, and it goes once it says it is drained.
"""

from __future__ import annotations

import functools
import time

import pytest

ray = pytest.importorskip("ray")

from pagedserve.cluster.worker_pool import WorkerPool  # noqa: E402
from polling import wait_for  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def _fake_worker_class():
    """A stand-in worker, defined here so that Ray ships it by value (tests/ is not importable)."""

    class FakeWorker:
        """Counts the pool's calls; ``drain_status`` answers like ``Worker.drain_status``."""

        def __init__(self) -> None:
            self.calls: dict[str, int] = {}
            self.is_draining = False
            self.num_unfinished = 3

        def _count(self, name: str) -> None:
            self.calls[name] = self.calls.get(name, 0) + 1

        def drain(self) -> None:
            self._count("drain")
            self.is_draining = True

        def drain_status(self) -> dict:
            self._count("drain_status")
            return {"is_draining": self.is_draining, "num_unfinished": self.num_unfinished,
                    "num_drain_migrations": 2, "num_held_exports": 0}

        def finish(self) -> None:
            self.num_unfinished = 0

        def num_used_blocks(self) -> int:
            return 0

        def call_counts(self) -> dict[str, int]:
            return dict(self.calls)

    return FakeWorker


def _fake_kv_manager_class():
    class FakeKVManager:
        def remove_worker(self, worker_id: str) -> None:
            pass

    return FakeKVManager


@pytest.fixture
def pool(local_ray):
    worker_cls = ray.remote(_fake_worker_class())
    workers = {f"worker-{i}": worker_cls.remote() for i in range(2)}
    liveness = {w: {"is_alive": True, "is_answering": True, "num_unfinished": 0, "failure_reason": None}
                for w in workers}
    gone = []
    pool = WorkerPool({}, "unused", {}, ray.remote(_fake_kv_manager_class()).remote(),
                      "unused", None, workers, {w: 0 for w in workers}, on_gone=gone.append,
                      read_liveness=lambda: {w: dict(entry) for w, entry in liveness.items()},
                      control_interval_s=0.05)
    yield pool, workers, liveness, gone
    pool.shutdown()


_wait = functools.partial(wait_for, interval_s=0.05)


def _record(pool, worker_id: str) -> dict:
    return pool.status()["workers"][worker_id]


def test_a_ready_workers_load_and_state_follow_its_heartbeats_and_nothing_asks_it(pool):
    pool, workers, liveness, _ = pool
    liveness["worker-0"]["num_unfinished"] = 7
    _wait(lambda: _record(pool, "worker-0")["num_ongoing"] == 7)
    liveness["worker-0"].update(is_alive=False, is_answering=False, failure_reason="heartbeat failed: RayActorError")
    _wait(lambda: _record(pool, "worker-0")["state"] == "dead")
    assert _record(pool, "worker-0")["reason"] == "heartbeat failed: RayActorError"
    liveness["worker-0"].update(is_alive=True, is_answering=True, num_unfinished=1)
    _wait(lambda: _record(pool, "worker-0")["state"] == "ready")
    assert _record(pool, "worker-0")["num_ongoing"] == 1
    assert _record(pool, "worker-1")["state"] == "ready"
    counts = ray.get([worker.call_counts.remote() for worker in workers.values()])
    assert counts == [{}, {}]   # no drain_status, no other call


def test_a_worker_that_answers_stays_ready_while_unroutable(pool):
    """Stalled, or a request saw it fail: the heartbeat monitor restarts it if need be."""
    pool, _, liveness, _ = pool
    liveness["worker-0"].update(is_alive=False, is_answering=True, num_unfinished=4,
                                failure_reason="stalled for 3.0 s")
    _wait(lambda: _record(pool, "worker-0")["num_ongoing"] == 4)
    time.sleep(0.3)   # several ticks
    assert _record(pool, "worker-0")["state"] == "ready"


def test_only_a_draining_worker_is_asked_its_drain_status_and_it_goes_once_drained(pool):
    pool, workers, liveness, gone = pool
    assert pool.drain("worker-1")
    _wait(lambda: _record(pool, "worker-1")["num_drain_migrations"] == 2)
    assert _record(pool, "worker-1")["state"] == "draining"
    assert _record(pool, "worker-1")["num_ongoing"] == 3   # from drain_status, not the heartbeats' 0
    ray.get(workers["worker-1"].finish.remote())
    _wait(lambda: gone == ["worker-1"])
    assert _record(pool, "worker-1")["state"] == "dead"
    assert _record(pool, "worker-1")["reason"] == "drained"
    assert "drain_status" not in ray.get(workers["worker-0"].call_counts.remote())
