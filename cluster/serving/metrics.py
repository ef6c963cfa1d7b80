"""Prometheus metrics of one server replica, in the text exposition format.

Latency histograms and request counters are observed by the server as
requests finish (server-side clock: from the request's arrival at the
replica), inter-token latencies as tokens arrive; queue, prefill and decode
times come from the worker's own request timings. Queue, KV and cache
figures are read from a stats snapshot of the KV manager and the workers at
scrape time. Each ``ServerMetrics`` owns its ``CollectorRegistry``, so
several servers in one process never collide.

Every figure is also exported under vLLM's name (``vllm:num_requests_running``,
``vllm:kv_cache_usage_perc``, ``vllm:time_to_first_token_seconds``, ...) with
vLLM's labels (``model_name``; ``engine`` = the worker for per-worker
figures), so a dashboard built for vLLM works unchanged. The aliases are
the same observations renamed at scrape time (``VLLM_ALIASES``), not a second
set of histograms.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from typing import NamedTuple

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's bounds: a dashboard built for vLLM reads these unchanged, and a queue's tail (seconds to
# minutes) keeps its resolution.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
PHASE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                 120.0, 300.0)
TOKEN_COUNT_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)
N_BUCKETS = (1, 2, 5, 10, 20)

# pagedserve's metric -> vLLM's name for the same figure (exported under both).
VLLM_ALIASES = {
    "pagedserve_prompt_tokens": "vllm:prompt_tokens",
    "pagedserve_generation_tokens": "vllm:generation_tokens",
    "pagedserve_request_success": "vllm:request_success",
    "pagedserve_time_to_first_token_seconds": "vllm:time_to_first_token_seconds",
    "pagedserve_inter_token_latency_seconds": "vllm:inter_token_latency_seconds",
    "pagedserve_time_per_output_token_seconds": "vllm:request_time_per_output_token_seconds",
    "pagedserve_e2e_request_latency_seconds": "vllm:e2e_request_latency_seconds",
    "pagedserve_request_queue_time_seconds": "vllm:request_queue_time_seconds",
    "pagedserve_request_prefill_time_seconds": "vllm:request_prefill_time_seconds",
    "pagedserve_request_decode_time_seconds": "vllm:request_decode_time_seconds",
    "pagedserve_request_inference_time_seconds": "vllm:request_inference_time_seconds",
    "pagedserve_request_prompt_tokens": "vllm:request_prompt_tokens",
    "pagedserve_request_generation_tokens": "vllm:request_generation_tokens",
    "pagedserve_request_max_num_generation_tokens": "vllm:request_max_num_generation_tokens",
    "pagedserve_request_params_n": "vllm:request_params_n",
    "pagedserve_request_params_max_tokens": "vllm:request_params_max_tokens",
}
VLLM_LABELS = {"model": "model_name", "finish_reason": "finished_reason"}
# Older vLLM dashboards read these names for the same figures.
VLLM_LEGACY_ALIASES = {
    "pagedserve_inter_token_latency_seconds": "vllm:time_per_output_token_seconds",
}


class _ClusterStatsCollector:
    """Yields gauges and counters from the latest stats snapshot (see ``cluster.stats.gather_stats``)."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.stats: dict = {}

    def collect(self):
        yield from self._collect_pagedserve()
        yield from self._collect_vllm()

    def _collect_vllm(self):
        """vLLM's per-engine gauges and counters (``engine`` = the worker id)."""
        labels = ["model_name", "engine"]
        running = GaugeMetricFamily("vllm:num_requests_running",
                                    "Number of requests in model execution batches.", labels=labels)
        waiting = GaugeMetricFamily("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                                    labels=labels)
        usage = GaugeMetricFamily("vllm:kv_cache_usage_perc",
                                  "KV-cache usage. 1 means 100 percent usage.", labels=labels)
        legacy_usage = GaugeMetricFamily("vllm:gpu_cache_usage_perc",
                                         "KV-cache usage. 1 means 100 percent usage (older name).",
                                         labels=labels)
        queries = CounterMetricFamily("vllm:prefix_cache_queries",
                                      "Prefix cache queries, in terms of number of queried tokens.",
                                      labels=labels)
        hits = CounterMetricFamily("vllm:prefix_cache_hits",
                                   "Prefix cache hits, in terms of number of cached tokens.", labels=labels)
        preemptions = CounterMetricFamily("vllm:num_preemptions", "Cumulative number of preemptions.",
                                          labels=labels)
        drafts = CounterMetricFamily("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.",
                                     labels=labels)
        draft_tokens = CounterMetricFamily("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.",
                                           labels=labels)
        accepted = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.",
                                       labels=labels)
        per_position = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                           "Accepted tokens per draft position.", labels=labels + ["position"])
        lora_info = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                                      labels=labels + ["max_lora", "waiting_lora_adapters", "running_lora_adapters"])
        for worker_id, stats in sorted(self.stats.get("workers", {}).items()):
            key = [self.model_name, worker_id]
            if "num_running" in stats:
                running.add_metric(key, stats["num_running"])
                waiting.add_metric(key, stats["num_waiting"])
            if "spec_decode_num_drafts" in stats:
                drafts.add_metric(key, stats["spec_decode_num_drafts"])
                draft_tokens.add_metric(key, stats["spec_decode_num_draft_tokens"])
                accepted.add_metric(key, stats["spec_decode_num_accepted_tokens"])
                for position, count in enumerate(stats["spec_decode_num_accepted_tokens_per_pos"]):
                    per_position.add_metric(key + [str(position)], count)
            lora = stats.get("lora")
            if lora:   # vLLM's: the value is when the figures were taken
                lora_info.add_metric(key + [str(lora["max_loras"]), ",".join(lora["waiting_adapters"]),
                                            ",".join(lora["running_adapters"])], self.stats.get("time", time.time()))
        for worker_id, pool in sorted(self.stats.get("kv_manager", {}).get("workers", {}).items()):
            key = [self.model_name, worker_id]
            num_blocks = pool.get("num_device_blocks", 0)
            fraction = pool.get("device_blocks_used", 0) / num_blocks if num_blocks else 0.0
            usage.add_metric(key, fraction)
            legacy_usage.add_metric(key, fraction)
            queries.add_metric(key, pool.get("num_prefix_query_tokens", 0))
            hits.add_metric(key, pool.get("num_prefix_hit_tokens", 0))
            preemptions.add_metric(key, sum(pool.get(f"num_preemptions_{mode}", 0)
                                            for mode in ("swap", "recompute", "migrate")))
        yield from (running, waiting, usage, legacy_usage, queries, hits, preemptions, drafts, draft_tokens, accepted,
                    per_position, lora_info)

    def _collect_pagedserve(self):
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


class _SeriesHistogram:
    """A histogram of one series (``labels``) observed in plain Python, for what is observed per
    token: one bisect, where prometheus_client's ``observe`` takes two locks (about 1 us).
    Exported as a ``Histogram``'s series is (``_bucket``, ``_count``, ``_sum``), without
    ``_created``. Observed and read on one event loop."""

    def __init__(self, name: str, documentation: str, labels: dict[str, str], buckets: tuple[float, ...]) -> None:
        self.name = name
        self.documentation = documentation
        self.labels = labels
        self.bounds = list(buckets)
        self.counts = [0] * (len(buckets) + 1)  # per bucket, not cumulative; the last is +Inf
        self.sum = 0.0

    def observe(self, value: float, count: int = 1) -> None:
        """``count`` observations of ``value``."""
        self.counts[bisect_left(self.bounds, value)] += count
        self.sum += value * count

    def collect(self) -> list[HistogramMetricFamily]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=list(self.labels))
        buckets, total = [], 0
        for bound, count in zip([*self.bounds, float("inf")], self.counts):
            total += count
            buckets.append((floatToGoString(bound), total))
        family.add_metric(list(self.labels.values()), buckets, self.sum)
        return [family]


class _VllmAliasCollector:
    """The server's own metrics again under vLLM's names and labels (``VLLM_LABELS``)."""

    def __init__(self, metrics: list, aliases: dict[str, str]) -> None:
        self.metrics = metrics
        self.aliases = aliases

    def collect(self):
        for metric in self.metrics:
            for family in metric.collect():
                name = self.aliases.get(family.name)
                if name is None:
                    continue
                renamed = Metric(name, family.documentation, family.type, family.unit)
                for sample in family.samples:
                    labels = {VLLM_LABELS.get(key, key): value for key, value in sample.labels.items()}
                    renamed.add_sample(name + sample.name[len(family.name):], labels, sample.value,
                                       sample.timestamp, sample.exemplar)
                yield renamed


class _ModelSeries(NamedTuple):
    """The one-model series of ``ServerMetrics``' metrics (each field names its metric's
    attribute), bound to its model's label."""

    in_flight: Gauge
    prompt_tokens: Counter
    cached_tokens: Counter
    generation_tokens: Counter
    ttft: Histogram
    tpot: Histogram
    e2e: Histogram
    queue_time: Histogram
    prefill_time: Histogram
    decode_time: Histogram
    inference_time: Histogram
    request_prompt_tokens: Histogram
    request_generation_tokens: Histogram
    request_max_generation_tokens: Histogram
    request_n: Histogram
    request_max_tokens: Histogram


class ServerMetrics:
    """Counters and histograms of one server, rendered with a cluster stats snapshot."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        self._cluster = _ClusterStatsCollector(model_name)
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
        self.itl = _SeriesHistogram("pagedserve_inter_token_latency_seconds",
                                    "Time between successive output tokens of a sample (as they reach the server)",
                                    {"model": model_name}, ITL_BUCKETS)
        self.registry.register(self.itl)
        self.queue_time = Histogram("pagedserve_request_queue_time_seconds",
                                    "Time a request waited in its worker's queue before its first step",
                                    labels, buckets=PHASE_BUCKETS, registry=self.registry)
        self.prefill_time = Histogram("pagedserve_request_prefill_time_seconds",
                                      "First step to first token, on the worker", labels,
                                      buckets=PHASE_BUCKETS, registry=self.registry)
        self.decode_time = Histogram("pagedserve_request_decode_time_seconds",
                                     "First token to the end, on the worker", labels,
                                     buckets=PHASE_BUCKETS, registry=self.registry)
        self.inference_time = Histogram("pagedserve_request_inference_time_seconds",
                                        "First step to the end, on the worker", labels,
                                        buckets=PHASE_BUCKETS, registry=self.registry)
        self.request_prompt_tokens = Histogram("pagedserve_request_prompt_tokens", "Prompt tokens per request",
                                               labels, buckets=TOKEN_COUNT_BUCKETS, registry=self.registry)
        self.request_generation_tokens = Histogram(
            "pagedserve_request_generation_tokens", "Generated tokens per request (all samples)", labels,
            buckets=TOKEN_COUNT_BUCKETS, registry=self.registry)
        self.request_max_generation_tokens = Histogram(
            "pagedserve_request_max_num_generation_tokens", "Most tokens generated by one sample of a request",
            labels, buckets=TOKEN_COUNT_BUCKETS, registry=self.registry)
        self.request_n = Histogram("pagedserve_request_params_n", "The n parameter of requests", labels,
                                   buckets=N_BUCKETS, registry=self.registry)
        self.request_max_tokens = Histogram("pagedserve_request_params_max_tokens",
                                            "The max_tokens parameter of requests", labels,
                                            buckets=TOKEN_COUNT_BUCKETS, registry=self.registry)
        histograms = [self.ttft, self.tpot, self.e2e, self.itl, self.queue_time, self.prefill_time,
                      self.decode_time, self.inference_time, self.request_prompt_tokens,
                      self.request_generation_tokens, self.request_max_generation_tokens, self.request_n,
                      self.request_max_tokens]
        # The model's series, bound once: ``labels()`` checks and joins its labels under a lock on every
        # call, some 20 calls a request. Binding them also exports them zeroed from the start, so
        # dashboards and scrapers see them before traffic.
        self._series = _ModelSeries(**{name: getattr(self, name).labels(model_name) for name in _ModelSeries._fields})
        self._children: dict[tuple, Counter] = {}   # series of several labels, bound as first seen
        self._series.in_flight.set(0)
        aliased = [self.prompt_tokens, self.generation_tokens, self.finished, *histograms]
        self.registry.register(_VllmAliasCollector(aliased, VLLM_ALIASES))
        self.registry.register(_VllmAliasCollector(aliased, VLLM_LEGACY_ALIASES))

    def set_in_flight(self, num_requests: int) -> None:
        self._series.in_flight.set(num_requests)

    def observe_response(self, api: str, status: int) -> None:
        self._child(self.requests, api, str(status)).inc()

    def _child(self, metric: Counter, *labels: str) -> Counter:
        """``metric``'s series for this model and ``labels``, bound once."""
        key = (metric, *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(self.model_name, *labels)
        return child

    def observe_inter_token(self, interval_s: float, num_tokens: int) -> None:
        """``num_tokens`` new tokens of one sample arrived ``interval_s`` after its previous ones:
        each counts as one inter-token interval of ``interval_s / num_tokens``."""
        if num_tokens <= 0 or interval_s < 0:
            return
        self.itl.observe(interval_s / num_tokens, num_tokens)

    def observe_phases(self, arrival: float, first_scheduled: float | None, first_token: float | None,
                       finished: float | None) -> None:
        """Queue, prefill, decode and inference times from a worker's request timings (its clock)."""
        if first_scheduled is None:
            return
        series = self._series
        series.queue_time.observe(max(0.0, first_scheduled - arrival))
        if first_token is not None:
            series.prefill_time.observe(max(0.0, first_token - first_scheduled))
            if finished is not None:
                series.decode_time.observe(max(0.0, finished - first_token))
        if finished is not None:
            series.inference_time.observe(max(0.0, finished - first_scheduled))

    def observe_generation(self, arrival: float, first_token: float | None, finished: float,
                           num_prompt_tokens: int, num_cached_tokens: int, num_generated_tokens: int,
                           finish_reasons: list[str], max_tokens: int | None = None,
                           max_sample_tokens: int | None = None) -> None:
        """Record one finished prompt's generation (all its ``n`` samples)."""
        series = self._series
        series.prompt_tokens.inc(num_prompt_tokens)
        series.cached_tokens.inc(num_cached_tokens)
        series.generation_tokens.inc(num_generated_tokens)
        for reason in finish_reasons:
            self._child(self.finished, reason or "unknown").inc()
        series.request_prompt_tokens.observe(num_prompt_tokens)
        series.request_generation_tokens.observe(num_generated_tokens)
        series.request_n.observe(max(1, len(finish_reasons)))
        if max_tokens is not None:
            series.request_max_tokens.observe(max_tokens)
        if max_sample_tokens is not None:
            series.request_max_generation_tokens.observe(max_sample_tokens)
        series.e2e.observe(finished - arrival)
        if first_token is not None:
            series.ttft.observe(first_token - arrival)
            num_samples = max(1, len(finish_reasons))
            per_sample = num_generated_tokens / num_samples
            if per_sample > 1:
                series.tpot.observe((finished - first_token) / (per_sample - 1))

    def render(self, stats: dict) -> bytes:
        """The exposition text, with cluster figures from ``stats`` (``cluster.stats.gather_stats``' shape)."""
        self._cluster.stats = stats
        try:
            return generate_latest(self.registry)
        finally:
            self._cluster.stats = {}
