"""A reasoning model's thinking split from its answer (``server.reasoning_parser``).

The parser alone: where a reply starts (the prompt's last tag), the documented cases, and,
drawn by hypothesis, that any split of any reply into streamed pieces gives what the whole
reply parses to, and both what a plain reading of the tags gives. Then chat completions
through the HTTP app and gRPC, over a scripted handle whose replies contain the tags (a
random-weight model never writes them), and once over the real engine: ``message.reasoning``
(and ``reasoning_content``), ``delta.reasoning`` pieces, tool calls read from the answer alone,
``include_reasoning: false``, constrained outputs held after the reasoning where the reply starts in
the reasoning, an earlier turn's reasoning given back to the template, and the Responses API's
refusal.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

httpx = pytest.importorskip("httpx")

from local_frontend import (LocalHandle, ScriptedHandle, assert_error, assert_idle, call, chat,  # noqa: E402
                            grpc_stub, streamed_chat)

from pagedserve.reasoning_parsers import REASONING_PARSERS, ThinkTagParser, get_reasoning_parser  # noqa: E402

OPEN = "<|user|>hi<|assistant|><think>\n"       # a prompt that opens the reasoning (DeepSeek-R1's)
CLOSED = "<|user|>hi<|assistant|><think>\n\n</think>\n\n"   # one that closed it (enable_thinking false)
# A template whose generation prompt opens the reasoning, or closes it with enable_thinking false;
# an assistant's earlier reasoning is written back (as Qwen3's template does with reasoning_content).
TEMPLATE = (
    "{% if reasoning_effort is defined %}Reasoning: {{ reasoning_effort }}\n{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>"
    "{% endif %}{{ m.content }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|><think>\n"
    "{% if enable_thinking is defined and not enable_thinking %}\n</think>\n\n{% endif %}{% endif %}")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


# ---- the parser ------------------------------------------------------------------------------
def test_the_prompt_says_where_a_reply_starts():
    starts = ThinkTagParser.starts_in_reasoning
    assert starts(OPEN) and starts("no tags at all") and starts(None) and starts("")
    assert not starts(CLOSED) and not starts("... </think> the answer follows")
    assert starts("<think>a</think> then <think>") and not starts("<think></think><think></think>")


@pytest.mark.parametrize("prompt, reply, expected", [
    (OPEN, "plan</think>\n\nanswer", ("plan", "\n\nanswer")),
    ("<|assistant|>", "<think>\nplan</think>answer", ("\nplan", "answer")),       # the model opens it
    ("<|assistant|>", "\n <think>plan</think>answer", ("plan", "answer")),
    (OPEN, "cut off mid-way", ("cut off mid-way", None)),                         # no </think>: all thinking
    (OPEN, "</think>only the answer", (None, "only the answer")),
    (OPEN, "a <think> inside</think>b", ("a <think> inside", "b")),
    (OPEN, "x</think>y</think>z", ("x", "y</think>z")),
    (CLOSED, "<think>not</think> thinking", (None, "<think>not</think> thinking")),
    (OPEN, "", (None, None)),
])
def test_whole_replies(prompt, reply, expected):
    assert ThinkTagParser(prompt).parse(reply) == expected


def _plain_reading(prompt: str, reply: str) -> tuple[str | None, str | None]:
    """The tags read off the whole reply, as a person would."""
    if not ThinkTagParser.starts_in_reasoning(prompt):
        return None, reply or None
    if reply.lstrip().startswith("<think>"):
        reply = reply.lstrip()[len("<think>"):]
    reasoning, found, content = reply.partition("</think>")
    return reasoning or None, (content or None) if found else None


fragments = st.sampled_from(["<think>", "</think>", "<th", "ink>", "</", "think", ">", "<", "/", " ", "\n",
                             "plan", "é", "\U0001F600", "<tool_call>"])
replies = st.lists(fragments, max_size=12).map("".join)


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(reply=replies, prompt=st.sampled_from([OPEN, CLOSED, "<|assistant|>"]), data=st.data())
def test_any_split_of_a_reply_streams_what_the_whole_parses_to(reply, prompt, data):
    cuts = sorted(data.draw(st.lists(st.integers(0, len(reply)), max_size=6)))
    pieces = [reply[a:b] for a, b in zip([0, *cuts], [*cuts, len(reply)])]
    parser = ThinkTagParser(prompt)
    streamed = [parser.feed(piece) for piece in pieces] + [parser.finish()]
    reasoning = "".join(d.reasoning for d in streamed) or None
    content = "".join(d.content for d in streamed) or None
    assert (reasoning, content) == ThinkTagParser(prompt).parse(reply) == _plain_reading(prompt, reply)


def test_parsers_by_name():
    assert set(REASONING_PARSERS) == {"deepseek_r1", "qwen3", "openai_gptoss"}
    assert get_reasoning_parser("qwen3") is ThinkTagParser
    with pytest.raises(ValueError, match="unknown reasoning parser 'r2'; known: deepseek_r1, openai_gptoss, qwen3"):
        get_reasoning_parser("r2")


def test_the_configuration_and_the_flag():
    from pydantic import ValidationError

    from pagedserve.cluster.cli import _overrides, build_parser
    from pagedserve.cluster.config import ServerConfig

    assert ServerConfig().reasoning_parser is None
    assert ServerConfig(reasoning_parser="qwen3").reasoning_parser == "qwen3"
    with pytest.raises(ValidationError, match="unknown reasoning parser 'r2'"):
        ServerConfig(reasoning_parser="r2")
    args = build_parser().parse_args(["serve", "m", "--reasoning-parser", "deepseek_r1"])
    assert 'server.reasoning_parser="deepseek_r1"' in _overrides(args)


# ---- chat completions over a scripted handle ---------------------------------------------------
@pytest.fixture(scope="module")
def scripted(tiny_model):
    from transformers import AutoTokenizer

    from local_frontend import make_frontend

    path = tiny_model("llama")
    handle = ScriptedHandle(path, AutoTokenizer.from_pretrained(path))
    return handle, make_frontend(handle, reasoning_parser="deepseek_r1", chat_template=TEMPLATE)


@pytest.fixture(autouse=True)
def _replies_stop(request):
    """Each test's scripted replies end with "stop" unless it says otherwise."""
    if "scripted" in request.fixturenames:
        request.getfixturevalue("scripted")[0].finish_reason = "stop"


@pytest.mark.parametrize("pieces", [
    ["I should", " greet.</th", "ink>\n\nHello", "!"],
    ["I should greet.", "</think>", "\n\nHello!"],
    ["I should greet.</think>\n\nHello!"],
])
def test_reasoning_and_answer_whole_and_streamed(scripted, pieces):
    handle, frontend = scripted
    handle.pieces, handle.finish_reason = pieces, "stop"
    message = chat(frontend).json()["choices"][0]["message"]
    assert message["reasoning"] == message["reasoning_content"] == "I should greet."
    assert message["content"] == "\n\nHello!" and message["tool_calls"] == []
    assert handle.prompts[-1].endswith("<|assistant|><think>\n")
    reasoning, content, _, choices = streamed_chat(chat(frontend, stream=True))
    assert (reasoning, content) == ("I should greet.", "\n\nHello!")
    assert choices[0]["delta"] == {"role": "assistant", "content": ""} and choices[-1]["finish_reason"] == "stop"


def test_a_reply_cut_off_while_thinking_is_reasoning_only(scripted):
    handle, frontend = scripted
    handle.pieces, handle.finish_reason = ["Let me", " think about"], "length"
    choice = chat(frontend).json()["choices"][0]
    assert choice["message"]["reasoning"] == "Let me think about" and choice["message"]["content"] is None
    assert choice["finish_reason"] == "length"
    assert streamed_chat(chat(frontend, stream=True))[:2] == ("Let me think about", "")


def test_tool_calls_come_from_the_answer_alone(scripted):
    handle, frontend = scripted
    call_text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    handle.pieces = ["Maybe ", call_text[:20], call_text[20:], "? No: ask.</think>", "\n\n", call_text[:30],
                     call_text[30:]]
    choice = chat(frontend, tools=TOOLS).json()["choices"][0]
    assert choice["message"]["reasoning"] == f"Maybe {call_text}? No: ask."
    [tool_call] = choice["message"]["tool_calls"]
    assert tool_call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    assert choice["finish_reason"] == "tool_calls" and not (choice["message"]["content"] or "").strip()
    reasoning, content, calls, choices = streamed_chat(chat(frontend, stream=True, tools=TOOLS))
    assert reasoning == f"Maybe {call_text}? No: ask." and not content.strip()
    assert [c["function"]["name"] for c in calls if c.get("function", {}).get("name")] == ["get_weather"]
    assert "".join(c["function"].get("arguments") or "" for c in calls) == '{"city": "Oslo"}'
    assert choices[-1]["finish_reason"] == "tool_calls"


def test_include_reasoning_false_leaves_it_out(scripted):
    handle, frontend = scripted
    handle.pieces, handle.finish_reason = ["plan</think>", "answer"], "stop"
    message = chat(frontend, include_reasoning=False).json()["choices"][0]["message"]
    assert message["content"] == "answer" and "reasoning" not in message and "reasoning_content" not in message
    response = chat(frontend, stream=True, include_reasoning=False)
    assert "reasoning" not in response.text and streamed_chat(response)[1] == "answer"


def test_a_prompt_that_closed_the_reasoning_answers_in_content(scripted):
    handle, frontend = scripted
    handle.pieces = ["<think>x</think>", "y"]
    closed = {"chat_template_kwargs": {"enable_thinking": False}}
    message = chat(frontend, **closed).json()["choices"][0]["message"]
    assert handle.prompts[-1].endswith("</think>\n\n")
    assert message["content"] == "<think>x</think>y" and "reasoning" not in message
    assert streamed_chat(chat(frontend, stream=True, **closed))[:2] == ("", "<think>x</think>y")
    # Its output is constrained from its first token.
    assert chat(frontend, response_format={"type": "json_object"}, **closed).status_code == 200
    assert handle.params[-1].structured_outputs.to_dict() == {"json_object": True}


@pytest.mark.parametrize("body", [
    {"response_format": {"type": "json_object"}},
    {"tools": TOOLS, "tool_choice": "required"},
    {"structured_outputs": {"regex": "[ab]+"}},
    {"guided_choice": ["yes", "no"]},
], ids=["response_format", "tool_choice", "structured_outputs", "guided_choice"])
def test_a_constrained_reply_that_starts_in_the_reasoning_is_constrained_after_it(scripted, body):
    """The reasoning stays free: the constraint holds after ``</think>`` (vLLM's way), and the
    answer alone is parsed as the constrained content."""
    handle, frontend = scripted
    handle.pieces = ["free thoughts", "</think>", "\n\nab"]
    response = chat(frontend, **body)
    assert response.status_code == 200, response.text
    spec = handle.params[-1].structured_outputs
    assert spec is not None and spec.reasoning_end == "</think>"
    message = response.json()["choices"][0]["message"]
    assert message["reasoning"] == "free thoughts"


def test_an_earlier_turns_reasoning_goes_back_to_the_template(scripted):
    handle, frontend = scripted
    handle.pieces = ["ok"]
    for key in ("reasoning", "reasoning_content"):
        messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello!", key: "greet"},
                    {"role": "user", "content": "again"}]
        assert chat(frontend, messages=messages).status_code == 200
        assert "<|assistant|><think>greet</think>Hello!<|user|>again" in handle.prompts[-1]
    wrong = [{"role": "user", "content": "hi", "reasoning": "mine"}]
    assert "assistant" in assert_error(chat(frontend, messages=wrong), 400)["message"]
    differ = [{"role": "assistant", "content": "a", "reasoning": "x", "reasoning_content": "y"}]
    assert_error(chat(frontend, messages=differ), 400)


@pytest.mark.parametrize("stream", [False, True])
def test_a_reasoning_effort_goes_to_the_chat_template(scripted, stream):
    handle, frontend = scripted
    handle.pieces = ["plan</think>", "answer"]
    assert chat(frontend, stream, reasoning_effort="high").status_code == 200
    assert handle.prompts[-1].startswith("Reasoning: high\n<|user|>hi")
    tokenized = call(frontend, "POST", "/tokenize", json={"messages": [{"role": "user", "content": "hi"}],
                                                          "reasoning_effort": "high"}).json()
    assert tokenized["tokens"] == handle.tokenizer.encode(handle.prompts[-1], add_special_tokens=False)
    assert chat(frontend, stream, reasoning_effort="low", tools=TOOLS).status_code == 200
    assert handle.prompts[-1].startswith("Reasoning: low\n")
    assert chat(frontend, stream).status_code == 200
    assert handle.prompts[-1].startswith("<|user|>hi")
    # chat_template_kwargs may say the same, not otherwise.
    same = chat(frontend, stream, reasoning_effort="low", chat_template_kwargs={"reasoning_effort": "low"})
    assert same.status_code == 200 and handle.prompts[-1].startswith("Reasoning: low\n")
    differ = chat(frontend, stream, reasoning_effort="low", chat_template_kwargs={"reasoning_effort": "high"})
    assert assert_error(differ, 400)["param"] == "reasoning_effort"
    assert assert_error(chat(frontend, stream, reasoning_effort="max"), 400)["param"] == "reasoning_effort"


def test_a_template_that_does_not_read_the_effort_refuses_it(tiny_model):
    """The tiny model's own ChatML template has no ``reasoning_effort``: a 400 in either API."""
    from local_frontend import make_frontend

    from transformers import AutoTokenizer

    handle = ScriptedHandle(tiny_model("llama"), AutoTokenizer.from_pretrained(tiny_model("llama")))
    frontend = make_frontend(handle, reasoning_parser="deepseek_r1")
    error = assert_error(chat(frontend, reasoning_effort="high"), 400)
    assert error["param"] == "reasoning_effort" and "does not read reasoning_effort" in error["message"]
    error = assert_error(_responses(frontend, reasoning={"effort": "high"}), 400)
    assert error["param"] == "reasoning.effort" and "does not read reasoning_effort" in error["message"]
    assert handle.prompts == []


def test_which_template_reads_a_variable():
    from pagedserve.workers.offline.chat_template import template_reads

    assert template_reads(TEMPLATE, "reasoning_effort") and template_reads(TEMPLATE, "enable_thinking")
    assert not template_reads(TEMPLATE, "builtin_tools")
    assert not template_reads("{% set reasoning_effort = 'x' %}{{ reasoning_effort }}", "reasoning_effort")
    named = {"default": "{{ messages }}", "tool_use": "{{ reasoning_effort }}{{ tools }}"}
    assert template_reads(named, "reasoning_effort", with_tools=True)
    assert not template_reads(named, "reasoning_effort", with_tools=False)
    assert not template_reads(None, "reasoning_effort") and not template_reads("{% if %}", "reasoning_effort")


# ---- the Responses API: a reasoning item before the answer ---------------------------------------
def _responses(frontend, **body):
    return call(frontend, "POST", "/v1/responses", json={"input": "hi", **body})


def _response_events(response) -> list[dict]:
    return [json.loads(line[len("data: "):]) for line in response.text.splitlines() if line.startswith("data: ")]


def _without_ids(items: list[dict]) -> list[dict]:
    return [{k: v for k, v in item.items() if k != "id"} for item in items]


@pytest.mark.parametrize("pieces", [
    ["I should", " greet.</th", "ink>\n\nHello", "!"],
    ["I should greet.</think>\n\nHello!"],
])
def test_a_response_has_a_reasoning_item_then_its_message_whole_and_streamed(scripted, pieces):
    handle, frontend = scripted
    handle.pieces = pieces
    body = _responses(frontend).json()
    assert body["status"] == "completed"
    reasoning, message = body["output"]
    assert reasoning["type"] == "reasoning" and reasoning["id"].startswith("rs_")
    assert (reasoning["content"], reasoning["summary"], reasoning["status"]) == (
        [{"type": "reasoning_text", "text": "I should greet."}], [], "completed")
    assert message["type"] == "message" and message["content"][0]["text"] == "\n\nHello!"

    streamed = _response_events(_responses(frontend, stream=True))
    kinds = [event["type"] for event in streamed]
    first_message = kinds.index("response.output_item.added", 3)
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert set(kinds[4:first_message]) == {"response.reasoning_text.delta", "response.reasoning_text.done",
                                           "response.content_part.done", "response.output_item.done"}
    assert "".join(e["delta"] for e in streamed if e["type"] == "response.reasoning_text.delta") == "I should greet."
    assert all(e["output_index"] == 0 for e in streamed if e["type"].startswith("response.reasoning_text"))
    done = next(e for e in streamed if e["type"] == "response.reasoning_text.done")
    assert done["text"] == "I should greet."
    assert "".join(e["delta"] for e in streamed if e["type"] == "response.output_text.delta") == "\n\nHello!"
    last = streamed[-1]
    assert last["type"] == "response.completed"
    assert _without_ids(last["response"]["output"]) == _without_ids(body["output"])


@pytest.mark.parametrize("stream", [False, True])
def test_a_responses_reasoning_effort_goes_to_the_chat_template(scripted, stream):
    handle, frontend = scripted
    handle.pieces = ["plan</think>", "answer"]
    response = _responses(frontend, stream=stream, reasoning={"effort": "minimal", "summary": None})
    assert response.status_code == 200 and handle.prompts[-1].startswith("Reasoning: minimal\n<|user|>hi")
    body = _response_events(response)[-1]["response"] if stream else response.json()
    assert body["reasoning"] == {"effort": "minimal", "summary": None}
    response = _responses(frontend, stream=stream)
    body = _response_events(response)[-1]["response"] if stream else response.json()
    assert body["reasoning"] == {"effort": None, "summary": None} and handle.prompts[-1].startswith("<|user|>hi")
    error = assert_error(_responses(frontend, reasoning={"effort": "low", "summary": "detailed"}), 400)
    assert "reasoning.summary" in error["message"]


def test_a_response_cut_off_while_thinking_is_its_reasoning_alone(scripted):
    handle, frontend = scripted
    handle.pieces, handle.finish_reason = ["still", " thinking"], "length"
    body = _responses(frontend).json()
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert [(item["type"], item["status"], item["content"][0]["text"]) for item in body["output"]] == [
        ("reasoning", "incomplete", "still thinking")]
    handle.finish_reason = "length"
    streamed = _response_events(_responses(frontend, stream=True))
    assert _without_ids(streamed[-1]["response"]["output"]) == _without_ids(body["output"])
    assert not any(e["type"].startswith("response.output_text") for e in streamed)


def test_a_reasoning_item_goes_back_with_the_assistant_turn_after_it(scripted):
    handle, frontend = scripted
    handle.pieces = ["ok</think>fine"]
    earlier = [{"role": "user", "content": "hi"},
               {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "greet"}]},
               {"role": "assistant", "content": "Hi!"}, {"role": "user", "content": "how are you?"}]
    assert _responses(frontend, input=earlier).status_code == 200
    assert "<think>greet</think>Hi!" in handle.prompts[-1]
    # A summary stands in for content that is left out (OpenAI's items carry one or the other).
    summarized = [earlier[0], {"type": "reasoning", "summary": [{"type": "summary_text", "text": "wave"}]},
                  *earlier[2:]]
    assert _responses(frontend, input=summarized).status_code == 200
    assert "<think>wave</think>Hi!" in handle.prompts[-1]
    # A turn that only thought (a stored response cut off while thinking) is an assistant turn
    # with no content.
    assert _responses(frontend, input=[earlier[0], earlier[1], earlier[3]]).status_code == 200
    assert "<|user|>hi<|assistant|><think>greet</think><|user|>how are you?" in handle.prompts[-1]
    # Reasoning items in a row (a harmony reply gives one per analysis message) are the one turn's.
    second = {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "then wave"}]}
    assert _responses(frontend, input=[earlier[0], earlier[1], second, *earlier[2:]]).status_code == 200
    assert "<|user|>hi<|assistant|><think>greet\nthen wave</think>Hi!<|user|>" in handle.prompts[-1]
    encrypted = [earlier[0], {**earlier[1], "encrypted_content": "gAAA"}, *earlier[2:]]
    assert "encrypted_content" in assert_error(_responses(frontend, input=encrypted), 400)["message"]


def test_a_responses_text_format_holds_after_the_reasoning(scripted):
    handle, frontend = scripted
    handle.pieces = ["hm</think>", "{}"]
    body = _responses(frontend, text={"format": {"type": "json_object"}}).json()
    assert handle.params[-1].structured_outputs.reasoning_end == "</think>"
    assert [item["type"] for item in body["output"]] == ["reasoning", "message"]
    assert body["output"][1]["content"][0]["text"] == "{}"


def test_a_stored_responses_reasoning_goes_back_with_previous_response_id(scripted):
    from local_frontend import make_frontend

    handle, _ = scripted
    frontend = make_frontend(handle, reasoning_parser="deepseek_r1", chat_template=TEMPLATE, store_responses=True)
    handle.pieces = ["greet</think>Hi!"]
    first = _responses(frontend).json()
    assert [item["type"] for item in first["output"]] == ["reasoning", "message"]
    handle.pieces = ["fine</think>Good."]
    assert _responses(frontend, input="how are you?", previous_response_id=first["id"]).status_code == 200
    assert "<|user|>hi<|assistant|><think>greet</think>Hi!<|user|>how are you?" in handle.prompts[-1]
    listed = call(frontend, "GET", f"/v1/responses/{first['id']}").json()
    assert listed["output"] == first["output"]


def test_a_responses_logprobs_are_refused_where_the_reply_starts_in_the_reasoning(scripted):
    handle, frontend = scripted
    handle.pieces = ["a</think>b"]
    assert_error(_responses(frontend, top_logprobs=2), 400, "top_logprobs")
    closed = {"chat_template_kwargs": {"enable_thinking": False}}
    assert chat(frontend, logprobs=True, **closed).status_code == 200


def test_reasoning_tokens_count_up_to_the_end_tag(tiny_model):
    from transformers import AutoTokenizer

    from pagedserve.cluster.serving.serving_responses import reasoning_token_count

    tokenizer = AutoTokenizer.from_pretrained(tiny_model("llama"))
    thinking = tokenizer.encode("plan the answer</think>", add_special_tokens=False)
    answer = tokenizer.encode("\n\nThe answer.", add_special_tokens=False)
    assert reasoning_token_count(tokenizer, thinking + answer, "</think>") == len(thinking)
    assert reasoning_token_count(tokenizer, thinking, "</think>") == len(thinking)
    assert reasoning_token_count(tokenizer, thinking[:-1], "</think>") == len(thinking) - 1   # cut off: all
    assert reasoning_token_count(tokenizer, [], "</think>") == 0
    # A tag that is one token of the vocabulary is found by its id.
    tokenizer.add_tokens(["</think>"])
    tag = tokenizer.convert_tokens_to_ids("</think>")
    assert reasoning_token_count(tokenizer, [5, 6, tag, 7], "</think>") == 3
    assert reasoning_token_count(tokenizer, [5, 6, 7], "</think>") == 3


def test_grpc_chat_carries_the_reasoning(scripted):
    import grpc

    from pagedserve.cluster.protos import pagedserve_pb2 as pb

    handle, frontend = scripted
    handle.pieces, handle.finish_reason = ["I should", " greet.</think>", "Hello!"], "stop"
    request = pb.ChatRequest(messages=[pb.ChatMessage(role="user", content="hi")])
    with grpc_stub(frontend) as stub:
        [choice] = stub.Chat(request, timeout=60).choices
        assert (choice.reasoning, choice.content) == ("I should greet.", "Hello!")
        pieces = [c for response in stub.ChatStream(request, timeout=60) for c in response.choices]
        assert "".join(c.reasoning for c in pieces) == "I should greet."
        assert "".join(c.content for c in pieces) == "Hello!"
        request.include_reasoning = False
        [choice] = stub.Chat(request, timeout=60).choices
        assert not choice.HasField("reasoning") and choice.content == "Hello!"
        earlier = pb.ChatRequest(messages=[pb.ChatMessage(role="user", content="hi"),
                                           pb.ChatMessage(role="assistant", content="Hi!", reasoning="greet"),
                                           pb.ChatMessage(role="user", content="again")])
        stub.Chat(earlier, timeout=60)
        assert "<think>greet</think>Hi!" in handle.prompts[-1]
        request.reasoning_effort = "low"
        list(stub.ChatStream(request, timeout=60))
        assert handle.prompts[-1].startswith("Reasoning: low\n")
        request.reasoning_effort = "lots"
        with pytest.raises(grpc.RpcError) as refused:
            stub.Chat(request, timeout=60)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "reasoning_effort" in refused.value.details()


# ---- the real engine ---------------------------------------------------------------------------
def test_a_served_reply_opened_in_the_reasoning_is_its_reasoning(tiny_model):
    """A random-weight model never closes its reasoning: its greedy reply, whole or streamed, is
    all reasoning, the same text the engine decoded."""
    from local_frontend import make_frontend

    handle = LocalHandle(tiny_model("llama"))
    try:
        frontend = make_frontend(handle, reasoning_parser="qwen3", chat_template=TEMPLATE)
        body = {"max_tokens": 12, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        choice = chat(frontend, **body).json()["choices"][0]
        text = handle.tokenizer.decode(choice["token_ids"], skip_special_tokens=True)
        assert "</think>" not in text
        assert choice["message"]["reasoning"] == text and choice["message"]["content"] is None
        reasoning, content, _, _ = streamed_chat(chat(frontend, stream=True, **body))
        assert (reasoning, content) == (text, "")
        # Constrained, the reasoning is still free: the same greedy text, the engine's grammar
        # waiting for a </think> that never comes.
        constrained = chat(frontend, response_format={"type": "json_object"}, **body).json()["choices"][0]
        assert constrained["message"]["reasoning"] == text and constrained["finish_reason"] == "length"
        # The Responses API: a reasoning item alone, every output token counted as reasoning.
        response = _responses(frontend, max_output_tokens=12, temperature=0).json()
        same = chat(frontend, max_tokens=12, temperature=0).json()["choices"][0]["message"]
        assert [(item["type"], item["content"][0]["text"]) for item in response["output"]] == [
            ("reasoning", same["reasoning"])]
        assert response["usage"]["output_tokens_details"]["reasoning_tokens"] == response["usage"]["output_tokens"]
        assert_idle(handle)
    finally:
        handle.engine.shutdown()


def test_a_reasoning_chunk_is_the_documented_shape():
    from pagedserve.cluster.serving.chunks import ChatChunkJSON

    assert json.loads(ChatChunkJSON("c", 1, "m").choice(0, reasoning="hm"))["choices"][0]["delta"] == {
        "reasoning": "hm", "reasoning_content": "hm"}


def test_the_official_client_reads_the_reasoning(scripted):
    """``openai``'s client keeps the fields it does not know: ``message.reasoning`` and the
    streamed ``delta.reasoning`` reach its user."""
    import asyncio

    openai = pytest.importorskip("openai")
    from pagedserve.cluster.serving.http_app import build_app

    handle, frontend = scripted
    handle.pieces = ["I should", " greet.</think>", "Hello!"]

    async def run():
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(frontend)), base_url="http://test")
        client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="unused", http_client=http, max_retries=0)
        async with http:
            messages = [{"role": "user", "content": "hi"}]
            message = (await client.chat.completions.create(model="m", messages=messages,
                                                            reasoning_effort="medium")).choices[0].message
            assert handle.prompts[-1].startswith("Reasoning: medium\n")
            stream = await client.chat.completions.create(model="m", messages=messages, stream=True)
            deltas = [chunk.choices[0].delta async for chunk in stream if chunk.choices]
            response = await client.responses.create(model="m", input="hi", reasoning={"effort": "high"})
            assert handle.prompts[-1].startswith("Reasoning: high\n") and response.reasoning.effort == "high"
            response_events = [event async for event in await client.responses.create(model="m", input="hi",
                                                                                       stream=True)]
        return message, deltas, response, response_events

    message, deltas, response, response_events = asyncio.run(run())
    reasoning, answer = response.output
    assert (reasoning.type, reasoning.content[0].text, answer.content[0].text) == ("reasoning", "I should greet.",
                                                                                   "Hello!")
    assert "".join(e.delta for e in response_events if e.type == "response.reasoning_text.delta") == "I should greet."
    assert response_events[-1].response.output[0].content[0].text == "I should greet."
    assert (message.reasoning, message.reasoning_content, message.content) == ("I should greet.", "I should greet.",
                                                                               "Hello!")
    assert "".join(getattr(d, "reasoning", None) or "" for d in deltas) == "I should greet."
    assert "".join(d.content or "" for d in deltas) == "Hello!"
