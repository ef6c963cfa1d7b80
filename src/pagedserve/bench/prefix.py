"""``bench prefix``: time to first token with and without prefix caching.

Every request is one shared system prompt (``prefix_len`` tokens) plus a
unique suffix (``suffix_len`` tokens). The same requests run on two engines
that differ only in ``enable_prefix_caching``, alternately, so that both
see the same load from anything else on the machine. By default requests go one
at a time (``max_concurrency=1``), so TTFT is the prefill itself and not
queueing. The measured hit rate is compared with the most an unbounded
cache could reach on the same prompts (``max_prefix_hit_rate``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from .plots import plot_bars, plot_cdfs
from .replay import build_engine, model_vocab_size, replay, resolve_model, warm_up
from .report import format_table, progress_bar, summarize, torch_threads, write_json
from .workload import make_shared_prefix_workload, max_prefix_hit_rate

TARGET_SPEEDUP = 5.0


@dataclass(frozen=True)
class PrefixBenchConfig:
    model: str | None = None
    arch: str = "llama"
    size: str = "small"
    num_requests: int = 32
    prefix_len: int = 1024
    suffix_len: int = 64
    max_tokens: int = 8
    block_size: int = 16
    max_model_len: int = 2048
    num_device_blocks: int = 1024
    max_concurrency: int = 1
    seed: int = 0
    num_threads: int = 1


DEFAULT_CONFIG = PrefixBenchConfig()
# The small model (2048 positions) with the full 1,024-token prefix, fewer requests.
QUICK_CONFIG = dataclasses.replace(DEFAULT_CONFIG, num_requests=8)


def _summary_ms(values) -> dict:
    return {k: v * 1e3 for k, v in summarize(values).items()}


def run_benchmark(config: PrefixBenchConfig = DEFAULT_CONFIG, out: str | None = None,
                  plot_dir: str | None = None, show_progress: bool = True) -> dict:
    """Run the workload on an engine with caching off and one with it on, alternating
    ``max_concurrency`` requests at a time; write JSON and plots.

    Returns ``{"config", "caching_off", "caching_on", "ttft_speedup",
    "ttft_speedup_warm", "ttft_speedup_p50", "theoretical_max_hit_rate",
    "target_speedup", "meets_target"}``; each ``caching_*`` has ``ttft_ms`` and
    ``ttft_warm_ms`` (mean/std/p50/p90/p99), ``e2e_ms``, ``prefix_hit_rate``,
    ``mean_cached_tokens`` and ``num_errors``. The ``_warm`` figures leave out
    the first request, which no cache can help; ``meets_target`` uses them.
    """
    with torch_threads(config.num_threads):
        return _run_benchmark(config, out, plot_dir, show_progress)


def _run_benchmark(config, out, plot_dir, show_progress) -> dict:
    model = resolve_model(config.model, config.arch, config.size)
    requests = make_shared_prefix_workload(config.num_requests, model_vocab_size(model),
                                           prefix_len=config.prefix_len, suffix_len=config.suffix_len,
                                           max_tokens=config.max_tokens, seed=config.seed)
    labels = {"caching_off": False, "caching_on": True}
    engines = {}
    for label, enabled in labels.items():
        engines[label] = build_engine(model, enable_prefix_caching=enabled,
                                      num_device_blocks=config.num_device_blocks, block_size=config.block_size,
                                      max_model_len=config.max_model_len)
        warm_up(engines[label])
    before = {label: engine.stats() for label, engine in engines.items()}
    ordered: dict[str, list] = {label: [] for label in labels}
    chunk = config.max_concurrency
    # Alternate between the engines, a chunk of requests at a time, so that both
    # see the same load from anything else running on the machine.
    with progress_bar(2 * len(requests), "prefix", disable=not show_progress) as bar:
        for first in range(0, len(requests), chunk):
            for label, engine in engines.items():
                result = replay(engine, requests[first:first + chunk], max_concurrency=chunk,
                                on_finish=lambda _: bar.update(1), id_prefix=f"{label}-{first}")
                ordered[label] += sorted(result.records, key=lambda rec: int(rec.request_id.rsplit("-", 1)[1]))
    hit_rates = {}
    for label, engine in engines.items():
        engine.check_integrity()
        after = engine.stats()
        queries = after["num_prefix_query_tokens"] - before[label]["num_prefix_query_tokens"]
        hits = after["num_prefix_hit_tokens"] - before[label]["num_prefix_hit_tokens"]
        hit_rates[label] = hits / queries if queries else 0.0
    data: dict = {"config": {k: v for k, v in dataclasses.asdict(config).items()}}
    for label, records in ordered.items():
        ttfts = [r.ttft_s for r in records]
        data[label] = {
            "ttft_ms": _summary_ms(ttfts),
            "ttft_warm_ms": _summary_ms(ttfts[1:]),
            "e2e_ms": _summary_ms([r.e2e_s for r in records]),
            "prefix_hit_rate": hit_rates[label],
            "mean_cached_tokens": sum(r.num_cached_tokens for r in records) / max(1, len(records)),
            "num_errors": sum(r.is_error for r in records),
        }
    off, on = data["caching_off"], data["caching_on"]
    data["ttft_speedup"] = off["ttft_ms"]["mean"] / on["ttft_ms"]["mean"]
    data["ttft_speedup_warm"] = (off["ttft_warm_ms"]["mean"] / on["ttft_warm_ms"]["mean"]
                                 if len(requests) > 1 else math.nan)
    data["ttft_speedup_p50"] = off["ttft_ms"]["p50"] / on["ttft_ms"]["p50"]
    data["theoretical_max_hit_rate"] = max_prefix_hit_rate([r.prompt_token_ids for r in requests],
                                                           config.block_size)
    data["target_speedup"] = TARGET_SPEEDUP
    # The first request finds nothing cached under any policy: the target is the steady state.
    data["meets_target"] = data["ttft_speedup_warm"] >= TARGET_SPEEDUP
    write_json(out, data)
    if plot_dir:
        write_plots(plot_dir, data, ordered)
    return data


def format_results(data: dict) -> str:
    config = data["config"]
    rows = [[label.replace("_", " "), s["ttft_ms"]["mean"], s["ttft_ms"]["p50"], s["ttft_ms"]["p99"],
             s["ttft_warm_ms"]["mean"], f"{s['prefix_hit_rate']:.1%}", s["mean_cached_tokens"]]
            for label, s in ((k, data[k]) for k in ("caching_off", "caching_on"))]
    return "\n".join([
        f"prefix: {config['num_requests']} requests, {config['prefix_len']}-token shared prefix + "
        f"{config['suffix_len']}-token unique suffix, concurrency {config['max_concurrency']}, "
        f"model {config['model'] or config['arch'] + '-' + config['size']}",
        format_table(["prefix caching", "TTFT mean ms", "p50 ms", "p99 ms", "mean ms (excl. 1st)",
                      "hit rate", "cached tok/req"], rows),
        f"TTFT speedup {data['ttft_speedup_warm']:.1f}x after the first request "
        f"({data['ttft_speedup']:.1f}x counting it, {data['ttft_speedup_p50']:.1f}x at p50; target >= {data['target_speedup']:.0f}x: "
        f"{'met' if data['meets_target'] else 'NOT met'}); hit rate "
        f"{data['caching_on']['prefix_hit_rate']:.1%} of a theoretical maximum "
        f"{data['theoretical_max_hit_rate']:.1%}",
    ])


def write_plots(plot_dir: str, data: dict, ordered: dict) -> list:
    from pathlib import Path

    plot_dir = Path(plot_dir)
    labels = {"caching_off": "caching off", "caching_on": "caching on"}
    return [
        plot_cdfs({"time to first token": {labels[k]: [r.ttft_s for r in recs] for k, recs in ordered.items()},
                   "end-to-end latency": {labels[k]: [r.e2e_s for r in recs] for k, recs in ordered.items()}},
                  plot_dir / "prefix_latency_cdf.png", "shared system prompt: latency with and without prefix caching"),
        plot_bars({"mean TTFT (ms)": {labels[k]: data[k]["ttft_ms"]["mean"] for k in labels},
                   "prefix hit rate": {labels[k]: data[k]["prefix_hit_rate"] for k in labels}
                   | {"theoretical max": data["theoretical_max_hit_rate"]}},
                  plot_dir / "prefix_comparison.png", "prefix caching"),
    ]
