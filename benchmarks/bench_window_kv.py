"""KV memory saved by freeing blocks out of the sliding window, on a long windowed workload.

One tiny Mistral-class checkpoint (every layer windowed) runs the same requests twice on
the same engine settings: once as served (blocks wholly out of the window freed as the
window moves) and once keeping every block (the pool's window policy switched off, as
for a model with a global layer). The pool is big enough that nothing is preempted, so
the peak of device blocks in use is the workload's demand. Greedy outputs of the two
runs must be identical.

    python benchmarks/bench_window_kv.py [--window 128] [--requests 32] [--block-size 16]
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

from pagedserve import LLM, SamplingParams
from pagedserve.devtools.model_matrix import make_matrix_model


def run(path: str, prompts, params, block_size: int, num_blocks: int, free_out_of_window: bool):
    llm = LLM(path, device="cpu", dtype="float32", block_size=block_size, num_device_blocks=num_blocks,
              swap_space_gb=0.001, max_num_batched_tokens=512, enable_prefix_caching=False)
    manager = llm.engine.kv_manager.block_manager(llm.engine.worker_id)
    if not free_out_of_window:
        manager.window = None
    for i, prompt in enumerate(prompts):
        llm.engine.add_request(str(i), None, params, prompt_token_ids=prompt)
    peak, outputs, start = 0, {}, time.perf_counter()
    while llm.engine.has_unfinished_requests():
        for output in llm.engine.step():
            if output.finished:
                outputs[output.request_id] = output.outputs[0].token_ids
        peak = max(peak, manager.device.num_used_blocks)
    elapsed = time.perf_counter() - start
    llm.check_integrity()
    stats = llm.stats()
    assert sum(stats["num_preemptions_by_mode"].values()) == 0, "pool too small: preemptions distort the peak"
    return peak, outputs, elapsed, manager.counters.num_window_freed_blocks


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--min-prompt", type=int, default=256)
    parser.add_argument("--max-prompt", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=256)
    args = parser.parse_args(argv)
    rng = random.Random(0)
    prompts = [[rng.randrange(5, 1024) for _ in range(rng.randint(args.min_prompt, args.max_prompt))]
               for _ in range(args.requests)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    max_len = args.max_prompt + args.max_tokens
    num_blocks = args.requests * -(-max_len // args.block_size) + 8
    with tempfile.TemporaryDirectory() as tmp:
        path = str(make_matrix_model("mistral", Path(tmp) / "mistral", sliding_window=args.window,
                                     max_position_embeddings=max(2048, max_len)))
        freed = run(path, prompts, params, args.block_size, num_blocks, True)
        kept = run(path, prompts, params, args.block_size, num_blocks, False)
    assert freed[1] == kept[1], "freeing out-of-window blocks changed the outputs"
    tokens = sum(map(len, prompts)) + args.requests * args.max_tokens
    print(f"{args.requests} requests, prompts {args.min_prompt}-{args.max_prompt} + {args.max_tokens} output "
          f"tokens ({tokens} in all), window {args.window}, block size {args.block_size}, prefix caching off")
    print(f"peak device blocks in use: {freed[0]} freeing out-of-window blocks, {kept[0]} keeping them: "
          f"ratio {freed[0] / kept[0]:.3f} ({kept[0] / freed[0]:.1f}x less KV memory); "
          f"{freed[3]} blocks freed early; outputs identical")
    print(f"wall time (2 shared CPU cores, not a speed claim): {freed[2]:.1f} s vs {kept[2]:.1f} s")


if __name__ == "__main__":
    main()
