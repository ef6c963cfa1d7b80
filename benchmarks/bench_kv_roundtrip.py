"""KV manager round trip against the decode step, with several workers on one machine.

Starts a local Ray cluster with ``--workers`` CPU workers (``num_cpus=0.5``
each) and the central KV manager actor, runs a decode-heavy load
(``--per-worker`` concurrent requests per worker, ``--max-tokens`` output
tokens each, greedy), and reports, from the measured round only (a warm-up
round runs first):
- per worker, the mean KV manager round trip per engine step as the worker
  measures it (msgpack in, Ray call, msgpack out) and the mean decode step
  wall time (the round trip included), and their ratio (target < 10%);
- the KV manager's own mean compute time per step (unpack, plan, pack),
  so the rest of the round trip is Ray's messaging.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time


def _totals(stats: dict) -> dict:
    """Cumulative sums behind the workers' and the manager's means (to take deltas)."""
    workers = {}
    for worker_id, s in stats["workers"].items():
        workers[worker_id] = {
            "kv_ms": s["mean_kv_call_ms"] * s["num_kv_calls"], "kv_calls": s["num_kv_calls"],
            "decode_ms": s["mean_decode_step_ms"] * s["num_decode_steps"],
            "decode_steps": s["num_decode_steps"], "tokens": s["num_generated_tokens"],
        }
    kv = stats["kv_manager"]
    return {"workers": workers, "manager_ms": kv["mean_step_ms"] * kv["num_steps"],
            "manager_steps": kv["num_steps"]}


def _mean(total: float, count: int) -> float:
    return total / count if count else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size", default="small", choices=["tiny", "small"])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--per-worker", type=int, default=8, help="concurrent requests per worker")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(16, 96), metavar=("MIN", "MAX"))
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()

    import ray

    from pagedserve.cluster import start
    from pagedserve.workers.sampling_params import SamplingParams

    ray.init(address="local", num_cpus=args.workers * 0.5 + 1, include_dashboard=False,
             namespace="pagedserve", log_to_driver=False)
    num_blocks = args.per_worker * -(-(args.prompt_len[1] + args.max_tokens) // 16) * 2
    handle = start({
        "model": {"arch": "llama", "size": args.size},
        "engine": {"num_device_blocks": num_blocks, "swap_space_gb": 0.001},
        "workers": [{"count": args.workers, "num_cpus": 0.5}],
        "kv_manager_num_cpus": 0.5,
    })
    try:
        rng = random.Random(0)
        vocab = 2048 if args.size == "small" else 1024

        def prompts(n: int) -> list[list[int]]:
            return [[rng.randrange(3, vocab) for _ in range(rng.randint(*args.prompt_len))]
                    for _ in range(n)]

        handle.generate_sync(prompts(args.workers),
                             SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        before = _totals(handle.stats())
        num_requests = args.workers * args.per_worker
        start_time = time.perf_counter()
        outputs = handle.generate_sync(
            prompts(num_requests),
            SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True))
        elapsed = time.perf_counter() - start_time
        after = _totals(handle.stats())
        if not all(o.finished and len(o.outputs[0].token_ids) == args.max_tokens for o in outputs):
            raise RuntimeError("some requests did not finish with max_tokens tokens")
        handle.wait_idle()
        handle.check_integrity()
    finally:
        handle.shutdown()
        ray.shutdown()

    rows = []
    for worker_id, end in sorted(after["workers"].items()):
        begin = before["workers"].get(worker_id, {k: 0 for k in end})
        kv_ms = _mean(end["kv_ms"] - begin["kv_ms"], end["kv_calls"] - begin["kv_calls"])
        step_ms = _mean(end["decode_ms"] - begin["decode_ms"], end["decode_steps"] - begin["decode_steps"])
        rows.append({"worker_id": worker_id, "num_tokens": end["tokens"] - begin["tokens"],
                     "num_kv_calls": end["kv_calls"] - begin["kv_calls"],
                     "num_decode_steps": end["decode_steps"] - begin["decode_steps"],
                     "mean_kv_call_ms": kv_ms, "mean_decode_step_ms": step_ms,
                     "kv_fraction": kv_ms / step_ms if step_ms else 0.0})
    manager_ms = _mean(after["manager_ms"] - before["manager_ms"],
                       after["manager_steps"] - before["manager_steps"])
    mean_kv = statistics.mean(r["mean_kv_call_ms"] for r in rows)
    mean_step = statistics.mean(r["mean_decode_step_ms"] for r in rows)
    summary = {
        "model": args.size, "num_workers": args.workers, "num_requests": num_requests,
        "max_tokens": args.max_tokens, "elapsed_s": elapsed,
        "output_tok_per_s": sum(r["num_tokens"] for r in rows) / elapsed,
        "mean_kv_call_ms": mean_kv, "mean_decode_step_ms": mean_step,
        "kv_fraction_of_decode_step": mean_kv / mean_step if mean_step else 0.0,
        "kv_manager_mean_step_ms": manager_ms, "workers": rows,
    }

    print(f"{args.workers} workers, model {args.size}, {num_requests} requests x {args.max_tokens} "
          f"tokens in {elapsed:.1f} s ({summary['output_tok_per_s']:.0f} output tok/s)")
    print(f"{'worker':<10} {'tokens':>7} {'kv calls':>9} {'decode steps':>13} {'kv call ms':>11} "
          f"{'decode step ms':>15} {'kv / step':>10}")
    for r in rows:
        print(f"{r['worker_id']:<10} {r['num_tokens']:>7} {r['num_kv_calls']:>9} {r['num_decode_steps']:>13} "
              f"{r['mean_kv_call_ms']:>11.2f} {r['mean_decode_step_ms']:>15.2f} {r['kv_fraction']:>9.1%}")
    verdict = "OK" if summary["kv_fraction_of_decode_step"] < 0.10 else "ABOVE TARGET"
    print(f"mean KV manager round trip {mean_kv:.2f} ms vs mean decode step {mean_step:.2f} ms: "
          f"{summary['kv_fraction_of_decode_step']:.1%} of a step (target < 10%: {verdict})")
    print(f"KV manager's own compute per step: {manager_ms:.3f} ms "
          f"(the rest of the round trip, {mean_kv - manager_ms:.2f} ms, is messaging)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)


if __name__ == "__main__":
    main()
