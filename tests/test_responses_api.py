"""OpenAI's Responses API (``POST /v1/responses``) without Ray: the ``Frontend``'s app over an
in-process engine, driven by the official ``openai`` client through httpx's ASGI transport.

The oracle is the chat path, itself checked against transformers: a response
generates what the chat completion of the same conversation does (greedy),
with the same token counts. The stream is OpenAI's named events, which add up
to the response; refusals are 400s naming the field. The served deployment is
covered in ``test_api_clients.py``.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from local_frontend import (MODEL, LocalHandle, assert_error, assert_idle, call, make_frontend,  # noqa: E402
                            with_context_length)

pytestmark = pytest.mark.timeout(300)

ADD = {"type": "function", "name": "add", "description": "Add two digits",
       "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                                      "b": {"type": "integer", "minimum": 0, "maximum": 9}},
                      "required": ["a", "b"], "additionalProperties": False}}
DIGIT = {"type": "object", "properties": {"n": {"enum": [1, 2, 3]}}, "required": ["n"],
         "additionalProperties": False}


@pytest.fixture(scope="module")
def local_handle(tiny_model, tmp_path_factory):
    """The tiny Llama with a 2048-token context: the tools' system prompt alone is about 500 tokens."""
    handle = LocalHandle(with_context_length(tiny_model("llama"), tmp_path_factory.mktemp("m") / "llama", 2048))
    yield handle
    handle.engine.shutdown()


@pytest.fixture(scope="module")
def server(local_handle):
    return make_frontend(local_handle)


@pytest.fixture(autouse=True)
def idle_after(local_handle):
    yield
    assert_idle(local_handle)


def with_client(server, use):
    """``await use(client)`` with the official async client on ``server``'s app, in a fresh loop."""
    from pagedserve.cluster.serving.http_app import build_app

    async def run():
        transport = httpx.ASGITransport(app=build_app(server))
        async with httpx.AsyncClient(transport=transport, base_url="http://test/v1") as http_client:
            client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="unused", http_client=http_client,
                                        max_retries=0)
            result = await use(client)
        deadline = time.monotonic() + 10
        while server.handle.has_streams() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return result
    return asyncio.run(run())


def create(server, **body):
    return with_client(server, lambda client: client.responses.create(model=MODEL, **body))


def stream_events(server, **body) -> list:
    async def use(client):
        stream = await client.responses.create(model=MODEL, stream=True, **body)
        return [event async for event in stream]
    return with_client(server, use)


def chat(server, messages, **body) -> dict:
    response = call(server, "POST", "/v1/chat/completions", json={"messages": messages, **body})
    assert response.status_code == 200, response.text
    return response.json()


def test_a_response_is_the_chat_completion_of_its_conversation(server):
    for instructions, max_tokens in ((None, 12), ("Answer in one word.", 9), ("Be brief.", 400)):
        response = create(server, input="What is a paged KV cache?", instructions=instructions,
                          max_output_tokens=max_tokens, temperature=0)
        messages = ([{"role": "system", "content": instructions}] if instructions else []) + [
            {"role": "user", "content": "What is a paged KV cache?"}]
        expected = chat(server, messages, max_completion_tokens=max_tokens, temperature=0)
        choice = expected["choices"][0]
        assert response.output_text == choice["message"]["content"]
        assert response.object == "response" and response.id.startswith("resp_")
        assert response.model == MODEL and response.instructions == instructions
        assert response.usage.input_tokens == expected["usage"]["prompt_tokens"]
        assert response.usage.output_tokens == expected["usage"]["completion_tokens"]
        assert response.usage.total_tokens == expected["usage"]["total_tokens"]
        [message] = response.output
        assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
        if choice["finish_reason"] == "length":
            assert response.status == "incomplete" and message.status == "incomplete"
            assert response.incomplete_details.reason == "max_output_tokens"
        else:
            assert response.status == "completed" and message.status == "completed"
            assert response.incomplete_details is None
        assert response.temperature == 0 and response.max_output_tokens == max_tokens
        assert response.store is False and response.previous_response_id is None


def test_input_items_are_the_conversation_with_its_function_calls(server):
    """Messages (with or without ``type``, text or parts), an earlier call and its output render
    as the chat messages they stand for: same prompt, same greedy output."""
    items = [
        {"role": "developer", "content": "Use the tools."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Add 2 and "},
                                                        {"type": "input_text", "text": "3."}]},
        {"type": "function_call", "call_id": "call_1", "name": "add", "arguments": '{"a": 2, "b": 3}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "5"},
        {"type": "message", "role": "assistant", "id": "msg_0", "status": "completed",
         "content": [{"type": "output_text", "text": "It is 5.", "annotations": []}]},
        {"role": "user", "content": "And 4 and 4?"},
    ]
    response = create(server, input=items, tools=[ADD], tool_choice="none", max_output_tokens=8, temperature=0)
    messages = [
        {"role": "developer", "content": "Use the tools."},
        {"role": "user", "content": "Add 2 and 3."},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "5"},
        {"role": "assistant", "content": "It is 5."},
        {"role": "user", "content": "And 4 and 4?"},
    ]
    tool = {"type": "function", "function": {k: v for k, v in ADD.items() if k != "type"}}
    expected = chat(server, messages, tools=[tool], tool_choice="none", max_tokens=8, temperature=0)
    assert response.usage.input_tokens == expected["usage"]["prompt_tokens"]
    assert response.output_text == expected["choices"][0]["message"]["content"]
    assert response.tools[0].name == "add" and response.tool_choice == "none"


def test_the_stream_is_openais_events_and_adds_up_to_the_response(server):
    body = dict(input="Tell me about blocks.", max_output_tokens=10, temperature=0)
    whole = create(server, **body)
    events = stream_events(server, **body)
    kinds = [event.type for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    deltas = [event for event in events if event.type == "response.output_text.delta"]
    assert kinds[4:4 + len(deltas)] == ["response.output_text.delta"] * len(deltas)
    assert kinds[4 + len(deltas):] == ["response.output_text.done", "response.content_part.done",
                                       "response.output_item.done", "response.incomplete"]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    item_id = events[2].item.id
    assert all(event.item_id == item_id and event.output_index == 0 for event in deltas)
    text = "".join(event.delta for event in deltas)
    assert text == events[-4].text == whole.output_text
    assert events[-2].item.status == "incomplete" and events[-2].item.content[0].text == text
    last = events[-1].response
    assert last.status == "incomplete" and last.output_text == text and last.id == events[0].response.id
    assert last.usage.output_tokens == whole.usage.output_tokens == 10


def test_the_stream_is_named_server_sent_events_without_done(server):
    response = call(server, "POST", "/v1/responses",
                    json={"input": "Hi", "max_output_tokens": 3, "temperature": 0, "stream": True})
    assert response.headers["content-type"].startswith("text/event-stream")
    blocks = [block for block in response.text.split("\n\n") if block]
    assert "[DONE]" not in response.text
    for block in blocks:
        event_line, data_line = block.split("\n")
        assert event_line.startswith("event: ") and data_line.startswith("data: ")
        assert json.loads(data_line[len("data: "):])["type"] == event_line[len("event: "):]
    # Times are whole Unix seconds on the wire, as OpenAI's are.
    last = json.loads(blocks[-1].split("\n")[1][len("data: "):])["response"]
    assert type(last["created_at"]) is int and type(last["completed_at"]) is int, last


def test_text_format_json_schema_constrains_the_output(server):
    """Random weights: only the grammar makes the output valid; each that completes validates."""
    num_valid = 0
    for question in ("Pick one.", "Which digit?", "A number, please.", "Choose."):
        text = {"format": {"type": "json_schema", "name": "digit", "schema": DIGIT, "strict": True}}
        response = create(server, input=question, text=text, max_output_tokens=48, temperature=0)
        assert response.text.format.type == "json_schema" and response.text.format.name == "digit"
        if response.status == "completed":
            jsonschema.validate(json.loads(response.output_text), DIGIT)
            num_valid += 1
    assert num_valid >= 2
    response = create(server, input="An object.", text={"format": {"type": "json_object"}}, max_output_tokens=48,
                      temperature=0)
    if response.status == "completed":
        assert isinstance(json.loads(response.output_text), dict)


def test_a_forced_function_call_is_a_function_call_item_streamed_and_not(server):
    body = dict(input="Add 2 and 3.", tools=[ADD], tool_choice={"type": "function", "name": "add"},
                max_output_tokens=64, temperature=0)
    response = create(server, **body)
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls and all(item.name == "add" and item.call_id.startswith("call_") for item in calls)
    assert response.status == "completed", response
    for item in calls:
        jsonschema.validate(json.loads(item.arguments), ADD["parameters"])
        assert item.status == "completed" and item.id.startswith("fc_")
    assert response.tool_choice.type == "function" and response.tool_choice.name == "add"

    events = stream_events(server, **body)
    added = [event.item for event in events if event.type == "response.output_item.added"]
    assert [item.type for item in added] == [item.type for item in response.output]
    for index, item in enumerate(added):
        if item.type != "function_call":
            continue
        pieces = "".join(event.delta for event in events if event.type == "response.function_call_arguments.delta"
                         and event.item_id == item.id)
        [done] = [event for event in events if event.type == "response.function_call_arguments.done"
                  and event.item_id == item.id]
        assert pieces == done.arguments == response.output[index].arguments
        assert item.name == "add" and done.output_index == index
    assert events[-1].type == "response.completed"
    assert [item.type for item in events[-1].response.output] == [item.type for item in response.output]


def test_required_tool_choice_needs_tools_and_tool_calls_parse_in_order(server):
    assert_error(call(server, "POST", "/v1/responses", json={"input": "x", "tool_choice": "required"}), 400,
                 "tool_choice")
    response = create(server, input="Use a tool.", tools=[ADD], tool_choice="required", max_output_tokens=80,
                      temperature=0)
    assert response.output and response.output[0].type == "function_call"
    assert response.usage.output_tokens <= 80


def test_logprobs_come_with_the_text_streamed_and_not(server, local_handle):
    body = dict(input="Logprobs, please.", max_output_tokens=6, temperature=0, top_logprobs=2,
                include=["message.output_text.logprobs"])
    response = create(server, **body)
    part = response.output[0].content[0]
    assert len(part.logprobs) == response.usage.output_tokens == 6
    assert "".join(entry.token for entry in part.logprobs) == part.text
    assert all(len(entry.top_logprobs) == 2 for entry in part.logprobs)
    assert all(entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-6) for entry in part.logprobs)
    events = stream_events(server, **body)
    streamed = [entry for event in events if event.type == "response.output_text.delta" for entry in event.logprobs]
    assert [e.token for e in streamed] == [e.token for e in part.logprobs]
    # Equal up to float noise (rounding both to 5 places failed once on a value at a rounding edge).
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in part.logprobs], abs=1e-4)
    without = create(server, input="Logprobs, please.", max_output_tokens=6, temperature=0)
    assert without.output[0].content[0].logprobs is None and without.output_text == part.text


@pytest.mark.parametrize("body, param, words", [
    ({"store": True}, "store", "server.store_responses is off"),
    ({"store": 1}, "store", None),
    ({"previous_response_id": "resp_1"}, "previous_response_id", "server.store_responses is off"),
    ({"background": True}, "background", "server.store_responses is off"),
    ({"conversation": "conv_1"}, "conversation", "not kept"),
    ({"reasoning": {"effort": "high"}}, "reasoning.effort", "does not read reasoning_effort"),
    ({"reasoning": {"effort": "enormous"}}, "reasoning.effort", None),
    ({"reasoning": {"summary": "auto"}}, "reasoning.summary", "not summarised"),
    ({"truncation": "auto"}, "truncation", "never truncated"),
    ({"include": ["reasoning.encrypted_content"]}, "include", "includes only"),
    ({"tools": [{"type": "web_search"}]}, "tools", "function tools only"),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice", "function tools only"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input",
     "text-only"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input", "server.store_responses is off"),
    ({"input": [{"role": "user", "content": "Hi"}, {"id": "msg_1"}]}, "input", "input[1] is item_reference"),
    ({"input": [True, {"type": [{}], "content": "x"}]}, "input", None),
    ({"stream_options": {"include_obfuscation": True}}, "stream_options.include_obfuscation", None),
    ({"max_output_tokens": 10**6}, "max_output_tokens", "maximum context length"),
    ({"tools": [ADD], "top_logprobs": 2}, "top_logprobs", "cannot be combined with tools"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}}, "text.format", None),
    ({"n": 2}, "n", "unknown field"),
])
def test_what_cannot_be_honoured_is_a_400_naming_the_field(server, body, param, words):
    response = call(server, "POST", "/v1/responses", json={"input": "Hi", **body})
    error = assert_error(response, 400)
    assert param in (error["param"] or error["message"]), error
    if words is not None:
        assert words in error["message"], error
    assert "response_format" not in error["message"]


def test_stored_response_routes_answer_that_nothing_is_stored(server):
    async def use(client):
        for ask in (client.responses.retrieve, client.responses.delete, client.responses.cancel,
                    client.responses.input_items.list):
            with pytest.raises(openai.NotFoundError) as caught:
                await ask("resp_1")
            assert caught.value.body["param"] == "response_id", caught.value.body
            assert "server.store_responses is off" in caught.value.body["message"], caught.value.body
    with_client(server, use)


def test_harmless_values_of_refused_fields_pass(server):
    response = create(server, input="Hi", store=False, background=False, truncation="disabled",
                      service_tier="auto", reasoning={}, metadata={"trace": "t1"}, user="u",
                      max_output_tokens=2, temperature=0)
    assert response.metadata == {"trace": "t1"} and response.user == "u"
    assert response.usage.output_tokens == 2


def test_a_stream_that_fails_mid_way_ends_with_response_failed(server, local_handle):
    from pagedserve.cluster.request_flow import StreamNotResumable

    local_handle.fail_after_first = StreamNotResumable("the worker failed; the stream cannot be continued")
    try:
        streamed = call(server, "POST", "/v1/responses",
                        json={"input": "Hello", "max_output_tokens": 20, "temperature": 0, "stream": True})
        whole = call(server, "POST", "/v1/responses", json={"input": "Hello", "max_output_tokens": 20})
    finally:
        local_handle.fail_after_first = None
    assert streamed.status_code == 200
    events = [json.loads(line[len("data: "):]) for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert events[0]["type"] == "response.created"
    last = events[-1]
    assert last["type"] == "response.failed" and last["sequence_number"] == len(events) - 1
    assert last["response"]["id"] == events[0]["response"]["id"] and last["response"]["status"] == "failed"
    assert last["response"]["error"]["code"] == "worker_failed"
    assert "cannot be continued" in last["response"]["error"]["message"]
    assert not any(event["type"] == "response.completed" for event in events)
    assert_error(whole, 503)


class _ScriptedGeneration:
    """A generation whose outputs are given: each a delta of text, the last finished."""

    def __init__(self, pieces: list[str], finish_reason: str) -> None:
        from pagedserve.workers.outputs.request_output import CompletionOutput, RequestOutput

        self.outputs = []
        for number, piece in enumerate(pieces, 1):
            is_last = number == len(pieces)
            completion = CompletionOutput(0, "".join(pieces[:number]), list(range(number)), None, None,
                                          finish_reason if is_last else None, delta_text=piece,
                                          delta_token_ids=[number], is_newly_finished=is_last)
            self.outputs.append((0, RequestOutput("r", None, [1, 2], [completion], is_last, None)))

    async def __aiter__(self):
        for output in self.outputs[1:]:
            yield output

    async def aclose(self) -> None:
        pass

    def usage(self):
        from pagedserve.cluster.serving.protocol import Usage

        return Usage(prompt_tokens=2, completion_tokens=len(self.outputs), total_tokens=2 + len(self.outputs))


def test_text_then_a_parsed_call_stream_as_two_items_in_order(server):
    """Under tool_choice "auto" the model's own format is parsed (hermes): the text before the
    call is a message item, closed before the call's item opens; the events name each item's
    index, and the last event's output is what a non-streamed response returns."""
    from pagedserve.cluster.serving.responses_protocol import ResponseObject, ResponsesRequest
    from pagedserve.cluster.serving.serving_chat import ServingChat
    from pagedserve.cluster.serving.serving_responses import ServingResponses, _ResponseEvents, chat_request

    request = ResponsesRequest.model_validate({"input": "Add 1 and 2.", "tools": [ADD], "stream": True})
    serving = ServingResponses(ServingChat(server))
    chat = chat_request(request)
    pieces = ["Sure", ". ", "<tool_call>\n", '{"name": "add", ', '"arguments": {"a": 1, ', '"b": 2}}\n</tool_call>']
    generation = _ScriptedGeneration(pieces, "stop")
    response = ResponseObject(id="resp_x", status="in_progress", model=MODEL, parallel_tool_calls=True,
                              text={"format": {"type": "text"}}, tool_choice="auto", tools=[ADD])
    stream = _ResponseEvents(serving, chat, request, response, generation)

    async def read():
        return [event async for batch in stream.batches(generation.outputs[0]) for event in batch]
    events = []
    for text in asyncio.run(read()):
        event_line, data_line = text.rstrip("\n").split("\n")
        events.append(json.loads(data_line[len("data: "):]))
        assert event_line == "event: " + events[-1]["type"]
    kinds = [event["type"] for event in events]
    message_done = kinds.index("response.output_item.done")
    assert kinds[:message_done + 1] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        *["response.output_text.delta"] * (kinds.count("response.output_text.delta")),
        "response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[message_done + 1] == "response.output_item.added" and kinds[-1] == "response.completed"
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    text = "".join(event["delta"] for event in events if event["type"] == "response.output_text.delta")
    assert text.strip() == "Sure."
    call_added = events[message_done + 1]
    assert call_added["output_index"] == 1 and call_added["item"]["name"] == "add"
    arguments = "".join(event["delta"] for event in events if event["type"] == "response.function_call_arguments.delta")
    assert json.loads(arguments) == {"a": 1, "b": 2}
    assert all(event["output_index"] == 1 for event in events
               if event["type"].startswith("response.function_call_arguments"))
    output = events[-1]["response"]["output"]
    assert [item["type"] for item in output] == ["message", "function_call"]
    assert output[1]["arguments"] == arguments and output[1]["status"] == "completed"
    assert output[0]["content"][0]["text"] == text and output[0]["status"] == "completed"
    whole = serving._output(chat, request, generation.outputs[-1][1].outputs[0])
    assert [(item.type, getattr(item, "arguments", None)) for item in whole] == [
        (item["type"], item.get("arguments")) for item in output]
    assert whole[0].content[0].text.strip() == text.strip()


def test_a_call_cut_off_by_the_token_limit_is_incomplete_streamed_and_not(server):
    """The parser's verdict on a call decides its status in both forms."""
    from pagedserve.cluster.serving.responses_protocol import ResponseObject, ResponsesRequest
    from pagedserve.cluster.serving.serving_chat import ServingChat
    from pagedserve.cluster.serving.serving_responses import ServingResponses, _ResponseEvents, chat_request

    request = ResponsesRequest.model_validate({"input": "Add 1 and 2.", "tools": [ADD], "stream": True})
    serving = ServingResponses(ServingChat(server))
    chat = chat_request(request)
    generation = _ScriptedGeneration(["<tool_call>\n", '{"name": "add", ', '"arguments": {"a": 1'], "length")
    response = ResponseObject(id="resp_x", status="in_progress", model=MODEL, parallel_tool_calls=True,
                              text={"format": {"type": "text"}}, tool_choice="auto", tools=[ADD])
    stream = _ResponseEvents(serving, chat, request, response, generation)

    async def read():
        return [event async for batch in stream.batches(generation.outputs[0]) for event in batch]
    last = json.loads(asyncio.run(read())[-1].split("\ndata: ", 1)[1])
    assert last["type"] == "response.incomplete"
    assert [(item["type"], item["status"]) for item in last["response"]["output"]] == [("function_call", "incomplete")]
    whole = serving._output(chat, request, generation.outputs[-1][1].outputs[0])
    assert [(item.type, item.status, item.arguments) for item in whole] == [
        ("function_call", "incomplete", last["response"]["output"][0]["arguments"])]


# ---- stored responses (server.store_responses) ---------------------------------------------------
@pytest.fixture(scope="module")
def storing(local_handle):
    """A frontend that keeps responses: room for four, and a megabyte."""
    return make_frontend(local_handle, store_responses=True, max_stored_responses=4, max_stored_response_bytes=1 << 20)


def test_a_stored_response_is_retrieved_listed_and_deleted(storing):
    response = create(storing, input=[{"role": "system", "content": "Be brief."},
                                      {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}],
                      max_output_tokens=3, temperature=0, metadata={"k": "v"})
    assert response.store is True and response.previous_response_id is None

    async def use(client):
        kept = await client.responses.retrieve(response.id)
        assert kept.model_dump() == response.model_dump()
        newest_first = await client.responses.input_items.list(response.id)
        assert [(item.role, item.content[0].text) for item in newest_first.data] == [("user", "Hi"),
                                                                                     ("system", "Be brief.")]
        assert all(item.id.startswith("msg_") and item.status == "completed" for item in newest_first.data)
        assert newest_first.first_id == newest_first.data[0].id and newest_first.has_more is False
        first = await client.responses.input_items.list(response.id, order="asc", limit=1)
        assert [item.role for item in first.data] == ["system"] and first.has_more is True
        rest = await client.responses.input_items.list(response.id, order="asc", after=first.last_id)
        assert [item.role for item in rest.data] == ["user"] and rest.has_more is False
        with pytest.raises(openai.BadRequestError) as caught:
            await client.responses.cancel(response.id)
        assert "only background responses" in caught.value.body["message"]
        await client.responses.delete(response.id)
        for ask in (client.responses.retrieve, client.responses.delete, client.responses.cancel,
                    client.responses.input_items.list):
            with pytest.raises(openai.NotFoundError) as caught:
                await ask(response.id)
            assert caught.value.body["param"] == "response_id", caught.value.body
    with_client(storing, use)
    for path, param in ((f"/v1/responses/{response.id}?include=x", "include"),
                        (f"/v1/responses/{response.id}/input_items?limit=101", "limit"),
                        (f"/v1/responses/{response.id}/input_items?order=up", "order")):
        assert assert_error(call(storing, "GET", path), 400)["param"] == param


def test_a_stream_whose_response_cannot_be_stored_ends_failed_without_a_gap(storing):
    """The store refuses the finished response: its last event never goes out, and the
    ``response.failed`` that does takes its sequence number."""
    store = storing.response_store

    async def refuse(*_, **__):
        raise ConnectionError("the store is gone")
    store.put = refuse
    try:
        events = stream_events(storing, input="Hello", max_output_tokens=4, temperature=0)
    finally:
        del store.put
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert events[-1].type == "response.failed" and events[-1].response.error.code == "store_unavailable"
    assert not any(event.type in ("response.completed", "response.incomplete") for event in events)


def test_store_false_keeps_nothing_on_a_storing_server(storing):
    response = create(storing, input="Hi", store=False, max_output_tokens=2, temperature=0)
    assert response.store is False
    assert assert_error(call(storing, "GET", f"/v1/responses/{response.id}"), 404)["param"] == "response_id"


def test_previous_response_id_continues_the_stored_conversation(storing, server):
    """The oracle: the same conversation sent whole, to a server that stores nothing. The
    earlier response's instructions are not carried over (as OpenAI's are not)."""
    first = create(storing, instructions="Answer in one word.", input="Name a colour.", max_output_tokens=5,
                   temperature=0)
    second = create(storing, previous_response_id=first.id, input="And another?", max_output_tokens=5,
                    temperature=0)
    third = create(storing, previous_response_id=second.id,
                   input=[{"role": "user", "content": "One more."}], max_output_tokens=5, temperature=0)
    assert third.previous_response_id == second.id and third.store is True
    whole = [{"role": "user", "content": "Name a colour."}, *[item.model_dump(mode="json") for item in first.output],
             {"role": "user", "content": "And another?"}, *[item.model_dump(mode="json") for item in second.output],
             {"role": "user", "content": "One more."}]
    expected = create(server, input=whole, max_output_tokens=5, temperature=0)
    assert third.output_text == expected.output_text
    assert third.usage.input_tokens == expected.usage.input_tokens > second.usage.input_tokens

    # Only the response's own input is listed.
    async def use(client):
        return (await client.responses.input_items.list(third.id)).data
    assert [item.content[0].text for item in with_client(storing, use)] == ["One more."]

    # Streamed, the same continuation; the stored copy is the stream's last event's response.
    events = stream_events(storing, previous_response_id=second.id, input="One more.", max_output_tokens=5,
                           temperature=0)
    final = events[-1].response
    assert final.output_text == expected.output_text and final.previous_response_id == second.id

    async def kept(client):
        return await client.responses.retrieve(final.id)
    assert with_client(storing, kept).model_dump() == final.model_dump()


def test_a_conversation_whose_earlier_response_is_gone_says_which(storing):
    first = create(storing, input="Hi", max_output_tokens=2, temperature=0)
    second = create(storing, previous_response_id=first.id, input="Again", max_output_tokens=2, temperature=0)
    assert call(storing, "DELETE", f"/v1/responses/{first.id}").status_code == 200
    error = assert_error(call(storing, "POST", "/v1/responses", json={
        "model": MODEL, "previous_response_id": second.id, "input": "More", "max_output_tokens": 2}), 404)
    assert error["param"] == "previous_response_id" and first.id in error["message"], error
    error = assert_error(call(storing, "POST", "/v1/responses", json={
        "model": MODEL, "previous_response_id": "resp_unknown", "input": "More"}), 404)
    assert error["param"] == "previous_response_id" and "resp_unknown" in error["message"], error


def test_item_references_are_the_stored_items_they_name(storing, server):
    """An ``item_reference`` (its ``type`` may be left out) is the stored input or output item of
    that id, in its place: the oracle is the same items sent whole to a server that stores
    nothing. The new response lists the resolved items as its own input."""
    first = create(storing, input=[{"role": "user", "content": "Name a colour."}], max_output_tokens=5,
                   temperature=0)

    async def listed(client):
        return (await client.responses.input_items.list(first.id)).data
    question = with_client(storing, listed)[0]
    answer = first.output[0]
    body = dict(max_output_tokens=5, temperature=0)
    referenced = create(storing, input=[{"type": "item_reference", "id": question.id}, {"id": answer.id},
                                        {"role": "user", "content": "And another?"}], **body)
    whole = create(server, input=[{"role": "user", "content": "Name a colour."}, answer.model_dump(mode="json"),
                                  {"role": "user", "content": "And another?"}], **body)
    assert referenced.output_text == whole.output_text
    assert referenced.usage.input_tokens == whole.usage.input_tokens

    async def own(client):
        return (await client.responses.input_items.list(referenced.id, order="asc")).data
    items = with_client(storing, own)
    assert [item.id for item in items[:2]] == [question.id, answer.id]
    assert [part.text for item in items for part in item.content] == [
        "Name a colour.", answer.content[0].text, "And another?"]

    # Streamed, and after the previous response's conversation, the same.
    events = stream_events(storing, previous_response_id=first.id, input=[{"id": answer.id}], **body)
    again = create(server, input=[{"role": "user", "content": "Name a colour."}, answer.model_dump(mode="json"),
                                  answer.model_dump(mode="json")], **body)
    assert events[-1].response.output_text == again.output_text

    # A reference to no stored item is a 404 naming it; nothing runs.
    error = assert_error(call(storing, "POST", "/v1/responses", json={
        "model": MODEL, "input": [{"role": "user", "content": "Hi"}, {"type": "item_reference", "id": "msg_gone"}]}),
        404)
    assert error["param"] == "input" and "msg_gone" in error["message"] and "input[1]" in error["message"], error
    # The answer is held as input by the later responses too: it is found until none holds it.
    only_answer = {"model": MODEL, "input": [{"type": "item_reference", "id": answer.id}], "max_output_tokens": 1,
                   "store": False}
    for holder in (first.id, referenced.id):
        assert call(storing, "DELETE", f"/v1/responses/{holder}").status_code == 200
        assert call(storing, "POST", "/v1/responses", json=only_answer).status_code == 200
    assert call(storing, "DELETE", f"/v1/responses/{events[-1].response.id}").status_code == 200
    error = assert_error(call(storing, "POST", "/v1/responses", json=only_answer), 404)
    assert answer.id in error["message"], error


def test_the_store_forgets_the_least_recently_used_beyond_its_room(storing):
    ids = [create(storing, input=f"Hi {n}", max_output_tokens=1, temperature=0).id for n in range(4)]
    assert call(storing, "GET", f"/v1/responses/{ids[0]}").status_code == 200   # now the most recent
    create(storing, input="Hi 4", max_output_tokens=1, temperature=0)
    assert [call(storing, "GET", f"/v1/responses/{i}").status_code for i in ids] == [200, 404, 200, 200]
    figures = call(storing, "GET", "/stats").json()["server"]["responses"]
    assert figures["num_stored"] == figures["max_responses"] == 4 and figures["num_evicted"] >= 1, figures
    assert 0 < figures["num_bytes"] < figures["max_bytes"] == 1 << 20, figures
    assert figures["num_running"] == figures["num_background_here"] == 0, figures


# ---- background responses ------------------------------------------------------------------------
async def _until_finished(client, response_id: str, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while True:
        response = await client.responses.retrieve(response_id)
        if response.status not in ("queued", "in_progress") or time.monotonic() > deadline:
            return response
        await asyncio.sleep(0.05)


def test_a_background_response_is_in_progress_then_polled_to_what_the_foreground_makes(storing, server):
    body = dict(input="Tell me about paging.", max_output_tokens=12, temperature=0)
    foreground = create(server, **body)

    async def use(client):
        started = await client.responses.create(model=MODEL, background=True, **body)
        assert started.status == "in_progress" and started.background is True and started.output == []
        return await _until_finished(client, started.id)
    done = with_client(storing, use)
    assert done.status == foreground.status and done.background is True
    assert (done.output_text, done.usage.output_tokens) == (foreground.output_text, foreground.usage.output_tokens)


def test_a_cancelled_background_response_stops_and_says_cancelled_on_every_ask(storing):
    async def use(client):
        queued = await client.responses.create(model=MODEL, background=True, input="Go on forever.",
                                               max_output_tokens=1500, temperature=0)
        cancelled = await client.responses.cancel(queued.id)
        again = await client.responses.cancel(queued.id)   # idempotent: the response as it stands
        kept = await client.responses.retrieve(queued.id)
        deadline = time.monotonic() + 10
        while storing.background_runs.tasks and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return cancelled, again, kept, dict(storing.background_runs.tasks)
    cancelled, again, kept, running = with_client(storing, use)
    assert cancelled.status == again.status == kept.status == "cancelled" and running == {}
    # the engine is idle after it (the idle_after fixture): the generation was aborted


def test_a_background_response_is_cancelled_through_another_replica(local_handle):
    """Two frontends over one handle share the store, as the cluster's replicas do: a cancel
    taken by one reaches the one that runs the response at its next lease renewal."""
    from pagedserve.cluster.serving.http_app import build_app

    runner = make_frontend(local_handle, store_responses=True)
    other = make_frontend(local_handle, store_responses=True)

    async def run():
        clients = []
        for frontend in (runner, other):
            http_client = httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(frontend)),
                                            base_url="http://test/v1")
            clients.append(openai.AsyncOpenAI(base_url="http://test/v1", api_key="unused",
                                              http_client=http_client, max_retries=0))
        queued = await clients[0].responses.create(model=MODEL, background=True, input="Go on forever.",
                                                   max_output_tokens=1500, temperature=0)
        assert queued.id in runner.background_runs.tasks
        cancelled = await clients[1].responses.cancel(queued.id)
        assert cancelled.status == "cancelled" and queued.id in runner.background_runs.tasks
        deadline = time.monotonic() + 10
        while runner.background_runs.tasks and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert not runner.background_runs.tasks, "the runner did not learn of the cancel"
        assert (await clients[0].responses.retrieve(queued.id)).status == "cancelled"
        deadline = time.monotonic() + 10
        while local_handle.has_streams() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
    asyncio.run(run())


def test_a_background_response_must_be_stored(storing):
    error = assert_error(call(storing, "POST", "/v1/responses", json={
        "model": MODEL, "input": "Hi", "background": True, "store": False}), 400)
    assert error["param"] == "store" and "must be stored" in error["message"], error


# ---- streamed background responses ---------------------------------------------------------------
def _serving(frontend):
    from pagedserve.cluster.serving.serving_chat import ServingChat
    from pagedserve.cluster.serving.serving_responses import ServingResponses

    return ServingResponses(ServingChat(frontend))


def _parsed(batches: list[list[str]]) -> list[dict]:
    """The JSON of each server-sent event in ``batches``."""
    return [json.loads(line[len("data: "):]) for batch in batches for event in batch
            for line in event.splitlines() if line.startswith("data: ")]


def test_a_streamed_background_response_is_streamed_again_from_any_event(storing, server):
    """``background`` with ``stream``: the foreground stream's events, with ``background`` set;
    ``GET ...?stream=true`` gives them again, and with ``starting_after=n`` those after n."""
    body = dict(input="Tell me about paging.", max_output_tokens=16, temperature=0)
    foreground = stream_events(server, **body)

    async def use(client):
        streamed = [event async for event in await client.responses.create(model=MODEL, background=True,
                                                                           stream=True, **body)]
        response_id = streamed[0].response.id
        whole = [event async for event in await client.responses.retrieve(response_id, stream=True)]
        rest = [event async for event in await client.responses.retrieve(response_id, stream=True,
                                                                          starting_after=4)]
        return streamed, whole, rest, await client.responses.retrieve(response_id)
    streamed, whole, rest, kept = with_client(storing, use)
    assert [event.type for event in streamed] == [event.type for event in foreground]
    assert [event.sequence_number for event in streamed] == list(range(len(streamed)))
    assert streamed[0].response.background is True and streamed[0].response.status == "in_progress"
    final = streamed[-1].response
    assert final.output_text == foreground[-1].response.output_text and final.status == kept.status
    assert kept.model_dump() == final.model_dump()
    assert [event.model_dump() for event in whole] == [event.model_dump() for event in streamed]
    assert [event.model_dump() for event in rest] == [event.model_dump() for event in streamed[5:]]


def test_a_streamed_background_response_runs_on_when_its_client_leaves(storing):
    from pagedserve.cluster.serving.responses_protocol import ResponsesRequest

    serving = _serving(storing)

    async def run():
        request = ResponsesRequest.model_validate(dict(model=MODEL, input="Tell me about paging.", background=True,
                                                       stream=True, max_output_tokens=24, temperature=0))
        stream = await serving.create_response(request)
        batches = stream.batches(True)
        seen = [await anext(batches)]
        await stream.aclose()   # the client left after its first events
        response_id = _parsed(seen)[0]["response"]["id"]
        assert response_id in storing.background_runs.tasks
        deadline = time.monotonic() + 60
        while storing.background_runs.tasks and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        rest = [batch async for batch in (await serving.stream_stored(response_id, len(_parsed(seen)) - 1)
                                          ).batches(True)]
        return _parsed(seen), _parsed(rest), (await serving.retrieve(response_id)).response
    seen, rest, kept = asyncio.run(run())
    events = seen + rest
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    assert events[-1]["type"] in ("response.completed", "response.incomplete") and events[-1]["response"] == kept
    assert kept["usage"]["output_tokens"] > 1


def test_another_replica_streams_a_background_response_from_the_store(local_handle):
    """A replica that does not run the response reads its events from the store, which the
    runner sends them to while it runs; cancelled through that replica, the stream ends."""
    runner, other = make_frontend(local_handle, store_responses=True), make_frontend(local_handle, store_responses=True)
    from pagedserve.cluster.serving.responses_protocol import ResponsesRequest

    async def run():
        request = ResponsesRequest.model_validate(dict(model=MODEL, input="Go on forever.", background=True,
                                                       stream=True, max_output_tokens=1500, temperature=0))
        own = (await _serving(runner).create_response(request)).batches(True)
        response_id = _parsed([await anext(own)])[0]["response"]["id"]
        reading = (await _serving(other).stream_stored(response_id, None)).batches(True)
        batches = []
        while sum(event["type"] == "response.output_text.delta" for event in _parsed(batches)) < 5:
            # deltas, sent on to the store by the runner while it runs
            batches.append(await anext(reading))
        assert response_id in runner.background_runs.tasks and not other.background_runs.logs
        cancelled = await _serving(other).cancel(response_id)
        assert cancelled["status"] == "cancelled"
        batches += [batch async for batch in reading]   # ends once the store says cancelled
        await own.aclose()
        deadline = time.monotonic() + 10
        while (runner.background_runs.tasks or local_handle.has_streams()) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert not runner.background_runs.tasks
        return _parsed(batches)
    events = asyncio.run(run())
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    assert events[0]["type"] == "response.created"
    assert sum(event["type"] == "response.output_text.delta" for event in events) >= 5


def test_a_streamed_background_response_that_fails_ends_with_response_failed_and_is_failed(storing, local_handle):
    from pagedserve.cluster.request_flow import StreamNotResumable

    local_handle.fail_after_first = StreamNotResumable("the worker failed; the stream cannot be continued")

    async def use(client):
        streamed = [event async for event in await client.responses.create(
            model=MODEL, input="Hello", max_output_tokens=20, temperature=0, background=True, stream=True)]
        response_id = streamed[0].response.id
        kept = await _until_finished(client, response_id)
        again = [event async for event in await client.responses.retrieve(response_id, stream=True)]
        return streamed, kept, again
    try:
        streamed, kept, again = with_client(storing, use)
    finally:
        local_handle.fail_after_first = None
    assert streamed[-1].type == "response.failed" and streamed[-1].response.error.code == "worker_failed"
    assert [event.sequence_number for event in streamed] == list(range(len(streamed)))
    assert kept.status == "failed" and kept.error.code == "worker_failed"
    assert "cannot be continued" in kept.error.message
    assert streamed[-1].response.model_dump() == kept.model_dump()
    assert [event.model_dump() for event in again] == [event.model_dump() for event in streamed]


def test_what_cannot_be_streamed_on_retrieve_is_a_4xx_naming_the_parameter(storing):
    stored = create(storing, input="Hi", max_output_tokens=2, temperature=0)

    async def background(client):
        started = await client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, temperature=0,
                                                background=True)
        return await _until_finished(client, started.id)
    polled = with_client(storing, background)
    for path, status, param in ((f"/v1/responses/{stored.id}?stream=true", 400, "stream"),
                                (f"/v1/responses/{polled.id}?stream=true", 400, "stream"),
                                (f"/v1/responses/{stored.id}?starting_after=2", 400, "starting_after"),
                                (f"/v1/responses/{stored.id}?stream=maybe", 400, "stream"),
                                (f"/v1/responses/{stored.id}?stream=true&starting_after=-1", 400, "starting_after"),
                                ("/v1/responses/resp_gone?stream=true", 404, "response_id")):
        assert assert_error(call(storing, "GET", path), status)["param"] == param, path
