"""KV blocks of beam search on copy-on-write blocks against a copy per beam (the seeds' table).

The seeds' table (seed 002): 4 beams take 32.4 GB of KV without copy-on-write and
12.8 GB with it (2.5x); 8 beams 64.8 GB against 18.2 GB (3.6x). It gives no prompt
or output length, so this runs a few shapes.

Each shape runs ``--requests`` beam searches at once (random prompts of
``prompt_len`` tokens, ``ignore_eos`` so that every beam runs ``max_tokens`` steps,
prefix caching off so that only the beams' sharing counts) on a pool large
enough that nothing is preempted. After every engine step it reads:
  - with copy-on-write: the pool's device blocks in use (what this step's forward
    holds: the beams share their common prefix and fork only the block being
    written);
  - copy per beam: the blocks the same beams would hold if each had its own copy of
    everything it reads, the sum over running beams of the blocks in their tables.
The ratio of the two peaks is the seeds' ratio. For scale, "prompt only" is the
ratio if the beams shared nothing but the prompt's full blocks (each diverging at
its first token); measured CoW beats it where beams also share output prefixes.
Every run ends with zero blocks in use and the pool's integrity checked.

    python benchmarks/bench_beam_blocks.py [--model-size small] [--block-size 16] [--requests 4]
"""

from __future__ import annotations

import argparse
import random
import time

from pagedserve import LLM, SamplingParams
from pagedserve.devtools.model_factory import ensure_model

SHAPES = ((512, 128), (128, 128), (1024, 256))    # (prompt tokens, output tokens)
WIDTHS = (4, 8)
SEEDS_GB = {4: (32.4, 12.8), 8: (64.8, 18.2)}     # beams: (without CoW, with CoW)


def measure(llm: LLM, prompts: list[list[int]], width: int, max_tokens: int) -> tuple[int, int, float]:
    """Peak blocks in use with copy-on-write, peak blocks a copy per beam would hold, seconds."""
    engine = llm.engine
    pool = engine.kv_manager.block_manager(engine.worker_id).device
    params = SamplingParams(n=width, max_tokens=max_tokens, temperature=0.0, use_beam_search=True,
                            ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"beam-{width}-{i}", None, params, prompt_token_ids=prompt)
    peak_shared = peak_copied = 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        peak_shared = max(peak_shared, pool.num_used_blocks)
        peak_copied = max(peak_copied, sum(len(seq.block_table) for seq in engine.scheduler.running))
    elapsed = time.perf_counter() - start
    llm.check_integrity()
    assert engine.num_used_blocks() == 0
    assert sum(llm.stats()["num_preemptions_by_mode"].values()) == 0, "pool too small: preemption"
    return peak_shared, peak_copied, elapsed


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-size", default="small", choices=("tiny", "small"))
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    path = str(ensure_model("llama", args.model_size))
    shapes = [(p, t) for p, t in SHAPES if args.model_size == "small" or p + t <= 512]
    max_len = max(p + t for p, t in shapes)
    blocks_per_seq = -(-max_len // args.block_size)
    num_blocks = args.requests * max(WIDTHS) * blocks_per_seq + 64
    llm = LLM(path, device="cpu", dtype="float32", block_size=args.block_size, num_device_blocks=num_blocks,
              swap_space_gb=0.001, enable_prefix_caching=False, max_model_len=max_len)
    bytes_per_block = llm.engine.runner.cache_shape(args.block_size).bytes_per_block
    rng = random.Random(args.seed)
    print(f"llama-{args.model_size}, block size {args.block_size}, {args.requests} beam searches at once, "
          f"ignore_eos, prefix caching off ({bytes_per_block} bytes of KV per block)")
    print(f"{'prompt':>6} {'output':>6} {'beams':>5} {'copy/beam':>9} {'CoW':>6} {'ratio':>6} "
          f"{'prompt only':>11} {'seeds':>6} {'seconds':>7}")
    for prompt_len, max_tokens in shapes:
        prompts = [[rng.randrange(5, 1000) for _ in range(prompt_len)] for _ in range(args.requests)]
        for width in WIDTHS:
            shared, copied, elapsed = measure(llm, prompts, width, max_tokens)
            without, with_cow = SEEDS_GB[width]
            num_prompt_blocks = prompt_len // args.block_size
            num_own_blocks = -(-(prompt_len + max_tokens) // args.block_size) - num_prompt_blocks
            prompt_only = copied / (args.requests * (num_prompt_blocks + width * num_own_blocks))
            print(f"{prompt_len:>6} {max_tokens:>6} {width:>5} {copied:>9} {shared:>6} {copied / shared:>5.2f}x "
                  f"{prompt_only:>10.2f}x {without / with_cow:>5.2f}x {elapsed:>7.1f}")


if __name__ == "__main__":
    main()
