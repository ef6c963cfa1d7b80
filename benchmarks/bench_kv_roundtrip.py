"""The KV share of a decode step, with several workers on one machine.

Starts a local Ray cluster with ``--workers`` CPU workers (``num_cpus=0.5``
each) and the central KV manager actor, runs a decode-heavy load
(``--per-worker`` concurrent requests per worker, ``--max-tokens`` output
tokens each, greedy), and reports, from the measured round only (a warm-up
round runs first), per worker:
- the KV work per decode step on the step's path: the local KV manager's
  plan (``LocalKVManager.step``, any blocking central preemption call
  included) plus the step hooks (the KV event flush, which never waits),
  against the mean decode step wall time (target <= 1%);
- blocking calls to the central KV manager per engine step (target: only
  when a step cannot grow);
and, for the central KV manager: event batches published per engine step
and its handler CPU per batch.

Before the two-level design this script measured the blocking per-step
round trip to the central actor (every step, 8-14% of a CPU decode step;
README "Benchmark figures").
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

WORKER_KEYS = ("decode_kv_seconds", "step_hook_seconds", "num_step_calls", "num_decode_steps",
               "num_generated_tokens", "num_steps", "num_blocking_kv_calls", "num_event_batches")


def _totals(stats: dict) -> dict:
    """Cumulative sums behind the workers' and the central manager's figures (to take deltas)."""
    workers = {}
    for worker_id, s in stats["workers"].items():
        entry = {key: s[key] for key in WORKER_KEYS}
        entry["decode_ms"] = s["mean_decode_step_ms"] * s["num_decode_steps"]
        workers[worker_id] = entry
    kv = stats["kv_manager"]
    return {"workers": workers, "handler_cpu_s": kv["handler_cpu_s"], "num_publishes": kv["num_publishes"],
            "num_preemption_calls": kv["num_preemption_calls"]}


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
    from pagedserve.workers.sample.sampling_params import SamplingParams

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
        d = {k: end[k] - begin[k] for k in end}
        step_ms = _mean(d["decode_ms"], d["num_decode_steps"])
        plan_ms = 1e3 * _mean(d["decode_kv_seconds"], d["num_decode_steps"])
        hook_ms = 1e3 * _mean(d["step_hook_seconds"], d["num_step_calls"])
        kv_ms = plan_ms + hook_ms
        rows.append({"worker_id": worker_id, "num_tokens": d["num_generated_tokens"],
                     "num_decode_steps": d["num_decode_steps"], "num_steps": d["num_steps"],
                     "mean_kv_ms_per_decode_step": kv_ms, "mean_kv_plan_ms": plan_ms, "mean_step_hook_ms": hook_ms,
                     "mean_decode_step_ms": step_ms,
                     "kv_fraction": kv_ms / step_ms if step_ms else 0.0,
                     "num_blocking_kv_calls": d["num_blocking_kv_calls"],
                     "blocking_calls_per_step": _mean(d["num_blocking_kv_calls"], d["num_steps"]),
                     "event_batches_per_step": _mean(d["num_event_batches"], d["num_steps"])})
    num_publishes = after["num_publishes"] - before["num_publishes"]
    handler_ms = 1e3 * _mean(after["handler_cpu_s"] - before["handler_cpu_s"], num_publishes)
    mean_kv = statistics.mean(r["mean_kv_ms_per_decode_step"] for r in rows)
    mean_step = statistics.mean(r["mean_decode_step_ms"] for r in rows)
    num_steps = sum(r["num_steps"] for r in rows)
    summary = {
        "model": args.size, "num_workers": args.workers, "num_requests": num_requests,
        "max_tokens": args.max_tokens, "elapsed_s": elapsed,
        "output_tok_per_s": sum(r["num_tokens"] for r in rows) / elapsed,
        "mean_kv_ms_per_decode_step": mean_kv, "mean_decode_step_ms": mean_step,
        "kv_fraction_of_decode_step": mean_kv / mean_step if mean_step else 0.0,
        "blocking_calls_per_step": _mean(sum(r["num_blocking_kv_calls"] for r in rows), num_steps),
        "event_batches_per_step": _mean(num_publishes, num_steps),
        "central_handler_ms_per_batch": handler_ms,
        "workers": rows,
    }

    print(f"{args.workers} workers, model {args.size}, {num_requests} requests x {args.max_tokens} "
          f"tokens in {elapsed:.1f} s ({summary['output_tok_per_s']:.0f} output tok/s)")
    print(f"{'worker':<10} {'tokens':>7} {'decode steps':>13} {'kv ms/step':>11} {'(plan + flush)':>16} "
          f"{'decode step ms':>15} {'kv / step':>10} {'blocking/step':>14}")
    for r in rows:
        split = f"{r['mean_kv_plan_ms']:.3f} + {r['mean_step_hook_ms']:.3f}"
        print(f"{r['worker_id']:<10} {r['num_tokens']:>7} {r['num_decode_steps']:>13} "
              f"{r['mean_kv_ms_per_decode_step']:>11.3f} {split:>16} {r['mean_decode_step_ms']:>15.2f} "
              f"{r['kv_fraction']:>9.2%} {r['blocking_calls_per_step']:>14.3f}")
    verdict = "OK" if summary["kv_fraction_of_decode_step"] <= 0.01 else "ABOVE TARGET"
    print(f"KV work on the step's path {mean_kv:.3f} ms vs mean decode step {mean_step:.2f} ms: "
          f"{summary['kv_fraction_of_decode_step']:.2%} of a step (target <= 1%: {verdict})")
    print(f"blocking central calls per step {summary['blocking_calls_per_step']:.4f}; "
          f"{summary['event_batches_per_step']:.3f} event batches per step, central handler "
          f"{handler_ms:.3f} ms per batch")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)


if __name__ == "__main__":
    main()
