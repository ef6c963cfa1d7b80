"""Bytes a worker streams to the handle per output token, by position in the sequence.

Before the delta protocol a worker yielded the engine's cumulative
``RequestOutput`` (prompt ids, every token so far, text, logprobs) at every
step; now its engine core sends each channel one packed ``StreamBatch`` a step
(``workers/outputs/stream_batch.py``), here holding one request's row. Both are
measured from one greedy sequence run twice on the same engine (the cumulative
output as Ray serialises it, pickle protocol 5; the batch as packed), at output
tokens 1, 10, 100, 1000 and 4000, with and without logprobs.

The tiny model's context is 512 positions; a copy of its checkpoint with
``max_position_embeddings`` raised to 8192 (RoPE, random weights: nothing
learned depends on it) lets one sequence reach 4,000 output tokens.

    python benchmarks/bench_stream_bytes.py [--max-tokens 4000] [--out artifacts/stream_bytes.json]
"""

from __future__ import annotations

import argparse
import json
import pickle
import shutil
from pathlib import Path

from pagedserve import LLM, SamplingParams
from pagedserve.devtools.model_factory import long_context_copy
from pagedserve.workers.outputs.stream_batch import StreamTarget

POSITIONS = (1, 10, 100, 1000, 4000)


def measure(llm: LLM, max_tokens: int, logprobs: int | None) -> dict[int, dict[str, int]]:
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)
    prompt = list(range(3, 131))
    sizes: dict[int, dict[str, int]] = {}
    engine.add_request(f"bytes-{logprobs}", None, params, prompt_token_ids=prompt)
    while engine.has_unfinished_requests():
        for output in engine.step():
            num_tokens = len(output.outputs[0].token_ids)
            if num_tokens in POSITIONS:
                sizes[num_tokens] = {"cumulative_bytes": len(pickle.dumps(output, protocol=5))}
    engine.add_request(f"rows-{logprobs}", None, params, prompt_token_ids=prompt,
                       stream_target=StreamTarget("bytes", 0))
    num_tokens = 0
    while engine.has_unfinished_requests():
        engine.step()
        for batch in engine.output_processor.take_batches().values():
            num_tokens += len(batch.token_ids)
            if num_tokens in sizes:
                sizes[num_tokens].update(delta_bytes=len(batch.pack()), tokens_in_step=len(batch.token_ids))
    return sizes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=4000)
    parser.add_argument("--out", default="artifacts/stream_bytes.json")
    args = parser.parse_args()
    model = long_context_copy(8192)
    try:
        llm = LLM(model=str(model), device="cpu", dtype="float32", block_size=16, num_device_blocks=512,
                  swap_space_gb=0.001, max_model_len=args.max_tokens + 256)
        result = {f"logprobs={lp}": measure(llm, args.max_tokens, lp) for lp in (None, 5)}
    finally:
        shutil.rmtree(model, ignore_errors=True)
    print(f"{'':>14} {'token':>6} {'cumulative B':>13} {'delta B':>8} {'ratio':>7}")
    for label, sizes in result.items():
        for position, row in sorted(sizes.items()):
            ratio = row["cumulative_bytes"] / row["delta_bytes"]
            print(f"{label:>14} {position:>6} {row['cumulative_bytes']:>13} {row['delta_bytes']:>8} {ratio:>6.1f}x")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
