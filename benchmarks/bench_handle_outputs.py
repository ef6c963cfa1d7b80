"""The handle's CPU per streamed token, from a step's message to the chunk's JSON.

A Serve replica's handle reads each engine step as one packed ``StreamBatch`` (one row
per request), makes a delta per request (``deltas_from_batch``), rebuilds each request's
output in its ``OutputAccumulator`` (which decodes the text, as a served request's does)
and the frontend writes a chunk per output (``CompletionChunkJSON``). This times that
path in one process, ``--streams`` one-token rows a step for ``--steps`` steps, against
the work any reader of the same steps must do in the same run: unpack the step, decode
each row's text with the same decoder, and write the same chunk. The difference is what
the handle's objects (deltas, outputs, prefixes) cost a token. Decoding alone is
reported too. Each round runs the three in turn, each the best of ``--repeats``; the serving heap
prepared as a replica's is (``prepare_serving_heap``).

    python benchmarks/bench_handle_outputs.py [--streams 64] [--steps 200] [--rounds 3]
"""

from __future__ import annotations

import argparse
import time

from pagedserve.cluster.serving.chunks import CompletionChunkJSON
from pagedserve.devtools.model_factory import ensure_model
from pagedserve.workers.actor.protocol import deltas_from_batch
from pagedserve.workers.outputs.accumulator import OutputAccumulator
from pagedserve.workers.outputs.detokenizer import DeltaTextDecoder
from pagedserve.workers.outputs.stream_batch import StreamBatch
from pagedserve.workers.process.gc_heap import prepare_serving_heap
from pagedserve.workers.sample.sampling_params import SamplingParams

PROMPT = [1, 2, 3]


def _steps(num_streams: int, num_steps: int) -> list[bytes]:
    """Packed steps of one new token a request, the ids spread over the vocabulary's common part."""
    packed = []
    for step in range(num_steps):
        batch = StreamBatch()
        for key in range(num_streams):
            batch.add(key, 0, [300 + (step * 7 + key) % 500])
        packed.append(batch.pack())
    return packed


def _handles_path(tokenizer, params, steps: list[bytes], num_streams: int) -> float:
    """Seconds of CPU: steps -> deltas -> accumulated outputs -> chunks."""
    accumulators = {key: OutputAccumulator(f"r{key}", None, PROMPT,
                                           lambda: DeltaTextDecoder(tokenizer, PROMPT, params, [tokenizer.eos_token_id]))
                    for key in range(num_streams)}
    encoder = CompletionChunkJSON("cmpl-bench", 1, "bench")
    start = time.process_time()
    for packed in steps:
        for key, delta in deltas_from_batch(StreamBatch.unpack(packed)):
            completion = accumulators[key].add(delta).outputs[0]
            encoder.choice(0, completion.delta_text, completion.finish_reason, completion.stop_reason)
    return time.process_time() - start


def _direct_path(tokenizer, params, steps: list[bytes], num_streams: int, with_chunks: bool = True) -> float:
    """Seconds of CPU: steps -> each row's text -> chunks (``with_chunks``), no objects between."""
    decoders = {key: DeltaTextDecoder(tokenizer, PROMPT, params, [tokenizer.eos_token_id])
                for key in range(num_streams)}
    encoder = CompletionChunkJSON("cmpl-bench", 1, "bench")
    start = time.process_time()
    for packed in steps:
        batch = StreamBatch.unpack(packed)
        for key, token in zip(batch.keys, batch.token_ids):
            text = decoders[key].add([token], None)
            if with_chunks:
                encoder.choice(0, text, None, None)
    return time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(ensure_model("llama", "tiny")))
    params = SamplingParams(max_tokens=args.steps + 1, ignore_eos=True)
    steps = _steps(args.streams, args.steps)
    prepare_serving_heap("bench")
    num_tokens = args.streams * args.steps
    for round_ in range(args.rounds):
        handle = min(_handles_path(tokenizer, params, steps, args.streams) for _ in range(args.repeats))
        direct = min(_direct_path(tokenizer, params, steps, args.streams) for _ in range(args.repeats))
        decoding = min(_direct_path(tokenizer, params, steps, args.streams, with_chunks=False)
                       for _ in range(args.repeats))
        per_token = [seconds / num_tokens * 1e6 for seconds in (handle, direct, decoding)]
        print(f"round {round_ + 1}: {args.streams} streams x {args.steps} steps: the handle's path "
              f"{per_token[0]:.2f} us CPU per token, unpack + decode + chunk {per_token[1]:.2f}, decoding alone "
              f"{per_token[2]:.2f}: the objects cost {per_token[0] - per_token[1]:.2f} us per token "
              f"({handle / direct:.2f}x the direct path)")


if __name__ == "__main__":
    main()
