"""A stream's chunks as JSON text (``cluster/serving/chunks.py``) are the response models' JSON,
byte for byte.

Each encoder pair is called with the same arguments, drawn by hypothesis (arbitrary Unicode
text with quotes, backslashes, control characters and emoji; every finish reason and stop
reason kind; token ids; indexes of n > 1 and batches; logprobs, tool calls, usage), and the
JSON encoder's text must equal the models encoder's ``model_dump_json()``. Then whole
streams (``test_chunk_json_streams``): a scripted generation through the HTTP app, whose SSE
body must equal the models' chunks framed as events, batched one write per output.
"""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from local_frontend import ScriptedHandle

from pagedserve.cluster.serving.chunks import (ChatChunkJSON, ChatChunkModels, CompletionChunkJSON,
                                               CompletionChunkModels)
from pagedserve.cluster.serving.protocol import (ChoiceLogprobs, CompletionLogprobs, DeltaFunctionCall,
                                                 DeltaToolCall, PromptLogprob, PromptTokensDetails,
                                                 TokenLogprob, TopLogprob, Usage)

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))

# Every character kind JSON escapes or passes through: quotes, backslashes, control
# characters (C0 and C1), line and paragraph separators, BOM, astral (emoji). Lone surrogates
# never reach a chunk: output text is the tokenizer's (valid Unicode) and text from the client
# is refused with one (``check_unicode``); ``test_a_lone_surrogate_fails_both_ways`` shows both.
SPECIAL = "\"\\/\b\f\n\r\t\x00\x01\x1f\x7f\x80\x9f\u2028\u2029\ufeff\U0001F600\u00e9\u4e2d"
texts = st.text(alphabet=st.characters(codec="utf-8") | st.sampled_from(SPECIAL), max_size=12)
token_ids = st.lists(st.integers(0, 2**31 - 1), max_size=5)
finish_reasons = st.none() | st.sampled_from(["stop", "length", "abort", "tool_calls"]) | texts
stop_reasons = st.none() | st.integers(0, 2**31 - 1) | texts
logprob_values = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([0.0, -0.0, -1e-300, -1e300])
usages = st.none() | st.builds(Usage, prompt_tokens=st.integers(0, 10**6), completion_tokens=st.integers(0, 10**6),
                               total_tokens=st.integers(0, 2 * 10**6),
                               prompt_tokens_details=st.builds(PromptTokensDetails,
                                                               cached_tokens=st.integers(0, 10**6)))
prompt_logprobs = st.none() | st.lists(st.none() | st.dictionaries(
    st.integers(0, 10**5).map(str),
    st.builds(PromptLogprob, logprob=logprob_values, rank=st.none() | st.integers(1, 20), decoded_token=texts),
    max_size=3), max_size=4)
completion_logprobs = st.none() | st.builds(
    CompletionLogprobs, text_offset=st.lists(st.integers(0, 10**6), max_size=3),
    token_logprobs=st.lists(st.none() | logprob_values, max_size=3), tokens=st.lists(texts, max_size=3),
    top_logprobs=st.lists(st.none() | st.dictionaries(texts, logprob_values, max_size=3), max_size=3))
top_logprobs = st.builds(TopLogprob, token=texts, logprob=logprob_values,
                         bytes=st.none() | st.lists(st.integers(0, 255), max_size=4))
chat_logprobs = st.none() | st.builds(ChoiceLogprobs, content=st.none() | st.lists(st.builds(
    TokenLogprob, token=texts, logprob=logprob_values, bytes=st.none() | st.lists(st.integers(0, 255), max_size=4),
    top_logprobs=st.lists(top_logprobs, max_size=2)), max_size=3))
tool_calls = st.none() | st.lists(st.builds(
    DeltaToolCall, index=st.integers(0, 5), id=st.none() | texts, type=st.none() | st.just("function"),
    function=st.none() | st.builds(DeltaFunctionCall, name=st.none() | texts, arguments=st.none() | texts)),
    max_size=3)
heads = st.tuples(texts, st.integers(0, 2**40), texts)  # request id, created, model


@SETTINGS
@given(head=heads, index=st.integers(0, 2**31 - 1), text=texts, finish_reason=finish_reasons,
       stop_reason=stop_reasons, logprobs=completion_logprobs, prompt_logprobs=prompt_logprobs,
       token_ids=st.none() | token_ids, prompt_token_ids=st.none() | token_ids, usage=usages)
def test_completion_chunks(head, index, text, finish_reason, stop_reason, logprobs, prompt_logprobs, token_ids,
                           prompt_token_ids, usage):
    fields = dict(logprobs=logprobs, prompt_logprobs=prompt_logprobs, token_ids=token_ids,
                  prompt_token_ids=prompt_token_ids, usage=usage)
    model = CompletionChunkModels(*head).choice(index, text, finish_reason, stop_reason, **fields)
    assert CompletionChunkJSON(*head).choice(index, text, finish_reason, stop_reason, **fields) == \
        model.model_dump_json()


@SETTINGS
@given(head=heads, index=st.integers(0, 2**31 - 1), content=st.none() | texts,
       role=st.none() | st.just("assistant"), tool_calls=tool_calls, logprobs=chat_logprobs,
       finish_reason=finish_reasons, stop_reason=stop_reasons, token_ids=st.none() | token_ids, usage=usages,
       prompt_logprobs=prompt_logprobs, prompt_token_ids=st.none() | token_ids, reasoning=st.none() | texts)
def test_chat_chunks(head, index, content, role, tool_calls, logprobs, finish_reason, stop_reason, token_ids, usage,
                     prompt_logprobs, prompt_token_ids, reasoning):
    fields = dict(role=role, tool_calls=tool_calls, logprobs=logprobs, finish_reason=finish_reason,
                  stop_reason=stop_reason, token_ids=token_ids, usage=usage, prompt_logprobs=prompt_logprobs,
                  prompt_token_ids=prompt_token_ids, reasoning=reasoning)
    model = ChatChunkModels(*head).choice(index, content, **fields)
    assert ChatChunkJSON(*head).choice(index, content, **fields) == model.model_dump_json()


@SETTINGS
@given(head=heads, usage=usages.filter(lambda usage: usage is not None))
def test_usage_chunks(head, usage):
    assert CompletionChunkJSON(*head).usage(usage) == CompletionChunkModels(*head).usage(usage).model_dump_json()
    assert ChatChunkJSON(*head).usage(usage) == ChatChunkModels(*head).usage(usage).model_dump_json()


def test_the_common_chunks_are_the_documented_shapes():
    """A content chunk of each API, written out: what a client parses."""
    head = ("cmpl-1", 1764370000, "m")
    assert CompletionChunkJSON(*head).choice(0, ' say "hi"\n') == (
        '{"id":"cmpl-1","object":"text_completion","created":1764370000,"model":"m","choices":[{"index":0,'
        '"text":" say \\"hi\\"\\n","logprobs":null,"finish_reason":null,"stop_reason":null,"prompt_logprobs":null}],'
        '"usage":null}')
    assert ChatChunkJSON(*head).choice(1, "\u00e9", token_ids=[7]) == (
        '{"id":"cmpl-1","object":"chat.completion.chunk","created":1764370000,"model":"m","choices":[{"index":1,'
        '"delta":{"content":"\u00e9"},"logprobs":null,"finish_reason":null,"stop_reason":null,"token_ids":[7]}],'
        '"usage":null}')


def test_a_lone_surrogate_fails_both_ways():
    head = ("cmpl-1", 1, "m")
    with pytest.raises(ValueError):
        CompletionChunkModels(*head).choice(0, "a\ud800").model_dump_json()
    with pytest.raises(UnicodeEncodeError):
        CompletionChunkJSON(*head).choice(0, "a\ud800").encode()


# ---- whole streams through the HTTP app ------------------------------------------------------
@pytest.fixture(scope="module")
def scripted(tiny_model):
    from transformers import AutoTokenizer

    from pagedserve.cluster.config import ServerConfig
    from pagedserve.cluster.serving.frontend import Frontend
    from pagedserve.cluster.serving.http_app import build_app

    path = tiny_model("llama")
    handle = ScriptedHandle(path, AutoTokenizer.from_pretrained(path))
    frontend = Frontend(handle, ServerConfig())
    return handle, frontend, build_app(frontend)


async def _sse_writes(app, path: str, body: dict) -> list[bytes]:
    """The bodies of ``app``'s answer to one POST, one per ASGI ``send``, as a server gets them."""
    import json

    raw = json.dumps(body).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json")], "client": ("127.0.0.1", 1),
             "server": ("127.0.0.1", 8000)}
    messages = [{"type": "http.request", "body": raw, "more_body": False}]
    writes = []

    async def receive():
        if messages:
            return messages.pop()
        await asyncio.Event().wait()  # the client stays

    async def send(message):
        if message["type"] == "http.response.start":
            assert message["status"] == 200
        elif message.get("body"):
            writes.append(message["body"])

    await app(scope, receive, send)
    return writes


async def _model_batches(frontend, path: str, body: dict) -> list[list]:
    """The same request's chunks as models, one list per output (what gRPC reads)."""
    from pagedserve.cluster.serving.protocol import ChatCompletionRequest, CompletionRequest
    from pagedserve.cluster.serving.serving_chat import ServingChat
    from pagedserve.cluster.serving.serving_completion import ServingCompletion

    if path == "/v1/chat/completions":
        stream = await ServingChat(frontend).create_chat_completion(ChatCompletionRequest.model_validate(body))
    else:
        stream = await ServingCompletion(frontend).create_completion(CompletionRequest.model_validate(body))
    try:
        return [batch async for batch in stream.batches()]
    finally:
        await stream.aclose()


steps = st.lists(st.tuples(texts, st.lists(st.integers(2, 200), max_size=2)), min_size=1, max_size=4)
samples = st.tuples(steps, st.sampled_from(["stop", "length", "abort"]), stop_reasons)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(script=st.lists(samples, min_size=1, max_size=3), api=st.sampled_from(["completions", "chat"]),
       num_prompts=st.integers(1, 2), options=st.fixed_dictionaries({
           "return_token_ids": st.booleans(), "include_usage": st.booleans(), "continuous_usage": st.booleans(),
           "logprobs": st.booleans(), "echo": st.booleans()}))
def test_chunk_json_streams(scripted, script, api, num_prompts, options):
    """The SSE body of a scripted stream is its chunk models' JSON as events, the chunks of each
    output in one write, then ``[DONE]``; every finish and stop reason, n up to 3, a batch of
    prompts, token ids, usage (last or on every chunk), logprobs, echo."""
    import re

    handle, frontend, app = scripted
    handle.script = script
    body = {"stream": True, "n": len(script), "max_tokens": 50, "request_id": "req-1",
            "return_token_ids": options["return_token_ids"],
            "stream_options": {"include_usage": options["include_usage"],
                               "continuous_usage_stats": options["continuous_usage"]}}
    if api == "chat":
        path = "/v1/chat/completions"
        body.update(messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Well,"}],
                    logprobs=options["logprobs"], echo=options["echo"], add_generation_prompt=False)
    else:
        path = "/v1/completions"
        body.update(prompt="Hi" if num_prompts == 1 else ["Hi", "Yo"], echo=options["echo"])
        if options["logprobs"] and not options["echo"]:  # with echo, the prompt's logprobs come first
            body["logprobs"] = 1
    writes = asyncio.run(_sse_writes(app, path, body))
    batches = asyncio.run(_model_batches(frontend, path, body))
    expected = ["".join(f"data: {chunk.model_dump_json()}\n\n" for chunk in batch).encode() for batch in batches]
    expected.append(b"data: [DONE]\n\n")

    def same_clock(data: bytes) -> bytes:  # the two runs may straddle a second
        return re.sub(rb'"created":\d+', b'"created":0', data)
    assert [same_clock(w) for w in writes] == [same_clock(e) for e in expected]
    assert frontend.limiter.num_in_flight == 0
