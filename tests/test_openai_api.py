"""The OpenAI-compatible API without Ray: the ``Frontend``'s FastAPI app over an
in-process engine, driven through httpx's ASGI transport. Error shapes and
statuses, limits, auth, SSE framing, usage and metrics; the live Ray Serve
deployment is covered by ``test_server.py``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import pickle
import re
import time
import uuid

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from local_frontend import MODEL, LocalHandle, assert_idle, call  # noqa: E402
from local_frontend import assert_error as _assert_error  # noqa: E402
from local_frontend import events as _events  # noqa: E402
from local_frontend import make_frontend as _server  # noqa: E402

import pagedserve  # noqa: E402
from pagedserve.cluster.handle import NoCapacityError  # noqa: E402
from pagedserve.cluster.serving.auth import check_api_key, client_key  # noqa: E402
from pagedserve.cluster.serving.limits import ClientLimiter, RequestLimiter  # noqa: E402

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def local_handle(tiny_model):
    handle = LocalHandle(tiny_model("llama"))
    yield handle
    handle.engine.shutdown()


@pytest.fixture(scope="module")
def server(local_handle):
    return _server(local_handle)


@pytest.fixture(autouse=True)
def idle_after(local_handle):
    yield
    local_handle.stall_s = 0.0
    assert_idle(local_handle)


# ---- happy paths ---------------------------------------------------------------------------------
def test_completion_usage_and_greedy_determinism(server, local_handle):
    body = {"model": MODEL, "prompt": "The paged KV cache splits sequences into blocks. " * 4,
            "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    first = call(server, "POST", "/v1/completions", json=body)
    assert first.status_code == 200, first.text
    data = first.json()
    assert data["object"] == "text_completion" and data["model"] == MODEL
    assert data["choices"][0]["finish_reason"] == "length"
    usage = data["usage"]
    num_prompt = len(local_handle.tokenizer.encode(body["prompt"]))
    assert usage["prompt_tokens"] == num_prompt and usage["completion_tokens"] == 8
    assert usage["total_tokens"] == num_prompt + 8
    second = call(server, "POST", "/v1/completions", json=body).json()
    assert second["choices"][0]["text"] == data["choices"][0]["text"]
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the prefix cache hit
    assert local_handle.num_used_blocks() == 0


def test_completion_batch_n_logprobs_echo(server):
    body = {"prompt": ["Once upon a time", "Hello"], "n": 2, "max_tokens": 4, "seed": 3, "logprobs": 2,
            "echo": True, "ignore_eos": True}
    data = call(server, "POST", "/v1/completions", json=body).json()
    choices = data["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert choices[2]["text"].startswith("Hello")
    for choice, prompt in zip(choices, [body["prompt"][0]] * 2 + [body["prompt"][1]] * 2):
        # Echo: the prompt's tokens first (the first without a logprob), then the 4 generated.
        logprobs = choice["logprobs"]
        num_prompt = len(server.tokenizer.encode(prompt))
        assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == num_prompt + 4
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        assert all(len(top) <= 3 for top in logprobs["top_logprobs"][1:])  # top 2 and the chosen token
        assert logprobs["text_offset"] == sorted(logprobs["text_offset"])
    assert data["usage"]["completion_tokens"] == 16


def test_completion_stream(server):
    body = {"prompt": "Once upon", "max_tokens": 6, "stream": True, "n": 2, "temperature": 0.8, "seed": 1,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    response = call(server, "POST", "/v1/completions", json=body)
    assert response.headers["content-type"].startswith("text/event-stream")
    events = _events(response)
    texts = {0: "", 1: ""}
    finishes = {}
    for event in events[:-1]:
        for choice in event["choices"]:
            texts[choice["index"]] += choice["text"]
            if choice["finish_reason"]:
                finishes[choice["index"]] = choice["finish_reason"]
    assert finishes == {0: "length", 1: "length"}
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 12


def test_chat_and_chat_stream(server):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    data = call(server, "POST", "/v1/chat/completions",
                json={"messages": messages, "max_tokens": 5, "temperature": 0, "logprobs": True,
                      "top_logprobs": 1}).json()
    assert data["object"] == "chat.completion"
    choice = data["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert len(choice["logprobs"]["content"]) == data["usage"]["completion_tokens"]
    events = _events(call(server, "POST", "/v1/chat/completions",
                          json={"messages": messages, "max_tokens": 5, "temperature": 0, "stream": True}))
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events)
    assert text == choice["message"]["content"]
    assert events[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_models_health_metrics(server):
    models = call(server, "GET", "/v1/models").json()
    assert models["data"][0]["id"] == MODEL
    _assert_error(call(server, "GET", "/v1/models/other"), 404)
    assert call(server, "GET", "/health").json()["status"] == "ok"
    for method in ("GET", "POST"):   # vLLM's /ping: /health by another name
        assert call(server, method, "/ping").json() == call(server, "GET", "/health").json()
    assert call(server, "GET", "/version").json() == {"version": pagedserve.__version__}
    text = call(server, "GET", "/metrics").text
    for name in ("pagedserve_num_requests_running", "pagedserve_num_requests_waiting",
                 "pagedserve_kv_cache_usage_ratio", "pagedserve_kv_slots_filled_ratio", "pagedserve_prefix_cache_hit_rate",
                 "pagedserve_preemptions_total", "pagedserve_swapped_blocks_total",
                 "pagedserve_time_to_first_token_seconds_bucket",
                 "pagedserve_time_per_output_token_seconds_bucket",
                 "pagedserve_e2e_request_latency_seconds_bucket"):
        assert name in text, name


# ---- errors --------------------------------------------------------------------------------------
def test_malformed_and_invalid_requests_are_400(server):
    post = lambda **kw: call(server, "POST", "/v1/completions", **kw)  # noqa: E731
    assert "JSON" in _assert_error(post(content=b"{not json"), 400)["message"]
    _assert_error(post(json=[1, 2]), 400)
    _assert_error(post(json={"max_tokens": 3}), 400, "prompt")
    _assert_error(post(json={"prompt": "x", "temprature": 0.5}), 400, "temprature")
    _assert_error(post(json={"prompt": "x", "temperature": "hot"}), 400, "temperature")
    _assert_error(post(json={"prompt": "x", "top_p": 0}), 400, "top_p")
    _assert_error(post(json={"prompt": "x", "max_tokens": 0}), 400, "max_tokens")
    _assert_error(post(json={"prompt": []}), 400, "prompt")
    _assert_error(post(json={"prompt": [[]]}), 400, "prompt")
    _assert_error(post(json={"prompt": [999999]}), 400, "prompt")
    _assert_error(post(json={"prompt": "x", "n": 17}), 400, "n")
    _assert_error(post(json={"prompt": "x", "stop": [str(i) for i in range(17)]}), 400, "stop")
    _assert_error(call(server, "POST", "/v1/chat/completions", json={"messages": []}), 400, "messages")
    _assert_error(call(server, "POST", "/v1/chat/completions",
                       json={"messages": [{"role": "robot", "content": "x"}]}), 400)


def test_prompt_too_long_names_the_limit(server):
    too_long = {"prompt": [5] * server.max_model_len}
    error = _assert_error(call(server, "POST", "/v1/completions", json=too_long), 400, "prompt")
    assert str(server.max_model_len) in error["message"]
    assert error["code"] == "context_length_exceeded"


def test_an_unreadable_dynamic_adapter_path_is_a_503_naming_it(server, monkeypatch):
    """A name looked up in a ``dynamic_lora_loading_path`` that cannot be read now (a hub or
    bucket that does not answer) is not an unknown model: 503, saying why."""
    from pagedserve.cluster.lora_adapters import LoRAAdapters
    from pagedserve.workers.lora.adapter_source import AdapterSourceError

    adapters = LoRAAdapters([], "memory://adapters")

    def unreadable(name: str):
        raise AdapterSourceError("dynamic_lora_loading_path 'memory://adapters' cannot be read (TimeoutError: )")

    monkeypatch.setattr(adapters.dynamic, "lora_path", unreadable)
    monkeypatch.setattr(server, "adapters", adapters)
    error = _assert_error(call(server, "POST", "/v1/completions", json={"model": "sql", "prompt": "x"}), 503, "model")
    assert error["code"] == "adapter_source_unavailable"
    assert error["message"] == ("model 'sql': dynamic_lora_loading_path 'memory://adapters' cannot be read "
                                "(TimeoutError: )")


def test_unknown_model_404_and_unknown_route(server):
    error = _assert_error(call(server, "POST", "/v1/completions", json={"model": "gpt-9", "prompt": "x"}),
                          404, "model")
    assert error["code"] == "model_not_found"
    # Both conventions' words: Ray Serve LLM's clients look for "Could not find", vLLM's for its sentence.
    assert error["message"] == (f"Could not find model 'gpt-9': the model `gpt-9` does not exist; this server "
                                f"serves '{MODEL}'")
    assert call(server, "GET", "/v1/models/gpt-9").json()["error"]["message"] == error["message"]
    _assert_error(call(server, "GET", "/v1/nothing"), 404)


def test_body_limit_413(local_handle):
    small = _server(local_handle, limits={"max_request_body_bytes": 1024})
    _assert_error(call(small, "POST", "/v1/completions", json={"prompt": "x" * 2000}), 413)


def test_full_queue_429_with_retry_after(local_handle):
    busy = _server(local_handle, limits={"max_queued_requests": 1})
    busy.limiter.acquire()  # one request in flight
    response = call(busy, "POST", "/v1/completions", json={"prompt": "x"})
    _assert_error(response, 429)
    assert int(response.headers["retry-after"]) >= 1
    busy.limiter.release()
    assert call(busy, "POST", "/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200
    assert busy.limiter.num_in_flight == 0
    # A batch takes one slot per prompt; one larger than the limit could never run: a 400, not a 429.
    busy.limiter.acquire()
    _assert_error(call(busy, "POST", "/v1/completions", json={"prompt": ["a"]}), 429)
    busy.limiter.release()
    _assert_error(call(busy, "POST", "/v1/completions", json={"prompt": ["a", "b"]}), 400, "prompt")


def test_no_capacity_is_503(server, local_handle):
    local_handle.fail_with = NoCapacityError("every worker is down")
    try:
        _assert_error(call(server, "POST", "/v1/completions", json={"prompt": "x"}), 503)
        _assert_error(call(server, "POST", "/v1/completions", json={"prompt": "x", "stream": True}), 503)
    finally:
        local_handle.fail_with = None
    assert server.limiter.num_in_flight == 0


def test_api_key(local_handle):
    secured = _server(local_handle, api_key="sekrit")
    for method, path in (("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/v1/completions")):
        _assert_error(call(secured, method, path, json={"prompt": "x"}), 401)
        _assert_error(call(secured, method, path, json={"prompt": "x"},
                           headers={"Authorization": "Bearer wrong"}), 401)
    assert call(secured, "GET", "/health").status_code == 200
    ok = call(secured, "GET", "/v1/models", headers={"Authorization": "Bearer sekrit"})
    assert ok.status_code == 200


def test_api_key_from_environment(local_handle, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_API_KEY", "from-env")
    secured = _server(local_handle)
    _assert_error(call(secured, "GET", "/v1/models"), 401)
    assert call(secured, "GET", "/v1/models", headers={"Authorization": "Bearer from-env"}).status_code == 200


def test_check_api_key_and_limiter_units():
    check_api_key(None, None)
    check_api_key("k", "Bearer k")
    check_api_key("k", "bearer k")
    for header in (None, "", "k", "Bearer", "Bearer kk", "Basic k"):
        with pytest.raises(Exception) as info:
            check_api_key("k", header)
        assert info.value.status == 401
    limiter = RequestLimiter(2)
    limiter.acquire()
    limiter.acquire()
    with pytest.raises(Exception) as info:
        limiter.acquire()
    assert info.value.status == 429 and "Retry-After" in info.value.headers


# ---- gRPC translation (no network) ---------------------------------------------------------------
class _GrpcContext:
    def __init__(self, metadata=()) -> None:
        self.metadata = list(metadata)
        self.code = self.details = None

    def invocation_metadata(self):
        return self.metadata

    def set_code(self, code):
        self.code = code

    def set_details(self, details):
        self.details = details


def test_grpc_service_translation(server, local_handle):
    import grpc

    from pagedserve.cluster.serving.grpc_service import GrpcService
    from pagedserve.cluster.protos import pagedserve_pb2 as pb

    service = GrpcService(server)
    request = pb.GenerateRequest(prompt="Hello", max_tokens=4, temperature=0, ignore_eos=True, logprobs=1)
    unary = asyncio.run(service.generate(request, _GrpcContext()))
    assert unary.usage.completion_tokens == 4 and len(unary.choices[0].token_ids) == 4
    assert len(unary.choices[0].logprobs) == 4
    assert list(local_handle.streamed.values())[-1] is False

    async def stream():
        return [m async for m in service.generate_stream(request, _GrpcContext())]

    messages = asyncio.run(stream())
    assert list(local_handle.streamed.values())[-1] is True
    assert [t for m in messages for c in m.choices for t in c.token_ids] == list(unary.choices[0].token_ids)
    assert messages[-1].usage.completion_tokens == 4

    context = _GrpcContext()
    # A refused unary call returns an empty reply, its status set on the context.
    assert asyncio.run(service.generate(pb.GenerateRequest(prompt="x", top_p=3), context)).ByteSize() == 0
    assert context.code == grpc.StatusCode.INVALID_ARGUMENT and "top_p" in context.details
    context = _GrpcContext()
    assert asyncio.run(service.generate(pb.GenerateRequest(prompt="x", model="nope"), context)).ByteSize() == 0
    assert context.code == grpc.StatusCode.NOT_FOUND


# ---- limits --------------------------------------------------------------------------------------
@pytest.mark.parametrize("prompt", ["Once upon a time", ["Once upon a time", "Hello"]], ids=["one", "batch"])
def test_request_timeout_is_408_and_frees_blocks(local_handle, prompt):
    """A single prompt's stream is read directly, a batch's through a task each: both time out."""
    timed = _server(local_handle, limits={"request_timeout_s": 0.6})
    local_handle.stall_s = 0.2
    body = {"prompt": prompt, "max_tokens": 200, "ignore_eos": True}
    error = _assert_error(call(timed, "POST", "/v1/completions", json=body), 408)
    assert error["code"] == "request_timeout"
    assert timed.limiter.num_in_flight == 0 and not timed.client_limiter.num_in_flight


def test_idle_stream_ends_with_an_error_event_and_frees_blocks(local_handle):
    idle = _server(local_handle, limits={"stream_idle_timeout_s": 0.3})
    local_handle.stall_s = 1.5
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 200, "ignore_eos": True,
            "stream": True}
    response = call(idle, "POST", "/v1/chat/completions", json=body)
    assert response.status_code == 200
    events = _events(response)
    assert events[-1]["error"]["code"] == "stream_idle_timeout"
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"  # it did stream before going quiet
    assert idle.limiter.num_in_flight == 0


def test_a_steady_stream_outlives_its_idle_timeout(local_handle):
    """The idle timeout bounds each wait, not the stream: outputs 0.1 s apart for 1.5 s under a
    0.5 s idle timeout (its one timer fires mid-stream and sets itself again) end normally. (At
    0.3 s, a step delayed by a loaded machine once made a gap longer than the timeout.)"""
    idle = _server(local_handle, limits={"stream_idle_timeout_s": 0.5})
    local_handle.stall_s = 0.1
    body = {"prompt": "Once upon a time", "max_tokens": 15, "ignore_eos": True, "stream": True}
    response = call(idle, "POST", "/v1/completions", json=body)
    assert response.status_code == 200
    events = _events(response)
    assert all("error" not in event for event in events), events
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert idle.limiter.num_in_flight == 0


@pytest.mark.parametrize("leaving", ["http.disconnect", "serve_cancel", "receive_fails"])
def test_a_client_leaving_mid_stream_ends_the_response_quietly_and_aborts(server, local_handle, leaving):
    """Starlette sees a client leave as ``http.disconnect``; under Ray Serve the proxy cancels the
    request and the replica's ``receive`` raises ``TaskCancelledError``. Either way the app returns
    without an error (Serve would log one for every client that leaves) and the request is aborted.
    A ``receive`` that breaks otherwise stops the stream too, and its error comes out of the app,
    as it would out of starlette's own streaming response."""
    from ray.exceptions import TaskCancelledError

    from pagedserve.cluster.serving.http_app import build_app

    num_requested = 8 * 480
    body = json.dumps({"prompt": "Hello", "max_tokens": 480, "n": 8, "ignore_eos": True,
                       "stream": True}).encode()
    generated_before = local_handle.engine.stats()["num_generated_tokens"]
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "root_path": "", "query_string": b"", "client": ("127.0.0.1", 40000), "server": ("test", 80),
             "headers": [(b"host", b"test"), (b"content-type", b"application/json")]}

    async def run() -> list[dict]:
        sent, streaming, body_read = [], asyncio.Event(), False

        async def receive() -> dict:
            nonlocal body_read
            if not body_read:
                body_read = True
                return {"type": "http.request", "body": body, "more_body": False}
            await streaming.wait()
            if leaving == "serve_cancel":
                raise TaskCancelledError()
            if leaving == "receive_fails":
                raise RuntimeError("the connection broke")
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            sent.append(message)
            if message["type"] == "http.response.body" and message.get("body"):
                streaming.set()

        if leaving == "receive_fails":
            with pytest.raises(RuntimeError, match="the connection broke"):
                await build_app(server)(scope, receive, send)
        else:
            await build_app(server)(scope, receive, send)
        deadline = time.monotonic() + 10  # the engine thread delivers the abort to this loop
        while local_handle.has_streams() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return sent

    sent = asyncio.run(run())
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    chunks = b"".join(m.get("body", b"") for m in sent[1:])
    assert chunks.startswith(b"data: ") and b"[DONE]" not in chunks
    assert server.limiter.num_in_flight == 0
    generated = local_handle.engine.stats()["num_generated_tokens"] - generated_before
    assert generated < 0.5 * num_requested, (
        f"assumed: the engine takes far longer for {num_requested} tokens than the app takes to see the "
        f"client leave; {generated} were generated")


def test_a_request_two_engines_failed_under_ends_with_a_500_that_says_so(server, local_handle):
    from pagedserve.cluster.request_flow import RepeatedEngineFailure

    local_handle.fail_with = RepeatedEngineFailure(
        "the engines of 2 workers failed while running request r; it may be what makes them fail")
    try:
        response = call(server, "POST", "/v1/completions", json={"prompt": "Hello", "max_tokens": 4})
    finally:
        local_handle.fail_with = None
    error = _assert_error(response, 500)
    assert error["code"] == "engine_failed" and "engines of 2 workers" in error["message"], error


def test_a_stream_that_cannot_go_on_after_a_worker_failed_ends_with_an_error_event(server, local_handle):
    """The frontend tells the handle which requests it streams (the handle then ends a request
    with several samples whose worker failed mid-stream with ``StreamNotResumable``, rather than
    run it again from the prompt); that error reaches the client as a 503-coded error event."""
    from pagedserve.cluster.request_flow import StreamNotResumable

    body = {"prompt": "Hello", "n": 2, "max_tokens": 20, "ignore_eos": True}
    local_handle.fail_after_first = StreamNotResumable(
        "the worker running request r failed after 2 tokens had been streamed; 2 samples cannot be continued")
    try:
        streamed = call(server, "POST", "/v1/completions", json={**body, "stream": True})
    finally:
        local_handle.fail_after_first = None
    assert streamed.status_code == 200
    error = _events(streamed)[-1]["error"]
    assert error["code"] == "worker_failed" and "cannot be continued" in error["message"], error
    assert list(local_handle.streamed.values())[-1] is True
    assert call(server, "POST", "/v1/completions", json=body).status_code == 200
    assert list(local_handle.streamed.values())[-1] is False

    # gRPC: the stream ends with UNAVAILABLE and the same message.
    import grpc

    from pagedserve.cluster.protos import pagedserve_pb2 as pb
    from pagedserve.cluster.serving.grpc_service import GrpcRequestError, GrpcService

    async def grpc_stream(context):
        request = pb.GenerateRequest(prompt="Hello", n=2, max_tokens=20, ignore_eos=True)
        return [m async for m in GrpcService(server).generate_stream(request, context)]

    context = _GrpcContext()
    local_handle.fail_after_first = StreamNotResumable("2 samples cannot be continued")
    try:
        with pytest.raises(GrpcRequestError):
            asyncio.run(grpc_stream(context))
    finally:
        local_handle.fail_after_first = None
    assert context.code == grpc.StatusCode.UNAVAILABLE and "cannot be continued" in context.details

    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    for stream in (True, False):
        assert call(server, "POST", "/v1/chat/completions", json={**chat, "stream": stream}).status_code == 200
        assert list(local_handle.streamed.values())[-1] is stream


def test_per_client_limit_429(local_handle):
    limited = _server(local_handle, limits={"max_requests_per_client": 1})
    busy_client = client_key("Bearer alice", "10.0.0.1")
    limited.client_limiter.acquire(busy_client)  # alice has one request in flight
    response = call(limited, "POST", "/v1/completions", json={"prompt": "x", "max_tokens": 2},
                    headers={"Authorization": "Bearer alice"})
    assert _assert_error(response, 429)["code"] == "client_limit"
    assert int(response.headers["retry-after"]) >= 1
    other = call(limited, "POST", "/v1/completions", json={"prompt": "x", "max_tokens": 2},
                 headers={"Authorization": "Bearer bob"})
    assert other.status_code == 200, other.text
    assert limited.client_limiter.num_in_flight == {busy_client: 1}
    assert limited.limiter.num_in_flight == 0


def test_client_key_and_client_limiter_units():
    assert client_key("Bearer k", "1.2.3.4") == client_key("bearer k ", "5.6.7.8") != client_key("Bearer j", None)
    assert client_key(None, "1.2.3.4") == "addr:1.2.3.4" and client_key("Basic x", None) == "addr:unknown"
    assert "k" not in client_key("Bearer k", None)[4:]  # the key itself is never kept
    limiter = ClientLimiter(2)
    limiter.acquire("a", 2)
    limiter.acquire("b")
    with pytest.raises(Exception) as info:
        limiter.acquire("a")
    assert info.value.status == 429
    limiter.release("a", 2)
    limiter.release("b")
    assert limiter.num_in_flight == {}


def test_hostile_numbers_and_unicode_are_400(server):
    post = lambda content: call(server, "POST", "/v1/completions", content=content,  # noqa: E731
                                headers={"Content-Type": "application/json"})
    for raw in (b'{"prompt": "x", "temperature": NaN}', b'{"prompt": "x", "temperature": Infinity}',
                b'{"prompt": "x", "top_p": -Infinity}', b'{"prompt": "x", "seed": 1e400}',
                b'{"prompt": "x", "priority": 99999999999999999999999}',
                b'{"prompt": "x", "stop_token_ids": [-1]}', b'[' * 100000 + b']' * 100000,
                # Found by the fuzz suite: 1e-297 is 0 in float32, and dividing logits by it killed the engine.
                b'{"prompt": [233], "repetition_penalty": 1.8e-297}', b'{"prompt": "x", "repetition_penalty": 1e30}'):
        _assert_error(post(raw), 400)
    assert server.handle.engine.is_running
    for raw in (b'{"prompt": "\\ud800"}', b'{"prompt": "ok", "stop": ["\\udfff"]}'):
        _assert_error(post(raw.replace(b"\\\\", b"\\")), 400)
    chat = call(server, "POST", "/v1/chat/completions", headers={"Content-Type": "application/json"},
                content=b'{"messages": [{"role": "user", "content": "\\ud83d"}]}'.replace(b"\\\\", b"\\"))
    _assert_error(chat, 400, "messages")
    unknown = post(b'{"model": "\\ud800\\u0000", "prompt": "x"}'.replace(b"\\\\", b"\\"))
    _assert_error(unknown, 404)
    assert b"\\ud800" in unknown.content.replace(b"\\\\", b"\\")  # escaped, so it encodes


CHAT_X = [{"role": "user", "content": "x"}]


@pytest.mark.parametrize(("path", "body", "field"), [
    ("/v1/completions", {"prompt": "x", "logprobs": False}, "logprobs"),   # chat's flag, sent to completions
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": False}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "x", "temperature": False}, "temperature"),
    ("/v1/completions", {"prompt": "x", "max_tokens": True}, "max_tokens"),
    ("/v1/completions", {"prompt": [True, True]}, "prompt"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [True]}, "stop_token_ids.0"),
    ("/v1/completions", {"prompt": "x", "echo": 0.0}, "echo"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, "stream"),
    ("/v1/chat/completions", {"messages": CHAT_X, "logprobs": 1}, "logprobs"),
    ("/v1/chat/completions", {"messages": CHAT_X, "top_logprobs": True}, "top_logprobs"),
])
def test_booleans_and_numbers_are_not_taken_for_each_other(server, path, body, field):
    """JSON's true and false are no numbers, and a flag is true or false: read as 1 and 0 (as
    pydantic would), ``"logprobs": false`` to completions would return logprobs. Found by the
    fuzz suite's long form (schemathesis' negative cases answered 200)."""
    _assert_error(call(server, "POST", path, json={"max_tokens": 2, **body}), 400, field)


def test_integral_and_numeric_forms_of_numbers_still_pass(server):
    body = {"prompt": "x", "max_tokens": 2.0, "temperature": 0, "top_p": 1, "n": "1"}
    assert call(server, "POST", "/v1/completions", json=body).status_code == 200


def test_pickled_bodies_are_never_unpickled(server, tmp_path):
    marker = tmp_path / "unpickled"

    class Exploit:
        def __reduce__(self):
            return os.mkdir, (str(marker),)

    payload = pickle.dumps(Exploit())
    for path in ("/v1/completions", "/v1/chat/completions"):
        for content_type in ("application/octet-stream", "application/python-pickle", "application/json"):
            response = call(server, "POST", path, content=payload, headers={"Content-Type": content_type})
            _assert_error(response, 400)
    assert not marker.exists()


# ---- security ------------------------------------------------------------------------------------
def test_api_key_guards_every_route_but_health(local_handle):
    secured = _server(local_handle, api_key="sekrit")
    for path in ("/openapi.json", "/docs", "/redoc", "/stats", "/metrics", "/version", "/v1/models", "/v1/models/x",
                 "/v1/nothing"):
        _assert_error(call(secured, "GET", path), 401)
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/health/../v1/completions",
                 "/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        _assert_error(call(secured, "POST", path, json={"prompt": "x"}), 401)
    assert call(secured, "GET", "/health").status_code == 200
    assert call(secured, "GET", "/ping").status_code == call(secured, "POST", "/ping").status_code == 200
    # The dashboard checks the key itself: a login form, never data.
    assert call(secured, "GET", "/dashboard/state").status_code == 401
    page = call(secured, "GET", "/dashboard")
    assert page.status_code == 401 and "<form" in page.text and "worker-0" not in page.text
    keyed = {"Authorization": "Bearer sekrit"}
    assert call(secured, "GET", "/openapi.json", headers=keyed).status_code == 200
    assert call(secured, "GET", "/metrics", headers=keyed).status_code == 200


def test_runtime_lora_routes_are_closed_unless_configured(server):
    """Without model.allow_runtime_lora_updating the adapter routes answer 404 naming the key
    (after the body's own checks)."""
    for path, body in (("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/tmp/a"}),
                       ("/v1/unload_lora_adapter", {"lora_name": "a"})):
        response = call(server, "POST", path, json=body)
        _assert_error(response, 404)
        assert "model.allow_runtime_lora_updating" in response.json()["error"]["message"]
    _assert_error(call(server, "POST", "/v1/load_lora_adapter", json={"lora_name": "a"}), 400, "lora_path")


def test_metrics_without_key_when_configured(local_handle):
    scrapable = _server(local_handle, api_key="sekrit", metrics_require_api_key=False)
    assert call(scrapable, "GET", "/metrics").status_code == 200
    _assert_error(call(scrapable, "GET", "/stats"), 401)
    _assert_error(call(scrapable, "GET", "/v1/models"), 401)


def test_grpc_every_method_needs_the_key(local_handle):
    import grpc

    from pagedserve.cluster.serving.grpc_service import GrpcRequestError, GrpcService
    from pagedserve.cluster.protos import pagedserve_pb2 as pb
    from pagedserve.cluster.protos import pagedserve_pb2_grpc as pb_grpc

    service = GrpcService(_server(local_handle, api_key="sekrit"))
    rpc_names = {m.name for m in pb.DESCRIPTOR.services_by_name["PagedServe"].methods}
    assert rpc_names == {"Generate", "GenerateStream", "Chat", "ChatStream"}
    assert all(hasattr(pb_grpc.PagedServeServicer, name) for name in rpc_names)
    request = pb.GenerateRequest(prompt="x", max_tokens=2)
    chat = pb.ChatRequest(messages=[pb.ChatMessage(role="user", content="x")], max_tokens=2)

    async def stream(context):
        return [m async for m in service.generate_stream(request, context)]

    async def chat_stream(context):
        return [m async for m in service.chat_stream(chat, context)]

    for metadata in ((), (("authorization", "Bearer wrong"),)):
        # A unary RPC returns an empty reply with its status set; a stream raises after setting it.
        for unary in (lambda c: service.generate(request, c), lambda c: service.chat(chat, c)):
            context = _GrpcContext(metadata)
            assert asyncio.run(unary(context)).ByteSize() == 0
            assert context.code == grpc.StatusCode.UNAUTHENTICATED
        for streamed in (stream, chat_stream):
            context = _GrpcContext(metadata)
            with pytest.raises(GrpcRequestError):
                asyncio.run(streamed(context))
            assert context.code == grpc.StatusCode.UNAUTHENTICATED
    ok = asyncio.run(service.generate(request, _GrpcContext((("authorization", "Bearer sekrit"),))))
    assert ok.usage.completion_tokens == 2


def test_grpc_request_ids_of_clients_do_not_collide(server):
    from pagedserve.cluster.serving.grpc_service import GrpcService
    from pagedserve.cluster.protos import pagedserve_pb2 as pb

    service = GrpcService(server)
    request = pb.GenerateRequest(prompt="Hello", max_tokens=6, temperature=0, ignore_eos=True, request_id="same")

    async def both():
        return await asyncio.gather(*(service.generate(request, _GrpcContext()) for _ in range(3)))

    responses = asyncio.run(both())
    assert [r.request_id for r in responses] == ["same"] * 3
    assert len({tuple(r.choices[0].token_ids) for r in responses}) == 1
    assert all(r.usage.completion_tokens == 6 for r in responses)


def test_prompts_and_completions_are_not_logged_unless_switched_on(local_handle, caplog):
    marker = f"secret-{uuid.uuid4().hex[:8]}"
    requests = [("/v1/completions", {"prompt": f"{marker} one", "max_tokens": 3}),
                ("/v1/completions", {"prompt": [f"{marker} a", f"{marker} b"], "max_tokens": 2, "stream": True}),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": marker}], "max_tokens": 2}),
                ("/v1/completions", {"prompt": marker * 400}),  # too long: a 400
                ("/v1/completions", {"prompt": marker, "temperature": "hot"})]
    with caplog.at_level(logging.DEBUG):
        quiet = _server(local_handle)
        for path, body in requests:
            call(quiet, "POST", path, json=body)
    assert marker not in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="pagedserve.server"):
        chatty = _server(local_handle, log_requests=True)
        response = call(chatty, "POST", "/v1/completions",
                        json={"prompt": f"{marker} one", "max_tokens": 3, "temperature": 0})
    completion = response.json()["choices"][0]["text"]
    assert f"{marker} one" in caplog.text and repr(completion) in caplog.text


def test_openapi_schema_describes_the_request_bodies(server):
    schema = call(server, "GET", "/openapi.json").json()
    components = schema["components"]["schemas"]
    for path, model in (("/v1/completions", "CompletionRequest"), ("/v1/chat/completions", "ChatCompletionRequest")):
        body = schema["paths"][path]["post"]["requestBody"]
        assert body["required"] is True
        assert body["content"]["application/json"]["schema"]["$ref"] == f"#/components/schemas/{model}"
        assert "429" in schema["paths"][path]["post"]["responses"]
    assert {"prompt", "max_tokens", "n", "stop"} <= set(components["CompletionRequest"]["properties"])
    assert components["CompletionRequest"]["required"] == ["prompt"]
    assert "ChatMessageIn" in components and "messages" in components["ChatCompletionRequest"]["required"]
    properties = components["CompletionRequest"]["properties"]
    # An explicit null takes a field's default (below), so the schema admits it; bounds stay standard.
    assert {"type": "null"} in properties["n"]["anyOf"] and properties["n"]["default"] == 1
    max_tokens = next(s for s in properties["max_tokens"]["anyOf"] if s.get("type") == "integer")
    assert (max_tokens["minimum"], "ge" in max_tokens) == (0, False)
    # Each operation has an id of its own (a route with two methods gets one per method).
    ids = [operation["operationId"] for methods in schema["paths"].values() for operation in methods.values()]
    assert len(ids) == len(set(ids)), sorted(ids)


def test_grpc_undecodable_bytes_are_invalid_argument(local_handle):
    import grpc

    from pagedserve.cluster.serving.grpc_service import GrpcService
    from pagedserve.cluster.protos.servicer import parse_generate_request

    assert parse_generate_request(b"\x0a\xff\xff\xff\xff\x0f") is None
    assert parse_generate_request(b"").prompt == ""
    for api_key, metadata, code in ((None, (), grpc.StatusCode.INVALID_ARGUMENT),
                                    ("sekrit", (), grpc.StatusCode.UNAUTHENTICATED)):
        service = GrpcService(_server(local_handle, api_key=api_key))
        context = _GrpcContext(metadata)
        assert asyncio.run(service.generate(None, context)).ByteSize() == 0
        assert context.code == code


# ---- fields of Ray Serve LLM's and vLLM's APIs -----------------------------------------------------
NUMBER = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["n"], "additionalProperties": False}


def test_ray_serve_llm_json_mode_constrains_to_the_schema(server):
    chat = {"messages": [{"role": "user", "content": "A digit, as JSON."}], "max_tokens": 48}
    num_valid = 0
    for seed, schema in enumerate([NUMBER, json.dumps(NUMBER)] * 3):  # an object, or its JSON text
        body = {**chat, "seed": seed, "response_format": {"type": "json_object", "schema": schema}}
        choice = call(server, "POST", "/v1/chat/completions", json=body).json()["choices"][0]
        if choice["finish_reason"] == "stop":
            value = json.loads(choice["message"]["content"])
            assert set(value) == {"n"} and 0 <= value["n"] <= 9, value
            num_valid += 1
    assert num_valid >= 3
    bad = {**chat, "response_format": {"type": "json_object", "schema": {"type": "nope"}}}
    assert "response_format.schema" in _assert_error(call(server, "POST", "/v1/chat/completions", json=bad),
                                                     400, "response_format.schema")["message"]
    misplaced = {**chat, "response_format": {"type": "json_schema", "schema": NUMBER,
                                             "json_schema": {"name": "n", "schema": NUMBER}}}
    _assert_error(call(server, "POST", "/v1/chat/completions", json=misplaced), 400, "response_format.schema")


def test_ray_serve_llm_json_mode_with_an_empty_schema_still_gives_objects(server):
    """JSON mode promises an object: an empty schema (or its text) does not lift that, and a
    schema that allows no object is a 400."""
    chat = {"messages": [{"role": "user", "content": "A number, as JSON."}], "max_tokens": 96}
    num_valid = 0
    for seed, schema in enumerate([{}, "{}"] * 4):
        body = {**chat, "seed": seed, "response_format": {"type": "json_object", "schema": schema}}
        choice = call(server, "POST", "/v1/chat/completions", json=body).json()["choices"][0]
        if choice["finish_reason"] == "stop":
            assert isinstance(json.loads(choice["message"]["content"]), dict), choice
            num_valid += 1
    assert num_valid >= 4
    for schema in ({"type": "integer"}, {"enum": [1, 2]}):
        bad = {**chat, "response_format": {"type": "json_object", "schema": schema}}
        error = _assert_error(call(server, "POST", "/v1/chat/completions", json=bad), 400, "response_format.schema")
        assert "'json_object'" in error["message"], error


def test_json_mode_schema_is_the_given_one_and_an_object():
    """``json_object_schema`` intersects a schema with an object, and its references still resolve."""
    import jsonschema

    from pagedserve.cluster.serving.structured import json_object_schema

    with_refs = {"$defs": {"number": NUMBER}, "anyOf": [{"type": "integer"}, {"$ref": "#/$defs/number"}],
                 "allOf": [{"required": ["n"]}]}
    given = json.loads(json.dumps(with_refs))
    for schema, objects, others in [({}, [{}, {"a": [1]}], [3, 2.5, "x", [], None, True]),
                                    (with_refs, [{"n": 3}], [3, {"n": 12}, {"m": 1}])]:
        validator = jsonschema.Draft202012Validator(json_object_schema(schema))
        assert [validator.is_valid(value) for value in objects + others] == [True] * len(objects) + [False] * len(others)
    assert with_refs == given   # the caller's schema is left as it was


def test_vllm_guided_fields_request_id_and_continue_final_message(server):
    body = {"prompt": "Pick one:", "max_tokens": 8, "guided_choice": ["yes", "no"], "seed": 1,
            "request_id": "my-request-7"}
    data = call(server, "POST", "/v1/completions", json=body).json()
    assert data["id"] == "my-request-7" and data["choices"][0]["text"] in ("yes", "no")
    regex = call(server, "POST", "/v1/completions", json={"prompt": "x", "max_tokens": 8,
                                                          "guided_regex": "[0-9]{3}"}).json()
    assert re.fullmatch("[0-9]{3}", regex["choices"][0]["text"])
    both = {"prompt": "x", "guided_json": NUMBER, "structured_outputs": {"regex": "a"}}
    _assert_error(call(server, "POST", "/v1/completions", json=both), 400, "guided_json")
    messages = [{"role": "user", "content": "Tell a story"}, {"role": "assistant", "content": "Once upon a"}]
    body = {"messages": messages, "max_tokens": 3, "continue_final_message": True, "add_generation_prompt": False}
    assert call(server, "POST", "/v1/chat/completions", json=body).status_code == 200
    _assert_error(call(server, "POST", "/v1/chat/completions", json={**body, "add_generation_prompt": True}), 400,
                  "continue_final_message")


def test_logit_bias_and_allowed_token_ids(server, local_handle):
    """OpenAI's logit_bias (token ids as JSON keys) and vLLM's allowed_token_ids reach the
    sampler: +100 on one token makes greedy repeat it, and so does allowing only it (sampled
    at temperature 1). Keys that are not token ids, values outside [-100, 100], ids outside
    the vocabulary and an empty list are 400s naming the field."""
    tokenizer = local_handle.tokenizer
    token = tokenizer.encode(" blocks", add_special_tokens=False)[0]
    expected = tokenizer.decode([token] * 5)
    base = {"prompt": "Once upon a time", "max_tokens": 5, "ignore_eos": True}
    forced = call(server, "POST", "/v1/completions", json={**base, "temperature": 0, "logit_bias": {str(token): 100}})
    assert forced.status_code == 200, forced.text
    assert forced.json()["choices"][0]["text"] == expected
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "ignore_eos": True, "seed": 3,
            "allowed_token_ids": [token]}
    allowed = call(server, "POST", "/v1/chat/completions", json=chat)
    assert allowed.status_code == 200, allowed.text
    assert allowed.json()["choices"][0]["message"]["content"] == expected
    vocab = local_handle.engine.engine.runner.vocab_size
    for field, value, param in (("logit_bias", {"a": 1}, "logit_bias"), ("logit_bias", {"-3": 1}, "logit_bias"),
                                ("logit_bias", {"5": 101}, "logit_bias.5"),
                                ("logit_bias", {str(vocab): 1}, "logit_bias"),
                                ("allowed_token_ids", [5, vocab], "allowed_token_ids"),
                                ("allowed_token_ids", [], "allowed_token_ids")):
        _assert_error(call(server, "POST", "/v1/completions", json={**base, field: value}), 400, param)
    both = {**base, "allowed_token_ids": [token], "structured_outputs": {"regex": "a+"}}
    _assert_error(call(server, "POST", "/v1/completions", json=both), 400, "allowed_token_ids")


def test_bad_words(server, local_handle):
    """vLLM's bad_words reach the sampler: banning a token of the greedy output (a one-token
    word, as vLLM tokenizes bad words) changes the output from there on; a blank word, or too
    many, are 400s naming the field."""
    from pagedserve.workers.sample.per_row_features import bad_word_token_ids

    tokenizer = local_handle.tokenizer
    base = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0, "ignore_eos": True, "logprobs": 0}
    free = call(server, "POST", "/v1/completions", json=base).json()["choices"][0]["logprobs"]["tokens"]
    at = next(i for i, t in enumerate(free)
              if tokenizer.encode(t, add_special_tokens=False) in bad_word_token_ids(tokenizer, [t]))
    banned = call(server, "POST", "/v1/completions", json={**base, "bad_words": [free[at]]})
    assert banned.status_code == 200, banned.text
    tokens = banned.json()["choices"][0]["logprobs"]["tokens"]
    assert free[at] not in tokens and tokens[:at] == free[:at]
    for value in (["  "], ["x"] * 129, "word"):
        _assert_error(call(server, "POST", "/v1/completions", json={**base, "bad_words": value}), 400, "bad_words")


def test_return_token_ids_in_completions(server, local_handle):
    """vLLM's return_token_ids: each choice's prompt and output token ids, which decode to its
    text; streamed, the prompt's in the first chunk only and the output's new ones in each
    chunk, adding up to the whole response's. Without it, neither key is sent."""
    tokenizer = local_handle.tokenizer
    prompts = ["Once upon a time", "The paged KV cache"]
    base = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
    data = call(server, "POST", "/v1/completions",
                json={**base, "prompt": prompts, "n": 2, "return_token_ids": True}).json()
    for choice in data["choices"]:
        prompt = prompts[choice["index"] // 2]
        assert choice["prompt_token_ids"] == tokenizer.encode(prompt)
        assert len(choice["token_ids"]) == 6
        assert tokenizer.decode(choice["token_ids"]) == choice["text"]
    whole = data["choices"][0]
    plain = call(server, "POST", "/v1/completions", json={**base, "prompt": prompts[0]}).json()["choices"][0]
    assert "token_ids" not in plain and "prompt_token_ids" not in plain and plain["text"] == whole["text"]
    events = _events(call(server, "POST", "/v1/completions",
                          json={**base, "prompt": prompts[0], "stream": True, "return_token_ids": True}))
    choices = [choice for event in events for choice in event["choices"]]
    assert choices[0]["prompt_token_ids"] == whole["prompt_token_ids"]
    assert all("prompt_token_ids" not in choice for choice in choices[1:])
    assert [t for choice in choices for t in choice["token_ids"]] == whole["token_ids"]
    scored = call(server, "POST", "/v1/completions", json={"prompt": prompts[0], "max_tokens": 0, "echo": True,
                                                           "logprobs": 0, "return_token_ids": True}).json()
    assert scored["choices"][0]["token_ids"] == [] and scored["choices"][0]["prompt_token_ids"] == whole[
        "prompt_token_ids"]
    _assert_error(call(server, "POST", "/v1/completions", json={**base, "prompt": "x", "return_token_ids": "yes"}),
                  400, "return_token_ids")


def test_return_token_ids_in_chat(server, local_handle):
    """Chat: ``prompt_token_ids`` at the response's top level (the rendered template's tokens),
    ``token_ids`` per choice, the stop token included as vLLM returns it; streamed, the
    prompt's in the first chunk and the output's in the chunks after."""
    tokenizer = local_handle.tokenizer
    messages = [{"role": "user", "content": "Hello there"}]
    body = {"messages": messages, "max_tokens": 5, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    data = call(server, "POST", "/v1/chat/completions", json=body).json()
    prompt_ids, output_ids = data["prompt_token_ids"], data["choices"][0]["token_ids"]
    assert len(prompt_ids) == data["usage"]["prompt_tokens"] and "Hello there" in tokenizer.decode(prompt_ids)
    assert len(output_ids) == 5 and tokenizer.decode(output_ids) == data["choices"][0]["message"]["content"]
    events = _events(call(server, "POST", "/v1/chat/completions", json={**body, "stream": True}))
    chunks = [event for event in events if event["choices"]]
    assert chunks[0]["prompt_token_ids"] == prompt_ids
    assert all("prompt_token_ids" not in chunk for chunk in chunks[1:])
    assert [t for chunk in chunks for t in chunk["choices"][0].get("token_ids", [])] == output_ids
    eos = tokenizer.eos_token_id
    ended = call(server, "POST", "/v1/chat/completions",
                 json={**body, "ignore_eos": False, "logit_bias": {str(eos): 100}}).json()["choices"][0]
    assert ended["finish_reason"] == "stop" and ended["token_ids"] == [eos] and ended["message"]["content"] == ""
    plain = call(server, "POST", "/v1/chat/completions", json={**body, "return_token_ids": False}).json()
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]


def test_return_tokens_as_token_ids(server):
    """vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:<id>" (the chosen
    ones are the output's ids, in order), the top candidates too; text offsets and chat's
    bytes stay the tokens' own."""
    base = {"prompt": "Once upon a time", "max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": 2}
    plain = call(server, "POST", "/v1/completions", json=base).json()["choices"][0]
    named = call(server, "POST", "/v1/completions",
                 json={**base, "return_tokens_as_token_ids": True, "return_token_ids": True}).json()["choices"][0]
    assert named["logprobs"]["tokens"] == [f"token_id:{t}" for t in named["token_ids"]]
    assert all(re.fullmatch(r"token_id:\d+", key) for top in named["logprobs"]["top_logprobs"] for key in top)
    assert [len(top) for top in named["logprobs"]["top_logprobs"]] == [
        len(top) for top in plain["logprobs"]["top_logprobs"]]
    assert named["logprobs"]["text_offset"] == plain["logprobs"]["text_offset"] and named["text"] == plain["text"]
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "logprobs": True, "top_logprobs": 2}
    plain = call(server, "POST", "/v1/chat/completions", json=chat).json()["choices"][0]["logprobs"]["content"]
    for stream in (False, True):
        response = call(server, "POST", "/v1/chat/completions",
                        json={**chat, "return_tokens_as_token_ids": True, "return_token_ids": True, "stream": stream})
        if stream:
            chunks = [event["choices"][0] for event in _events(response) if event["choices"]]
            content = [entry for chunk in chunks for entry in (chunk.get("logprobs") or {}).get("content") or []]
            token_ids = [t for chunk in chunks for t in chunk.get("token_ids", [])]
        else:
            choice = response.json()["choices"][0]
            content, token_ids = choice["logprobs"]["content"], choice["token_ids"]
        assert [entry["token"] for entry in content] == [f"token_id:{t}" for t in token_ids]
        assert [entry["bytes"] for entry in content] == [entry["bytes"] for entry in plain]
        assert all(re.fullmatch(r"token_id:\d+", top["token"]) for entry in content for top in entry["top_logprobs"])


def test_cache_salt_keeps_prefix_cache_hits_within_a_salt(server):
    """vLLM's cache_salt: a repeated prompt hits the prefix cache under the same salt only
    (usage's cached_tokens); an empty salt is a 400 naming the field."""
    prompt = "A salted prompt keeps its cached blocks to itself, block by block. " * 3

    def cached(**salt) -> int:
        body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, **salt}
        response = call(server, "POST", "/v1/completions", json=body)
        assert response.status_code == 200, response.text
        return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    cached(cache_salt="tenant-a")
    assert cached(cache_salt="tenant-a") > 0
    assert cached(cache_salt="tenant-b") == 0 and cached() == 0
    _assert_error(call(server, "POST", "/v1/completions", json={"prompt": "x", "cache_salt": ""}), 400,
                  "cache_salt")


def test_tokenize_and_detokenize(server, local_handle):
    """vLLM's /tokenize: a prompt's ids as a completion tokenizes it (or without special
    tokens), a chat's as the chat completion renders it (usage agrees), token strings on
    request, the context length; /detokenize decodes ids back. Bad input is a 400 naming the field."""
    tokenizer = local_handle.tokenizer
    prompt = "The paged KV cache splits sequences into blocks."
    data = call(server, "POST", "/tokenize", json={"prompt": prompt}).json()
    assert data["tokens"] == tokenizer.encode(prompt) and data["count"] == len(data["tokens"])
    assert data["max_model_len"] == server.max_model_len and data["token_strs"] is None
    bare = call(server, "POST", "/tokenize", json={"prompt": prompt, "add_special_tokens": False,
                                                   "return_token_strs": True}).json()
    assert bare["tokens"] == tokenizer.encode(prompt, add_special_tokens=False)
    assert bare["token_strs"] == tokenizer.convert_ids_to_tokens(bare["tokens"])
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    chat = call(server, "POST", "/tokenize", json={"messages": messages}).json()
    usage = call(server, "POST", "/v1/chat/completions", json={"messages": messages, "max_tokens": 1}).json()["usage"]
    assert chat["count"] == usage["prompt_tokens"]
    assert "Be brief." in tokenizer.decode(chat["tokens"])
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    with_tools = call(server, "POST", "/tokenize", json={"messages": messages, "tools": tools}).json()
    chat_usage = call(server, "POST", "/v1/chat/completions",
                      json={"messages": messages, "tools": tools, "max_tokens": 1}).json()["usage"]
    assert with_tools["count"] == chat_usage["prompt_tokens"] > chat["count"]
    no_prompt = call(server, "POST", "/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
    assert no_prompt["count"] < chat["count"] and chat["tokens"][:no_prompt["count"]] == no_prompt["tokens"]
    text = call(server, "POST", "/detokenize", json={"tokens": data["tokens"]}).json()["prompt"]
    assert text == tokenizer.decode(data["tokens"])
    long = call(server, "POST", "/tokenize", json={"prompt": "block " * server.max_model_len}).json()
    assert long["count"] > server.max_model_len   # counted, not refused
    vocab = local_handle.engine.engine.runner.vocab_size
    for path, body, param in (("/detokenize", {"tokens": [1, vocab]}, "tokens"), ("/detokenize", {"tokens": [-1]}, "tokens.0"),
                              ("/tokenize", {"prompt": 3}, "prompt"), ("/tokenize", {"messages": []}, "messages"),
                              ("/tokenize", {"prompt": "x", "model": "other"}, "model"),
                              ("/tokenize", {"prompt": "x", "stream": True}, "stream")):
        _assert_error(call(server, "POST", path, json=body), 404 if param == "model" else 400, param)


CHAT_TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}[assistant] {% endif %}")


def test_a_chat_template_of_the_servers_own_replaces_the_tokenizers(local_handle, tmp_path):
    """server.chat_template (vLLM's --chat-template; a file or the template itself) renders
    every chat completion and /tokenize's messages; a tokenizer without one then serves chats."""
    tokenizer = local_handle.tokenizer
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    rendered = "[system] Be brief.\n[user] Hi!\n[assistant] "
    template_file = tmp_path / "chat.jinja"
    template_file.write_text(CHAT_TEMPLATE)
    for given in (CHAT_TEMPLATE, str(template_file)):
        server = _server(local_handle, chat_template=given)
        chat = call(server, "POST", "/tokenize", json={"messages": messages}).json()
        assert chat["tokens"] == tokenizer.encode(rendered, add_special_tokens=False)
        completion = call(server, "POST", "/v1/chat/completions", json={"messages": messages, "max_tokens": 1})
        assert completion.json()["usage"]["prompt_tokens"] == chat["count"]
    saved, tokenizer.chat_template = tokenizer.chat_template, None
    try:
        _assert_error(call(_server(local_handle), "POST", "/v1/chat/completions",
                           json={"messages": messages, "max_tokens": 1}), 400, "messages")
        served = call(_server(local_handle, chat_template=CHAT_TEMPLATE), "POST", "/v1/chat/completions",
                      json={"messages": messages, "max_tokens": 2, "ignore_eos": True}).json()
        assert served["usage"]["completion_tokens"] == 2
    finally:
        tokenizer.chat_template = saved


RETRIEVAL_TEMPLATE = ("{% for d in documents or [] %}<doc {{ d['title'] }}>{{ d['text'] }}</doc>\n{% endfor %}"
                      + CHAT_TEMPLATE)


def test_documents_go_to_a_retrieval_template_and_are_refused_by_others(server, local_handle):
    """vLLM's ``documents``: a template that reads them (Command R's, Granite's) gets them as
    transformers' ``documents``; a template that does not is a 400 naming the field."""
    tokenizer = local_handle.tokenizer
    messages = [{"role": "user", "content": "What is paged attention?"}]
    documents = [{"title": "vLLM", "text": "KV cache in blocks."}, {"title": "notes", "text": "Pages."}]
    rendered = ("<doc vLLM>KV cache in blocks.</doc>\n<doc notes>Pages.</doc>\n"
                "[user] What is paged attention?\n[assistant] ")
    retrieval = _server(local_handle, chat_template=RETRIEVAL_TEMPLATE)
    body = {"messages": messages, "max_tokens": 1, "documents": documents}
    usage = call(retrieval, "POST", "/v1/chat/completions", json=body).json()["usage"]
    assert usage["prompt_tokens"] == len(tokenizer.encode(rendered, add_special_tokens=False))
    counted = call(retrieval, "POST", "/tokenize", json={"messages": messages, "documents": documents}).json()
    assert counted["count"] == usage["prompt_tokens"]
    without = call(retrieval, "POST", "/v1/chat/completions", json={**body, "documents": None}).json()["usage"]
    assert without["prompt_tokens"] == len(tokenizer.encode(rendered.split("</doc>\n")[-1], add_special_tokens=False))

    error = _assert_error(call(server, "POST", "/v1/chat/completions", json=body), 400, "documents")
    assert "does not read documents" in error["message"]
    _assert_error(call(server, "POST", "/tokenize", json={"messages": messages, "documents": documents}),
                  400, "documents")
    not_text = call(retrieval, "POST", "/v1/chat/completions", json={**body, "documents": [{"title": 1}]})
    assert _assert_error(not_text, 400)["param"] == "documents.0.title"
    _assert_error(call(retrieval, "POST", "/v1/completions", json={"prompt": "x", "documents": documents}),
                  400, "documents")
    _assert_error(call(retrieval, "POST", "/v1/chat/completions",
                       json={"messages": messages, "chat_template_kwargs": {"documents": documents}}),
                  400, "chat_template_kwargs")


def test_grpc_chat_carries_documents(local_handle):
    import grpc

    from local_frontend import grpc_stub
    from pagedserve.cluster.protos import pagedserve_pb2 as pb

    documents = [{"title": "vLLM", "text": "KV cache in blocks."}]
    request = pb.ChatRequest(messages=[pb.ChatMessage(role="user", content="hi")], max_tokens=1,
                             documents=json.dumps(documents))
    with grpc_stub(_server(local_handle, chat_template=RETRIEVAL_TEMPLATE)) as stub:
        with_documents = stub.Chat(request, timeout=60).usage.prompt_tokens
        request.documents = ""
        assert stub.Chat(request, timeout=60).usage.prompt_tokens < with_documents
        request.documents = json.dumps(documents[0])
        with pytest.raises(grpc.RpcError) as refused:
            stub.Chat(request, timeout=60)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "documents must be a JSON array" in refused.value.details()


def test_a_request_that_leaves_sampling_out_gets_the_models_generation_config(local_handle, tmp_path):
    """vLLM's --generation-config: a sampling field a request leaves out takes the generation
    config's value ("auto": the model's; a folder's), overrides winning; what the request states
    stands; "vllm" keeps OpenAI's defaults. A chat without max_tokens stops at max_new_tokens."""
    from pagedserve.cluster.serving.protocol import ChatCompletionRequest, CompletionRequest

    folder = tmp_path / "generation"
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
         "repetition_penalty": 1.05, "max_new_tokens": 3}))
    server = _server(local_handle, generation_config=str(folder), override_generation_config={"top_p": 0.8})
    left_out = server.sampling_params(CompletionRequest.model_validate({"prompt": "x"}), 16, None)
    assert (left_out.temperature, left_out.top_p, left_out.top_k) == (0.6, 0.8, 20)
    assert (left_out.min_p, left_out.repetition_penalty) == (0.05, 1.05)
    stated = server.sampling_params(CompletionRequest.model_validate(
        {"prompt": "x", "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}), 16, None)
    assert (stated.temperature, stated.top_p, stated.top_k, stated.min_p, stated.repetition_penalty) == (1.0, 1.0, -1, 0.0, 1.0)
    beams = server.sampling_params(CompletionRequest.model_validate({"prompt": "x", "use_beam_search": True, "n": 2}),
                                   16, None)
    assert beams.temperature == 0.0
    neutral = _server(local_handle, generation_config="vllm").sampling_params(
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}]}), 16, None)
    assert (neutral.temperature, neutral.top_p, neutral.top_k, neutral.min_p, neutral.repetition_penalty) == \
        (1.0, 1.0, -1, 0.0, 1.0)
    # Served: greedy by default (an override), the chat's length from max_new_tokens.
    greedy = _server(local_handle, generation_config=str(folder), override_generation_config={"temperature": 0})
    chat = {"messages": [{"role": "user", "content": "Tell a story"}], "ignore_eos": True}
    by_default = call(greedy, "POST", "/v1/chat/completions", json=chat).json()
    assert by_default["usage"]["completion_tokens"] == 3
    stated_greedy = call(greedy, "POST", "/v1/chat/completions",
                         json={**chat, "temperature": 0, "top_p": 0.8, "top_k": 20, "min_p": 0.05,
                               "repetition_penalty": 1.05, "max_tokens": 3}).json()
    assert by_default["choices"][0]["message"] == stated_greedy["choices"][0]["message"]


def test_sampling_defaults_read_what_a_generation_config_sets(tiny_model, tmp_path):
    from pagedserve.workers.sample.generation_defaults import sampling_defaults

    assert sampling_defaults(tiny_model("llama")) == {}   # bos, eos, do_sample: no sampling defaults
    model = tmp_path / "model"
    model.mkdir()
    (model / "generation_config.json").write_text(json.dumps({"temperature": 0.7, "max_new_tokens": 9,
                                                              "do_sample": True, "bos_token_id": 1}))
    assert sampling_defaults(str(model)) == {"temperature": 0.7, "max_tokens": 9}
    assert sampling_defaults(str(model), "vllm") == {}
    assert sampling_defaults(str(model), "vllm", {"top_k": 5}) == {"top_k": 5}


@pytest.mark.parametrize("override, message", [
    ("server.generation_config=/nowhere", "neither 'auto', 'vllm' nor a folder holding a generation_config.json"),
    ('server.override_generation_config={"do_sample": true}', "do_sample: not a sampling default"),
    ('server.override_generation_config={"temperature": "hot"}', "temperature must be a number"),
])
def test_generation_config_settings_that_cannot_be_honoured_are_refused(override, message):
    from pagedserve.cluster.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=message):
        load_config(overrides=[override])


@pytest.mark.parametrize("given, message", [
    ("{% for m in messages %}", "not valid Jinja \\(line 1\\)"),
    ("/no/such/template.jinja", "looks like a chat template's file, which cannot be read"),
])
def test_a_chat_template_that_cannot_be_read_or_parsed_is_refused_naming_the_key(given, message):
    from pagedserve.cluster.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=f"server.chat_template: .*{message}"):
        load_config(overrides=[f"server.chat_template={json.dumps(given)}"])


def test_stop_reason_names_the_stop_string_or_token(server):
    """vLLM's stop_reason: the stop string or stop token id that ended a choice, null for a
    length limit; in completions, chat, and their streams' last chunks."""
    base = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    free = call(server, "POST", "/v1/completions", json=base).json()["choices"][0]
    assert free["finish_reason"] == "length" and free["stop_reason"] is None
    stop_id = free["token_ids"][3]
    by_id = call(server, "POST", "/v1/completions", json={**base, "stop_token_ids": [stop_id]}).json()["choices"][0]
    assert (by_id["finish_reason"], by_id["stop_reason"]) == ("stop", stop_id)
    text = free["text"]
    stop = text[len(text) // 2:len(text) // 2 + 2]
    assert stop, text
    by_text = call(server, "POST", "/v1/completions", json={**base, "stop": [stop]}).json()["choices"][0]
    assert (by_text["finish_reason"], by_text["stop_reason"]) == ("stop", stop)
    assert by_text["text"] == text[:text.index(stop)]
    events = _events(call(server, "POST", "/v1/completions", json={**base, "stop": [stop], "stream": True}))
    assert [c["stop_reason"] for e in events for c in e["choices"]][-1] == stop
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    free = call(server, "POST", "/v1/chat/completions", json=chat).json()["choices"][0]
    chat["stop_token_ids"] = [free["token_ids"][2]]
    ended = call(server, "POST", "/v1/chat/completions", json=chat).json()["choices"][0]
    assert (ended["finish_reason"], ended["stop_reason"]) == ("stop", free["token_ids"][2])
    chunks = [e["choices"][0] for e in _events(call(server, "POST", "/v1/chat/completions",
                                                     json={**chat, "stream": True})) if e["choices"]]
    assert chunks[-1]["stop_reason"] == free["token_ids"][2] and chunks[-1]["finish_reason"] == "stop"
    assert all(c["stop_reason"] is None for c in chunks[:-1])


def test_chat_echo_starts_the_reply_with_the_message_it_continues(server):
    """vLLM's chat echo: with continue_final_message, the assistant's started message opens the
    reply's content (streamed: a chunk of its own after the role's); a user message last,
    under a generation prompt, is not the reply's and is not echoed."""
    messages = [{"role": "user", "content": "Tell a story"}, {"role": "assistant", "content": "Once upon a"}]
    body = {"messages": messages, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "continue_final_message": True, "add_generation_prompt": False}
    plain = call(server, "POST", "/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
    echoed = call(server, "POST", "/v1/chat/completions", json={**body, "echo": True}).json()
    assert echoed["choices"][0]["message"]["content"] == "Once upon a" + plain
    assert echoed["usage"]["completion_tokens"] == 4
    events = _events(call(server, "POST", "/v1/chat/completions", json={**body, "echo": True, "stream": True}))
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert deltas[0] == {"role": "assistant", "content": ""} and deltas[1] == {"content": "Once upon a"}
    assert "".join(d.get("content", "") for d in deltas) == "Once upon a" + plain
    asked = {"messages": messages[:1], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    assert (call(server, "POST", "/v1/chat/completions", json={**asked, "echo": True}).json()["choices"][0]["message"]
            == call(server, "POST", "/v1/chat/completions", json=asked).json()["choices"][0]["message"])


def test_a_streamed_completions_first_chunk_waits_for_text_held_back(server):
    """A stop string that the whole output could still begin holds its text back until the
    end: the choice's first chunk is then the last, and still carries what a first chunk
    carries (the prompt's logprobs)."""
    base = {"prompt": "Once upon a time", "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    text = call(server, "POST", "/v1/completions", json=base).json()["choices"][0]["text"]
    events = _events(call(server, "POST", "/v1/completions",
                          json={**base, "stop": [text + "\u0000"], "prompt_logprobs": 1, "stream": True}))
    choices = [choice for event in events for choice in event["choices"]]
    assert "".join(choice["text"] for choice in choices) == text
    assert choices[0]["prompt_logprobs"] is not None and choices[0]["text"] == text


@pytest.mark.parametrize(("field", "value", "path"), [
    ("store", True, "/v1/chat/completions"), ("metadata", {"a": "b"}, "/v1/chat/completions"),
    ("service_tier", "flex", "/v1/chat/completions"), ("reasoning_effort", "high", "/v1/chat/completions"),
    ("functions", [{"name": "f"}], "/v1/chat/completions"), ("modalities", ["audio"], "/v1/chat/completions"),
    ("prediction", {"type": "content"}, "/v1/chat/completions"), ("chat_template", "{{ 1 }}", "/v1/chat/completions"),
    ("vllm_xargs", {"a": 1}, "/v1/completions"), ("guided_whitespace_pattern", " ", "/v1/completions"),
])
def test_fields_we_cannot_honour_are_refused_with_the_reason(server, field, value, path):
    body = {"prompt": "x", "max_tokens": 2} if path == "/v1/completions" else {
        "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    error = _assert_error(call(server, "POST", path, json={**body, field: value}), 400, field)
    assert "unknown field" not in error["message"] and len(error["message"]) > len(field) + 30, error


@pytest.mark.parametrize(("part", "kind"), [
    ({"type": "image_url", "image_url": {"url": "http://example.invalid/a.png"}}, "image_url"),
    ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}, "input_audio"),
    ({"type": "file", "file": {"file_id": "file-1"}}, "file"),
    ({"type": "refusal", "refusal": "no"}, "refusal"),
])
def test_a_chat_part_that_is_not_text_is_refused_by_its_kind(server, part, kind):
    """An image, audio or a file in a message is refused naming the part and why (a text-only
    model), not with every way the part fails to be text; text parts beside it still pass."""
    messages = [{"role": "user", "content": [{"type": "text", "text": "look"}, part]}]
    error = _assert_error(call(server, "POST", "/v1/chat/completions", json={"messages": messages, "max_tokens": 2}),
                          400, "messages.0.content")
    assert f"content[1] is of type '{kind}'" in error["message"], error
    assert "text-only" in error["message"] or kind == "refusal", error
    assert "Input should be" not in error["message"] and "Field required" not in error["message"], error
    text_only = [{"role": "user", "content": [{"type": "text", "text": "look"}, {"type": "text", "text": "again"}]}]
    assert call(server, "POST", "/v1/chat/completions", json={"messages": text_only, "max_tokens": 2}).status_code == 200


def test_harmless_values_of_those_fields_pass(server):
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "store": False,
            "service_tier": "auto", "modalities": ["text"], "guided_decoding_backend": "guidance"}
    assert call(server, "POST", "/v1/chat/completions", json=body).status_code == 200


def test_vllm_disable_any_whitespace_option(server):
    body = {"prompt": "{", "max_tokens": 64, "response_format": {"type": "json_object", "schema": NUMBER},
            "guided_decoding_backend": "guidance:disable-any-whitespace"}
    for seed in range(3):
        choice = call(server, "POST", "/v1/completions", json={**body, "seed": seed}).json()["choices"][0]
        assert choice["finish_reason"] == "stop" and re.fullmatch(r'\{"n":[0-9]\}', choice["text"]), choice
    _assert_error(call(server, "POST", "/v1/completions", json={**body, "guided_decoding_backend": "xgrammar"}),
                  400, "guided_decoding_backend")


def test_explicit_nulls_take_the_defaults_as_openai_and_vllm_read_them():
    """Clients send ``null`` for unset optional fields (``n``, ``stream``, the penalties,
    chat's ``logprobs`` and ``parallel_tool_calls``): they take the defaults, not a 400.
    OpenAI's caching and safety hints are accepted; a required field stays required."""
    from pydantic import ValidationError

    from pagedserve.cluster.serving.protocol import ChatCompletionRequest, CompletionRequest

    nulls = {"n": None, "stream": None, "presence_penalty": None, "frequency_penalty": None,
             "max_tokens": None, "min_p": None, "ignore_eos": None}
    completion = CompletionRequest.model_validate({"prompt": "x", **nulls, "prompt_cache_key": "k",
                                                   "safety_identifier": "user-1"})
    assert (completion.n, completion.stream, completion.presence_penalty, completion.min_p) == (1, False, 0.0, 0.0)
    assert completion.max_tokens is None and completion.ignore_eos is False
    chat = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}],
                                                 "logprobs": None, "parallel_tool_calls": None, **nulls})
    assert (chat.logprobs, chat.parallel_tool_calls, chat.n) == (False, True, 1)
    with pytest.raises(ValidationError, match="messages"):
        ChatCompletionRequest.model_validate({"messages": None})
    with pytest.raises(ValidationError, match="n"):
        CompletionRequest.model_validate({"prompt": "x", "n": 0})


def test_stream_deltas_leave_out_exactly_their_none_keys():
    """Every combination of set and unset fields of the chat stream's delta models serialises
    to the keys that are set, nested ones included, in ``model_dump_json`` and ``model_dump``;
    the choice around them keeps its nulls, as OpenAI's chunks do."""
    import itertools

    from pagedserve.cluster.serving.protocol import (ChatCompletionChunk, ChatStreamChoice, DeltaFunctionCall,
                                                     DeltaMessage, DeltaToolCall)

    functions = [None] + [DeltaFunctionCall(name=n, arguments=a)
                          for n, a in itertools.product([None, "f"], [None, "", '{"a": 1}'])]
    calls = [DeltaToolCall(index=1, id=i, type=t, function=f)
             for i, t, f in itertools.product([None, "c1"], [None, "function"], functions)]
    for role, content, tool_calls in itertools.product([None, "assistant"], [None, "", "hé\n\"x\""],
                                                      [None, [], calls[:3], calls[3:]]):
        delta = DeltaMessage(role=role, content=content, tool_calls=tool_calls)
        expected = {k: v for k, v in (("role", role), ("content", content)) if v is not None}
        if tool_calls is not None:
            expected["tool_calls"] = [
                {"index": 1, **{k: v for k, v in (("id", c.id), ("type", c.type)) if v is not None},
                 **({} if c.function is None else {"function": {
                     k: v for k, v in (("name", c.function.name), ("arguments", c.function.arguments))
                     if v is not None}})}
                for c in tool_calls]
        assert json.loads(delta.model_dump_json()) == delta.model_dump() == expected
        chunk = ChatCompletionChunk(id="c", created=1, model=MODEL, choices=[ChatStreamChoice(index=0, delta=delta)])
        choice = json.loads(chunk.model_dump_json())["choices"][0]
        assert choice == {"index": 0, "delta": expected, "logprobs": None, "finish_reason": None,
                          "stop_reason": None}   # vLLM's key, null as theirs
