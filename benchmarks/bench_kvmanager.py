"""KV manager micro-benchmarks: allocator ops/s and decode-step planning time.

Reports, each beside a baseline measured in the same run:
- block allocate+free pairs per second, against the seed documents' Python
  slab allocator (a free list plus an in-use set) re-implemented here;
- the KV manager's time to plan one decode step for 256 running sequences,
  against one ``list.copy()`` of a 256-entry list per sequence (a floor).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from pagedserve.kvmanager import BlockPool, KVManager, NewSequence, PoolConfig, StepInput


class SeedSlabAllocator:
    """The seed article's allocator: a free list and an in-use set."""

    def __init__(self, num_blocks: int) -> None:
        self.free = list(range(num_blocks))
        self.in_use: set[int] = set()

    def alloc(self):
        if not self.free:
            return None
        block = self.free.pop()
        self.in_use.add(block)
        return block

    def free_page(self, block: int) -> None:
        if block in self.in_use:
            self.in_use.remove(block)
            self.free.append(block)


def pairs_per_second(alloc, free, num_pairs: int, repeats: int = 5) -> float:
    best = 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(num_pairs):
            free(alloc())
        best = max(best, num_pairs / (time.perf_counter() - start))
    return best


def bench_allocator(num_pairs: int) -> dict:
    pool = BlockPool(4096, 16)
    slab = SeedSlabAllocator(4096)
    ours = pairs_per_second(pool.allocate, pool.free, num_pairs)
    seed = pairs_per_second(slab.alloc, slab.free_page, num_pairs)
    return {"pool_pairs_per_s": ours, "seed_slab_pairs_per_s": seed, "ratio_vs_seed": ours / seed}


def bench_decode_step(num_seqs: int, prompt_len: int, num_steps: int) -> dict:
    manager = KVManager()
    manager.add_worker("w", PoolConfig(num_device_blocks=num_seqs * ((prompt_len + num_steps) // 16 + 2),
                                       block_size=16, max_model_len=4096))
    ids = [f"seq{i}" for i in range(num_seqs)]
    manager.step(StepInput("w", waiting=ids, token_budget=num_seqs * prompt_len, new_sequences=[
        NewSequence(seq_id, [i] * 3 + list(range(prompt_len - 3))) for i, seq_id in enumerate(ids)]))
    times = []
    for step in range(num_steps):
        step_input = StepInput("w", running=ids, appended=[(s, [step]) for s in ids])
        start = time.perf_counter()
        output = manager.step(step_input)
        times.append(time.perf_counter() - start)
        assert len(output.scheduled) == num_seqs
    manager.check_integrity()
    floor = []
    tables = [list(range(prompt_len // 16 + 1)) for _ in ids]
    for _ in range(num_steps):
        start = time.perf_counter()
        _ = [t.copy() for t in tables]
        floor.append(time.perf_counter() - start)
    median = statistics.median(times)
    return {"num_seqs": num_seqs, "median_step_ms": median * 1e3,
            "p90_step_ms": sorted(times)[int(0.9 * len(times))] * 1e3,
            "ratio_vs_table_copy": median / statistics.median(floor)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pairs", type=int, default=500_000)
    parser.add_argument("--seqs", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = {"allocator": bench_allocator(args.pairs),
              "decode_step": bench_decode_step(args.seqs, args.prompt_len, args.steps)}
    if args.json:
        print(json.dumps(result, indent=2))
        return
    a, d = result["allocator"], result["decode_step"]
    print(f"allocate+free pairs/s: {a['pool_pairs_per_s']:,.0f}  "
          f"(seed slab allocator {a['seed_slab_pairs_per_s']:,.0f}; ratio {a['ratio_vs_seed']:.2f}x)")
    print(f"plan one decode step, {d['num_seqs']} running sequences: median {d['median_step_ms']:.3f} ms, "
          f"p90 {d['p90_step_ms']:.3f} ms ({d['ratio_vs_table_copy']:.1f}x copying their block tables)")


if __name__ == "__main__":
    main()
