"""Where a LoRA adapter's requests land in a cluster: on a worker that already holds it?

A local Ray cluster of ``--workers`` CPU workers (the tiny random llama, ``enable_lora``,
``--max-loras`` slots and ``--max-cpu-loras`` adapters in host memory each), driven through
``ClusterHandle.generate`` (the router every ingress replica runs): ``--requests`` greedy
requests, ``--concurrency`` at a time, each on one of ``--adapters`` adapters drawn at random
(rank 8, every linear layer). A request lands on a holder when its worker had the adapter in
host memory or a slot: the workers' own counters say how many adapter reads the run caused
(each read is a request that landed elsewhere, the adapters' first reads included). The same
load runs with the router's ``cache_aware`` policy (adapter affinity, the workers' adapter
reports) and with ``round_robin`` (no affinity), side by side.

    python benchmarks/bench_lora_routing.py [--workers 2 --adapters 8 --requests 256]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from pathlib import Path

from bench_lora import ALL_LINEAR, write_adapter

from pagedserve import LoRARequest, SamplingParams
from pagedserve.devtools.model_factory import ensure_model


def adapter_reads(handle) -> int:
    return sum(worker["lora"]["num_adapter_reads"] for worker in handle.stats()["workers"].values())


async def drive(handle, jobs: list[tuple[list[int], LoRARequest]], concurrency: int) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    queue = list(enumerate(jobs))

    async def client() -> None:
        while queue:
            index, (prompt, lora) = queue.pop(0)
            async for _ in handle.generate(prompt, params, request_id=f"route-{index}-{time.time_ns()}",
                                           lora_request=lora):
                pass

    await asyncio.gather(*(client() for _ in range(concurrency)))


def run(policy: str, args, model_path: str, adapters: list[LoRARequest], jobs) -> dict:
    from pagedserve.cluster.bootstrap import start

    config = {"model": {"path": model_path}, "router": {"policy": policy},
              "engine": {"num_device_blocks": 256, "swap_space_gb": 0.001, "enable_lora": True,
                         "max_loras": args.max_loras, "max_cpu_loras": args.max_cpu_loras, "max_lora_rank": 8},
              "workers": [{"count": args.workers, "num_cpus": 0.5}]}
    handle = start(config, ready_timeout_s=180.0)
    try:
        before = adapter_reads(handle)
        start_time = time.perf_counter()
        asyncio.run(drive(handle, jobs, args.concurrency))
        seconds = time.perf_counter() - start_time
        time.sleep(1.0)
        reads = adapter_reads(handle) - before
        reasons = handle.stats()["router"]["reasons"]
    finally:
        handle.shutdown()
    return {"policy": policy, "reads": reads, "on_holder": 1 - reads / len(jobs),
            "on_holder_after_first_reads": 1 - max(0, reads - len(adapters)) / len(jobs),
            "seconds": seconds, "reasons": reasons}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-loras", type=int, default=2)
    parser.add_argument("--max-cpu-loras", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    import ray
    from transformers import AutoModelForCausalLM

    from pagedserve.cluster.bootstrap import NAMESPACE

    model_path = str(ensure_model("llama", "tiny"))
    model = AutoModelForCausalLM.from_pretrained(model_path)
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as root:
        adapters = [LoRARequest(f"adapter-{i}", i + 1, write_adapter(Path(root) / str(i), model, 8,
                                                                    ALL_LINEAR.split(","), i))
                    for i in range(args.adapters)]
        jobs = [([rng.randrange(5, 1000) for _ in range(rng.randrange(8, 64))], rng.choice(adapters))
                for _ in range(args.requests)]
        ray.init(address="local", namespace=NAMESPACE, num_cpus=4, include_dashboard=False, log_to_driver=False)
        try:
            results = [run(policy, args, model_path, adapters, jobs) for policy in ("cache_aware", "round_robin")]
        finally:
            ray.shutdown()
    print(f"{args.workers} workers (max_loras {args.max_loras}, max_cpu_loras {args.max_cpu_loras}), "
          f"{args.adapters} adapters, {args.requests} requests, {args.concurrency} at a time")
    print(f"{'router policy':>14} {'adapter reads':>14} {'on a holder':>12} {'past first reads':>17} {'seconds':>8}  reasons")
    for r in results:
        print(f"{r['policy']:>14} {r['reads']:>14} {r['on_holder']:>12.1%} {r['on_holder_after_first_reads']:>17.1%} "
              f"{r['seconds']:>8.1f}  {r['reasons']}")


if __name__ == "__main__":
    main()
