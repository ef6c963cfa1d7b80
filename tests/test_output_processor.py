"""Sampled tokens to outputs, on the engine's thread or behind it.

- The persistent batch's vectorized finish checks find exactly the sequences that
  ``check_stop`` ends, for any params and token stream.
- An output processor that runs steps behind the engine (as the async engine's
  output thread does), with aborts, stop strings, n > 1, preemption and every output
  kind interleaved at random (streamed, final, and an output channel's deltas),
  gives every request exactly the outputs the engine gives when it processes each
  step at once, ends every request, and leaks no block.
"""

from __future__ import annotations

import random
from collections import defaultdict, deque

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedserve import LLM, SamplingParams
from pagedserve.workers.outputs.accumulator import OutputAccumulator
from pagedserve.workers.model.block_tables import BlockTableRows
from pagedserve.workers.outputs.detokenizer import check_stop
from pagedserve.workers.model.input_batch import STOP_TOKEN_IDS, InputBatch
from pagedserve.workers.actor.protocol import OutputDelta, deltas_from_batch
from pagedserve.workers.outputs.stream_batch import StreamBatch, StreamTarget
from pagedserve.workers.engine.request import Request, Sequence

pytestmark = pytest.mark.usefixtures("one_torch_thread")

EOS = [2, 3]


@settings(max_examples=200, deadline=None)
@given(params=st.fixed_dictionaries({
           "max_tokens": st.integers(1, 12), "ignore_eos": st.booleans(),
           "stop_token_ids": st.lists(st.integers(0, 9), max_size=2)}),
       prompt_len=st.integers(1, 20), max_model_len=st.integers(8, 40),
       tokens=st.lists(st.integers(0, 9), min_size=1, max_size=14), batch_size=st.integers(1, 5))
def test_vectorized_finish_checks_agree_with_check_stop(params, prompt_len, max_model_len, tokens, batch_size):
    """Each of ``batch_size`` sequences (same params, staggered streams) samples the
    tokens; the batch's counters plus the per-row stop-id check end a sequence exactly
    when ``check_stop`` says it ends."""
    if prompt_len >= max_model_len:
        prompt_len = max_model_len - 1
    sampling = SamplingParams(temperature=0.0, **params)
    batch = InputBatch(BlockTableRows(torch.device("cpu"), num_rows=2), EOS, max_model_len)
    seqs = []
    for i in range(batch_size):
        request = Request(f"r{i}", None, list(range(10, 10 + prompt_len)), sampling)
        seq = Sequence(f"r{i}#0", request, 0, list(request.prompt_token_ids))
        request.seqs.append(seq)
        batch.add(seq)
        seqs.append(seq)
    for step in range(len(tokens) + batch_size):
        live = [s for s in seqs if s.batch_row >= 0]
        if not live:
            break
        sampled = [tokens[(step + int(s.seq_id[1])) % len(tokens)] for s in live]
        rows = torch.tensor([s.batch_row for s in live])
        flags = batch.flags[rows].tolist()
        ends = (batch.count_samples(rows) | batch.ends_on_eos(rows, torch.tensor(sampled))).tolist()
        for seq, token, end, flag in zip(live, sampled, ends, flags):
            seq.append_token(token)
            if flag & STOP_TOKEN_IDS and token in sampling.stop_token_ids:
                end = True
            expected = check_stop(sampling, seq.output_token_ids, EOS, prompt_len, max_model_len)
            assert end == (expected is not None), (seq.output_token_ids, expected)
            if end:
                batch.remove(seq)


# ---- an output processor behind the engine ------------------------------------------------

STOPS = (None, ["a"], ["e", "o"])
# The per-row sampling features that change which token is greedy: they must hold through
# lag, preemption (swap and recompute), overlap and forks as in a request run alone.
LOGIT_FEATURES = ({}, {}, {"logit_bias": {7: 3.0, 300: 5.0, 512: -100.0}},
                  {"allowed_token_ids": [7, 40, 41, 300, 512, 700, 1000]}, {"bad_words": ["e", "the end"]})
PROMPT_IDS = range(5, 1024)


class LaggedOutputs(RuleBasedStateMachine):
    """The engine steps while the processor works through a queue of unprocessed steps
    (as ``AsyncLLMEngine``'s output thread does), and sequences ended by stop strings go
    back to the engine when the processor gets to them."""

    llm: LLM = None
    reference: dict = None

    @initialize()
    def start(self) -> None:
        self.engine = self.llm.engine
        # Each example starts from an empty engine and an empty prefix cache, so that it
        # replays as it first ran (the rules that apply, and so the draws, depend on how many
        # steps a prompt takes): one that failed part-way leaves requests behind, and every
        # example leaves cached prefixes.
        self.queue: deque = deque()
        self.outputs: dict[str, list] = defaultdict(list)
        for request_id in sorted(self.engine.requests):
            self.engine.abort_request(request_id)
        self._drain()
        assert self.engine.num_used_blocks() == 0 and self.engine.reset_prefix_cache()
        self.requests: dict[str, tuple] = {}
        self.keys: dict[int, str] = {}   # a channel request's key -> its id
        self.outputs.clear()
        self.aborted: set[str] = set()
        self.num_added = 0

    @rule(seed=st.integers(0, 10_000), prompt_len=st.integers(1, 40), max_tokens=st.integers(1, 24),
          n=st.sampled_from([1, 1, 2]), stop=st.sampled_from(STOPS),
          kind=st.sampled_from(["stream", "final", "channel"]), features=st.sampled_from(LOGIT_FEATURES))
    def add(self, seed, prompt_len, max_tokens, n, stop, kind, features) -> None:
        rng = random.Random(seed)
        prompt = [rng.choice(PROMPT_IDS) for _ in range(prompt_len)]
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, n=n, stop=stop, **features)
        request_id = f"req-{self.num_added}"
        self.num_added += 1
        target = None
        if kind == "channel":
            target = StreamTarget(f"channel-{self.num_added % 2}", self.num_added)
            self.keys[target.key] = request_id
        self.engine.add_request(request_id, prompt, params, output_kind="stream" if kind == "channel" else kind,
                                stream_target=target)
        self.requests[request_id] = (prompt, params, kind)

    @precondition(lambda self: self.engine.has_unfinished_requests() or self.engine.has_pending_outputs())
    @rule()
    def step(self) -> None:
        self.queue.append(self.engine.step_tokens())

    @precondition(lambda self: self.queue)
    @rule()
    def process(self) -> None:
        processed = self.engine.output_processor.process(self.queue.popleft())
        if processed.stopped:
            self.engine.stop_sequences(processed.stopped)
        for output in processed.outputs:
            self.outputs[output.request_id].append(output)
        for batch in self.engine.output_processor.take_batches().values():
            for key, delta in deltas_from_batch(StreamBatch.unpack(batch.pack())):
                delta.request_id = self.keys[key]
                self.outputs[delta.request_id].append(delta)

    @precondition(lambda self: self.engine.requests)
    @rule(data=st.data())
    def abort(self, data) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.engine.requests)))
        self.engine.abort_request(request_id)
        self.aborted.add(request_id)

    @invariant()
    def accounting_holds(self) -> None:
        if hasattr(self, "engine"):
            self.engine.check_integrity()

    def _drain(self) -> None:
        for _ in range(10_000):
            if self.queue:
                self.process()
            elif self.engine.has_unfinished_requests() or self.engine.has_pending_outputs():
                self.step()
            else:
                break

    def teardown(self) -> None:
        if not hasattr(self, "engine"):
            return
        self._drain()
        self.engine.check_integrity()
        assert self.engine.num_used_blocks() == 0
        for request_id, (prompt, params, kind) in self.requests.items():
            self._check_request(request_id, prompt, params, kind)

    def _check_request(self, request_id, prompt, params, kind) -> None:
        outputs = self.outputs[request_id]
        assert outputs and outputs[-1].finished, f"{request_id} never ended"
        assert all(not o.finished for o in outputs[:-1]), f"{request_id}: an output after its final one"
        if kind == "final":
            assert len(outputs) == 1
        if kind == "channel":   # the wire's deltas: each sample's finish once, rebuilt as the handle does
            assert all(type(o) is OutputDelta for o in outputs)
            accumulator = OutputAccumulator(request_id, None, prompt)
            final = [accumulator.add(o) for o in outputs][-1]
            for completion in final.outputs:   # (an aborted request may end before its samples fork)
                assert sum(s.finish_reason is not None for o in outputs for s in o.samples
                           if s.index == completion.index) == 1
        else:
            final = outputs[-1]
            for completion in final.outputs:
                deltas = [c for o in outputs for c in o.outputs if c.index == completion.index]
                assert "".join(c.delta_text for c in deltas) == completion.text
                assert sum((c.delta_token_ids for c in deltas), []) == completion.token_ids
                assert sum(c.is_newly_finished for c in deltas) == 1
        if request_id in self.aborted:
            return
        key = (tuple(prompt), repr(params))
        if key not in self.reference:
            self.reference[key] = LaggedOutputs.reference_llm.generate([prompt], params)[0]
        expected = self.reference[key]
        got = sorted((c.index, c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in final.outputs)
        assert got == sorted((c.index, c.token_ids, c.text, c.finish_reason, c.stop_reason)
                             for c in expected.outputs)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("pool", [dict(num_device_blocks=512), dict(num_device_blocks=24, swap_space_gb=0.0005)],
                         ids=["roomy", "preempting"])
def test_outputs_behind_the_engine_equal_outputs_at_once(pool, async_scheduling, tiny_model, long_form):
    """With overlapped scheduling too: aborts, stop strings and preemption land between a
    step's launch and the reading of its samples."""
    LaggedOutputs.llm = LLM(tiny_model("llama"), device="cpu", dtype="float32", block_size=4,
                            max_num_batched_tokens=48, async_scheduling=async_scheduling, **pool)
    LaggedOutputs.reference_llm = LLM(tiny_model("llama"), device="cpu", dtype="float32", block_size=4,
                                      num_device_blocks=256)
    LaggedOutputs.reference = {}
    runner = LaggedOutputs.TestCase()
    runner.settings = settings(max_examples=40 if long_form else 8, stateful_step_count=40, deadline=None,
                               suppress_health_check=list(HealthCheck))
    runner.runTest()
    stats = LaggedOutputs.llm.stats()
    assert stats["num_generated_tokens"] > 0


def test_a_migrated_stream_mid_character_continues_without_a_replacement_char(tiny_model):
    """A stream cut by a migration (or an abort) emits no text it was holding back: the
    target, its decoder primed with the tokens so far, emits the completed character, so
    the client's text equals the uninterrupted one."""
    from transformers import AutoTokenizer

    from pagedserve.workers.outputs.output_processor import EngineStep, OutputProcessor, StepTokens, new_stream

    tokenizer = AutoTokenizer.from_pretrained(tiny_model("llama"))
    output = tokenizer.encode("hello 你好 world", add_special_tokens=False)
    cut = next(i for i in range(1, len(output)) if tokenizer.decode(output[:i]).endswith("\ufffd"))
    params = SamplingParams(temperature=0.0, max_tokens=len(output), ignore_eos=True)

    def stream_of(request_id: str, tokens_so_far: list[int]) -> Sequence:
        request = Request(request_id, None, [10, 11, 12], params)
        seq = Sequence(f"{request_id}#0", request, 0, [10, 11, 12] + tokens_so_far)
        seq.stream = new_stream(seq, tokenizer, [2], 512, tokens_so_far)
        request.seqs.append(seq)
        return seq

    def run(processor: OutputProcessor, seq: Sequence, tokens: list[int], migrate: bool) -> str:
        text = ""
        for i, token in enumerate(tokens):
            seq.append_token(token)
            step = EngineStep(tokens=[StepTokens([seq], [token])])
            if migrate and i == len(tokens) - 1:
                step.migrated.append((seq, (b"header", b"payload"), "worker-1"))
            for out in processor.process(step).outputs:
                text += out.outputs[0].delta_text
        return text

    source = stream_of("src", [])
    before = run(OutputProcessor(), source, output[:cut], migrate=True)
    assert "\ufffd" not in before and source.stream.finish_reason == "migrated"
    target = stream_of("dst", output[:cut])
    after = run(OutputProcessor(), target, output[cut:], migrate=False)
    whole = stream_of("whole", [])
    assert before + after == run(OutputProcessor(), whole, output, migrate=False) == "hello 你好 world"


def test_a_migrated_stream_targets_last_rows_carry_no_end_and_its_kv_goes_with_it(tiny_model):
    """A migrated request goes on elsewhere: its last rows (the tokens it made here) carry no
    finish and no end, and the step reports its KV transfer and target for the worker."""
    from transformers import AutoTokenizer

    from pagedserve.workers.outputs.output_processor import EngineStep, OutputProcessor, StepTokens, new_stream

    tokenizer = AutoTokenizer.from_pretrained(tiny_model("llama"))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    request = Request("m", None, [10, 11, 12], params)
    request.stream_target = StreamTarget("channel", 5)
    seq = Sequence("m#0", request, 0, [10, 11, 12])
    seq.stream = new_stream(seq, tokenizer, [2], 512, [])
    request.seqs.append(seq)
    processor = OutputProcessor()
    for token in (40, 41):
        seq.append_token(token)
        processor.process(EngineStep(tokens=[StepTokens([seq], [token])]))
    processor.take_batches()
    seq.append_token(42)
    step = EngineStep(tokens=[StepTokens([seq], [42])])
    step.migrated.append((seq, (b"header", b"payload"), "worker-1"))
    processed = processor.process(step)
    assert processed.outputs == [] and processed.migrated == [(request, (b"header", b"payload"), "worker-1")]
    batches = processor.take_batches()
    [(key, delta)] = deltas_from_batch(StreamBatch.unpack(batches["channel"].pack()))
    assert key == 5 and delta.samples[-1].token_ids == [42] and not delta.finished
    assert all(s.finish_reason is None for s in delta.samples)
    assert processor.process(EngineStep()).outputs == [] and not processor.take_batches()


def test_a_stream_targets_row_carries_every_token_a_step_read():
    """A step that reads two steps' tokens (overlapped scheduling read the running step's
    early; speculative decoding accepts several) gives a stream target one row with all of
    them, whether its metrics go too (the first row) or not (every later one)."""
    from pagedserve.workers.outputs.output_processor import EngineStep, OutputProcessor, StepTokens
    from pagedserve.workers.outputs.sequence_stream import SequenceStream, UndecodedText

    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, detokenize=False)
    request = Request("r", None, [10, 11, 12], params)
    request.stream_target = StreamTarget("channel", 7)
    seq = Sequence("r#0", request, 0, [10, 11, 12])
    seq.stream = SequenceStream(UndecodedText([]), 0)
    request.seqs.append(seq)
    processor = OutputProcessor()
    for tokens in ([40, 41], [42, 43, 44]):
        for token in tokens:
            seq.append_token(token)
        processor.process(EngineStep(tokens=[StepTokens([seq], [token]) for token in tokens]))
        [(key, delta)] = deltas_from_batch(StreamBatch.unpack(processor.take_batches()["channel"].pack()))
        assert key == 7 and [s.token_ids for s in delta.samples] == [tokens] and not delta.finished
