"""Cluster stats as one JSON snapshot: the KV manager's pools, every worker's
engine and the router's decisions (``/stats``, ``/metrics``, ``pagedserve status``)."""

from __future__ import annotations

import asyncio

STATS_TIMEOUT_S = 5.0


async def collect_stats(handle, timeout_s: float = STATS_TIMEOUT_S) -> dict:
    """The KV manager's pool stats and every worker's engine stats, without blocking the loop.

    A part that does not answer within ``timeout_s`` appears as ``{"error": ...}``
    (a worker additionally as ``is_healthy: False``).
    """
    async def ask(ref):
        try:
            return await asyncio.wait_for(ref, timeout_s)
        except Exception as exc:
            return {"is_healthy": False, "error": repr(exc)}

    kv_stats, *worker_stats = await asyncio.gather(
        ask(handle.kv_manager.stats.remote()), *(ask(w.stats.remote()) for w in handle.workers.values()))
    return {"model": handle.model_name, "kv_manager": kv_stats,
            "workers": dict(zip(handle.workers, worker_stats)), "router": handle.router.snapshot()}
