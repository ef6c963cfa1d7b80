"""The one cluster stats gatherer (``cluster.stats.gather_stats``): its snapshot, its errors,
and that ``ClusterHandle.stats``, ``/stats``, ``/metrics``, ``pagedserve status`` and the
dashboard all read through it (a source replaced in it shows up in every one of them).

No Ray: the KV manager is the real service behind awaitable stand-ins for actor methods;
the distributed forms are covered by test_server, test_dashboard and test_distributed.
"""

from __future__ import annotations

import asyncio

import pytest

from pagedserve.cluster import stats as cluster_stats
from pagedserve.cluster.config import RouterConfig
from pagedserve.cluster.router import Router
from pagedserve.kvmanager import LocalKVManager, PoolConfig
from pagedserve.kvmanager.service import KVManagerService


class _Method:
    """``.remote(...)`` returning an awaitable, like a Ray actor method; ``fails`` raises."""

    def __init__(self, fn, fails: bool = False, hangs: bool = False) -> None:
        self.fn, self.fails, self.hangs = fn, fails, hangs

    def remote(self, *args):
        async def call():
            if self.hangs:
                await asyncio.sleep(3600)
            if self.fails:
                raise ConnectionError("actor died")
            return self.fn(*args)

        return call()


class _Worker:
    """Engine figures, and block maps drawn by a real ``LocalKVManager``."""

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self.kv = LocalKVManager()
        self.kv.add_worker(worker_id, PoolConfig(num_device_blocks=32, num_host_blocks=4))

    def stats(self) -> dict:
        return {"worker_id": self.worker_id, "num_running": 2, "num_waiting": 1, "is_healthy": True}

    def block_map(self, max_cells: int) -> dict:
        return self.kv.block_map(self.worker_id, max_cells)


class _Health:
    def snapshot(self) -> dict:
        return {"w0": {"is_alive": True, "num_restarts_requested": 0}}


class FakeHandle:
    """The parts of a ``ClusterHandle`` the gatherer reads."""

    def __init__(self, model_path: str | None = None, tokenizer=None, broken: str | None = None) -> None:
        self.service = KVManagerService()
        self.workers = {}
        for worker_id in ("w0", "w1"):
            self.service.register_worker(worker_id, {"num_device_blocks": 32, "num_host_blocks": 4})
            worker = _Worker(worker_id)
            self.workers[worker_id] = type("Actor", (), {})()
            self.workers[worker_id].stats = _Method(worker.stats, fails=broken == worker_id)
            self.workers[worker_id].block_map = _Method(worker.block_map)
        self.kv_manager = type("Actor", (), {})()
        self.kv_manager.stats = _Method(self.service.stats, hangs=broken == "kv_manager")
        self.router = Router(RouterConfig(), list(self.workers))
        self.health = _Health()
        self.roles = {"w0": "mixed", "w1": "mixed"}
        self.model_name = "fake-model"
        self.model_path = model_path
        self.tokenizer = tokenizer
        self.max_model_len = 128

    def request_counters(self) -> dict:
        return {"num_resumed": 3, "num_migrated": 1, "num_recomputed_tokens": 40, "num_no_capacity": 0,
                "num_not_resumable": 0, "num_repeated_engine_failures": 0}


def test_the_snapshot_holds_every_source():
    stats = asyncio.run(cluster_stats.gather_stats(FakeHandle(), block_map_cells=64))
    assert set(stats) == {"time", "model", "kv_manager", "workers", "router", "recent_decisions", "health",
                          "num_resumed", "num_migrated", "num_recomputed_tokens", "num_no_capacity",
                          "num_not_resumable", "num_repeated_engine_failures",
                          "block_maps", "errors", "scaling"}
    assert stats["errors"] == [] and stats["model"] == "fake-model"
    assert set(stats["kv_manager"]["workers"]) == {"w0", "w1"} == set(stats["workers"]) == set(stats["block_maps"])
    assert stats["workers"]["w1"]["num_running"] == 2 and stats["num_resumed"] == 3
    assert stats["health"]["w0"]["is_alive"] and set(stats["router"]["loads"]) == {"w0", "w1"}
    assert "block_maps" not in asyncio.run(cluster_stats.gather_stats(FakeHandle()))


def test_a_failed_or_silent_source_is_named_never_raised():
    stats = asyncio.run(cluster_stats.gather_stats(FakeHandle(broken="w1"), timeout_s=1.0))
    assert stats["workers"]["w1"] == {"worker_id": "w1", "is_healthy": False,
                                      "error": "ConnectionError('actor died')"}
    assert stats["workers"]["w0"]["is_healthy"] and stats["errors"] == ["w1 stats: ConnectionError('actor died')"]
    stats = asyncio.run(cluster_stats.gather_stats(FakeHandle(broken="kv_manager"), timeout_s=0.2))
    assert stats["kv_manager"] == {"error": "TimeoutError()", "workers": {}}
    assert stats["errors"] == ["KV manager stats: TimeoutError()"]
    assert stats["workers"]["w0"]["is_healthy"]  # the others still answer


def test_the_sync_form_works_inside_a_running_loop():
    async def from_a_coroutine():
        return cluster_stats.gather_stats_sync(FakeHandle())

    assert asyncio.run(from_a_coroutine())["errors"] == []
    assert cluster_stats.gather_stats_sync(FakeHandle())["workers"]["w0"]["num_waiting"] == 1


def test_every_consumer_reads_through_the_one_gatherer(tiny_model, monkeypatch):
    """Replace one source (as the KV-scale work will: occupancy from the event-fed index):
    the handle, /stats, /metrics, `pagedserve status` and the dashboard all show it."""
    from transformers import AutoTokenizer

    from pagedserve.cluster.handle import ClusterHandle
    from pagedserve.cluster.launcher import format_status
    from pagedserve.cluster.serving.dashboard import DashboardState
    from pagedserve.cluster.serving.frontend import Frontend

    path = tiny_model("llama")
    handle = FakeHandle(path, AutoTokenizer.from_pretrained(path))
    original = cluster_stats.kv_manager_stats

    async def occupancy_from_elsewhere(h):
        figures = await original(h)
        for pool in figures["workers"].values():
            pool["device_blocks_used"] = 24  # of 32: 75 %
        return figures

    monkeypatch.setattr(cluster_stats, "kv_manager_stats", occupancy_from_elsewhere)
    handle.config = type("Config", (), {"step_timeout_s": 5.0})()
    through_handle = ClusterHandle.stats(handle)
    assert through_handle["kv_manager"]["workers"]["w0"]["device_blocks_used"] == 24

    frontend = Frontend(handle)
    served = asyncio.run(frontend.stats())
    assert served["kv_manager"]["workers"]["w1"]["device_blocks_used"] == 24 and served["server"]["num_admitted"] == 0
    status = format_status(served)  # what `pagedserve status` prints of the same snapshot
    assert " 24/" in status and "75.0%" in status, status
    metrics = asyncio.run(frontend.metrics_text()).decode()
    assert 'pagedserve_kv_cache_usage_ratio{worker="w0"} 0.75' in metrics
    assert 'vllm:kv_cache_usage_perc{engine="w1",model_name="fake-model"} 0.75' in metrics
    dashboard = asyncio.run(DashboardState(handle).get(256))
    assert dashboard["workers"]["w0"]["pool"]["device_blocks_used"] == 24 and dashboard["errors"] == []


def test_status_says_what_each_routing_reason_means():
    """`pagedserve status` names why the router sent requests where it did, in words; a reason
    it does not know yet shows as the router names it."""
    from pagedserve.cluster.launcher import format_status

    status = format_status({"model": "m", "router": {"reasons": {"only": 46, "prefix": 3, "new_reason": 1}}})
    assert status.splitlines()[-1] == ("routing decisions: 1 new_reason, 46 to the only worker that could take "
                                       "them, 3 to the worker with the longest cached prefix")
