"""Side-by-side comparison of the two maintained grammar engines: xgrammar and llguidance.

For one tokenizer (a ``make-model`` checkpoint's), it measures per engine:
  - tokenizer set-up time;
  - compile time of a set of JSON schemas, a regex, a Lark/EBNF grammar and
    free JSON (cold, then cached where the engine caches);
  - the per-step cost of filling the token bitmask for a batch of matchers;
  - JSON-schema coverage: which keywords compile, and whether random walks
    through the allowed tokens produce text that validates with ``jsonschema``.

Run: ``python benchmarks/compare_grammar_engines.py [--model DIR] [--walks N]``.
Only the engines that are installed are measured. The figures are CPU times
on this machine; compare the two engines' columns within one run.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import jsonschema

SCHEMAS: dict[str, dict] = {
    "flat": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
             "required": ["name", "age"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"id": {"type": "integer"},
                                                  "tags": {"type": "array", "items": {"type": "string"}}},
                 "required": ["id"]},
        "ok": {"type": "boolean"}}, "required": ["user", "ok"]},
    "enum_const": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                                    "v": {"const": 3}},
                   "required": ["color", "v"]},
    "anyof": {"anyOf": [{"type": "integer"}, {"type": "object", "properties": {"x": {"type": "number"}},
                                                "required": ["x"]}]},
    "oneof": {"oneOf": [{"type": "string", "maxLength": 3}, {"type": "null"}]},
    "allof": {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                        {"type": "object", "properties": {"b": {"type": "string"}}, "required": ["b"]}]},
    "refs": {"$defs": {"node": {"type": "object", "properties": {"v": {"type": "integer"},
                                                                  "next": {"anyOf": [{"$ref": "#/$defs/node"},
                                                                                     {"type": "null"}]}},
                                "required": ["v", "next"]}},
             "$ref": "#/$defs/node"},
    "string_bounds": {"type": "object", "properties": {"s": {"type": "string", "minLength": 2, "maxLength": 5}},
                      "required": ["s"]},
    "pattern": {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["zip"]},
    "number_bounds": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 3, "maximum": 42}},
                      "required": ["n"]},
    "array_bounds": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3},
    "prefix_items": {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}],
                     "items": False},
    "format_date": {"type": "object", "properties": {"d": {"type": "string", "format": "date"}},
                    "required": ["d"]},
    "additional": {"type": "object", "additionalProperties": {"type": "integer"}},
    "optional_fields": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"},
                                                         "c": {"type": "boolean"}}, "required": ["b"]},
    "unique_items": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True, "maxItems": 3},
    "exclusive_min": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "multiple_of": {"type": "integer", "multipleOf": 5},
    "pattern_properties": {"type": "object", "patternProperties": {"^x_": {"type": "integer"}},
                           "additionalProperties": False},
}
REGEX = r"(\d{3})-(\d{4}) [A-Z][a-z]+"
LARK = r"""
start: expr
expr: term (("+" | "-") term)*
term: NUMBER | "(" expr ")"
NUMBER: /[0-9]+/
"""
EBNF = r"""
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= [0-9]+ | "(" expr ")"
"""


class XGrammarEngine:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        start = time.perf_counter()
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self.setup_s = time.perf_counter() - start
        self.vocab_size = vocab_size

    def compile_schema(self, schema: dict):
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)

    def compile_json(self):
        return self.compiler.compile_builtin_json_grammar()

    def compile_regex(self, regex: str):
        return self.compiler.compile_regex(regex)

    def compile_grammar(self, text: str, kind: str):
        return self.compiler.compile_lark(text) if kind == "lark" else self.compiler.compile_grammar(text)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def alloc(self, batch: int):
        return self.xgr.allocate_token_bitmask(batch, self.vocab_size)

    def fill(self, matchers, bitmask) -> None:
        for i, matcher in enumerate(matchers):
            matcher.fill_next_token_bitmask(bitmask, i)

    def accept(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)

    def is_done(self, matcher) -> bool:
        return matcher.is_terminated()


class LLGuidanceEngine:
    name = "llguidance"

    def __init__(self, tokenizer, vocab_size: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg = llguidance
        self.lt = llguidance.torch
        start = time.perf_counter()
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        self.executor = llguidance.LLExecutor(num_threads=1)
        self.setup_s = time.perf_counter() - start
        self.vocab_size = vocab_size

    def _check(self, grammar: str):
        # Matcher construction compiles (lazily: the lexer is built as masks are asked for).
        matcher = self.llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return grammar

    def compile_schema(self, schema: dict):
        return self._check(self.llg.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False}))

    def compile_json(self):
        return self._check(self.llg.LLMatcher.grammar_from_json_schema({"type": "object"}))

    def compile_regex(self, regex: str):
        return self._check(self.llg.LLMatcher.grammar_from_regex(regex))

    def compile_grammar(self, text: str, kind: str):
        if kind == "ebnf":
            from llguidance.gbnf_to_lark import any_to_lark

            text = any_to_lark(text)
        return self._check(self.llg.LLMatcher.grammar_from_lark(text))

    def matcher(self, compiled):
        return self.llg.LLMatcher(self.tokenizer, compiled, log_level=0)

    def alloc(self, batch: int):
        return self.lt.allocate_token_bitmask(batch, self.vocab_size)

    def fill(self, matchers, bitmask) -> None:
        for i, matcher in enumerate(matchers):
            self.lt.fill_next_token_bitmask(matcher, bitmask, i)

    def accept(self, matcher, token: int) -> bool:
        return matcher.consume_token(token)

    def is_done(self, matcher) -> bool:
        return matcher.is_stopped()


def allowed_tokens(bitmask_row, vocab_size: int) -> list[int]:
    words = bitmask_row.tolist()
    return [t for t in range(vocab_size) if (words[t >> 5] >> (t & 31)) & 1]


def random_walk(engine, compiled, tokenizer, eos: set[int], rng: random.Random, max_tokens: int):
    """Sample uniformly among allowed tokens (EOS preferred once allowed, to finish)."""
    matcher = engine.matcher(compiled)
    bitmask = engine.alloc(1)
    tokens: list[int] = []
    for _ in range(max_tokens):
        engine.fill([matcher], bitmask)
        allowed = allowed_tokens(bitmask[0], engine.vocab_size)
        if not allowed:
            return None, "empty mask"
        ends = [t for t in allowed if t in eos]
        token = ends[0] if ends and rng.random() < 0.5 else rng.choice(allowed)
        if not engine.accept(matcher, token):
            return None, f"token {token} rejected after the mask allowed it"
        if token in eos:
            return tokenizer.decode(tokens), None
        tokens.append(token)
        if engine.is_done(matcher):
            return tokenizer.decode(tokens), None
    return None, "length"


def timed(fn, *args):
    start = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - start


def main() -> None:
    from transformers import AutoTokenizer

    from pagedserve.devtools.model_factory import ensure_model

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint (default: make-model llama small)")
    parser.add_argument("--walks", type=int, default=20, help="random walks per schema")
    parser.add_argument("--batch", type=int, default=32, help="matchers per mask-fill step")
    args = parser.parse_args()
    model = args.model or str(ensure_model("llama", "small"))
    tokenizer = AutoTokenizer.from_pretrained(model)
    vocab_size = len(tokenizer)
    eos = {tokenizer.eos_token_id}
    engines = []
    for cls in (XGrammarEngine, LLGuidanceEngine):
        try:
            engines.append(cls(tokenizer, vocab_size))
        except ImportError as exc:
            print(f"{cls.name}: not installed ({exc})")
    report: dict[str, dict] = {}
    for engine in engines:
        rng = random.Random(0)
        row: dict = {"setup_ms": 1e3 * engine.setup_s, "schemas": {}}
        compiled = {}
        for name, schema in SCHEMAS.items():
            try:
                compiled[name], seconds = timed(engine.compile_schema, schema)
                row["schemas"][name] = {"compile_ms": 1e3 * seconds}
            except Exception as exc:  # noqa: BLE001 - a comparison records every failure
                row["schemas"][name] = {"error": str(exc)[:120]}
        for label, fn, arg in (("regex", engine.compile_regex, REGEX),
                               ("lark", engine.compile_grammar, (LARK, "lark")),
                               ("ebnf", engine.compile_grammar, (EBNF, "ebnf")),
                               ("json_object", engine.compile_json, None)):
            try:
                call_args = arg if isinstance(arg, tuple) else (() if arg is None else (arg,))
                _, seconds = timed(fn, *call_args)
                row[f"{label}_compile_ms"] = 1e3 * seconds
            except Exception as exc:  # noqa: BLE001
                row[f"{label}_compile_ms"] = f"error: {str(exc)[:100]}"
        # Validity of random walks.
        num_valid = num_invalid = num_length = 0
        failures = []
        for name, grammar in compiled.items():
            for _ in range(args.walks):
                text, why = random_walk(engine, grammar, tokenizer, eos, rng, 256)
                if text is None:
                    if why == "length":
                        num_length += 1
                    else:
                        failures.append((name, why))
                    continue
                try:
                    jsonschema.validate(json.loads(text), SCHEMAS[name])
                    num_valid += 1
                except Exception as exc:  # noqa: BLE001
                    num_invalid += 1
                    failures.append((name, f"{text[:60]!r}: {str(exc)[:80]}"))
        by_schema: dict[str, int] = {}
        for name, _ in failures:
            by_schema[name] = by_schema.get(name, 0) + 1
        row["walks"] = {"valid": num_valid, "invalid": num_invalid, "length": num_length,
                        "failures_by_schema": by_schema,
                        "examples": sorted({name: why for name, why in failures}.items())}
        # Per-step mask cost for a batch: matchers advanced a few tokens into a nested schema.
        grammar = compiled.get("nested")
        matchers = [engine.matcher(grammar) for _ in range(args.batch)]
        bitmask = engine.alloc(args.batch)
        step_times = []
        for step in range(40):
            start = time.perf_counter()
            engine.fill(matchers, bitmask)
            step_times.append(time.perf_counter() - start)
            for i, matcher in enumerate(matchers):
                allowed = allowed_tokens(bitmask[i], vocab_size)
                choices = [t for t in allowed if t not in eos] or allowed
                engine.accept(matcher, rng.choice(choices))
                if engine.is_done(matcher):
                    matchers[i] = engine.matcher(grammar)
        step_times.sort()
        row["mask_fill_ms_per_row_p50"] = 1e3 * step_times[len(step_times) // 2] / args.batch
        row["mask_fill_ms_per_row_p90"] = 1e3 * step_times[int(len(step_times) * 0.9)] / args.batch
        report[engine.name] = row
    print(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    main()
