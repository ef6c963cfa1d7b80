"""Tool-call parsing (streamed and whole) and tool_choice constraints on the engine."""

from __future__ import annotations

import itertools
import json

import jsonschema
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve import LLM, SamplingParams
from pagedserve.tool_parsers import (
    HermesToolParser,
    Llama3JsonToolParser,
    NamedToolParser,
    RequiredToolParser,
    constrained_parser,
    get_tool_parser,
    tool_choice_constraint,
)
from pagedserve.workers.outputs.detokenizer import IncrementalDetokenizer
from pagedserve.workers.sample.sampling_params import StructuredOutputsParams

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                         "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                         "b": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["a", "b"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "now"}},
]
SCHEMAS = {t["function"]["name"]: t["function"].get("parameters", {"type": "object"}) for t in TOOLS}


def ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def stream(parser, pieces):
    """Feed pieces; return (content, {index: (id, name, arguments)}) rebuilt from the deltas."""
    content, calls = "", {}
    for delta in [parser.feed(piece) for piece in pieces] + [parser.finish()]:
        content += delta.content
        for call in delta.tool_calls:
            if call.index not in calls:
                assert call.id and call.name, "a call's first delta carries its id and name"
                calls[call.index] = [call.id, call.name, ""]
            else:
                assert call.id is None and call.name is None
            calls[call.index][2] += call.arguments
    return content, {i: tuple(v) for i, v in calls.items()}


HERMES_TEXT = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
               '"unit": "c"}}\n</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}'
               '\n</tool_call>')


def test_hermes_parses_content_and_calls():
    parsed = HermesToolParser(ids()).parse(HERMES_TEXT)
    assert parsed.content == "Let me check."  # the whitespace before a call is dropped
    assert [(c.id, c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        ("call_0", "get_weather", {"city": "Paris", "unit": "c"}), ("call_1", "add", {"a": 1, "b": 2})]
    assert HermesToolParser().parse("no calls, a < b and <tool").tool_calls == []
    assert HermesToolParser().parse("no calls, a < b and <tool").content == "no calls, a < b and <tool"
    # A block that is not a call stays content, tags included.
    bad = "x <tool_call>{not json}</tool_call> y"
    assert HermesToolParser().parse(bad).content == bad
    # A call cut off by the end of the output is not a call.
    cut = HERMES_TEXT[:HERMES_TEXT.rindex('"b"')]
    parsed = HermesToolParser().parse(cut)
    assert [c.name for c in parsed.tool_calls] == ["get_weather"]
    # Arguments written as a JSON string are decoded.
    quoted = '<tool_call>{"name": "add", "arguments": "{\\"a\\": 3, \\"b\\": 4}"}</tool_call>'
    assert json.loads(HermesToolParser().parse(quoted).tool_calls[0].arguments) == {"a": 3, "b": 4}


@settings(max_examples=200, deadline=None)
@given(cuts=st.lists(st.integers(0, len(HERMES_TEXT)), max_size=12))
def test_hermes_streaming_equals_whole_parse(cuts):
    bounds = sorted(set(cuts) | {0, len(HERMES_TEXT)})
    pieces = [HERMES_TEXT[a:b] for a, b in zip(bounds, bounds[1:])]
    content, calls = stream(HermesToolParser(ids()), pieces)
    whole = HermesToolParser(ids()).parse(HERMES_TEXT)
    assert content == whole.content
    assert calls == {i: (c.id, c.name, c.arguments) for i, c in enumerate(whole.tool_calls)}


def test_hermes_streams_arguments_before_the_call_closes():
    parser = HermesToolParser(ids())
    assert parser.feed("Hi <tool_").content == "Hi"  # the possible tag start is held back
    delta = parser.feed('call>{"name": "add", "arguments": {"a": 1')
    assert delta.content == "" and delta.tool_calls[0].name == "add"
    assert delta.tool_calls[0].arguments == '{"a": 1'[:len(delta.tool_calls[0].arguments)]
    delta = parser.feed(', "b": 2}}</tool_call>')
    assert "".join(c.arguments for c in delta.tool_calls).endswith('"b": 2}')


LLAMA_TEXT = '<|python_tag|>{"name": "add", "parameters": {"a": 5, "b": 6}}; {"name": "now", "parameters": {}}'


def test_llama3_json():
    parsed = Llama3JsonToolParser(ids()).parse(LLAMA_TEXT)
    assert parsed.content is None
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [("add", {"a": 5, "b": 6}),
                                                                           ("now", {})]
    plain = "The answer is {not a call}."
    assert Llama3JsonToolParser().parse(plain).content == plain
    assert Llama3JsonToolParser().parse(plain).tool_calls == []
    broken = '{"name": "add", "parameters": {"a": 1'
    assert Llama3JsonToolParser().parse(broken).content == broken
    for size in (1, 3, 7):
        pieces = [LLAMA_TEXT[i:i + size] for i in range(0, len(LLAMA_TEXT), size)]
        content, calls = stream(Llama3JsonToolParser(ids()), pieces)
        assert content == "" and [c[1] for c in calls.values()] == ["add", "now"]
        assert json.loads(calls[0][2]) == {"a": 5, "b": 6}


def test_registry():
    assert get_tool_parser("hermes") is HermesToolParser
    assert get_tool_parser("llama3_json") is Llama3JsonToolParser
    with pytest.raises(ValueError, match="unknown tool-call parser 'nope'; known: hermes, llama3_json"):
        get_tool_parser("nope")


def test_tool_choice_constraints():
    assert tool_choice_constraint(TOOLS, "auto") is None and tool_choice_constraint(TOOLS, "none") is None
    named = tool_choice_constraint(TOOLS, {"type": "function", "function": {"name": "add"}})
    assert named.json == SCHEMAS["add"]
    assert tool_choice_constraint(TOOLS, {"type": "function", "function": {"name": "now"}}).json == {
        "type": "object"}
    with pytest.raises(ValueError, match="tool_choice: function 'missing' is not among"):
        tool_choice_constraint(TOOLS, {"type": "function", "function": {"name": "missing"}})
    with pytest.raises(ValueError, match="tool_choice"):
        tool_choice_constraint([], "required")
    required = tool_choice_constraint(TOOLS, "required", parallel_tool_calls=False)
    assert required.json["maxItems"] == 1
    validator = jsonschema.Draft202012Validator(required.json)
    validator.validate([{"name": "add", "parameters": {"a": 1, "b": 2}}])
    with pytest.raises(jsonschema.ValidationError):
        validator.validate([{"name": "add", "parameters": {"city": "x"}}])
    with pytest.raises(jsonschema.ValidationError):
        validator.validate([])


# ---- constrained generation on the engine ---------------------------------------------------

@pytest.fixture(scope="module")
def llm(tiny_model):
    torch.set_num_threads(1)
    llm = LLM(tiny_model("llama"), device="cpu", dtype="float32", num_device_blocks=256, swap_space_gb=0.001)
    yield llm
    llm.check_integrity()
    assert llm.engine.num_used_blocks() == 0


def prompt_for(llm, messages):
    # The tiny model's context (512) cannot hold the tools' JSON in its small-vocabulary
    # tokens; the prompt does not matter to the constraint, so the template renders none.
    return llm.get_tokenizer().apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "add"}},
                                         {"type": "function", "function": {"name": "get_weather"}}])
@pytest.mark.parametrize("parallel", [True, False])
def test_constrained_tool_calls_validate(llm, tool_choice, parallel):
    spec = tool_choice_constraint(TOOLS, tool_choice, parallel_tool_calls=parallel)
    prompt = prompt_for(llm, [{"role": "user", "content": "Weather in Paris? And 2 + 3?"}])
    params = [SamplingParams(temperature=0.9, seed=seed, max_tokens=256, structured_outputs=spec)
              for seed in range(6)]
    outputs = llm.generate([prompt] * len(params), params)
    num_calls = 0
    for output in outputs:
        completion = output.outputs[0]
        if completion.finish_reason == "length":
            continue
        assert completion.finish_reason == "stop"
        text = completion.text
        whole = constrained_parser(tool_choice).parse(text)
        assert whole.content is None and whole.tool_calls, text
        if not parallel:
            assert len(whole.tool_calls) == 1
        for call in whole.tool_calls:
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
            if isinstance(tool_choice, dict):
                assert call.name == tool_choice["function"]["name"]
        num_calls += len(whole.tool_calls)
        # Streamed token by token, the deltas rebuild the same calls.
        detokenizer = IncrementalDetokenizer(llm.get_tokenizer(), output.prompt_token_ids)
        pieces = [detokenizer.append(t) for t in completion.token_ids] + [detokenizer.flush()]
        _, calls = stream(constrained_parser(tool_choice), pieces)
        assert [(name, args) for _, name, args in calls.values()] == [(c.name, c.arguments)
                                                                       for c in whole.tool_calls]
    assert num_calls >= 3


def test_auto_tool_calls_from_model_output_parse(llm):
    """With tool_choice "auto" the output is free; a grammar forcing the template's
    <tool_call> format stands in for a trained model, and the hermes parser reads it."""
    grammar = ('start: "<tool_call>\\n" %json' + json.dumps({
        "type": "object", "properties": {"name": {"const": "add"}, "arguments": SCHEMAS["add"]},
        "required": ["name", "arguments"], "additionalProperties": False}) + ' "\\n</tool_call>"')
    spec = StructuredOutputsParams(grammar=grammar)
    prompt = prompt_for(llm, [{"role": "user", "content": "2 + 3?"}])
    outputs = llm.generate([prompt] * 4, [SamplingParams(temperature=1.0, seed=s, max_tokens=120,
                                                         structured_outputs=spec) for s in range(4)])
    num_ok = 0
    for output in outputs:
        if output.outputs[0].finish_reason != "stop":
            continue
        parsed = get_tool_parser("hermes")().parse(output.outputs[0].text)
        assert parsed.content is None and len(parsed.tool_calls) == 1
        assert parsed.tool_calls[0].name == "add"
        jsonschema.validate(json.loads(parsed.tool_calls[0].arguments), SCHEMAS["add"])
        num_ok += 1
    assert num_ok >= 2
    # Plain generation with tools offered: random weights make no call, all of it is content.
    [plain] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20))
    parsed = HermesToolParser().parse(plain.outputs[0].text)
    assert parsed.tool_calls == [] and parsed.content == plain.outputs[0].text


def test_named_and_required_parsers_on_cut_output():
    assert NamedToolParser("add").parse('{"a": 1').tool_calls == []
    parsed = RequiredToolParser().parse('[{"name": "add", "parameters": {"a": 1, "b": 2}}, {"name": "no')
    assert [c.name for c in parsed.tool_calls] == ["add"]


REQUIRED_TEXT = '[{"name": "add", "parameters": {"a": 1, "b": 2}}, {"name": "get_weather", "parameters": {"city": "Oslo"}}]'
NAMED_TEXT = '{"city": "Paris", "unit": "c"}'
CUT_OFF_PARSERS = [(HermesToolParser, HERMES_TEXT), (RequiredToolParser, REQUIRED_TEXT),
                   (lambda new_id: NamedToolParser("get_weather", new_id), NAMED_TEXT),
                   (Llama3JsonToolParser, LLAMA_TEXT)]


@settings(max_examples=60, deadline=None)
@given(case=st.sampled_from(CUT_OFF_PARSERS), cut=st.floats(0, 1), size=st.integers(1, 9))
def test_cut_off_output_streams_what_parse_returns(case, cut, size):
    """An output cut off anywhere (max_tokens): streamed piece by piece, the deltas rebuild
    exactly what ``parse(..., is_cut_off=True)`` returns, as vLLM returns truncated calls."""
    make, text = case
    text = text[:int(len(text) * cut)]
    whole = make(ids()).parse(text, is_cut_off=True)
    content, calls = stream(make(ids()), [text[i:i + size] for i in range(0, len(text), size)])
    assert content == (whole.content or "")
    assert calls == {i: (c.id, c.name, c.arguments) for i, c in enumerate(whole.tool_calls)}


def test_cut_off_calls_keep_their_partial_arguments_and_no_wrapper_is_content():
    named = NamedToolParser("add").parse('{"a": 1', is_cut_off=True)
    assert named.content is None and [(c.name, c.arguments) for c in named.tool_calls] == [("add", '{"a": 1')]
    # Cut before the first call's name is complete: "required"'s wrapper is no content.
    for text in ("", "[", '[{"name": "final_result', '[{"name": "add'):
        wrapper = RequiredToolParser().parse(text, is_cut_off=True)
        assert wrapper.content is None and wrapper.tool_calls == [], text
    # Once the name is complete the call has started (streaming sent its id and name).
    started = RequiredToolParser().parse('[{"name": "add", "param', is_cut_off=True)
    assert [(c.name, c.arguments) for c in started.tool_calls] == [("add", "")]
    required = RequiredToolParser().parse('[{"name": "add", "parameters": {"a": 1, "b": 2}}, '
                                          '{"name": "get_weather", "parameters": {"ci', is_cut_off=True)
    assert required.content is None
    assert [(c.name, c.arguments) for c in required.tool_calls] == [("add", '{"a": 1, "b": 2}'),
                                                                    ("get_weather", '{"ci')]
    hermes = HermesToolParser().parse('Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1',
                                      is_cut_off=True)
    assert hermes.content == "Let me add."
    assert [(c.name, c.arguments) for c in hermes.tool_calls] == [("add", '{"a": 1')]
    # Not cut off (the model ended a malformed call itself): still content, whole.
    assert NamedToolParser("add").parse('{"a": 1').tool_calls == []
