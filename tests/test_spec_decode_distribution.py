"""Sampling with each speculative method follows the target's distribution, end to end.

For every method (n-gram, a draft model, an EAGLE and an EAGLE-3 head), thousands of unseeded
requests of three tokens each run through the engine with top-k 3 (27 possible outputs); the
first token comes from the prompt's step, the next two from a verification step of the
method's proposal (one token: the request's last two). Their joint frequencies are held within a total-variation bound of
the target's exact distribution, computed from transformers' logits in float32 with the
sampler's own temperature and top-k. The verifier alone is tested the same way, on a
vocabulary of 12, in ``test_spec_decode.py``; here the proposers, the draft KV and the
engine's plumbing of probabilities are in the loop.
"""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.devtools.model_factory import ensure_model
from pagedserve.workers.sample.sampler import processed_probs
from offline_checks import assert_idle

pytestmark = pytest.mark.usefixtures("one_torch_thread")

K = 2
NUM_SAMPLES = 6000
PARAMS = SamplingParams(temperature=1.0, top_k=3, max_tokens=3, ignore_eos=True)
# Built for the n-gram lookup: each of the 3 first tokens top-k leaves occurs in it once,
# followed by the target's likeliest token after it (190 -> 724, 578 -> 96, 621 -> 374), so
# that its proposals are both kept and rejected (``exact`` checks it still holds).
PROMPT = [16, 53, 90, 127, 190, 724, 238, 275, 312, 349, 386, 423, 460, 497, 534, 571, 578, 96, 682, 719,
          756, 793, 830, 867, 904, 941, 978, 15, 621, 374, 126, 163, 200, 237, 274, 311, 348, 385, 422, 459,
          496, 533, 570, 607, 644, 681, 718, 755, 792, 829, 866, 903, 940, 977, 14, 51, 88, 125, 162, 199]


def method_config(method: str, target: str) -> dict:
    """``method``'s configuration; the draft model is the target itself, whose proposals (its
    greedy tokens) are kept about as often as the likeliest token is sampled."""
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1, "prompt_lookup_max": 1}
    model = target if method == "draft_model" else str(ensure_model("llama", f"tiny-{method}"))
    return {"method": method, "model": model, "num_speculative_tokens": K}


@pytest.fixture(scope="module")
def exact(tiny_model) -> dict[tuple[int, int, int], float]:
    """P(t1, t2, t3 | PROMPT) under PARAMS, from transformers."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model("llama"), torch_dtype=torch.float32).eval()

    def next_probs(tokens: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([tokens])).logits[0, -1:].float()
        return processed_probs(logits, [PARAMS])[0]

    joint = {}
    first = next_probs(PROMPT)
    for t1 in first.nonzero().flatten().tolist():
        second = next_probs(PROMPT + [t1])
        assert PROMPT.count(t1) == 1 and PROMPT[PROMPT.index(t1) + 1] == int(second.argmax())
        for t2 in second.nonzero().flatten().tolist():
            third = next_probs(PROMPT + [t1, t2])
            for t3 in third.nonzero().flatten().tolist():
                joint[(t1, t2, t3)] = float(first[t1] * second[t2] * third[t3])
    assert len(joint) == 27 and abs(sum(joint.values()) - 1) < 1e-4
    return joint


@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle", "eagle3"])
def test_unseeded_samples_follow_the_targets_distribution(method, exact, tiny_model):
    llm = LLM(tiny_model("llama"), device="cpu", dtype="float32", swap_space_gb=0.001, num_device_blocks=2048,
              max_num_seqs=256, seed=1, speculative_config=method_config(method, tiny_model("llama")))
    outputs = llm.generate([PROMPT] * NUM_SAMPLES, PARAMS, use_tqdm=False)
    counts = Counter(tuple(output.outputs[0].token_ids) for output in outputs)
    stats = llm.stats()
    # Every request proposed its second token; proposals were rejected, and those of the n-gram
    # lookup and the draft (the likeliest token) also kept. A random EAGLE head's proposals fall
    # outside the top 3, so its requests test the resampling of a rejected position only.
    assert stats["spec_decode_num_drafts"] >= NUM_SAMPLES, stats["spec_decode_num_drafts"]
    assert stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
    if method in ("ngram", "draft_model"):
        assert stats["spec_decode_num_accepted_tokens"] > NUM_SAMPLES // 10
    assert set(counts) <= set(exact), set(counts) - set(exact)
    total_variation = 0.5 * sum(abs(counts.get(cell, 0) / NUM_SAMPLES - p) for cell, p in exact.items())
    # Sampling noise alone: about 0.02 at 6,000 samples over 27 cells.
    assert total_variation < 0.05, (method, total_variation, counts.most_common(5))
    # Per position: the second token's marginal too (the one a rejected proposal resamples).
    second = Counter(cell[1] for cell in itertools.chain.from_iterable([cell] * n for cell, n in counts.items()))
    exact_second = Counter()
    for cell, p in exact.items():
        exact_second[cell[1]] += p
    assert 0.5 * sum(abs(second[t] / NUM_SAMPLES - p) for t, p in exact_second.items()) < 0.03
    assert_idle(llm)
