"""Speculative decoding through the server: a worker with ``speculative_config`` (n-gram)
streams the greedy tokens of decoding without it, and its counters reach ``/metrics`` under
vLLM's names and ``pagedserve status`` as the mean acceptance length.

One Ray instance, one CPU worker and the Serve application, driven by the official
``openai`` client; the reference is the offline engine without speculation. After every
test the cluster is idle with no block in use.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from served_cluster import assert_idle, cluster_config, free_port, running_cluster  # noqa: E402

from pagedserve import LLM, SamplingParams  # noqa: E402

MODEL = "tiny-spec"
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
ENGINE = {"num_device_blocks": 256, "swap_space_gb": 0.001, "speculative_config": NGRAM}
# Greedy random models loop: prompt lookup finds the loops in their own output.
PROMPTS = [[5, 17, 301, 44, 9, 12, 700], [8, 8, 93, 260, 31], [400, 2, 77, 19, 5, 61, 88, 140, 3]]
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def served(tiny_model):
    from pagedserve.cluster.serving.deployment import deploy

    config = cluster_config(tiny_model("llama"), MODEL, ENGINE, num_workers=1, grpc_port=free_port())
    with running_cluster(config, num_cpus=2) as cluster:
        endpoints = deploy(cluster.handle, cluster.config, quiet=True)
        yield cluster.handle, endpoints["http"], endpoints["grpc"]


@pytest.fixture(autouse=True)
def idle_after(served):
    yield
    assert_idle(served[0])


def test_served_speculation_streams_the_tokens_of_decoding_without_it(served, tiny_model):
    llm = LLM(tiny_model("llama"), device="cpu", dtype="float32", swap_space_gb=0.001)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = [list(r.outputs[0].token_ids) for r in llm.generate(PROMPTS, params, use_tqdm=False)]
    client = openai.OpenAI(base_url=served[1] + "/v1", api_key="unused", max_retries=0, timeout=120)

    def stream(prompt: list[int]) -> tuple[list[int], int]:
        chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                                stream=True, extra_body={"ignore_eos": True,
                                                                         "return_token_ids": True}))
        pieces = [chunk.choices[0].token_ids for chunk in chunks if chunk.choices and chunk.choices[0].token_ids]
        return [t for piece in pieces for t in piece], max(len(piece) for piece in pieces)

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(pool.map(stream, PROMPTS))
    assert [tokens for tokens, _ in results] == expected
    assert max(widest for _, widest in results) > 1   # accepted proposals arrive with their step's token

    text = httpx.get(served[1] + "/metrics", timeout=30).text
    samples = {(s.name, s.labels.get("engine")): s.value for family in text_string_to_metric_families(text)
               for s in family.samples}
    worker = next(engine for name, engine in samples if name == "vllm:spec_decode_num_drafts_total")
    drafts = samples[("vllm:spec_decode_num_drafts_total", worker)]
    accepted = samples[("vllm:spec_decode_num_accepted_tokens_total", worker)]
    assert drafts > 0 and 0 < accepted <= samples[("vllm:spec_decode_num_draft_tokens_total", worker)]

    from pagedserve.cluster.launcher import format_status

    assert f"{worker}: speculative decoding: mean acceptance length" in format_status(served[0].stats())


def test_served_speculation_streams_each_accepted_tokens_logprobs(served, tiny_model):
    """A streamed request with logprobs speculates, and its chunks carry one logprob per token,
    those of decoding without speculation."""
    llm = LLM(tiny_model("llama"), device="cpu", dtype="float32", swap_space_gb=0.001)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    [reference] = llm.generate([PROMPTS[1]], params, use_tqdm=False)
    reference = reference.outputs[0]
    before = served[0].stats()["workers"]
    client = openai.OpenAI(base_url=served[1] + "/v1", api_key="unused", max_retries=0, timeout=120)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0,
                                            logprobs=1, stream=True, extra_body={"ignore_eos": True,
                                                                                 "return_token_ids": True}))
    choices = [chunk.choices[0] for chunk in chunks if chunk.choices and chunk.choices[0].token_ids]
    token_ids = [t for choice in choices for t in choice.token_ids]
    logprobs = [value for choice in choices for value in choice.logprobs.token_logprobs]
    assert token_ids == list(reference.token_ids) and len(logprobs) == len(token_ids)
    assert logprobs == pytest.approx([entry.logprob for entry in reference.logprobs], abs=1e-4)
    after = served[0].stats()["workers"]
    assert sum(w["spec_decode_num_drafts"] for w in after.values()) > \
        sum(w["spec_decode_num_drafts"] for w in before.values())


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_token_by_token_streams_an_event_per_accepted_token(api, served, tiny_model):
    """``stream_options.token_by_token``: every chunk carries one token, with its own text and
    logprob, and together they are what the request streams without it, stop strings included
    (cut at the same place); with beam search it is refused with a 400 naming it."""
    client = openai.OpenAI(base_url=served[1] + "/v1", api_key="unused", max_retries=0, timeout=120)
    before = served[0].stats()["workers"]
    extra = {"ignore_eos": True, "return_token_ids": True}

    def stream(token_by_token: bool) -> list:
        options = {"include_usage": True, "token_by_token": token_by_token}
        if api == "completions":
            chunks = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=MAX_TOKENS,
                                               temperature=0, logprobs=1, stream=True, stream_options=options,
                                               extra_body=extra)
        else:
            chunks = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "loop"}],
                                                    max_tokens=MAX_TOKENS, temperature=0, logprobs=True,
                                                    stream=True, stream_options=options, extra_body=extra)
        return [chunk for chunk in chunks if chunk.choices]

    def tokens(choice) -> list:
        """A chunk's tokens: their ids (completions), or their logprob entries (chat)."""
        if api == "completions":
            return choice.token_ids or []
        return choice.logprobs.content if choice.logprobs else []

    def text_and_logprobs(chunks: list) -> tuple[str, list[float]]:
        if api == "completions":
            return ("".join(c.choices[0].text for c in chunks),
                    [v for c in chunks if c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs])
        return ("".join(c.choices[0].delta.content or "" for c in chunks),
                [e.logprob for c in chunks for e in tokens(c.choices[0])])

    together, one_by_one = stream(False), stream(True)
    assert max(len(tokens(c.choices[0])) for c in together) > 1   # accepted proposals come together
    assert all(len(tokens(c.choices[0])) <= 1 for c in one_by_one)
    assert sum(len(tokens(c.choices[0])) for c in one_by_one) == MAX_TOKENS
    if api == "completions":
        assert [t for c in one_by_one for t in tokens(c.choices[0])] == \
            [t for c in together for t in tokens(c.choices[0])]
    text, logprobs = text_and_logprobs(one_by_one)
    assert text == text_and_logprobs(together)[0]
    assert logprobs == pytest.approx(text_and_logprobs(together)[1], abs=1e-4) and len(logprobs) == MAX_TOKENS
    assert one_by_one[-1].choices[0].finish_reason == "length"
    after = served[0].stats()["workers"]
    assert sum(w["spec_decode_num_accepted_tokens"] for w in after.values()) > \
        sum(w["spec_decode_num_accepted_tokens"] for w in before.values())

    if api == "completions":   # stop strings: found on the worker, and again where the text is decoded
        whole_text = text_and_logprobs(together)[0]
        stop = whole_text[len(whole_text) // 2:len(whole_text) // 2 + 3]
        assert len(stop) == 3

        def stopped(token_by_token: bool) -> list:
            return [chunk for chunk in client.completions.create(
                model=MODEL, prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0, stream=True, stop=[stop],
                stream_options={"token_by_token": token_by_token}, extra_body=extra) if chunk.choices]

        whole, single = stopped(False), stopped(True)
        assert all(len(tokens(c.choices[0])) <= 1 for c in single)
        assert "".join(c.choices[0].text for c in single) == "".join(c.choices[0].text for c in whole)
        assert stop not in "".join(c.choices[0].text for c in single)
        assert (single[-1].choices[0].finish_reason, single[-1].choices[0].stop_reason) == ("stop", stop)
        assert whole[-1].choices[0].stop_reason == stop

    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=8, stream=True, n=2,
                                  stream_options={"token_by_token": True}, extra_body={"use_beam_search": True})
    assert refused.value.body["param"] == "stream_options.token_by_token"
    assert "beam search" in refused.value.body["message"]


def test_grpc_streams_token_by_token_when_asked(served):
    """``token_by_token`` on ``GenerateStream`` and ``ChatStream``: a message per token, the
    same tokens and text as without it; with beam search, INVALID_ARGUMENT."""
    grpc = pytest.importorskip("grpc")
    from pagedserve.cluster.protos import pagedserve_pb2 as pb
    from pagedserve.cluster.protos import pagedserve_pb2_grpc as pb_grpc

    app = (("application", "pagedserve"),)
    with grpc.insecure_channel(served[2]) as channel:
        stub = pb_grpc.PagedServeStub(channel)
        request = pb.GenerateRequest(prompt_token_ids=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0,
                                     ignore_eos=True)
        together = [c for m in stub.GenerateStream(request, metadata=app, timeout=120) for c in m.choices]
        request.token_by_token = True
        one_by_one = [c for m in stub.GenerateStream(request, metadata=app, timeout=120) for c in m.choices]
        assert max(len(c.token_ids) for c in together) > 1
        assert all(len(c.token_ids) <= 1 for c in one_by_one)
        assert [t for c in one_by_one for t in c.token_ids] == [t for c in together for t in c.token_ids]
        assert "".join(c.text for c in one_by_one) == "".join(c.text for c in together)

        chat = pb.ChatRequest(messages=[pb.ChatMessage(role="user", content="loop")], max_tokens=MAX_TOKENS,
                              temperature=0, ignore_eos=True, logprobs=True)
        together = [c for m in stub.ChatStream(chat, metadata=app, timeout=120) for c in m.choices]
        chat.token_by_token = True
        one_by_one = [c for m in stub.ChatStream(chat, metadata=app, timeout=120) for c in m.choices]
        assert max(len(c.logprobs) for c in together) > 1 and all(len(c.logprobs) <= 1 for c in one_by_one)
        assert "".join(c.content for c in one_by_one) == "".join(c.content for c in together)

        request.use_beam_search, request.n = True, 2
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.GenerateStream(request, metadata=app, timeout=60))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "token_by_token" in refused.value.details()


def test_a_beam_search_is_refused_with_a_400_naming_use_beam_search(served):
    """vLLM's ``use_beam_search`` on a server that speculates: refused up front, naming the field
    (the engine refuses it too, offline); the server serves the next request as before."""
    client = openai.OpenAI(base_url=served[1] + "/v1", api_key="unused", max_retries=0, timeout=120)
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, n=2,
                                  extra_body={"use_beam_search": True})
    error = refused.value.body
    assert refused.value.status_code == 400 and error["param"] == "use_beam_search"
    assert "speculative decoding" in error["message"]
    after = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0)
    assert after.choices[0].finish_reason == "length"
