"""Output tokens a worker streams to the handle per second, against its own engine.

One colocated worker (``--worker-cpus`` CPUs, so as many torch threads), ``--streams``
concurrent greedy requests of ``--max-tokens`` tokens each (EOS ignored) through
``ClusterHandle.generate``, the path every HTTP and gRPC request takes; then the same
requests through an engine with the worker's settings offline (``LLM.generate`` in this
process, with the worker's torch threads, final outputs only), and streamed from that engine
in this process (``AsyncLLMEngine``, one coroutine per request: what the worker does, without
Ray). Reported: delivered output tok/s, the offline
engine's, their ratio, the outputs each request received and their tokens, the Ray
messages the worker sent (one per engine step for all of the handle's requests, through
its output channel, ``workers.output_channel``), and the mean decode step in the worker
and offline (the worker's engine thread shares its process's GIL with the event loop
that sends).

    python benchmarks/bench_stream_messages.py [--streams 64] [--max-tokens 128] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time


async def _stream(handle, prompt: list[int], params) -> tuple[int, int]:
    messages = tokens = 0
    async for output in handle.generate(None, params, prompt_token_ids=prompt, is_streamed=True):
        messages += 1
        tokens = len(output.outputs[0].token_ids)
    return messages, tokens


async def _stream_in_process(llm, prompts: list[list[int]], params) -> float:
    """Seconds for the requests streamed from an ``AsyncLLMEngine`` in this process, one
    coroutine per request: the worker's engine, output thread and event loop without Ray."""
    from pagedserve.workers.async_engine import AsyncLLMEngine

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
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()

    import ray

    from pagedserve import LLM, SamplingParams
    from pagedserve.cluster import start

    engine_config = {"kv_cache_memory_gb": 0.25, "swap_space_gb": 0.01, "max_num_seqs": max(args.streams, 8)}
    ray.init(address="local", num_cpus=2, include_dashboard=False, namespace="pagedserve", log_to_driver=False)
    handle = start({"model": {"arch": "llama", "size": "tiny"}, "engine": engine_config,
                    "workers": [{"role": "mixed", "count": 1, "num_cpus": args.worker_cpus}]})
    prompts = [[5 + (i * 31 + j) % 900 for j in range(args.prompt_len)] for i in range(args.streams)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)

    async def run_all():
        await asyncio.gather(*(_stream(handle, p, params) for p in prompts[:2]))  # warm-up
        messages_before = _worker_messages(handle)
        start_s = time.perf_counter()
        results = await asyncio.gather(*(_stream(handle, p, params) for p in prompts))
        return results, time.perf_counter() - start_s, (
            None if messages_before is None else _worker_messages(handle) - messages_before)

    results, served_s, worker_messages = asyncio.run(run_all())
    if worker_messages is None:  # a build whose workers sent one message per output
        worker_messages = sum(m for m, _ in results)
    model_path = handle.model_path
    handle.wait_idle()
    workers = handle.stats()["workers"]
    workers = list(workers.values()) if isinstance(workers, dict) else workers
    served_step_ms = workers[0]["mean_decode_step_ms"]
    handle.check_integrity()
    handle.shutdown()
    ray.shutdown()

    import torch

    torch.set_num_threads(args.worker_cpus)  # as the worker's (Ray sets its OMP_NUM_THREADS)
    llm = LLM(model_path, **engine_config)
    llm.generate(prompts[:2], params)  # warm-up
    start_s = time.perf_counter()
    llm.generate(prompts, params)
    offline_s = time.perf_counter() - start_s
    offline_step_ms = llm.stats()["mean_decode_step_ms"]
    in_process_s = asyncio.run(_stream_in_process(llm, prompts, params))

    num_tokens = sum(tokens for _, tokens in results)
    assert num_tokens == args.streams * args.max_tokens, num_tokens
    outputs = [m for m, _ in results]
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
    }
    print(f"{args.streams} streams x {args.max_tokens} tokens: served {figures['served_tok_s']:,.0f} tok/s, "
          f"offline engine {figures['offline_tok_s']:,.0f} tok/s ({figures['served_over_offline']:.2f}x of it), "
          f"streamed in-process {figures['in_process_streaming_tok_s']:,.0f} tok/s "
          f"({figures['served_over_in_process_streaming']:.2f}x of it); "
          f"{figures['outputs_per_request_mean']:.1f} outputs per request "
          f"({figures['tokens_per_output']:.2f} tokens each), {worker_messages} messages from the worker "
          f"({figures['worker_messages_per_request']:.1f} per request); decode step {served_step_ms:.2f} ms in the "
          f"worker, {offline_step_ms:.2f} ms offline")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)


if __name__ == "__main__":
    main()
