"""Speculative decoding with a draft model through the server: a worker whose engine core
speculates with a draft model (here the target itself, so that every proposal is right).

One Ray instance, one CPU worker and the Serve application, driven by the official
``openai`` client; the reference is the offline engine without speculation.
"""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")

from served_cluster import assert_idle, cluster_config, running_cluster  # noqa: E402

from pagedserve import LLM, SamplingParams  # noqa: E402

MODEL = "tiny-draft-spec"
PROMPTS = [[5, 17, 301, 44, 9, 12, 700], [8, 8, 93, 260, 31], [400, 2, 77, 19, 5, 61, 88, 140, 3]]
MAX_TOKENS = 48


def test_a_worker_with_a_draft_model_streams_exact_tokens_and_shows_its_draft(tiny_model):
    """A worker whose engine core speculates with a draft model (here the target itself, so
    that every proposal is right): exact tokens over HTTP, every proposal accepted, and the
    draft's share of each block in ``pagedserve status``."""
    from pagedserve.cluster.launcher import format_status
    from pagedserve.cluster.serving.deployment import deploy

    draft = {"model": tiny_model("llama"), "num_speculative_tokens": 3}
    engine = {"num_device_blocks": 256, "swap_space_gb": 0.001, "speculative_config": draft}
    config = cluster_config(tiny_model("llama"), MODEL, engine, num_workers=1)
    llm = LLM(tiny_model("llama"), device="cpu", dtype="float32", swap_space_gb=0.001)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = [list(r.outputs[0].token_ids) for r in llm.generate(PROMPTS, params, use_tqdm=False)]
    with running_cluster(config, num_cpus=2) as cluster:
        endpoint = deploy(cluster.handle, cluster.config, quiet=True)["http"]
        client = openai.OpenAI(base_url=endpoint + "/v1", api_key="unused", max_retries=0, timeout=120)
        for prompt, tokens in zip(PROMPTS, expected):
            completion = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                                   extra_body={"ignore_eos": True, "return_token_ids": True})
            assert completion.choices[0].token_ids == tokens
        stats = cluster.handle.stats()
        (worker_id, worker), = stats["workers"].items()
        assert worker["spec_decode_num_draft_tokens"] > 0
        assert worker["spec_decode_num_accepted_tokens"] == worker["spec_decode_num_draft_tokens"]
        assert f"{worker_id}: draft model {tiny_model('llama')}: its KV takes" in format_status(stats)
        assert_idle(cluster.handle)
