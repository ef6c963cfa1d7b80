"""Beam search on copy-on-write blocks, against transformers' ``generate(num_beams=k)``.

The oracle is ``generate(num_beams=k, do_sample=False)`` in float32 on CPU with
the same length penalty, stop tokens and ``early_stopping``: the top beam must be
token-identical (and here every returned beam is, with its score). Then what the
engine does underneath must not change a token: beams forked on shared blocks,
preemption by swap or recompute splitting a group, aborts; and every block comes
back (integrity checked every step in the state machine).
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import pagedserve
from pagedserve import LLM, BeamSearchParams, SamplingParams
from offline_checks import assert_idle

pytestmark = pytest.mark.usefixtures("one_torch_thread")

EOS_IDS = (2, 4)            # the tiny checkpoints' generation_config.eos_token_id
FIRST_ORDINARY_ID = 5
VOCAB_SIZE = 1024


def random_prompts(lengths, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(FIRST_ORDINARY_ID, VOCAB_SIZE) for _ in range(n)] for n in lengths]


def beams(k: int, max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(n=k, max_tokens=max_tokens, temperature=0.0, use_beam_search=True, **kwargs)


@pytest.fixture(scope="module")
def hf_beams(tiny_model):
    """``hf_beams(prompt, k, max_tokens, **generate_kwargs) -> [(output ids, score)]``: transformers'
    k returned beams, best first (tiny llama, float32, CPU), memoised."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model("llama"), dtype=torch.float32).eval()
    cache: dict[tuple, list[tuple[list[int], float]]] = {}

    def generate(prompt: list[int], k: int, max_tokens: int, **kwargs) -> list[tuple[list[int], float]]:
        key = (tuple(prompt), k, max_tokens, tuple(sorted((name, str(v)) for name, v in kwargs.items())))
        if key not in cache:
            ids = torch.tensor([prompt], dtype=torch.long)
            with torch.inference_mode():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, num_beams=k,
                                     num_return_sequences=k, max_new_tokens=max_tokens,
                                     return_dict_in_generate=True, output_scores=True, **kwargs)
            lengths = (out.beam_indices >= 0).sum(dim=1).tolist()
            cache[key] = [(out.sequences[i, len(prompt):len(prompt) + lengths[i]].tolist(),
                           float(out.sequences_scores[i])) for i in range(k)]
        return cache[key]

    return generate


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "overlap"])
def make_llm(request, tiny_model):
    """``make_llm(**engine_kwargs) -> LLM`` on the tiny llama (float32, CPU), shared per
    configuration; every engine must be idle with zero blocks after every test. Every
    test runs without and with overlapped scheduling."""
    shared: dict[tuple, LLM] = {}

    def make(**kwargs) -> LLM:
        kwargs.setdefault("async_scheduling", request.param)
        kwargs.setdefault("device", "cpu")
        kwargs.setdefault("dtype", "float32")
        kwargs.setdefault("swap_space_gb", 0.001)
        kwargs.setdefault("block_size", 4)
        kwargs.setdefault("num_device_blocks", 1024)
        key = tuple(sorted(kwargs.items()))
        if key not in shared:
            shared[key] = LLM(tiny_model("llama"), **kwargs)
        return shared[key]

    make.instances = shared
    return make


@pytest.fixture(autouse=True)
def no_leaks(make_llm):
    yield
    for llm in make_llm.instances.values():
        assert_idle(llm)


def assert_beams_match(output, reference, length_penalty: float = 1.0) -> None:
    """Every beam token-identical to transformers', best first, with its score."""
    assert output.finished
    got = [c.token_ids for c in output.outputs]
    want = [ids for ids, _ in reference]
    assert got[0] == want[0], "the top beam diverged from transformers"
    assert got == want
    for completion, (ids, score) in zip(output.outputs, reference):
        ours = completion.cumulative_logprob / len(ids) ** length_penalty
        assert ours == pytest.approx(score, rel=1e-4, abs=1e-5)


# ---- the oracle -------------------------------------------------------------------------

@pytest.mark.parametrize("k", [2, 4, 8])
def test_beams_match_transformers(k, make_llm, hf_beams):
    llm = make_llm()
    prompts = random_prompts((7, 16, 33), seed=k)
    outputs = llm.generate(prompts, beams(k, 24))
    for prompt, output in zip(prompts, outputs):
        assert len(output.outputs) == k
        assert [c.index for c in output.outputs] == list(range(k))
        assert_beams_match(output, hf_beams(prompt, k, 24))


def stop_tokens_for(hf_beams, prompt: list[int], k: int) -> list[int]:
    """Two tokens the unconstrained search meets early: as stop tokens they end many
    hypotheses, so that length penalties and stopping rules decide the result."""
    [(top, _), *_] = hf_beams(prompt, k, 24)
    return [top[2], top[5]]


@pytest.mark.parametrize("early_stopping", [False, True, "never"])
@pytest.mark.parametrize("length_penalty", [-1.0, 0.0, 1.0, 2.0])
@pytest.mark.parametrize("k", [2, 4, 8])
def test_stopping_rules_and_length_penalty_match_transformers(k, length_penalty, early_stopping, make_llm,
                                                              hf_beams):
    llm = make_llm()
    prompts = random_prompts((9, 21), seed=100 + k)
    for prompt in prompts:
        stop = stop_tokens_for(hf_beams, prompt, k)
        [output] = llm.generate([prompt], beams(k, 24, stop_token_ids=stop, length_penalty=length_penalty,
                                                early_stopping=early_stopping))
        reference = hf_beams(prompt, k, 24, eos_token_id=[*EOS_IDS, *stop], length_penalty=length_penalty,
                             early_stopping=early_stopping)
        assert_beams_match(output, reference, length_penalty)
        for completion in output.outputs:
            if completion.token_ids[-1] in stop:
                assert (completion.finish_reason, completion.stop_reason) == ("stop", completion.token_ids[-1])
            else:
                assert completion.finish_reason == "length"


def test_ignore_eos_matches_transformers_without_eos(make_llm, hf_beams):
    llm = make_llm()
    [prompt] = random_prompts((12,), seed=7)
    [output] = llm.generate([prompt], beams(4, 20, ignore_eos=True))
    assert_beams_match(output, hf_beams(prompt, 4, 20, eos_token_id=None))
    assert all(len(c.token_ids) == 20 and c.finish_reason == "length" for c in output.outputs)


def test_llm_beam_search_api(make_llm, hf_beams):
    """vLLM's ``LLM.beam_search``: BeamSearchOutput per prompt, beam_width sequences whose
    tokens hold prompt and output; the prompt forms vLLM takes."""
    llm = make_llm()
    prompts = random_prompts((8, 14), seed=3)
    text = llm.get_tokenizer().decode(prompts[0])
    results = llm.beam_search([{"prompt_token_ids": prompts[0]}, prompts[1], {"prompt": text}],
                              BeamSearchParams(beam_width=3, max_tokens=10))
    assert [len(r.sequences) for r in results] == [3, 3, 3]
    for prompt, result in zip(prompts, results):
        reference = hf_beams(prompt, 3, 10)
        assert [s.tokens for s in result.sequences] == [prompt + ids for ids, _ in reference]
        top = result.sequences[0]
        assert top.text == llm.get_tokenizer().decode(top.tokens[len(prompt):], skip_special_tokens=True)
        assert top.finish_reason in ("stop", "length")
    retokenized = llm.get_tokenizer().encode(text)
    assert results[2].sequences[0].tokens[:len(retokenized)] == retokenized


def test_beam_search_params_import_where_vllms_do():
    """From the package, as ``SamplingParams``, and from ``sampling_params``, as vLLM's."""
    from pagedserve.workers.sample import sampling_params

    assert BeamSearchParams is sampling_params.BeamSearchParams
    assert "BeamSearchParams" in pagedserve.__all__


@pytest.mark.parametrize("field, value", [
    ("temperature", 0.7), ("top_p", 0.5), ("top_k", 3), ("min_p", 0.1), ("presence_penalty", 0.5),
    ("frequency_penalty", 0.5), ("repetition_penalty", 1.2), ("stop", ["x"]), ("min_tokens", 2),
    ("logprobs", 1), ("prompt_logprobs", 0), ("structured_outputs", {"regex": "a+"})])
def test_fields_beam_search_cannot_honour_are_refused(field, value):
    kwargs = {"temperature": 0.0, field: value}
    with pytest.raises(ValueError, match=f"^{field} cannot be used with use_beam_search"):
        SamplingParams(n=2, use_beam_search=True, **kwargs)


@pytest.mark.parametrize("value", ["no", 1, None])
def test_early_stopping_takes_transformers_values(value):
    with pytest.raises(ValueError, match="early_stopping must be"):
        SamplingParams(use_beam_search=True, temperature=0.0, early_stopping=value)


@pytest.mark.parametrize("value", [1e308, -11.0, float("nan"), float("inf")])
def test_length_penalty_is_bounded(value):
    with pytest.raises(ValueError, match="length_penalty must"):
        SamplingParams(use_beam_search=True, temperature=0.0, length_penalty=value)


# ---- shared blocks --------------------------------------------------------------------------

def test_beams_share_their_prefix_blocks(make_llm):
    """While a group runs, its beams' tables hold far more entries than the pool has
    blocks in use: the prefix is shared, each beam owns at most its last block."""
    llm = make_llm(num_device_blocks=256, enable_prefix_caching=False)
    engine = llm.engine
    [prompt] = random_prompts((40,), seed=5)
    engine.add_request("shared", prompt, beams(8, 16, ignore_eos=True))
    block_size = engine.config.block_size
    max_ratio = 0.0
    while engine.has_unfinished_requests():
        engine.step()
        llm.check_integrity()
        running = engine.scheduler.running
        if len(running) == 8:
            table_entries = sum(len(seq.block_table) for seq in running)
            used = engine.num_used_blocks()
            assert used <= 10 + 8 * 2 + (-(-(40 + 16) // block_size)), (used, table_entries)
            max_ratio = max(max_ratio, table_entries / used)
            # Pruned beams' blocks come back at the next step's plan.
            assert len({block for seq in running for block in seq.block_table}) <= used
    assert max_ratio > 3.0
    assert engine.beam_groups.num_forks >= 7


# ---- preemption, swap and abort ------------------------------------------------------------

@pytest.mark.parametrize("mode", ["swap", "recompute"])
@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_preemption_splits_groups_without_changing_a_token(mode, enable_prefix_caching, make_llm, hf_beams):
    llm = make_llm(num_device_blocks=40, preemption_mode=mode, enable_prefix_caching=enable_prefix_caching,
                   swap_space_gb=0.01)
    prompts = random_prompts((18, 25, 11, 30), seed=21)
    widths = [4, 3, 2, 4]
    outputs = llm.generate(prompts, [beams(k, 20) for k in widths])
    for prompt, k, output in zip(prompts, widths, outputs):
        assert_beams_match(output, hf_beams(prompt, k, 20))
    stats = llm.stats()
    assert stats["num_preemptions_by_mode"][mode] > 0, stats
    assert llm.engine.beam_groups.num_parked > 0
    if mode == "swap":
        assert stats["swapped_out_bytes"] > 0 and stats["swapped_in_bytes"] > 0


def test_abort_of_a_beam_group_returns_every_block(make_llm, hf_beams):
    llm = make_llm(num_device_blocks=48, preemption_mode="swap", swap_space_gb=0.01)
    engine = llm.engine
    prompts = random_prompts((20, 26, 15), seed=31)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, beams(4, 16))
    aborted = {}
    for _ in range(6):
        for output in engine.step():
            assert not output.finished
        llm.check_integrity()
    assert engine.abort_request("r1")
    outputs = {}
    while engine.has_unfinished_requests() or engine.has_pending_outputs():
        for output in engine.step():
            if output.finished:
                (aborted if output.request_id == "r1" else outputs)[output.request_id] = output
        llm.check_integrity()
    assert set(aborted) == {"r1"} and all(c.finish_reason == "abort" for c in aborted["r1"].outputs)
    for i in (0, 2):
        assert_beams_match(outputs[f"r{i}"], hf_beams(prompts[i], 4, 16))


def test_beam_searches_are_never_offered_for_migration(make_llm):
    """A worker may move a preempted single-sample sequence elsewhere; a beam (even of
    width 1) is part of its group's state here, so it is never offered."""
    llm = make_llm(num_device_blocks=512)
    scheduler = llm.engine.scheduler
    offered: list[str] = []
    kv_step = scheduler.kv_step

    def recording_step(step_input):
        offered.extend(step_input.migratable)
        return kv_step(step_input)

    scheduler.kv_step, scheduler.allow_migration = recording_step, True
    try:
        [prompt] = random_prompts((10,), seed=8)
        llm.generate([prompt] * 3, [SamplingParams(max_tokens=3), beams(1, 3), SamplingParams(n=2, max_tokens=3)])
    finally:
        scheduler.kv_step, scheduler.allow_migration = kv_step, False
    assert offered and {seq_id.split("#")[0] for seq_id in offered} == {"offline-" + str(llm._next_id - 3)}


class BeamGroupMachine(RuleBasedStateMachine):
    """Beam searches and sampled requests arrive, steps run, requests are aborted, on a
    pool small enough to preempt (by swap or recompute, prefix caching on or off).
    Every step keeps the KV accounting; every beam search that finishes equals the
    search run alone on a large pool; at the end no block is held."""

    make_llm = None
    reference = None
    prompts = random_prompts((6, 13, 22, 31), seed=41)

    @initialize(mode=st.sampled_from(["swap", "recompute"]), caching=st.booleans())
    def start(self, mode, caching):
        self.llm = self.make_llm(num_device_blocks=36, preemption_mode=mode, enable_prefix_caching=caching,
                                 swap_space_gb=0.01)
        self.engine = self.llm.engine
        self.live: dict[str, tuple[int, int, int]] = {}
        self.next_id = 0

    @rule(prompt=st.integers(0, 3), k=st.integers(1, 4), max_tokens=st.integers(1, 12))
    def add_beam_search(self, prompt, k, max_tokens):
        request_id = f"beam{self.next_id}"
        self.next_id += 1
        self.engine.add_request(request_id, self.prompts[prompt], beams(k, max_tokens))
        self.live[request_id] = (prompt, k, max_tokens)

    @rule(prompt=st.integers(0, 3), n=st.integers(1, 3))
    def add_sampled(self, prompt, n):
        request_id = f"sample{self.next_id}"
        self.next_id += 1
        self.engine.add_request(request_id, self.prompts[prompt], SamplingParams(n=n, max_tokens=8, seed=1))
        self.live[request_id] = None

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort(self, data):
        request_id = data.draw(st.sampled_from(sorted(self.live)))
        assert self.engine.abort_request(request_id)
        del self.live[request_id]

    @rule(num_steps=st.integers(1, 4))
    def step(self, num_steps):
        for _ in range(num_steps):
            self._check(self.engine.step())

    def _check(self, outputs) -> None:
        for output in outputs:
            if not output.finished or output.request_id not in self.live:
                continue
            spec = self.live.pop(output.request_id)
            if spec is not None:
                prompt, k, max_tokens = spec
                expected = self.reference(self.prompts[prompt], k, max_tokens)
                assert [c.token_ids for c in output.outputs] == expected

    @invariant()
    def accounting_holds(self):
        if hasattr(self, "llm"):
            self.llm.check_integrity()

    def teardown(self):
        if not hasattr(self, "llm"):
            return
        for _ in range(2000):
            if not (self.engine.has_unfinished_requests() or self.engine.has_pending_outputs()):
                break
            self._check(self.engine.step())
            self.llm.check_integrity()
        assert not self.live
        assert_idle(self.llm)


def test_beam_groups_state_machine(make_llm):
    reference_llm = make_llm(num_device_blocks=1024)
    cache: dict[tuple, list[list[int]]] = {}

    def reference(prompt, k, max_tokens):
        key = (tuple(prompt), k, max_tokens)
        if key not in cache:
            [output] = reference_llm.generate([prompt], beams(k, max_tokens))
            cache[key] = [c.token_ids for c in output.outputs]
        return cache[key]

    BeamGroupMachine.make_llm = staticmethod(make_llm)
    BeamGroupMachine.reference = staticmethod(reference)
    machine = BeamGroupMachine.TestCase
    machine.settings = settings(max_examples=40, stateful_step_count=25, deadline=None,
                                suppress_health_check=list(HealthCheck))
    machine().runTest()
