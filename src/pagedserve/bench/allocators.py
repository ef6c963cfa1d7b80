"""``bench allocators``: contiguous vs paged vs paged+prefix on one engine and one KV budget.

The same mixed workload (shared system prompts, varied prompt and output
lengths) runs three times on the same model with the same number of device
blocks, and the engine is sampled after every step:

* ``contiguous``: each sequence reserves ``ceil(max_model_len / block_size)``
  consecutive blocks, first fit, as per-request buffers do; no sharing.
* ``paged``: blocks on demand from anywhere in the pool; prefix caching off.
* ``paged+prefix``: paged, with prefix caching on.

It then runs the seed's fragmentation simulation (``fragmentation.py``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from .fragmentation import fragmentation_report
from .plots import plot_bars, plot_cdfs, plot_lines
from .replay import build_engine, model_vocab_size, replay, resolve_model, warm_up
from .report import format_table, percentile, progress_bar, torch_threads, write_json
from .workload import LengthDist, make_mixed_workload

# name -> (EngineConfig.allocation, enable_prefix_caching)
ALLOCATORS = {"contiguous": ("contiguous", False), "paged": ("paged", False), "paged+prefix": ("paged", True)}

# The seed's table (001_8faa1a7ac5ddf314.txt, "Illustrative results (mixed workload)").
SEED_TABLE = {
    "contiguous": {"kv_utilization": 0.65, "relative_throughput": 1.0, "p99_latency_s": 0.480},
    "paged": {"kv_utilization": 0.94, "relative_throughput": 1.8, "p99_latency_s": 0.180},
    "paged+prefix": {"kv_utilization": 0.96, "relative_throughput": 2.0, "p99_latency_s": 0.160},
}

ROW_KEYS = ("allocator", "kv_utilization", "max_concurrent", "preemptions", "p99_latency_s", "throughput_tok_s")


@dataclass(frozen=True)
class FragmentationScenario:
    name: str
    num_blocks: int
    max_alloc_blocks: int = 256
    free_probability: float = 0.4


# The seed's parameters (80 GB in 1 MB blocks), and the same stream on a 16 GB
# heap, which runs full: the regime a loaded server lives in.
FRAGMENTATION_SCENARIOS = (FragmentationScenario("seed_config", 81920),
                           FragmentationScenario("under_pressure", 16384))


@dataclass(frozen=True)
class AllocatorBenchConfig:
    """Workload, engine and KV budget of one ``bench allocators`` run."""

    model: str | None = None            # checkpoint; default: the built ``arch``/``size`` model
    arch: str = "llama"
    size: str = "small"
    num_requests: int = 96
    num_device_blocks: int = 512
    block_size: int = 16
    max_model_len: int = 1024
    prompt_len: LengthDist = LengthDist(mean=160, low=16, high=400)    # unique part
    output_len: LengthDist = LengthDist(mean=64, low=16, high=160)
    num_prefixes: int = 4
    prefix_len: int = 128
    shared_fraction: float = 0.75
    request_rate: float = math.inf      # requests/s, Poisson; inf: all at once
    max_num_seqs: int = 256
    repeats: int = 1                    # runs per allocator, round robin; rows are the medians
    seed: int = 0
    num_threads: int = 1
    fragmentation_trials: int = 5
    fragmentation_ops: tuple[int, ...] = (100, 500, 1000)
    fragmentation_scenarios: tuple[FragmentationScenario, ...] = FRAGMENTATION_SCENARIOS
    allocators: tuple[str, ...] = tuple(ALLOCATORS)
    extra_engine_options: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        unknown = [a for a in self.allocators if a not in ALLOCATORS]
        if unknown:
            raise ValueError(f"unknown allocator(s) {unknown}; choose from {list(ALLOCATORS)}")
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")


DEFAULT_CONFIG = AllocatorBenchConfig()
# Under 3 minutes on the 2-core VM: the tiny model (max 512 positions), lengths scaled to fit.
QUICK_CONFIG = dataclasses.replace(
    DEFAULT_CONFIG, size="tiny", num_requests=64, num_device_blocks=256, max_model_len=512,
    prompt_len=LengthDist(mean=80, low=8, high=200), output_len=LengthDist(mean=40, low=8, high=96),
    prefix_len=64, repeats=3, fragmentation_trials=2)


def run_allocator(model: str, name: str, requests, config: AllocatorBenchConfig, on_finish=None):
    """Serve ``requests`` under allocator ``name``; returns the ``ReplayResult``."""
    allocation, enable_prefix_caching = ALLOCATORS[name]
    engine = build_engine(model, allocation=allocation, enable_prefix_caching=enable_prefix_caching,
                          num_device_blocks=config.num_device_blocks, block_size=config.block_size,
                          max_model_len=config.max_model_len, max_num_seqs=config.max_num_seqs,
                          **config.extra_engine_options)
    warm_up(engine)
    result = replay(engine, requests, on_finish=on_finish, id_prefix=name)
    engine.check_integrity()
    if engine.num_used_blocks():
        raise RuntimeError(f"{name}: {engine.num_used_blocks()} blocks still in use after the run")
    return result


def result_row(name: str, result) -> dict:
    """One JSON row: exactly ``ROW_KEYS``."""
    latencies = [r.e2e_s for r in result.records if not r.is_error]
    return {"allocator": name, "kv_utilization": result.mean_kv_utilization,
            "max_concurrent": result.max_concurrent, "preemptions": result.num_preemptions,
            "p99_latency_s": percentile(latencies, 99), "throughput_tok_s": result.throughput_tok_s}


def median_row(rows: list[dict]) -> dict:
    """The per-metric median of repeated runs' rows (the lower middle for an even count,
    so every value is one that was measured)."""
    def middle(values):
        return sorted(values)[(len(values) - 1) // 2]

    return {key: rows[0][key] if key == "allocator" else middle([row[key] for row in rows]) for key in ROW_KEYS}


def run_benchmark(config: AllocatorBenchConfig = DEFAULT_CONFIG, out: str | None = None,
                  plot_dir: str | None = None, show_progress: bool = True,
                  run_fragmentation: bool = True) -> dict:
    """Run every allocator and the fragmentation simulation; write JSON and plots.

    Returns ``{"rows": [...], "fragmentation": {...}}`` (the JSON written to ``out``).
    """
    with torch_threads(config.num_threads):
        return _run_benchmark(config, out, plot_dir, show_progress, run_fragmentation)


def _run_benchmark(config, out, plot_dir, show_progress, run_fragmentation) -> dict:
    model = resolve_model(config.model, config.arch, config.size)
    requests = make_mixed_workload(
        config.num_requests, model_vocab_size(model), config.max_model_len, prompt_len=config.prompt_len,
        output_len=config.output_len, num_prefixes=config.num_prefixes, prefix_len=config.prefix_len,
        shared_fraction=config.shared_fraction, request_rate=config.request_rate, seed=config.seed)
    num_frag_runs = config.fragmentation_trials * len(config.fragmentation_scenarios) if run_fragmentation else 0
    runs: dict[str, list] = {name: [] for name in config.allocators}
    fragmentation: dict = {}
    traces = {}
    with progress_bar(len(requests) * len(config.allocators) * config.repeats + num_frag_runs, "allocators",
                      disable=not show_progress) as bar:
        # Round robin, so that load from other processes hits every allocator alike.
        for repeat in range(config.repeats):
            for name in config.allocators:
                bar.set_description(f"{name} ({repeat + 1}/{config.repeats})")
                runs[name].append(run_allocator(model, name, requests, config,
                                                on_finish=lambda _: bar.update(1)))
        if run_fragmentation:
            bar.set_description("fragmentation")
            fragmentation, traces = run_fragmentation_scenarios(config, progress=bar)
    rows = [median_row([result_row(name, result) for result in results]) for name, results in runs.items()]
    # Plots show, per allocator, the run whose throughput is the median.
    results = {}
    for (name, name_runs), row in zip(runs.items(), rows):
        throughputs = [r.throughput_tok_s for r in name_runs]
        results[name] = name_runs[throughputs.index(row["throughput_tok_s"])]
    data = {"rows": rows, "fragmentation": fragmentation}
    write_json(out, data)
    if plot_dir:
        write_plots(plot_dir, data, results, traces)
    return data


def run_fragmentation_scenarios(config: AllocatorBenchConfig, progress=None) -> tuple[dict, dict]:
    """The fragmentation report per scenario, with the definition and the seed's figures."""
    from .fragmentation import DEFINITION, SEED_FRAGMENTATION

    report: dict = {"definition": DEFINITION,
                    "seed_reference": {"contiguous_peak_at_ops": {str(k): v for k, v in
                                                                  SEED_FRAGMENTATION["contiguous"].items()},
                                       "paged": SEED_FRAGMENTATION["paged"]}}
    traces = {}
    for scenario in config.fragmentation_scenarios:
        report[scenario.name], traces[scenario.name] = fragmentation_report(
            config.fragmentation_trials, config.fragmentation_ops, progress=progress,
            num_blocks=scenario.num_blocks, max_alloc_blocks=scenario.max_alloc_blocks,
            free_probability=scenario.free_probability)
    return report, traces


def format_results(data: dict, config: AllocatorBenchConfig) -> str:
    """The rows beside the seed's table, and the fragmentation summary, as text."""
    rows = {row["allocator"]: row for row in data["rows"]}
    base = rows.get("contiguous", {}).get("throughput_tok_s") or math.nan
    lines = [f"allocators: {config.num_requests} requests, {config.num_device_blocks} blocks of "
             f"{config.block_size} tokens, max_model_len {config.max_model_len}, model "
             f"{config.model or config.arch + '-' + config.size}, median of {config.repeats} run(s) each"]
    table = []
    for name, row in rows.items():
        seed = SEED_TABLE[name]
        table.append([name, f"{row['kv_utilization']:.0%} ({seed['kv_utilization']:.0%})",
                      row["max_concurrent"], row["preemptions"],
                      f"{row['p99_latency_s'] * 1e3:.0f} ({seed['p99_latency_s'] * 1e3:.0f})",
                      f"{row['throughput_tok_s']:.1f}",
                      f"{row['throughput_tok_s'] / base:.2f}x ({seed['relative_throughput']:.1f}x)"])
    lines.append(format_table(["allocator", "KV util (seed)", "max conc", "preempt", "p99 ms (seed)",
                               "out tok/s", "vs contiguous (seed)"], table))
    for scenario in config.fragmentation_scenarios:
        frag = data["fragmentation"].get(scenario.name)
        if not frag:
            continue
        ops = str(max(config.fragmentation_ops))
        c, p = frag["contiguous"], frag["paged"]
        lines.append(
            f"fragmentation [{scenario.name}: {scenario.num_blocks} blocks, allocations 1..{scenario.max_alloc_blocks}, "
            f"{frag['num_trials']} trials] after {ops} ops: contiguous {c['at_ops'][ops]['fragmentation']:.1%} "
            f"(peak {c['at_ops'][ops]['peak_fragmentation']:.1%}, refused with free space "
            f"{c['failed_with_free_space']:.1%}), paged {p['at_ops'][ops]['fragmentation']:.1%} "
            f"(refused with free space {p['failed_with_free_space']:.1%}); seed: contiguous 34% peak, paged 0%")
    return "\n".join(lines)


def write_plots(plot_dir: str, data: dict, results: dict, traces: dict) -> list:
    """KV utilisation over time, latency CDFs, comparison bars and fragmentation traces."""
    from pathlib import Path

    plot_dir = Path(plot_dir)
    paths = [
        plot_lines({
            "KV utilisation (tokens / slots)": {n: ([s.t_s for s in r.samples], [s.kv_utilization for s in r.samples])
                                               for n, r in results.items()},
            "device blocks in use": {n: ([s.t_s for s in r.samples], [s.block_usage for s in r.samples])
                                     for n, r in results.items()},
            "running sequences": {n: ([s.t_s for s in r.samples], [s.num_running for s in r.samples])
                                  for n, r in results.items()},
        }, plot_dir / "allocators_kv_utilization.png", "KV cache over time, per allocator"),
        plot_cdfs({
            "end-to-end latency": {n: [x.e2e_s for x in r.records] for n, r in results.items()},
            "time to first token": {n: [x.ttft_s for x in r.records] for n, r in results.items()},
        }, plot_dir / "allocators_latency_cdf.png", "request latency, per allocator"),
    ]
    rows = {row["allocator"]: row for row in data["rows"]}
    base = rows.get("contiguous", {}).get("throughput_tok_s") or math.nan
    paths.append(plot_bars({
        "KV utilisation": {n: row["kv_utilization"] for n, row in rows.items()},
        "throughput vs contiguous": {n: row["throughput_tok_s"] / base for n, row in rows.items()},
        "p99 latency (s)": {n: row["p99_latency_s"] for n, row in rows.items()},
        "max concurrent sequences": {n: float(row["max_concurrent"]) for n, row in rows.items()},
    }, plot_dir / "allocators_comparison.png", "allocators on one KV budget (hatched: seed's figures)",
        reference={"KV utilisation": {n: s["kv_utilization"] for n, s in SEED_TABLE.items()},
                   "throughput vs contiguous": {n: s["relative_throughput"] for n, s in SEED_TABLE.items()}}))
    if traces:
        paths.append(plot_lines({
            scenario: {name: (list(range(1, len(trace) + 1)), trace) for name, trace in by_name.items()}
            for scenario, by_name in traces.items()
        }, plot_dir / "fragmentation.png", "external fragmentation under random alloc/free (mean of trials)",
            xlabel="operations"))
    return paths
