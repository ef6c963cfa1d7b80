"""Incremental detokenizing per output token, as a worker's output thread pays it.

Sequences with random token-id prompts and outputs (as the engine benchmarks draw
them) go through ``StreamingDetokenizer``, one token of every sequence at a time.
A prompt whose last tokens end inside a UTF-8 character cannot start a
``tokenizers`` ``DecodeStream``; such a sequence takes the Python route (two
decodes per token) until text is emitted, then hands over to a stream. The run
times both forms side by side, alternating, with the collector off (as in a
serving process), and checks that their texts are equal.

``--at-end``: the text of an output decoded only at its end (``LLM.generate``'s final
outputs without stop strings), as the output processor catches it up: every token but
the last in one ``extend`` (a byte-level tokenizer's stream steps once), against the
tokens appended one at a time; side by side, alternating, texts compared.

    python benchmarks/bench_detokenizer.py [--sequences 256 --tokens 256 --rounds 3] [--at-end]
"""

from __future__ import annotations

import argparse
import gc
import random
import time

from transformers import AutoTokenizer

from pagedserve import SamplingParams
from pagedserve.devtools.model_factory import ensure_model
from pagedserve.workers.outputs.detokenizer import StreamingDetokenizer


def run(tokenizer, prompts: list[list[int]], outputs: list[list[int]],
        hand_over: bool) -> tuple[float, int, int, list[str]]:
    """Seconds per token, sequences on the Python route at the start and at the end, texts."""
    params = SamplingParams(max_tokens=1 << 30)
    streams = [StreamingDetokenizer(tokenizer, prompt, params, eos_token_id=None) for prompt in prompts]
    detokenizers = [stream._detokenizer for stream in streams]
    if not hand_over:
        for detokenizer in detokenizers:
            detokenizer._may_start_stream = False
    at_start = sum(d._stream is None for d in detokenizers)
    num_tokens = len(outputs[0])
    start = time.perf_counter()
    for i in range(num_tokens):
        for stream, ids in zip(streams, outputs):
            stream.append(ids[i], None)
    seconds = (time.perf_counter() - start) / (len(streams) * num_tokens)
    at_end = sum(d._stream is None for d in detokenizers)
    return seconds, at_start, at_end, [stream.output_text for stream in streams]


def run_at_end(tokenizer, prompts: list[list[int]], outputs: list[list[int]],
               extend: bool) -> tuple[float, list[str]]:
    """Seconds per token to decode each whole output at its end, and the texts."""
    params = SamplingParams(max_tokens=1 << 30)
    streams = [StreamingDetokenizer(tokenizer, prompt, params, eos_token_id=None) for prompt in prompts]
    start = time.perf_counter()
    for stream, ids in zip(streams, outputs):
        if extend:
            stream.extend(ids[:-1])
        else:
            for token_id in ids[:-1]:
                stream.append(token_id, None)
        stream.append(ids[-1], "length")
    seconds = (time.perf_counter() - start) / (len(streams) * len(outputs[0]))
    return seconds, [stream.output_text for stream in streams]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama", help="a tiny family's checkpoint (make-model)")
    parser.add_argument("--sequences", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=256, help="output tokens per sequence")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--at-end", action="store_true",
                        help="outputs decoded at their end: one extend against token by token")
    args = parser.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(str(ensure_model(args.model)))
    rng = random.Random(args.seed)
    vocab = len(tokenizer)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(16, 64))] for _ in range(args.sequences)]
    outputs = [[rng.randrange(vocab) for _ in range(args.tokens)] for _ in range(args.sequences)]
    gc.disable()
    print(f"{args.sequences} sequences x {args.tokens} tokens, {args.model}'s tokenizer")
    if args.at_end:
        print("| round | extend | token by token | ratio |")
        print("| --- | --- | --- | --- |")
        for round_ in range(1, args.rounds + 1):
            single, single_texts = run_at_end(tokenizer, prompts, outputs, extend=False)
            bulk, bulk_texts = run_at_end(tokenizer, prompts, outputs, extend=True)
            assert bulk_texts == single_texts, "extend changed the text"
            print(f"| {round_} | {bulk * 1e6:.2f} us a token | {single * 1e6:.2f} us a token | {single / bulk:.1f}x |")
        return
    print("| round | Python route until text, then a stream | Python route for life | ratio |")
    print("| --- | --- | --- | --- |")
    for round_ in range(1, args.rounds + 1):
        kept, slow_start, slow_end, kept_texts = run(tokenizer, prompts, outputs, hand_over=False)
        handed, _, handed_end, handed_texts = run(tokenizer, prompts, outputs, hand_over=True)
        assert handed_texts == kept_texts, "the hand-over changed the text"
        print(f"| {round_} | {handed * 1e6:.2f} us a token ({handed_end} on the Python route at the end) "
              f"| {kept * 1e6:.2f} us a token ({slow_start} of {args.sequences} from the start, "
              f"{slow_end} at the end) | {kept / handed:.2f}x |")


if __name__ == "__main__":
    main()
