"""gpt-oss's harmony format: ``server.reasoning_parser: openai_gptoss`` with ``tool_call_parser: openai``.

The parsers alone: documented replies, and, drawn by hypothesis, replies of any messages (reasoning,
preambles, answers, calls to functions and built-in tools, written with either header order, cut
off or not) that parse, whole or streamed in any pieces, to what their messages say. Then chat
completions and the Responses API over a scripted handle whose replies are harmony (a random-weight
model never writes it): the reasoning, the answer, function calls, constrained outputs held in the
final channel, the refusals of what the format cannot honour, the configuration's check. The engine's
grammar for a constrained reply, over a tokenizer with harmony's special tokens. Then over the real
engine: the reply's special tokens reach the parser, and a constrained reply is harmony whose final
message is the constrained language.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

httpx = pytest.importorskip("httpx")

from local_frontend import (LocalHandle, ScriptedHandle, assert_error, assert_idle, call, chat,  # noqa: E402
                            make_frontend, streamed_chat)

from pagedserve.reasoning_parsers import HarmonyParser  # noqa: E402
from pagedserve.reasoning_parsers.base import ANSWER, FUNCTION_CALL, REASONING  # noqa: E402
from pagedserve.tool_parsers import HarmonyToolParser  # noqa: E402

PROMPT = "<|start|>user<|message|>hi<|end|><|start|>assistant"
ANALYSIS = "<|channel|>analysis<|message|>"
NEXT = "<|end|><|start|>assistant"
FINAL = NEXT + "<|channel|>final<|message|>"
WEATHER = NEXT + " to=functions.get_weather<|channel|>commentary json<|message|>"
CALL = "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
# A harmony template in gpt-oss's shape: each message's role, an assistant's reasoning (``thinking``, as
# gpt-oss's template reads it) on the analysis channel and its answer on the final one.
TEMPLATE = ("{% for m in messages %}<|start|>{{ m.role }}{% if m.role == 'assistant' %}{% if m.thinking %}"
            "<|channel|>analysis<|message|>{{ m.thinking }}<|end|><|start|>assistant{% endif %}<|channel|>final"
            "{% endif %}<|message|>{{ m.content }}<|end|>{% endfor %}"
            "{% if add_generation_prompt %}<|start|>assistant{% endif %}")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
MARKERS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")


# ---- the parsers -------------------------------------------------------------------------------
@pytest.mark.parametrize("prompt, reply, expected", [
    (PROMPT, ANALYSIS + "plan" + FINAL + "answer", ("plan", "answer")),
    (PROMPT, ANALYSIS + "a" + NEXT + ANALYSIS + "b" + FINAL + "x", ("a\nb", "x")),          # joined by a line
    (PROMPT, ANALYSIS + "cut off mid-way", ("cut off mid-way", None)),
    (PROMPT, ANALYSIS + "plan" + NEXT + "<|chan", ("plan", None)),                         # cut in a header
    (PROMPT, "<|channel|>commentary<|message|>preamble" + FINAL + "x", (None, "preamble\nx")),     # for the user
    (PROMPT, ANALYSIS + "a" + NEXT + "<|channel|>commentary<|message|>b" + NEXT + CALL + "{}",
     ("a", "b<|channel|>commentary to=functions.get_weather<|message|>{}<|call|>")),
    (PROMPT, "<|channel|>final<|message|>only the answer<|return|>", (None, "only the answer")),
    (PROMPT, "not harmony at all", (None, "not harmony at all")),
    (PROMPT, ANALYSIS + "p" + NEXT + "<|channel|>commentary to=functions.f <|constrain|>json<|message|>{}",
     ("p", "<|channel|>commentary to=functions.f<|message|>{}<|call|>")),
    (PROMPT, "<|channel|>analysis to=browser.search<|message|>{\"q\": 1}" + FINAL + "x", ('{"q": 1}', "x")),
    (PROMPT + "<|channel|>analysis<|message|>", "more" + FINAL + "x", ("more", "x")),    # the prompt opened it
    (PROMPT, "", (None, None)),
])
def test_whole_replies(prompt, reply, expected):
    assert HarmonyParser(prompt).parse(reply) == expected


def test_the_prompt_says_where_a_reply_starts():
    starts = HarmonyParser.starts_in_reasoning
    assert starts(PROMPT) and starts(None) and starts(PROMPT + ANALYSIS)
    assert not starts(PROMPT + "<|channel|>final<|message|>") and not starts(PROMPT + "<|message|>")
    assert starts(PROMPT + "<|channel|>commentary<|message|>")    # a preamble: content, then more messages
    assert starts(PROMPT + "<|channel|>final<|message|>done<|end|><|start|>assistant")


_bodies = st.lists(st.sampled_from(["plan", " ", "\n", "<", "|", "<|", "end", "é", "{\"a\": 1}", "to=x"]),
                   max_size=5).map("".join)
_messages = st.lists(st.tuples(st.sampled_from(["analysis", "commentary", "final", "call", "builtin"]),
                               st.booleans(), _bodies), max_size=5)


def _render(messages: list[tuple[str, bool, str]]) -> str:
    """Harmony text of ``messages`` (kind, whether the recipient comes before the channel, body)."""
    text = []
    for position, (kind, recipient_first, body) in enumerate(messages):
        start = "" if position == 0 else NEXT
        recipient = {"call": " to=functions.get_weather", "builtin": " to=browser.search"}.get(kind)
        channel = "commentary" if recipient else kind
        if recipient is None:
            header = f"<|channel|>{channel}"
        elif recipient_first:
            header = f"{recipient}<|channel|>{channel} json"
        else:
            header = f"<|channel|>{channel}{recipient} <|constrain|>json"
        text.append(f"{start}{header}<|message|>{body}")
    return "".join(text)


def _reading(messages: list[tuple[str, bool, str]]) -> tuple[str | None, str | None, list[tuple[str, str]]]:
    """What ``messages`` say, read off them as the module docstring states: reasoning, content, calls."""
    reasoning = [body for kind, _, body in messages if kind in ("analysis", "builtin") and body]
    answers = [body for kind, _, body in messages if kind in ("final", "commentary") and body]
    calls = [("get_weather", body) for kind, _, body in messages if kind == "call"]
    return "\n".join(reasoning) or None, "\n".join(answers) or None, calls


def _messages_of(messages: list[tuple[str, bool, str]]) -> list[tuple[str, str]]:
    """``messages`` as ``parse_messages`` gives them: each kind and text; a body-less message is left
    out, and a call is in the form the tool-call parser reads."""
    kinds = {"analysis": REASONING, "builtin": REASONING, "commentary": ANSWER, "final": ANSWER}
    return [(FUNCTION_CALL, f"<|channel|>commentary to=functions.get_weather<|message|>{body}<|call|>")
            if kind == "call" else (kinds[kind], body) for kind, _, body in messages if kind == "call" or body]


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(messages=_messages, data=st.data())
def test_any_reply_streamed_in_any_pieces_reads_as_its_messages_say(messages, data):
    reply = _render(messages)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(reply)), max_size=8)))
    pieces = [reply[a:b] for a, b in zip([0, *cuts], [*cuts, len(reply)])]
    parser, tools = HarmonyParser(PROMPT), HarmonyToolParser()
    reasoning, content, calls, streamed_parts = "", "", {}, []
    for delta in [parser.feed(piece) for piece in pieces] + [parser.finish()]:
        reasoning += delta.reasoning
        streamed_parts += delta.parts
        for tool_delta in [tools.feed(delta.content)]:
            content += tool_delta.content
            for piece in tool_delta.tool_calls:
                calls.setdefault(piece.index, ["", ""])
                calls[piece.index][0] += piece.name or ""
                calls[piece.index][1] += piece.arguments
    content += tools.finish().content
    # Message by message (what the Responses API makes an item of each), streamed and whole.
    streamed_messages: list[tuple[str, str]] = []
    for kind, starts, text in streamed_parts:
        if starts:
            streamed_messages.append((kind, text))
        else:
            assert streamed_messages[-1][0] == kind
            streamed_messages[-1] = (kind, streamed_messages[-1][1] + text)
    assert streamed_messages == HarmonyParser(PROMPT).parse_messages(reply) == _messages_of(messages)
    whole_reasoning, whole_content = HarmonyParser(PROMPT).parse(reply)
    parsed = HarmonyToolParser().parse(whole_content or "")
    expected_reasoning, expected_content, expected_calls = _reading(messages)
    assert (reasoning or None, whole_reasoning) == (expected_reasoning, expected_reasoning)
    if expected_calls and not (expected_content or "").strip():   # whitespace beside calls is no content
        expected_content, content = None, content.strip()
    assert content == (parsed.content or "") and (parsed.content or None) == expected_content
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == expected_calls
    assert [tuple(calls[i]) for i in sorted(calls)] == expected_calls
    for text in (reasoning, content):
        assert not any(marker in text for marker in MARKERS if marker not in "".join(b for *_, b in messages))


def test_the_tool_parser_reads_calls_between_content():
    parser = HarmonyToolParser(new_id=lambda: "call_1")
    parsed = parser.parse("see <|channel|>commentary to=functions.get_weather<|message|>{\"city\": \"P\"}<|call|>")
    assert parsed.content == "see " and [(c.id, c.name, c.arguments) for c in parsed.tool_calls] == [
        ("call_1", "get_weather", '{"city": "P"}')]
    cut = HarmonyToolParser().parse("<|channel|>commentary to=functions.f<|message|>{\"a\": ", is_cut_off=True)
    assert cut.content is None and [(c.name, c.arguments) for c in cut.tool_calls] == [("f", '{"a": ')]
    builtin = "x<|channel|>commentary to=browser.search<|message|>{}<|call|>"
    assert HarmonyToolParser().parse(builtin).content == builtin


# ---- chat completions and responses over a scripted handle -------------------------------------
@pytest.fixture(scope="module")
def harmony(tiny_model):
    from transformers import AutoTokenizer

    path = tiny_model("llama")
    handle = ScriptedHandle(path, AutoTokenizer.from_pretrained(path))
    return handle, make_frontend(handle, reasoning_parser="openai_gptoss", tool_call_parser="openai",
                                 chat_template=TEMPLATE)


@pytest.mark.parametrize("pieces", [
    [ANALYSIS, "I should", " greet.", FINAL, "Hello", "!"],
    ["<|channel|>analysis<|mess", "age|>I should greet.<|e", "nd|><|start|>assistant<|channel|>final<|message|>Hello!"],
])
def test_reasoning_and_answer_whole_and_streamed(harmony, pieces):
    handle, frontend = harmony
    handle.pieces, handle.finish_reason = pieces, "stop"
    message = chat(frontend).json()["choices"][0]["message"]
    assert message["reasoning"] == message["reasoning_content"] == "I should greet."
    assert message["content"] == "Hello!" and message["tool_calls"] == []
    assert handle.prompts[-1].endswith("<|start|>assistant")
    # The reply's text keeps its special tokens, whatever the request says.
    params = handle.params[-1]
    assert not params.skip_special_tokens and not params.spaces_between_special_tokens
    reasoning, content, _, choices = streamed_chat(chat(frontend, stream=True, skip_special_tokens=True))
    assert (reasoning, content) == ("I should greet.", "Hello!") and not handle.params[-1].skip_special_tokens
    assert choices[-1]["finish_reason"] == "stop"


def test_an_earlier_turns_reasoning_goes_back_as_thinking(harmony):
    handle, frontend = harmony
    handle.pieces = [FINAL[len(NEXT):], "ok"]
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello!", "reasoning": "greet"},
                {"role": "user", "content": "again"}]
    assert chat(frontend, messages=messages).json()["choices"][0]["message"]["content"] == "ok"
    assert ("<|start|>assistant<|channel|>analysis<|message|>greet<|end|><|start|>assistant<|channel|>final"
            "<|message|>Hello!<|end|>") in handle.prompts[-1]


def test_a_function_call_whole_and_streamed(harmony):
    handle, frontend = harmony
    handle.pieces, handle.finish_reason = [ANALYSIS, "weather?", WEATHER, '{"city"', ': "Paris"}'], "stop"
    choice = chat(frontend, tools=TOOLS).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert choice["message"]["reasoning"] == "weather?"
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in choice["message"]["tool_calls"]] == [
        ("get_weather", '{"city": "Paris"}')]
    reasoning, content, pieces, choices = streamed_chat(chat(frontend, stream=True, tools=TOOLS))
    assert (reasoning, content) == ("weather?", "") and choices[-1]["finish_reason"] == "tool_calls"
    assert pieces[0]["function"]["name"] == "get_weather" and pieces[0]["id"].startswith("call_")
    assert "".join(p["function"].get("arguments") or "" for p in pieces) == '{"city": "Paris"}'
    # Without tools, the call's block stays in the content: nothing the model wrote is lost.
    content = chat(frontend).json()["choices"][0]["message"]["content"]
    assert content == '<|channel|>commentary to=functions.get_weather<|message|>{"city": "Paris"}<|call|>'


@pytest.mark.parametrize("body, kind", [
    ({"response_format": {"type": "json_object"}}, "json_object"),
    ({"structured_outputs": {"regex": "[ab]+"}}, "regex"),
])
def test_a_constrained_reply_holds_in_the_final_channel(harmony, body, kind):
    """The reasoning messages stay free; the final channel's message is what the constraint asks
    (workers.sample.grammar's harmony wrapper), parsed as the constrained content."""
    handle, frontend = harmony
    handle.pieces = [ANALYSIS, "free thoughts", FINAL, "ab"]
    response = chat(frontend, **body)
    assert response.status_code == 200, response.text
    constraint = handle.params[-1].structured_outputs
    assert constraint.kind == kind and constraint.reasoning_end == "<|channel|>final<|message|>"
    message = response.json()["choices"][0]["message"]
    assert message["reasoning"] == "free thoughts" and message["content"] == "ab"


TWO_TOOLS = [*TOOLS, {"type": "function", "function": {"name": "now"}}]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_required_or_named_call_is_made_in_harmony(harmony, tool_choice):
    """``tool_choice`` "required" or named holds the reply to one call in harmony's own form after
    free reasoning messages (``reasoning_end`` the call's header start), read by the ``openai``
    parser, whole, streamed and as a response's item; not a JSON list on the final channel."""
    handle, frontend = harmony
    handle.pieces, handle.finish_reason = [ANALYSIS, "weather?", NEXT, CALL, '{"city":', '"Paris"}'], "stop"
    choice = chat(frontend, tools=TWO_TOOLS, tool_choice=tool_choice).json()["choices"][0]
    constraint = handle.params[-1].structured_outputs
    assert constraint.kind == "grammar" and constraint.reasoning_end == "<|channel|>commentary to=functions."
    assert ('"now ' in constraint.grammar) is (tool_choice == "required")
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["reasoning"] == "weather?"
    assert choice["message"]["content"] is None
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in choice["message"]["tool_calls"]] == [
        ("get_weather", '{"city":"Paris"}')]
    pieces = handle.pieces
    handle.pieces = [*pieces[:3], "<|channel|>commentary<|message|>Checking.", *pieces[2:]]  # a preamble: content
    message = chat(frontend, tools=TWO_TOOLS, tool_choice=tool_choice).json()["choices"][0]["message"]
    assert (message["reasoning"], message["content"], len(message["tool_calls"])) == ("weather?", "Checking.", 1)
    handle.pieces = pieces
    reasoning, content, pieces, choices = streamed_chat(chat(frontend, stream=True, tools=TWO_TOOLS,
                                                             tool_choice=tool_choice))
    assert (reasoning, content) == ("weather?", "") and choices[-1]["finish_reason"] == "tool_calls"
    assert "".join(p["function"].get("arguments") or "" for p in pieces) == '{"city":"Paris"}'
    tools = [{"type": "function", **tool["function"]} for tool in TWO_TOOLS]
    response = call(frontend, "POST", "/v1/responses", json={"input": "hi", "tools": tools, "tool_choice": (
        tool_choice if tool_choice == "required" else {"type": "function", "name": "get_weather"})}).json()
    assert [item["type"] for item in response["output"]] == ["reasoning", "function_call"]
    assert (response["output"][1]["name"], response["output"][1]["arguments"]) == ("get_weather", '{"city":"Paris"}')
    # Where the prompt opened the final message, the reply is in it: the calls are the JSON list.
    opened = make_frontend(handle, reasoning_parser="openai_gptoss", tool_call_parser="openai",
                           chat_template=TEMPLATE.replace("<|start|>assistant{% endif %}",
                                                          "<|start|>assistant<|channel|>final<|message|>{% endif %}"))
    handle.pieces = ['[{"name":"now","parameters":{}}]']
    choice = chat(opened, tools=TWO_TOOLS, tool_choice="required").json()["choices"][0]
    assert handle.params[-1].structured_outputs.kind == "json"
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["now"]


def test_a_constrained_reply_inside_a_message_the_prompt_opened_is_refused(harmony):
    handle, _ = harmony
    opened = make_frontend(handle, reasoning_parser="openai_gptoss", tool_call_parser="openai",
                           chat_template=TEMPLATE.replace("<|start|>assistant{% endif %}",
                                                          "<|start|>assistant" + ANALYSIS + "{% endif %}"))
    sent = len(handle.prompts)
    error = assert_error(chat(opened, response_format={"type": "json_object"}), 400, "response_format")
    assert "opened a message" in error["message"] and len(handle.prompts) == sent
    handle.pieces = ["thoughts", FINAL, "hi"]
    assert chat(opened).json()["choices"][0]["message"]["reasoning"] == "thoughts"


def test_the_workers_harmony_headers_are_spelled_with_the_parsers_markers():
    """The sampler's wrappers (``workers.sample.grammar``) cannot import the parsers' layer: its two
    headers are written out there, and must stay what the parsers read."""
    from pagedserve.reasoning_parsers.harmony import CHANNEL, MESSAGE
    from pagedserve.tool_parsers.harmony_calls import FUNCTIONS
    from pagedserve.workers.sample.grammar import HARMONY_CALL, HARMONY_FINAL

    assert HARMONY_FINAL == HarmonyParser.end_tag == CHANNEL + "final" + MESSAGE
    assert HARMONY_CALL == f"{CHANNEL}commentary to={FUNCTIONS}"


def test_the_grammar_holds_the_final_channel_and_leaves_the_reasoning_free(tiny_model):
    """The engine's grammar over a tokenizer with harmony's special tokens: a reply must open a
    header; reasoning messages (the analysis channel) take any text, but a preamble is refused (it
    is content); the final message takes only the language, and the grammar is complete once it is."""
    from transformers import AutoTokenizer

    from pagedserve.workers.sample.grammar import GrammarCompiler
    from pagedserve.workers.sample.sampling_params import StructuredOutputsParams

    tokenizer = AutoTokenizer.from_pretrained(tiny_model("llama"))
    tokenizer.add_special_tokens({"additional_special_tokens": list(MARKERS)})
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.convert_tokens_to_ids("<|return|>")])
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    grammar = compiler.compile(StructuredOutputsParams(json=schema, reasoning_end=HarmonyParser.end_tag))

    def ids(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    first = grammar.matcher()
    bitmask = compiler.allocate_bitmask(1)
    compiler.fill_bitmask([first], bitmask)
    allowed = [t for t in range(len(tokenizer)) if bitmask[0, t // 32] >> (t % 32) & 1]
    assert allowed == [tokenizer.convert_tokens_to_ids("<|channel|>")]
    reasoning = ANALYSIS + 'free {"a": "x"} <b>' + NEXT + ANALYSIS + "soon" + FINAL
    for answer, is_complete in [('{"a": 5}', True), ('{"a": 5', False)]:
        matcher = grammar.matcher()
        assert matcher.accept_all(ids(reasoning + answer)) and matcher.is_finished is is_complete
    # A preamble is content, which must be the language alone; so is a call.
    for wrong in ["<|channel|>final<|message|>hello", ANALYSIS + "x" + NEXT + "<|channel|>final<|message|>[",
                  "<|channel|>analysis to=functions.f<|message|>", "<|channel|>commentary<|message|>soon" + FINAL]:
        assert not grammar.matcher().accept_all(ids(wrong)), wrong


def test_tools_whose_call_grammar_is_over_the_size_limit_are_refused(harmony):
    """The harmony grammar of a call is larger than the JSON list's schema of the same tools: tools
    that fit the one and not the other are a 400 naming ``tools``, nothing sent."""
    from pagedserve.tool_parsers import tool_choice_constraint
    from pagedserve.workers.sample.sampling_params import MAX_STRUCTURED_OUTPUT_BYTES

    handle, frontend = harmony
    parameters = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(2000)}}
    tools = [{"type": "function", "function": {"name": "big", "parameters": parameters}}]
    assert len(tool_choice_constraint(tools, "required").key) < MAX_STRUCTURED_OUTPUT_BYTES
    sent = len(handle.prompts)
    error = assert_error(chat(frontend, tools=tools, tool_choice="required"), 400, "tools")
    assert "bytes; the limit is" in error["message"] and len(handle.prompts) == sent


def test_the_call_grammar_leaves_the_reasoning_free_and_holds_one_call(tiny_model):
    """The engine's grammar of a required call over a tokenizer with harmony's special tokens:
    reasoning messages take any text; then one call to one of the tools, its header as gpt-oss
    writes it and its arguments compact JSON of the function's schema, complete once they are."""
    from transformers import AutoTokenizer

    from pagedserve.tool_parsers.harmony_calls import harmony_call_constraint
    from pagedserve.workers.sample.grammar import GrammarCompiler

    tokenizer = AutoTokenizer.from_pretrained(tiny_model("llama"))
    tokenizer.add_special_tokens({"additional_special_tokens": list(MARKERS)})
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.convert_tokens_to_ids("<|return|>")])
    functions = {"get_weather": TOOLS[0]["function"], "now": {"name": "now"}}

    def ids(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    required = compiler.compile(harmony_call_constraint(functions, None))
    reasoning = ANALYSIS + "free <|x" + NEXT + "<|channel|>commentary<|message|>A preamble." + NEXT
    for reply, is_complete in [(reasoning + CALL + '{"city":"Paris"}', True), (CALL + '{"city":"Par', False),
                               ("<|channel|>commentary to=functions.now <|constrain|>json<|message|>{}", True)]:
        matcher = required.matcher()
        assert matcher.accept_all(ids(reply)) and matcher.is_finished is is_complete, reply
    named = compiler.compile(harmony_call_constraint(functions, "now"))
    for wrong, grammar in [(CALL + '{"city": "Paris"}', required), (CALL + '{"city":1}', required),
                           ("<|channel|>final<|message|>{}", required), (CALL, named),
                           ("<|channel|>commentary to=functions.other <|constrain|>json<|message|>", required)]:
        assert not grammar.matcher().accept_all(ids(wrong)), wrong


def test_a_gpt_oss_checkpoint_is_read_as_harmony_unless_the_configuration_says_otherwise(harmony, tmp_path):
    tokenizer = harmony[0].tokenizer
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt_oss", "vocab_size": len(tokenizer)}))
    handle = ScriptedHandle(str(tmp_path), tokenizer)
    parsers = {}
    for name, fields in [("default", {}), ("hermes", {"tool_call_parser": "hermes"}),
                         ("qwen3", {"reasoning_parser": "qwen3"})]:
        config = make_frontend(handle, chat_template=TEMPLATE, **fields).config
        parsers[name] = config.reasoning_parser, config.tool_call_parser
    assert parsers == {"default": ("openai_gptoss", "openai"), "hermes": ("openai_gptoss", "hermes"),
                       "qwen3": ("qwen3", "hermes")}
    handle.pieces = [ANALYSIS, "plan", FINAL, "hi"]
    message = chat(make_frontend(handle, chat_template=TEMPLATE)).json()["choices"][0]["message"]
    assert (message["reasoning"], message["content"]) == ("plan", "hi")
    llama = make_frontend(ScriptedHandle(harmony[0].model_path, tokenizer), chat_template=TEMPLATE).config
    assert (llama.reasoning_parser, llama.tool_call_parser) == (None, "hermes")


def test_tools_need_the_formats_tool_call_parser(tiny_model, harmony):
    from pydantic import ValidationError

    from pagedserve.cluster.config import ServerConfig

    handle, _ = harmony
    hermes = make_frontend(handle, reasoning_parser="openai_gptoss", chat_template=TEMPLATE)
    handle.pieces = [FINAL[len(NEXT):], "hi"]
    assert "tool_call_parser 'openai'" in assert_error(chat(hermes, tools=TOOLS), 400, "tools")["message"]
    assert chat(hermes, tools=TOOLS, tool_choice="none").json()["choices"][0]["message"]["content"] == "hi"
    assert chat(hermes).status_code == 200
    with pytest.raises(ValidationError, match="set reasoning_parser: openai_gptoss"):
        ServerConfig(tool_call_parser="openai")
    with pytest.raises(ValidationError, match="set reasoning_parser: openai_gptoss"):
        ServerConfig(tool_call_parser="openai", reasoning_parser="qwen3")


def test_a_response_has_its_reasoning_item_then_its_call_or_message(harmony):
    handle, frontend = harmony
    handle.pieces, handle.finish_reason = [ANALYSIS, "weather?", WEATHER, '{"city": "Paris"}'], "stop"
    tools = [{"type": "function", **TOOLS[0]["function"]}]
    response = call(frontend, "POST", "/v1/responses", json={"input": "hi", "tools": tools}).json()
    assert [item["type"] for item in response["output"]] == ["reasoning", "function_call"]
    assert response["output"][0]["content"][0]["text"] == "weather?"
    assert (response["output"][1]["name"], response["output"][1]["arguments"]) == ("get_weather", '{"city": "Paris"}')
    handle.pieces = [ANALYSIS, "plan", FINAL, "Hello!"]
    response = call(frontend, "POST", "/v1/responses", json={"input": "hi"}).json()
    assert [(item["type"], item["content"][0]["text"]) for item in response["output"]] == [
        ("reasoning", "plan"), ("message", "Hello!")]
    handle.pieces = [ANALYSIS, "plan", FINAL, "{}"]
    response = call(frontend, "POST", "/v1/responses", json={"input": "hi", "text": {"format": {
        "type": "json_object"}}}).json()
    assert handle.params[-1].structured_outputs.reasoning_end == HarmonyParser.end_tag
    assert [(item["type"], item["content"][0]["text"]) for item in response["output"]] == [
        ("reasoning", "plan"), ("message", "{}")]


def _item_summary(item: dict) -> tuple:
    if item["type"] == "function_call":
        return item["type"], (item["name"], item["arguments"]), item["status"]
    return item["type"], item["content"][0]["text"], item["status"]


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(messages=_messages, data=st.data(), finish_reason=st.sampled_from(["stop", "length"]))
def test_a_response_has_an_item_for_each_message_whole_and_streamed(harmony, messages, data, finish_reason):
    """vLLM's Responses items for harmony: one per message, in the reply's order (a preamble and the
    final answer are two messages); the last one incomplete where the reply was cut off."""
    handle, frontend = harmony
    reply = _render(messages)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(reply)), max_size=6)))
    handle.pieces = [reply[a:b] for a, b in zip([0, *cuts], [*cuts, len(reply)])]
    handle.finish_reason = finish_reason
    with_tools = data.draw(st.booleans())   # without tools, a call stays text: a message of its own
    body = {"input": "hi", "tools": [{"type": "function", **TOOLS[0]["function"]}] if with_tools else []}
    whole = call(frontend, "POST", "/v1/responses", json=body).json()["output"]
    streamed = call(frontend, "POST", "/v1/responses", json={**body, "stream": True})
    last = json.loads(streamed.text.rstrip().rsplit("\ndata: ", 1)[1])["response"]["output"]
    assert [_item_summary(item) for item in whole] == [_item_summary(item) for item in last]
    kinds = {REASONING: "reasoning", ANSWER: "message", FUNCTION_CALL: "function_call" if with_tools else "message"}
    expected = [(kinds[kind], text) for kind, text in _messages_of(messages)]
    expected = [(kind, ("get_weather", text.split("<|message|>", 1)[1].removesuffix("<|call|>"))
                 if kind == "function_call" else text) for kind, text in expected]
    if not any(kind != "reasoning" for kind, _ in expected) and finish_reason == "stop":
        expected.append(("message", ""))   # no answer and no call: the message is there, empty
    assert [summary[:2] for summary in map(_item_summary, whole)] == expected
    statuses = [summary[2] for summary in map(_item_summary, whole) if summary[0] != "function_call"]
    cut_off = int(finish_reason == "length" and bool(whole) and whole[-1]["type"] != "function_call")
    assert statuses == ["completed"] * (len(statuses) - cut_off) + ["incomplete"] * cut_off


def test_reasoning_tokens_count_up_to_the_final_channel(tiny_model):
    from transformers import AutoTokenizer

    from pagedserve.cluster.serving.serving_responses import reasoning_token_count

    tokenizer = AutoTokenizer.from_pretrained(tiny_model("llama"))
    tokenizer.add_special_tokens({"additional_special_tokens": list(MARKERS)})
    thinking = tokenizer.encode(ANALYSIS + "plan it" + FINAL, add_special_tokens=False)
    answer = tokenizer.encode("The answer.", add_special_tokens=False)
    assert reasoning_token_count(tokenizer, thinking + answer, HarmonyParser.end_tag) == len(thinking)
    assert reasoning_token_count(tokenizer, thinking[:-1], HarmonyParser.end_tag) == len(thinking) - 1


# ---- the real engine ---------------------------------------------------------------------------
def test_a_served_replys_special_tokens_reach_the_parser(tiny_model):
    """A random-weight model writes no harmony, but, held to a special token (raised) and a few
    words, it writes special tokens: the parser reads them (a reply with no harmony is the content, whole),
    where a server without the parser leaves them out."""
    handle = LocalHandle(tiny_model("llama"))
    try:
        tokenizer = handle.tokenizer
        allowed = [tokenizer.convert_tokens_to_ids("<|im_start|>"), *tokenizer.encode(" the cat sat",
                                                                                       add_special_tokens=False)]
        body = {"max_tokens": 16, "temperature": 1.0, "seed": 3, "ignore_eos": True, "return_token_ids": True,
                "allowed_token_ids": allowed, "logit_bias": {str(allowed[0]): 5}}
        replies = {}
        for parser in ("openai_gptoss", None):
            frontend = make_frontend(handle, reasoning_parser=parser, chat_template=TEMPLATE)
            choice = chat(frontend, **body).json()["choices"][0]
            replies[parser] = choice["message"], tokenizer.decode(choice["token_ids"], skip_special_tokens=False)
            streamed = streamed_chat(chat(frontend, stream=True, **body))
            assert (streamed[0] or None, streamed[1]) == (choice["message"].get("reasoning"),
                                                          choice["message"]["content"])
        message, text = replies["openai_gptoss"]
        assert "<|im_start|>" in text and message["content"] == text and message.get("reasoning") is None
        plain, _ = replies[None]
        assert plain["content"] == text.replace("<|im_start|>", "")
        assert_idle(handle)
    finally:
        handle.engine.shutdown()


@pytest.fixture(scope="module")
def harmony_model(tiny_model, tmp_path_factory) -> str:
    """The tiny Llama with harmony's markers added to its vocabulary as special tokens, their
    embeddings and logits' weights zero (as the checkpoint's own special tokens' logits are)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source, path = tiny_model("llama"), tmp_path_factory.mktemp("harmony-llama")
    tokenizer = AutoTokenizer.from_pretrained(source)
    tokenizer.add_special_tokens({"additional_special_tokens": list(MARKERS)})
    model = AutoModelForCausalLM.from_pretrained(source)
    known = model.get_input_embeddings().weight.shape[0]
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    with torch.no_grad():
        model.get_input_embeddings().weight[known:] = 0
        model.get_output_embeddings().weight[known:] = 0
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def test_a_served_constrained_reply_is_harmony_with_the_answer_in_the_final_channel(harmony_model):
    """Over the real engine: unconstrained, the greedy reply opens no header; constrained, it must.
    Raising ``<|end|>`` ends reasoning messages early, each followed by the next header; raising the
    first token of ``final`` opens the final channel at once, whose message is JSON."""
    handle = LocalHandle(harmony_model)
    try:
        tokenizer = handle.tokenizer
        frontend = make_frontend(handle, reasoning_parser="openai_gptoss", chat_template=TEMPLATE)
        body = {"max_tokens": 40, "temperature": 0, "return_token_ids": True}

        def reply(**extra) -> tuple[dict, str]:
            choice = chat(frontend, **body, **extra).json()["choices"][0]
            return choice["message"], tokenizer.decode(choice["token_ids"], skip_special_tokens=False)

        _, free = reply()
        assert not free.startswith("<|channel|>")
        constrained = {"response_format": {"type": "json_object"}}
        end, final = tokenizer.convert_tokens_to_ids("<|end|>"), tokenizer.encode("final", add_special_tokens=False)[0]
        message, text = reply(**constrained, logit_bias={str(end): 8})
        assert text.startswith(ANALYSIS) and message.get("reasoning")
        assert text.count("<|end|>") == text.count(NEXT + "<|channel|>")
        assert (message.get("reasoning"), message["content"]) == HarmonyParser().parse(text)
        message, text = reply(**constrained, logit_bias={str(final): 5})
        assert text.startswith("<|channel|>final<|message|>{") and message.get("reasoning") is None
        assert message["content"] == text[len("<|channel|>final<|message|>"):]
        assert_idle(handle)
    finally:
        handle.engine.shutdown()


def test_a_served_named_call_is_harmony_and_ends_with_its_arguments(harmony_model):
    """Over the real engine, a named ``tool_choice``: raising the first token of ``commentary`` and
    of `` to`` opens the call at once; the grammar then writes the function's name and arguments
    that its schema fixes, and the reply ends there."""
    handle = LocalHandle(harmony_model)
    try:
        tokenizer = handle.tokenizer
        frontend = make_frontend(handle, reasoning_parser="openai_gptoss", tool_call_parser="openai",
                                 chat_template=TEMPLATE)
        tools = [{"type": "function", "function": {"name": "set_unit", "parameters": {
            "type": "object", "properties": {"unit": {"enum": ["celsius"]}}, "required": ["unit"],
            "additionalProperties": False}}}]
        bias = {str(tokenizer.encode(word, add_special_tokens=False)[0]): 8 for word in ("commentary", " to")}
        choice = chat(frontend, max_tokens=60, temperature=0, return_token_ids=True, logit_bias=bias, tools=tools,
                      tool_choice={"type": "function", "function": {"name": "set_unit"}}).json()["choices"][0]
        text = tokenizer.decode(choice["token_ids"], skip_special_tokens=False)
        assert text.startswith("<|channel|>commentary to=functions.set_unit <|constrain|>json<|message|>"), text
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None, (text, choice)
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in choice["message"]["tool_calls"]] == [
            ("set_unit", '{"unit":"celsius"}')]
        assert_idle(handle)
    finally:
        handle.engine.shutdown()


def test_the_official_client_reads_the_reasoning_and_the_call(harmony):
    import asyncio

    openai = pytest.importorskip("openai")
    from pagedserve.cluster.serving.http_app import build_app

    handle, frontend = harmony
    handle.pieces, handle.finish_reason = [ANALYSIS, "weather?", WEATHER, '{"city": "Paris"}'], "stop"

    async def ask():
        transport = httpx.ASGITransport(app=build_app(frontend))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", http_client=http)
            completion = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                              tools=TOOLS)
            return completion.choices[0]

    choice = asyncio.run(ask())
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls[0].function.name == "get_weather"
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"city": "Paris"}
    assert choice.message.model_extra["reasoning"] == "weather?"

    # A Responses reply of a preamble, more reasoning and the answer: the client's types read each item,
    # whole and streamed.
    handle.pieces = [ANALYSIS, "plan", NEXT, "<|channel|>commentary<|message|>", "Checking.", NEXT, ANALYSIS,
                     "done", FINAL, "Sunny."]

    async def respond():
        transport = httpx.ASGITransport(app=build_app(frontend))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", http_client=http)
            whole = await client.responses.create(model="m", input="hi")
            stream = await client.responses.create(model="m", input="hi", stream=True)
            streamed = [event async for event in stream]
            return whole, streamed

    whole, streamed = asyncio.run(respond())
    assert [item.type for item in whole.output] == ["reasoning", "message", "reasoning", "message"]
    assert whole.output_text == "Checking.Sunny."   # the client joins the messages' text
    assert [item.content[0].text for item in whole.output[::2]] == ["plan", "done"]
    assert [event.item.type for event in streamed if event.type == "response.output_item.done"] == [
        "reasoning", "message", "reasoning", "message"]
    assert "".join(event.delta for event in streamed if event.type == "response.output_text.delta") == \
        "Checking.Sunny."
