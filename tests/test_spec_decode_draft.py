"""Speculative decoding with a draft model (``speculative_config`` method "draft_model").

The draft's KV lives in the target's blocks. A self-draft (the target as its own draft)
proposes exactly the target's greedy tokens, so every proposal is accepted if, and only if,
the draft's KV is right at every position: after prefill, across block boundaries, through
prefix hits, swaps, recompute and KV transfers. A different draft (``tiny-draft``) shows that
the output stays exact whatever is proposed. Every engine's KV accounting is checked after
every step, and ends each test holding no block.
"""

from __future__ import annotations

import random

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.devtools.model_factory import ensure_model
from pagedserve.workers.engine.kv_transfer import export_kv
from pagedserve.workers.spec_decode.config import SpeculativeConfig
from offline_checks import assert_idle

pytestmark = pytest.mark.usefixtures("one_torch_thread")

K = 4
MAX_TOKENS = 24


def random_prompts(lengths, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 1024) for _ in range(n)] for n in lengths]


def greedy(max_tokens: int = MAX_TOKENS, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def outputs_of(results) -> list[list[int]]:
    return [list(completion.token_ids) for result in results for completion in result.outputs]


def draft_config(model: str, **kwargs) -> dict:
    return {"method": "draft_model", "model": model, "num_speculative_tokens": K, **kwargs}


@pytest.fixture(scope="module")
def make_llm(tiny_model):
    """``make_llm(arch, draft=None | "self" | "tiny-draft", **engine_kwargs) -> LLM``, shared per
    configuration, its KV accounting checked after every step."""
    shared: dict[tuple, LLM] = {}

    def make(arch: str = "llama", draft: str | None = "self", **kwargs) -> LLM:
        kwargs.setdefault("device", "cpu")
        kwargs.setdefault("dtype", "float32")
        kwargs.setdefault("swap_space_gb", 0.001)
        kwargs.setdefault("num_device_blocks", 4096 // kwargs.get("block_size", 16))
        if draft is not None:
            model = tiny_model(arch) if draft == "self" else str(ensure_model(arch, draft))
            kwargs.setdefault("speculative_config", draft_config(model))
        key = (arch, draft, repr(sorted(kwargs.items(), key=lambda item: item[0])))
        if key not in shared:
            llm = LLM(tiny_model(arch), **kwargs)
            llm.engine.step_hooks.append(llm.engine.check_integrity)
            shared[key] = llm
        return shared[key]

    make.instances = shared
    make.target = tiny_model
    return make


@pytest.fixture(autouse=True)
def no_leaks(make_llm):
    yield
    for llm in make_llm.instances.values():
        assert_idle(llm)


def counts(llm: LLM) -> tuple[int, int]:
    """Proposed and accepted tokens so far."""
    stats = llm.stats()
    return stats["spec_decode_num_draft_tokens"], stats["spec_decode_num_accepted_tokens"]


def generate_all_accepted(llm: LLM, prompts, params) -> list[list[int]]:
    """Generate, and check that the draft proposed and every proposal was accepted."""
    proposed, accepted = counts(llm)
    outputs = outputs_of(llm.generate(prompts, params, use_tqdm=False))
    new_proposed, new_accepted = counts(llm)
    assert new_proposed > proposed
    assert new_accepted - accepted == new_proposed - proposed
    return outputs


# ---- a self-draft: every proposal accepted, outputs exact --------------------------------------

@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2", "mistral", "qwen3_moe"])
def test_self_draft_accepts_everything_and_matches_transformers(arch, make_llm, hf_greedy):
    llm = make_llm(arch)
    prompts = random_prompts((3, 15, 16, 17, 33, 50), seed=1)
    outputs = generate_all_accepted(llm, prompts, greedy())
    for prompt, output in zip(prompts, outputs):
        assert output == hf_greedy(arch, prompt, MAX_TOKENS)
    stats = llm.stats()
    assert stats["spec_decode_mean_acceptance_length"] > 3.5
    assert stats["spec_decode_draft_kv_tokens"] > 0


def test_a_draft_verified_on_padded_rows(make_llm, hf_greedy):
    """Verification steps on the padded buffers CUDA graphs replay (run eagerly here), of a
    self-draft's proposals (every one kept): transformers' tokens."""
    llm = make_llm("llama", block_size=4, max_num_seqs=8)   # an engine of its own: padded from now on
    engine = llm.engine
    max_blocks = -(-engine.max_model_len // 4)
    assert engine.runner.enable_decode_graphs([1, 2, 4, 8], max_blocks, capture=False)
    assert engine.runner.enable_verify_graphs([1, 2, 4, 8], max_blocks, K + 1, capture=False)
    prompts = random_prompts((3, 15, 16, 17, 33, 50), seed=7)
    outputs = outputs_of(llm.generate(prompts, greedy(), use_tqdm=False))
    assert outputs == [hf_greedy("llama", p, MAX_TOKENS) for p in prompts]
    stats = llm.stats()
    assert stats["num_padded_verification_steps"] > 0 and stats["spec_decode_num_accepted_tokens"] > 0


@pytest.mark.parametrize("block_size", [4, 8])
def test_self_draft_across_block_boundaries_and_chunked_prefill(block_size, make_llm, hf_greedy):
    """Small blocks put the last token at every offset of its block (the scratch copy), and
    a small token budget chunks prompts and cuts verifications short."""
    llm = make_llm("llama", block_size=block_size, max_num_batched_tokens=24)
    prompts = random_prompts((5, 9, 30, 41), seed=2)
    outputs = outputs_of(llm.generate(prompts, greedy(), use_tqdm=False))
    assert outputs == [hf_greedy("llama", p, MAX_TOKENS) for p in prompts]
    proposed, accepted = counts(llm)
    assert proposed > 0 and accepted == proposed


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_self_draft_keeps_its_kv_through_preemption_and_prefix_hits(mode, make_llm, hf_greedy):
    """Swaps move the draft's KV with the target's, recompute recomputes it, and a prefix hit
    finds it in the cached blocks: the self-draft still accepts every proposal."""
    llm = make_llm("llama", block_size=8, num_device_blocks=20, preemption_mode=mode, enable_prefix_caching=True)
    prompts = random_prompts((10, 35, 60, 22, 47, 13, 58, 30), seed=10)
    prompts[3] = prompts[1][:24] + prompts[3]   # a shared prefix: cache hits
    reference = [hf_greedy("llama", p, MAX_TOKENS) for p in prompts]
    assert generate_all_accepted(llm, prompts, greedy()) == reference
    assert llm.stats()["num_preemptions_by_mode"][mode] > 0
    assert generate_all_accepted(llm, prompts, greedy()) == reference
    assert llm.stats()["prefix_cache_hit_rate"] > 0


def test_self_draft_computes_its_kv_after_a_transfer(make_llm, hf_greedy):
    """A request that continues from transferred KV (migration, disaggregated prefill) gets
    the target's layers only; the draft computes its own, and accepts everything after."""
    source, target = make_llm("llama", draft=None, block_size=8), make_llm("llama", block_size=8)
    prompt = random_prompts((29,), seed=3)[0]
    engine = source.engine
    engine.add_request("src", prompt, greedy())
    while len(engine.requests["src"].seqs[0].output_token_ids) < 5:
        engine.step()
    seq = engine.requests["src"].seqs[0]
    transfer = export_kv(engine.runner.kv_cache, seq.block_table, seq.num_computed, seq.token_ids)
    done = list(seq.output_token_ids)
    engine.abort_request("src")
    engine.step()
    proposed, accepted = counts(target)
    computed = target.stats()["spec_decode_draft_kv_tokens"]
    target.engine.add_request("dst", prompt, greedy(), kv_transfer=transfer, output_token_ids=done)
    final = None
    while target.engine.has_unfinished_requests():
        for output in target.engine.step():
            final = output
    assert list(final.outputs[0].token_ids) == hf_greedy("llama", prompt, MAX_TOKENS)
    # The draft computed the transferred positions, then each step's new ones: every position once.
    assert target.stats()["spec_decode_draft_kv_tokens"] - computed < len(prompt) + MAX_TOKENS
    new_proposed, new_accepted = counts(target)
    assert new_proposed > proposed and new_accepted - accepted == new_proposed - proposed


def test_the_draft_costs_nothing_until_a_sequence_proposes(make_llm, hf_greedy):
    """Its KV is computed when a sequence proposes: sequences that never do (the batch holds
    ``disable_by_batch_size`` of them to the end) never run it; a lone one then catches up
    on its whole prompt and proposes, every proposal right."""
    llm = make_llm("llama", speculative_config=draft_config(make_llm.target("llama"), disable_by_batch_size=2))
    prompts = random_prompts((12, 12, 12), seed=5)
    before = llm.stats()
    assert outputs_of(llm.generate(prompts, greedy(), use_tqdm=False)) == [
        hf_greedy("llama", p, MAX_TOKENS) for p in prompts]
    after = llm.stats()
    assert after["spec_decode_draft_kv_tokens"] == before["spec_decode_draft_kv_tokens"]
    assert after["spec_decode_num_drafts"] == before["spec_decode_num_drafts"]
    assert after["spec_decode_num_disabled_steps"] > before["spec_decode_num_disabled_steps"]
    assert generate_all_accepted(llm, prompts[:1], greedy()) == [hf_greedy("llama", prompts[0], MAX_TOKENS)]
    assert llm.stats()["spec_decode_draft_kv_tokens"] > after["spec_decode_draft_kv_tokens"] + len(prompts[0])


def test_overlapped_scheduling_with_a_draft_model(make_llm, hf_greedy):
    """With async_scheduling, a batch at ``disable_by_batch_size`` overlaps its steps and runs
    no draft; as it shrinks, steps read their ids at once and the self-draft proposes (and
    catches up on what it skipped), every proposal right."""
    llm = make_llm("llama", async_scheduling=True,
                   speculative_config=draft_config(make_llm.target("llama"), disable_by_batch_size=3))
    prompts = random_prompts((8, 20, 5, 11, 30), seed=6)
    lengths = (24, 6, 9, 12, 24)
    before = llm.stats()
    outputs = outputs_of(llm.generate(prompts, [greedy(n) for n in lengths], use_tqdm=False))
    assert outputs == [hf_greedy("llama", p, n) for p, n in zip(prompts, lengths)]
    after = llm.stats()
    assert after["num_overlapped_steps"] > before["num_overlapped_steps"]
    proposed = after["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
    assert proposed > 0
    assert after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"] == proposed


# ---- another draft: whatever it proposes, the output is exact -----------------------------------

@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_smaller_draft_gives_the_target_greedy_output(arch, make_llm, hf_greedy):
    llm = make_llm(arch, draft="tiny-draft")
    prompts = random_prompts((4, 17, 40), seed=4)
    proposed, _ = counts(llm)
    outputs = outputs_of(llm.generate(prompts, greedy(), use_tqdm=False))
    assert outputs == [hf_greedy(arch, p, MAX_TOKENS) for p in prompts]
    assert counts(llm)[0] > proposed


@pytest.mark.parametrize("draft", ["self", "tiny-draft"])
@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.8, seed=11, max_tokens=MAX_TOKENS),
    SamplingParams(temperature=1.3, top_k=20, top_p=0.9, seed=12, max_tokens=MAX_TOKENS, min_tokens=5),
], ids=["temperature", "top-k-top-p"])
def test_seeded_sampling_gives_the_tokens_of_decoding_without_speculation(draft, params, make_llm):
    base, llm = make_llm("llama", draft=None), make_llm("llama", draft=draft)
    prompts = random_prompts((5, 21, 40), seed=14)
    expected = outputs_of(base.generate(prompts, params, use_tqdm=False))
    proposed, _ = counts(llm)
    assert outputs_of(llm.generate(prompts, params, use_tqdm=False)) == expected
    assert counts(llm)[0] > proposed


# ---- the pool and the config -------------------------------------------------------------------

def test_the_draft_kv_is_counted_in_the_pool_budget(tiny_model):
    """With a memory budget, each block costs the target's bytes and the draft's, and the
    draft's scratch comes off the budget first."""
    kwargs = dict(device="cpu", dtype="float32", swap_space_gb=0.001, kv_cache_memory_gb=0.01, max_num_seqs=8)
    plain = LLM(tiny_model("llama"), **kwargs)
    llm = LLM(tiny_model("llama"), speculative_config=draft_config(tiny_model("llama")), **kwargs)
    target_bytes = plain.engine.runner.kv_cache.shape.bytes_per_block
    draft = llm.engine.draft
    draft_bytes = draft.cache.shape.bytes_per_block
    assert draft_bytes == target_bytes   # the self-draft's layers are the target's
    budget = 0.01 * 2**30
    assert llm.engine.pool_config.num_device_blocks == int((budget - draft.scratch_bytes(16, 8))
                                                           // (target_bytes + draft_bytes))
    assert draft.cache.num_device_blocks == llm.engine.pool_config.num_device_blocks + 8 * draft.kv.blocks_per_seq
    assert llm.stats()["spec_decode_draft_kv_bytes_per_block"] == draft_bytes


def test_the_method_follows_the_model_and_needs_one():
    assert SpeculativeConfig(model="/some/draft", num_speculative_tokens=3).method == "draft_model"
    assert SpeculativeConfig(model="[ngram]", num_speculative_tokens=3).method == "ngram"
    with pytest.raises(ValueError, match="needs model"):
        SpeculativeConfig(method="draft_model", num_speculative_tokens=3)
    with pytest.raises(ValueError, match="takes no model"):
        SpeculativeConfig(method="ngram", model="/some/draft", num_speculative_tokens=3)
    with pytest.raises(ValueError, match="mtp.*not supported yet"):
        SpeculativeConfig(method="mtp", model="/some/head", num_speculative_tokens=3)


def test_a_draft_with_another_vocabulary_is_refused(tiny_model):
    other = str(ensure_model("llama", "small-draft"))   # 2048 tokens; tiny has 1024
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(tiny_model("llama"), device="cpu", dtype="float32", num_device_blocks=64,
            speculative_config=draft_config(other))

