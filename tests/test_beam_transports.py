"""Beam search over the APIs: ``use_beam_search`` and ``length_penalty`` (vLLM's extension
fields) on ``POST /v1/completions`` and gRPC ``Generate``, over one in-process frontend.

``n`` is the beam width and every beam is a choice, the best first (vLLM's
semantics; ``best_of``, if sent, must equal ``n``). The choices equal transformers'
``generate(num_beams=n)``, streamed or not, on both transports. A field beam search
cannot honour is a 400 (gRPC INVALID_ARGUMENT) naming it.
"""

from __future__ import annotations


import pytest
import torch

grpc = pytest.importorskip("grpc")
httpx = pytest.importorskip("httpx")

from local_frontend import (LocalHandle, assert_error, assert_idle, call, events, grpc_stub,  # noqa: E402
                            make_frontend)

from pagedserve.cluster.protos import pagedserve_pb2 as pb  # noqa: E402

pytestmark = pytest.mark.timeout(600)

PROMPT = [1, 17, 300, 45, 99, 512, 7, 250, 31]


@pytest.fixture(scope="module")
def handle(tiny_model):
    local = LocalHandle(tiny_model("llama"), num_device_blocks=256, block_size=4)
    yield local
    local.engine.shutdown()


@pytest.fixture(scope="module")
def frontend(handle):
    return make_frontend(handle)


@pytest.fixture(scope="module")
def stub(frontend):
    with grpc_stub(frontend) as stub:
        yield stub


@pytest.fixture(scope="module")
def hf_beams(tiny_model):
    """transformers' ``n`` beams (output ids, best first) for ``PROMPT``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model("llama"), dtype=torch.float32).eval()

    def generate(n: int, max_tokens: int, **kwargs) -> list[list[int]]:
        ids = torch.tensor([PROMPT])
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, num_beams=n,
                                 num_return_sequences=n, max_new_tokens=max_tokens, return_dict_in_generate=True,
                                 **kwargs)
        lengths = (out.beam_indices >= 0).sum(dim=1).tolist()
        return [out.sequences[i, len(PROMPT):len(PROMPT) + lengths[i]].tolist() for i in range(n)]

    return generate


@pytest.fixture(autouse=True)
def idle_after(handle):
    yield
    assert_idle(handle)


def texts(frontend, beams: list[list[int]]) -> list[str]:
    return [frontend.tokenizer.decode([t for t in ids if t not in (2, 4)], skip_special_tokens=True)
            for ids in beams]


def test_http_completion_returns_the_n_best_beams(frontend, hf_beams):
    body = {"prompt": PROMPT, "max_tokens": 12, "n": 3, "use_beam_search": True, "length_penalty": 0.5}
    response = call(frontend, "POST", "/v1/completions", json=body)
    assert response.status_code == 200, response.text
    data = response.json()
    expected = hf_beams(3, 12, length_penalty=0.5)
    assert [c["index"] for c in data["choices"]] == [0, 1, 2]
    assert [c["text"] for c in data["choices"]] == texts(frontend, expected)
    assert data["usage"]["completion_tokens"] == sum(len(ids) for ids in expected)

    streamed = events(call(frontend, "POST", "/v1/completions", json={**body, "stream": True}))
    by_index: dict[int, str] = {}
    for event in streamed:
        for choice in event["choices"]:
            by_index[choice["index"]] = by_index.get(choice["index"], "") + choice["text"]
    assert [by_index[i] for i in range(3)] == texts(frontend, expected)

    same = call(frontend, "POST", "/v1/completions", json={**body, "best_of": 3, "temperature": 0}).json()
    assert [c["text"] for c in same["choices"]] == [c["text"] for c in data["choices"]]


def test_grpc_generate_agrees_with_http(frontend, stub, hf_beams):
    request = pb.GenerateRequest(prompt_token_ids=PROMPT, max_tokens=10, n=4, use_beam_search=True,
                                 length_penalty=2.0, early_stopping="never")
    reply = stub.Generate(request, timeout=60)
    expected = hf_beams(4, 10, length_penalty=2.0, early_stopping="never")
    assert [list(c.token_ids) for c in reply.choices] == expected
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    body = {"prompt": PROMPT, "max_tokens": 10, "n": 4, "use_beam_search": True, "length_penalty": 2.0,
            "early_stopping": "never"}
    http = call(frontend, "POST", "/v1/completions", json=body).json()
    assert [c["text"] for c in http["choices"]] == [c.text for c in reply.choices]
    streamed = list(stub.GenerateStream(request, timeout=60))
    assert sorted((c.index, list(c.token_ids)) for m in streamed for c in m.choices if c.token_ids) == \
        list(enumerate(expected))


@pytest.mark.parametrize("extra, param", [
    ({"temperature": 0.8}, "temperature"), ({"top_p": 0.5}, "top_p"), ({"logprobs": 2}, "logprobs"),
    ({"stop": ["x"]}, "stop"), ({"min_tokens": 2}, "min_tokens"), ({"presence_penalty": 0.3}, "presence_penalty"),
    ({"response_format": {"type": "json_object"}}, "structured_outputs"), ({"best_of": 4}, "best_of"),
    ({"early_stopping": "sometimes"}, None)])
def test_http_refuses_what_beam_search_cannot_honour(frontend, extra, param):
    body = {"prompt": PROMPT, "max_tokens": 4, "n": 2, "use_beam_search": True, **extra}
    error = assert_error(call(frontend, "POST", "/v1/completions", json=body), 400, param)
    assert error["message"]


def test_http_refuses_beam_fields_without_beam_search_and_in_chat(frontend):
    body = {"prompt": PROMPT, "max_tokens": 4, "length_penalty": 2.0}
    assert "use_beam_search" in assert_error(call(frontend, "POST", "/v1/completions", json=body), 400,
                                             "length_penalty")["message"]
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "n": 2, "use_beam_search": True}
    assert "use_beam_search" in assert_error(call(frontend, "POST", "/v1/chat/completions", json=chat),
                                             400)["message"]


def test_grpc_refuses_what_beam_search_cannot_honour(stub):
    for request in (pb.GenerateRequest(prompt_token_ids=PROMPT, n=2, use_beam_search=True, temperature=0.5),
                    pb.GenerateRequest(prompt_token_ids=PROMPT, n=2, use_beam_search=True, early_stopping="soon"),
                    pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content="hi")], n=2,
                                       use_beam_search=True)):
        with pytest.raises(grpc.RpcError) as info:
            stub.Generate(request, timeout=60)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
