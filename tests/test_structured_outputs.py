"""Structured outputs enforced during decoding, on a tiny random-weight checkpoint.

With random weights only the grammar makes an output valid, so every output
that finishes with "stop" must parse and validate (``jsonschema``, ``re``, the
choices, a parser for the test grammar); "length" is the only other way out.
Constrained rows share steps with unconstrained ones, which must be unaffected.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedserve import LLM, SamplingParams
from pagedserve.workers.sample.grammar import GrammarCompiler, check_structured_outputs
from pagedserve.workers.engine.kv_transfer import export_kv
from pagedserve.workers.sample.sampler import apply_token_bitmask, processed_probs, seeded_uniform
from pagedserve.workers.sample.sampling_params import MAX_STRUCTURED_OUTPUT_BYTES, StructuredOutputsParams

from near_ties import DRAW_NOISE, common_prefix, draw_distance

S = StructuredOutputsParams
MAX_TOKENS = 160

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0},
                                                  "tags": {"type": "array", "items": {"type": "string"},
                                                           "maxItems": 3}},
                 "required": ["id", "tags"], "additionalProperties": False},
        "active": {"type": "boolean"}}, "required": ["user", "active"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "v": {"const": 3}},
     "required": ["color", "v"], "additionalProperties": False},
    {"anyOf": [{"type": "integer"},
               {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"],
                "additionalProperties": False}]},
    {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 8},
                                      "c": {"type": "boolean"}}, "required": ["b"], "additionalProperties": False},
    {"$defs": {"leaf": {"type": "object", "properties": {"v": {"type": "integer"}}, "required": ["v"],
                        "additionalProperties": False}},
     "type": "object", "properties": {"left": {"$ref": "#/$defs/leaf"}, "right": {"$ref": "#/$defs/leaf"}},
     "required": ["left", "right"], "additionalProperties": False},
    {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                                      "d": {"type": "string", "format": "date"}},
     "required": ["zip", "d"], "additionalProperties": False},
    {"type": "object", "properties": {"s": {"type": "string", "minLength": 2, "maxLength": 4},
                                      "n": {"type": ["number", "null"]}},
     "required": ["s", "n"], "additionalProperties": False},
    {"type": "array", "prefixItems": [{"type": "string", "maxLength": 5}, {"type": "boolean"}], "items": False,
     "minItems": 2},
]


def check_json(text: str, schema: dict) -> None:
    validator = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker())
    validator.validate(json.loads(text))


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "overlap"])
def llm(request, tiny_model):
    """Without and with overlapped scheduling (a constrained row reads the running step's
    samples first: its grammar must have taken them)."""
    torch.set_num_threads(1)
    return LLM(tiny_model("llama"), device="cpu", dtype="float32", block_size=8,
               num_device_blocks=512, swap_space_gb=0.001, async_scheduling=request.param)


@pytest.fixture(autouse=True)
def idle_after(llm):
    yield
    llm.check_integrity()
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.num_used_blocks() == 0


def params_for(spec: StructuredOutputsParams, seed: int, temperature: float = 1.0, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=temperature, seed=seed, max_tokens=kwargs.pop("max_tokens", MAX_TOKENS),
                          structured_outputs=spec, **kwargs)


def test_every_schema_output_validates_under_batching(llm):
    """Ten schemas x three seeds (greedy, t=0.7, t=1 with top-p) batched with
    unconstrained requests: structured outputs validate, the others are unchanged."""
    plain_prompts = ["The river starts", "A good loaf of bread", "Numbers and dates:"]
    plain = [SamplingParams(temperature=0.0, max_tokens=24),
             SamplingParams(temperature=0.9, seed=5, max_tokens=24, repetition_penalty=1.2),
             SamplingParams(temperature=1.0, seed=6, max_tokens=24, top_k=20)]
    alone = [o.outputs[0].token_ids for o in llm.generate(plain_prompts, plain)]
    prompts, params = list(plain_prompts), list(plain)
    for i, schema in enumerate(SCHEMAS):
        for seed, (temperature, extra) in enumerate([(0.0, {}), (0.7, {"top_k": 50}),
                                                      (1.0, {"top_p": 0.95, "presence_penalty": 0.5})]):
            prompts.append(f"Return JSON #{i}:")
            params.append(params_for(S(json=schema), seed, temperature, **extra))
    outputs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outputs[:3]] == alone
    num_stop = 0
    for output, param in zip(outputs[3:], params[3:]):
        completion = output.outputs[0]
        if completion.finish_reason == "stop":
            num_stop += 1
            check_json(completion.text, param.structured_outputs.json)
        else:
            assert completion.finish_reason == "length" and len(completion.token_ids) == MAX_TOKENS
    assert num_stop >= 0.6 * len(outputs[3:]), num_stop  # random weights: long strings run out


def test_json_object_and_compact_whitespace(llm):
    outputs = llm.generate(["{"] * 8, [params_for(S(json_object=True, disable_any_whitespace=i % 2 == 0), i)
                                       for i in range(8)])
    num_stop = 0
    for i, output in enumerate(outputs):
        completion = output.outputs[0]
        if completion.finish_reason == "length":
            continue
        num_stop += 1
        assert completion.finish_reason == "stop"
        assert isinstance(json.loads(completion.text), dict)
        outside_strings = re.sub(r'"(?:[^"\\]|\\.)*"', "", completion.text)
        if i % 2 == 0:  # compact: no whitespace outside string literals
            assert not re.search(r"\s", outside_strings), completion.text
        else:  # the default: at most one space or line break between tokens
            assert not re.search(r"\s\s|\t", outside_strings), completion.text
    assert num_stop >= 3


def test_bounded_schemas_finish_inside_a_compact_answers_budget(tiny_model):
    """The whitespace benchmark's measurement, short: a random-weight model under bounded schemas,
    each request's max_tokens the most bytes a compact answer can take, always finishes valid
    under the default whitespace rule and under disable_any_whitespace."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_json_whitespace.py"
    spec = importlib.util.spec_from_file_location("bench_json_whitespace", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    for rule in ("default", "compact"):
        result = bench.run_rule(tiny_model("llama"), rule, num_samples=6)
        assert result["finished_in_budget"] == 1.0 and result["valid"] == result["requests"], result


def test_regex_choice_and_grammar(llm):
    regexes = [r"\(\d{3}\) \d{3}-\d{4}", r"[a-z]{3,8}@[a-z]{2,5}\.(com|org)", r"(yes|no)( because [a-z ]{1,20})?"]
    choices = ["red", "green", "blue sky", 'say "hi"', "日本"]
    lark = 'start: expr\nexpr: term (("+" | "-") term)*\nterm: NUMBER | "(" expr ")"\nNUMBER: /[0-9]{1,3}/'
    gbnf = 'root ::= expr\nexpr ::= term (("+" | "-") term)*\nterm ::= [0-9] [0-9]? | "(" expr ")"'
    specs = ([S(regex=r) for r in regexes] + [S(choice=choices)] * 4 + [S(grammar=lark), S(grammar=gbnf)])
    outputs = llm.generate(["Answer:"] * len(specs) * 2,
                           [params_for(spec, seed, max_tokens=48) for seed in range(2) for spec in specs])
    seen_choices = set()
    for output, spec in zip(outputs, specs * 2):
        completion = output.outputs[0]
        if completion.finish_reason == "length":
            assert spec.grammar is not None, completion  # only the recursive grammars may run long
            continue
        assert completion.finish_reason == "stop"
        text = completion.text
        if spec.regex is not None:
            assert re.fullmatch(spec.regex, text), (spec.regex, text)
        elif spec.choice is not None:
            assert text in choices
            seen_choices.add(text)
        else:
            assert is_expression(text), text
    assert len(seen_choices) >= 2


def is_expression(text: str) -> bool:
    """expr := term (("+"|"-") term)*; term := digits | "(" expr ")"."""
    position = 0

    def term() -> bool:
        nonlocal position
        if position < len(text) and text[position] == "(":
            position += 1
            if not expr() or position >= len(text) or text[position] != ")":
                return False
            position += 1
            return True
        start = position
        while position < len(text) and text[position].isdigit():
            position += 1
        return position > start

    def expr() -> bool:
        nonlocal position
        if not term():
            return False
        while position < len(text) and text[position] in "+-":
            position += 1
            if not term():
                return False
        return True

    return expr() and position == len(text)


# ---- hypothesis: random schemas ---------------------------------------------------------

_leaf = st.one_of(
    st.just({"type": "integer"}),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(1, 6)),
    st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
              st.integers(-50, 50), st.integers(0, 100)),
    st.lists(st.sampled_from(["a", "bb", "c d", "x-y", "1"]), min_size=1, max_size=4, unique=True)
    .map(lambda values: {"enum": values}),
)
_names = st.sampled_from(["id", "name", "tags", "meta", "value", "kind", "items"])


def _object(children):
    return st.dictionaries(_names, children, min_size=1, max_size=3).flatmap(
        lambda props: st.lists(st.sampled_from(sorted(props)), unique=True).map(
            lambda required: {"type": "object", "properties": props, "required": required,
                              "additionalProperties": False}))


json_schemas = st.recursive(
    _leaf,
    lambda children: st.one_of(
        _object(children),
        st.builds(lambda items, n: {"type": "array", "items": items, "maxItems": n}, children, st.integers(1, 3)),
        st.lists(children, min_size=2, max_size=3).map(lambda options: {"anyOf": options}),
    ),
    max_leaves=6,
)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(schemas=st.lists(json_schemas, min_size=1, max_size=4), seed=st.integers(0, 2**16))
def test_random_schemas_validate(llm, schemas, seed):
    prompts = ["Data:"] * len(schemas) + ["Unconstrained"]
    params = [params_for(S(json=schema), seed + i, temperature=0.9) for i, schema in enumerate(schemas)]
    params.append(SamplingParams(temperature=1.0, seed=seed, max_tokens=16))
    outputs = llm.generate(prompts, params)
    for output, schema in zip(outputs, schemas):
        completion = output.outputs[0]
        assert completion.finish_reason in ("stop", "length")
        if completion.finish_reason == "stop":
            check_json(completion.text, schema)


# ---- n > 1, preemption, resume and migration ----------------------------------------------

def test_forked_samples_each_follow_the_grammar(llm):
    [output] = llm.generate(["JSON:"], params_for(S(json=SCHEMAS[4]), seed=3, n=4))
    assert len(output.outputs) == 4
    assert len({tuple(c.token_ids) for c in output.outputs}) > 1
    assert any(completion.finish_reason == "stop" for completion in output.outputs)
    for completion in output.outputs:
        if completion.finish_reason == "stop":
            check_json(completion.text, SCHEMAS[4])
        else:
            assert completion.finish_reason == "length"


@pytest.fixture(scope="module")
def hf_model(tiny_model):
    """transformers on the tiny llama in float32: the oracle of a step's distribution."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model("llama"), dtype=torch.float32).eval()


def step_probs(hf_model, compiler: GrammarCompiler, prompt_token_ids: list[int], output_token_ids: list[int],
               params: SamplingParams) -> torch.Tensor:
    """The distribution the next token after ``output_token_ids`` is drawn from: transformers'
    float32 logits, masked by the grammar after those tokens, under ``params``' temperature."""
    ids = torch.tensor([prompt_token_ids + output_token_ids])
    with torch.inference_mode():
        logits = hf_model(ids).logits[0, -1:].float()
    matcher = compiler.compile(params.structured_outputs).matcher()
    assert matcher.accept_all(output_token_ids)
    bitmask = compiler.allocate_bitmask(1)
    compiler.fill_bitmask([matcher], bitmask)
    return processed_probs(apply_token_bitmask(logits, bitmask), [params])[0]


def assert_follows_grammar(compiler: GrammarCompiler, completion, params: SamplingParams) -> None:
    """Every token of ``completion`` is one its grammar allows after the ones before it, and a
    finished completion validates."""
    assert compiler.compile(params.structured_outputs).matcher().accept_all(completion.token_ids)
    if completion.finish_reason == "stop":
        check_json(completion.text, params.structured_outputs.json)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_structured_requests_resume_exactly(tiny_model, llm, hf_model, mode):
    """A pool too small for the batch preempts sequences mid-output; their outputs are
    token for token those of a roomy pool, and valid.

    Token for token up to float noise: recomputing and the batch's shape change the logits'
    last bits, so the two runs may part where a draw is that close to its CDF edge (a
    near-tie, ``near_ties.draw_distance``), and nowhere else; from there on each only follows
    its grammar. A resumed sequence that lost tokens or restarted its grammar parts far from
    any near-tie."""
    small = LLM(tiny_model("llama"), device="cpu", dtype="float32", block_size=8, num_device_blocks=40,
                swap_space_gb=0.01, preemption_mode=mode, enable_prefix_caching=False)
    prompts = [f"Record {i}: " + "word " * (8 * i) for i in range(8)]
    params = [params_for(S(json=SCHEMAS[i % 3]), seed=i, temperature=0.8) for i in range(8)]
    expected = llm.generate(prompts, params)
    got = small.generate(prompts, params)
    assert small.stats()["num_preemptions_by_mode"][mode] > 0
    compiler = llm.engine.grammar_compiler
    for want, have, param in zip(expected, got, params):
        want_ids, have_ids = want.outputs[0].token_ids, have.outputs[0].token_ids
        step = common_prefix(want_ids, have_ids)
        if step < min(len(want_ids), len(have_ids)):
            probs = step_probs(hf_model, compiler, want.prompt_token_ids, want_ids[:step], param)
            uniform = seeded_uniform(param.seed, 0, step)
            for token in (want_ids[step], have_ids[step]):
                distance = draw_distance(probs, uniform, token)
                assert distance <= DRAW_NOISE, (
                    f"{want.request_id}: the preempted run parted at step {step} ({have_ids[step]} "
                    f"for {want_ids[step]}), where token {token} is {distance:.2e} from the draw")
        else:
            assert have_ids == want_ids and have.outputs[0].finish_reason == want.outputs[0].finish_reason
        for output in (want, have):
            assert_follows_grammar(compiler, output.outputs[0], param)
    small.check_integrity()
    assert small.engine.num_used_blocks() == 0


def test_resumed_request_replays_its_output_through_the_grammar(llm):
    """A request resumed elsewhere with the tokens it already produced continues
    exactly as it would have, and stays valid."""
    params = params_for(S(json=SCHEMAS[0]), seed=11, temperature=1.0)
    [full] = llm.generate(["Person:"], params)
    tokens = full.outputs[0].token_ids
    assert full.outputs[0].finish_reason == "stop" and len(tokens) > 6
    engine = llm.engine
    engine.add_request("resumed", "Person:", params, output_token_ids=tokens[:5])
    final = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            final = output
    assert final.outputs[0].token_ids == tokens
    check_json(final.outputs[0].text, SCHEMAS[0])
    # Tokens the grammar does not allow are refused at add time.
    bad = llm.get_tokenizer().encode("xyz", add_special_tokens=False)
    with pytest.raises(ValueError, match="structured_outputs"):
        engine.add_request("bad-resume", "Person:", params, output_token_ids=bad)
    assert "bad-resume" not in engine.requests


def test_migrated_request_continues_valid_on_another_engine(tiny_model, llm):
    """KV and output tokens exported mid-generation continue on a second engine."""
    params = params_for(S(json=SCHEMAS[2]), seed=21, temperature=0.9)
    [full] = llm.generate(["Migrate me:"], params)
    tokens = full.outputs[0].token_ids
    assert full.outputs[0].finish_reason == "stop" and len(tokens) > 8
    engine = llm.engine
    engine.add_request("src", "Migrate me:", params)
    while True:
        engine.step()
        seq = engine.requests["src"].seqs[0]
        if len(seq.output_token_ids) >= 6:
            break
    transfer = export_kv(engine.runner.kv_cache, seq.block_table, seq.num_computed, seq.token_ids)
    done = list(seq.output_token_ids)
    engine.abort_request("src")
    engine.step()
    target = LLM(tiny_model("llama"), device="cpu", dtype="float32", block_size=8, num_device_blocks=128,
                 swap_space_gb=0.001)
    target.engine.add_request("dst", "Migrate me:", params, kv_transfer=transfer, output_token_ids=done)
    final = None
    while target.engine.has_unfinished_requests():
        for output in target.engine.step():
            final = output
    assert final.outputs[0].token_ids == tokens
    check_json(final.outputs[0].text, SCHEMAS[2])
    assert target.engine.num_used_blocks() == 0


# ---- bad input -------------------------------------------------------------------------

BAD_SPECS = [
    (S(json={"type": "object", "properties": {"a": {"type": "strin"}}}), "structured_outputs.json"),
    (S(json={"type": "array", "uniqueItems": True}), "structured_outputs.json.*uniqueItems"),
    (S(json={"type": "object", "properties": {"a": {"$ref": "#/nope"}}}), "structured_outputs.json"),
    (S(json={"type": "string", "format": "no-such-format"}), "structured_outputs.json"),
    (S(regex="(ab"), "structured_outputs.regex"),
    (S(grammar="start: undefined_rule"), "structured_outputs.grammar"),
    (S(grammar="root ::= ("), "structured_outputs.grammar"),
]


@pytest.mark.parametrize("spec, message", BAD_SPECS)
def test_bad_specs_are_refused_and_the_batch_goes_on(llm, spec, message):
    with pytest.raises(ValueError, match=message):
        check_structured_outputs(spec)
    engine = llm.engine
    good = params_for(S(json=SCHEMAS[2]), seed=1)
    engine.add_request("good", "Colour:", good)
    engine.add_request("plain", "Hello", SamplingParams(temperature=0, max_tokens=8))
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", "Colour:", params_for(spec, seed=1))
    assert "bad" not in engine.requests
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    assert set(finished) == {"good", "plain"}
    check_json(finished["good"].outputs[0].text, SCHEMAS[2])
    [alone] = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=8))
    assert finished["plain"].outputs[0].token_ids == alone.outputs[0].token_ids


def test_spec_shape_and_size_limit():
    with pytest.raises(ValueError, match="exactly one"):
        S(json={"type": "object"}, regex="a")
    with pytest.raises(ValueError, match="exactly one"):
        S()
    with pytest.raises(ValueError, match="structured_outputs.choice"):
        S(choice=[])
    with pytest.raises(ValueError, match="unknown structured_outputs option.*jsonn"):
        S.from_dict({"jsonn": {}})
    big = {"type": "object", "properties": {f"field_{i}": {"type": "string"} for i in range(3000)}}
    assert len(json.dumps(big)) > MAX_STRUCTURED_OUTPUT_BYTES
    with pytest.raises(ValueError, match=r"structured_outputs.json is \d+ bytes; the limit"):
        S(json=big)
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs={"regex": 5})
    params = SamplingParams(structured_outputs={"json": '{"type": "integer"}'})
    assert params.structured_outputs.json == {"type": "integer"}
    assert SamplingParams.from_dict(params.to_dict()) == params


def test_grammars_are_compiled_once_and_the_cache_is_bounded(llm):
    tokenizer = llm.get_tokenizer()
    compiler = GrammarCompiler(tokenizer, 1024, [2, 4], max_cached=2)
    specs = [S(regex=f"a{{{i}}}") for i in range(1, 4)]
    first = compiler.compile(specs[0])
    assert compiler.compile(S(regex="a{1}")) is first
    assert (compiler.num_compiled, compiler.num_cache_hits) == (1, 1)
    compiler.compile(specs[1])
    compiler.compile(specs[2])
    assert compiler.num_cached == 2 and compiler.num_compiled == 3
    assert compiler.compile(specs[0]) is not first  # evicted, compiled again
    # Equal schemas in a different key order share the compiled grammar.
    a = compiler.compile(S(json={"type": "object", "properties": {"x": {"type": "integer"}}}))
    b = compiler.compile(S(json={"properties": {"x": {"type": "integer"}}, "type": "object"}))
    assert a is b


def test_finished_grammar_ends_the_sequence_without_eos(llm):
    """A grammar that is complete ends the output at once ("stop"), whatever
    ``ignore_eos`` and ``max_tokens`` say."""
    [output] = llm.generate(["x"], params_for(S(choice=["ok"]), seed=0, ignore_eos=True, max_tokens=50))
    completion = output.outputs[0]
    assert completion.text == "ok" and completion.finish_reason == "stop"
    assert llm.get_tokenizer().decode(completion.token_ids) == "ok"


# ---- a reasoning model's free thinking, then the language ---------------------------------------
def test_reasoning_end_is_part_of_the_spec():
    spec = S(regex="[ab]+", reasoning_end="</think>")
    assert spec.to_dict() == {"regex": "[ab]+", "reasoning_end": "</think>"}
    assert S.from_dict(spec.to_dict()) == spec and spec.key != S(regex="[ab]+").key
    params = SamplingParams(structured_outputs=spec.to_dict())
    assert SamplingParams.from_dict(params.to_dict()) == params
    for bad in ("", 5):
        with pytest.raises(ValueError, match="structured_outputs.reasoning_end must be a non-empty string"):
            S(regex="a", reasoning_end=bad)


@pytest.mark.parametrize(("spec", "accepted", "refused"), [
    (S(json={"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}),
     ['hmm, {"a": "x"}?</think>\n\n{"a": 5}', '</think>{"a":1}', '<think>a</thi b</think>{"a":1}'],
     ['{"a": 5}', 'x</think>{"b": 1}', 'x</think>\n\n\n{"a": 1}', 'x</think>{"a": 1} and more']),
    (S(regex="[0-9]+"), ["think 12</think>42", "</think>\n7"], ["42", "a</think>x", "1</think>2</think>3"]),
    (S(choice=["yes", "no"]), ["yes?</think>\nno", "</think>yes"], ["yes", "</think>maybe"]),
    (S(grammar='root ::= "x" [0-9]'), ["</think>x7"], ["x7", "</think>x"]),
    (S(grammar='start: "x" NUM\nNUM: /[0-9]/'), ["a\nb</think>\n\nx1"], ["x1"]),
], ids=["json", "regex", "choice", "gbnf", "lark"])
def test_the_language_holds_after_the_first_reasoning_end(llm, spec, accepted, refused):
    """Free text up to the first ``</think>``, at most two line breaks, then the spec's language
    to its end (a text is accepted when the matcher takes all its tokens and could end there)."""
    import dataclasses

    compiler = llm.engine.grammar_compiler
    tokenizer = llm.get_tokenizer()
    reasoned = dataclasses.replace(spec, reasoning_end="</think>")
    check_structured_outputs(reasoned)

    def takes(text: str) -> bool:
        matcher = compiler.compile(reasoned).matcher()
        ids = tokenizer.encode(text, add_special_tokens=False)
        return matcher.accept_all(ids) and matcher.engine_matcher.is_accepting()

    assert [text for text in accepted if not takes(text)] == []
    assert [text for text in refused if takes(text)] == []


def test_greedy_reasoning_is_the_free_models_then_the_answer_is_constrained(llm):
    """The tokens before the reasoning's end are the ones the model picks unconstrained (greedy);
    from there the output is one of the choices, and the grammar's end ends the sequence."""
    free = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    [unconstrained] = llm.generate(["The story so far:"], free)
    head = unconstrained.outputs[0]
    assert not set(head.token_ids) & set(llm.engine.eos_token_ids)
    end = head.text.strip()
    assert end
    spec = S(choice=["yes", "no"], reasoning_end=end)
    constrained = SamplingParams(temperature=0, max_tokens=40, structured_outputs=spec)
    [output] = llm.generate(["The story so far:"], constrained)
    completion = output.outputs[0]
    assert completion.token_ids[:3] == head.token_ids
    assert completion.finish_reason == "stop", completion
    assert re.fullmatch(re.escape(head.text) + r"\n{0,2}(yes|no)", completion.text), completion.text


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_structured_outputs_on_cuda(tiny_model):
    cuda = LLM(tiny_model("llama"), device="cuda", dtype="float32", num_device_blocks=64, swap_space_gb=0.001)
    outputs = cuda.generate(["JSON:"] * 4, [params_for(S(json=SCHEMAS[1]), seed=i) for i in range(4)])
    for output in outputs:
        if output.outputs[0].finish_reason == "stop":
            check_json(output.outputs[0].text, SCHEMAS[1])
