"""Soak: the served API (Ray Serve, two mixed CPU workers) with a deliberately
small KV pool, under 64 concurrent streaming clients on loopback for a
bounded time (1 minute; 30 under ``--long-form``, ``make test-all``).

The pool (64 device blocks and about 26 host blocks per worker) is small
enough that preemption, swapping and prefix-cache eviction all happen; the
test asserts each from the server's ``/metrics`` and ``/stats`` counters.
Requests mix greedy and sampled ones, lengths from a few to a few hundred
tokens, and eight shared prefixes.

Pass: no request fails; every greedy request's text equals the same request
served alone by the single-process ``LLM``; every worker's pools pass their
integrity check at every sample during the load (a block in use that no
sequence's table holds, or a wrong ref count, is a leak the moment it
happens); the RSS of the Serve replica, the workers, their engine core
processes and the KV manager does not grow over the warm part of the run (Theil-Sen slopes, printed);
fewer than 1% of the requests once warm wait for their first token more
than 3 mean request cycles (a cycle: clients / completed requests per
second, Little's law: what a request waits behind the others when the queue
is served in order), by the server's own TTFT histogram (the Serve
replica's, from a request's arrival there to its first token); at the end,
every request finished, consistent accounting and no block in use.

The TTFT the clients see is printed, not asserted: 64 streaming ``openai``
clients keep this process's event loop busy most of the time on 2 cores
(a 10 ms sleep overshot by 27 ms at the median and 0.8 s at worst, busy 86%
of the run; 2026-11-29), so a first chunk waits for the client itself. There
the client-side p99 read 3.0 and 3.3 cycles where the replica's histogram
had no request above 2.5 s (about 1 cycle).

Blocks in use are sampled and their slope printed, not asserted: with 64
clients on 128 device blocks the pool is full, so the level reads how well
the clients and the ingress keep up on this machine (they stall for a few
seconds under load and the pool half empties), not a leak, which the
integrity samples and the end state catch exactly. Its least-squares slope
read 16.8 and 15.4 blocks of growth (limit 12.8) in two leak-free runs at
load 20-67 (2026-11-25), Theil-Sen 9.5 and 7.8: a bound on a level the load
moves cannot separate a leak from a busy machine.
``PAGEDSERVE_SOAK_REPORT=path`` also writes the figures as JSON.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import random
import re
import statistics
import time
from dataclasses import dataclass, field

import pytest

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from pagedserve.workers.process.background_loop import BackgroundLoop  # noqa: E402
from pagedserve.workers.sample.sampling_params import SamplingParams  # noqa: E402
from served_cluster import cluster_config, running_cluster  # noqa: E402

pytestmark = [pytest.mark.soak, pytest.mark.distributed, pytest.mark.timeout(3600)]

MODEL = "tiny-soak"
# Tiny llama: 8 KiB per 16-token block, so 0.0002 GB of swap is 26 host blocks.
ENGINE = {"num_device_blocks": 64, "swap_space_gb": 0.0002, "max_model_len": 512}
NUM_CLIENTS = 64
NUM_PREFIXES = 8
NUM_GREEDY_PROMPTS = 48
SHORT_S, LONG_S = 60.0, 1800.0
DURATION_OVERRIDE_S = os.environ.get("PAGEDSERVE_SOAK_SECONDS")  # any other length, by hand
WARMUP_S = 20.0
SAMPLE_EVERY_S = 2.0
# Growth allowed over the warm part of the run, from the fitted slope. The short
# run serves about 1,300 requests (900 of them warm; 2026-11-26, a quiet VM), so this
# catches a leak of 27 KiB a request (one lost KV export of a few blocks, say) and, over
# the long run's 10k+ requests, of 2.5 KiB; Python's allocator and Ray's buffers wander by
# a few MiB. Two such runs' largest fitted growth: 9.5 MiB (the replica).
MAX_RSS_GROWTH_MIB = 24.0
# A first token within this many mean request cycles (NUM_CLIENTS / throughput) for 99% of the
# warm requests, at the replica. Client-side, p99 / cycle read 0.66 (1-minute run) and 1.38
# (2 minutes) on 2026-11-26; with the engine core in a process of its own the server got faster
# and the clients' event loop became the bottleneck: 3.0 and 3.3 client-side (2026-11-29), while
# the replica saw no first token later than 2.5 s (about 1 cycle). The histogram's bounds (vLLM's:
# 5, 7.5, 10, 20, 40 s) make the check conservative: it counts the requests above the largest bound
# within the limit. On a CI machine running other tests beside it (a cycle of 8.7 s, 2026-12-01), 15
# of 382 warm requests were over 10 s; alone with two busy loops on its 2 cores (a cycle of 7.5 s),
# none over 10 s.
MAX_TTFT_CYCLES = 3.0
REPORT_PATH = os.environ.get("PAGEDSERVE_SOAK_REPORT")


@dataclass
class Job:
    prompt: list[int]
    max_tokens: int
    temperature: float
    expected_text: str | None   # greedy jobs only


@dataclass
class Record:
    start: float
    ttft: float
    is_greedy: bool
    is_equal: bool | None


@dataclass
class LoadResult:
    deadline: float                 # no request starts after this; the pools drain
    records: list[Record] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    warm_metrics: str = ""          # the server's /metrics when the warm-up ends
    client_busy_frac: float = 0.0   # how much of the run this process's event loop was late


# ---- fixtures -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def jobs(tiny_model) -> list[Job]:
    """Greedy jobs (references served alone by the offline ``LLM``) and sampled jobs."""
    from pagedserve.workers.offline.llm import LLM

    rng = random.Random(2026)
    prefixes = [[rng.randrange(3, 1000) for _ in range(rng.randrange(32, 129))] for _ in range(NUM_PREFIXES)]

    def prompt() -> list[int]:
        suffix = [rng.randrange(3, 1000) for _ in range(rng.randrange(4, 120))]
        return (rng.choice(prefixes) if rng.random() < 0.75 else []) + suffix

    llm = LLM(tiny_model("llama"), **ENGINE)
    greedy = []
    for _ in range(NUM_GREEDY_PROMPTS):
        ids, max_tokens = prompt(), rng.randrange(4, 97)
        (output,) = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        greedy.append(Job(ids, max_tokens, 0.0, output.outputs[0].text))
    llm.check_integrity()
    sampled = [Job(prompt(), rng.randrange(4, 97), 0.8, None) for _ in range(NUM_GREEDY_PROMPTS)]
    return greedy + sampled


@pytest.fixture(scope="module")
def served(tiny_model):
    from pagedserve.cluster.serving.deployment import deploy

    config = cluster_config(tiny_model("llama"), MODEL, ENGINE, num_workers=2, worker_cpus=1)
    with running_cluster(config, include_dashboard=None) as cluster:   # the state API finds the processes to sample
        endpoints = deploy(cluster.handle, cluster.config, quiet=True)
        yield cluster.handle, endpoints["http"], f"http://{cluster.dashboard_url}"


# ---- the load -----------------------------------------------------------------------------
async def _one(client, job: Job, rng: random.Random) -> Record:
    start = time.perf_counter()
    ttft = None
    pieces: list[str] = []
    finish_reason = None
    extra = {"ignore_eos": True}
    if job.temperature > 0:
        extra["seed"] = rng.randrange(1 << 30)
    stream = await client.completions.create(model=MODEL, prompt=job.prompt, max_tokens=job.max_tokens,
                                             temperature=job.temperature, stream=True, extra_body=extra)
    async for chunk in stream:
        if not chunk.choices:
            continue
        if ttft is None:
            ttft = time.perf_counter() - start
        pieces.append(chunk.choices[0].text)
        finish_reason = chunk.choices[0].finish_reason or finish_reason
    if finish_reason != "length" or ttft is None:
        raise AssertionError(f"stream ended with finish_reason {finish_reason!r}")
    is_greedy = job.expected_text is not None
    return Record(time.time(), ttft, is_greedy, "".join(pieces) == job.expected_text if is_greedy else None)


async def _drive(base_url: str, jobs: list[Job], duration_s: float) -> LoadResult:
    deadline = time.time() + duration_s
    result = LoadResult(deadline)
    limits = httpx.Limits(max_connections=NUM_CLIENTS + 8, max_keepalive_connections=NUM_CLIENTS + 8)
    http = httpx.AsyncClient(limits=limits, timeout=300)
    async with openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=300,
                                  http_client=http) as client:
        async def client_loop(index: int) -> None:
            rng = random.Random(index)
            while time.time() < deadline:
                job = rng.choice(jobs)
                try:
                    result.records.append(await _one(client, job, rng))
                except Exception as exc:
                    result.failures.append(f"client {index}: {exc!r}")

        async def warm_snapshot() -> None:
            await asyncio.sleep(WARMUP_S)
            result.warm_metrics = (await http.get(base_url + "/metrics")).text

        async def loop_lag_probe() -> None:
            late = 0.0
            start = time.perf_counter()
            while time.time() < deadline:
                before = time.perf_counter()
                await asyncio.sleep(0.01)
                late += max(0.0, time.perf_counter() - before - 0.01)
            result.client_busy_frac = late / (time.perf_counter() - start)

        await asyncio.gather(warm_snapshot(), loop_lag_probe(), *(client_loop(i) for i in range(NUM_CLIENTS)))
    return result


# ---- sampling blocks and memory -------------------------------------------------------------
def _process_ids(dashboard_url: str) -> dict[str, int]:
    """PIDs of the Serve replica, the workers, each worker's engine core process (which holds
    the pools and the requests) and the KV manager (Ray's state API; the address is explicit,
    as other Ray instances may run on this machine)."""
    from ray.util.state import list_actors

    from pagedserve.bench.cpu_pinning import engine_core_pids

    wanted = {"ServeReplica": "replica", "Worker": "worker", "CentralKVManager": "kv_manager"}
    pids = {}
    for actor in list_actors(address=dashboard_url, filters=[("state", "=", "ALIVE")], limit=1000):
        for marker, role in wanted.items():
            if marker in actor.class_name and (role != "replica" or "PagedServe" in actor.class_name):
                name = actor.name or actor.actor_id[:8]
                pids[f"{role}:{name}"] = actor.pid
                if role == "worker":
                    pids.update({f"engine_core:{name}": pid for pid in engine_core_pids(actor.pid)})
    return pids


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        match = re.search(r"VmRSS:\s+(\d+) kB", f.read())
    return int(match.group(1)) / 1024


class Sampler:
    """Every ``SAMPLE_EVERY_S``, in a thread: each worker's integrity check (between two of its
    engine steps), blocks in use and per-process RSS. A failed check is recorded; a sample
    that cannot be taken (a worker slow to answer on a loaded machine) is logged and skipped."""

    def __init__(self, handle, pids: dict[str, int]) -> None:
        self.handle = handle
        self.pids = pids
        self.samples: list[tuple[float, int, dict[str, float]]] = []
        self.num_integrity_checks = 0
        self.integrity_failures: list[str] = []
        self._loop = BackgroundLoop("soak-sampler", self._sample, SAMPLE_EVERY_S, join_timeout_s=30)

    def __enter__(self) -> "Sampler":
        self._loop.start()
        return self

    def __exit__(self, *exc) -> None:
        self._loop.stop()

    def _sample(self) -> None:
        from pagedserve.kvmanager import IntegrityError

        for worker_id, worker in self.handle.workers.items():
            try:
                ray.get(worker.check_integrity.remote(), timeout=60)
                self.num_integrity_checks += 1
            except IntegrityError as exc:   # Ray raises the worker's error as this type too
                self.integrity_failures.append(f"{worker_id} at {time.time():.1f}: {exc}")
        rss = {name: _rss_mib(pid) for name, pid in self.pids.items()}
        self.samples.append((time.time(), self.handle.num_used_blocks(), rss))


def _slope_per_s(points: list[tuple[float, float]]) -> float:
    """Theil-Sen slope of y over x: the median of the slopes between every two points.

    A steady trend (a leak) adds its own slope to it exactly, as to a least-squares
    fit; a few outlying samples barely move it. Blocks in use have such outliers on a
    loaded machine: the clients or the ingress stall for a moment and the pool half
    empties for a sample or two. A least-squares line through dips early in the
    window reads as growth: 16.8 blocks, over the 12.8 allowed, in a run with no leak
    (2026-11-25 09:43 UTC, load 20-67); Theil-Sen read 9.5 (the test at the end).
    """
    slopes = [(y2 - y1) / (x2 - x1) for (x1, y1), (x2, y2) in itertools.combinations(points, 2) if x2 != x1]
    return statistics.median(slopes) if slopes else 0.0


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# ---- counters from the server ----------------------------------------------------------------
def _metric_sum(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _histogram(text: str, name: str) -> dict[float, float]:
    """A Prometheus histogram's cumulative counts by upper bound (``le``), all labels summed."""
    counts: dict[float, float] = {}
    for line in text.splitlines():
        if line.startswith(name + "_bucket{"):
            bound = float(re.search(r'le="([^"]+)"', line).group(1))
            counts[bound] = counts.get(bound, 0.0) + float(line.rsplit(" ", 1)[1])
    return counts


def _num_above(counts: dict[float, float], limit: float) -> tuple[float, float]:
    """(observations above ``limit``, ``limit``) from cumulative bucket counts: those above the
    bucket that holds ``limit``, plus that bucket's share past it, linear within the bucket as
    Prometheus's ``histogram_quantile`` reads one. (All of that bucket would count observations
    that may not reach ``limit``: with buckets at 10 and 20 s, a limit of 18.6 s became 10 s.)"""
    lower = max(b for b in counts if b <= limit)
    upper = min(b for b in counts if b > limit)
    in_bucket = counts[upper] - counts[lower]
    past = in_bucket if upper == float("inf") else in_bucket * (upper - limit) / (upper - lower)
    return counts[float("inf")] - counts[upper] + past, limit


def _server_counters(base_url: str, metrics: str) -> dict[str, float]:
    pools = httpx.get(base_url + "/stats", timeout=60).json()["kv_manager"]["workers"].values()
    return {
        "preemptions_swap": _metric_sum(metrics, "pagedserve_preemptions_total", mode="swap"),
        "preemptions_recompute": _metric_sum(metrics, "pagedserve_preemptions_total", mode="recompute"),
        "preemptions_migrate": _metric_sum(metrics, "pagedserve_preemptions_total", mode="migrate"),
        "blocks_swapped_out": _metric_sum(metrics, "pagedserve_swapped_blocks_total", direction="out"),
        "blocks_swapped_in": _metric_sum(metrics, "pagedserve_swapped_blocks_total", direction="in"),
        "prefix_cache_evictions": sum(p["num_device_evictions"] for p in pools),
        "prefix_cache_hits": _metric_sum(metrics, "pagedserve_prefix_cache_hits_total"),
    }


# ---- the test -----------------------------------------------------------------------------
def test_soak_small_pool_many_streaming_clients(served, jobs, long_form):
    handle, base_url, dashboard_url = served
    duration_s = float(DURATION_OVERRIDE_S or (LONG_S if long_form else SHORT_S))
    pool_blocks = 2 * ENGINE["num_device_blocks"]
    pids = _process_ids(dashboard_url)
    assert sorted(name.partition(":")[0] for name in pids) == [
        "engine_core", "engine_core", "kv_manager", "replica", "worker", "worker"], pids
    with Sampler(handle, pids) as sampler:
        result = asyncio.run(_drive(base_url, jobs, duration_s))
    metrics = httpx.get(base_url + "/metrics", timeout=60).text
    counters = _server_counters(base_url, metrics)

    run_start = min(r.start - r.ttft for r in result.records)
    warm = [r for r in result.records if r.start - r.ttft >= run_start + WARMUP_S]
    ttfts = [r.ttft for r in warm]
    warm_span = max(r.start for r in warm) - min(r.start - r.ttft for r in warm)
    cycle_s = NUM_CLIENTS / (len(warm) / warm_span)   # Little's law: mean time a request takes
    p50, p99 = _percentile(ttfts, 0.50), _percentile(ttfts, 0.99)
    # The replica's TTFT histogram over the warm part: the end's counts less the warm-up's.
    ttft_name = "pagedserve_time_to_first_token_seconds"
    at_warm = _histogram(result.warm_metrics, ttft_name)
    server_ttft = {b: n - at_warm.get(b, 0.0) for b, n in _histogram(metrics, ttft_name).items()}
    num_server_warm = server_ttft[float("inf")]
    num_slow, slow_bound = _num_above(server_ttft, MAX_TTFT_CYCLES * cycle_s)
    greedy = [r for r in result.records if r.is_greedy]
    warm_samples = [s for s in sampler.samples if run_start + WARMUP_S <= s[0] <= result.deadline]
    warm_span_s = warm_samples[-1][0] - warm_samples[0][0]
    block_slope = _slope_per_s([(t, used) for t, used, _ in warm_samples])
    rss_slopes = {name: _slope_per_s([(t, rss[name]) for t, _, rss in warm_samples])
                  for name in warm_samples[0][2]}
    report = {
        "duration_s": duration_s, "clients": NUM_CLIENTS, "completed": len(result.records),
        "failed": len(result.failures), "greedy_checked": len(greedy),
        "greedy_equal": sum(bool(r.is_equal) for r in greedy), "counters": counters,
        "blocks_in_use_slope_per_min": 60 * block_slope, "pool_blocks": pool_blocks,
        "rss_slope_mib_per_min": {k: 60 * v for k, v in rss_slopes.items()},
        "rss_slope_second_half_mib_per_min": {
            k: 60 * _slope_per_s([(t, rss[k]) for t, _, rss in warm_samples[len(warm_samples) // 2:]])
            for k in rss_slopes},
        "rss_mib_first_last": {k: (warm_samples[0][2][k], warm_samples[-1][2][k]) for k in rss_slopes},
        "client_ttft_p50_s": p50, "client_ttft_p99_s": p99, "client_ttft_p99_cycles": p99 / cycle_s,
        "client_loop_busy_frac": result.client_busy_frac, "num_warm": len(warm),
        "server_ttft_warm_buckets": {str(b): n for b, n in sorted(server_ttft.items())},
        "server_ttft_above_s": {"bound_s": slow_bound, "requests": num_slow, "of": num_server_warm},
        "request_cycle_s": cycle_s,
        "warm_span_s": warm_span_s, "integrity_checks_under_load": sampler.num_integrity_checks,
    }
    print("\nsoak:", json.dumps(report, indent=1))
    if REPORT_PATH:
        with open(REPORT_PATH, "w") as f:
            samples = [(round(t - run_start, 1), used) for t, used, _ in sampler.samples]
            json.dump({**report, "blocks_in_use_samples": samples}, f, indent=1)

    assert not result.failures, result.failures[:10]
    assert greedy and all(r.is_equal for r in greedy), f"{report['greedy_equal']}/{len(greedy)} equal"
    assert counters["preemptions_swap"] + counters["preemptions_recompute"] > 0
    assert counters["blocks_swapped_out"] > 0 and counters["blocks_swapped_in"] > 0
    assert counters["prefix_cache_evictions"] > 0
    assert not sampler.integrity_failures, sampler.integrity_failures[:5]
    assert sampler.num_integrity_checks >= len(handle.workers), \
        f"{sampler.num_integrity_checks} integrity checks ran under load: a worker never answered one"
    for name, slope in rss_slopes.items():
        assert slope * warm_span_s < MAX_RSS_GROWTH_MIB, (name, report["rss_slope_mib_per_min"])
    assert result.warm_metrics and num_server_warm >= 0.5 * len(warm), report["server_ttft_above_s"]
    assert num_slow <= 0.01 * num_server_warm, (
        f"{num_slow:.1f} of {num_server_warm:.0f} warm requests waited over {slow_bound:.2f} s for their first "
        f"token at the replica, where {MAX_TTFT_CYCLES} mean request cycles are {MAX_TTFT_CYCLES * cycle_s:.2f} s: "
        f"far longer than the whole queue takes to turn over; assumes the {NUM_CLIENTS} clients keep the "
        f"queue full and it is served in order")

    handle.wait_idle(timeout=120.0)
    handle.check_integrity()
    assert handle.num_used_blocks() == 0
