"""vLLM's sampling extensions on the engine: prompt logprobs (against transformers),
min_tokens, logit_bias and allowed_token_ids (against transformers), truncate_prompt_tokens,
special-token spacing, token bytes, and the sampler's token bitmasks."""

from __future__ import annotations

import random

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.workers.outputs.detokenizer import IncrementalDetokenizer, StreamingDetokenizer, TokenBytes
from pagedserve.workers.sample.sampler import Sampler, SamplingState, apply_token_bitmask

VOCAB = 1024
TOLERANCE = 1e-4


def random_prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [1] + [rng.randrange(5, VOCAB) for _ in range(length - 1)]


@pytest.fixture(scope="module")
def hf_model(tiny_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model("llama"), dtype=torch.float32).eval()


def hf_prompt_logprobs(model, token_ids: list[int]) -> torch.Tensor:
    """log p(token i | tokens < i) for i >= 1, from one transformers forward pass."""
    with torch.inference_mode():
        logits = model(torch.tensor([token_ids])).logits[0].float()
    return logits.log_softmax(-1)


@pytest.fixture(scope="module")
def make_llm(tiny_model):
    torch.set_num_threads(1)
    built = []

    def make(**kwargs) -> LLM:
        kwargs.setdefault("num_device_blocks", 256)
        llm = LLM(tiny_model("llama"), device="cpu", dtype="float32", block_size=8,
                  swap_space_gb=0.001, **kwargs)
        built.append(llm)
        return llm

    yield make
    for llm in built:
        llm.check_integrity()
        assert llm.engine.num_used_blocks() == 0


def assert_prompt_logprobs_match(output, reference: torch.Tensor, k: int) -> None:
    prompt = output.prompt_token_ids
    entries = output.prompt_logprobs
    assert entries is not None and len(entries) == len(prompt) and entries[0] is None
    for position in range(1, len(prompt)):
        entry = entries[position]
        assert entry.token_id == prompt[position]
        expected = reference[position - 1]
        assert abs(entry.logprob - expected[prompt[position]].item()) < TOLERANCE, position
        values, ids = expected.topk(k)
        assert [t for t, _ in entry.top] == ids.tolist()
        assert all(abs(v - w) < TOLERANCE for (_, v), w in zip(entry.top, values.tolist()))


@pytest.mark.parametrize("max_num_batched_tokens", [None, 16])
def test_prompt_logprobs_match_transformers(make_llm, hf_model, max_num_batched_tokens):
    """Whole and chunked prefills (16-token chunks), batched with other requests."""
    llm = make_llm(max_num_batched_tokens=max_num_batched_tokens, max_model_len=512)
    prompts = [random_prompt(n, seed=n) for n in (2, 9, 40, 75)]
    params = [SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=k) for k in (0, 1, 3, 5)]
    params.append(SamplingParams(temperature=0, max_tokens=3))
    outputs = llm.generate(prompts + [random_prompt(30, seed=99)], params)
    for output, param in zip(outputs, params):
        if param.prompt_logprobs is None:
            assert output.prompt_logprobs is None
            continue
        assert_prompt_logprobs_match(output, hf_prompt_logprobs(hf_model, output.prompt_token_ids),
                                     param.prompt_logprobs)
    # A one-token prompt has only the leading None.
    [single] = llm.generate([[1]], SamplingParams(max_tokens=1, prompt_logprobs=2))
    assert single.prompt_logprobs == [None]


def test_prompt_logprobs_with_the_prefix_cache(make_llm, hf_model):
    """A request asking for prompt logprobs does not read cached blocks (they hold no
    logits), so its logprobs are complete and exact; the blocks it writes still serve
    later requests that do not ask for them."""
    llm = make_llm(enable_prefix_caching=True)
    shared = random_prompt(48, seed=7)
    prompt = shared + [11, 12, 13]
    [warm] = llm.generate([shared + [20, 21]], SamplingParams(temperature=0, max_tokens=2))
    [cold_hit] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2))
    assert cold_hit.metrics.num_cached_tokens >= 40  # the cache works for ordinary requests
    [scored] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2))
    assert scored.metrics.num_cached_tokens == 0
    assert_prompt_logprobs_match(scored, hf_prompt_logprobs(hf_model, prompt), 2)
    assert scored.outputs[0].token_ids == cold_hit.outputs[0].token_ids
    # Blocks written by the scored request are hits for the next one.
    llm.reset_prefix_cache()
    fresh = random_prompt(40, seed=8)
    [scored_first] = llm.generate([fresh + [5]], SamplingParams(max_tokens=1, prompt_logprobs=0))
    assert scored_first.metrics.num_cached_tokens == 0
    [after] = llm.generate([fresh + [6]], SamplingParams(temperature=0, max_tokens=1))
    assert after.metrics.num_cached_tokens >= 32


def test_prompt_logprobs_survive_preemption(make_llm, hf_model):
    """A pool too small for the batch preempts (recompute) sequences mid-prefill; each
    prompt position is still scored once and exactly."""
    llm = make_llm(num_device_blocks=24, max_num_batched_tokens=32, preemption_mode="recompute")
    prompts = [random_prompt(n, seed=100 + n) for n in (60, 70, 50, 66)]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, prompt_logprobs=1))
    assert llm.stats()["num_preemptions_by_mode"]["recompute"] > 0
    for output in outputs:
        assert_prompt_logprobs_match(output, hf_prompt_logprobs(hf_model, output.prompt_token_ids), 1)


def test_min_tokens_matches_transformers(make_llm, tiny_model):
    """EOS and stop tokens are masked until min_tokens, as transformers' min_new_tokens."""
    from transformers import AutoModelForCausalLM

    llm = make_llm()
    prompt = random_prompt(12, seed=3)
    [free] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12))
    stop_token = free.outputs[0].token_ids[2]
    [early] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_token]))
    assert early.outputs[0].token_ids == free.outputs[0].token_ids[:3]
    params = SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_token], min_tokens=6)
    [held] = llm.generate([prompt], params)
    model = AutoModelForCausalLM.from_pretrained(tiny_model("llama"), dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        reference = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                   max_new_tokens=12, min_new_tokens=6,
                                   eos_token_id=[stop_token, 2, 4])[0, len(prompt):].tolist()
    assert held.outputs[0].token_ids == reference
    assert len(held.outputs[0].token_ids) > 6
    assert held.outputs[0].token_ids[2] != stop_token


class _BiasAndAllow:
    """A transformers logits processor: ``allowed`` tokens only, ``bias`` added (the oracle)."""

    def __init__(self, bias: dict[int, float], allowed: list[int] | None) -> None:
        self.bias, self.allowed = bias, allowed

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        if self.allowed is not None:
            keep = torch.zeros_like(scores, dtype=torch.bool)
            keep[:, self.allowed] = True
            scores = scores.masked_fill(~keep, float("-inf"))
        for token_id, value in self.bias.items():
            scores[:, token_id] += value
        return scores


def test_logit_bias_and_allowed_token_ids_match_transformers(make_llm, hf_model):
    """Greedy with a logit bias (pushing some tokens up and banning others) and with allowed
    token ids equals transformers' generate with a processor doing the same; in one batch
    with a plain row, which is unchanged. Logprobs stay the raw model's."""
    from transformers import LogitsProcessorList

    llm = make_llm()
    prompts = [random_prompt(9, seed=21), random_prompt(14, seed=22), random_prompt(6, seed=23)]
    [free] = llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    first = free.outputs[0].token_ids
    cases = [({first[3]: 3.0, first[0]: -100.0, 77: 2.5}, None), ({}, [17, 301, 522, 800, first[1]]),
             ({301: 1.5}, [17, 301, 522])]
    for bias, allowed in cases:
        params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=1,
                                logit_bias=bias or None, allowed_token_ids=allowed)
        plain = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
        outputs = llm.generate(prompts, [params, params, plain])
        for prompt, output in zip(prompts[:2], outputs):
            ids = torch.tensor([prompt])
            with torch.inference_mode():
                reference = hf_model.generate(
                    ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=10,
                    logits_processor=LogitsProcessorList([_BiasAndAllow(bias, allowed)]),
                    eos_token_id=None)[0, len(prompt):].tolist()
            assert output.outputs[0].token_ids == reference, (bias, allowed)
            if allowed is not None:
                assert set(reference) <= set(allowed)
            # The sampled token's logprob is the raw model's: the first one from the prompt's forward.
            raw = hf_prompt_logprobs(hf_model, prompt)[-1, reference[0]].item()
            sampled = output.outputs[0].logprobs[0]
            assert sampled.token_id == reference[0] and sampled.logprob == pytest.approx(raw, abs=TOLERANCE)
        [plain_alone] = llm.generate(prompts[2:], plain)
        assert outputs[2].outputs[0].token_ids == plain_alone.outputs[0].token_ids
    assert free.outputs[0].token_ids[0] not in llm.generate(
        prompts[:1], SamplingParams(temperature=0, max_tokens=1, logit_bias={first[0]: -100.0}))[0].outputs[0].token_ids


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_logit_bias_and_allowed_token_ids_apply_to_sampled_rows(device):
    """Random rows: only allowed tokens are drawn, and a +100 bias takes every draw."""
    sampler = Sampler(seed=0)
    logits = torch.randn(6, 50, device=device)
    allowed = SamplingParams(temperature=1.0, allowed_token_ids=[3, 9, 40])
    forced = SamplingParams(temperature=0.7, top_p=0.9, logit_bias={12: 100.0})
    for _ in range(20):
        out = sampler.sample(logits, [SamplingState(allowed), SamplingState(forced)] * 3)
        assert all(t in (3, 9, 40) for t in out.token_ids[0::2]) and out.token_ids[1::2] == [12] * 3


def test_the_samples_of_an_n_request_all_keep_its_biases(make_llm):
    """n > 1 forks at the first token: every sample keeps the allowed ids, the ban by bias
    and the bad word, in the same batch as another such request."""
    llm = make_llm()
    word = llm.get_tokenizer().decode([10])
    params = SamplingParams(n=3, temperature=1.0, max_tokens=10, ignore_eos=True, seed=4,
                            allowed_token_ids=[10, 11, 12, 13], logit_bias={11: -100.0}, bad_words=[word])
    for output in llm.generate([random_prompt(5, seed=1), random_prompt(8, seed=2)], params):
        assert len(output.outputs) == 3
        for sample in output.outputs:
            assert set(sample.token_ids) <= {12, 13}, sample.token_ids


def test_out_of_vocabulary_logit_bias_is_refused_when_added(make_llm):
    llm = make_llm()
    for params in (SamplingParams(logit_bias={VOCAB: 1.0}), SamplingParams(allowed_token_ids=[5, VOCAB + 3])):
        with pytest.raises(ValueError, match=r"token ids must be in \[0, 1024\)"):
            llm.generate([[1, 2, 3]], params)


class _BanBadWords:
    """The oracle: the last token of each word is banned where the output so far (the tokens
    after ``num_prompt``) ends with the tokens before it (vLLM's rule)."""

    def __init__(self, words: list[list[int]], num_prompt: int) -> None:
        self.words, self.num_prompt = words, num_prompt

    def __call__(self, input_ids, scores):
        output = input_ids[0, self.num_prompt:].tolist()
        scores = scores.clone()
        for word in self.words:
            prefix = word[:-1]
            if len(prefix) <= len(output) and output[len(output) - len(prefix):] == prefix:
                scores[0, word[-1]] = float("-inf")
        return scores


def test_bad_words_are_tokenized_alone_and_after_a_space_as_vllm_does(tiny_model):
    from transformers import AutoTokenizer

    from pagedserve.workers.sample.per_row_features import bad_word_bans, bad_word_token_ids

    tok = AutoTokenizer.from_pretrained(tiny_model("llama"))
    for word in ("PL", " PLrid OR", "45OP", "ic that"):
        alone = tok.encode(word.lstrip(), add_special_tokens=False)
        spaced = tok.encode(" " + word.lstrip(), add_special_tokens=False)
        kept = [alone] + ([spaced] if len(spaced) == len(alone) and spaced[0] != alone[0] else [])
        assert bad_word_token_ids(tok, [word]) == kept
    assert bad_word_token_ids(tok, ["PL"]) == [tok.encode("PL", add_special_tokens=False),
                                               tok.encode(" PL", add_special_tokens=False)]
    assert bad_word_bans([7, 8, 9], [[9, 4], [8, 9, 5], [7, 6], [1], [2, 3]]) == [4, 5, 1]
    assert bad_word_bans([], [[1], [2, 3]]) == [1]


def test_bad_words_match_transformers(make_llm, tiny_model, hf_model):
    """Greedy with bad words taken from the free output (one and several tokens long, with and
    without a leading space) equals transformers' generate with a processor banning the same
    tokens; the banned sequences never appear in the output."""
    from transformers import LogitsProcessorList

    from pagedserve.workers.sample.per_row_features import bad_word_token_ids

    llm = make_llm()
    tok = llm.get_tokenizer()
    checked = 0
    for seed in range(6):
        prompt = random_prompt(9, seed=40 + seed)
        [free] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        ids = free.outputs[0].token_ids
        words = [tok.decode(ids[i:i + length]) for i, length in ((2, 1), (4, 2), (7, 3))]
        words = [w for w in words if w.strip()]
        [out] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                      bad_words=words))
        sequences = bad_word_token_ids(tok, words)
        ids_tensor = torch.tensor([prompt])
        with torch.inference_mode():
            reference = hf_model.generate(
                ids_tensor, attention_mask=torch.ones_like(ids_tensor), do_sample=False, max_new_tokens=12,
                logits_processor=LogitsProcessorList([_BanBadWords(sequences, len(prompt))]),
                eos_token_id=None)[0, len(prompt):].tolist()
        assert out.outputs[0].token_ids == reference, (words, sequences)
        for word in sequences:
            assert not any(reference[i:i + len(word)] == word for i in range(len(reference)))
        checked += out.outputs[0].token_ids != ids
    assert checked >= 3   # the bans changed most outputs


def test_min_tokens_holds_stop_strings(make_llm):
    llm = make_llm()
    prompt = random_prompt(10, seed=4)
    [free] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10))
    tokenizer = llm.get_tokenizer()
    first = tokenizer.decode(free.outputs[0].token_ids[:1])
    assert first.strip()
    [stopped] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, stop=[first]))
    assert stopped.outputs[0].finish_reason == "stop" and len(stopped.outputs[0].token_ids) == 1
    [held] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, stop=[first], min_tokens=4))
    assert len(held.outputs[0].token_ids) > 4


def test_truncate_prompt_tokens(make_llm):
    llm = make_llm(max_model_len=64)
    prompt = random_prompt(50, seed=5)
    [cut] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, truncate_prompt_tokens=20))
    [direct] = llm.generate([prompt[-20:]], SamplingParams(temperature=0, max_tokens=4))
    assert cut.prompt_token_ids == prompt[-20:]
    assert cut.outputs[0].token_ids == direct.outputs[0].token_ids
    # -1: as much of the prompt as the context allows, with room for one output token.
    long_prompt = random_prompt(80, seed=6)
    [fitted] = llm.generate([long_prompt], SamplingParams(max_tokens=4, truncate_prompt_tokens=-1))
    assert fitted.prompt_token_ids == long_prompt[-63:]
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=0)


def test_spaces_between_special_tokens(tiny_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model("llama"))
    words = tokenizer.encode("hello there", add_special_tokens=False)
    ids = [3] + words + [4, 3] + words

    def stream(skip: bool, spaces: bool) -> str:
        params = SamplingParams(skip_special_tokens=skip, spaces_between_special_tokens=spaces,
                                max_tokens=len(ids) + 1, ignore_eos=True)
        detokenizer = StreamingDetokenizer(tokenizer, prompt, params, [2])
        return "".join(detokenizer.append(t) for t in ids)

    prompt = tokenizer.encode("Say:", add_special_tokens=False)
    assert stream(True, True) == "hello therehello there"
    assert stream(False, False) == "<|im_start|>hello there<|im_end|><|im_start|>hello there"
    # The first special token is separated from the prompt's last word too.
    assert stream(False, True) == " <|im_start|> hello there <|im_end|> <|im_start|> hello there"
    # Incremental pieces concatenate to the whole decode whatever the split.
    detokenizer = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=False)
    assert "".join(detokenizer.append(t) for t in ids) + detokenizer.flush() == stream(False, True)


def test_token_bytes_rebuild_split_characters(tiny_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model("llama"))
    token_bytes = TokenBytes(tokenizer)
    for text in ["héllo 😀 日本", "naïve café ☕", "plain ascii", "\n\ttabs and\r\nlines"]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert b"".join(token_bytes(t) for t in ids) == text.encode("utf-8")
    pieces = [token_bytes(t) for t in tokenizer.encode("😀", add_special_tokens=False)]
    assert len(pieces) > 1  # the emoji is split across tokens: no piece decodes alone
    assert token_bytes(4) == b"<|im_end|>"
    # Every token of the vocabulary decodes to its bytes.
    for token_id in range(5, len(tokenizer)):
        piece = token_bytes(token_id)
        decoded = tokenizer.decode([token_id])
        if "\ufffd" not in decoded:
            assert piece == decoded.encode("utf-8"), token_id


# ---- the sampler's bitmasks ----------------------------------------------------------------

def bitmask_allowing(allowed: list[set[int]], vocab: int) -> torch.Tensor:
    words = torch.zeros((len(allowed), (vocab + 31) // 32), dtype=torch.int64)
    for row, tokens in enumerate(allowed):
        for token in tokens:
            words[row, token // 32] |= 1 << (token % 32)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_bitmask_restricts_every_sampling_mode(device):
    vocab = 100
    torch.manual_seed(0)
    logits = torch.randn(6, vocab, device=device) * 3
    allowed = [{0, 31, 32, 99}, {5}, set(range(40, 60)), {63, 64, 65}, {1, 2}, set(range(vocab))]
    bitmask = bitmask_allowing(allowed, vocab)
    masked = apply_token_bitmask(logits, bitmask)
    for row, tokens in enumerate(allowed):
        finite = torch.isfinite(masked[row]).nonzero().flatten().tolist()
        assert set(finite) == tokens
    configs = [dict(temperature=0), dict(temperature=1.0, seed=1), dict(temperature=0.7, top_k=2, seed=2),
               dict(temperature=1.0, top_p=0.5, seed=3), dict(temperature=1.0, min_p=0.3, seed=4,
                                                               repetition_penalty=1.5),
               dict(temperature=0, presence_penalty=1.0)]
    sampler = Sampler(seed=0)
    for trial in range(20):
        states = [SamplingState(SamplingParams(**{**c, "seed": trial} if "seed" in c else c), [1, 2], [5, 40],
                                token_bitmask=bitmask[row]) for row, c in enumerate(configs)]
        result = sampler.sample(logits, states)
        for row, token in enumerate(result.token_ids):
            assert token in allowed[row]
    # Greedy rows take the argmax among the allowed tokens.
    states = [SamplingState(SamplingParams(temperature=0), token_bitmask=bitmask[row]) for row in range(6)]
    expected = [max(tokens, key=lambda t: logits[row, t].item()) for row, tokens in enumerate(allowed)]
    assert sampler.sample(logits, states).token_ids == expected


def test_banned_tokens_yield_to_the_bitmask():
    logits = torch.zeros(2, 64)
    logits[:, 7] = 5.0
    bitmask = bitmask_allowing([{7}, {7, 8}], 64)
    states = [SamplingState(SamplingParams(temperature=0), token_bitmask=bitmask[0], banned_token_ids=[7]),
              SamplingState(SamplingParams(temperature=0), token_bitmask=bitmask[1], banned_token_ids=[7])]
    # Row 0: the grammar allows only the banned token, which wins; row 1 takes the other.
    assert Sampler().sample(logits, states).token_ids == [7, 8]
    plain = [SamplingState(SamplingParams(temperature=0), banned_token_ids=[7])]
    assert Sampler().sample(logits[:1], plain).token_ids != [7]
