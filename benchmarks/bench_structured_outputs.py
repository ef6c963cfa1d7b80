"""Structured-output throughput: a mix of JSON-schema and unconstrained requests, side by side
with the same requests unconstrained.

64 requests (half with a JSON schema from a set of six, half free) run through one engine
on the ``small`` model; the same 64 requests with their schemas removed run on the same
engine, alternating, ``--rounds`` times each. Reported: output tokens per second of each
(and their ratio; target >= 0.8), the grammar engine's share of step time (bitmask filling
and matcher updates, ``grammar_seconds / step_seconds``), and how many structured outputs
validated. Throughput is tokens/s because constrained outputs end when their grammar is
complete, so the two runs produce different token counts.

Run: ``python benchmarks/bench_structured_outputs.py [--model DIR] [--rounds 2] [--out FILE]``
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import jsonschema
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.devtools.model_factory import ensure_model
from pagedserve.workers.sample.sampling_params import StructuredOutputsParams

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer"}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "id": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                                            "maxItems": 4}}, "required": ["id", "tags"]},
        "active": {"type": "boolean"}}, "required": ["user", "active"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "size": {"type": "number"}},
     "required": ["color", "size"]},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 1000}, "minItems": 1, "maxItems": 12},
    {"anyOf": [{"type": "object", "properties": {"ok": {"const": True}, "value": {"type": "string", "maxLength": 24}},
                "required": ["ok", "value"]},
               {"type": "object", "properties": {"ok": {"const": False}, "error": {"type": "string", "maxLength": 24}},
                "required": ["ok", "error"]}]},
    {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "object", "properties": {
        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}, "qty": {"type": "integer", "minimum": 1}},
        "required": ["sku", "qty"]}, "maxItems": 5}}, "required": ["items"]},
]


def workload(num_requests: int, max_tokens: int, seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(seed)
    prompts, params = [], []
    for i in range(num_requests):
        prompts.append([1] + [rng.randrange(5, 2048) for _ in range(rng.randrange(32, 257))])
        spec = StructuredOutputsParams(json=SCHEMAS[i % len(SCHEMAS)]) if i % 2 == 0 else None
        params.append(SamplingParams(temperature=0.8, seed=i, max_tokens=max_tokens, structured_outputs=spec))
    return prompts, params


def run(llm: LLM, prompts, params) -> dict:
    engine = llm.engine
    step0, grammar0 = engine.step_seconds, engine.grammar_seconds
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    valid = length = invalid = 0
    for output, param in zip(outputs, params):
        if param.structured_outputs is None:
            continue
        completion = output.outputs[0]
        if completion.finish_reason == "length":
            length += 1
            continue
        try:
            jsonschema.validate(json.loads(completion.text), param.structured_outputs.json)
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            invalid += 1
    step_s = engine.step_seconds - step0
    grammar_s = engine.grammar_seconds - grammar0
    return {"wall_s": wall, "output_tokens": num_tokens, "tok_per_s": num_tokens / wall,
            "step_s": step_s, "grammar_s": grammar_s, "grammar_share": grammar_s / step_s if step_s else 0.0,
            "valid": valid, "length": length, "invalid": invalid}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint (default: make-model llama small)")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-threads", type=int, default=1)
    parser.add_argument("--out", default=None, help="write the JSON report here")
    args = parser.parse_args()
    torch.set_num_threads(args.num_threads)
    model = args.model or str(ensure_model("llama", "small"))
    llm = LLM(model, device="cpu", dtype="float32", enable_prefix_caching=False)
    prompts, mixed = workload(args.num_requests, args.max_tokens, seed=0)
    free = [SamplingParams(**{**p.to_dict(), "structured_outputs": None}) for p in mixed]
    llm.generate(prompts[:4], free[:4], use_tqdm=False)  # warm-up
    results = {"mixed": [], "unconstrained": []}
    for _ in range(args.rounds):
        results["mixed"].append(run(llm, prompts, mixed))
        results["unconstrained"].append(run(llm, prompts, free))
    median = {name: statistics.median(r["tok_per_s"] for r in runs) for name, runs in results.items()}
    report = {
        "model": model, "num_requests": args.num_requests, "max_tokens": args.max_tokens,
        "num_structured": sum(p.structured_outputs is not None for p in mixed),
        "runs": results,
        "tok_per_s_mixed": median["mixed"], "tok_per_s_unconstrained": median["unconstrained"],
        "throughput_ratio": median["mixed"] / median["unconstrained"],
        "grammar_share_of_step_time": statistics.median(r["grammar_share"] for r in results["mixed"]),
    }
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
