"""End-to-end correctness of the engine against transformers, on tiny random checkpoints.

Greedy outputs must be token-identical to ``generate(do_sample=False)`` (float32,
CPU) whatever the engine does underneath: batching, prefix caching, chunked
prefill, preemption by swap or recompute, forks for n > 1, any block size.
After every test, every engine built here must be idle, hold zero blocks and
pass its integrity check.
"""

from __future__ import annotations

import asyncio
import importlib.util
import random

import pytest
import torch

from pagedserve import LLM, SamplingParams
from offline_checks import assert_idle

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAX_TOKENS = 16
# Mixed prompt lengths, including block-boundary ones (16, 17, 32, 64).
PROMPT_LENGTHS = (3, 7, 16, 17, 32, 50, 64, 90, 120, 5)
# Prompts avoid the ids of special tokens (0..4).
FIRST_ORDINARY_ID = 5
VOCAB_SIZE = 1024


def random_prompts(lengths, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(FIRST_ORDINARY_ID, VOCAB_SIZE) for _ in range(n)] for n in lengths]


def greedy(max_tokens: int = MAX_TOKENS, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "overlap"])
def make_llm(request, tiny_model):
    """``make_llm(arch="llama", shared_instance=True, **engine_kwargs) -> LLM``.

    Shared engines are reused by every test asking for the same configuration;
    ``shared_instance=False`` builds a fresh one (for tests that read its
    counters or patch its parts). Every engine built is checked after each test.
    Every test runs twice: reading each step's samples at once, and with overlapped
    scheduling (the next step planned and launched before they are read).
    """
    shared: dict[tuple, LLM] = {}
    every: list[LLM] = []

    def make(arch: str = "llama", shared_instance: bool = True, **kwargs) -> LLM:
        # The reference is float32 on CPU, wherever the suite runs.
        kwargs.setdefault("device", "cpu")
        kwargs.setdefault("dtype", "float32")
        # Small pools keep allocation and integrity checks cheap (the CPU default is 1 GiB).
        kwargs.setdefault("swap_space_gb", 0.001)
        kwargs.setdefault("num_device_blocks", 4096 // kwargs.get("block_size", 16))
        kwargs.setdefault("async_scheduling", request.param)
        key = (arch, tuple(sorted(kwargs.items())))
        if shared_instance and key in shared:
            return shared[key]
        llm = LLM(tiny_model(arch), **kwargs)
        every.append(llm)
        if shared_instance:
            shared[key] = llm
        return llm

    make.instances = every
    return make


@pytest.fixture(autouse=True)
def no_leaks(make_llm):
    yield
    for llm in list(make_llm.instances):
        try:
            assert_idle(llm)
        except Exception:
            make_llm.instances.remove(llm)  # report a broken engine once, not after every test
            raise


def assert_greedy_matches(outputs, arch: str, max_tokens: int, hf_greedy, eos_ids=(2, 4)) -> None:
    for output in outputs:
        reference = hf_greedy(arch, output.prompt_token_ids, max_tokens)
        assert output.finished
        for completion in output.outputs:
            assert completion.token_ids == reference, (
                f"{output.request_id} (prompt of {len(output.prompt_token_ids)} tokens) "
                f"sample {completion.index} diverged")
            expected_reason = "stop" if reference[-1] in eos_ids else "length"
            assert completion.finish_reason == expected_reason


# ---- greedy equivalence ---------------------------------------------------------------

@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_greedy_batch_matches_transformers(arch, make_llm, hf_greedy):
    llm = make_llm(arch)
    prompts = random_prompts(PROMPT_LENGTHS, seed=1)
    outputs = llm.generate(prompts, greedy())
    assert [o.prompt_token_ids for o in outputs] == prompts
    assert_greedy_matches(outputs, arch, MAX_TOKENS, hf_greedy)
    for output in outputs:
        assert output.metrics.num_prompt_tokens == len(output.prompt_token_ids)
        assert output.metrics.num_generated_tokens == len(output.outputs[0].token_ids)
        assert output.metrics.first_token_time is not None
        assert output.metrics.finished_time >= output.metrics.first_token_time


def test_text_prompts_match_transformers(make_llm, hf_greedy):
    llm = make_llm("llama")
    prompts = ["The quick brown fox", "hello", "a b c d e f g h i j k l m n o p q r s t u v w"]
    outputs = llm.generate(prompts, greedy())
    tokenizer = llm.get_tokenizer()
    for prompt, output in zip(prompts, outputs):
        assert output.prompt == prompt
        assert output.prompt_token_ids == tokenizer.encode(prompt)
        completion = output.outputs[0]
        assert completion.text == tokenizer.decode(completion.token_ids, skip_special_tokens=True)
    assert_greedy_matches(outputs, "llama", MAX_TOKENS, hf_greedy)


@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_block_sizes(block_size, make_llm, hf_greedy):
    llm = make_llm("llama", block_size=block_size)
    outputs = llm.generate(random_prompts(PROMPT_LENGTHS, seed=2), greedy())
    assert_greedy_matches(outputs, "llama", MAX_TOKENS, hf_greedy)
    assert llm.stats()["block_size"] == block_size


@pytest.mark.parametrize("block_size", [8, 16])
def test_torch_decode_path_matches_transformers(block_size, make_llm, hf_greedy, monkeypatch):
    """With the native CPU decode kernel off (no C compiler), the torch ops give the same outputs."""
    from pagedserve.kernels import cpu_decode

    def native_must_not_run(*args, **kwargs):
        raise AssertionError("the native kernel ran")

    monkeypatch.setattr(cpu_decode, "supports_cache", lambda k_cache: False)
    monkeypatch.setattr(cpu_decode, "decode_attention", native_must_not_run)
    llm = make_llm("llama", shared_instance=False, block_size=block_size)
    outputs = llm.generate(random_prompts(PROMPT_LENGTHS, seed=9), greedy())
    assert_greedy_matches(outputs, "llama", MAX_TOKENS, hf_greedy)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_chunked_prefill(arch, make_llm, hf_greedy):
    budget = 24
    llm = make_llm(arch, shared_instance=False, block_size=8, max_num_batched_tokens=budget)
    prompts = random_prompts(PROMPT_LENGTHS, seed=3)
    outputs = llm.generate(prompts, greedy())
    assert_greedy_matches(outputs, arch, MAX_TOKENS, hf_greedy)
    # No step ran more than the budget, so prompts took several steps each.
    assert llm.stats()["num_steps"] >= sum(PROMPT_LENGTHS) // budget


def test_stats_sum_each_requests_wait_for_its_first_schedule_and_first_token(make_llm, hf_greedy):
    llm = make_llm(shared_instance=False, max_num_seqs=2)
    prompts = random_prompts(PROMPT_LENGTHS[:4], seed=5)
    outputs = llm.generate(prompts, greedy())
    assert_greedy_matches(outputs, "llama", MAX_TOKENS, hf_greedy)
    stats = llm.stats()
    assert stats["num_scheduled_requests"] == stats["num_first_tokens"] == len(prompts)
    # Each request waits for its first token at least as long as for its first schedule, and
    # with two rows for four requests, the last two queued while the first two ran.
    expected_queue = sum(o.metrics.first_scheduled_time - o.metrics.arrival_time for o in outputs)
    expected_first_token = sum(o.metrics.first_token_time - o.metrics.arrival_time for o in outputs)
    assert stats["queue_seconds"] == pytest.approx(expected_queue)
    assert stats["first_token_seconds"] == pytest.approx(expected_first_token)
    assert stats["first_token_seconds"] > stats["queue_seconds"] > 0
    waits = sorted(o.metrics.first_scheduled_time - o.metrics.arrival_time for o in outputs)
    assert waits[2] > waits[1]


def test_prefix_caching_with_shared_prefixes(make_llm, hf_greedy):
    llm = make_llm("llama", shared_instance=False, block_size=8, num_device_blocks=256)
    base = random_prompts([70], seed=4)[0]
    suffixes = random_prompts([1, 5, 9, 16, 23, 3, 0, 11], seed=5)
    prompts = [base[:40 + 4 * i] + suffix for i, suffix in enumerate(suffixes)]
    # A first batch that all share the prefix: later ones hit within the batch.
    first = llm.generate(prompts, greedy())
    assert_greedy_matches(first, "llama", MAX_TOKENS, hf_greedy)
    assert llm.stats()["prefix_cache_hit_rate"] > 0
    # The same prompts again hit the cached (freed) blocks of the first batch.
    second = llm.generate(prompts, greedy())
    assert_greedy_matches(second, "llama", MAX_TOKENS, hf_greedy)
    block_size = 8
    for output in second:
        expected = (len(output.prompt_token_ids) - 1) // block_size * block_size
        assert output.metrics.num_cached_tokens == expected
    # A follow-up turn: a cached prompt continued by its own output.
    continued = first[0].prompt_token_ids + first[0].outputs[0].token_ids[:10]
    third = llm.generate([continued], greedy())
    assert third[0].metrics.num_cached_tokens >= 40
    assert_greedy_matches(third, "llama", MAX_TOKENS, hf_greedy)


def test_prefix_caching_with_chunked_prefill(make_llm, hf_greedy):
    llm = make_llm("qwen2", shared_instance=False, block_size=8, max_num_batched_tokens=16)
    base = random_prompts([64], seed=6)[0]
    prompts = [base + tail for tail in random_prompts([3, 10, 1, 20], seed=7)]
    outputs = llm.generate(prompts, greedy())
    assert_greedy_matches(outputs, "qwen2", MAX_TOKENS, hf_greedy)
    assert llm.stats()["prefix_cache_hit_rate"] > 0


def test_prefix_cache_second_tier_on_host(make_llm, hf_greedy):
    """Evicted prefix blocks are offloaded to the host pool and hit from there later."""
    llm = make_llm("llama", shared_instance=False, block_size=8, num_device_blocks=16)
    max_tokens = 8
    first, second, third, others = random_prompts((60, 11, 5, 120), seed=29)
    prompts = [first, first[:50] + second, first[:40] + third]
    evicting = [others[:70], others[70:]]
    for _ in range(2):
        assert_greedy_matches(llm.generate(prompts, greedy(max_tokens)), "llama", max_tokens,
                              hf_greedy)
        assert_greedy_matches(llm.generate(evicting, greedy(max_tokens)), "llama", max_tokens,
                              hf_greedy)
    stats = llm.stats()
    assert stats["num_blocks_offloaded"] > 0
    assert stats["num_blocks_swapped_in"] > 0
    assert stats["num_preemptions_by_mode"]["recompute"] == 0
    again = llm.generate(prompts, greedy(max_tokens))
    assert_greedy_matches(again, "llama", max_tokens, hf_greedy)
    assert all(o.metrics.num_cached_tokens > 0 for o in again)


def test_cache_salt_shares_prefix_blocks_only_within_a_salt(make_llm, hf_greedy):
    """vLLM's cache_salt: a salted request hits only blocks its own salt cached, an unsalted
    one never hits a salted request's blocks, nor the other way; outputs stay transformers'.
    Also through the host tier: the salt travels with an offloaded block."""
    llm = make_llm("llama", shared_instance=False, block_size=8, num_device_blocks=32)
    prompt = random_prompts([49], seed=31)[0]
    full_blocks = (len(prompt) - 1) // 8 * 8

    def cached(salt: str | None) -> int:
        [output] = llm.generate([prompt], greedy(cache_salt=salt))
        assert_greedy_matches([output], "llama", MAX_TOKENS, hf_greedy)
        return output.metrics.num_cached_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-a") == full_blocks
    assert cached("tenant-b") == 0 and cached(None) == 0
    assert cached(None) == full_blocks and cached("tenant-b") == full_blocks
    # Evicted to the host tier by other prompts, a salted prefix still hits only its salt.
    others = random_prompts((100, 100), seed=32)
    llm.generate(others, greedy())
    assert llm.stats()["num_blocks_offloaded"] > 0
    assert cached("tenant-c") == 0 and cached("tenant-a") == full_blocks
    with pytest.raises(ValueError, match="cache_salt"):
        SamplingParams(cache_salt="")


def test_llm_chat_renders_conversations_as_transformers_does(make_llm, hf_greedy):
    """vLLM's LLM.chat: the tokenizer's chat template (text parts joined), its tokens as
    transformers' apply_chat_template gives them, then greedy as transformers; a batch of
    conversations in order; continue_final_message continues the last assistant message.
    What the template cannot render as asked raises ValueError naming why."""
    llm = make_llm("llama")
    tokenizer = llm.get_tokenizer()
    system = {"role": "system", "content": "Be brief."}
    parts = {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}
    plain = {"role": "user", "content": "Hi there"}

    def template_ids(conversation, **kwargs):
        return tokenizer.apply_chat_template(conversation, tokenize=True, return_dict=False, **kwargs)

    [single] = llm.chat([system, parts], greedy(), use_tqdm=False)
    assert single.prompt_token_ids == template_ids([system, plain], add_generation_prompt=True)
    assert_greedy_matches([single], "llama", MAX_TOKENS, hf_greedy)
    other = [{"role": "user", "content": "Tell a story"}, {"role": "assistant", "content": "Once upon a"}]
    batch = llm.chat([[system, plain], other], greedy(), use_tqdm=False)
    assert [o.prompt_token_ids for o in batch] == [template_ids([system, plain], add_generation_prompt=True),
                                                   template_ids(other, add_generation_prompt=True)]
    [continued] = llm.chat(other, greedy(), use_tqdm=False, add_generation_prompt=False, continue_final_message=True)
    assert continued.prompt_token_ids == template_ids(other, continue_final_message=True)
    assert tokenizer.decode(continued.prompt_token_ids).endswith("Once upon a")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    [with_tools] = llm.chat([plain], greedy(), use_tqdm=False, tools=tools)
    assert with_tools.prompt_token_ids == template_ids([plain], add_generation_prompt=True, tools=tools)
    assert "get_weather" in tokenizer.decode(with_tools.prompt_token_ids)
    # vLLM's chat_template: a template (or its file) in place of the tokenizer's, as transformers renders it.
    own = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    [templated] = llm.chat([system, plain], greedy(), use_tqdm=False, chat_template=own)
    assert templated.prompt_token_ids == template_ids([system, plain], chat_template=own)
    assert tokenizer.decode(templated.prompt_token_ids) == "<system>Be brief.<user>Hi there"
    for conversation, kwargs, reason in (
            (other, {"continue_final_message": True}, "add_generation_prompt"),
            ([plain], {"chat_template_kwargs": {"tools": []}}, "may not set tools"),
            ([plain], {"chat_template": "{% if %}"}, "not valid Jinja"),
            ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], {}, "text only")):
        with pytest.raises(ValueError, match=reason):
            llm.chat(conversation, greedy(), use_tqdm=False, **kwargs)


def test_without_sampling_params_the_models_generation_config_decides(make_llm, tiny_model, tmp_path):
    """vLLM's get_default_sampling_params: what the model's generation_config.json recommends
    (here greedy, 5 tokens) is what generate and chat use when given no sampling params."""
    import json
    import shutil

    assert make_llm("llama").get_default_sampling_params().temperature == 1.0   # it recommends nothing
    path = tmp_path / "recommending"
    shutil.copytree(tiny_model("llama"), path)
    config = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**config, "temperature": 0.0, "max_new_tokens": 5}))
    llm = LLM(str(path), num_device_blocks=64, swap_space_gb=0.001)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.max_tokens) == (0.0, 5)
    prompt = random_prompts([9], seed=4)[0]
    [by_default] = llm.generate([prompt], use_tqdm=False)
    [stated] = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=5), use_tqdm=False)
    assert by_default.outputs[0].token_ids == stated.outputs[0].token_ids and len(stated.outputs[0].token_ids) <= 5
    [chat] = llm.chat([{"role": "user", "content": "Hi"}], use_tqdm=False)
    assert len(chat.outputs[0].token_ids) <= 5
    assert_idle(llm)


def test_generate_takes_vllms_prompt_dicts_and_shows_progress(make_llm, capsys):
    llm = make_llm("llama")
    ids = random_prompts([12], seed=33)[0]
    text = "The paged KV cache"
    plain = llm.generate([ids, text], greedy(), use_tqdm=False)
    assert "Processed prompts" not in capsys.readouterr().err
    dicts = llm.generate([{"prompt_token_ids": ids}, {"prompt": text}], greedy())
    assert [o.outputs[0].token_ids for o in dicts] == [o.outputs[0].token_ids for o in plain]
    assert "Processed prompts" in capsys.readouterr().err
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate([{"prompt_ids": ids}], greedy(), use_tqdm=False)


def test_prefix_caching_off(make_llm, hf_greedy):
    llm = make_llm("llama", shared_instance=False, block_size=8, enable_prefix_caching=False)
    base = random_prompts([40], seed=8)[0]
    prompts = [base + tail for tail in random_prompts([2, 9, 17], seed=9)]
    outputs = llm.generate(prompts, greedy()) + llm.generate(prompts, greedy())
    assert_greedy_matches(outputs, "llama", MAX_TOKENS, hf_greedy)
    assert llm.stats()["prefix_cache_hit_rate"] == 0
    assert all(o.metrics.num_cached_tokens == 0 for o in outputs)


# ---- preemption -----------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["swap", "recompute"])
@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_preemption_keeps_outputs_exact(mode, enable_prefix_caching, make_llm, hf_greedy):
    # 20 blocks of 8 tokens: one sequence always fits, all eight at once never do.
    llm = make_llm("llama", shared_instance=False, block_size=8, num_device_blocks=20,
                   preemption_mode=mode, enable_prefix_caching=enable_prefix_caching)
    max_tokens = 24
    prompts = random_prompts((10, 35, 60, 22, 47, 13, 58, 30), seed=10)
    outputs = llm.generate(prompts, greedy(max_tokens))
    assert_greedy_matches(outputs, "llama", max_tokens, hf_greedy)
    stats = llm.stats()
    assert stats["num_preemptions_by_mode"][mode] > 0, stats
    other = "recompute" if mode == "swap" else "swap"
    assert stats["num_preemptions_by_mode"][other] == 0, stats
    assert stats[f"num_preemptions_{mode}"] == stats["num_preemptions_by_mode"][mode]
    assert sum(o.metrics.num_preemptions for o in outputs) == stats["num_preemptions_by_mode"][mode]
    if mode == "swap":
        assert stats["swapped_out_bytes"] > 0 and stats["swapped_in_bytes"] > 0


def test_preemption_with_chunked_prefill_and_forks(make_llm, hf_greedy):
    llm = make_llm("qwen2", shared_instance=False, block_size=8, num_device_blocks=24,
                   max_num_batched_tokens=16)
    max_tokens = 20
    prompts = random_prompts((9, 41, 27, 60, 15, 33), seed=11)
    params = [greedy(max_tokens, n=2 if i % 2 else 1) for i in range(len(prompts))]
    outputs = llm.generate(prompts, params)
    assert [len(o.outputs) for o in outputs] == [p.n for p in params]
    assert_greedy_matches(outputs, "qwen2", max_tokens, hf_greedy)
    assert sum(llm.stats()["num_preemptions_by_mode"].values()) > 0


def test_contiguous_allocation_matches(make_llm, hf_greedy):
    llm = make_llm("llama", shared_instance=False, allocation="contiguous", block_size=16,
                   max_model_len=256, num_device_blocks=64)
    outputs = llm.generate(random_prompts(PROMPT_LENGTHS, seed=12), greedy())
    assert_greedy_matches(outputs, "llama", MAX_TOKENS, hf_greedy)


def test_prompt_reaching_max_model_len_finishes_with_length(make_llm, hf_greedy):
    llm = make_llm("llama", max_model_len=64, block_size=8)
    prompt = random_prompts([60], seed=13)[0]
    output = llm.generate([prompt], greedy(20))[0]
    completion = output.outputs[0]
    assert completion.token_ids == hf_greedy("llama", prompt, 20)[:4]
    assert completion.finish_reason == "length"


def test_request_larger_than_the_pool_is_aborted_not_hung(make_llm, hf_greedy):
    llm = make_llm("llama", block_size=8, num_device_blocks=4)  # 32 token slots
    too_long, grows_too_long, fits = random_prompts([40, 20, 10], seed=14)
    outputs = llm.generate([too_long, grows_too_long, fits], greedy(20))
    assert outputs[0].outputs[0].finish_reason == "abort"
    assert outputs[0].outputs[0].token_ids == []
    # It runs until the pool cannot hold it, then ends; its tokens so far are right.
    partial = outputs[1].outputs[0]
    assert partial.finish_reason == "abort"
    assert partial.token_ids == hf_greedy("llama", grows_too_long, 20)[:len(partial.token_ids)]
    assert_greedy_matches(outputs[2:], "llama", 20, hf_greedy)


def test_repetition_penalty_matches_transformers(make_llm, hf_greedy):
    llm = make_llm("llama")
    prompts = random_prompts((5, 30, 77), seed=30)
    outputs = llm.generate(prompts, greedy(repetition_penalty=1.5))
    for prompt, output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == hf_greedy("llama", prompt, MAX_TOKENS,
                                                        repetition_penalty=1.5)


def test_two_engines_interleaved(make_llm, hf_greedy):
    """Per-step state lives in each engine: stepping two in turn changes nothing."""
    engines = [make_llm("llama", block_size=8).engine, make_llm("qwen2").engine]
    prompts = random_prompts((23, 9, 41), seed=31)
    for e, engine in enumerate(engines):
        for i, prompt in enumerate(prompts):
            engine.add_request(f"two-{e}-{i}", prompt, greedy())
    finished: list = []
    for _ in range(200):
        for engine in engines:
            finished.extend(o for o in engine.step() if o.finished)
        if not any(engine.has_unfinished_requests() for engine in engines):
            break
    by_arch = {"llama": [o for o in finished if o.request_id.startswith("two-0")],
               "qwen2": [o for o in finished if o.request_id.startswith("two-1")]}
    for arch, outputs in by_arch.items():
        assert len(outputs) == len(prompts)
        assert_greedy_matches(outputs, arch, MAX_TOKENS, hf_greedy)


# ---- n > 1 ----------------------------------------------------------------------------

def test_greedy_n3_samples_equal_reference_and_share_blocks(make_llm, hf_greedy):
    llm = make_llm("llama", shared_instance=False, block_size=8)
    prompts = random_prompts((13, 30, 5), seed=15)  # none a multiple of the block size
    outputs = llm.generate(prompts, greedy(n=3))
    for output in outputs:
        assert sorted(c.index for c in output.outputs) == [0, 1, 2]
    assert_greedy_matches(outputs, "llama", MAX_TOKENS, hf_greedy)
    # The samples forked off one prefill and copied the shared partial last block on write.
    assert llm.stats()["num_cow_copies"] >= 2 * len(prompts)
    assert llm.stats()["num_generated_tokens"] == 3 * MAX_TOKENS * len(prompts)


def test_sampled_n3_siblings_differ_and_reproduce(make_llm):
    llm = make_llm("llama", block_size=8)
    prompt = random_prompts([21], seed=16)[0]
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=MAX_TOKENS)
    first = llm.generate([prompt], params)[0]
    samples = [c.token_ids for c in sorted(first.outputs, key=lambda c: c.index)]
    assert len({tuple(s) for s in samples}) == 3
    again = llm.generate([prompt], params)[0]
    assert [c.token_ids for c in sorted(again.outputs, key=lambda c: c.index)] == samples


# ---- seeded sampling ------------------------------------------------------------------

def test_seeded_sampling_is_independent_of_the_batch(make_llm):
    prompt = random_prompts([25], seed=17)[0]
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=1234, max_tokens=MAX_TOKENS)
    llm = make_llm("llama")
    alone = llm.generate([prompt], params)[0].outputs[0].token_ids
    assert len(alone) == MAX_TOKENS

    others = random_prompts((40, 8, 70, 3), seed=18)
    other_params = [SamplingParams(temperature=1.0, max_tokens=12),
                    greedy(5), SamplingParams(temperature=0.5, top_k=20, max_tokens=20),
                    SamplingParams(temperature=0.8, top_p=0.9, seed=99, max_tokens=MAX_TOKENS)]
    batch = others[:2] + [prompt] + others[2:]
    outputs = llm.generate(batch, other_params[:2] + [params] + other_params[2:])
    assert outputs[2].outputs[0].token_ids == alone

    # The same on an engine that chunks, pages and preempts differently.
    other_llm = make_llm("llama", block_size=8, num_device_blocks=24, max_num_batched_tokens=16)
    outputs = other_llm.generate(batch, other_params[:2] + [params] + other_params[2:])
    assert outputs[2].outputs[0].token_ids == alone

    different = llm.generate([prompt], SamplingParams(temperature=0.8, top_p=0.9, seed=4321,
                                                      max_tokens=MAX_TOKENS))
    assert different[0].outputs[0].token_ids != alone


def test_unseeded_requests_draw_a_fresh_stream_per_engine_unless_the_engine_is_seeded(make_llm):
    """Default seed: each engine a fresh random one (workers and restarts never share a
    stream); an explicit engine seed makes unseeded requests reproducible run to run."""
    prompt = random_prompts([19], seed=21)[0]
    params = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS)

    def first_sample(**kwargs) -> list[int]:
        llm = make_llm("llama", shared_instance=False, num_device_blocks=64, **kwargs)
        return llm.generate([prompt], params)[0].outputs[0].token_ids

    fresh = [first_sample(), first_sample()]
    assert fresh[0] != fresh[1]
    assert first_sample(seed=11) == first_sample(seed=11)
    assert first_sample(seed=11) != first_sample(seed=12)


# ---- bad input ------------------------------------------------------------------------

def test_bad_input_raises_and_the_engine_keeps_serving(make_llm, tiny_model, hf_greedy):
    llm = make_llm("llama")
    good = random_prompts([12], seed=19)[0]

    def still_serves():
        assert_greedy_matches(llm.generate([good], greedy()), "llama", MAX_TOKENS, hf_greedy)
        assert_idle(llm)

    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], greedy())
    still_serves()
    with pytest.raises(ValueError, match="maximum context"):
        llm.generate([list(range(5, 605))], greedy())  # the tiny models hold 512 positions
    still_serves()
    for bad_ids in ([5, -1], [5, VOCAB_SIZE], [5, 1.5], [5, "x"], [True, 5]):
        with pytest.raises(ValueError, match="token ids"):
            llm.generate([bad_ids], greedy())
        still_serves()
    with pytest.raises(TypeError):
        llm.generate([None], greedy())
    still_serves()
    # One bad prompt in a batch: nothing of the batch runs.
    with pytest.raises(ValueError):
        llm.generate([good, [], good], greedy())
    still_serves()
    with pytest.raises(ValueError):
        llm.generate([good, good], [greedy()])
    still_serves()

    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="bogus"):
        SamplingParams.from_dict({"bogus": 1})
    with pytest.raises(TypeError):
        SamplingParams(bogus=1)
    with pytest.raises(TypeError, match="bogus"):
        LLM(tiny_model("llama"), bogus=1)
    with pytest.raises(ValueError, match="block_size"):
        LLM(tiny_model("llama"), block_size=12)
    with pytest.raises(ValueError, match="preemption_mode"):
        LLM(tiny_model("llama"), preemption_mode="sometimes")

    engine = llm.engine
    engine.add_request("dup", good, greedy())
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("dup", good, greedy())
    with pytest.raises(TypeError):
        engine.add_request("dict-params", good, {"max_tokens": 3})
    outputs = drain(engine)
    assert_greedy_matches([outputs["dup"]], "llama", MAX_TOKENS, hf_greedy)
    still_serves()


# ---- abort ----------------------------------------------------------------------------

def drain(engine, max_steps: int = 1000) -> dict:
    """Step until idle; the last output of each request, by id."""
    last = {}
    for _ in range(max_steps):
        for output in engine.step():
            last[output.request_id] = output
        if not engine.has_unfinished_requests():
            for output in engine.step():  # outputs of aborts made in the last step
                last[output.request_id] = output
            return last
    raise AssertionError("the engine did not finish")


def test_abort_running_waiting_and_forked_requests(make_llm, hf_greedy):
    llm = make_llm("llama", block_size=8)
    engine = llm.engine
    long_params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    a, b, c = random_prompts((30, 11, 17), seed=20)
    engine.add_request("a", a, long_params)
    engine.add_request("b", b, greedy())
    engine.add_request("forked", c, SamplingParams(temperature=0.0, max_tokens=100, n=3))
    for _ in range(3):
        engine.step()
    assert engine.num_used_blocks() > 0
    engine.add_request("never-scheduled", c, greedy())
    assert engine.abort_request("a")
    assert engine.abort_request("forked")
    assert engine.abort_request("never-scheduled")
    assert not engine.abort_request("a")
    assert not engine.abort_request("unknown")
    outputs = drain(engine)
    assert outputs["a"].finished and outputs["a"].outputs[0].finish_reason == "abort"
    # Three steps sampled three tokens; with overlapped scheduling the third was still on
    # the device, unread, when the abort came: it is dropped.
    assert outputs["a"].outputs[0].token_ids == hf_greedy("llama", a, 3)[:2 if engine.async_scheduling else 3]
    assert outputs["never-scheduled"].outputs[0].finish_reason == "abort"
    assert outputs["never-scheduled"].outputs[0].token_ids == []
    assert all(c.finish_reason == "abort" for c in outputs["forked"].outputs)
    assert_greedy_matches([outputs["b"]], "llama", MAX_TOKENS, hf_greedy)


def test_abort_the_last_request_frees_blocks_at_once(make_llm):
    llm = make_llm("llama", block_size=8)
    engine = llm.engine
    engine.add_request("only", random_prompts([40], seed=21)[0], greedy(50))
    engine.step()
    engine.step()
    assert engine.num_used_blocks() > 0
    engine.abort_request("only")
    assert engine.num_used_blocks() == 0
    llm.check_integrity()
    outputs = engine.step()
    assert [o.request_id for o in outputs] == ["only"]
    assert outputs[0].outputs[0].finish_reason == "abort"


def test_abort_swapped_out_requests(make_llm):
    llm = make_llm("llama", shared_instance=False, block_size=8, num_device_blocks=16,
                   preemption_mode="swap")
    engine = llm.engine
    prompts = random_prompts((30, 30, 30, 30), seed=22)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, greedy(60))
    swapped = None
    for _ in range(200):
        engine.step()
        llm.check_integrity()
        stats = llm.stats()
        if stats["num_swapped"]:
            swapped = [s.request.request_id for s in engine.scheduler.waiting
                       if s.request.metrics.num_preemptions]
            break
    assert swapped, "no request was swapped out"
    for request_id in swapped:
        assert engine.abort_request(request_id)
    llm.check_integrity()
    outputs = drain(engine)
    for request_id in swapped:
        assert outputs[request_id].outputs[0].finish_reason == "abort"
    assert llm.stats()["host_blocks_used"] == 0


# ---- streaming outputs -----------------------------------------------------------------

def test_step_outputs_stream_consistently(make_llm):
    """Each step's output extends the last: deltas add up to the cumulative text and
    tokens, and the text never shows what a stop string later trims."""
    llm = make_llm("llama", block_size=8)
    engine = llm.engine
    prompts = random_prompts((19, 33, 8), seed=24)
    full = llm.generate(prompts, greedy(24))
    stops = []
    for output in full:
        text = output.outputs[0].text
        start = next(i for i in range(len(text) // 2, len(text) - 3) if text[i:i + 3].isalnum())
        stops.append(text[start:start + 3])
    for i, (prompt, stop) in enumerate(zip(prompts, stops)):
        engine.add_request(f"stream-{i}", prompt, greedy(24, stop=stop, n=1 + i % 2))
    history: dict[tuple[str, int], list] = {}
    for _ in range(200):
        for output in engine.step():
            for completion in output.outputs:
                history.setdefault((output.request_id, completion.index), []).append(completion)
        if not engine.has_unfinished_requests():
            break
    assert len(history) == 4  # n = 1, 2, 1
    for (request_id, _), steps in history.items():
        final = steps[-1]
        assert final.finish_reason == "stop"
        assert final.stop_reason == stops[int(request_id.split("-")[1])]
        assert "".join(c.delta_text for c in steps) == final.text
        assert sum((c.delta_token_ids for c in steps), []) == final.token_ids
        for completion in steps:
            assert final.text.startswith(completion.text)
            assert final.token_ids[:len(completion.token_ids)] == completion.token_ids


def test_outputs_read_late_equal_outputs_read_at_once(make_llm):
    """Cumulative fields are prefixes copied on first read: read after the run, every
    step's output equals what it held when returned (the sequence's streamed text,
    tokens and logprobs then), with logprobs, stop strings, n = 2 and a resumed request."""
    llm = make_llm("llama", block_size=8)
    engine = llm.engine
    prompts = random_prompts((19, 33, 8), seed=31)
    first = llm.generate(prompts[:1], greedy(6))[0].outputs[0].token_ids
    engine.add_request("plain", prompts[0], greedy(20, logprobs=2, n=2))
    engine.add_request("stopped", prompts[1], greedy(20, stop=["a", "e", "o"], logprobs=0))
    engine.add_request("resumed", prompts[0], greedy(20), output_token_ids=first)
    at_once, late = [], []
    while engine.has_unfinished_requests():
        for output in engine.step():
            request = engine.requests.get(output.request_id)
            for completion in output.outputs:
                late.append(completion)
                seq = request.seqs[completion.index] if request is not None else None
                at_once.append((completion.num_tokens, list(completion.token_ids), completion.text,
                                completion.logprobs and list(completion.logprobs),
                                seq.stream.text.streamed_text if seq is not None else completion.text))
    assert len(late) > 20
    for completion, (num_tokens, token_ids, text, logprobs, streamed_text) in zip(late, at_once):
        assert (completion.num_tokens, completion.token_ids, completion.text, completion.logprobs) == (
            num_tokens, token_ids, text, logprobs)
        assert text == streamed_text


# ---- failures mid-step ---------------------------------------------------------------

def test_interrupted_generate_leaves_the_engine_clean(make_llm, hf_greedy):
    """Ctrl-C (or a failing forward) inside generate: the call's requests are dropped,
    and a rerun does not hit prefix blocks that were planned but never written."""
    llm = make_llm("llama", shared_instance=False, block_size=8)
    prompts = random_prompts((40, 26), seed=33)
    runner = llm.engine.runner
    execute = runner.execute
    calls = []

    def interrupted(model_input, pending_tokens=None):
        calls.append(model_input.num_chunks)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return execute(model_input, pending_tokens)

    runner.execute = interrupted
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts, greedy())
    runner.execute = execute
    assert_idle(llm)
    assert_greedy_matches(llm.generate(prompts, greedy()), "llama", MAX_TOKENS, hf_greedy)


def test_failed_kv_manager_call_loses_no_changes(make_llm, hf_greedy):
    """A KV manager call that fails (a remote call timing out) changes nothing; the
    next step sends the same changes again and the outputs are unaffected."""
    llm = make_llm("llama", shared_instance=False, block_size=8)
    engine = llm.engine
    scheduler = engine.scheduler
    kv_step = scheduler.kv_step
    failures = iter([False, False, True, False, True])

    def flaky(step_input):
        if next(failures, False):
            raise TimeoutError("the KV manager did not answer")
        return kv_step(step_input)

    scheduler.kv_step = flaky
    prompts = random_prompts((12, 30), seed=34)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"flaky-{i}", prompt, greedy())
    finished = {}
    num_failures = 0
    for _ in range(100):
        try:
            outputs = engine.step()
        except TimeoutError:
            num_failures += 1
            continue
        finished.update((o.request_id, o) for o in outputs if o.finished)
        if not engine.has_unfinished_requests():
            break
    scheduler.kv_step = kv_step
    assert num_failures == 2
    assert sorted(finished) == ["flaky-0", "flaky-1"]
    assert_greedy_matches(finished.values(), "llama", MAX_TOKENS, hf_greedy)


# ---- stops and logprobs ---------------------------------------------------------------

def test_stop_token_ids_end_the_output(make_llm, hf_greedy):
    llm = make_llm("llama")
    prompt = random_prompts([19], seed=23)[0]
    reference = hf_greedy("llama", prompt, MAX_TOKENS)
    stop_token = reference[6]
    cut = reference.index(stop_token) + 1
    output = llm.generate([prompt], greedy(stop_token_ids=[stop_token]))[0].outputs[0]
    assert output.token_ids == reference[:cut]
    assert output.finish_reason == "stop"
    assert output.stop_reason == stop_token
    full_text = llm.generate([prompt], greedy())[0].outputs[0].text
    assert full_text.startswith(output.text)


def test_stop_strings_are_trimmed(make_llm):
    llm = make_llm("llama")
    prompt = random_prompts([19], seed=24)[0]
    full = llm.generate([prompt], greedy(24))[0].outputs[0]
    text = full.text
    # A short stop string from the second half of the text.
    start = next(i for i in range(len(text) // 2, len(text) - 3) if text[i:i + 3].isalnum())
    stop = text[start:start + 3]
    cut = text.find(stop)
    trimmed = llm.generate([prompt], greedy(24, stop=[stop, "never-appears-anywhere"]))[0].outputs[0]
    assert trimmed.text == text[:cut]
    assert trimmed.finish_reason == "stop" and trimmed.stop_reason == stop
    assert full.token_ids[:len(trimmed.token_ids)] == trimmed.token_ids
    assert len(trimmed.token_ids) < len(full.token_ids)
    kept = llm.generate([prompt], greedy(24, stop=stop, include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == text[:cut + len(stop)]


def test_logprobs(make_llm, hf_greedy, tiny_model):
    llm = make_llm("llama")
    prompts = random_prompts((9, 33), seed=25)
    outputs = llm.generate(prompts, greedy(8, logprobs=3))
    for output in outputs:
        completion = output.outputs[0]
        assert len(completion.logprobs) == len(completion.token_ids) == 8
        total = 0.0
        for token_id, entry in zip(completion.token_ids, completion.logprobs):
            assert entry.token_id == token_id
            assert len(entry.top) == 3
            values = [lp for _, lp in entry.top]
            assert values == sorted(values, reverse=True) and values[0] <= 0
            assert entry.top[0][0] == token_id  # greedy: the sampled token is the top one
            assert entry.logprob == pytest.approx(values[0], abs=1e-6)
            total += entry.logprob
        assert completion.cumulative_logprob == pytest.approx(total, abs=1e-4)
    # The logprobs are the model's: compare one prompt with transformers' logits.
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model("llama"), dtype=torch.float32).eval()
    ids = torch.tensor([prompts[0]])
    with torch.inference_mode():
        result = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                max_new_tokens=8, output_logits=True, return_dict_in_generate=True)
    expected = [torch.log_softmax(step[0].float(), dim=-1) for step in result.logits]
    for entry, step_logprobs in zip(outputs[0].outputs[0].logprobs, expected):
        assert entry.logprob == pytest.approx(step_logprobs[entry.token_id].item(), abs=1e-4)
        top_ids = step_logprobs.topk(3).indices.tolist()
        assert [token_id for token_id, _ in entry.top] == top_ids

    no_top = llm.generate(prompts[:1], greedy(4, logprobs=0))[0].outputs[0]
    assert all(entry.top == [] for entry in no_top.logprobs)
    none = llm.generate(prompts[:1], greedy(4))[0].outputs[0]
    assert none.logprobs is None and none.cumulative_logprob is None


# ---- everything at once ---------------------------------------------------------------

def test_mixed_workload_under_pressure(make_llm, hf_greedy):
    """Shared prefixes, chunked prefill, forks, sampling and preemption in one run."""
    llm = make_llm("llama", shared_instance=False, block_size=8, num_device_blocks=28,
                   max_num_batched_tokens=32)
    base = random_prompts([48], seed=26)[0]
    tails = random_prompts((2, 9, 17, 0, 30, 5, 12, 1), seed=27)
    prompts = [base[:24 + 3 * i] + tail for i, tail in enumerate(tails)]
    params = []
    for i in range(len(prompts)):
        if i % 3 == 1:
            params.append(SamplingParams(temperature=0.9, top_k=50, seed=i, max_tokens=20, n=2))
        else:
            params.append(greedy(20, n=2 if i % 4 == 0 else 1))
    outputs = llm.generate(prompts, params)
    greedy_outputs = [o for o, p in zip(outputs, params) if p.is_greedy]
    assert_greedy_matches(greedy_outputs, "llama", 20, hf_greedy)
    stats = llm.stats()
    assert stats["prefix_cache_hit_rate"] > 0
    assert sum(stats["num_preemptions_by_mode"].values()) > 0
    # Seeded samples come out the same on a roomy engine.
    roomy = make_llm("llama", block_size=8)
    sampled = [i for i, p in enumerate(params) if not p.is_greedy]
    again = roomy.generate([prompts[i] for i in sampled], [params[i] for i in sampled])
    for i, output in zip(sampled, again):
        assert ([c.token_ids for c in output.outputs]
                == [c.token_ids for c in outputs[i].outputs])


# ---- streaming ------------------------------------------------------------------------

@pytest.mark.skipif(importlib.util.find_spec("pagedserve.workers.offline.async_engine") is None,
                    reason="the async engine is not written yet")
def test_async_streaming(make_llm, hf_greedy):
    from pagedserve.workers.offline.async_engine import AsyncLLMEngine

    llm = make_llm("llama", shared_instance=False, block_size=8)
    engine = AsyncLLMEngine(llm.engine)
    prompts = random_prompts((14, 40, 6), seed=28)

    async def collect(request_id, prompt):
        deltas, text, last = [], "", None
        async for output in engine.generate(prompt, greedy(), request_id=request_id):
            deltas.extend(output.outputs[0].delta_token_ids)
            text += output.outputs[0].delta_text
            last = output
        assert last.finished
        assert deltas == last.outputs[0].token_ids
        assert text == last.outputs[0].text
        return last

    async def cancelled():
        stream = engine.generate(prompts[0], greedy(100), request_id="cancelled")
        await stream.__anext__()
        await stream.aclose()  # a client that goes away aborts its request

    async def main():
        results = await asyncio.gather(*(collect(f"s{i}", p) for i, p in enumerate(prompts)),
                                       cancelled())
        with pytest.raises(ValueError):
            async for _ in engine.generate([], greedy()):
                pass
        return results[:-1]

    try:
        outputs = asyncio.run(asyncio.wait_for(main(), timeout=120))
        assert_greedy_matches(outputs, "llama", MAX_TOKENS, hf_greedy)
        for _ in range(100):  # the loop thread finishes the abort
            if engine.num_used_blocks() == 0:
                break
            asyncio.run(asyncio.sleep(0.05))
        assert engine.num_used_blocks() == 0
    finally:
        engine.shutdown()


# ---- randomized stress, checked down to the cache contents -----------------------------

class KVShadow:
    """Tracks which token prefix each cache slot holds, through the engine's own copies.

    Wraps an engine's scheduler, copy execution and forward pass. Before each
    forward it checks that every context slot a scheduled sequence reads holds
    the KV of exactly that sequence's tokens (tracked as the hash of the token
    prefix ending at that position), so a wrong block table, a skipped or
    misordered copy, or a block reused while still cached shows up at once.
    """

    def __init__(self, engine) -> None:
        self.block_size = engine.config.block_size
        self.device: dict[tuple[int, int], int] = {}
        self.host: dict[tuple[int, int], int] = {}
        self.plan = None
        self.num_checked = 0
        cache, runner, scheduler = engine.runner.kv_cache, engine.runner, engine.scheduler
        execute_copies, execute, schedule = cache.execute_copies, runner.execute, scheduler.schedule

        def shadow_copies(swap_out, swap_in, copy_on_write):
            self._copy(swap_out, self.device, self.host)
            self._copy(swap_in, self.host, self.device)
            self._copy(copy_on_write, self.device, self.device)
            return execute_copies(swap_out, swap_in, copy_on_write)

        def shadow_schedule():
            self.plan = schedule()
            return self.plan

        def shadow_execute(model_input, pending_tokens=None):
            result = execute(model_input, pending_tokens)  # brings the persistent block tables up to date
            self._forward(model_input, runner.block_tables.host)
            return result

        cache.execute_copies, runner.execute, scheduler.schedule = (
            shadow_copies, shadow_execute, shadow_schedule)

    def _copy(self, pairs, source, target) -> None:
        for src, dst in pairs:
            for offset in range(self.block_size):
                target[(dst, offset)] = source.get((src, offset))

    def _slot(self, block_table, position) -> tuple[int, int]:
        return block_table[position // self.block_size], position % self.block_size

    def _forward(self, model_input, tables) -> None:
        scheduled = self.plan.scheduled
        assert len(scheduled) == model_input.num_chunks
        for (seq, sched), row, start in zip(scheduled, model_input.rows, model_input.starts):
            # The persistent row the forward read must hold the plan's whole table.
            num_blocks = len(sched.block_table)
            assert (start, tables[row, :num_blocks].tolist()) == (sched.start, sched.block_table)
            for position in range(sched.start, sched.start + sched.num_tokens):
                # The writer and position, not yet its prefix: with overlapped scheduling
                # the token at it may still be pending (read once resolved).
                self.device[self._slot(sched.block_table, position)] = (seq, position)
        # Every layer writes all of a step's tokens before any token reads.
        for seq, sched in scheduled:
            for position in range(sched.start):
                held = self.device.get(self._slot(sched.block_table, position))
                assert held is not None and _prefix(*held) == _prefix(seq, position), (
                    f"{seq.seq_id}: the slot of position {position} (block "
                    f"{sched.block_table[position // self.block_size]}) holds other KV")
            self.num_checked += 1


def _prefix(seq, position: int) -> tuple[int, ...] | None:
    """The tokens up to ``position`` of ``seq`` (None if it has dropped that position)."""
    tokens = seq.token_ids[:position + 1]
    return tuple(tokens) if len(tokens) == position + 1 else None


def test_host_prefix_hits_survive_the_offloads_they_cause(make_llm, hf_greedy):
    """Admitting a prompt whose cached chain is on the host allocates a device block
    per hit; each may evict a device block and offload it to a full host pool. That
    must not evict the chain's own later host blocks (they are pinned first)."""
    block_size = 4
    bytes_per_block = 2 * 2 * block_size * 2 * 16 * 4  # layers, K/V, heads, head_dim, fp32
    llm = make_llm("llama", shared_instance=False, block_size=block_size, num_device_blocks=16,
                   swap_space_gb=16 * bytes_per_block / (1 << 30))
    assert llm.stats()["num_host_blocks"] == 16
    shadow = KVShadow(llm.engine)
    first, second, third = random_prompts((41, 41, 41), seed=32)
    for prompt in (first, second, third, first):  # the last one hits on the host
        assert_greedy_matches(llm.generate([prompt], greedy(4)), "llama", 4, hf_greedy)
    assert shadow.num_checked > 0
    stats = llm.stats()
    assert stats["num_blocks_offloaded"] > 0 and stats["num_blocks_swapped_in"] > 0


@pytest.mark.parametrize("seed", [19, 42, 59, 67])
def test_random_workload_keeps_cache_contents_exact(seed, make_llm, hf_greedy):
    """Random pools, policies, arrivals and aborts; pools may be smaller than one
    max-length sequence. Every forward reads exactly the right KV, greedy outputs
    match transformers, and requests too big for the pool end with "abort"."""
    rng = random.Random(seed)
    block_size = rng.choice([4, 8, 16])
    max_model_len = 160
    config = dict(
        block_size=block_size,
        num_device_blocks=rng.randint(max_model_len // block_size // 2, 2 * max_model_len // block_size),
        swap_space_gb=rng.choice([0, 0.0002, 0.001]),
        preemption_mode=rng.choice([None, "swap", "recompute"]),
        enable_prefix_caching=rng.random() < 0.7,
        max_num_batched_tokens=rng.choice([8, 16, 33, 2048]),
        max_num_seqs=rng.choice([2, 5, 256]),
        scheduling_policy=rng.choice(["fcfs", "priority"]),
        max_model_len=max_model_len)
    if config["swap_space_gb"] == 0 and config["preemption_mode"] == "swap":
        config["preemption_mode"] = None
    llm = make_llm("llama", shared_instance=False, **config)
    engine = llm.engine
    shadow = KVShadow(engine)
    base = [rng.randrange(FIRST_ORDINARY_ID, VOCAB_SIZE) for _ in range(60)]
    requests: dict[str, tuple[list[int], SamplingParams]] = {}
    aborted: set[str] = set()
    finished = {}
    for _ in range(3000):
        if len(requests) < 10 and rng.random() < 0.3:
            prompt = base[:rng.randint(0, 60)] + [rng.randrange(FIRST_ORDINARY_ID, VOCAB_SIZE)
                                                  for _ in range(rng.randint(1, 50))]
            n = rng.choice([1, 1, 2, 3])
            max_tokens = rng.randint(1, 16)
            params = (greedy(max_tokens, n=n) if rng.random() < 0.7 else
                      SamplingParams(temperature=0.9, seed=rng.randint(0, 9), max_tokens=max_tokens, n=n))
            request_id = f"stress-{len(requests)}"
            engine.add_request(request_id, prompt, params, priority=rng.randint(0, 3))
            requests[request_id] = (prompt, params)
        if requests and rng.random() < 0.02:
            request_id = rng.choice(sorted(requests))
            if engine.abort_request(request_id):
                aborted.add(request_id)
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
        llm.check_integrity()
        if len(requests) == 10 and not engine.has_unfinished_requests():
            break
    finished.update((o.request_id, o) for o in engine.step())
    assert sorted(finished) == sorted(requests)
    assert shadow.num_checked > 0
    num_pool_tokens = config["num_device_blocks"] * block_size
    for request_id, output in finished.items():
        prompt, params = requests[request_id]
        for completion in output.outputs:
            if request_id in aborted:
                assert completion.finish_reason == "abort"
                continue
            if completion.finish_reason == "abort":  # the pool cannot hold it
                assert len(prompt) + params.max_tokens > num_pool_tokens - block_size
            if not params.is_greedy:
                continue
            reference = hf_greedy("llama", prompt, params.max_tokens)
            if completion.finish_reason == "abort":
                assert completion.token_ids == reference[:len(completion.token_ids)]
            else:
                assert completion.token_ids == reference, (request_id, completion.finish_reason, len(prompt),
                                                           params.max_tokens, params.n, config)
