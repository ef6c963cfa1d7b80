"""The roofline and serial floor of a ``bench_engine_gpu.py`` workload, without a GPU.

The engine's scheduling does not depend on the model's width: which prompt chunks and
decode rows each step holds follows from the prompt lengths, the step budget
(``--max-num-batched-tokens``), ``--max-num-seqs`` and the output length. So the
workload's scheduling is replayed here on the CPU with a tiny Llama whose context is
raised to the real model's (random weights, greedy, EOS ignored, a KV pool large
enough for every request, as on a large GPU), each forward recorded by shape
(``pagedserve.bench.roofline``), and the steps costed at ``--size``'s parameter
counts and the given matmul and copy rates.

Printed: the roofline and the serial floor, in the decode steps and in the steps with
a prompt chunk; the run's FLOPs and the FLOP utilisation a run would reach at its
roofline and at its serial floor (the most a prefill-heavy target can ask); the decode
steps' sequences. Set against a GPU run's own times (``bench_engine_gpu.py`` prints
them per step kind), this says how far each kind of step is from its floor, and what
each would have to reach for a target.

    python benchmarks/bench_roofline_replay.py [--num-requests 256 --min-prompt 128 --max-prompt 1024
        --output-len 256 --max-num-batched-tokens 4096] [--matmul-tflops 794 --copy-gbps 4265] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
from pathlib import Path

from pagedserve import LLM, SamplingParams
from pagedserve.bench.roofline import record_steps, roofline_seconds
from pagedserve.bench.workload import random_token_ids
from pagedserve.devtools.model_factory import SHAPES, ModelShape, long_context_copy

# Bytes per element of the costed model's weights and K/V (bench_engine_gpu.py's bfloat16).
ELEMENT_BYTES = 2


def model_counts(shape: ModelShape) -> dict:
    """``roofline_seconds``' counts for a dense Llama of ``shape`` (q/k/v/o, gate/up/down)."""
    hidden, heads, kv_heads, head_dim = (shape.hidden_size, shape.num_attention_heads,
                                         shape.num_key_value_heads, shape.head_dim)
    per_layer = hidden * head_dim * (2 * heads + 2 * kv_heads) + 3 * hidden * shape.intermediate_size
    num_linear = shape.num_hidden_layers * per_layer
    num_lm_head = shape.vocab_size * hidden
    return {"num_linear": num_linear, "num_lm_head": num_lm_head, "num_layers": shape.num_hidden_layers,
            "attention_width": heads * head_dim,
            "kv_bytes_per_token": 2 * shape.num_hidden_layers * kv_heads * head_dim * ELEMENT_BYTES,
            "weight_bytes": (num_linear + num_lm_head) * ELEMENT_BYTES}


def prompt_lengths(args, shape: ModelShape) -> list[int]:
    """The lengths of ``bench_engine_gpu.py``'s timed prompts: the same draws, in the real
    model's vocabulary (the token draws between two lengths depend on it), clipped to its
    context as it clips them."""
    max_prompt = min(args.max_prompt, shape.max_position_embeddings - args.output_len - 1)
    min_prompt = min(args.min_prompt, max_prompt)
    rng = random.Random(args.seed)
    lengths = []
    for _ in range(args.num_requests):
        length = rng.randint(min_prompt, max_prompt)
        random_token_ids(rng, length, shape.vocab_size)
        lengths.append(length)
    return lengths


def replay(args) -> dict:
    shape = SHAPES[args.size]
    lengths = prompt_lengths(args, shape)
    path = long_context_copy(shape.max_position_embeddings)
    try:
        block_size = 16
        num_blocks = sum(-(-(length + args.output_len) // block_size) for length in lengths) + 64
        llm = LLM(str(path), max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                  num_device_blocks=num_blocks, block_size=block_size, seed=args.seed)
        rng = random.Random(args.seed)
        vocab = llm.engine.runner.vocab_size
        prompts = [random_token_ids(rng, length, vocab) for length in lengths]
        shapes = record_steps(llm.engine.runner)
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True),
                     use_tqdm=False)
        llm.engine.check_integrity()
        if llm.engine.num_used_blocks():
            raise RuntimeError(f"{llm.engine.num_used_blocks()} KV blocks still in use after the replay")
        del llm
    finally:
        shutil.rmtree(path, ignore_errors=True)
    counts = model_counts(shape)
    matmul, copy = args.matmul_tflops * 1e12, args.copy_gbps * 1e9
    floors = roofline_seconds(shapes, **counts, matmul_flops_per_s=matmul, copy_bytes_per_s=copy)
    flops = sum(2 * counts["num_linear"] * tokens + 2 * counts["num_lm_head"] * sampled
                + 4 * counts["attention_width"] * counts["num_layers"] * pairs
                for tokens, sampled, pairs in zip(shapes.num_tokens, shapes.num_sampled, shapes.num_attended_pairs))
    decode_seqs = [seqs for seqs, is_decode in zip(shapes.num_seqs, shapes.is_decode) if is_decode]
    mixed_tokens = [tokens for tokens, is_decode in zip(shapes.num_tokens, shapes.is_decode) if not is_decode]
    flop_seconds = flops / matmul
    return {**floors, "size": args.size, "matmul_tflops": args.matmul_tflops, "copy_gbps": args.copy_gbps,
            "num_prompt_tokens": sum(lengths), "tflop": flops / 1e12, "flop_seconds": flop_seconds,
            "flop_utilisation_at_roofline": flop_seconds / floors["seconds"],
            "flop_utilisation_at_serial_floor": flop_seconds / floors["serial_seconds"],
            "num_mixed_steps": len(mixed_tokens),
            "mixed_mean_tokens": statistics.mean(mixed_tokens) if mixed_tokens else 0.0,
            "decode_seqs_median": statistics.median(decode_seqs) if decode_seqs else 0,
            "decode_steps_under_half": sum(1 for seqs in decode_seqs if seqs < args.max_num_seqs / 2)}


def format_replay(r: dict) -> str:
    return (f"{r['size']} at {r['matmul_tflops']:g} TFLOP/s and {r['copy_gbps']:g} GB/s: {r['num_steps']} steps, "
            f"{r['num_prompt_tokens']:,} prompt tokens, {r['tflop']:.1f} TFLOP ({r['flop_seconds']:.3f} s at the "
            f"matmul rate)\n"
            f"  roofline {r['seconds']:.3f} s (decode steps {r['decode_seconds']:.3f}, steps with a prompt chunk "
            f"{r['mixed_seconds']:.3f}); serial floor {r['serial_seconds']:.3f} s (decode "
            f"{r['serial_decode_seconds']:.3f}, with a prompt chunk {r['serial_mixed_seconds']:.3f})\n"
            f"  {r['num_decode_steps']} decode steps: {r['decode_mean_seqs']:.1f} sequences on average (median "
            f"{r['decode_seqs_median']}, {r['decode_steps_under_half']} under half of max_num_seqs), "
            f"{r['decode_mean_kv_read']:,.0f} K/V positions read a step; {r['num_mixed_steps']} steps with a "
            f"prompt chunk, {r['mixed_mean_tokens']:,.0f} tokens on average\n"
            f"  FLOP utilisation of a run at its roofline {r['flop_utilisation_at_roofline']:.1%}, at its serial "
            f"floor {r['flop_utilisation_at_serial_floor']:.1%}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="1b", choices=sorted(SHAPES), help="the costed model's shape (Llama)")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--min-prompt", type=int, default=128)
    parser.add_argument("--max-prompt", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=4096)
    parser.add_argument("--matmul-tflops", type=float, default=794.0, help="default: the H200's, measured")
    parser.add_argument("--copy-gbps", type=float, default=4265.0, help="default: the H200's, measured")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    result = replay(args)
    print(format_replay(result), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
