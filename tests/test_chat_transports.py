"""Chat completions through both transports over one in-process frontend: HTTP (the
FastAPI app) and gRPC's ``Chat``/``ChatStream`` through a real ``grpcio`` client on a
local port. The same request gets the same answer and the same refusal on both;
tools, ``tool_choice``, structured outputs and logprobs work on both; a forced tool
call cut off by ``max_tokens`` comes back inside ``tool_calls`` with its partial
arguments and ``finish_reason: "length"``, streamed or not, never as content.
"""

from __future__ import annotations

import json

import pytest

grpc = pytest.importorskip("grpc")
httpx = pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")

from local_frontend import (MODEL, GrpcServer, LocalHandle, assert_error, assert_idle, call,  # noqa: E402
                            events, grpc_stub, make_frontend, with_context_length)

from pagedserve.cluster.protos import pagedserve_pb2 as pb  # noqa: E402

pytestmark = pytest.mark.timeout(600)

ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {
        "a": {"type": "integer", "minimum": -999, "maximum": 999},
        "b": {"type": "integer", "minimum": -999, "maximum": 999}},
        "required": ["a", "b"], "additionalProperties": False}}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TOOLS = [ADD, WEATHER]
MESSAGES = [{"role": "user", "content": "What is 2 + 3?"}]


def pb_tools(tools: list[dict]) -> list[pb.Tool]:
    return [pb.Tool(name=t["function"]["name"], description=t["function"]["description"],
                    parameters=json.dumps(t["function"]["parameters"])) for t in tools]


def pb_messages(messages: list[dict]) -> list[pb.ChatMessage]:
    return [pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages]


@pytest.fixture(scope="module")
def handle(tiny_model, tmp_path_factory):
    # The tools' JSON in the chat template needs more than the tiny model's 512 tokens.
    path = with_context_length(tiny_model("llama"), tmp_path_factory.mktemp("model") / "llama-tiny-2k", 2048)
    local = LocalHandle(path, num_device_blocks=512)
    yield local
    local.engine.shutdown()


@pytest.fixture(scope="module")
def frontend(handle):
    return make_frontend(handle)


@pytest.fixture(scope="module")
def stub(frontend):
    with grpc_stub(frontend) as stub:
        yield stub


@pytest.fixture(autouse=True)
def idle_after(handle):
    yield
    assert_idle(handle)


def grpc_error(call_rpc) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call_rpc()
    return info.value


# ---- same answers ---------------------------------------------------------------------------------
def test_chat_unary_stream_and_http_agree(frontend, stub):
    request = pb.ChatRequest(messages=pb_messages(MESSAGES), max_tokens=8, temperature=0, ignore_eos=True,
                             logprobs=True, top_logprobs=2, prompt_logprobs=1)
    unary = stub.Chat(request, timeout=60)
    [choice] = unary.choices
    assert choice.role == "assistant" and choice.finish_reason == "length" and unary.model == MODEL
    assert unary.usage.completion_tokens == 8 == len(choice.logprobs)
    assert all(len(entry.top_logprobs) == 2 and entry.bytes for entry in choice.logprobs)
    assert len(unary.prompt_logprobs) == unary.usage.prompt_tokens
    assert not unary.prompt_logprobs[0].candidates and unary.prompt_logprobs[1].candidates

    messages = list(stub.ChatStream(request, timeout=60))
    assert messages[0].choices[0].role == "assistant" and messages[0].prompt_logprobs
    assert "".join(c.content for m in messages for c in m.choices) == choice.content
    assert [e.token for m in messages for c in m.choices for e in c.logprobs] == [e.token for e in choice.logprobs]
    assert [c.finish_reason for m in messages for c in m.choices if c.finish_reason] == ["length"]
    assert not messages[-1].choices and messages[-1].usage.completion_tokens == 8

    body = {"messages": MESSAGES, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "logprobs": True,
            "top_logprobs": 2}
    http = call(frontend, "POST", "/v1/chat/completions", json=body).json()["choices"][0]
    assert http["message"]["content"] == choice.content
    assert [e["token"] for e in http["logprobs"]["content"]] == [e.token for e in choice.logprobs]
    assert [bytes(e["bytes"]) for e in http["logprobs"]["content"]] == [e.bytes for e in choice.logprobs]


def test_stop_reason_and_cache_salt_over_grpc(stub):
    """vLLM's stop_token_ids, stop_reason (a stop token id, a stop string) and cache_salt reach
    gRPC's Generate, GenerateStream and Chat as they reach HTTP."""
    base = dict(prompt="Once upon a time", max_tokens=8, temperature=0, ignore_eos=True)
    free = stub.Generate(pb.GenerateRequest(**base), timeout=60).choices[0]
    assert not free.stop_string and not free.HasField("stop_token_id")
    by_id = stub.Generate(pb.GenerateRequest(**base, stop_token_ids=[free.token_ids[3]]), timeout=60).choices[0]
    assert by_id.finish_reason == "stop" and by_id.stop_token_id == free.token_ids[3]
    stop = free.text[len(free.text) // 2:len(free.text) // 2 + 2]
    streamed = list(stub.GenerateStream(pb.GenerateRequest(**base, stop=[stop]), timeout=60))
    assert [c.stop_string for m in streamed for c in m.choices if c.finish_reason] == [stop]
    chat = pb.ChatRequest(messages=pb_messages(MESSAGES), max_tokens=8, temperature=0, ignore_eos=True)
    chat_free = stub.Chat(chat, timeout=60).choices[0]
    assert not chat_free.stop_string and not chat_free.HasField("stop_token_id")
    long_prompt = "A salted prompt keeps its cached blocks to itself, block by block. " * 3

    def cached(salt: str) -> int:
        request = pb.GenerateRequest(prompt=long_prompt, max_tokens=2, temperature=0, cache_salt=salt)
        return stub.Generate(request, timeout=60).usage.cached_tokens

    cached("tenant-a")
    assert cached("tenant-a") > 0 and cached("tenant-b") == 0
    salted_chat = pb.ChatRequest(messages=pb_messages(MESSAGES), max_tokens=2, cache_salt="tenant-c")
    assert stub.Chat(salted_chat, timeout=60).usage.cached_tokens == 0
    assert stub.Chat(salted_chat, timeout=60).usage.cached_tokens > 0


def test_logit_bias_allowed_token_ids_and_bad_words_over_grpc(frontend, stub):
    """OpenAI's logit_bias and vLLM's allowed_token_ids and bad_words over gRPC, with HTTP's
    answers and refusals."""
    token = frontend.tokenizer.encode(" blocks", add_special_tokens=False)[0]
    base = dict(prompt="Once upon a time", max_tokens=5, temperature=0, ignore_eos=True)
    forced = stub.Generate(pb.GenerateRequest(**base, logit_bias={token: 100.0}), timeout=60).choices[0]
    assert list(forced.token_ids) == [token] * 5
    allowed = stub.Chat(pb.ChatRequest(messages=pb_messages(MESSAGES), max_tokens=5, ignore_eos=True, seed=3,
                                       allowed_token_ids=[token]), timeout=60).choices[0]
    assert allowed.content == frontend.tokenizer.decode([token] * 5)
    free = stub.Generate(pb.GenerateRequest(**base), timeout=60).choices[0]
    word = frontend.tokenizer.decode([free.token_ids[0]])
    banned = stub.Generate(pb.GenerateRequest(**base, bad_words=[word]), timeout=60).choices[0]
    assert banned.token_ids[0] != free.token_ids[0]
    vocab = frontend.vocab_size
    for request, param in ((pb.GenerateRequest(**base, logit_bias={token: 101.0}), "logit_bias"),
                           (pb.GenerateRequest(**base, allowed_token_ids=[vocab]), "allowed_token_ids")):
        failure = grpc_error(lambda: stub.Generate(request, timeout=60))
        assert failure.code() == grpc.StatusCode.INVALID_ARGUMENT and param in failure.details()


@pytest.mark.parametrize("tool_choice", ["required", "add"])
def test_forced_tool_calls_over_grpc(stub, tool_choice):
    choice_pb = pb.ToolChoice(mode=tool_choice) if tool_choice == "required" else pb.ToolChoice(function=tool_choice)
    request = pb.ChatRequest(messages=pb_messages(MESSAGES), tools=pb_tools(TOOLS), tool_choice=choice_pb,
                             max_tokens=200, temperature=0.8, seed=3, parallel_tool_calls=False)
    unary = stub.Chat(request, timeout=120)
    [choice] = unary.choices
    assert choice.finish_reason in ("tool_calls", "length")
    assert not choice.HasField("content") and len(choice.tool_calls) == 1
    call_pb = choice.tool_calls[0]
    assert call_pb.id.startswith("call_") and call_pb.name in {"add", "get_weather"}
    if tool_choice == "add":
        assert call_pb.name == "add"
    if choice.finish_reason == "tool_calls":
        schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call_pb.name)
        jsonschema.validate(json.loads(call_pb.arguments), schema)
    # Streamed: the pieces rebuild the same call (same seed, same tokens).
    pieces = [c for m in stub.ChatStream(request, timeout=120) for ch in m.choices for c in ch.tool_calls]
    assert pieces[0].id and pieces[0].name == call_pb.name
    assert all(not p.id and not p.name for p in pieces[1:])
    assert "".join(p.arguments for p in pieces) == call_pb.arguments


def test_structured_outputs_over_grpc(stub):
    """``response_format`` reaches the engine over gRPC: finished answers validate, and most
    answers finish (a random-weight model without the schema never writes one)."""
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    response_format = json.dumps({"type": "json_schema", "json_schema": {"name": "digit", "schema": schema}})
    num_valid = 0
    for seed in range(6):
        [choice] = stub.Chat(pb.ChatRequest(messages=pb_messages(MESSAGES), response_format=response_format,
                                            max_tokens=40, seed=seed), timeout=60).choices
        if choice.finish_reason == "stop":
            jsonschema.validate(json.loads(choice.content), schema)
            num_valid += 1
    assert num_valid >= 3, num_valid


# ---- truncated tool calls (both transports) ----------------------------------------------------------
NAMED = {"type": "function", "function": {"name": "add"}}


# The last size of each choice cuts inside the arguments (the "required" wrapper takes more tokens).
@pytest.mark.parametrize(("tool_choice", "max_tokens"),
                         [("required", 1), ("required", 4), ("required", 20), (NAMED, 1), (NAMED, 4), (NAMED, 9)])
def test_truncated_tool_call_is_a_partial_call_not_content(frontend, tool_choice, max_tokens):
    body = {"messages": MESSAGES, "tools": TOOLS, "tool_choice": tool_choice, "max_tokens": max_tokens,
            "temperature": 0.7, "seed": 1}
    data = call(frontend, "POST", "/v1/chat/completions", json=body).json()
    [choice] = data["choices"]
    message = choice["message"]
    assert choice["finish_reason"] == "length", data
    assert message["content"] is None, message
    calls = message["tool_calls"]
    for tool_call in calls:
        assert tool_call["function"]["name"] in {"add", "get_weather"}
        # The partial arguments: a prefix of an object (JSON cut mid-way), never the wrapper.
        assert tool_call["function"]["arguments"].startswith("{") or not tool_call["function"]["arguments"]
        assert '"name"' not in tool_call["function"]["arguments"] or tool_choice != "required"
    if isinstance(tool_choice, dict):
        assert [c["function"]["name"] for c in calls] == ["add"]
    if max_tokens in (9, 20):
        assert calls and calls[-1]["function"]["arguments"], message

    streamed = events(call(frontend, "POST", "/v1/chat/completions", json={**body, "stream": True}))
    deltas = [c["delta"] for e in streamed for c in e["choices"]]
    assert not any(d.get("content") for d in deltas), deltas
    pieces = [p for d in deltas for p in d.get("tool_calls") or []]
    rebuilt: dict[int, dict] = {}
    for piece in pieces:
        entry = rebuilt.setdefault(piece["index"], {"name": piece.get("function", {}).get("name"), "arguments": ""})
        entry["arguments"] += (piece.get("function") or {}).get("arguments") or ""
    assert [(e["name"], e["arguments"]) for e in rebuilt.values()] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in calls]
    assert [c["finish_reason"] for e in streamed for c in e["choices"] if c["finish_reason"]] == ["length"]


def test_truncated_tool_call_over_grpc(stub):
    request = pb.ChatRequest(messages=pb_messages(MESSAGES), tools=pb_tools(TOOLS),
                             tool_choice=pb.ToolChoice(function="add"), max_tokens=4, temperature=0)
    [choice] = stub.Chat(request, timeout=60).choices
    assert choice.finish_reason == "length" and not choice.HasField("content")
    [partial] = choice.tool_calls
    assert partial.name == "add" and partial.arguments.startswith("{")
    with pytest.raises(ValueError):
        json.loads(partial.arguments)  # cut off mid-object
    streamed = list(stub.ChatStream(request, timeout=60))
    assert "".join(c.arguments for m in streamed for ch in m.choices for c in ch.tool_calls) == partial.arguments
    assert not any(ch.content for m in streamed for ch in m.choices)


# ---- same refusals -------------------------------------------------------------------------------
def _refusals() -> list[tuple[dict, pb.ChatRequest, int, grpc.StatusCode, str | None]]:
    """(HTTP body, the same as a ChatRequest, HTTP status, gRPC status, the param named)."""
    user = pb_messages(MESSAGES)
    return [
        ({"model": "gpt-9", "messages": MESSAGES}, pb.ChatRequest(model="gpt-9", messages=user),
         404, grpc.StatusCode.NOT_FOUND, "model"),
        ({"messages": MESSAGES, "tool_choice": "required"},
         pb.ChatRequest(messages=user, tool_choice=pb.ToolChoice(mode="required")),
         400, grpc.StatusCode.INVALID_ARGUMENT, "tool_choice"),
        ({"messages": MESSAGES, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         pb.ChatRequest(messages=user, tools=pb_tools(TOOLS), tool_choice=pb.ToolChoice(function="nope")),
         400, grpc.StatusCode.INVALID_ARGUMENT, "tool_choice"),
        ({"messages": MESSAGES, "top_logprobs": 2}, pb.ChatRequest(messages=user, top_logprobs=2),
         400, grpc.StatusCode.INVALID_ARGUMENT, "top_logprobs"),
        ({"messages": MESSAGES, "max_tokens": 5000}, pb.ChatRequest(messages=user, max_tokens=5000),
         400, grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
        ({"messages": MESSAGES, "top_p": 2}, pb.ChatRequest(messages=user, top_p=2),
         400, grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
        ({"messages": [{"role": "robot", "content": "x"}]}, pb.ChatRequest(messages=[pb.ChatMessage(role="robot")]),
         400, grpc.StatusCode.INVALID_ARGUMENT, None),
        ({"messages": MESSAGES, "response_format": {"type": "json_schema",
                                                    "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
         pb.ChatRequest(messages=user, response_format=json.dumps(
             {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}})),
         400, grpc.StatusCode.INVALID_ARGUMENT, "response_format.json_schema.schema"),
    ]


def test_refusals_match_http(frontend, stub):
    for body, request, status, code, param in _refusals():
        error = assert_error(call(frontend, "POST", "/v1/chat/completions", json=body), status, param)
        for rpc in (stub.Chat, lambda r, **kw: list(stub.ChatStream(r, **kw))):
            failure = grpc_error(lambda: rpc(request, timeout=60))
            assert failure.code() == code, (body, failure.details())
            assert failure.details() == error["message"], body


def test_bad_tool_parameters_and_undecodable_bytes(stub, frontend):
    bad = pb.ChatRequest(messages=pb_messages(MESSAGES), tools=[pb.Tool(name="add", parameters="{nope")])
    failure = grpc_error(lambda: stub.Chat(bad, timeout=60))
    assert failure.code() == grpc.StatusCode.INVALID_ARGUMENT and "tools.0.function.parameters" in failure.details()
    with GrpcServer(frontend) as server, grpc.insecure_channel(server.target) as channel:
        raw = channel.unary_unary("/pagedserve.PagedServe/Chat")
        failure = grpc_error(lambda: raw(b"\x0a\xff\xff\xff\xff\x0f", timeout=60))
    assert failure.code() == grpc.StatusCode.INVALID_ARGUMENT and "ChatRequest" in failure.details()
