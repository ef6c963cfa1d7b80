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
from served_cluster import assert_idle, cluster_config, running_cluster  # noqa: E402

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

    config = cluster_config(tiny_model("llama"), MODEL, ENGINE, num_workers=1)
    with running_cluster(config, num_cpus=2) as cluster:
        endpoints = deploy(cluster.handle, cluster.config, quiet=True)
        yield cluster.handle, endpoints["http"]


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
