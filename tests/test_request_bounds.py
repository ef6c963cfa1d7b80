"""Every request ends: it completes, or it is refused up front with a 4xx.

A request whose prompt plus the ``max_tokens`` it states, or plus its
``min_tokens``, cannot fit the model's context could never finish as asked:
it is a 400 naming the field and both numbers (vLLM's wording), over HTTP
(completions and chat, streamed or not) and gRPC (``Generate``, ``Chat``)
alike. Without a stated ``max_tokens`` the output stops at the context with
``finish_reason: "length"``; the engine itself finishes any sequence that
reaches the context limit. A property test sends generated requests of every
shape and checks that each one ends, with a 200 or a 4xx, within a time bound
derived from its token count (the idle timeout set far beyond it, so a hang
cannot pass as a 408).
"""

from __future__ import annotations

import time

import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

grpc = pytest.importorskip("grpc")
httpx = pytest.importorskip("httpx")

from local_frontend import (LocalHandle, assert_error, assert_idle, call, events, grpc_stub,  # noqa: E402
                            make_frontend)

from pagedserve.cluster.protos import pagedserve_pb2 as pb  # noqa: E402

pytestmark = pytest.mark.timeout(900)

# The request: 62 prompt tokens on a 512-token model, min_tokens 500.
PROMPT = "hello " * 20


@pytest.fixture(scope="module")
def handle(tiny_model):
    local = LocalHandle(tiny_model("llama"), num_device_blocks=256)
    yield local
    local.engine.shutdown()


@pytest.fixture(scope="module")
def frontend(handle):
    # A hang must show as a hang, not as the idle timeout's 408.
    return make_frontend(handle, limits={"stream_idle_timeout_s": 600, "request_timeout_s": 600})


@pytest.fixture(scope="module")
def stub(frontend):
    with grpc_stub(frontend) as stub:
        yield stub


@pytest.fixture(autouse=True)
def idle_after(handle):
    yield
    assert_idle(handle)


def num_tokens(handle, text: str) -> int:
    return len(handle.tokenizer.encode(text))


def grpc_failure(rpc) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        rpc()
    return info.value


def test_min_tokens_that_cannot_fit_is_a_400_naming_both_numbers(frontend, handle, stub):
    num_prompt = num_tokens(handle, PROMPT)
    context = handle.max_model_len
    for stream in (False, True):
        start = time.monotonic()
        error = assert_error(call(frontend, "POST", "/v1/completions", json={
            "prompt": PROMPT, "max_tokens": 500, "min_tokens": 500, "stream": stream}), 400, "max_tokens")
        assert time.monotonic() - start < 5  # refused up front, not after an idle timeout
        assert f"500 > {context} - {num_prompt}" in error["message"]
        error = assert_error(call(frontend, "POST", "/v1/chat/completions",
                                  json={"messages": [{"role": "user", "content": PROMPT}], "min_tokens": 500,
                                        "stream": stream}), 400, "min_tokens")
        assert "'min_tokens' is too large: 500" in error["message"] and str(context) in error["message"]
        assert error["code"] == "context_length_exceeded"
    completion_error = assert_error(call(frontend, "POST", "/v1/completions",
                                         json={"prompt": PROMPT, "max_tokens": 16, "min_tokens": 500}), 400)
    assert completion_error["param"] == "min_tokens"

    failure = grpc_failure(lambda: stub.Generate(pb.GenerateRequest(prompt=PROMPT, max_tokens=500), timeout=30))
    assert failure.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"'max_tokens' is too large: 500. This model's maximum context length is {context} tokens and " \
           f"your request has {num_prompt} input tokens (500 > {context} - {num_prompt})" == failure.details()
    chat = pb.ChatRequest(messages=[pb.ChatMessage(role="user", content=PROMPT)], min_tokens=500)
    for rpc in (stub.Chat, lambda r, **kw: list(stub.ChatStream(r, **kw))):
        failure = grpc_failure(lambda: rpc(chat, timeout=30))
        assert failure.code() == grpc.StatusCode.INVALID_ARGUMENT and "'min_tokens' is too large" in failure.details()


def test_stated_max_tokens_that_cannot_fit_is_a_400(frontend, handle, stub):
    context = handle.max_model_len
    error = assert_error(call(frontend, "POST", "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": context}), 400,
        "max_completion_tokens")
    assert f"'max_completion_tokens' is too large: {context}" in error["message"]
    # A batch: the longest prompt decides.
    long_prompt = [7] * (context - 10)
    error = assert_error(call(frontend, "POST", "/v1/completions",
                              json={"prompt": [[7, 8], long_prompt], "max_tokens": 11}), 400, "max_tokens")
    assert f"11 > {context} - {context - 10}" in error["message"]
    ok = call(frontend, "POST", "/v1/completions", json={"prompt": [[7, 8], long_prompt], "max_tokens": 10,
                                                         "ignore_eos": True})
    assert ok.status_code == 200 and [c["finish_reason"] for c in ok.json()["choices"]] == ["length"] * 2
    failure = grpc_failure(lambda: stub.Generate(pb.GenerateRequest(prompt_token_ids=long_prompt, max_tokens=11),
                                                 timeout=30))
    assert failure.code() == grpc.StatusCode.INVALID_ARGUMENT and "11 > " in failure.details()


def test_without_max_tokens_the_output_stops_at_the_context(frontend, handle, stub):
    context = handle.max_model_len
    prompt = [5] * (context - 6)
    # Completions' default max_tokens (16) is cut to what the context leaves.
    data = call(frontend, "POST", "/v1/completions", json={"prompt": prompt, "ignore_eos": True, "min_tokens": 6})
    assert data.status_code == 200, data.text
    choice = data.json()["choices"][0]
    assert choice["finish_reason"] == "length" and data.json()["usage"]["completion_tokens"] == 6
    streamed = events(call(frontend, "POST", "/v1/completions",
                           json={"prompt": prompt, "ignore_eos": True, "stream": True}))
    assert [c["finish_reason"] for e in streamed for c in e["choices"] if c["finish_reason"]] == ["length"]
    # Chat without max_tokens: the rest of the context.
    body = {"messages": [{"role": "user", "content": PROMPT * 6}], "ignore_eos": True, "min_tokens": 10}
    data = call(frontend, "POST", "/v1/chat/completions", json=body).json()
    assert data["choices"][0]["finish_reason"] == "length" and data["usage"]["total_tokens"] == context
    unary = stub.Generate(pb.GenerateRequest(prompt_token_ids=prompt, ignore_eos=True), timeout=60)
    assert unary.choices[0].finish_reason == "length" and unary.usage.completion_tokens == 6


def test_the_engine_finishes_a_sequence_at_the_context_limit(tiny_model):
    """Asked for more than the context holds (min_tokens included), the engine ends the sequence
    with "length" at the limit and frees its blocks: it never holds one that cannot progress."""
    from pagedserve import LLM, SamplingParams

    llm = LLM(tiny_model("llama"), num_device_blocks=64, swap_space_gb=0.001)
    context = llm.engine.max_model_len
    prompt = [9] * (context - 20)
    [output] = llm.generate([prompt], SamplingParams(max_tokens=1000, min_tokens=1000, temperature=0))
    completion = output.outputs[0]
    assert completion.finish_reason == "length"
    assert len(prompt) + len(completion.token_ids) == context
    llm.check_integrity()


# ---- the property ----------------------------------------------------------------------------------
# Seconds a request may take: a fixed allowance plus a per-token cost well above the tiny
# model's on two loaded cores (it decodes hundreds of tokens a second).
BASE_S = 15.0
PER_TOKEN_S = 0.05


@st.composite
def requests(draw):
    transport = draw(st.sampled_from(["completions", "chat", "grpc-generate", "grpc-chat"]))
    fields: dict = {"n": draw(st.integers(1, 3)), "ignore_eos": draw(st.booleans()),
                    "temperature": draw(st.sampled_from([0.0, 0.8])), "seed": draw(st.integers(0, 99))}
    # Mostly requests that fit, often ones that do not: both sizes of every number.
    max_tokens = draw(st.one_of(st.none(), st.integers(1, 48), st.integers(1, 600)))
    if max_tokens is not None:
        fields["max_tokens"] = max_tokens
    min_tokens = draw(st.one_of(st.just(0), st.integers(0, 24), st.integers(0, 600)))
    if min_tokens:
        fields["min_tokens"] = min_tokens
    if draw(st.booleans()):
        fields["stop"] = [draw(st.sampled_from(["a", "the", "\n"]))]
    size = draw(st.one_of(st.integers(1, 64), st.integers(1, 540)))
    return transport, draw(st.booleans()), size, fields


def _num_prompt_tokens(frontend, transport: str, size: int) -> int:
    """The prompt's tokens as the server counts them (a chat's through its template, by ``/tokenize``)."""
    if transport in ("completions", "grpc-generate"):
        return size
    body = {"messages": [{"role": "user", "content": "hi " * (size // 2)}]}
    return call(frontend, "POST", "/tokenize", json=body).json()["count"]


def _fits(handle, num_prompt_tokens: int, fields: dict) -> bool:
    """Whether the request can finish as asked: one output token at least, the stated
    ``max_tokens`` and ``min_tokens`` within what the context leaves."""
    room = handle.max_model_len - num_prompt_tokens
    return room >= 1 and fields.get("max_tokens", 1) <= room and fields.get("min_tokens", 0) <= room


def _bound_s(handle, num_prompt_tokens: int, fields: dict) -> float:
    per_sample = min(fields.get("max_tokens") or handle.max_model_len, handle.max_model_len)
    return BASE_S + PER_TOKEN_S * (num_prompt_tokens + fields["n"] * per_sample)


def _send(frontend, stub, transport: str, stream: bool, size: int, fields: dict) -> str:
    """Send one request; return how it ended: "ok" or "refused"."""
    if transport in ("completions", "chat"):
        if transport == "completions":
            path, body = "/v1/completions", {"prompt": [11] * size, **fields, "stream": stream}
        else:
            path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi " * (size // 2)}],
                                                  **fields, "stream": stream}
        response = call(frontend, "POST", path, json=body)
        if response.status_code != 200:
            assert 400 <= response.status_code < 500, response.text
            return "refused"
        finishes = ([c["finish_reason"] for e in events(response) for c in e["choices"] if c["finish_reason"]]
                    if stream else [c["finish_reason"] for c in response.json()["choices"]])
        assert len(finishes) == fields["n"] and set(finishes) <= {"stop", "length"}, response.text
        return "ok"
    rpc_fields = dict(fields)
    try:
        if transport == "grpc-generate":
            request = pb.GenerateRequest(prompt_token_ids=[11] * size, **rpc_fields)
            replies = list(stub.GenerateStream(request, timeout=600)) if stream else [stub.Generate(request, timeout=600)]
        else:
            request = pb.ChatRequest(messages=[pb.ChatMessage(role="user", content="hi " * (size // 2))], **rpc_fields)
            replies = list(stub.ChatStream(request, timeout=600)) if stream else [stub.Chat(request, timeout=600)]
    except grpc.RpcError as failure:
        assert failure.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND), failure
        return "refused"
    finishes = [c.finish_reason for r in replies for c in r.choices if c.finish_reason]
    assert len(finishes) == fields["n"] and set(finishes) <= {"stop", "length"}, replies
    return "ok"


def _example(transport: str, stream: bool, size: int, **fields):
    return example(request=(transport, stream, size, {"n": 1, "ignore_eos": True, "temperature": 0.0, "seed": 0,
                                                      **fields}))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture],
          derandomize=True)
@given(request=requests())
# A stated max_tokens or min_tokens the context cannot hold, on every transport, beside the drawn requests
# (most of which fit).
@_example("completions", False, 100, max_tokens=500)
@_example("chat", True, 100, min_tokens=500)
@_example("grpc-generate", True, 100, min_tokens=500)
@_example("grpc-chat", False, 100, max_tokens=500)
def test_every_request_completes_or_is_refused_within_its_bound(frontend, stub, handle, request):
    """A request that fits completes, one that cannot is refused: either way within its bound."""
    transport, stream, size, fields = request
    num_prompt = _num_prompt_tokens(frontend, transport, size)
    start = time.monotonic()
    outcome = _send(frontend, stub, transport, stream, size, fields)
    elapsed = time.monotonic() - start
    event(f"{transport}: {outcome}")
    assert outcome == ("ok" if _fits(handle, num_prompt, fields) else "refused"), (request, num_prompt, outcome)
    assert elapsed <= _bound_s(handle, num_prompt, fields), (request, elapsed)
    assert_idle(handle)
