"""JSON whitespace under grammars: does a random-weight model finish inside a compact answer's budget?

A grammar that lets any run of whitespace stand between JSON tokens lets a model
spend its whole budget on whitespace. Every schema here bounds every field
(string lengths, integer ranges, enums, array sizes; all keys required, no
extra keys), so a compact answer has a known worst case: ``compact_bound``
bytes, and a token is at least one byte. That bound is each request's
``max_tokens``. A random-weight model (no preference for ending early) samples
at temperature 1 under each whitespace rule:

- ``default``: the server's default (``grammar.JSON_WHITESPACE_PATTERN``);
- ``compact``: vLLM's ``disable_any_whitespace`` (no whitespace at all);
- ``wide``: the earlier default, a line break and up to 24 spaces or tabs per gap;
- ``unbounded``: the grammar engine's own flexible whitespace (any run).

Reported per rule: the share of requests that finished (``stop``) inside the
budget, output tokens (mean, max), whitespace tokens' share, and how many
finished outputs validated.

Run: ``python benchmarks/bench_json_whitespace.py [--model DIR] [--samples 24] [--out FILE]``
"""

from __future__ import annotations

import argparse
import json
import statistics
from contextlib import contextmanager

import jsonschema
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.devtools.model_factory import ensure_model
from pagedserve.workers.sample import grammar
from pagedserve.workers.sample.sampling_params import StructuredOutputsParams

SCHEMAS = {
    "person": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"], "additionalProperties": False},
    "weather": {"type": "object", "properties": {
        "city": {"enum": ["Oslo", "Paris", "Lima"]}, "temp": {"type": "integer", "minimum": -50, "maximum": 50},
        "rain": {"type": "boolean"}}, "required": ["city", "temp", "rain"], "additionalProperties": False},
    "tags": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
        "required": ["id", "tags"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 6}, "admin": {"type": "boolean"}},
            "required": ["name", "admin"], "additionalProperties": False},
        "score": {"type": "integer", "minimum": 0, "maximum": 100}},
        "required": ["user", "score"], "additionalProperties": False},
    "pairs": {"type": "object", "properties": {
        "items": {"type": "array", "maxItems": 2, "items": {"type": "object", "properties": {
            "k": {"enum": ["x", "y"]}, "v": {"type": "integer", "minimum": 0, "maximum": 9}},
            "required": ["k", "v"], "additionalProperties": False}}},
        "required": ["items"], "additionalProperties": False},
}

RULES = ("default", "compact", "wide", "unbounded")
WIDE_PATTERN = r"(?:\r?\n)?[\x20\x09]{0,24}"
# A JSON string's character as its longest compact escape (\uXXXX).
MAX_CHAR_BYTES = 6


def compact_bound(schema: dict) -> int:
    """The most bytes a compact (whitespace-free) JSON answer to ``schema`` can take; for the
    bounded subset used here (objects with required keys, enums, bounded strings, integers, arrays)."""
    if "enum" in schema:
        return max(len(json.dumps(value)) for value in schema["enum"])
    kind = schema["type"]
    if kind == "object":
        keys = schema["properties"]
        return 2 + len(keys) - 1 + sum(len(json.dumps(k)) + 1 + compact_bound(v) for k, v in keys.items())
    if kind == "array":
        count = schema["maxItems"]
        return 2 + max(count - 1, 0) + count * compact_bound(schema["items"])
    if kind == "string":
        return 2 + MAX_CHAR_BYTES * schema["maxLength"]
    if kind == "integer":
        return max(len(str(schema["minimum"])), len(str(schema["maximum"])))
    if kind == "boolean":
        return len("false")
    raise ValueError(f"unbounded or unsupported schema: {schema}")


@contextmanager
def whitespace_rule(rule: str):
    """Make the grammar module build JSON grammars under ``rule`` (a fresh LLM per rule, since
    compiled grammars are cached per engine by their spec)."""
    saved_source = grammar.grammar_source
    saved_pattern = grammar.JSON_WHITESPACE_PATTERN

    def unbounded_source(spec):
        if spec.kind not in ("json", "json_object") or spec.disable_any_whitespace:
            return saved_source(spec)
        schema = spec.json if spec.kind == "json" else {"type": "object"}
        return grammar._llguidance().LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": True}, overrides={"lenient": False})

    if rule == "wide":
        grammar.JSON_WHITESPACE_PATTERN = WIDE_PATTERN
    elif rule == "unbounded":
        grammar.grammar_source = unbounded_source
    try:
        yield
    finally:
        grammar.grammar_source = saved_source
        grammar.JSON_WHITESPACE_PATTERN = saved_pattern


def run_rule(model: str, rule: str, num_samples: int) -> dict:
    with whitespace_rule(rule):
        llm = LLM(model, num_device_blocks=512, swap_space_gb=0.001, seed=0)
        tokenizer = llm.get_tokenizer()
        prompts, params, names = [], [], []
        for name, schema in SCHEMAS.items():
            spec = StructuredOutputsParams(json=schema, disable_any_whitespace=rule == "compact")
            for seed in range(num_samples):
                prompts.append(f"Answer in JSON ({name}):")
                params.append(SamplingParams(temperature=1.0, seed=seed, max_tokens=compact_bound(schema),
                                             structured_outputs=spec))
                names.append(name)
        outputs = llm.generate(prompts, params, use_tqdm=False)
    per_schema: dict[str, dict] = {}
    num_tokens, num_whitespace = [], 0
    for name, output in zip(names, outputs):
        completion = output.outputs[0]
        entry = per_schema.setdefault(name, {"budget": compact_bound(SCHEMAS[name]), "finished": 0, "valid": 0,
                                             "tokens": []})
        entry["tokens"].append(len(completion.token_ids))
        num_tokens.append(len(completion.token_ids))
        num_whitespace += sum(1 for t in completion.token_ids if not tokenizer.decode([t]).strip())
        if completion.finish_reason == "stop":
            entry["finished"] += 1
            try:
                jsonschema.validate(json.loads(completion.text), SCHEMAS[name])
                entry["valid"] += 1
            except (ValueError, jsonschema.ValidationError):
                pass
    total = len(outputs)
    return {
        "rule": rule,
        "finished_in_budget": sum(e["finished"] for e in per_schema.values()) / total,
        "valid": sum(e["valid"] for e in per_schema.values()),
        "requests": total,
        "mean_tokens": statistics.mean(num_tokens),
        "max_tokens_used": max(num_tokens),
        "whitespace_share": num_whitespace / max(sum(num_tokens), 1),
        "per_schema": {name: {"budget": e["budget"], "finished": e["finished"], "valid": e["valid"],
                              "max_tokens_used": max(e["tokens"])} for name, e in per_schema.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="checkpoint (default: the random-weight tiny llama)")
    parser.add_argument("--samples", type=int, default=24, help="seeds per schema and rule")
    parser.add_argument("--rules", nargs="+", choices=RULES, default=list(RULES))
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = args.model or str(ensure_model("llama", "tiny"))
    results = [run_rule(model, rule, args.samples) for rule in args.rules]
    print(f"{'rule':<10} {'finished in budget':>18} {'valid':>9} {'mean tok':>9} {'max tok':>8} {'whitespace':>10}")
    for r in results:
        print(f"{r['rule']:<10} {r['finished_in_budget']:>18.1%} {r['valid']:>4}/{r['requests']:<4} "
              f"{r['mean_tokens']:>9.1f} {r['max_tokens_used']:>8} {r['whitespace_share']:>10.1%}")
    print("budgets (compact bound, bytes = max tokens):",
          ", ".join(f"{name} {compact_bound(schema)}" for name, schema in SCHEMAS.items()))
    if args.out:
        with open(args.out, "w") as file:
            json.dump(results, file, indent=2)


if __name__ == "__main__":
    main()
