"""The router's choice: cached prefix against queued load, and the capacity gate.

The gate reads ``kv_blocks_used_frac`` (device blocks in use / pool size, with
cached-but-free blocks counted free), never ``kv_utilization`` (tokens / slots
of allocated blocks), which paging keeps near 1 whatever the pool's fill.
"""

from __future__ import annotations

import pytest

from pagedserve.cluster.config import RouterConfig
from pagedserve.cluster.launcher import format_status
from pagedserve.cluster.router import Router, kv_blocks_used_frac
from pagedserve.kvmanager import KVManager, NewSequence, PoolConfig, StepInput


def _router(**config) -> Router:
    return Router(RouterConfig(**config), ["w0", "w1"])


def _load(router: Router, worker_id: str, in_flight_tokens: int) -> None:
    """Queue ``in_flight_tokens`` of work on ``worker_id`` through the router itself."""
    decision = router.choose("filler", in_flight_tokens, 0, {}, exclude={w for w in router.loads if w != worker_id})
    assert decision.worker_id == worker_id


def test_prefix_wins_until_its_worker_has_more_queued_than_the_hit_saves():
    router = _router(prefix_weight=1.0)
    cached = {"w0": 512, "w1": 0}
    first = router.choose("a", 600, 16, cached)
    assert (first.worker_id, first.reason, first.cached_tokens) == ("w0", "prefix", 512)
    # w0 now holds 616 queued tokens, more than the 512 the hit saves: load wins.
    second = router.choose("b", 600, 16, cached)
    assert (second.worker_id, second.reason) == ("w1", "load")
    assert second.scores == {"w0": 512 - 616, "w1": 0}
    # A cached token worth twice a queued one tips it back to the cache.
    heavy = _router(prefix_weight=2.0)
    _load(heavy, "w0", 616)
    _load(heavy, "w1", 100)
    decision = heavy.choose("c", 600, 16, cached)
    assert (decision.worker_id, decision.reason) == ("w0", "prefix")
    # Released work no longer counts.
    router.release(first, 16)
    assert router.choose("d", 600, 16, cached).worker_id == "w0"


def test_least_loaded_ignores_the_cache():
    router = _router(policy="least_loaded")
    _load(router, "w1", 10)
    decision = router.choose("a", 100, 16, {"w0": 0, "w1": 96})
    assert (decision.worker_id, decision.reason) == ("w0", "load")


def test_a_worker_with_a_full_pool_is_skipped_even_with_the_best_prefix():
    router = _router(max_kv_utilization=0.9)
    router.update_occupancy({"w0": 0.95, "w1": 0.20})
    decision = router.choose("a", 600, 16, {"w0": 512, "w1": 0})
    assert (decision.worker_id, decision.reason) == ("w1", "only")
    router.update_occupancy({"w0": 0.50})
    decision = router.choose("b", 600, 16, {"w0": 512, "w1": 0})
    assert (decision.worker_id, decision.reason) == ("w0", "prefix")


def test_fallback_when_every_worker_is_full_routes_by_score_anyway():
    router = _router(max_kv_utilization=0.9)
    router.update_occupancy({"w0": 0.99, "w1": 0.95})
    decision = router.choose("a", 600, 16, {"w0": 0, "w1": 512})
    assert (decision.worker_id, decision.reason) == ("w1", "fallback")
    # A dead worker is never the fallback while a live one exists.
    router.mark_dead("w1")
    decision = router.choose("b", 600, 16, {"w0": 0, "w1": 512})
    assert (decision.worker_id, decision.reason) == ("w0", "only")
    # Queue length gates like occupancy does.
    queued = _router(max_queue_per_worker=1)
    _load(queued, "w0", 1)
    decision = queued.choose("c", 10, 1, {"w0": 10, "w1": 0})
    assert (decision.worker_id, decision.reason) == ("w1", "only")
    _load(queued, "w1", 1)
    assert queued.choose("d", 10, 1, {"w0": 10, "w1": 0}).reason == "fallback"


def _pool_stats(num_device_blocks: int, used: int, cached: int) -> dict:
    return {"num_device_blocks": num_device_blocks, "device_blocks_used": used,
            "device_blocks_cached": cached, "device_blocks_free": num_device_blocks - used - cached}


def test_blocks_used_fraction_counts_cached_free_blocks_as_free():
    assert kv_blocks_used_frac(_pool_stats(1000, 10, 900)) == pytest.approx(0.01)
    assert kv_blocks_used_frac(_pool_stats(1000, 1000, 0)) == 1.0
    assert kv_blocks_used_frac({}) == 0.0


def test_the_gate_figure_tracks_the_pool_not_paging_waste():
    """On a real manager: long sequences in a big pool are not 'full'; a full pool is;
    finished sequences' cached blocks free the gate again."""
    manager = KVManager()
    manager.add_worker("w", PoolConfig(num_device_blocks=400, block_size=16, max_model_len=4096))
    prompts = [NewSequence(f"s{i}", [i + 3] * 1024) for i in range(2)]
    manager.step(StepInput("w", waiting=[p.seq_id for p in prompts], new_sequences=prompts, token_budget=4096))
    stats = manager.stats("w")
    assert stats["kv_utilization"] == pytest.approx(1.0)      # paging wastes nothing here ...
    assert kv_blocks_used_frac(stats) == pytest.approx(128 / 400)  # ... and the pool is a third full
    more = [NewSequence(f"t{i}", [i + 50] * 1024) for i in range(4)]
    manager.step(StepInput("w", running=["s0", "s1"], waiting=[p.seq_id for p in more], new_sequences=more,
                           token_budget=8192))
    router = _router(max_kv_utilization=0.9)
    router.update_occupancy({"w0": kv_blocks_used_frac(manager.stats("w")), "w1": 0.0})
    assert kv_blocks_used_frac(manager.stats("w")) >= 0.9
    assert router.choose("x", 10, 1, {"w0": 1024}).worker_id == "w1"
    live = [s for s in manager.block_manager("w").seqs]
    manager.step(StepInput("w", finished=live))
    stats = manager.stats("w")
    assert stats["device_blocks_used"] == 0 and stats["device_blocks_cached"] > 0
    router.update_occupancy({"w0": kv_blocks_used_frac(stats)})
    assert router.choose("y", 10, 1, {"w0": 1024}).worker_id == "w0"
    manager.check_integrity()


def test_status_shows_blocks_in_use_as_kv_used():
    stats = {"model": "m", "workers": {"w0": {"role": "mixed", "is_healthy": True}},
             "kv_manager": {"workers": {"w0": {**_pool_stats(1000, 250, 700), "kv_utilization": 0.99}}}}
    lines = format_status(stats).splitlines()
    header, row = lines[1], lines[2]
    column = header.index("kv used")
    assert row[column - 1:column + len("kv used")].strip() == "25.0%"


def test_the_gate_reads_the_central_occupancy_fed_by_events():
    """The handle feeds the gate from the central manager's stats, which hold each
    worker's occupancy as its last event batch reported it."""
    from dataclasses import asdict

    from pagedserve.kvmanager.events import EventLog, PublishAck
    from pagedserve.kvmanager.local_manager import LocalKVManager
    from pagedserve.kvmanager.service import KVManagerService

    central = KVManagerService()
    local = LocalKVManager(event_log=EventLog("w0"))
    config = PoolConfig(num_device_blocks=400, block_size=16, max_model_len=4096)
    local.add_worker("w0", config)
    central.register_worker("w0", asdict(config))
    assert PublishAck.unpack(central.resync(local.snapshot().pack())).status == "ok"
    prompts = [NewSequence(f"s{i}", [i + 3] * 1024) for i in range(3)]
    local.step(StepInput("w0", waiting=[p.seq_id for p in prompts], new_sequences=prompts, token_budget=4096))
    local.step(StepInput("w0", finished=["s2"]))   # its 64 blocks stay cached, and count as free
    assert PublishAck.unpack(central.publish(local.drain_events().pack())).status == "ok"
    frac = kv_blocks_used_frac(central.stats()["workers"]["w0"])
    assert frac == pytest.approx(128 / 400) == pytest.approx(kv_blocks_used_frac(local.stats("w0")))


def test_adapters_go_where_they_are_held_and_a_cold_one_to_the_least_loaded():
    """2 workers holding 4 adapters each, a random stream of 8 adapters' requests (each released
    after a while): at least 90% land on a worker that already held their adapter (the
    issue's target), and the load stays shared."""
    import random

    router = Router(RouterConfig(), ["w0", "w1"], adapters_per_worker=4)
    first = router.choose("a", 100, 16, {}, adapter="sql")
    assert first.reason == "load"
    _load(router, first.worker_id, 1_000)   # the holder is busier, but holds the adapter
    again = router.choose("b", 100, 16, {}, adapter="sql")
    assert (again.worker_id, again.reason) == (first.worker_id, "adapter")
    cold = router.choose("c", 100, 16, {}, adapter="chat")
    assert cold.worker_id != first.worker_id and cold.reason == "load"

    rng = random.Random(0)
    router = Router(RouterConfig(), ["w0", "w1"], adapters_per_worker=4)
    adapters = [f"adapter-{i}" for i in range(8)]
    running, num_held, per_worker = [], 0, {"w0": 0, "w1": 0}
    for i in range(1_000):
        adapter = rng.choice(adapters)
        held = {w for w in ("w0", "w1") if adapter in router._adapters.get(w, ())}
        decision = router.choose(f"r{i}", rng.randrange(16, 512), 64, {}, adapter=adapter)
        num_held += decision.worker_id in held
        per_worker[decision.worker_id] += 1
        running.append(decision)
        if len(running) > 16:
            router.release(running.pop(rng.randrange(len(running))), 64)
    assert num_held >= 900 and min(per_worker.values()) >= 300, (num_held, per_worker)
    # A worker that died (and restarts) holds nothing any more.
    router.mark_dead("w0")
    assert not router._adapters.get("w0")


def test_round_robin_ignores_adapters():
    router = Router(RouterConfig(policy="round_robin"), ["w0", "w1"], adapters_per_worker=4)
    workers = [router.choose(f"r{i}", 10, 1, {}, adapter="sql").worker_id for i in range(4)]
    assert workers == ["w0", "w1", "w0", "w1"]


def test_reported_holders_decide_and_a_fresh_send_counts_until_its_report(monkeypatch):
    """With the workers' reports (``holders``), a worker that reports the adapter is preferred
    even if this router never sent it there; one this router sent it to counts for
    ``ADAPTER_REPORT_GRACE_S`` (not reported yet), then only if reported (another replica's
    traffic may have evicted it)."""
    from pagedserve.cluster import router as router_module

    clock = [100.0]
    monkeypatch.setattr(router_module.time, "monotonic", lambda: clock[0])
    router = Router(RouterConfig(), ["w0", "w1"], adapters_per_worker=4)
    _load(router, "w1", 1_000)
    reported = router.choose("a", 100, 16, {}, adapter="sql", holders={"w1"})
    assert (reported.worker_id, reported.reason) == ("w1", "adapter")
    cold = router.choose("b", 100, 16, {}, adapter="chat", holders=set())
    assert (cold.worker_id, cold.reason) == ("w0", "load")
    _load(router, "w0", 5_000)
    fresh = router.choose("c", 100, 16, {}, adapter="chat", holders=set())     # sent 0 s ago, not reported
    assert (fresh.worker_id, fresh.reason) == ("w0", "adapter")
    clock[0] += router_module.ADAPTER_REPORT_GRACE_S + 1
    stale = router.choose("d", 100, 16, {}, adapter="chat", holders=set())     # not reported since: gone
    assert (stale.worker_id, stale.reason) == ("w1", "load")
    assert router.choose("e", 100, 16, {}, adapter="chat", holders=None).reason == "adapter"   # no reports
