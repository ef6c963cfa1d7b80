"""The offline engine's CPU per output token on a served benchmark's requests.

``LLM.generate`` runs the requests at once (greedy, EOS ignored, each request its own
``max_tokens``) with one torch thread, as a worker actor of one CPU runs, after a warm-up
on other requests. The figure is the process's own CPU time (user + system, all its
threads) over the timed call, divided by the output tokens: the engine's cost of a token
with no server around it, the baseline of ``bench serve --cpu-per-token``; and the engine's
steps over the call (``engine_steps``).

The timed call runs ``rounds`` times and the median round is the figure: on a shared
virtual machine one run's CPU per token can stray by a fifth from the next one's, and the
baseline is subtracted from the server's figure. Every round's figure is kept beside it.

``measure_in_subprocess`` runs it in a fresh spawned process, so that the figure holds
nothing of the caller's (its load client, its imports) and the caller's torch is untouched.
"""

from __future__ import annotations

import os
import time

Prompt = str | list[int]


def measure(model: str, requests: list[tuple[Prompt, int]], warmup: list[tuple[Prompt, int]],
            num_threads: int = 1, engine_options: dict | None = None, rounds: int = 1,
            cpus: set[int] | None = None) -> dict:
    """CPU seconds, output tokens and seconds of ``LLM.generate`` on ``requests`` in this
    process (``(prompt, max_tokens)`` each), after ``warmup``: the median of ``rounds`` timed
    calls, with each round's CPU per token (``rounds_us_per_token``). ``cpus``: this process
    runs on those CPUs only (a pinned served run's engine CPU)."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    if cpus:
        os.sched_setaffinity(0, cpus)
    import psutil

    from pagedserve import LLM, SamplingParams

    from .report import torch_threads

    def run(batch: list[tuple[Prompt, int]]) -> int:
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in batch]
        outputs = llm.generate([prompt for prompt, _ in batch], params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outputs)

    with torch_threads(num_threads) as threads:
        llm = LLM(model, **(engine_options or {}))
        if warmup:
            run(warmup)
        process = psutil.Process()
        timed = [_timed_call(llm, run, requests, process) for _ in range(rounds)]
    timed.sort(key=lambda one: one["us_per_token"])
    return {"model": model, "threads": threads, "engine_options": engine_options or {},
            "cpus": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            "num_requests": len(requests), **timed[(len(timed) - 1) // 2],
            "rounds_us_per_token": [one["us_per_token"] for one in timed]}


def _timed_call(llm, run, requests: list[tuple[Prompt, int]], process) -> dict:
    """One timed ``run(requests)``: its tokens, seconds, CPU and the engine's steps."""
    from . import engine_steps

    steps_before = engine_steps.counters(llm.engine.stats())
    before, start = process.cpu_times(), time.perf_counter()
    num_tokens = run(requests)
    seconds, after = time.perf_counter() - start, process.cpu_times()
    steps_after = engine_steps.counters(llm.engine.stats())
    cpu_s = (after.user + after.system) - (before.user + before.system)
    return {"num_output_tokens": num_tokens, "seconds": seconds, "output_throughput": num_tokens / seconds,
            "cpu_s": cpu_s, "us_per_token": cpu_s / num_tokens * 1e6 if num_tokens else float("nan"),
            "engine_steps": engine_steps.window(steps_before, steps_after, cpu_s)}


def measure_in_subprocess(model: str, requests: list[tuple[Prompt, int]], warmup: list[tuple[Prompt, int]],
                          num_threads: int = 1, engine_options: dict | None = None, rounds: int = 1,
                          cpus: set[int] | None = None) -> dict:
    """``measure`` in a new process (``spawn``); its result."""
    import concurrent.futures
    import multiprocessing

    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(measure, model, requests, warmup, num_threads, engine_options, rounds, cpus).result()
