"""The handle <-> worker stream protocol: the engine core's rows on the wire, one accumulator
rebuilding the cumulative outputs.

The oracle is the engine itself: the same requests run twice on one engine (the prefix cache
reset between), once returning ``RequestOutput``s and once as an output channel's requests
(``StreamTarget``), whose rows are packed as the engine core sends them (``StreamBatch``),
unpacked as the handle does, read as deltas (``deltas_from_batch``) and rebuilt by
``OutputAccumulator``: step by step they must equal the engine's own outputs field by field,
over n > 1, logprobs, prompt logprobs, stop strings, sampling, beam search and an abort. The
bytes of a streamed token must not grow with the sequence, while the cumulative output does.
"""

from __future__ import annotations

import dataclasses
import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve import LLM, SamplingParams
from pagedserve.workers.actor.protocol import (EngineDeadError, OutputDelta, SampleDelta, _deltas_any,
                                               deltas_from_batch, merge_deltas, split_delta)
from pagedserve.workers.outputs.accumulator import OutputAccumulator
from pagedserve.workers.outputs.request_output import RequestMetrics, SampleLogprobs
from pagedserve.workers.outputs.stream_batch import StreamBatch, StreamTarget, pack_logprobs, pack_metrics

FIELDS = ("index", "text", "token_ids", "cumulative_logprob", "logprobs", "finish_reason", "stop_reason",
          "delta_text", "delta_token_ids", "delta_logprobs", "is_newly_finished")
CLOCKS = {"arrival_time", "first_scheduled_time", "first_token_time", "finished_time"}


# n > 1, logprobs, prompt logprobs, stop strings and beam search: request id -> (prompt, params).
MIXED_REQUESTS = {
    "greedy": (list(range(3, 30)), SamplingParams(temperature=0.0, max_tokens=24, logprobs=2, prompt_logprobs=1)),
    "n3": (list(range(40, 52)), SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=20, logprobs=1)),
    "stop": (list(range(5, 17)), SamplingParams(temperature=0.8, seed=3, max_tokens=30, stop=["e", " t"])),
    "beam": (list(range(20, 26)), SamplingParams(n=2, use_beam_search=True, temperature=0.0, max_tokens=6)),
}


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(model=tiny_model("llama"), device="cpu", dtype="float32", block_size=8,
               num_device_blocks=256, swap_space_gb=0.001)


def _untimed(metrics: RequestMetrics) -> dict:
    return {k: v for k, v in dataclasses.asdict(metrics).items() if k not in CLOCKS}


def _add(engine, requests: dict, targets: bool) -> dict[int, str]:
    engine.reset_prefix_cache()   # the same cached-token counts in both runs
    keys = {}
    for key, (rid, (prompt, params)) in enumerate(requests.items()):
        target = StreamTarget(f"channel-{key % 2}", key) if targets else None
        engine.add_request(rid, None, params, prompt_token_ids=prompt, stream_target=target)
        keys[key] = rid
    return keys


def _finish(engine) -> None:
    engine.check_integrity()
    assert engine.num_used_blocks() == 0


def _outputs(llm: LLM, requests: dict, abort: tuple[int, str] | None = None) -> list[list]:
    """Each step's ``RequestOutput``s (``abort``: at which step, which request)."""
    engine = llm.engine
    _add(engine, requests, targets=False)
    steps = []
    while engine.has_unfinished_requests():
        if abort is not None and len(steps) == abort[0]:
            assert engine.abort_request(abort[1])
        outputs = engine.step()
        for output in outputs:   # a request's outputs share one metrics object: keep this step's
            output.metrics = dataclasses.replace(output.metrics)
        steps.append(sorted(outputs, key=lambda o: list(requests).index(o.request_id)))
    _finish(engine)
    return steps


def _deltas(llm: LLM, requests: dict, abort: tuple[int, str] | None = None,
            merge: int = 1) -> list[list[OutputDelta]]:
    """Each step's deltas as a handle reads them: the channels' batches packed and unpacked;
    with ``merge`` > 1, each channel's batches of that many steps merged into one first."""
    engine = llm.engine
    keys = _add(engine, requests, targets=True)
    steps, pending = [], {}
    while engine.has_unfinished_requests():
        if abort is not None and len(steps) == abort[0]:
            assert engine.abort_request(abort[1])
        assert engine.step() == []   # every request's news goes into its channel's batch
        for channel, batch in engine.output_processor.take_batches().items():
            if channel in pending:
                pending[channel].merge(StreamBatch.unpack(batch.pack()))
            else:
                pending[channel] = batch
        if (len(steps) + 1) % merge == 0 or not engine.has_unfinished_requests():
            step = []
            for channel in sorted(pending):
                for key, delta in deltas_from_batch(StreamBatch.unpack(pending[channel].pack())):
                    delta.request_id = keys[key]
                    step.append(delta)
            pending = {}
            steps.append(sorted(step, key=lambda d: list(requests).index(d.request_id)))
        else:
            steps.append([])
    _finish(engine)
    return steps


def test_accumulated_outputs_equal_the_engines(llm):
    requests = {**MIXED_REQUESTS,
                "plain": (list(range(60, 64)), SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)),
                "aborted": (list(range(70, 90)), SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))}
    abort = (5, "aborted")
    expected = _outputs(llm, requests, abort)
    got = _deltas(llm, requests, abort)
    assert len(got) == len(expected) > 20
    accumulators = {rid: OutputAccumulator(rid, None, prompt) for rid, (prompt, _) in requests.items()}
    num_finished = {rid: 0 for rid in requests}
    last = {}
    for step, (outputs, deltas) in enumerate(zip(expected, got)):
        assert [o.request_id for o in outputs] == [d.request_id for d in deltas], step
        for output, delta in zip(outputs, deltas):
            rebuilt = accumulators[output.request_id].add(delta)
            assert rebuilt.finished == output.finished
            assert rebuilt.prompt_logprobs == output.prompt_logprobs
            assert _untimed(rebuilt.metrics) == _untimed(output.metrics), (step, output.request_id)
            engine_samples = sorted(output.outputs, key=lambda c: c.index)
            assert [c.index for c in rebuilt.outputs] == [c.index for c in engine_samples]
            for mine, theirs in zip(rebuilt.outputs, engine_samples):
                for name in FIELDS:
                    assert getattr(mine, name) == getattr(theirs, name), (step, output.request_id, name)
                num_finished[output.request_id] += mine.is_newly_finished
            last[output.request_id] = rebuilt
    assert num_finished == {"greedy": 1, "n3": 3, "stop": 1, "beam": 2, "plain": 1, "aborted": 1}
    assert len(last["n3"].outputs) == 3 and all(len(c.logprobs) == len(c.token_ids) for c in last["n3"].outputs)
    assert len(last["greedy"].prompt_logprobs) == len(requests["greedy"][0])
    assert last["aborted"].outputs[0].finish_reason == "abort"


def test_a_stream_interval_sends_fewer_larger_rows_and_the_same_outputs(llm):
    """With ``stream_interval`` 4 a sample's first token goes out at once, then its tokens in
    fours, its last ones with its finish: fewer deltas, each rebuilt output the same at the end."""
    requests = {"greedy": MIXED_REQUESTS["greedy"], "n3": MIXED_REQUESTS["n3"],
                "plain": (list(range(60, 64)), SamplingParams(temperature=0.0, max_tokens=23, ignore_eos=True))}
    every = _deltas(llm, requests)
    processor = llm.engine.output_processor
    processor.stream_interval = 4
    try:
        fours = _deltas(llm, requests)
    finally:
        processor.stream_interval = 1
    for rid, (prompt, _) in requests.items():
        runs = [[d for step in steps for d in step if d.request_id == rid] for steps in (every, fours)]
        finals = []
        for run in runs:
            accumulator = OutputAccumulator(rid, None, prompt)
            finals.append([accumulator.add(d) for d in run][-1])
        assert [(c.token_ids, c.text, c.logprobs, c.finish_reason) for c in finals[0].outputs] == \
            [(c.token_ids, c.text, c.logprobs, c.finish_reason) for c in finals[1].outputs], rid
        assert len(runs[1]) < len(runs[0]) / 2, rid
        for index in {s.index for d in runs[1] for s in d.samples}:
            sizes = [len(s.token_ids) for d in runs[1] for s in d.samples if s.index == index]
            assert sizes[0] == 1 and all(size == 4 for size in sizes[1:-1]) and 1 <= sizes[-1] <= 4, (rid, sizes)


def test_the_engine_option_sets_the_stream_interval(tiny_model):
    llm = LLM(model=tiny_model("llama"), device="cpu", dtype="float32", num_device_blocks=32, stream_interval=3)
    assert llm.engine.output_processor.stream_interval == 3


def test_text_decoded_by_the_handle_equals_the_workers(llm):
    """Workers sent token ids only (``detokenize`` off) and each sample's text decoded where the
    deltas arrive (``DeltaTextDecoder``) give, step by step and however the deltas are merged,
    the text and deltas the worker would have streamed: sampling and n > 1, a stop token id
    (its text left out, or kept with include_stop_str_in_output), EOS with special tokens kept,
    the length limit, a grammar's end (the text held back flushed), an abort (held back kept)."""
    from pagedserve.workers.outputs.detokenizer import DeltaTextDecoder
    from pagedserve.workers.sample.sampling_params import StructuredOutputsParams

    engine = llm.engine
    eos = engine.eos_token_ids[0]
    requests = {
        "n3": (list(range(40, 52)), SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=20)),
        "stop_id": (list(range(5, 17)), SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[])),
        "kept": (list(range(5, 17)), SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[],
                                                    include_stop_str_in_output=True)),
        "eos": (list(range(7, 19)), SamplingParams(temperature=0.0, max_tokens=30, min_tokens=4,
                                                   logit_bias={eos: 100.0}, skip_special_tokens=False)),
        "grammar": (list(range(9, 21)), SamplingParams(temperature=1.0, seed=2, max_tokens=30,
                                                       structured_outputs=StructuredOutputsParams(regex="[a-z ]{3,9}"))),
        "length": (list(range(60, 64)), SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)),
        "aborted": (list(range(70, 90)), SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)),
    }
    free = llm.generate([list(range(5, 17))], SamplingParams(temperature=0.0, max_tokens=30), use_tqdm=False)
    stop_id = free[0].outputs[0].token_ids[5]
    for rid in ("stop_id", "kept"):
        requests[rid] = (requests[rid][0], dataclasses.replace(requests[rid][1], stop_token_ids=[stop_id]))
    abort = (6, "aborted")
    worker = _deltas(llm, requests, abort)
    undecoded = {rid: (prompt, dataclasses.replace(params, detokenize=False)) for rid, (prompt, params) in requests.items()}
    tokens_only = _deltas(llm, undecoded, abort)
    assert all(s.text == "" for step in tokens_only for d in step for s in d.samples)
    finishes = {d.request_id: s.finish_reason for step in worker for d in step for s in d.samples if s.finish_reason}
    assert finishes == {"n3": "length", "stop_id": "stop", "kept": "stop", "eos": "stop", "grammar": "stop",
                        "length": "length", "aborted": "abort"}

    def decoder_for(rid):
        prompt, params = requests[rid]
        return lambda: DeltaTextDecoder(engine.tokenizer, prompt, params, engine.eos_token_ids, engine.max_model_len)

    for group in (1, 3):
        expected = {rid: OutputAccumulator(rid, None, requests[rid][0]) for rid in requests}
        decoded = {rid: OutputAccumulator(rid, None, requests[rid][0], decoder_for(rid)) for rid in requests}
        runs = {rid: ([], []) for rid in requests}
        for theirs, mine in zip(worker, tokens_only, strict=True):
            for a, b in zip(theirs, mine, strict=True):
                runs[a.request_id][0].append(a)
                runs[b.request_id][1].append(b)
        for rid, (theirs, mine) in runs.items():
            for i in range(0, len(theirs), group):
                want = expected[rid].add(merge_deltas(theirs[i:i + group]))
                got = decoded[rid].add(merge_deltas(mine[i:i + group]))
                for a, b in zip(got.outputs, want.outputs, strict=True):
                    assert (a.text, a.delta_text, a.token_ids, a.finish_reason, a.stop_reason) == \
                        (b.text, b.delta_text, b.token_ids, b.finish_reason, b.stop_reason), (rid, group, i)
    # EOS ends "eos" with special tokens kept: its text is not the output's, as the worker decodes it.
    for accumulators in (expected, decoded):
        assert "<|endoftext|>" not in accumulators["eos"].add(OutputDelta("eos", [], True, None)).outputs[0].text
    with pytest.raises(ValueError, match="stop strings"):
        DeltaTextDecoder(engine.tokenizer, [5], SamplingParams(stop=["x"]), [eos])


def test_merged_batches_and_merged_deltas_rebuild_the_same_outputs(llm):
    """A handle behind the engine gets several steps' batches in one message, and may merge a
    request's deltas (``StreamBatch.merge``, ``merge_deltas``): any grouping rebuilds the same
    cumulative output (tokens, text, logprobs, running totals, finishes, prompt logprobs)."""
    requests = MIXED_REQUESTS
    finals = {}
    for step in _outputs(llm, requests):
        for output in step:
            if output.finished:
                finals[output.request_id] = output
    for merge in (1, 2, 3, 7):
        steps = _deltas(llm, requests, merge=merge)
        for rid, (prompt, _) in requests.items():
            run = [d for step in steps for d in step if d.request_id == rid]
            for group in (1, 2, len(run)):
                accumulator = OutputAccumulator(rid, None, prompt)
                merged = [merge_deltas(run[i:i + group]) for i in range(0, len(run), group)]
                rebuilt = [accumulator.add(pickle.loads(pickle.dumps(m, protocol=5))) for m in merged][-1]
                final = finals[rid]
                assert rebuilt.finished and rebuilt.prompt_logprobs == final.prompt_logprobs, (rid, merge, group)
                assert _untimed(rebuilt.metrics) == _untimed(final.metrics), (rid, merge, group)
                for mine, theirs in zip(rebuilt.outputs, sorted(final.outputs, key=lambda c: c.index), strict=True):
                    for name in ("index", "text", "token_ids", "cumulative_logprob", "logprobs", "finish_reason",
                                 "stop_reason"):
                        assert getattr(mine, name) == getattr(theirs, name), (rid, merge, group, name)
        if merge == 1:
            assert len([d for step in steps for d in step if d.request_id == "greedy"]) > 20


def test_split_deltas_rebuild_the_outputs_of_the_whole_ones_a_token_at_a_time(llm):
    """A stream read token by token (``split_delta``, for ``stream_options.token_by_token``):
    merged deltas of several tokens, split, give outputs of one new token per sample each,
    whose text (decoded by the reader) and logprobs add up to the whole deltas' output; the
    finish comes once, on its sample's last token. A request with stop strings, whose worker
    decodes its text and finds them, is decoded by the reader too (the worker's text dropped):
    the same text after every delta, cut at the same stop string. A delta with text stays
    whole unless its reader decodes the text."""
    from pagedserve.workers.outputs.detokenizer import DeltaTextDecoder

    requests = {rid: (prompt, params if params.stop else dataclasses.replace(params, detokenize=False))
                for rid, (prompt, params) in MIXED_REQUESTS.items() if rid in ("greedy", "n3", "stop")}
    engine = llm.engine
    steps = _deltas(llm, requests)
    for rid, (prompt, params) in requests.items():
        def decoder():
            return DeltaTextDecoder(engine.tokenizer, prompt, params, engine.eos_token_ids, engine.max_model_len,
                                    with_stop_strings=bool(params.stop))

        run = [d for step in steps for d in step if d.request_id == rid]
        merged = [merge_deltas(run[i:i + 3]) for i in range(0, len(run), 3)]
        # The whole deltas' output: the worker's text where it decodes (stop strings), else the reader's.
        whole = OutputAccumulator(rid, None, prompt, None if params.stop else decoder)
        one_by_one = OutputAccumulator(rid, None, prompt, decoder)
        num_pieces, finishes = 0, []
        for delta in merged:
            want = whole.add(delta)
            pieces = split_delta(delta, drop_text=True)
            assert pieces[0].metrics is delta.metrics and all(p.metrics is None for p in pieces[1:])
            assert [p.finished for p in pieces] == [False] * (len(pieces) - 1) + [delta.finished]
            for piece in pieces:
                got = one_by_one.add(piece)
                num_pieces += 1
                assert all(len(c.delta_token_ids) <= 1 for c in got.outputs)
                finishes += [c.index for c in got.outputs if c.is_newly_finished]
            for mine, theirs in zip(got.outputs, want.outputs, strict=True):
                for name in ("index", "text", "token_ids", "logprobs", "finish_reason", "stop_reason"):
                    assert getattr(mine, name) == getattr(theirs, name), (rid, name)
                assert mine.cumulative_logprob == pytest.approx(theirs.cumulative_logprob)
        assert sorted(finishes) == list(range(params.n))   # each sample's finish, once
        assert num_pieces == sum(max((len(s.token_ids) for s in d.samples), default=1) for d in merged) > len(merged)
        if params.stop:
            assert got.outputs[0].finish_reason == "stop" and got.outputs[0].stop_reason in params.stop
    with_text = OutputDelta("t", [SampleDelta(0, [5, 6], "ab")], False, None)
    assert split_delta(with_text) == [with_text]
    assert [p.samples[0].text for p in split_delta(with_text, drop_text=True)] == ["", ""]


def test_a_delta_carries_only_news(llm):
    requests = {"news": (list(range(3, 20)), SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=12,
                                                            logprobs=1))}
    for outputs, deltas in zip(_outputs(llm, requests), _deltas(llm, requests), strict=True):
        for output, delta in zip(outputs, deltas, strict=True):
            by_index = {c.index: c for c in output.outputs}
            for sample in delta.samples:
                completion = by_index[sample.index]
                assert sample.token_ids == completion.delta_token_ids
                assert sample.logprobs == completion.delta_logprobs
            quiet = {c.index for c in output.outputs
                     if not (c.delta_token_ids or c.delta_text or c.is_newly_finished)}
            assert quiet.isdisjoint(s.index for s in delta.samples)


def test_metrics_travel_when_a_milestone_changes_and_at_the_end(llm):
    """A request's metrics go out on its first output, when a milestone changes and at its
    end; the rebuilt outputs' metrics still equal the engine's at every output, the token count
    included (the handle counts the tokens between)."""
    requests = {"m": (list(range(3, 11)), SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))}
    carried = []
    accumulator = OutputAccumulator("m", None, requests["m"][0])
    for outputs, deltas in zip(_outputs(llm, requests), _deltas(llm, requests), strict=True):
        for output, delta in zip(outputs, deltas, strict=True):
            carried.append(delta.metrics is not None)
            rebuilt = accumulator.add(delta)
            assert _untimed(rebuilt.metrics) == _untimed(output.metrics)
            assert rebuilt.metrics.num_generated_tokens == len(output.outputs[0].token_ids)
    assert carried[0] and carried[-1] and sum(carried) <= 3 and len(carried) >= 40, carried


def test_bytes_per_streamed_token_do_not_grow_with_the_sequence(llm):
    """A one-token row packs in a few bytes whatever the position; the cumulative output grows."""
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True, logprobs=2)
    engine = llm.engine
    engine.add_request("long", None, params, prompt_token_ids=list(range(3, 11)), stream_target=StreamTarget("c", 7))
    batch_sizes = []
    while engine.has_unfinished_requests():
        engine.step()
        batch_sizes += [len(b.pack()) for b in engine.output_processor.take_batches().values()]
    _finish(engine)
    cumulative_sizes = [len(pickle.dumps(o, protocol=5)) for step in _outputs(llm, {"long": (list(range(3, 11)), params)})
                        for o in step]
    assert len(batch_sizes) > 350
    # Integers pack in 1 to 5 bytes (a row and its three logprob entries' ids): a batch varies by
    # a few bytes with the values, never with the length.
    assert max(batch_sizes[10:-1]) - min(batch_sizes[10:-1]) <= 32
    assert abs(sum(batch_sizes[-51:-1]) - sum(batch_sizes[10:60])) / 50 <= 4
    assert cumulative_sizes[-2] > 10 * cumulative_sizes[10]


def test_a_batch_arrives_as_it_was_packed():
    """Every column survives packing (rows of several samples and token counts, texts, logprobs,
    finishes, metrics, prompt logprobs, ends, errors), and reads back as the deltas it says."""
    metrics = RequestMetrics(1.5, first_token_time=2.0, num_prompt_tokens=7)
    logprobs = [SampleLogprobs(9, -0.5, [(9, -0.5), (4, -1.25)])]
    batch = StreamBatch()
    row = batch.add(3, 0, [9])
    batch.texts.append((row, "x"))
    batch.logprobs.append((row, pack_logprobs(logprobs), -0.5))
    batch.metrics.append((3, pack_metrics(metrics)))
    batch.prompt_logprobs.append((3, [None, pack_logprobs([SampleLogprobs(3, -2.0)])[0]]))
    row = batch.add(5, 1, [4, 5])
    batch.texts.append((row, "yz"))
    batch.finishes.append((row, "stop", "z"))
    row = batch.add(5, 0, [])
    batch.finishes.append((row, "length", None))
    batch.end(5, 30)
    batch.add(3, 0, [11])
    batch.add_error(8, ValueError("the prompt is empty"))
    batch.add_error(9, EngineDeadError("the engine loop failed"), "e1")
    received = StreamBatch.unpack(batch.pack())
    import msgpack

    for name in StreamBatch.__slots__:   # tuples come back as lists
        assert getattr(received, name) == msgpack.unpackb(msgpack.packb(getattr(batch, name))), name
    items = dict(deltas_from_batch(received))
    assert items[3] == OutputDelta("", [SampleDelta(0, [9, 11], "x", logprobs, -0.5)], False, metrics,
                                   [None, SampleLogprobs(3, -2.0)], None)
    assert items[5] == OutputDelta("", [SampleDelta(1, [4, 5], "yz", None, None, "stop", "z"),
                                        SampleDelta(0, [], "", None, None, "length", None)], True, None, None, 30)
    assert type(items[8]) is ValueError and items[8].args == ("the prompt is empty",)
    assert isinstance(items[9], EngineDeadError) and items[9].engine_id == "e1"
    plain = StreamBatch()
    for key in range(4):
        plain.add(key, 0, [key + 100])
    assert msgpack_fields(plain) == [[0, 1, 2, 3], None, None, [100, 101, 102, 103]] + [None] * 7


def msgpack_fields(batch: StreamBatch) -> list:
    import msgpack

    return msgpack.unpackb(batch.pack())


def test_resumed_and_restarted_requests_keep_one_output():
    metrics = RequestMetrics(0.0)
    accumulator = OutputAccumulator("r", "hi", [1, 2])
    accumulator.add(OutputDelta("r", [SampleDelta(0, [5, 6], "ab")], False, metrics))
    # A resumed attempt (another worker, another sub-request id) continues the same output.
    resumed = accumulator.add(OutputDelta("r~2", [SampleDelta(0, [7], "c", finish_reason="length")], True,
                                          metrics))
    (completion,) = resumed.outputs
    assert resumed.request_id == "r" and resumed.prompt == "hi"
    assert completion.token_ids == [5, 6, 7] and completion.text == "abc"
    assert completion.delta_token_ids == [7] and completion.delta_text == "c" and completion.is_newly_finished
    assert accumulator.token_ids() == [5, 6, 7]
    accumulator.reset()
    assert accumulator.num_tokens() == 0 and accumulator.token_ids() == []
    again = accumulator.add(OutputDelta("r~3", [SampleDelta(0, [9], "z")], False, metrics))
    assert again.outputs[0].token_ids == [9] and again.outputs[0].text == "z"
    # Outputs already returned do not change under later deltas.
    assert completion.token_ids == [5, 6, 7]


def test_a_resumed_requests_cumulative_logprob_counts_every_token():
    """The resumed run's worker sums only the logprobs of the tokens it sampled; the request's
    cumulative logprob is over all of them."""
    metrics = RequestMetrics(0.0)
    accumulator = OutputAccumulator("r", None, [1, 2])
    first = [SampleLogprobs(5, -1.0), SampleLogprobs(6, -2.0)]
    accumulator.add(OutputDelta("r", [SampleDelta(0, [5, 6], "ab", first, -3.0)], False, metrics))
    resumed = accumulator.add(OutputDelta("r~2", [SampleDelta(0, [7], "c", [SampleLogprobs(7, -0.5)], -0.5,
                                                               "length")], True, metrics))
    (completion,) = resumed.outputs
    assert [lp.logprob for lp in completion.logprobs] == [-1.0, -2.0, -0.5]
    assert completion.cumulative_logprob == -3.5


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 2**20), min_size=1, max_size=40, unique=True), st.data())
def test_a_plain_steps_deltas_equal_the_general_readers(keys, data):
    """A decoding step with one new token a request and nothing else is read by a short path;
    its deltas are the general reader's."""
    batch = StreamBatch()
    for key in keys:
        batch.add(key, 0, [data.draw(st.integers(0, 50_000))])
    received = StreamBatch.unpack(batch.pack())
    assert deltas_from_batch(received) == _deltas_any(received)


# A request's deltas: per sample (index), its tokens and text, logprobs if the request asked for
# them (else maybe a running total, as a beam's), maybe a finish; maybe metrics and a count.
def _random_deltas(with_logprobs: bool):
    news = st.builds(
        lambda index, tokens, cumulative, finish: SampleDelta(
            index, tokens, "".join(chr(97 + t % 26) for t in tokens),
            [SampleLogprobs(t, -0.5) for t in tokens] if with_logprobs else None,
            -0.5 * len(tokens) if with_logprobs else cumulative, finish, None if finish is None else "x"),
        st.sampled_from([0, 0, 0, 1]), st.lists(st.integers(0, 99), min_size=0, max_size=3),
        st.one_of(st.none(), st.floats(-9.0, 0.0)), st.sampled_from([None, None, None, "stop", "length"]))
    return st.lists(st.builds(
        lambda samples, with_metrics, count, finished: OutputDelta(
            "r", samples, finished, RequestMetrics(1.0, num_prompt_tokens=2) if with_metrics else None,
            num_generated_tokens=count),
        st.lists(news, min_size=1, max_size=2, unique_by=lambda sample: sample.index),
        st.sampled_from([False, False, False, True]), st.sampled_from([None, None, None, 7]), st.booleans()),
        min_size=1, max_size=12)


@settings(max_examples=150, deadline=None)
@given(st.booleans().flatmap(_random_deltas))
def test_the_accumulators_short_path_makes_the_general_paths_outputs(deltas):
    """``add`` takes most decoding steps' deltas by a short path (one sample, no logprobs, no
    metrics); every output, and every output kept from before, equals the general path's."""
    short, general = OutputAccumulator("r", None, [1, 2]), OutputAccumulator("r", None, [1, 2])
    kept = []
    for delta in deltas:
        made, expected = short.add(delta), general._add_any(delta)
        assert made == expected
        kept.append((made, expected))
    assert all(made == expected for made, expected in kept)
