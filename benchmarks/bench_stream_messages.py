"""Output tokens a worker streams to the handle per second, against its own engine.

One colocated worker, ``--streams`` concurrent greedy requests of ``--max-tokens``
tokens each (EOS ignored) through ``ClusterHandle.generate``, the path every HTTP and
gRPC request takes; then the same requests through an engine with the worker's settings
offline (``LLM.generate`` in this process). Reported: delivered output tok/s, the offline
engine's, their ratio, the messages (``OutputDelta``s) each request received from the
worker, the tokens per message, and the mean decode step in the worker and offline (the
worker's engine thread shares its process's GIL with the event loop that sends). Every Ray message costs the worker's event loop a few
hundred microseconds, so a stream that sent one per step fell behind an engine that
steps faster than that times the number of streams; a stream now sends everything made
since its last message as one.

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()

    import ray

    from pagedserve import LLM, SamplingParams
    from pagedserve.cluster import start

    engine_config = {"kv_cache_memory_gb": 0.25, "swap_space_gb": 0.01, "max_num_seqs": max(args.streams, 8)}
    ray.init(address="local", num_cpus=2, include_dashboard=False, namespace="pagedserve", log_to_driver=False)
    handle = start({"model": {"arch": "llama", "size": "tiny"}, "engine": engine_config,
                    "workers": [{"role": "mixed", "count": 1, "num_cpus": 1}]})
    prompts = [[5 + (i * 31 + j) % 900 for j in range(args.prompt_len)] for i in range(args.streams)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)

    async def run_all():
        await asyncio.gather(*(_stream(handle, p, params) for p in prompts[:2]))  # warm-up
        start_s = time.perf_counter()
        results = await asyncio.gather(*(_stream(handle, p, params) for p in prompts))
        return results, time.perf_counter() - start_s

    results, served_s = asyncio.run(run_all())
    model_path = handle.model_path
    handle.wait_idle()
    workers = handle.stats()["workers"]
    workers = list(workers.values()) if isinstance(workers, dict) else workers
    served_step_ms = workers[0]["mean_decode_step_ms"]
    handle.check_integrity()
    handle.shutdown()
    ray.shutdown()

    llm = LLM(model_path, **engine_config)
    llm.generate(prompts[:2], params)  # warm-up
    start_s = time.perf_counter()
    llm.generate(prompts, params)
    offline_s = time.perf_counter() - start_s
    offline_step_ms = llm.stats()["mean_decode_step_ms"]

    num_tokens = sum(tokens for _, tokens in results)
    assert num_tokens == args.streams * args.max_tokens, num_tokens
    messages = [m for m, _ in results]
    figures = {
        "streams": args.streams, "max_tokens": args.max_tokens,
        "served_tok_s": num_tokens / served_s, "offline_tok_s": num_tokens / offline_s,
        "served_over_offline": offline_s / served_s,
        "messages_per_request_mean": sum(messages) / len(messages),
        "tokens_per_message": num_tokens / sum(messages),
        "worker_decode_step_ms": served_step_ms, "offline_decode_step_ms": offline_step_ms,
    }
    print(f"{args.streams} streams x {args.max_tokens} tokens: served {figures['served_tok_s']:,.0f} tok/s, "
          f"offline engine {figures['offline_tok_s']:,.0f} tok/s ({figures['served_over_offline']:.2f}x of it); "
          f"{figures['messages_per_request_mean']:.1f} messages per request, "
          f"{figures['tokens_per_message']:.2f} tokens per message; decode step {served_step_ms:.2f} ms in the "
          f"worker, {offline_step_ms:.2f} ms offline")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)


if __name__ == "__main__":
    main()
