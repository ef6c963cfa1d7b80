"""Output tokens a worker streams to the handle per second, against its own engine.

One colocated worker (``--worker-cpus`` CPUs, so as many torch threads), ``--streams``
concurrent greedy requests of ``--max-tokens`` tokens each (EOS ignored) through
``ClusterHandle.generate``, the path every HTTP and gRPC request takes; then the same
requests through an engine with the worker's settings offline (``LLM.generate`` in this
process, with the worker's torch threads, final outputs only), and streamed from that engine
in this process (``AsyncLLMEngine``, one coroutine per request: what the worker does, without
Ray). Reported: delivered output tok/s, the offline
engine's, their ratio, the outputs each request received and their tokens, the
messages the worker sent (one per engine step for all of the handle's requests, through
its output channel, ``workers.actor.output_channel``), and the mean decode step in the worker
and offline (the worker's engine thread shares its process's GIL with the event loop
that sends), and the longest wait between two outputs of a stream once every stream
decodes. ``--poll-stats S`` gathers the cluster's stats every S seconds while the
requests stream, as the dashboard does (each second): the polls' latency, and those
waits, show what a poll costs the serving processes. ``--per-output-us U`` spins U
microseconds of this process's CPU per output received, as a server's work per chunk
(building, framing and writing it) would: with enough of it the handle falls behind the
worker, as a replica at full load does at a GPU's step rate. Also reported: the worker's
engine core's CPU over the served run by phase of its loop (its inbox, steps, output
processing, sends, KV events), per step and per token: what serving costs the core's
thread, beside the steps themselves.

    python benchmarks/bench_stream_messages.py [--streams 64] [--max-tokens 128] [--poll-stats 1]
                                               [--per-output-us 200] [--output-transport zmq|ray]
                                               [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time


# Waits between outputs count from a stream's this many-th output on: before, the other
# streams' prompts are still being prefilled.
STEADY_AFTER_OUTPUTS = 16


async def _stream(handle, prompt: list[int], params, per_output_s: float = 0.0) -> tuple[int, int, float]:
    """(outputs, tokens, the longest wait between two outputs in seconds, once decoding)"""
    messages = tokens = 0
    longest_gap_s, last_s = 0.0, None
    async for output in handle.generate(None, params, prompt_token_ids=prompt, is_streamed=True):
        now_s = time.perf_counter()
        if per_output_s:   # a server's own work per output: building, framing and writing a chunk
            while time.perf_counter() - now_s < per_output_s:
                pass
        if messages >= STEADY_AFTER_OUTPUTS:
            longest_gap_s = max(longest_gap_s, now_s - last_s)
        messages, last_s = messages + 1, now_s
        tokens = output.outputs[0].num_tokens   # no copy of the growing list
    return messages, tokens, longest_gap_s


async def _poll_stats(handle, every_s: float, latencies_s: list[float]) -> None:
    """What the dashboard does: the cluster's stats every ``every_s`` (until cancelled)."""
    from pagedserve.cluster.stats import gather_stats

    while True:
        await asyncio.sleep(every_s)
        start_s = time.perf_counter()
        await gather_stats(handle)
        latencies_s.append(time.perf_counter() - start_s)


async def _stream_in_process(llm, prompts: list[list[int]], params) -> float:
    """Seconds for the requests streamed from an ``AsyncLLMEngine`` in this process, one
    coroutine per request: the worker's engine, output thread and event loop without Ray."""
    from pagedserve.workers.offline.async_engine import AsyncLLMEngine

    engine = AsyncLLMEngine(llm.engine)

    async def one(prompt):
        async for _ in engine.generate(None, params, prompt_token_ids=prompt):
            pass

    try:
        await asyncio.gather(*(one(p) for p in prompts[:2]))  # warm-up
        start_s = time.perf_counter()
        await asyncio.gather(*(one(p) for p in prompts))
        return time.perf_counter() - start_s
    finally:
        engine.shutdown()


async def _core_figures(handle) -> tuple[dict, int] | None:
    """The first worker's engine-core CPU seconds by phase, and its steps so far (None for a
    build without them)."""
    from pagedserve.cluster.stats import gather_stats

    worker = next(iter((await gather_stats(handle))["workers"].values()))
    seconds = worker.get("engine_core_cpu_seconds")
    return None if seconds is None else (seconds, worker["num_steps"])


def _core_phases(before: tuple[dict, int] | None, after: tuple[dict, int] | None, num_tokens: int) -> dict | None:
    """Each phase's CPU per step and per token (µs) between two ``_core_figures``."""
    if before is None or after is None:
        return None
    num_steps = after[1] - before[1]
    return {phase: {"us_per_step": 1e6 * (seconds - before[0].get(phase, 0.0)) / num_steps,
                    "us_per_token": 1e6 * (seconds - before[0].get(phase, 0.0)) / num_tokens}
            for phase, seconds in after[0].items()} | {"steps": num_steps}


def _worker_messages(handle) -> int | None:
    """Messages read from the workers so far (None for a build without output channels)."""
    channels = getattr(handle, "channels", None)
    return None if channels is None else channels.num_messages()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--worker-cpus", type=int, default=1)
    parser.add_argument("--poll-stats", type=float, default=None, metavar="S",
                        help="gather the cluster's stats every S seconds while streaming (the dashboard: 1)")
    parser.add_argument("--per-output-us", type=float, default=0.0,
                        help="spin this long per output received, as a server's work per chunk would")
    parser.add_argument("--output-transport", default="zmq", choices=("zmq", "ray"),
                        help="how the worker's channel carries its messages to the handle")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()

    import ray

    from pagedserve import LLM, SamplingParams
    from pagedserve.cluster import start

    engine_config = {"kv_cache_memory_gb": 0.25, "swap_space_gb": 0.01, "max_num_seqs": max(args.streams, 8)}
    ray.init(address="local", num_cpus=2, include_dashboard=False, namespace="pagedserve", log_to_driver=False)
    handle = start({"model": {"arch": "llama", "size": "tiny"}, "engine": engine_config,
                    "workers": [{"role": "mixed", "count": 1, "num_cpus": args.worker_cpus}],
                    "output_transport": args.output_transport})
    prompts = [[5 + (i * 31 + j) % 900 for j in range(args.prompt_len)] for i in range(args.streams)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    handle_gc = None
    try:  # this process stands for a Serve replica, whose start-up heap is frozen
        from pagedserve.workers.process.gc_heap import prepare_serving_heap
        handle_gc = prepare_serving_heap("the benchmark's handle")
    except ImportError:  # a build before it
        pass

    poll_latencies_s: list[float] = []

    async def run_all():
        await asyncio.gather(*(_stream(handle, p, params) for p in prompts[:2]))  # warm-up
        messages_before = _worker_messages(handle)
        core_before = await _core_figures(handle)
        poller = (asyncio.create_task(_poll_stats(handle, args.poll_stats, poll_latencies_s))
                  if args.poll_stats else None)
        start_s = time.perf_counter()
        results = await asyncio.gather(*(_stream(handle, p, params, args.per_output_us * 1e-6) for p in prompts))
        served_s = time.perf_counter() - start_s
        if poller is not None:
            poller.cancel()
        core_after = await _core_figures(handle)
        return results, served_s, (
            None if messages_before is None else _worker_messages(handle) - messages_before), (core_before, core_after)

    results, served_s, worker_messages, core_figures = asyncio.run(run_all())
    handle_gc_figures = handle_gc.snapshot() if handle_gc is not None else None   # before the offline runs
    if worker_messages is None:  # a build whose workers sent one message per output
        worker_messages = sum(m for m, _, _ in results)
    model_path = handle.model_path
    handle.wait_idle()
    workers = handle.stats()["workers"]
    workers = list(workers.values()) if isinstance(workers, dict) else workers
    served_step_ms = workers[0]["mean_decode_step_ms"]
    worker_gc = workers[0].get("gc")   # the worker's collections: counts and pauses per generation
    handle.check_integrity()
    handle.shutdown()
    ray.shutdown()

    import torch

    torch.set_num_threads(args.worker_cpus)  # as the worker's (Ray sets its OMP_NUM_THREADS)
    llm = LLM(model_path, **engine_config)
    llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
    start_s = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    offline_s = time.perf_counter() - start_s
    offline_step_ms = llm.stats()["mean_decode_step_ms"]
    in_process_s = asyncio.run(_stream_in_process(llm, prompts, params))

    num_tokens = sum(tokens for _, tokens, _ in results)
    assert num_tokens == args.streams * args.max_tokens, num_tokens
    outputs = [m for m, _, _ in results]
    gaps_ms = sorted(1e3 * gap for _, _, gap in results)
    figures = {
        "streams": args.streams, "max_tokens": args.max_tokens,
        "served_tok_s": num_tokens / served_s, "offline_tok_s": num_tokens / offline_s,
        "served_over_offline": offline_s / served_s,
        "in_process_streaming_tok_s": num_tokens / in_process_s,
        "served_over_in_process_streaming": in_process_s / served_s,
        "outputs_per_request_mean": sum(outputs) / len(outputs),
        "tokens_per_output": num_tokens / sum(outputs),
        "worker_messages": worker_messages,
        "worker_messages_per_request": worker_messages / args.streams,
        "worker_decode_step_ms": served_step_ms, "offline_decode_step_ms": offline_step_ms,
        "longest_output_gap_ms": {"median_stream": gaps_ms[len(gaps_ms) // 2], "max": gaps_ms[-1]},
        "worker_gc": worker_gc,
        "engine_core_phases": _core_phases(*core_figures, num_tokens),
    }
    if args.poll_stats:
        polls_ms = sorted(1e3 * s for s in poll_latencies_s)
        figures["stats_polls"] = {"every_s": args.poll_stats, "count": len(polls_ms),
                                  "median_ms": polls_ms[len(polls_ms) // 2] if polls_ms else None,
                                  "max_ms": polls_ms[-1] if polls_ms else None}
    print(f"{args.streams} streams x {args.max_tokens} tokens: served {figures['served_tok_s']:,.0f} tok/s, "
          f"offline engine {figures['offline_tok_s']:,.0f} tok/s ({figures['served_over_offline']:.2f}x of it), "
          f"streamed in-process {figures['in_process_streaming_tok_s']:,.0f} tok/s "
          f"({figures['served_over_in_process_streaming']:.2f}x of it); "
          f"{figures['outputs_per_request_mean']:.1f} outputs per request "
          f"({figures['tokens_per_output']:.2f} tokens each), {worker_messages} messages from the worker "
          f"({figures['worker_messages_per_request']:.1f} per request); decode step {served_step_ms:.2f} ms in the "
          f"worker, {offline_step_ms:.2f} ms offline; longest wait between two outputs "
          f"{gaps_ms[len(gaps_ms) // 2]:.1f} ms (median stream), {gaps_ms[-1]:.1f} ms (max)")
    phases = figures["engine_core_phases"]
    if phases is not None:
        print(f"the engine core's CPU over {phases['steps']} steps, by phase, per step (per token): " + ", ".join(
            f"{phase} {value['us_per_step']:.1f} us ({value['us_per_token']:.2f})"
            for phase, value in phases.items() if phase != "steps"))
    figures["handle_gc"] = handle_gc_figures
    for process, gc_figures in (("worker", worker_gc), ("handle", handle_gc_figures)):
        if gc_figures is not None:
            print(f"the {process}'s collections per generation: " + ", ".join(
                f"{n} ({1e3 * longest:.1f} ms longest)" for n, longest in zip(gc_figures["collections"],
                                                                            gc_figures["max_pause_seconds"])))
    if args.poll_stats:
        polls = figures["stats_polls"]
        print(f"stats gathered every {args.poll_stats:g} s: {polls['count']} polls, "
              f"{polls['median_ms']:.1f} ms median, {polls['max_ms']:.1f} ms max")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)


if __name__ == "__main__":
    main()
