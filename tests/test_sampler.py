"""Sampling params, the batched sampler, incremental detokenization and stop handling."""

from __future__ import annotations

import math
import pickle

import random

import pytest
import torch

from pagedserve.workers.outputs.detokenizer import (
    NUM_CONTEXT_TOKENS,
    REPLACEMENT_CHAR,
    IncrementalDetokenizer,
    StopStringMatcher,
    StreamingDetokenizer,
    check_stop,
    decode_function,
)
from pagedserve.workers.sample.sampler import (
    Sampler,
    SamplingBatch,
    SamplingState,
    apply_penalties_to_states,
    apply_top_k_top_p,
    processed_probs,
)
from pagedserve.workers.sample.sampling_params import (
    GREEDY_TEMPERATURE_EPS,
    MAX_ABS_LENGTH_PENALTY,
    MAX_ABS_PENALTY,
    MAX_LOGPROBS,
    MAX_N,
    MAX_REPETITION_PENALTY,
    MAX_TEMPERATURE,
    MAX_TOP_K,
    MIN_REPETITION_PENALTY,
    SamplingParams,
)

VOCAB = 50


def _logits(num_rows: int, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, vocab, generator=generator) * 3


# ---------------------------------------------------------------- SamplingParams


def test_params_defaults_and_normalisation():
    params = SamplingParams()
    assert (params.n, params.max_tokens, params.temperature, params.top_k) == (1, 16, 1.0, -1)
    assert params.stop == [] and params.stop_token_ids == []
    assert not params.is_greedy and not params.has_penalties
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(temperature=1e-6).is_greedy
    assert SamplingParams(top_k=0).top_k == -1
    assert SamplingParams(top_k=None).top_k == -1
    assert SamplingParams(stop="x").stop == ["x"]
    assert isinstance(SamplingParams(temperature=1).temperature, float)


@pytest.mark.parametrize(
    "options, fragment",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "finite"),
        ({"temperature": 1e300}, r"temperature must be <= 3\.403e\+38"),  # killed the engine loop once
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": float("inf")}, "finite"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.1}, "min_p"),
        ({"n": 0}, "n must be"),
        ({"n": True}, "n must be an int"),
        ({"n": 1.0}, "n must be an int"),
        ({"n": 2**31}, "n must be <= 1024"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": "5"}, "max_tokens"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": 1.8e-297}, "repetition_penalty"),  # 0 in float32
        ({"repetition_penalty": 1e6}, "repetition_penalty"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"frequency_penalty": "1"}, "frequency_penalty"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": True}, "logprobs"),
        ({"seed": "7"}, "seed"),
        ({"stop": [""]}, "stop"),
        ({"stop": ["a", 3]}, "stop"),
        ({"stop": 3}, "stop"),
        ({"stop_token_ids": [1, -2]}, "stop_token_ids"),
        ({"stop_token_ids": "12"}, "stop_token_ids"),
        ({"ignore_eos": 1}, "ignore_eos"),
    ],
)
def test_params_validation(options, fragment):
    with pytest.raises(ValueError, match=fragment):
        SamplingParams(**options)


# Every number a request can carry, at the edges of the types the engine's batch holds it in,
# and each field's own bounds: what validation lets through at its edges.
EDGE_NUMBERS = [2**31 - 1, 2**31, 2**63 - 1, 2**63, 2**70, -2**63 - 1, 3.4e38, 3.5e38, 1e300, -1e300, 1e-300]
FIELD_EDGES = {
    "temperature": [0.0, GREEDY_TEMPERATURE_EPS / 2, GREEDY_TEMPERATURE_EPS, MAX_TEMPERATURE],
    "top_p": [5e-324, 1.0],
    "top_k": [-1, 0, 1, MAX_TOP_K],
    "min_p": [5e-324, 1.0],
    "seed": [0, -1],
    "presence_penalty": [-MAX_ABS_PENALTY, MAX_ABS_PENALTY],
    "frequency_penalty": [-MAX_ABS_PENALTY, MAX_ABS_PENALTY],
    "repetition_penalty": [MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY],
    "max_tokens": [1],
    "min_tokens": [0, 1],
    "n": [MAX_N, MAX_N + 1],
    "logprobs": [0, MAX_LOGPROBS],
    "length_penalty": [-MAX_ABS_LENGTH_PENALTY, MAX_ABS_LENGTH_PENALTY],
}
EDGE_FIELDS = list(FIELD_EDGES)


def test_params_that_validate_never_break_the_engine(tiny_model):
    """Each field at each edge value: refused by ``SamplingParams`` (a 400 when served), or the
    request runs as it asked, nothing cut. A value the batch's tensors cannot hold would
    otherwise kill the engine loop, and every request beside it (a temperature of 1e300 did)."""
    from pagedserve.workers.offline.llm import LLM

    prompt = [5, 6, 7]
    max_model_len = 128
    llm = LLM(tiny_model("llama"), num_device_blocks=64, max_model_len=max_model_len, max_num_seqs=8)
    ran = []
    for name in EDGE_FIELDS:
        for value in dict.fromkeys(EDGE_NUMBERS + FIELD_EDGES[name]):
            # length_penalty is beam search's, which takes no temperature; min_tokens is bounded by max_tokens.
            options = ({"use_beam_search": True, "temperature": 0.0, "n": 2, "max_tokens": 2}
                       if name == "length_penalty" else {"temperature": 0.8, "max_tokens": 2, "seed": 0})
            options[name] = value
            if name == "min_tokens" and isinstance(value, int) and value > 0:
                options["max_tokens"] = value
            try:
                params = SamplingParams(**options)
            except ValueError:
                continue
            (output,) = llm.generate([prompt], params, use_tqdm=False)
            assert output.finished and len(output.outputs) == params.n, (name, value)
            room = max_model_len - len(prompt)
            for completion in output.outputs:
                assert min(params.min_tokens, room) <= len(completion.token_ids) <= min(params.max_tokens, room)
                assert completion.finish_reason in ("stop", "length"), (name, value, completion.finish_reason)
            llm.check_integrity()
            assert llm.engine.num_used_blocks() == 0
            ran.append((name, value))
    # Every field reached the engine at its edges, at the batch types' where validation allows them.
    assert {name for name, _ in ran} == set(EDGE_FIELDS)
    assert {("seed", 2**70), ("seed", -2**63 - 1), ("temperature", 3.4e38), ("temperature", MAX_TEMPERATURE),
            ("top_k", 2**31 - 1), ("top_p", 5e-324), ("min_p", 1.0), ("max_tokens", 2**70),
            ("min_tokens", 2**31 - 1), ("n", MAX_N), ("logprobs", MAX_LOGPROBS),
            ("repetition_penalty", MAX_REPETITION_PENALTY), ("length_penalty", -MAX_ABS_LENGTH_PENALTY)} <= set(ran)


def test_params_from_dict_rejects_unknown_keys():
    with pytest.raises(ValueError, match="unknown sampling option.*best_of.*top_q"):
        SamplingParams.from_dict({"temperature": 0.5, "top_q": 0.9, "best_of": 2})
    with pytest.raises(ValueError, match="mapping"):
        SamplingParams.from_dict([("n", 2)])


def test_params_round_trip():
    params = SamplingParams(
        n=2, temperature=0.7, top_k=5, top_p=0.9, seed=3, stop=["a", "bc"],
        stop_token_ids=[7], logprobs=2, repetition_penalty=1.2,
    )
    as_dict = params.to_dict()
    assert SamplingParams.from_dict(as_dict) == params
    assert pickle.loads(pickle.dumps(params)) == params
    msgpack = pytest.importorskip("msgpack")
    assert SamplingParams.from_dict(msgpack.unpackb(msgpack.packb(as_dict))) == params


# ---------------------------------------------------------------- greedy and penalties


def test_greedy_is_argmax_bit_for_bit():
    logits = _logits(8).to(torch.bfloat16)
    logits[3, 10] = logits[3, 11] = logits[3].max() + 1  # a tie: argmax takes the first
    states = [SamplingState(SamplingParams(temperature=0.0)) for _ in range(8)]
    expected = logits.argmax(-1).tolist()
    assert Sampler().sample(logits, states).token_ids == expected
    # Greedy rows mixed with random and penalised rows still take the raw argmax.
    mixed = list(states)
    mixed[1] = SamplingState(SamplingParams(temperature=0.8, seed=1))
    mixed[5] = SamplingState(SamplingParams(repetition_penalty=2.0, top_k=3), [1, 2], [3])
    token_ids = Sampler().sample(logits, mixed).token_ids
    assert [t for i, t in enumerate(token_ids) if i not in (1, 5)] == [
        t for i, t in enumerate(expected) if i not in (1, 5)
    ]


def _reference_penalties(row, prompt, output, repetition, frequency, presence):
    row = row.clone()
    for token in set(prompt) | set(output):
        value = row[token].item()
        row[token] = value / repetition if value > 0 else value * repetition
    for token in set(output):
        row[token] -= frequency * output.count(token) + presence
    return row


def test_penalties_match_reference():
    logits = _logits(4)
    configs = [
        dict(repetition_penalty=1.3),
        dict(frequency_penalty=0.5, presence_penalty=-0.7),
        dict(repetition_penalty=0.8, frequency_penalty=-1.0, presence_penalty=2.0),
        dict(),
    ]
    prompts = [[1, 2, 2, 3], [4, 5], [6, 7, 7], [1, 2]]
    outputs = [[3, 9, 9], [5, 5, 5, 8], [7, 10, 10], [1]]
    states = [
        SamplingState(SamplingParams(temperature=0, **c), p, o)
        for c, p, o in zip(configs, prompts, outputs)
    ]
    got = apply_penalties_to_states(logits, states)
    for i, (config, prompt, output) in enumerate(zip(configs, prompts, outputs)):
        expected = _reference_penalties(
            logits[i], prompt, output,
            config.get("repetition_penalty", 1.0),
            config.get("frequency_penalty", 0.0),
            config.get("presence_penalty", 0.0),
        )
        torch.testing.assert_close(got[i], expected)
    assert torch.equal(got[3], logits[3])  # no penalties: untouched
    # Greedy with penalties is the argmax of the penalised logits.
    assert Sampler().sample(logits, states).token_ids == got.argmax(-1).tolist()


def test_penalty_token_out_of_vocab_raises():
    state = SamplingState(SamplingParams(repetition_penalty=1.5), [VOCAB + 1], [])
    with pytest.raises(ValueError, match="out of range"):
        Sampler().sample(_logits(1), [state])


# ---------------------------------------------------------------- top-k / top-p / min-p


def _reference_probs(row, temperature, top_k, top_p, min_p):
    probs = torch.softmax(row.double() / temperature, -1)
    order = sorted(range(len(row)), key=lambda t: (-row[t].item(), t))
    keep = set(order[:top_k] if top_k > 0 else order)
    kept = [t for t in order if t in keep]
    total = sum(probs[t].item() for t in kept)
    mass, nucleus = 0.0, []
    for t in kept:
        if nucleus and mass >= top_p * total - 1e-9:
            break
        nucleus.append(t)
        mass += probs[t].item()
    top = max(probs[t].item() for t in nucleus)
    support = [t for t in nucleus if probs[t].item() >= min_p * top]
    out = torch.zeros(len(row), dtype=torch.float64)
    for t in support:
        out[t] = probs[t]
    return out / out.sum()


@pytest.mark.parametrize(
    "temperature, top_k, top_p, min_p",
    [
        (1.0, -1, 1.0, 0.0),
        (0.7, 5, 1.0, 0.0),
        (1.3, -1, 0.6, 0.0),
        (1.0, -1, 1.0, 0.2),
        (0.9, 10, 0.8, 0.05),
        (2.0, 1, 1.0, 0.0),
        (1.0, 100, 0.95, 0.0),  # top_k beyond vocab
    ],
)
def test_processed_probs_match_reference(temperature, top_k, top_p, min_p):
    logits = _logits(3, seed=11)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    probs = processed_probs(logits, [params] * 3)
    for i in range(3):
        expected = _reference_probs(logits[i], temperature, top_k, top_p, min_p)
        assert torch.equal(probs[i] > 0, expected > 0), "support differs"
        torch.testing.assert_close(probs[i].double(), expected, atol=1e-6, rtol=1e-5)


def test_top_p_over_many_candidates_matches_reference():
    # A flat distribution over a larger vocab makes the nucleus exceed the first
    # batch of top-p candidates, so the search must widen.
    logits = torch.randn(2, 1000, generator=torch.Generator().manual_seed(5)) * 0.3
    params = [SamplingParams(top_p=0.9), SamplingParams(top_p=0.5, top_k=300)]
    probs = processed_probs(logits, params)
    for i, p in enumerate(params):
        expected = _reference_probs(logits[i], 1.0, p.top_k, p.top_p, 0.0)
        assert int((probs[i] > 0).sum()) > 64
        assert torch.equal(probs[i] > 0, expected > 0)


def _reference_top_k_top_p(row: torch.Tensor, top_k: int, top_p: float) -> list[bool]:
    """Plain Python: which tokens top-k then top-p keep (the smallest most-likely set whose
    renormalised probability reaches p, and every token tied with its last one)."""
    values = row.tolist()
    if 0 < top_k < len(values):
        kth = sorted(values, reverse=True)[top_k - 1]
        values = [v if v >= kth else -math.inf for v in values]
    if top_p < 1.0:
        probs = torch.tensor(values, dtype=torch.float64).softmax(-1).tolist()
        mass, threshold = 0.0, -math.inf
        for t in sorted(range(len(values)), key=lambda t: -probs[t]):
            mass += probs[t]
            if mass >= top_p:
                threshold = values[t]
                break
        values = [v if v >= threshold else -math.inf for v in values]
    return [v > -math.inf for v in values]


@pytest.mark.parametrize("is_widening", [False, True], ids=["one-pass", "widening"])
def test_top_k_top_p_cut_offs_match_a_plain_reference(is_widening):
    """The one-pass search (every device but the CPU) and the widening one (the CPU) keep
    the same tokens as a plain sort: nuclei of a few tokens and of hundreds, ties at the
    cut-off, masked tokens, rows with top-p off left alone."""
    generator = torch.Generator().manual_seed(3)
    flat = torch.randn(4, 1000, generator=generator) * 0.3        # nuclei of hundreds of tokens
    peaked = torch.randn(4, 1000, generator=generator) * 6.0      # nuclei of a few
    tied = (torch.randn(4, 1000, generator=generator) * 2).round()  # many ties at every cut-off
    logits = torch.cat([flat, peaked, tied])
    logits[1, :500] = float("-inf")
    top_k = torch.tensor([-1, -1, 300, 5, -1, 2, -1, 40, -1, 3, 1000, 50])
    top_p = torch.tensor([0.9, 0.5, 0.95, 1.0, 0.9, 0.3, 0.999, 0.8, 0.7, 1.0, 0.9, 0.99])
    kept = torch.isfinite(apply_top_k_top_p(logits, top_k, top_p, is_widening=is_widening))
    for row in range(logits.shape[0]):
        expected = _reference_top_k_top_p(logits[row], int(top_k[row]), float(top_p[row]))
        assert kept[row].tolist() == expected, f"row {row}"
    assert int(kept[0].sum()) > 64   # wider than the first candidates


def test_sampling_never_reads_the_device():
    """Sampling with temperature, top-k, top-p and min-p (greedy rows mixed in) decides
    everything from the batch's host tensors: on the meta device, which holds no values,
    any read of the logits (``.item()``, ``.tolist()``, ``bool(tensor)``, a shape that
    depends on values) raises. So on a GPU the overlapped engine never waits here."""
    params = [SamplingParams(temperature=0.8, top_p=0.9), SamplingParams(temperature=0),
              SamplingParams(top_k=5, top_p=0.5), SamplingParams(top_k=3),
              SamplingParams(temperature=1.2, top_p=0.7, min_p=0.1), SamplingParams(temperature=1.0)]
    logits = torch.empty(len(params), VOCAB, device="meta")
    for batch_params in (params, params[:1] * 3, params[2:3] * 2):
        token_ids = Sampler(seed=0).sample_tokens(logits[:len(batch_params)],
                                                  SamplingBatch.from_params(batch_params))
        assert token_ids.shape == (len(batch_params),) and token_ids.dtype == torch.int64


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sampling_on_cuda_never_synchronizes():
    params = [SamplingParams(temperature=0.8, top_p=0.9), SamplingParams(temperature=0),
              SamplingParams(top_k=50, top_p=0.95), SamplingParams(temperature=1.2, min_p=0.1)] * 64
    logits = (torch.randn(len(params), 32000) * 4).cuda()
    batch = SamplingBatch.from_params(params)
    sampler = Sampler(seed=0)
    expected = sampler.sample_tokens(logits, batch)   # warm-up (allocations, kernels)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        token_ids = Sampler(seed=0).sample_tokens(logits, batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(token_ids, expected)


def test_top_k_keeps_ties_at_the_boundary():
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0]])
    probs = processed_probs(logits, [SamplingParams(top_k=2)])[0]
    assert (probs > 0).tolist() == [True, False, True, True, False]


def test_sampled_tokens_stay_in_support_and_follow_probs():
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -1.0, -3.0, 4.0]])
    params = SamplingParams(temperature=1.0, top_k=5, top_p=0.9, min_p=0.05)
    probs = processed_probs(logits, [params])[0]
    num_samples = 20000
    states = [SamplingState(params) for _ in range(num_samples)]
    sampler = Sampler(seed=1234)
    token_ids = torch.tensor(sampler.sample(logits.expand(num_samples, -1), states).token_ids)
    counts = torch.bincount(token_ids, minlength=8).double() / num_samples
    assert set(token_ids.tolist()) <= set(torch.nonzero(probs).flatten().tolist())
    assert torch.allclose(counts, probs.double(), atol=0.015)


def test_greedy_rows_have_one_hot_probs():
    logits = _logits(2)
    probs = processed_probs(logits, [SamplingParams(temperature=0)] * 2)
    assert torch.equal(probs.argmax(-1), logits.argmax(-1))
    assert torch.equal(probs.sum(-1), torch.ones(2))


# ---------------------------------------------------------------- seeds


def _step_logits(step: int, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randn(vocab, generator=torch.Generator().manual_seed(1000 + step)) * 2


def _run_steps(batch_for_step, num_steps, sampler):
    """Fake decode loop; ``batch_for_step(outputs, step)`` gives (states, our row)."""
    outputs = []
    for step in range(num_steps):
        states, row = batch_for_step(outputs, step)
        logits = torch.stack(
            [_step_logits(step if i == row else step + 77 * (i + 1)) for i in range(len(states))]
        )
        outputs.append(sampler.sample(logits, states).token_ids[row])
    return outputs


def test_seeded_request_reproduces_whatever_the_batch():
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=42, frequency_penalty=0.3)
    prompt = [1, 2, 3]

    def alone(outputs, step):
        return [SamplingState(params, prompt, list(outputs))], 0

    def batched(outputs, step):
        # Other random rows (seeded and unseeded, different settings) around ours.
        others = [
            SamplingState(SamplingParams(temperature=1.5), [4], [5] * step),
            SamplingState(SamplingParams(temperature=0.5, seed=7, top_k=3)),
            SamplingState(SamplingParams(temperature=0)),
        ][: 1 + step % 3]
        row = step % (len(others) + 1)
        states = others[:row] + [SamplingState(params, prompt, list(outputs))] + others[row:]
        return states, row

    first = _run_steps(alone, 20, Sampler())
    torch.manual_seed(999)  # the default RNG's state must not matter
    second = _run_steps(batched, 20, Sampler(seed=5))
    assert first == second
    assert len(set(first)) > 3  # actually random, not a degenerate argmax


def test_seeded_siblings_differ_but_reproduce():
    params = SamplingParams(n=2, temperature=1.0, seed=9)

    def siblings(outputs_a, outputs_b):
        return [SamplingState(params, [], outputs_a, 0), SamplingState(params, [], outputs_b, 1)]

    def run():
        a, b = [], []
        for step in range(20):
            logits = _step_logits(step).expand(2, -1)
            token_a, token_b = Sampler().sample(logits, siblings(a, b)).token_ids
            a.append(token_a)
            b.append(token_b)
        return a, b

    a1, b1 = run()
    a2, b2 = run()
    assert (a1, b1) == (a2, b2)
    assert a1 != b1


def test_unseeded_sampler_seed_reproduces():
    logits = _logits(4)
    states = [SamplingState(SamplingParams(temperature=1.0)) for _ in range(4)]
    runs = [Sampler(seed=3).sample(logits, states).token_ids for _ in range(2)]
    assert runs[0] == runs[1]


# ---------------------------------------------------------------- logprobs


def test_logprobs_are_raw_log_softmax():
    logits = _logits(3)
    states = [
        SamplingState(SamplingParams(temperature=0, logprobs=3)),
        SamplingState(
            SamplingParams(temperature=0.5, seed=1, logprobs=0, repetition_penalty=1.5), [1], [2]
        ),
        SamplingState(SamplingParams(temperature=0)),
    ]
    output = Sampler().sample(logits, states)
    reference = torch.log_softmax(logits, -1)
    first, second, third = output.logprobs
    assert third is None
    assert first.token_id == output.token_ids[0]
    assert math.isclose(first.logprob, reference[0, first.token_id].item(), rel_tol=1e-6)
    values, ids = reference[0].topk(3)
    assert [t for t, _ in first.top] == ids.tolist()
    for (_, got), want in zip(first.top, values.tolist()):
        assert math.isclose(got, want, rel_tol=1e-6)
    assert second.top == [] and second.token_id == output.token_ids[1]
    assert math.isclose(second.logprob, reference[1, second.token_id].item(), rel_tol=1e-6)


def test_sampler_rejects_bad_inputs():
    with pytest.raises(ValueError, match="rows"):
        Sampler().sample(_logits(2), [SamplingState(SamplingParams())])
    with pytest.raises(ValueError, match="2-D"):
        Sampler().sample(torch.zeros(VOCAB), [])
    assert Sampler().sample(torch.zeros(0, VOCAB), []).token_ids == []


# ---------------------------------------------------------------- detokenizer


UNICODE_TEXTS = [
    "hello world, the quick brown fox jumps over the lazy dog",
    "héllo wörld: naïve café, déjà vu, façade",
    "日本語のテキストと中文字符 mixed with English",
    "emoji time 😀🎉🚀 and more 👍🏽 done",
    "Ελληνικά και русский текст",
]


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<|eos|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(UNICODE_TEXTS * 3, trainer=trainer)
    return tok


def test_tokenizer_splits_multibyte_characters(tokenizer):
    # The test below is only meaningful if some token ends mid-character.
    ids = tokenizer.encode("😀🎉🚀 👍🏽").ids
    pieces = [tokenizer.decode([i]) for i in ids]
    assert any("\ufffd" in piece for piece in pieces)


@pytest.mark.parametrize("text", UNICODE_TEXTS + ["unseen: 你好 🤖 ñ ß"])
def test_incremental_detokenizer_never_splits_characters(tokenizer, text):
    prompt = tokenizer.encode("prompt: 😀").ids
    ids = tokenizer.encode(text).ids
    detokenizer = IncrementalDetokenizer(tokenizer, prompt)
    pieces = [detokenizer.append(t) for t in ids]
    pieces.append(detokenizer.flush())
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) == detokenizer.output_text == tokenizer.decode(ids) == text


def test_incremental_detokenizer_with_transformers_tokenizer(tokenizer):
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|eos|>")
    text = "héllo , world . 😀 ok !"
    ids = hf.encode(text)
    detokenizer = IncrementalDetokenizer(hf, [])
    streamed = "".join(detokenizer.append(t) for t in ids) + detokenizer.flush()
    assert streamed == text


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_function_equals_transformers_decode(tokenizer, tiny_model, skip_special_tokens):
    """The engine's decode goes straight to a fast tokenizer's Rust backend: the same text
    as transformers' ``decode`` (spaces not cleaned up) on random ids, specials included."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    class OwnDecode(PreTrainedTokenizerFast):
        def _decode(self, token_ids, **kwargs):
            return "[" + super()._decode(token_ids, **kwargs) + "]"

    rng = random.Random(7)
    for hf in (PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|eos|>"),
               AutoTokenizer.from_pretrained(tiny_model("llama")),
               OwnDecode(tokenizer_object=tokenizer, eos_token="<|eos|>")):
        decode = decode_function(hf, skip_special_tokens)
        for _ in range(200):
            ids = [rng.randrange(len(hf)) for _ in range(rng.randint(0, 12))]
            assert decode(ids) == hf.decode(ids, skip_special_tokens=skip_special_tokens,
                                            clean_up_tokenization_spaces=False), ids
        # The direct route never enters transformers' Python; an overridden _decode is kept.
        hf._decode = None
        if type(hf) is OwnDecode:
            with pytest.raises(TypeError):
                decode([5])
        else:
            assert decode([5]) == hf.backend_tokenizer.decode([5], skip_special_tokens=skip_special_tokens)


def test_incremental_detokenizer_skips_special_tokens(tokenizer):
    eos = tokenizer.token_to_id("<|eos|>")
    ids = tokenizer.encode("café").ids + [eos] + tokenizer.encode(" ok").ids
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    assert "".join(detokenizer.append(t) for t in ids) == "café ok"


def _sentencepiece_tokenizer():
    """Llama 2's shape: byte fallback, "▁" for spaces, the leading one stripped on decode."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{byte:02X}>" for byte in range(256)]
    tok.train_from_iterator(UNICODE_TEXTS * 3, trainer=trainers.BpeTrainer(
        vocab_size=600, special_tokens=specials, show_progress=False))
    return tok


def _wordpiece_tokenizer():
    """BERT's shape: "##" marks a word's continuation."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(cleanup=True)
    tok.train_from_iterator(UNICODE_TEXTS * 3, trainer=trainers.WordPieceTrainer(
        vocab_size=300, special_tokens=["[UNK]", "[SEP]"], show_progress=False))
    return tok


class _DecodeOnly:
    """A tokenizer known only by its ``decode``: the detokenizer's Python route."""

    def __init__(self, tokenizer) -> None:
        self._decode = decode_function(tokenizer, True)

    def decode(self, ids, skip_special_tokens=True):
        assert skip_special_tokens
        return self._decode(ids)


@pytest.mark.parametrize("kind", ["byte-level", "sentencepiece", "wordpiece", "transformers"])
def test_incremental_detokenizer_routes_stream_the_whole_decode(kind, tokenizer, tiny_model):
    """Random prompts and outputs, special and out-of-vocabulary ids among them: the Rust
    route (a ``tokenizers`` ``DecodeStream``) and the Python route stream the same pieces,
    and they add up to the whole decode's continuation of the prompt's last tokens, also
    where a context that ends inside a character hands the Python route over to a stream
    once text is emitted. (The
    Python route once moved its window past a token that decoded to nothing, a skipped
    special token: SentencePiece then lost the next word's space, WordPiece showed "##".)"""
    from transformers import AutoTokenizer

    tok = {"byte-level": lambda: tokenizer, "sentencepiece": _sentencepiece_tokenizer,
           "wordpiece": _wordpiece_tokenizer,
           "transformers": lambda: AutoTokenizer.from_pretrained(tiny_model("llama"))}[kind]()
    decode = decode_function(tok, True)
    vocab_size = len(tok) if kind == "transformers" else tok.get_vocab_size()
    rng = random.Random(3)
    num_rust = num_handed_over = num_compared = 0
    for _ in range(300):
        prompt = [rng.randrange(vocab_size) for _ in range(rng.randrange(8))]
        ids = [rng.randrange(vocab_size + 4) for _ in range(rng.randrange(1, 40))]
        rust, python = IncrementalDetokenizer(tok, prompt), IncrementalDetokenizer(_DecodeOnly(tok), prompt)
        assert python._stream is None
        started = rust._stream is not None
        num_rust += started
        pieces = [rust.append(t) for t in ids]
        # A context that ends inside a character: the Python route, then a stream.
        num_handed_over += not started and rust._stream is not None
        pieces.append(rust.flush())
        assert pieces == [python.append(t) for t in ids] + [python.flush()], (prompt, ids)
        assert python._stream is None
        context = prompt[-NUM_CONTEXT_TOKENS:]
        head, whole = decode(context), decode(context + ids)
        if whole.startswith(head) and REPLACEMENT_CHAR not in head:
            num_compared += 1
            assert "".join(pieces) == rust.output_text == whole[len(head):], (prompt, ids)
    assert num_rust > 150 and num_compared > 100
    assert num_handed_over >= (300 - num_rust) // 2   # 111 of 113 byte-level, 37 of 38 SentencePiece


def test_incremental_detokenizer_leaves_the_rust_route_when_a_decoder_rewrites_text():
    """A decoder whose text is not monotonic (here a ligature, "ab" -> "X") makes the
    ``DecodeStream`` raise: the detokenizer goes on by the Python route, as that route
    alone would have."""
    from tokenizers import Tokenizer, decoders, models

    class Ligature:
        def decode_chain(self, tokens):
            return ["".join(tokens).replace("ab", "X")]

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2, "c": 3}, unk_token="[UNK]"))
    tok.decoder = decoders.Decoder.custom(Ligature())
    ids = [3, 1, 2, 3, 1, 3]
    rust, python = IncrementalDetokenizer(tok, [3]), IncrementalDetokenizer(_DecodeOnly(tok), [3])
    assert rust._stream is not None
    pieces = [rust.append(t) for t in ids]
    assert rust._stream is None
    assert pieces == [python.append(t) for t in ids] == ["c", "a", "", "c", "a", "c"]


def test_check_stop():
    params = SamplingParams(max_tokens=3, stop_token_ids=[9])
    assert check_stop(params, [1], eos_token_id=2) is None
    assert check_stop(params, [1, 2], eos_token_id=2) == "stop"
    assert check_stop(params, [1, 2], eos_token_id={2, 3}) == "stop"
    assert check_stop(params, [1, 9], eos_token_id=2) == "stop"
    assert check_stop(params, [1, 1, 1], eos_token_id=2) == "length"
    assert check_stop(params, [1, 1, 2], eos_token_id=2) == "stop"
    assert check_stop(SamplingParams(ignore_eos=True), [2], eos_token_id=2) is None
    assert check_stop(params, [1], None, num_prompt_tokens=7, max_model_len=8) == "length"


def test_stop_string_matcher():
    matcher = StopStringMatcher(["stop", "op!", "xyz"])
    assert matcher.find("a stop", num_new_chars=3) == (2, "stop")
    assert matcher.find("a stop here", num_new_chars=1) is None  # already checked
    assert matcher.find("ab op!", num_new_chars=1) == (3, "op!")
    # The earliest start wins when several stop strings complete in the new text.
    assert StopStringMatcher(["cde", "bc"]).find("xabcde", 3) == (2, "bc")
    assert StopStringMatcher(["bcd", "abcde"]).find("xabcde", 2) == (1, "abcde")
    including = StopStringMatcher(["abcd"], include_stop_str_in_output=True)
    assert including.find("xxabcd", 1) == (6, "abcd")
    assert matcher.num_held_back("hello st") == 2
    assert matcher.num_held_back("hello xy") == 2
    assert matcher.num_held_back("hello o") == 1
    assert matcher.num_held_back("hell") == 0


def _stream(tokenizer, text, params, eos=None, extra=()):
    ids = tokenizer.encode(text).ids + list(extra)
    stream = StreamingDetokenizer(tokenizer, [], params, eos_token_id=eos)
    pieces = []
    for token_id in ids:
        pieces.append(stream.append(token_id))
        if stream.is_finished:
            break
    return stream, pieces


def test_stop_string_across_token_boundaries(tokenizer):
    text = "the quick brown fox jumps over the lazy dog"
    stop = "fox jumps"
    assert not any(stop in tokenizer.decode([t]) for t in tokenizer.encode(text).ids)
    params = SamplingParams(stop=["lazy", stop], max_tokens=100)
    stream, pieces = _stream(tokenizer, text, params)
    assert stream.finish_reason == "stop" and stream.stop_reason == stop
    assert stream.output_text == "the quick brown "
    assert "".join(pieces) == stream.output_text
    # No streamed prefix ever showed part of the stop string.
    shown = ""
    for piece in pieces:
        shown += piece
        assert not any(shown.endswith(stop[:k]) for k in range(1, len(stop)))


def test_stop_string_included_when_asked(tokenizer):
    params = SamplingParams(stop=["café"], include_stop_str_in_output=True, max_tokens=100)
    stream, pieces = _stream(tokenizer, "héllo wörld: naïve café, déjà vu", params)
    assert stream.output_text == "héllo wörld: naïve café"
    assert "".join(pieces) == stream.output_text


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_on_long_streams_cut_at_the_earliest_match(tokenizer, include):
    """Random stop strings (1-12 characters, some never present) over a long text: the
    output is the text up to the earliest match, and the streamed pieces add up to it."""
    rng = random.Random(5)
    words = ["the", "quick", "brown", "fox", "café", "naïve", "déjà", "vu", "jumps", "over", "lazy", "dog", "😀"]
    for trial in range(30):
        text = " ".join(rng.choice(words) for _ in range(300))
        ids = tokenizer.encode(text).ids
        full = tokenizer.decode(ids)
        stops = []
        for _ in range(rng.randrange(1, 4)):
            start = rng.randrange(len(full) // 3, len(full) - 12) if trial % 3 else 0
            stops.append(full[start:start + rng.randrange(1, 13)] if trial % 5 else "zzz" + str(trial))
        params = SamplingParams(stop=stops, include_stop_str_in_output=include, max_tokens=len(ids) + 1)
        stream, pieces = _stream(tokenizer, text, params)
        found = [(full.find(stop), stop) for stop in stops if stop in full]
        if found:
            index, stop = min(found, key=lambda item: (item[0], -len(item[1])))
            assert stream.finish_reason == "stop"
            expected = full[:index + len(stream.stop_reason)] if include else full[:index]
            assert full.find(stream.stop_reason) == index
        else:
            expected = full
        assert stream.output_text == expected
        assert "".join(pieces) == expected


def test_stream_holds_back_possible_stop_prefix(tokenizer):
    params = SamplingParams(stop=["world!"], max_tokens=100)
    stream = StreamingDetokenizer(tokenizer, [], params, eos_token_id=None)
    shown = ""
    for token_id in tokenizer.encode("hello world").ids:
        shown += stream.append(token_id)
    assert shown == "hello "  # "world" might still become "world!"
    shown += stream.append(tokenizer.encode(" again").ids[0])
    assert shown.startswith("hello world")  # released once it cannot match


def test_stream_finish_reasons(tokenizer):
    eos = tokenizer.token_to_id("<|eos|>")
    params = SamplingParams(max_tokens=100)
    stream, pieces = _stream(tokenizer, "café 😀", params, eos=eos, extra=[eos])
    assert stream.finish_reason == "stop" and stream.stop_reason is None
    assert "".join(pieces) == stream.output_text == "café 😀"
    stop_id = tokenizer.encode(" ok").ids[0]
    params = SamplingParams(max_tokens=100, stop_token_ids=[stop_id])
    stream, pieces = _stream(tokenizer, "hello", params, extra=[stop_id])
    assert stream.finish_reason == "stop" and stream.stop_reason == stop_id
    assert stream.output_text == "hello"
    ids = tokenizer.encode("emoji time 😀🎉").ids
    params = SamplingParams(max_tokens=len(ids) - 1)
    stream, pieces = _stream(tokenizer, "emoji time 😀🎉", params)
    assert stream.finish_reason == "length"
    assert "".join(pieces) == stream.output_text == tokenizer.decode(ids[:-1])
    with pytest.raises(ValueError, match="finished"):
        stream.append(ids[-1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sampler_on_cuda_matches_cpu_where_deterministic():
    logits = _logits(6)
    states = [
        SamplingState(SamplingParams(temperature=0)),
        SamplingState(SamplingParams(temperature=0, repetition_penalty=1.5), [1, 2], [3]),
        SamplingState(SamplingParams(temperature=1.0, top_k=1, seed=3)),
        SamplingState(SamplingParams(temperature=0.7, top_p=0.8, min_p=0.1, seed=4, logprobs=2)),
        SamplingState(SamplingParams(temperature=1.0)),
        SamplingState(SamplingParams(temperature=0.5, frequency_penalty=1.0), [], [5, 5]),
    ]
    cpu = Sampler().sample(logits, states)
    cuda = Sampler().sample(logits.cuda(), states)
    assert cuda.token_ids[:4] == cpu.token_ids[:4]
    assert cuda.logprobs[3].token_id == cuda.token_ids[3]


def test_rows_with_non_finite_logits_fall_back_to_their_argmax():
    """An overflowing row yields its raw argmax, never an out-of-vocabulary id, and the
    other rows sample as usual."""
    logits = _logits(3, seed=11)
    logits[1, 7] = float("inf")
    logits[2] = float("nan")
    logits[2, 4] = 5.0
    states = [SamplingState(SamplingParams(temperature=0.7, seed=row)) for row in range(3)]
    token_ids = Sampler().sample(logits, states).token_ids
    assert token_ids[1:] == [7, 4]
    healthy = Sampler().sample(logits[:1], states[:1]).token_ids
    assert token_ids[0] == healthy[0]


def test_unseeded_samplers_draw_fresh_streams_and_seeded_ones_reproduce():
    logits = _logits(64)
    states = [SamplingState(SamplingParams(temperature=1.0)) for _ in range(64)]
    torch.manual_seed(0)  # torch's default RNG must not decide the stream
    first, second = Sampler(), Sampler()
    assert first.seed != second.seed
    drawn = first.sample(logits, states).token_ids
    assert drawn != second.sample(logits, states).token_ids
    assert Sampler(seed=first.seed).sample(logits, states).token_ids == drawn


@pytest.mark.parametrize("kind", ["byte-level", "sentencepiece", "wordpiece", "transformers"])
def test_extending_a_detokenizer_emits_what_appending_one_token_at_a_time_does(kind, tokenizer, tiny_model):
    """``extend`` (a byte-level stream steps once for many tokens) against ``append`` token by
    token, then more tokens one by one and a flush: the same text, random ids with special and
    out-of-vocabulary ones among them, prompt contexts ending inside a character too."""
    from transformers import AutoTokenizer

    tok = {"byte-level": lambda: tokenizer, "sentencepiece": _sentencepiece_tokenizer,
           "wordpiece": _wordpiece_tokenizer,
           "transformers": lambda: AutoTokenizer.from_pretrained(tiny_model("llama"))}[kind]()
    vocab_size = len(tok) if kind == "transformers" else tok.get_vocab_size()
    rng = random.Random(5)
    num_bulk = 0
    for _ in range(300):
        prompt = [rng.randrange(vocab_size) for _ in range(rng.randrange(8))]
        ids = [rng.randrange(vocab_size + 4) for _ in range(rng.randrange(1, 60))]
        cut = rng.randrange(len(ids) + 1)
        bulk, single = IncrementalDetokenizer(tok, prompt), IncrementalDetokenizer(tok, prompt)
        num_bulk += bulk._steps_in_bulk and bulk._stream is not None and cut > 1
        text = bulk.extend(ids[:cut]) + "".join(bulk.append(t) for t in ids[cut:]) + bulk.flush()
        assert text == "".join(single.append(t) for t in ids) + single.flush(), (prompt, ids, cut)
        assert bulk.output_text == single.output_text and bulk.num_output_tokens == len(ids)
    assert (num_bulk > 150) == (kind in ("byte-level", "transformers")), num_bulk


def test_a_streaming_detokenizer_extended_ends_as_one_appended_token_by_token(tokenizer):
    """What the output processor's catch-up does for a sequence decoded only at its end: all
    but its last token at once, then the last with its finish. A sequence with stop strings
    takes its tokens one at a time (any of them may end it)."""
    rng = random.Random(7)
    vocab_size = tokenizer.get_vocab_size()
    params = SamplingParams(max_tokens=64)
    for _ in range(100):
        prompt = [rng.randrange(vocab_size) for _ in range(rng.randrange(8))]
        ids = [rng.randrange(vocab_size) for _ in range(rng.randrange(2, 50))]
        bulk = StreamingDetokenizer(tokenizer, prompt, params, eos_token_id=None)
        single = StreamingDetokenizer(tokenizer, prompt, params, eos_token_id=None)
        text = bulk.extend(ids[:-1]) + bulk.append(ids[-1], "length")
        assert text == "".join(single.append(t, None) for t in ids[:-1]) + single.append(ids[-1], "length")
        assert bulk.output_text == single.output_text == bulk.streamed_text
        assert (bulk.finish_reason, bulk.output_token_ids) == ("length", ids)
    with_stops = StreamingDetokenizer(tokenizer, [], SamplingParams(stop=["x"]), eos_token_id=None)
    with pytest.raises(ValueError, match="one at a time"):
        with_stops.extend([5, 6])
