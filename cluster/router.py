"""Cache-aware routing: send a request where its prefix is cached, unless that
worker is already loaded with more work than the cache hit saves."""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import asdict, dataclass, field

from .config import RouterConfig

logger = logging.getLogger("pagedserve.router")

# An adapter this router sent a worker counts as held there this long without the worker's
# report (it reads the adapter when the request arrives, and reports it after that step).
ADAPTER_REPORT_GRACE_S = 5.0


@dataclass
class WorkerLoad:
    """What the router knows of one worker's load."""

    num_in_flight: int = 0
    num_in_flight_tokens: int = 0   # prompt + max_tokens of requests still running
    # Device blocks in use / pool size (cached-but-free blocks count as free),
    # refreshed from the KV manager's occupancy figures.
    kv_blocks_used_frac: float = 0.0
    is_alive: bool = True


@dataclass
class RoutingDecision:
    request_id: str
    worker_id: str
    reason: str                      # "prefix", "adapter", "load", "only", "round_robin", "fallback"
    cached_tokens: int
    prompt_tokens: int
    scores: dict[str, float] = field(default_factory=dict)
    timestamp: float = field(default_factory=time.time)


def kv_blocks_used_frac(pool_stats: dict) -> float:
    """Device blocks in use / device pool size, from one worker's pool statistics.

    Cached-but-free blocks count as free: they are evicted on demand. This is
    the capacity figure; ``kv_utilization`` (tokens stored / slots of allocated
    blocks) measures paging waste and stays near 1 whatever the pool's fill.
    """
    total = pool_stats.get("num_device_blocks", 0)
    return pool_stats.get("device_blocks_used", 0) / total if total else 0.0


class Router:
    """Picks a worker per request and remembers why.

    Score of worker w for a prompt: ``prefix_weight * cached_tokens(w) -
    in_flight_tokens(w)``, so a cached token is worth ``prefix_weight``
    tokens of queued work, and a skewed hit stops winning once its worker
    has more queued than the hit saves. Workers whose ``kv_blocks_used_frac``
    reaches ``max_kv_utilization``, or with ``max_queue_per_worker`` requests,
    are skipped while another has room ("fallback" when none has).

    A request with a LoRA adapter goes, among those workers, to one that holds the adapter if
    any does ("adapter", unless a cached prefix decided), scored as above among them; a cold
    adapter goes by the score alone, and the worker it lands on holds it from then on. What a
    worker holds is what the workers report to the central KV manager (``holders``, from
    ``KVManagerService.route_hints``), and what this router sent it in the last
    ``ADAPTER_REPORT_GRACE_S`` (not reported yet); without reports, what this router last sent
    it: up to ``adapters_per_worker`` adapters (the worker's ``max_cpu_loras``), the least
    recently sent dropped first, as the worker's own host cache drops them.
    """

    def __init__(self, config: RouterConfig, worker_ids: list[str], history: int = 256,
                 adapters_per_worker: int = 1) -> None:
        self.config = config
        self.adapters_per_worker = adapters_per_worker
        # Per worker, the adapters this router sent it (least recently sent first) and when.
        self._adapters: dict[str, collections.OrderedDict[str, float]] = {}
        self.loads: dict[str, WorkerLoad] = {w: WorkerLoad() for w in worker_ids}
        self.decisions: collections.deque[RoutingDecision] = collections.deque(maxlen=history)
        self.reason_counts: collections.Counter[str] = collections.Counter()
        self._next = 0
        self._lock = threading.Lock()

    def set_workers(self, worker_ids: list[str]) -> None:
        with self._lock:
            self.loads = {w: self.loads.get(w, WorkerLoad()) for w in worker_ids}
            self._adapters = {w: held for w, held in self._adapters.items() if w in self.loads}

    def mark_dead(self, worker_id: str, is_alive: bool = False) -> None:
        with self._lock:
            if worker_id in self.loads:
                self.loads[worker_id].is_alive = is_alive
            if not is_alive:
                self._adapters.pop(worker_id, None)   # restarted, it starts without adapters

    def update_occupancy(self, blocks_used_frac: dict[str, float]) -> None:
        """Set each worker's ``kv_blocks_used_frac`` (see ``kv_blocks_used_frac``)."""
        with self._lock:
            for worker_id, value in blocks_used_frac.items():
                if worker_id in self.loads:
                    self.loads[worker_id].kv_blocks_used_frac = value

    def choose(self, request_id: str, prompt_tokens: int, max_tokens: int,
               cached: dict[str, int], exclude: set[str] = frozenset(), adapter: str | None = None,
               holders: set[str] | None = None) -> RoutingDecision:
        """Pick a worker; ``cached`` is the cached prefix length per worker, ``adapter`` the
        request's LoRA adapter (None: the base model), ``holders`` the workers that report
        holding it (None: no reports, this router's record alone)."""
        with self._lock:
            alive = [w for w, load in self.loads.items() if load.is_alive and w not in exclude]
            if not alive:
                alive = [w for w in self.loads if w not in exclude] or list(self.loads)
            roomy = [w for w in alive
                     if self.loads[w].kv_blocks_used_frac < self.config.max_kv_utilization
                     and self.loads[w].num_in_flight < self.config.max_queue_per_worker]
            candidates = roomy or alive
            policy = self.config.policy
            holding = ([w for w in candidates if self._holds(w, adapter, holders)]
                       if adapter is not None and policy != "round_robin" and len(candidates) > 1 else [])
            if holding:
                candidates = holding
            scores: dict[str, float] = {}
            if len(candidates) == 1:
                worker_id, reason = candidates[0], "adapter" if holding else "only"
            elif policy == "round_robin":
                worker_id, reason = candidates[self._next % len(candidates)], "round_robin"
                self._next += 1
            else:
                weight = self.config.prefix_weight if policy == "cache_aware" else 0.0
                for w in candidates:
                    scores[w] = weight * cached.get(w, 0) - self.loads[w].num_in_flight_tokens
                best = max(scores.values())
                tied = [w for w in candidates if scores[w] == best]
                worker_id = tied[self._next % len(tied)]
                self._next += 1
                # "prefix" when the winner holds a longer cached prefix than every other
                # candidate (the cache decided, even if it is also the least loaded).
                best_other = max((cached.get(w, 0) for w in candidates if w != worker_id), default=0)
                reason = ("prefix" if weight > 0 and cached.get(worker_id, 0) > best_other
                          else "adapter" if holding else "load")
                if not roomy:
                    reason = "fallback"
            if adapter is not None:
                held = self._adapters.setdefault(worker_id, collections.OrderedDict())
                held.pop(adapter, None)
                held[adapter] = time.monotonic()
                while len(held) > self.adapters_per_worker:
                    held.popitem(last=False)
            load = self.loads[worker_id]
            load.num_in_flight += 1
            load.num_in_flight_tokens += prompt_tokens + max_tokens
            decision = RoutingDecision(request_id, worker_id, reason, cached.get(worker_id, 0),
                                       prompt_tokens, scores)
            self.decisions.append(decision)
            self.reason_counts[reason] += 1
        logger.debug("route %s -> %s (%s): cached %d of %d tokens, scores %s", request_id, worker_id,
                     reason, decision.cached_tokens, prompt_tokens, scores)
        return decision

    def _holds(self, worker_id: str, adapter: str, reported: set[str] | None) -> bool:
        sent_at = self._adapters.get(worker_id, {}).get(adapter)
        if reported is None:
            return sent_at is not None
        return worker_id in reported or (sent_at is not None and time.monotonic() - sent_at < ADAPTER_REPORT_GRACE_S)

    def release(self, decision: RoutingDecision, max_tokens: int) -> None:
        """The request left the worker (finished, aborted or failed)."""
        with self._lock:
            load = self.loads.get(decision.worker_id)
            if load is not None:
                load.num_in_flight = max(0, load.num_in_flight - 1)
                load.num_in_flight_tokens = max(
                    0, load.num_in_flight_tokens - decision.prompt_tokens - max_tokens)

    def recent_decisions(self, limit: int = 50) -> list[dict]:
        with self._lock:
            return [asdict(d) for d in list(self.decisions)[-limit:]]

    def snapshot(self) -> dict:
        with self._lock:
            return {"loads": {w: asdict(l) for w, l in self.loads.items()},
                    "reasons": dict(self.reason_counts)}
