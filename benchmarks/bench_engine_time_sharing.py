"""What sharing its CPU costs the engine: the offline engine's CPU per token on one CPU, alone,
beside a process that wakes often on the same CPU, and beside the same process on another CPU.

A served run's engine core on a small machine shares its CPU with the server's other
processes (the replica's event loop, HAProxy, the load client), which wake for every step's
outputs. Each switch between processes costs the engine its private caches, so its steps take
more CPU than the same steps offline. The neighbour here is such a process: it runs about
60 µs of Python (dicts, JSON) and sleeps 100 µs, over and over. ``LLM.generate`` runs the
tiny model's requests (greedy, EOS ignored) pinned to the first CPU, with one torch thread;
each setting takes the median of three timed calls (``bench.offline_cpu``), and the settings
alternate for ``--rounds``.

    python benchmarks/bench_engine_time_sharing.py [--requests 64] [--tokens 256] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import time

from pagedserve.bench.cpu_pinning import split_cpus
from pagedserve.bench.offline_cpu import measure_in_subprocess
from pagedserve.devtools.model_factory import ensure_model

WORK_S = 60e-6
SLEEP_S = 100e-6


def neighbour(stop, cpus: set[int]) -> None:
    """Wake, run ``WORK_S`` of Python, sleep ``SLEEP_S``; until ``stop`` is set."""
    os.sched_setaffinity(0, cpus)
    table = {}
    while not stop.is_set():
        start = time.perf_counter()
        while time.perf_counter() - start < WORK_S:
            for i in range(50):
                table[str(i)] = json.dumps({"index": i, "text": "x" * 20})
        time.sleep(SLEEP_S)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    engine_cpus, other_cpus = split_cpus()
    model = str(ensure_model("llama", "tiny"))
    rng = random.Random(0)
    requests = [([rng.randrange(100, 1000) for _ in range(16)], args.tokens) for _ in range(args.requests)]
    warmup = [([rng.randrange(100, 1000) for _ in range(16)], 16) for _ in range(8)]
    context = multiprocessing.get_context("spawn")
    for round_index in range(args.rounds):
        alone = None
        for setting, neighbour_cpus in (("alone", None), ("neighbour on the same CPU", engine_cpus),
                                        ("neighbour on another CPU", other_cpus)):
            stop, process = context.Event(), None
            if neighbour_cpus is not None:
                process = context.Process(target=neighbour, args=(stop, neighbour_cpus))
                process.start()
            try:
                result = measure_in_subprocess(model, requests, warmup, 1, {}, 3, engine_cpus)
            finally:
                stop.set()
                if process is not None:
                    process.join()
            us = result["us_per_token"]
            alone = alone or us
            print(json.dumps({"round": round_index + 1, "setting": setting, "us_per_token": round(us, 1),
                              "rounds_us_per_token": [round(x, 1) for x in result["rounds_us_per_token"]],
                              "cpu_us_per_step": round(result["engine_steps"]["cpu_us_per_step"]),
                              "against_alone": round(us / alone, 2)}), flush=True)


if __name__ == "__main__":
    main()
