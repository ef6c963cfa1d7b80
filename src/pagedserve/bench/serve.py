"""``bench serve``: online load against an OpenAI-compatible server, as ``vllm bench serve``.

Requests stream from ``/v1/completions`` with Poisson arrivals at
``request_rate`` (infinite: all at once), optionally capped at
``max_concurrency`` in flight. Per request we time the first streamed text
(TTFT), the gaps between streamed chunks (ITL), the time per output token
after the first (TPOT) and the whole request (E2EL). The summary uses
``vllm bench serve``'s metric names (``request_throughput``,
``output_throughput``, ``mean_ttft_ms``, ``median_ttft_ms``,
``p99_itl_ms``, ...), so the numbers compare directly.

``num_warmups`` requests (other prompts, the same lengths) run before the timed load.
With a ``CpuPerTokenConfig`` the run also reads the CPU time of every process of the
server (``process_cpu``: by role, on this machine) just before and just after the timed
load, and reports it per streamed output token, with the load client's own; optionally
the same requests then run through the offline engine in a process of its own
(``offline_cpu``), and what serving adds per token is the server's figure minus that.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import random
import time
from dataclasses import asdict, dataclass, field

from . import engine_steps
from .plots import plot_cdfs
from .report import format_table, percentile, progress_bar, summarize, write_json
from .workload import LengthDist, poisson_arrivals, random_token_ids

PROMPT_FORMATS = ("token-ids", "text")
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
MAX_ERRORS_KEPT = 20
# Words for text prompts: each is one or two tokens with most BPE vocabularies.
_WORDS = ("the cache holds keys and values for every token of each sequence in fixed blocks "
          "so memory is shared across requests without copies while the scheduler batches "
          "prefill with decode steps and frees blocks when a request ends").split()


@dataclass(frozen=True)
class ServeBenchConfig:
    url: str
    model: str | None = None                 # default: the first id /v1/models lists
    num_requests: int = 64
    request_rate: float = math.inf           # requests/s (Poisson); inf sends all at once
    max_concurrency: int | None = None
    input_len: LengthDist = LengthDist(mean=200, low=8, high=1024)
    output_len: LengthDist = LengthDist(mean=64, low=4, high=256)
    prompt_format: str = "token-ids"         # token ids give exact prompt lengths
    vocab_size: int = 1000                   # range of random prompt token ids
    ignore_eos: bool = True                  # vLLM's extension: outputs of exactly max_tokens
    max_duration_s: float = 600.0            # no request starts after this
    request_timeout_s: float = 300.0
    api_key: str | None = None
    seed: int = 0
    num_warmups: int = 0                     # untimed requests first (other prompts, the same lengths)

    def __post_init__(self) -> None:
        if self.prompt_format not in PROMPT_FORMATS:
            raise ValueError(f"prompt_format must be one of {PROMPT_FORMATS}, got {self.prompt_format!r}")
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if self.num_warmups < 0:
            raise ValueError(f"num_warmups must be >= 0, got {self.num_warmups}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url must start with http:// or https://, got {self.url!r}")


@dataclass(frozen=True)
class CpuPerTokenConfig:
    """``--cpu-per-token``: the server's processes' CPU per streamed token (this machine's)."""

    server_pid: int | None = None            # default: the one `pagedserve serve`'s state file records
    offline: bool = False                    # also LLM.generate on the same requests, in its own process
    offline_model: str | None = None         # default: the state file's model, else the built tiny model
    offline_threads: int = 1
    offline_rounds: int = 3                  # the offline call's timed rounds; their median is the baseline
    offline_cpus: tuple[int, ...] | None = None   # the offline process runs on these CPUs only


@dataclass
class RequestResult:
    """One streamed request; times in seconds."""

    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    start_s: float = 0.0                    # from the start of the run
    ttft_s: float = math.nan
    e2e_s: float = math.nan
    itl_s: list[float] = field(default_factory=list)

    @property
    def tpot_s(self) -> float:
        if self.output_tokens < 2:
            return math.nan
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


def make_prompts(config: ServeBenchConfig) -> list[tuple[str | list[int], int, int]]:
    """``(prompt, prompt_len, max_tokens)`` per request, seeded."""
    rng = random.Random(config.seed)
    prompts = []
    for _ in range(config.num_requests):
        num_input = config.input_len.sample(rng)
        num_output = config.output_len.sample(rng)
        if config.prompt_format == "token-ids":
            prompt: str | list[int] = random_token_ids(rng, num_input, config.vocab_size)
        else:
            prompt = " ".join(rng.choice(_WORDS) for _ in range(num_input))
        prompts.append((prompt, num_input, num_output))
    return prompts


def _headers(config: ServeBenchConfig) -> dict:
    return {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}


async def _model_name(session, config: ServeBenchConfig) -> str:
    if config.model:
        return config.model
    async with session.get(f"{config.url.rstrip('/')}/v1/models", headers=_headers(config)) as response:
        response.raise_for_status()
        models = (await response.json()).get("data") or []
    if not models:
        raise RuntimeError(f"{config.url} lists no models; pass --model")
    return models[0]["id"]


class LineSplitter:
    """Complete lines out of a byte stream read in arbitrary pieces."""

    def __init__(self) -> None:
        self._partial = b""

    def feed(self, data: bytes) -> list[bytes]:
        """The lines ``data`` completes, without their line ends (``\\n``, or ``\\r\\n``
        less the ``\\n``); an unfinished last line waits for the next piece."""
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        return lines


async def _send(session, config: ServeBenchConfig, model: str, prompt, prompt_len: int, max_tokens: int,
                run_start: float) -> RequestResult:
    """Stream one completion, timing every chunk that carries text."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}}
    if config.ignore_eos:
        body["ignore_eos"] = True
    result = RequestResult(prompt_len=prompt_len)
    start = time.perf_counter()
    result.start_s = time.time() - run_start
    last = start
    num_chunks = 0
    usage_tokens = None
    try:
        async with session.post(f"{config.url.rstrip('/')}/v1/completions", json=body,
                                headers=_headers(config)) as response:
            if response.status != 200:
                text = (await response.read()).decode(errors="replace")
                result.error = f"HTTP {response.status}: {text[:300]}"
                return result
            lines = LineSplitter()
            is_done = False
            # Whatever the socket has, at once, as vLLM's client reads: about 0.92x the client's
            # CPU a token of aiohttp's line by line reading.
            async for data in response.content.iter_any():
                for line in lines.feed(data):   # server-sent events: one "data:" line each
                    if not line.startswith(b"data:"):
                        continue
                    payload = line[len(b"data:"):].strip()
                    if payload == b"[DONE]":
                        is_done = True
                        break
                    chunk = json.loads(payload)
                    if "error" in chunk:
                        result.error = f"stream error: {json.dumps(chunk['error'])[:300]}"
                        return result
                    if chunk.get("usage"):
                        usage_tokens = chunk["usage"].get("completion_tokens")
                        result.prompt_len = chunk["usage"].get("prompt_tokens", prompt_len)
                    if any(choice.get("text") for choice in chunk.get("choices") or []):
                        now = time.perf_counter()
                        if num_chunks == 0:
                            result.ttft_s = now - start
                        else:
                            result.itl_s.append(now - last)
                        last = now
                        num_chunks += 1
                if is_done:
                    break
        result.e2e_s = time.perf_counter() - start
        result.output_tokens = usage_tokens if usage_tokens is not None else num_chunks
        result.success = num_chunks > 0
        if not result.success:
            result.error = "the stream carried no text"
    except Exception as exc:  # noqa: BLE001 - a failed request is a data point, not a crash
        result.error = f"{type(exc).__name__}: {exc}"[:300]
    return result


async def run_load(config: ServeBenchConfig, on_finish=None,
                   requests: list[tuple] | None = None) -> tuple[list[RequestResult], float]:
    """Send every request (Poisson arrivals, optional concurrency cap); returns results and duration.
    ``requests``: ``(prompt, prompt_len, max_tokens)`` each, instead of the config's random ones.

    The client is aiohttp, as ``vllm bench serve``'s: reading a streamed token costs it a
    fifth to a quarter of what httpx's streaming costs (``docs/benchmarks.md``, "The load
    client"), CPU a load run on the server's machine would otherwise take from the server."""
    try:
        import aiohttp
    except ImportError as exc:
        raise RuntimeError("`pagedserve bench serve` needs aiohttp: pip install 'pagedserve[bench]'") from exc

    prompts = requests if requests is not None else make_prompts(config)
    arrivals = poisson_arrivals(len(prompts), config.request_rate, config.seed)
    connector = aiohttp.TCPConnector(limit=config.max_concurrency or config.num_requests)
    timeout = aiohttp.ClientTimeout(total=config.request_timeout_s, connect=30.0)
    semaphore = asyncio.Semaphore(config.max_concurrency or config.num_requests)
    # A line of up to 16 MiB (a chunk with many logprobs): aiohttp's default limit is 64 KiB.
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, read_bufsize=1 << 24) as session:
        model = await _model_name(session, config)
        run_start = time.time()

        async def one(index: int) -> RequestResult:
            async with semaphore:
                prompt, prompt_len, max_tokens = prompts[index]
                result = await _send(session, config, model, prompt, prompt_len, max_tokens, run_start)
            if on_finish is not None:
                on_finish(result)
            return result

        tasks = []
        for index, offset in enumerate(arrivals):
            delay = run_start + offset - time.time()
            if offset > config.max_duration_s:
                break
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(index)))
        results = await asyncio.gather(*tasks)
        duration = time.time() - run_start
    return list(results), duration


def summarize_results(results: list[RequestResult], duration_s: float) -> dict:
    """``vllm bench serve``'s summary: throughputs and latency statistics in ms."""
    ok = [r for r in results if r.success]
    total_input = sum(r.prompt_len for r in ok)
    total_output = sum(r.output_tokens for r in ok)
    summary: dict = {
        "duration": duration_s,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(ok) / duration_s if duration_s > 0 else 0.0,
        "output_throughput": total_output / duration_s if duration_s > 0 else 0.0,
        "total_token_throughput": (total_input + total_output) / duration_s if duration_s > 0 else 0.0,
    }
    samples = {"ttft": [r.ttft_s for r in ok], "tpot": [r.tpot_s for r in ok if not math.isnan(r.tpot_s)],
               "itl": [gap for r in ok for gap in r.itl_s], "e2el": [r.e2e_s for r in ok]}
    for metric in LATENCY_METRICS:
        values = [v * 1e3 for v in samples[metric]]
        stats = summarize(values)
        summary[f"mean_{metric}_ms"] = stats["mean"]
        summary[f"median_{metric}_ms"] = percentile(values, 50)
        summary[f"std_{metric}_ms"] = stats["std"]
        for q in (50, 90, 99):
            summary[f"p{q}_{metric}_ms"] = stats[f"p{q}"]
    summary["errors"] = [r.error for r in results if not r.success][:MAX_ERRORS_KEPT]
    return summary


def warmup_config(config: ServeBenchConfig) -> ServeBenchConfig:
    """The warm-up's load: ``num_warmups`` requests of the same lengths with other prompts
    (another seed, so that no timed prompt is cached by them), all at once."""
    return dataclasses.replace(config, num_requests=config.num_warmups, seed=config.seed + 1,
                               request_rate=math.inf, num_warmups=0)


def run_benchmark(config: ServeBenchConfig, out: str | None = None, plot_dir: str | None = None,
                  show_progress: bool = True, cpu: CpuPerTokenConfig | None = None,
                  requests: list[tuple] | None = None) -> dict:
    """Run the warm-up and the load, write JSON (config, summary, per-request results, and
    with ``cpu`` the CPU per token) and the latency CDFs. ``requests``: the load's
    ``(prompt, prompt_len, max_tokens)`` instead of the config's random ones."""
    probe = None
    if cpu is not None:
        from .process_cpu import ServerCpuProbe, find_server_root

        probe = ServerCpuProbe(find_server_root(config.url, cpu.server_pid))
    if config.num_warmups:
        asyncio.run(run_load(warmup_config(config)))
    num_requests = config.num_requests if requests is None else len(requests)
    steps_before = _served_steps(config) if probe else None
    with progress_bar(num_requests, "serve", disable=not show_progress) as bar, \
            (probe.measure() if probe else contextlib.nullcontext()) as window:
        results, duration = asyncio.run(run_load(config, on_finish=lambda _: bar.update(1), requests=requests))
    steps_after = _served_steps(config) if probe else None
    summary = summarize_results(results, duration)
    data = {"config": {k: v for k, v in asdict(config).items() if k != "api_key"},
            **summary,
            "requests": [{"success": r.success, "prompt_len": r.prompt_len, "output_tokens": r.output_tokens,
                          "start_s": r.start_s, "ttft_s": r.ttft_s, "e2e_s": r.e2e_s, "error": r.error}
                         for r in results]}
    if window is not None:
        data["cpu_per_token"] = window.result(summary["total_output_tokens"])
        served_steps = None
        if steps_before is not None and steps_after is not None:
            core_cpu_s = sum(g["cpu_s"] for label, g in data["cpu_per_token"]["groups"].items()
                             if label.startswith("engine core"))
            served_steps = engine_steps.window(steps_before, steps_after, core_cpu_s or None)
            data["engine_steps"] = {"served": served_steps}
        if cpu.offline:
            data["offline"] = run_offline(config, cpu, requests)
            served = data["cpu_per_token"]["server_total"]["us_per_token"]
            data["cpu_per_token"]["serving_adds_us_per_token"] = served - data["offline"]["us_per_token"]
            if served_steps is not None:
                offline_steps = data["offline"]["engine_steps"]
                data["engine_steps"].update(offline=offline_steps,
                                            split=engine_steps.split_excess(served_steps, offline_steps))
    write_json(out, data)
    if plot_dir:
        from pathlib import Path

        ok = [r for r in results if r.success]
        plot_cdfs({"TTFT": {"ttft": [r.ttft_s * 1e3 for r in ok]},
                   "TPOT": {"tpot": [r.tpot_s * 1e3 for r in ok]},
                   "ITL": {"itl": [g * 1e3 for r in ok for g in r.itl_s]},
                   "end-to-end": {"e2el": [r.e2e_s * 1e3 for r in ok]}},
                  Path(plot_dir) / "serve_latency_cdf.png", f"online load against {config.url}", xlabel="ms")
    return data


def _served_steps(config: ServeBenchConfig) -> dict | None:
    """The server's engine step figures (``engine_steps``), or None where ``/stats`` gives none
    (another server than pagedserve, say)."""
    try:
        return engine_steps.served_counters(config.url, _headers(config))
    except Exception as exc:  # the CPU figures stand without it
        print(f"bench serve: no engine step figures from {config.url}/stats: {exc!r}"[:300])
        return None


def run_offline(config: ServeBenchConfig, cpu: CpuPerTokenConfig, requests: list[tuple] | None = None) -> dict:
    """The load's requests (and its warm-up's) through ``LLM.generate`` in a process of its
    own: the offline engine's CPU per token (``offline_cpu``)."""
    from urllib.parse import urlsplit

    from pagedserve.cluster import server_records

    from .offline_cpu import measure_in_subprocess

    port = urlsplit(config.url).port
    record = next((r for r in server_records.running() if r.port == port), None)
    model, engine_options = cpu.offline_model, {}
    if model is None and record is not None and record.model_path:
        model, engine_options = record.model_path, record.engine
    if model is None:
        from pagedserve.devtools.model_factory import ensure_model

        model = str(ensure_model("llama", "tiny"))
    if config.max_concurrency is not None:
        # The served engine never had more than that many requests at once: nor does the offline one.
        engine_options = dict(engine_options or {})
        engine_options["max_num_seqs"] = min(config.max_concurrency,
                                             engine_options.get("max_num_seqs", config.max_concurrency))
    requests = [(prompt, max_tokens) for prompt, _, max_tokens in (requests or make_prompts(config))]
    warmup = [(prompt, max_tokens) for prompt, _, max_tokens in make_prompts(warmup_config(config))] \
        if config.num_warmups else []
    return measure_in_subprocess(model, requests, warmup, cpu.offline_threads, engine_options, cpu.offline_rounds,
                                set(cpu.offline_cpus) if cpu.offline_cpus else None)


def format_cpu_per_token(data: dict) -> str:
    """The CPU table of a ``--cpu-per-token`` run: µs per streamed token by process group."""
    cpu = data["cpu_per_token"]
    def titles(names: list[str], most: int = 3) -> str:
        return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")

    rows = [[label, len(g["pids"]), g["cpu_s"], g["us_per_token"], titles(g["titles"])]
            for label, g in cpu["groups"].items()]
    rows.append(["all of the server", sum(len(g["pids"]) for g in cpu["groups"].values()),
                 cpu["server_total"]["cpu_s"], cpu["server_total"]["us_per_token"], ""])
    rows.append(["load client (not the server's)", 1, cpu["client"]["cpu_s"], cpu["client"]["us_per_token"], ""])
    if "offline" in data:
        offline = data["offline"]
        spread = offline.get("rounds_us_per_token", [])
        of_rounds = (f"; the median of {len(spread)} rounds, {min(spread):.1f}-{max(spread):.1f} us/token"
                     if len(spread) > 1 else "")
        rows.append([f"offline LLM.generate ({offline['threads']} torch thread(s))", 1, offline["cpu_s"],
                     offline["us_per_token"], f"{offline['output_throughput']:.0f} output tok/s{of_rounds}"])
    ingress = f", ingress {cpu['ingress']}" if cpu.get("ingress") else ""
    lines = [f"CPU per streamed output token ({cpu['num_output_tokens']:,} tokens; this machine's processes"
             f"{ingress}):",
             format_table(["process group", "processes", "CPU s", "us/token", "titles"], rows)]
    if "serving_adds_us_per_token" in cpu:
        lines.append(f"serving adds {cpu['serving_adds_us_per_token']:.1f} us per token (the server's "
                     f"{cpu['server_total']['us_per_token']:.1f} less the offline engine's "
                     f"{data['offline']['us_per_token']:.1f}); served {data['output_throughput']:.0f} against "
                     f"offline {data['offline']['output_throughput']:.0f} output tok/s")
    if "engine_steps" in data:
        lines.extend(format_engine_steps(data["engine_steps"]))
    if cpu["ended_processes"]:
        lines.append("ended during the run (CPU after the first snapshot not counted): " + ", ".join(
            f"{p['name']} ({p['pid']})" for p in cpu["ended_processes"]))
    return "\n".join(lines)


def format_engine_steps(steps: dict) -> list[str]:
    """The engine's steps over the load, served and offline, and its excess split in two."""
    def one(name: str, w: dict) -> str:
        phases = w.get("phase_us_per_step")
        by_phase = (" (core loop: " + ", ".join(f"{p} {us:.0f}" for p, us in phases.items()) + ")"
                    if phases else "")
        waits = (f"; {w['requests']} first tokens, {w['first_token_ms']:.1f} ms after arriving at the engine "
                 f"(queued {w['queue_ms']:.1f}), mean; {w['preemptions']} preemptions" if w.get("requests") else "")
        return (f"{name}: {w['steps']:,} steps ({w['decode_steps']:,} decode), {w['tokens_per_step']:.1f} tokens "
                f"a step, step {w['step_ms']:.2f} ms (decode {w['decode_step_ms']:.2f}), CPU "
                f"{w['cpu_us_per_step']:.0f} us a step{by_phase}, {w['cpu_us_per_token']:.1f} us a token{waits}")

    lines = ["engine steps over the load:", one("  served engine core", steps["served"])]
    if "offline" in steps:
        lines.append(one("  offline engine", steps["offline"]))
        split = steps["split"]
        lines.append(f"  the served engine's {split['excess_us_per_token']:.1f} us a token over offline: "
                     f"{split['fewer_tokens_per_step_us']:.1f} from fewer tokens a step, "
                     f"{split['costlier_steps_us']:.1f} from costlier steps")
    return lines


def format_results(data: dict) -> str:
    lines = [f"serve: {data['completed']} completed, {data['failed']} failed in {data['duration']:.1f} s; "
             f"{data['request_throughput']:.2f} req/s, {data['output_throughput']:.1f} output tok/s, "
             f"{data['total_token_throughput']:.1f} total tok/s",
             format_table(["metric (ms)", "mean", "median", "p90", "p99"],
                          [[m.upper(), data[f"mean_{m}_ms"], data[f"median_{m}_ms"], data[f"p90_{m}_ms"],
                            data[f"p99_{m}_ms"]] for m in LATENCY_METRICS])]
    if "cpu_per_token" in data:
        lines.append(format_cpu_per_token(data))
    for error in data["errors"][:5]:
        lines.append(f"error: {error}")
    return "\n".join(lines)
