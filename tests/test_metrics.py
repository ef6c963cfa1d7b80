"""``ServerMetrics``' exposition: pagedserve's own names and vLLM's, so that a
dashboard built for vLLM reads pagedserve unchanged. No Ray, no engine: a
stats snapshot in ``gather_stats``' shape and hand-made observations."""

from __future__ import annotations

import pytest

pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from pagedserve.cluster.serving.metrics import ServerMetrics  # noqa: E402

MODEL = "m"
STATS = {
    "workers": {"worker-0": {"is_healthy": True, "num_running": 3, "num_waiting": 2},
                "worker-1": {"is_healthy": True, "num_running": 1, "num_waiting": 0}},
    "kv_manager": {"workers": {
        "worker-0": {"num_device_blocks": 100, "device_blocks_used": 25, "num_prefix_query_tokens": 40,
                     "num_prefix_hit_tokens": 16, "num_preemptions_swap": 1, "num_preemptions_recompute": 2},
        "worker-1": {"num_device_blocks": 50, "device_blocks_used": 50}}},
}
# Every series the panels of vLLM's example Grafana dashboards (prometheus_grafana, the
# overview/performance/query-statistics dashboards) query, as the sample names they read.
VLLM_DASHBOARD_SERIES = [
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
    "vllm:num_preemptions_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
    "vllm:request_success_total",
    *(f"{name}_{suffix}" for name in (
        "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
        "vllm:time_per_output_token_seconds", "vllm:request_time_per_output_token_seconds",
        "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
        "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
        "vllm:request_inference_time_seconds", "vllm:request_prompt_tokens",
        "vllm:request_generation_tokens", "vllm:request_max_num_generation_tokens",
        "vllm:request_params_n", "vllm:request_params_max_tokens")
      for suffix in ("bucket", "sum", "count")),
]


def _samples(metrics: ServerMetrics, stats: dict = STATS) -> dict[str, list]:
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(metrics.render(stats).decode()):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    return samples


def _value(samples, name: str, **labels) -> float:
    matching = [s.value for s in samples[name] if all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(matching) == 1, (name, labels, samples.get(name))
    return matching[0]


def test_every_vllm_dashboard_series_is_exported_before_any_traffic():
    samples = _samples(ServerMetrics(MODEL))
    missing = [name for name in VLLM_DASHBOARD_SERIES
               if name != "vllm:request_success_total" and name not in samples]
    assert not missing
    for name in VLLM_DASHBOARD_SERIES:
        for sample in samples.get(name, []):
            assert sample.labels["model_name"] == MODEL, (name, sample.labels)


def test_vllm_gauges_and_counters_per_worker_equal_pagedserve_figures():
    samples = _samples(ServerMetrics(MODEL))
    assert _value(samples, "vllm:num_requests_running", engine="worker-0") == 3
    assert _value(samples, "vllm:num_requests_waiting", engine="worker-0") == 2
    assert _value(samples, "vllm:num_requests_running", engine="worker-1") == 1
    assert _value(samples, "vllm:kv_cache_usage_perc", engine="worker-0") == pytest.approx(0.25)
    assert _value(samples, "vllm:kv_cache_usage_perc", engine="worker-1") == pytest.approx(1.0)
    assert _value(samples, "vllm:prefix_cache_queries_total", engine="worker-0") == 40
    assert _value(samples, "vllm:prefix_cache_hits_total", engine="worker-0") == 16
    assert _value(samples, "vllm:num_preemptions_total", engine="worker-0") == 3
    for worker in ("worker-0", "worker-1"):
        assert (_value(samples, "vllm:kv_cache_usage_perc", engine=worker)
                == _value(samples, "pagedserve_kv_cache_usage_ratio", worker=worker))


def test_observations_appear_under_both_names_once():
    metrics = ServerMetrics(MODEL)
    metrics.observe_generation(arrival=10.0, first_token=10.5, finished=12.5, num_prompt_tokens=30,
                               num_cached_tokens=16, num_generated_tokens=9, finish_reasons=["stop", "length"],
                               max_tokens=8, max_sample_tokens=5)
    metrics.observe_inter_token(0.3, 3)   # three tokens in one delta: three intervals of 0.1 s
    metrics.observe_inter_token(0.02, 1)
    metrics.observe_phases(arrival=100.0, first_scheduled=100.25, first_token=100.75, finished=102.0)
    samples = _samples(metrics)
    for ours, theirs in (("pagedserve_prompt_tokens_total", "vllm:prompt_tokens_total"),
                         ("pagedserve_generation_tokens_total", "vllm:generation_tokens_total"),
                         ("pagedserve_inter_token_latency_seconds_count", "vllm:inter_token_latency_seconds_count"),
                         ("pagedserve_inter_token_latency_seconds_sum", "vllm:inter_token_latency_seconds_sum"),
                         ("pagedserve_request_queue_time_seconds_sum", "vllm:request_queue_time_seconds_sum")):
        assert _value(samples, ours, model=MODEL) == _value(samples, theirs, model_name=MODEL)
    assert _value(samples, "vllm:prompt_tokens_total", model_name=MODEL) == 30
    assert _value(samples, "vllm:generation_tokens_total", model_name=MODEL) == 9
    assert _value(samples, "vllm:request_success_total", model_name=MODEL, finished_reason="stop") == 1
    assert _value(samples, "vllm:request_success_total", model_name=MODEL, finished_reason="length") == 1
    assert _value(samples, "vllm:inter_token_latency_seconds_count", model_name=MODEL) == 4
    assert _value(samples, "vllm:inter_token_latency_seconds_sum", model_name=MODEL) == pytest.approx(0.32)
    assert _value(samples, "vllm:inter_token_latency_seconds_bucket", model_name=MODEL, le="0.02") == 1
    assert _value(samples, "vllm:inter_token_latency_seconds_bucket", model_name=MODEL, le="0.1") == 4
    assert _value(samples, "vllm:request_queue_time_seconds_sum", model_name=MODEL) == pytest.approx(0.25)
    assert _value(samples, "vllm:request_prefill_time_seconds_sum", model_name=MODEL) == pytest.approx(0.5)
    assert _value(samples, "vllm:request_decode_time_seconds_sum", model_name=MODEL) == pytest.approx(1.25)
    assert _value(samples, "vllm:request_inference_time_seconds_sum", model_name=MODEL) == pytest.approx(1.75)
    assert _value(samples, "vllm:time_to_first_token_seconds_sum", model_name=MODEL) == pytest.approx(0.5)
    assert _value(samples, "vllm:e2e_request_latency_seconds_sum", model_name=MODEL) == pytest.approx(2.5)
    assert _value(samples, "vllm:request_params_n_sum", model_name=MODEL) == 2
    assert _value(samples, "vllm:request_params_max_tokens_sum", model_name=MODEL) == 8
    assert _value(samples, "vllm:request_max_num_generation_tokens_sum", model_name=MODEL) == 5


def test_a_request_never_scheduled_records_no_phase():
    metrics = ServerMetrics(MODEL)
    metrics.observe_phases(arrival=1.0, first_scheduled=None, first_token=None, finished=2.0)
    metrics.observe_inter_token(0.1, 0)
    samples = _samples(metrics)
    assert _value(samples, "vllm:request_queue_time_seconds_count", model_name=MODEL) == 0
    assert _value(samples, "vllm:inter_token_latency_seconds_count", model_name=MODEL) == 0
