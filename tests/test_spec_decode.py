"""Speculative decoding end to end, on tiny random checkpoints.

Greedy output with speculation must be token-identical to decoding without it, and so to
transformers; seeded sampling gives the same tokens too (each position draws the uniform its
output number would have drawn); the rejection sampler's output follows the target's
distribution. The KV manager's integrity is checked after every step of every engine here, and
every engine ends each test holding no block.
"""

from __future__ import annotations

import dataclasses
import random
from collections import Counter

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.bench.scripted_proposer import ScriptedProposer
from pagedserve.workers.sample.sampler import Sampler, SamplingBatch, processed_probs
from pagedserve.workers.spec_decode.speculator import reason_not_speculating
from pagedserve.workers.spec_decode.verifier import num_accepted, verify
from offline_checks import assert_idle

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAX_TOKENS = 24
FIRST_ORDINARY_ID = 5
VOCAB_SIZE = 1024
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def random_prompts(lengths, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(FIRST_ORDINARY_ID, VOCAB_SIZE) for _ in range(n)] for n in lengths]


def greedy(max_tokens: int = MAX_TOKENS, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)


@pytest.fixture(scope="module")
def make_llm(tiny_model):
    """``make_llm(arch="llama", speculative=True, **engine_kwargs) -> LLM``, shared per
    configuration, its KV accounting checked after every step."""
    shared: dict[tuple, LLM] = {}
    ngram: dict[tuple, object] = {}

    def make(arch: str = "llama", speculative: bool = True, **kwargs) -> LLM:
        kwargs.setdefault("device", "cpu")
        kwargs.setdefault("dtype", "float32")
        kwargs.setdefault("swap_space_gb", 0.001)
        kwargs.setdefault("num_device_blocks", 4096 // kwargs.get("block_size", 16))
        if speculative:
            kwargs.setdefault("speculative_config", NGRAM)
        key = (arch, repr(sorted(kwargs.items())))
        if key not in shared:
            llm = LLM(tiny_model(arch), **kwargs)
            llm.engine.step_hooks.append(llm.engine.check_integrity)
            shared[key] = llm
            ngram[key] = llm.engine.speculator and llm.engine.speculator.proposer
        llm = shared[key]
        if llm.engine.speculator is not None:
            llm.engine.speculator.proposer = ngram[key]   # each test starts with n-gram
        return llm

    make.instances = shared
    return make


@pytest.fixture(autouse=True)
def no_leaks(make_llm):
    yield
    for llm in make_llm.instances.values():
        assert_idle(llm)


def outputs_of(results) -> list[list[int]]:
    return [list(completion.token_ids) for result in results for completion in result.outputs]


def script(llm: LLM, prompts, reference, num_right: int | None = None, seed: int = 0) -> None:
    """Make ``llm`` propose ``reference`` outputs (one per prompt), ``num_right`` right each time
    (None: a random number each time)."""
    engine = llm.engine
    engine.speculator.proposer = ScriptedProposer({tuple(p): r for p, r in zip(prompts, reference)},
                                                  engine.config.speculative_config.num_speculative_tokens,
                                                  num_right, engine.runner.vocab_size, seed)


def drafts(llm: LLM) -> tuple[int, int]:
    stats = llm.stats()
    return stats["spec_decode_num_drafts"], stats["spec_decode_num_accepted_tokens"]


# ---- greedy: token-identical -----------------------------------------------------------------

@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2"])
def test_greedy_ngram_matches_transformers(arch, make_llm, hf_greedy):
    llm = make_llm(arch)
    prompts = random_prompts((3, 7, 16, 17, 32, 50), seed=1)
    before = drafts(llm)
    results = llm.generate(prompts, greedy(), use_tqdm=False)
    for prompt, output in zip(prompts, outputs_of(results)):
        assert output == hf_greedy(arch, prompt, MAX_TOKENS)
    assert drafts(llm)[0] > before[0]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("block_size", [4, 16])
def test_greedy_with_any_acceptance_matches_transformers(arch, block_size, make_llm, hf_greedy):
    """Proposals right for a random number of positions (0..k) each step: every acceptance
    length, across block boundaries, gives transformers' tokens."""
    llm = make_llm(arch, block_size=block_size)
    prompts = random_prompts((3, 7, 16, 17, 31, 50), seed=2)
    reference = [hf_greedy(arch, p, MAX_TOKENS) for p in prompts]
    script(llm, prompts, reference)
    assert outputs_of(llm.generate(prompts, greedy(), use_tqdm=False)) == reference
    per_pos = llm.stats()["spec_decode_num_accepted_tokens_per_pos"]
    assert len(per_pos) == 4 and per_pos[3] > 0


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_greedy_under_preemption_with_prefix_caching(mode, make_llm, hf_greedy):
    # 20 blocks of 8 tokens: one sequence always fits, all eight at once never do.
    llm = make_llm("llama", block_size=8, num_device_blocks=20, preemption_mode=mode, enable_prefix_caching=True)
    prompts = random_prompts((10, 35, 60, 22, 47, 13, 58, 30), seed=10)
    prompts[3] = prompts[1][:24] + prompts[3]   # a shared prefix: cache hits
    reference = [hf_greedy("llama", p, MAX_TOKENS) for p in prompts]
    script(llm, prompts, reference, seed=3)
    assert outputs_of(llm.generate(prompts, greedy(), use_tqdm=False)) == reference
    stats = llm.stats()
    assert stats["num_preemptions_by_mode"][mode] > 0 and stats["spec_decode_num_accepted_tokens"] > 0
    # Again: the accepted tokens' blocks were indexed, and a hit on them gives the same outputs.
    assert outputs_of(llm.generate(prompts, greedy(), use_tqdm=False)) == reference
    assert llm.stats()["prefix_cache_hit_rate"] > 0


def test_samples_sharing_blocks_copy_before_proposals_write(make_llm, hf_greedy):
    llm = make_llm("llama", block_size=4)
    prompts = random_prompts((9, 14), seed=4)
    reference = [hf_greedy("llama", p, MAX_TOKENS) for p in prompts]
    script(llm, prompts, reference, seed=5)
    results = llm.generate(prompts, greedy(n=3), use_tqdm=False)
    assert outputs_of(results) == [reference[0]] * 3 + [reference[1]] * 3
    assert llm.stats()["num_cow_copies"] > 0


def test_chunked_prefill_and_a_small_budget(make_llm, hf_greedy):
    """A step's token budget cuts verification chunks short; what is cut is rolled back."""
    llm = make_llm("qwen3", max_num_batched_tokens=16, block_size=8)
    prompts = random_prompts((9, 41, 27, 60, 15, 33), seed=11)
    reference = [hf_greedy("qwen3", p, MAX_TOKENS) for p in prompts]
    script(llm, prompts, reference, num_right=4)
    assert outputs_of(llm.generate(prompts, greedy(), use_tqdm=False)) == reference


def test_contiguous_allocation(make_llm, hf_greedy):
    llm = make_llm("llama", allocation="contiguous", max_model_len=128, num_device_blocks=64)
    prompts = random_prompts((5, 30, 17), seed=12)
    reference = [hf_greedy("llama", p, MAX_TOKENS) for p in prompts]
    script(llm, prompts, reference, seed=6)
    assert outputs_of(llm.generate(prompts, greedy(), use_tqdm=False)) == reference


# ---- finishes inside an accepted run ------------------------------------------------------------

def test_max_tokens_stop_tokens_and_min_tokens_end_where_they_would(make_llm):
    """Every proposal right (k = 4): a finish inside an accepted run ends the output there,
    exactly as one token a step would, and the tokens after it are dropped."""
    base, llm = make_llm("llama", speculative=False), make_llm("llama")
    prompts = random_prompts((6, 19, 33), seed=13)
    plain = outputs_of(base.generate(prompts, greedy(40), use_tqdm=False))
    cases = [greedy(7), greedy(9), greedy(40, stop_token_ids=[plain[0][5], plain[1][10], plain[2][3]]),
             greedy(40, stop_token_ids=[plain[0][5]], ignore_eos=True),
             greedy(30, logit_bias={plain[0][4]: -100.0}), greedy(30, allowed_token_ids=sorted(set(plain[1])))]
    for params in cases:
        expected = base.generate(prompts, params, use_tqdm=False)
        reference = outputs_of(base.generate(prompts, greedy(40), use_tqdm=False))
        script(llm, prompts, outputs_of(expected) if params.logit_bias or params.allowed_token_ids
               or params.min_tokens else reference, num_right=4)
        got = llm.generate(prompts, params, use_tqdm=False)
        assert outputs_of(got) == outputs_of(expected), params
        assert [o.outputs[0].finish_reason for o in got] == [o.outputs[0].finish_reason for o in expected]


@pytest.mark.parametrize("index", [2, 4])
def test_min_tokens_bans_stop_tokens_only_at_the_positions_before_it(index, make_llm):
    """A stop token the target would pick at output ``index``: banned there when that is
    before ``min_tokens`` (4), ending the output there when it is not. The first verification
    (outputs 1..5, k = 4) crosses min_tokens: its positions differ in their bans."""
    base, llm = make_llm("llama", speculative=False), make_llm("llama")
    prompts = random_prompts((6, 19, 33), seed=13)
    plain = outputs_of(base.generate(prompts, greedy(40), use_tqdm=False))
    params = [greedy(40, stop_token_ids=[output[index]], min_tokens=4) for output in plain]
    expected = base.generate(prompts, params, use_tqdm=False)
    reasons = [(o.outputs[0].finish_reason, len(o.outputs[0].token_ids)) for o in expected]
    if index >= 4:
        assert ("stop", index + 1) in reasons
    else:
        assert outputs_of(expected) != plain
    script(llm, prompts, outputs_of(expected), num_right=4)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert outputs_of(got) == outputs_of(expected)
    assert [(o.outputs[0].finish_reason, len(o.outputs[0].token_ids)) for o in got] == reasons


def test_stop_strings_and_streaming_see_the_same_text(make_llm):
    base, llm = make_llm("llama", speculative=False), make_llm("llama")
    prompt = "the cat sat on the mat and the cat sat on the"
    plain = base.generate([prompt], greedy(30), use_tqdm=False)[0].outputs[0]
    stop = plain.text[len(plain.text) // 2:len(plain.text) // 2 + 3]
    expected = base.generate([prompt], greedy(30, stop=[stop]), use_tqdm=False)[0].outputs[0]
    llm.engine.speculator.proposer = ScriptedProposer(
        {tuple(llm.get_tokenizer().encode(prompt)): plain.token_ids}, 4, 4, llm.engine.runner.vocab_size)
    got = llm.generate([prompt], greedy(30, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert (got.text, got.token_ids, got.finish_reason) == (expected.text, expected.token_ids, expected.finish_reason)
    # Streamed step by step: several tokens arrive in one step, and the deltas add up.
    engine = llm.engine
    engine.add_request("streamed", prompt, greedy(30))
    texts, tokens = [], []
    while engine.has_unfinished_requests():
        for output in engine.step():
            texts.append(output.outputs[0].text)
            tokens.append(len(output.outputs[0].token_ids))
    assert texts[-1] == plain.text and tokens[-1] == len(plain.token_ids)
    assert max(b - a for a, b in zip(tokens, tokens[1:])) > 1


# ---- verification steps on the padded static buffers that CUDA graphs replay -------------------

def padded(llm: LLM, sizes=(1, 2, 4, 8)) -> LLM:
    """``llm`` with its decode and verification steps on the padded buffers (run eagerly here;
    CUDA graphs replay them on a GPU)."""
    engine = llm.engine
    runner = engine.runner
    if runner.verify_graphs is None:
        max_blocks = -(-engine.max_model_len // engine.config.block_size)
        assert runner.enable_decode_graphs(list(sizes), max_blocks, capture=False)
        query_len = engine.config.speculative_config.num_speculative_tokens + 1
        assert runner.enable_verify_graphs(list(sizes), max_blocks, query_len, capture=False)
    return llm


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("block_size", [4, 16])
def test_padded_verification_gives_transformers_tokens(arch, block_size, make_llm, hf_greedy):
    """Scripted proposals of every acceptance length, verified on padded rows (4 queries a
    sequence, fewer used where a sequence proposes less, padding sequences up to the size):
    transformers' tokens; a batch over the largest padded size verifies eagerly."""
    llm = padded(make_llm(arch, block_size=block_size, max_model_len=96), sizes=(1, 2, 4))
    prompts = random_prompts((3, 7, 16, 17, 31, 50), seed=21)
    reference = [hf_greedy(arch, p, MAX_TOKENS) for p in prompts]
    script(llm, prompts, reference)
    before = llm.stats()
    assert outputs_of(llm.generate(prompts, greedy(), use_tqdm=False)) == reference
    after = llm.stats()
    verified = after["num_padded_verification_steps"] - before["num_padded_verification_steps"]
    assert verified > 0 and after["num_padded_verification_rows"] > before["num_padded_verification_rows"]
    assert after["spec_decode_num_drafts"] - before["spec_decode_num_drafts"] > verified   # some eager: 6 > 4
    assert after["num_verification_graph_replays"] == 0   # the CPU runs the padded forward eagerly


def test_padded_verification_near_the_context_end_and_with_samples(make_llm, hf_greedy):
    """Sequences that run to max_model_len (a padded row's position past it) and sampled
    requests (the sampler reads each real row's logits) verify on padded rows too."""
    llm = padded(make_llm(block_size=4, max_model_len=40))
    prompts = random_prompts((30, 36, 12), seed=22)
    reference = [hf_greedy("llama", p, 40 - len(p)) for p in prompts]
    script(llm, prompts, reference)
    assert outputs_of(llm.generate(prompts, [greedy(40 - len(p)) for p in prompts], use_tqdm=False)) == reference
    base = make_llm(speculative=False)
    params = SamplingParams(temperature=0.9, top_k=30, seed=23, max_tokens=MAX_TOKENS)
    expected = outputs_of(base.generate(prompts[2:], params, use_tqdm=False))
    script(llm, prompts[2:], expected, seed=5)
    steps = llm.stats()["num_padded_verification_steps"]
    assert outputs_of(llm.generate(prompts[2:], params, use_tqdm=False)) == expected
    assert llm.stats()["num_padded_verification_steps"] > steps


def test_padded_verification_through_the_triton_kernels(make_llm, hf_greedy):
    """The Triton kernels CUDA runs (interpreted here) on the padded verification rows:
    transformers' tokens."""
    pytest.importorskip("triton")
    llm = padded(make_llm(kernel_backend="triton", block_size=8, max_model_len=64), sizes=(2, 4))
    prompts = random_prompts((5, 19, 12), seed=25)
    reference = [hf_greedy("llama", p, 12) for p in prompts]
    script(llm, prompts, reference)
    assert outputs_of(llm.generate(prompts, greedy(12), use_tqdm=False)) == reference
    assert llm.stats()["num_padded_verification_steps"] > 0


def test_padded_verification_writes_only_the_real_rows_kv(make_llm):
    """A verification step of 3 sequences on 4 padded ones: the KV slots written are exactly
    those of each sequence's last token and proposals."""
    llm = padded(make_llm(block_size=4, enable_prefix_caching=False), sizes=(4,))
    engine = llm.engine
    runner = engine.runner
    prompts = random_prompts((6, 11, 3), seed=24)
    script(llm, prompts, [[7] * MAX_TOKENS] * 3, num_right=0)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"v{i}", prompt, greedy(8, ignore_eos=True))
    engine.step()   # the prompts
    caches = runner.kv_cache.device_caches
    before = [k.clone() for k, _ in caches]
    expected: set[int] = set()
    graphs = runner.verify_graphs
    run, runs = graphs.run, graphs.num_runs

    def recorded(model_input, pending_tokens=None):
        host = runner.block_tables.host   # the step's tables, written before the run
        for row, start, count in zip(model_input.rows, model_input.starts, model_input.num_tokens):
            expected.update(int(host[row, p // 4]) * 4 + p % 4 for p in range(start, start + count))
        return run(model_input, pending_tokens)

    graphs.run = recorded
    try:
        engine.step()   # verification: each sequence's last token and its 4 proposals
    finally:
        del graphs.run
    assert graphs.num_runs == runs + 1 and len(expected) == 3 * 5
    for (k, _), old in zip(caches, before):
        changed = set((k != old).flatten(2).any(-1).flatten().nonzero().squeeze(1).tolist())
        assert changed == expected
    while engine.has_unfinished_requests():
        engine.step()


# ---- sampling --------------------------------------------------------------------------------

@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.8, seed=11, max_tokens=MAX_TOKENS),
    SamplingParams(temperature=1.3, top_k=20, top_p=0.9, seed=12, max_tokens=MAX_TOKENS),
    SamplingParams(temperature=0.7, min_p=0.05, seed=13, max_tokens=MAX_TOKENS, min_tokens=5),
], ids=["temperature", "top-k-top-p", "min-p"])
def test_seeded_sampling_gives_the_tokens_of_decoding_without_speculation(params, make_llm):
    base, llm = make_llm("llama", speculative=False), make_llm("llama")
    prompts = random_prompts((5, 21, 40), seed=14)
    expected = outputs_of(base.generate(prompts, params, use_tqdm=False))
    script(llm, prompts, expected, seed=7)
    assert outputs_of(llm.generate(prompts, params, use_tqdm=False)) == expected
    assert outputs_of(llm.generate(prompts, params, use_tqdm=False)) == expected   # and again


def test_unseeded_sampling_speculates_and_ends_clean(make_llm):
    llm = make_llm("llama")
    prompts = random_prompts((5, 21), seed=15)
    before = drafts(llm)[0]
    results = llm.generate(prompts * 4, SamplingParams(temperature=0.5, max_tokens=MAX_TOKENS), use_tqdm=False)
    assert all(len(output) == MAX_TOKENS or output[-1] in (2, 4) for output in outputs_of(results))
    assert drafts(llm)[0] > before


def total_variation(counts: Counter, probs: torch.Tensor, num: int) -> float:
    observed = torch.zeros_like(probs)
    for token, count in counts.items():
        observed[token] = count / num
    return 0.5 * float((observed - probs).abs().sum())


@pytest.mark.parametrize("kwargs", [
    {"temperature": 1.0}, {"temperature": 0.7, "top_k": 5}, {"temperature": 1.2, "top_p": 0.8},
    {"temperature": 0.9, "min_p": 0.1}, {"temperature": 1.5, "top_k": 6, "top_p": 0.9, "min_p": 0.02},
], ids=["t", "top-k", "top-p", "min-p", "all"])
def test_the_rejection_sampler_keeps_the_target_distribution(kwargs):
    """Two proposals per sequence on a vocabulary of 12, many sequences at once: the first
    output follows p0, the second (where the first proposal was accepted) follows p1, each
    proposal is accepted with its target probability, and a sequence whose first proposal is
    rejected outputs one token. Total variation within 0.02 at 40,000 samples."""
    generator = torch.Generator().manual_seed(0)
    vocab, num = 12, 40_000
    position_logits = torch.randn(3, vocab, generator=generator) * 2
    params = SamplingParams(**kwargs)
    p = processed_probs(position_logits, [params] * 3)
    d0, d1 = int(p[0].argsort()[-2]), int(p[1].argmax())   # a likely (not the likeliest) and the likeliest
    logits = position_logits.repeat(num, 1)
    batch = SamplingBatch.from_params([params] * (3 * num))
    outputs, accepted, _ = verify(Sampler(seed=1), logits, batch, [[d0, d1]] * num)
    first = Counter(output[0] for output in outputs)
    assert total_variation(first, p[0], num) < 0.02
    after_d0 = [output for output in outputs if output[0] == d0]
    assert abs(len(after_d0) / num - float(p[0, d0])) < 0.01
    assert all(len(output) == 1 for output in outputs if output[0] != d0)
    second = Counter(output[1] for output in after_d0)
    assert total_variation(second, p[1], len(after_d0)) < 0.03
    assert all(a == len(o) - 1 for a, o in zip(accepted, outputs))


def test_greedy_acceptance_is_the_longest_agreeing_prefix():
    assert num_accepted([5, 6, 7, 8], [5, 6, 9]) == 2
    assert num_accepted([5, 6, 7, 8], [5, 6, 7]) == 3
    assert num_accepted([1], []) == 0
    logits = torch.full((4, 10), -5.0)
    for position, token in enumerate([3, 4, 5, 6]):
        logits[position, token] = 5.0
    outputs, accepted, logprobs = verify(Sampler(seed=0), logits, SamplingBatch.from_params([greedy()] * 4), [[3, 4, 9]])
    assert (outputs, accepted, logprobs) == ([[3, 4, 5]], [2], None)


# ---- who speculates ----------------------------------------------------------------------------

STRUCTURED = [{"choice": ["yes", "no", "maybe so"]}, {"regex": "[a-f]{3,9}-[0-9]{2,5}"},
              {"json": {"type": "object", "properties": {"id": {"type": "integer"}, "tags": {
                  "type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3}},
                        "required": ["id", "tags"], "additionalProperties": False}}]


@pytest.mark.parametrize("spec", STRUCTURED, ids=["choice", "regex", "json"])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_structured_outputs_speculate_within_their_grammar(spec, temperature, make_llm):
    """Proposals are cut to what the grammar accepts, each position is sampled under the mask
    of the grammar after the proposals before it, and the accepted tokens move the grammar:
    the outputs are those of decoding without speculation, also when the proposals break the
    grammar (a random number right)."""
    params = SamplingParams(temperature=temperature, seed=3, max_tokens=40, structured_outputs=spec)
    base, llm = make_llm("llama", speculative=False), make_llm("llama")
    prompts = random_prompts((8, 20, 13), seed=37)
    results = base.generate(prompts, params, use_tqdm=False)
    expected = outputs_of(results)
    assert reason_not_speculating(llm.engine.make_request("probe", prompts[0], params)) is None
    for num_right in (None, 4):
        script(llm, prompts, expected, num_right=num_right, seed=num_right or 1)
        before = drafts(llm)
        got = llm.generate(prompts, params, use_tqdm=False)
        assert outputs_of(got) == expected
        assert [(r.outputs[0].text, r.outputs[0].finish_reason) for r in got] == \
            [(r.outputs[0].text, r.outputs[0].finish_reason) for r in results]
        assert drafts(llm)[0] > before[0]


@pytest.mark.parametrize("params", [greedy(logprobs=3), SamplingParams(temperature=0.8, seed=7, logprobs=2,
                                                                      max_tokens=MAX_TOKENS, ignore_eos=True)])
def test_logprobs_of_accepted_tokens_are_those_of_decoding_without_speculation(params, make_llm):
    """A row with logprobs speculates, and each output's logprob and top alternatives are the
    ones decoding one token a step gives (its own position's raw logits; float32 noise apart)."""
    base, llm = make_llm("llama", speculative=False), make_llm("llama")
    prompts = random_prompts((8, 20, 13), seed=23)
    expected = base.generate(prompts, params, use_tqdm=False)
    script(llm, prompts, outputs_of(expected), num_right=3)
    before = drafts(llm)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert drafts(llm)[0] > before[0]                                  # it speculated
    assert outputs_of(got) == outputs_of(expected)
    for ours, theirs in zip(got, expected):
        ours, theirs = ours.outputs[0], theirs.outputs[0]
        assert len(ours.logprobs) == len(theirs.logprobs) == len(theirs.token_ids)
        for token_id, mine, reference in zip(theirs.token_ids, ours.logprobs, theirs.logprobs):
            assert mine.token_id == reference.token_id == token_id and len(mine.top) == params.logprobs
            assert mine.logprob == pytest.approx(reference.logprob, abs=1e-4)
            alternatives = dict(mine.top)
            for alternative, value in reference.top:   # a near-tie may swap the last two
                if alternative in alternatives:
                    assert alternatives[alternative] == pytest.approx(value, abs=1e-4)
        assert ours.cumulative_logprob == pytest.approx(theirs.cumulative_logprob, abs=1e-3)


@pytest.mark.parametrize("params", [
    greedy(repetition_penalty=1.3), greedy(presence_penalty=0.8, frequency_penalty=0.6),
    SamplingParams(temperature=0.9, seed=5, repetition_penalty=1.2, frequency_penalty=0.4, max_tokens=MAX_TOKENS),
])
def test_penalties_at_each_position_count_the_proposals_before_it(params, make_llm):
    """Position i of a draft is penalised as if the proposals before it were outputs (it counts
    only if they are): the tokens are those of decoding without speculation."""
    base, llm = make_llm("llama", speculative=False), make_llm("llama")
    prompts = random_prompts((8, 20, 13), seed=29)
    expected = outputs_of(base.generate(prompts, params, use_tqdm=False))
    for num_right in (None, 4):
        script(llm, prompts, expected, num_right=num_right, seed=num_right or 0)
        before = drafts(llm)
        assert outputs_of(llm.generate(prompts, params, use_tqdm=False)) == expected
        assert drafts(llm)[0] > before[0]


def test_bad_words_at_each_position_follow_the_proposals_before_it(make_llm):
    """A bad word's last token is banned at a position whose proposals before it end with the
    word's other tokens: the outputs are those of decoding without speculation, which differ
    from decoding without the ban."""
    base, llm = make_llm("llama", speculative=False), make_llm("llama")
    prompts = random_prompts((8, 20), seed=31)
    free = outputs_of(base.generate(prompts, greedy(), use_tqdm=False))
    # Words of each output's tokens 3-4 and 6 (token ids: ``bad_words`` as the engine tokenizes
    # them); their last tokens are banned where the rest precedes them.
    words = [[o[2], o[3]] for o in free] + [[o[6]] for o in free]

    def generate(llm) -> list[list[int]]:
        engine, finished = llm.engine, {}
        for i, prompt in enumerate(prompts):
            request = engine.make_request(f"bad-{i}", prompt, greedy(), output_kind="final")
            request.bad_words_token_ids = words
            engine.admit(request)
        while len(finished) < len(prompts):
            finished.update({o.request_id: o for o in engine.step() if o.finished})
        return [list(finished[f"bad-{i}"].outputs[0].token_ids) for i in range(len(prompts))]

    expected = generate(base)
    assert expected != free
    script(llm, prompts, free, num_right=4)      # proposals that walk into the bad words
    before = drafts(llm)
    assert generate(llm) == expected
    assert drafts(llm)[0] > before[0]


def test_no_proposals_once_the_batch_reaches_disable_by_batch_size(make_llm):
    llm = make_llm("llama", speculative_config={**NGRAM, "disable_by_batch_size": 3})
    prompts = random_prompts((8, 20, 5, 11), seed=17)
    base = make_llm("llama", speculative=False)
    expected = outputs_of(base.generate(prompts, greedy(), use_tqdm=False))
    script(llm, prompts, expected, num_right=4)
    stats = llm.stats()
    assert outputs_of(llm.generate(prompts, greedy(), use_tqdm=False)) == expected
    after = llm.stats()
    assert after["spec_decode_num_disabled_steps"] > stats["spec_decode_num_disabled_steps"]
    # Two at a time stay under the limit: they speculate.
    assert outputs_of(llm.generate(prompts[:2], greedy(), use_tqdm=False)) == expected[:2]
    assert llm.stats()["spec_decode_num_drafts"] > after["spec_decode_num_drafts"]


@pytest.mark.parametrize("params", [greedy(), SamplingParams(temperature=0.8, seed=21, max_tokens=MAX_TOKENS)],
                         ids=["greedy", "seeded"])
def test_overlapped_scheduling_runs_the_steps_that_cannot_propose(params, make_llm, hf_greedy):
    """With async_scheduling, a batch at ``disable_by_batch_size`` overlaps its steps; once it
    falls below, each step reads the running step's ids before proposing and verifies. The
    tokens are decoding's without speculation, the same in any batch."""
    llm = make_llm("llama", async_scheduling=True, speculative_config={**NGRAM, "disable_by_batch_size": 3})
    base = make_llm("llama", speculative=False)
    prompts = random_prompts((8, 20, 5, 11, 30), seed=18)
    # Different lengths: the batch shrinks below the limit as requests end.
    many = [dataclasses.replace(params, max_tokens=n) for n in (24, 6, 9, 12, 24)]
    expected = outputs_of(base.generate(prompts, many, use_tqdm=False))
    script(llm, prompts, expected, num_right=4)
    before = llm.stats()
    assert outputs_of(llm.generate(prompts, many, use_tqdm=False)) == expected
    after = llm.stats()
    if params.temperature == 0.0:   # a seeded row reads its ids at once anyway
        assert after["num_overlapped_steps"] > before["num_overlapped_steps"]
    assert after["spec_decode_num_drafts"] > before["spec_decode_num_drafts"]
    assert after["spec_decode_num_accepted_tokens"] > before["spec_decode_num_accepted_tokens"]
    if params.temperature == 0.0:
        assert expected == [hf_greedy("llama", p, n) for p, n in zip(prompts, (24, 6, 9, 12, 24))]


def test_a_sequence_whose_drafts_keep_nothing_backs_off(make_llm):
    """Drafts that keep nothing pause a sequence's proposals for 1, 2, 4, ... tokens (the
    back-off), and outputs stay exact; drafts that keep a token never pause it."""
    llm = make_llm("llama")
    prompts = random_prompts((6, 13), seed=19)
    base = make_llm("llama", speculative=False)
    max_tokens = 64
    expected = outputs_of(base.generate(prompts, greedy(max_tokens), use_tqdm=False))
    for num_right, most_drafts in ((0, 7), (1, max_tokens)):
        script(llm, prompts, expected, num_right=num_right)
        before = llm.stats()
        assert outputs_of(llm.generate(prompts, greedy(max_tokens), use_tqdm=False)) == expected
        after = llm.stats()
        num_drafts = after["spec_decode_num_drafts"] - before["spec_decode_num_drafts"]
        num_backoffs = after["spec_decode_num_backoffs"] - before["spec_decode_num_backoffs"]
        if num_right == 0:
            # Drafts at outputs 1, 3, 6, 11, 20, 37 (a pause of 1, 2, 4, 8, 16 tokens after each).
            assert num_drafts == num_backoffs and len(prompts) * 5 <= num_drafts <= len(prompts) * most_drafts
        else:
            # Each step keeps a proposal and the target's token: two tokens a draft, never a pause.
            assert num_backoffs == 0 and num_drafts >= len(prompts) * (max_tokens // 2 - 1)


def test_beam_search_is_refused_on_an_engine_that_speculates(make_llm):
    """As the issue asks (vLLM has no beam search with speculation either): refused by name,
    the engine left as it was."""
    from pagedserve.workers.sample.sampling_params import BeamSearchParams

    llm = make_llm("llama")
    prompts = random_prompts((8,), seed=18)
    before = drafts(llm)
    with pytest.raises(ValueError, match="use_beam_search cannot be combined with speculative decoding"):
        llm.beam_search([{"prompt_token_ids": p} for p in prompts], BeamSearchParams(beam_width=2, max_tokens=8))
    assert drafts(llm) == before and llm.engine.num_used_blocks() == 0 and not llm.engine.has_unfinished_requests()
