"""The heartbeat monitor (``cluster.health.WorkerHealth``) on real, restartable Ray
actors that stand in for workers (the real ``Worker`` under faults is
``test_chaos.py``): a killed actor stops being routable until its new
incarnation answers; a stalled or unresponsive one is restarted exactly once.
"""

from __future__ import annotations

import functools
import os
import time

import pytest

ray = pytest.importorskip("ray")

from pagedserve.cluster import ray_compat  # noqa: E402
from pagedserve.cluster.config import RouterConfig  # noqa: E402
from pagedserve.cluster.health import WorkerHealth  # noqa: E402
from pagedserve.cluster.router import Router  # noqa: E402
from polling import wait_for  # noqa: E402

pytestmark = pytest.mark.timeout(300)

STALL_TIMEOUT_S = 1.5


def _fake_worker_class():
    """A stand-in worker, defined here so that Ray ships it by value (tests/ is not importable)."""

    class FakeWorker:
        """Answers heartbeats like ``Worker.heartbeat``; can report a stall or stop answering."""

        def __init__(self) -> None:
            self.is_stalled = False
            self.num_unfinished = 0

        def heartbeat(self) -> dict:
            return {"pid": os.getpid(), "actor_id": ray.get_runtime_context().get_actor_id(),
                    "is_stalled": self.is_stalled, "seconds_since_progress": 0.0,
                    "num_unfinished": self.num_unfinished}

        def set_stalled(self, is_stalled: bool) -> None:
            self.is_stalled = is_stalled

        def set_unfinished(self, num_unfinished: int) -> None:
            self.num_unfinished = num_unfinished

        def block(self, seconds: float) -> None:
            time.sleep(seconds)

        def pid(self) -> int:
            return os.getpid()

    return FakeWorker


@pytest.fixture
def monitored(local_ray):
    actor_cls = ray.remote(_fake_worker_class())
    workers = {f"w{i}": actor_cls.options(max_restarts=-1, max_task_retries=0).remote() for i in range(2)}
    ray.get([w.pid.remote() for w in workers.values()])
    router = Router(RouterConfig(), list(workers))
    health = WorkerHealth(workers, router, STALL_TIMEOUT_S, probe_interval_s=0.1)
    health.start()
    _wait(lambda: all(state["pid"] for state in health.snapshot().values()))  # each has answered
    yield workers, router, health
    health.stop()
    for worker in workers.values():
        ray.kill(worker, no_restart=True)


_wait = functools.partial(wait_for, interval_s=0.05)


def _routable(router: Router) -> set[str]:
    return {w for w, load in router.snapshot()["loads"].items() if load["is_alive"]}


def test_a_killed_worker_is_unroutable_until_its_restart_answers(monitored):
    workers, router, health = monitored
    old_pid = ray.get(workers["w0"].pid.remote())
    ray.kill(workers["w0"], no_restart=False)
    _wait(lambda: "w0" not in health.alive_workers())
    assert "w0" not in _routable(router) and "w1" in _routable(router)
    assert not health.snapshot()["w0"]["is_answering"]   # what the worker pool reads as dead
    # Ray's actor error, or, on a loaded machine, the stall timeout first: either way it is not answering.
    assert health.snapshot()["w0"]["failure_reason"].startswith(("heartbeat failed", "heartbeat unanswered"))
    _wait(lambda: health.alive_workers() == {"w0", "w1"})
    assert health.snapshot()["w0"]["is_answering"]
    assert ray.get(workers["w0"].pid.remote()) != old_pid
    assert _routable(router) == {"w0", "w1"}
    assert health.snapshot()["w0"]["num_restarts_requested"] == 0  # Ray restarted it, not the monitor


def test_a_stalled_worker_is_restarted_once(monitored):
    workers, router, health = monitored
    old_pid = ray.get(workers["w1"].pid.remote())
    ray.get(workers["w1"].set_stalled.remote(True))
    _wait(lambda: health.snapshot()["w1"]["num_restarts_requested"] == 1)
    assert health.snapshot()["w1"]["failure_reason"].startswith("stalled")
    _wait(lambda: health.alive_workers() == {"w0", "w1"})  # the new incarnation is not stalled
    assert ray.get(workers["w1"].pid.remote()) != old_pid
    assert health.snapshot()["w1"]["num_restarts_requested"] == 1


def test_a_worker_that_stops_answering_is_restarted(monitored):
    workers, router, health = monitored
    old_pid = ray.get(workers["w0"].pid.remote())
    workers["w0"].block.remote(60)  # a sync actor: heartbeats queue behind this call
    _wait(lambda: health.snapshot()["w0"]["num_restarts_requested"] == 1)
    assert "w0" not in _routable(router)
    _wait(lambda: health.alive_workers() == {"w0", "w1"})
    assert ray.get(workers["w0"].pid.remote()) != old_pid


def test_each_heartbeat_carries_the_workers_unfinished_requests(monitored):
    """The worker pool's load figure: it asks a ready worker nothing of its own."""
    workers, router, health = monitored
    ray.get(workers["w1"].set_unfinished.remote(5))
    _wait(lambda: health.snapshot()["w1"]["num_unfinished"] == 5)
    assert health.snapshot()["w0"]["num_unfinished"] == 0


def test_a_failure_noted_by_a_request_takes_the_worker_out_until_the_next_heartbeat(monitored):
    workers, router, health = monitored
    health.note_failure("w1", "request timed out")
    assert "w1" not in _routable(router)
    assert health.snapshot()["w1"]["is_answering"]   # unroutable, but not dead for the pool
    _wait(lambda: "w1" in health.alive_workers())  # it was fine after all: back at the next answer
    assert health.snapshot()["w1"]["num_restarts_requested"] == 0


def test_a_stalled_worker_a_request_reported_first_is_restarted_once(monitored):
    """A failed engine loop: its requests see it before the next heartbeat, which then says
    stalled. The incarnation is still restarted, once."""
    workers, router, health = monitored
    old_pid = ray.get(workers["w0"].pid.remote())
    ray.get(workers["w0"].set_stalled.remote(True))
    health.note_failure("w0", "request: EngineDeadError")
    _wait(lambda: health.snapshot()["w0"]["num_restarts_requested"] == 1)
    _wait(lambda: health.alive_workers() == {"w0", "w1"})
    assert ray.get(workers["w0"].pid.remote()) != old_pid
    assert health.snapshot()["w0"]["num_restarts_requested"] == 1


def test_a_hung_worker_is_restarted_even_when_rays_state_is_unreadable(monitored, monkeypatch):
    workers, router, health = monitored
    monkeypatch.setattr(ray_compat, "actor_status", lambda actor_id: None)
    old_pid = ray.get(workers["w1"].pid.remote())
    workers["w1"].block.remote(60)
    _wait(lambda: health.snapshot()["w1"]["num_restarts_requested"] == 1)
    assert health.snapshot()["w1"]["state_unknown"]
    # Until a new incarnation answers, a second blind restart is refused (it may be loading).
    assert not health._is_hung("w1", workers["w1"])
    _wait(lambda: health.alive_workers() == {"w0", "w1"})
    assert ray.get(workers["w1"].pid.remote()) != old_pid
    assert health.snapshot()["w1"]["num_restarts_requested"] == 1


def test_the_actor_state_comes_from_ray_for_a_worker_that_answered(monitored):
    workers, router, health = monitored
    actor_id = health.snapshot()["w0"]["actor_id"]
    status = ray_compat.actor_status(actor_id)  # this module's Ray has no dashboard: the GCS fallback
    assert status is not None and status.state == "ALIVE"
    assert status.pid == ray.get(workers["w0"].pid.remote()) == health.snapshot()["w0"]["pid"]
