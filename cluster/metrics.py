"""Prometheus metrics of one server replica, in the text exposition format.

Latency histograms and request counters are observed by the server as
requests finish (server-side clock: from the request's arrival at the
replica). Queue, KV and cache figures are read from a stats snapshot of the
KV manager and the workers at scrape time. Each ``ServerMetrics`` owns its
``CollectorRegistry``, so several servers in one process never collide.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class _ClusterStatsCollector:
    """Yields gauges and counters from the latest stats snapshot (see ``collect_stats``)."""

    def __init__(self) -> None:
        self.stats: dict = {}

    def collect(self):
        workers = self.stats.get("workers", {})
        pools = self.stats.get("kv_manager", {}).get("workers", {})
        running = GaugeMetricFamily("pagedserve_num_requests_running",
                                    "Requests running on a worker (in its batch)", labels=["worker"])
        waiting = GaugeMetricFamily("pagedserve_num_requests_waiting",
                                    "Requests waiting in a worker's queue", labels=["worker"])
        healthy = GaugeMetricFamily("pagedserve_worker_healthy", "1 if the worker's engine loop runs",
                                    labels=["worker"])
        for worker_id, stats in sorted(workers.items()):
            healthy.add_metric([worker_id], 1.0 if stats.get("is_healthy") else 0.0)
            if "num_running" in stats:
                running.add_metric([worker_id], stats["num_running"])
                waiting.add_metric([worker_id], stats["num_waiting"])
        usage = GaugeMetricFamily("pagedserve_kv_cache_usage_ratio",
                                  "Fraction of a worker's device KV blocks in use", labels=["worker"])
        filled = GaugeMetricFamily("pagedserve_kv_slots_filled_ratio",
                                   "Tokens stored / token slots of the device blocks in use "
                                   "(paging keeps this near 1)", labels=["worker"])
        blocks = GaugeMetricFamily("pagedserve_kv_blocks", "KV blocks by pool and state",
                                   labels=["worker", "pool", "state"])
        hit_rate = GaugeMetricFamily("pagedserve_prefix_cache_hit_rate",
                                     "Prompt tokens found in the prefix cache / prompt tokens looked up",
                                     labels=["worker"])
        queried = CounterMetricFamily("pagedserve_prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache", labels=["worker"])
        hits = CounterMetricFamily("pagedserve_prefix_cache_hits",
                                   "Prompt tokens found in the prefix cache", labels=["worker"])
        preemptions = CounterMetricFamily("pagedserve_preemptions", "Sequences preempted",
                                          labels=["worker", "mode"])
        swaps = CounterMetricFamily("pagedserve_swapped_blocks", "KV blocks swapped between pools",
                                    labels=["worker", "direction"])
        for worker_id, pool in sorted(pools.items()):
            num_blocks = pool.get("num_device_blocks", 0)
            usage.add_metric([worker_id], pool.get("device_blocks_used", 0) / num_blocks if num_blocks else 0.0)
            filled.add_metric([worker_id], pool.get("kv_utilization", 0.0))
            for tier in ("device", "host"):
                for state in ("used", "free", "cached"):
                    blocks.add_metric([worker_id, tier, state], pool.get(f"{tier}_blocks_{state}", 0))
            hit_rate.add_metric([worker_id], pool.get("prefix_cache_hit_rate", 0.0))
            queried.add_metric([worker_id], pool.get("num_prefix_query_tokens", 0))
            hits.add_metric([worker_id], pool.get("num_prefix_hit_tokens", 0))
            for mode in ("swap", "recompute", "migrate"):
                preemptions.add_metric([worker_id, mode], pool.get(f"num_preemptions_{mode}", 0))
            swaps.add_metric([worker_id, "out"], pool.get("num_blocks_swapped_out", 0))
            swaps.add_metric([worker_id, "in"], pool.get("num_blocks_swapped_in", 0))
        yield from (running, waiting, healthy, usage, filled, blocks, hit_rate, queried, hits, preemptions, swaps)


class ServerMetrics:
    """Counters and histograms of one server, rendered with a cluster stats snapshot."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        self._cluster = _ClusterStatsCollector()
        self.registry.register(self._cluster)
        labels = ["model"]
        self.in_flight = Gauge("pagedserve_server_requests_in_flight",
                               "Requests admitted by this server and not yet finished", labels,
                               registry=self.registry)
        self.requests = Counter("pagedserve_server_requests", "Requests answered, by API and status",
                                ["model", "api", "status"], registry=self.registry)
        self.finished = Counter("pagedserve_request_success", "Generations finished, by finish reason",
                                ["model", "finish_reason"], registry=self.registry)
        self.prompt_tokens = Counter("pagedserve_prompt_tokens", "Prompt tokens of finished requests",
                                     labels, registry=self.registry)
        self.cached_tokens = Counter("pagedserve_prompt_cached_tokens",
                                     "Prompt tokens served from the prefix cache", labels,
                                     registry=self.registry)
        self.generation_tokens = Counter("pagedserve_generation_tokens", "Generated tokens", labels,
                                         registry=self.registry)
        self.ttft = Histogram("pagedserve_time_to_first_token_seconds", "Time to first token",
                              labels, buckets=TTFT_BUCKETS, registry=self.registry)
        self.tpot = Histogram("pagedserve_time_per_output_token_seconds",
                              "Mean time per output token after the first", labels,
                              buckets=TPOT_BUCKETS, registry=self.registry)
        self.e2e = Histogram("pagedserve_e2e_request_latency_seconds", "End-to-end request latency",
                             labels, buckets=E2E_BUCKETS, registry=self.registry)
        self.in_flight.labels(model_name).set(0)
        # Export zeroed series from the start, so dashboards and scrapers see them before traffic.
        for metric in (self.prompt_tokens, self.cached_tokens, self.generation_tokens,
                       self.ttft, self.tpot, self.e2e):
            metric.labels(model_name)

    def set_in_flight(self, num_requests: int) -> None:
        self.in_flight.labels(self.model_name).set(num_requests)

    def observe_response(self, api: str, status: int) -> None:
        self.requests.labels(self.model_name, api, str(status)).inc()

    def observe_generation(self, arrival: float, first_token: float | None, finished: float,
                           num_prompt_tokens: int, num_cached_tokens: int, num_generated_tokens: int,
                           finish_reasons: list[str]) -> None:
        """Record one finished prompt's generation (all its ``n`` samples)."""
        model = self.model_name
        self.prompt_tokens.labels(model).inc(num_prompt_tokens)
        self.cached_tokens.labels(model).inc(num_cached_tokens)
        self.generation_tokens.labels(model).inc(num_generated_tokens)
        for reason in finish_reasons:
            self.finished.labels(model, reason or "unknown").inc()
        self.e2e.labels(model).observe(finished - arrival)
        if first_token is not None:
            self.ttft.labels(model).observe(first_token - arrival)
            num_samples = max(1, len(finish_reasons))
            per_sample = num_generated_tokens / num_samples
            if per_sample > 1:
                self.tpot.labels(model).observe((finished - first_token) / (per_sample - 1))

    def render(self, stats: dict) -> bytes:
        """The exposition text, with cluster figures from ``stats`` (``collect_stats``' shape)."""
        self._cluster.stats = stats
        try:
            return generate_latest(self.registry)
        finally:
            self._cluster.stats = {}
