"""The one cluster stats gatherer, behind ``ClusterHandle.stats``, ``/stats``, ``/metrics``,
``pagedserve status`` and the dashboard.

``gather_stats`` asks every source at once, without blocking the event loop,
and returns one JSON-able snapshot. Each source is one function below, so a
new source of a figure (occupancy from the KV manager's event-fed index, block
maps asked of the workers, the router's capacity figure) replaces one function
and every consumer follows. A source that fails or does not answer within the
timeout is named in ``errors`` and never raises.

The snapshot::

    time, model
    kv_manager        the KV manager's stats; its "workers" are the per-worker pools: the
                      central figures (fed by KV events, lagging a little) completed by
                      each worker's own pool statistics (its "kv_pool", the source of truth)
    workers           worker id -> that engine's stats ({"worker_id", "is_healthy": False,
                      "error"} when it did not answer) and its "state" (starting, ready,
                      draining, dead: every worker the cluster controller knows)
    scaling           worker counts per state and the elastic groups' recent decisions
    router            this process's router: loads, liveness, reasons
    recent_decisions  its last routing decisions
    health            the cluster controller's liveness per worker, as this process last read it
    num_resumed, num_migrated, num_recomputed_tokens, num_no_capacity, num_not_resumable,
    num_repeated_engine_failures
                      this handle's counters
    block_maps        worker id -> block states per tier, asked of each worker (only when
                      asked: ``block_map_cells``)
    errors            "source: reason" for every source that failed
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from typing import Any, Awaitable

STATS_TIMEOUT_S = 5.0
NUM_RECENT_DECISIONS = 20


# ---- the sources -----------------------------------------------------------------------------
def kv_manager_stats(handle) -> Awaitable[dict]:
    """Pools and counters per worker, and the KV manager's own figures."""
    return handle.kv_manager.stats.remote()


def worker_stats(handle, worker_id: str) -> Awaitable[dict]:
    """One engine's queue, step and transfer figures."""
    return handle.workers[worker_id].stats.remote()


def block_map(handle, worker_id: str, max_cells: int) -> Awaitable[dict]:
    """One worker's block states per tier, at most ``max_cells`` cells per pool; the worker
    draws its own pools between two engine steps."""
    return handle.workers[worker_id].block_map.remote(max_cells)


def with_worker_pools(kv_stats: dict, workers: dict[str, dict]) -> dict:
    """The KV manager's stats, each worker's entry under ``workers`` completed by that
    worker's own pool statistics (``kv_pool``)."""
    central = kv_stats.get("workers") or {}
    pools = {w: {**central.get(w, {}), **(stats.get("kv_pool") or {})} for w, stats in workers.items()}
    return {**kv_stats, "workers": {w: pool for w, pool in pools.items() if pool}}


async def worker_states(handle) -> dict:
    """Every worker the cluster controller knows, with its state (starting, ready, draining,
    dead), per-state counts and recent scaling decisions; the handle's worker set refreshed."""
    controller = getattr(handle, "controller", None)
    if controller is None:
        return {}
    await handle.refresh_workers(force=True)
    return await controller.worker_states.remote()


def with_states(workers: dict[str, dict], states: dict) -> dict[str, dict]:
    """Engine stats per worker, each with its ``state``; workers without engine stats (starting,
    dead) appear with what the controller knows of them."""
    merged = dict(workers)
    for worker_id, record in (states or {}).get("workers", {}).items():
        merged[worker_id] = {**record, **workers.get(worker_id, {}), "state": record["state"]}
    return merged


def local_figures(handle) -> dict:
    """What this process knows without asking anyone: routing, liveness, request counters."""
    router = handle.router
    health = getattr(handle, "health", None)
    counters = handle.request_counters() if hasattr(handle, "request_counters") else {}
    return {"router": router.snapshot(), "recent_decisions": router.recent_decisions(NUM_RECENT_DECISIONS),
            "health": health.snapshot() if health is not None else {}, **counters}


# ---- the gatherer ----------------------------------------------------------------------------
async def gather_stats(handle, timeout_s: float = STATS_TIMEOUT_S, block_map_cells: int | None = None) -> dict:
    """The cluster's stats snapshot (see the module's docstring), every source asked at once."""
    errors: list[str] = []

    async def ask(awaitable: Awaitable, what: str) -> Any:
        try:
            return await asyncio.wait_for(awaitable, timeout_s)
        except Exception as exc:
            errors.append(f"{what}: {exc!r}"[:300])
            return None

    states = await ask(worker_states(handle), "worker states")
    worker_ids = list(handle.workers)
    asks = [ask(kv_manager_stats(handle), "KV manager stats"),
            *(ask(worker_stats(handle, w), f"{w} stats") for w in worker_ids)]
    if block_map_cells is not None:
        asks += [ask(block_map(handle, w, block_map_cells), f"{w} block map") for w in worker_ids]
    results = await asyncio.gather(*asks)
    kv_stats, engine_stats = results[0], results[1:1 + len(worker_ids)]
    workers = {}
    for worker_id, stats in zip(worker_ids, engine_stats):
        workers[worker_id] = stats if stats is not None else {
            "worker_id": worker_id, "is_healthy": False, "error": _error_of(errors, f"{worker_id} stats")}
    if kv_stats is None:  # restarting: the workers' own pool figures still come
        kv_stats = {"error": _error_of(errors, "KV manager stats")}
    snapshot = {"time": time.time(), "model": handle.model_name,
                "kv_manager": with_worker_pools(kv_stats, workers),
                "workers": with_states(workers, states),
                "scaling": {k: (states or {}).get(k) for k in ("counts", "decisions")},
                **local_figures(handle)}
    if block_map_cells is not None:
        maps = results[1 + len(worker_ids):]
        snapshot["block_maps"] = {w: m for w, m in zip(worker_ids, maps) if m is not None}
    snapshot["errors"] = errors
    return snapshot


def gather_stats_sync(handle, timeout_s: float = STATS_TIMEOUT_S, block_map_cells: int | None = None) -> dict:
    """``gather_stats`` for synchronous callers; safe inside a running event loop (it then
    runs on a helper thread)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(gather_stats(handle, timeout_s, block_map_cells))
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, gather_stats(handle, timeout_s, block_map_cells)).result()


def _error_of(errors: list[str], what: str) -> str:
    return next((e.split(": ", 1)[1] for e in errors if e.startswith(f"{what}: ")), "no answer")
