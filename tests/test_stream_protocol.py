"""The handle <-> worker stream protocol: deltas on the wire, one accumulator rebuilding
the cumulative outputs.

The oracle is the engine itself: every step's ``RequestOutput`` is encoded as the
worker does (``DeltaEncoder``), sent as the worker sends a step's deltas (one
``ChannelMessage``, pickled by Ray's pickler), decoded by ``OutputAccumulator``,
and must equal the engine's own output field by field, over n > 1, logprobs,
prompt logprobs, stop strings and sampling. The size of a streamed delta must
not grow with the sequence, while the cumulative output it replaces does.
"""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.workers.accumulator import OutputAccumulator
from pagedserve.workers.protocol import ChannelMessage, DeltaEncoder, Migrated, OutputDelta, SampleDelta, merge_deltas
from pagedserve.workers.request import RequestMetrics, SampleLogprobs

FIELDS = ("index", "text", "token_ids", "cumulative_logprob", "logprobs", "finish_reason", "stop_reason",
          "delta_text", "delta_token_ids", "delta_logprobs", "is_newly_finished")


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


def _sent(message: ChannelMessage) -> ChannelMessage:
    """``message`` as the handle receives it: pickled by Ray's pickler, read by ``pickle``."""
    from ray import cloudpickle

    received = pickle.loads(cloudpickle.dumps(message, protocol=5))
    assert type(received) is ChannelMessage
    return received


def _run(llm: LLM, requests: dict[str, tuple[list[int], SamplingParams]]):
    """Step the engine; yield every output with what the worker would send for it (each step's
    deltas sent in one message)."""
    engine = llm.engine
    encoders = {}
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, None, params, prompt_token_ids=prompt)
        encoders[request_id] = DeltaEncoder()
    while engine.has_unfinished_requests():
        outputs = engine.step()
        message = ChannelMessage((output.request_id, encoders[output.request_id].encode(output))
                                 for output in outputs)
        for output, (request_id, delta) in zip(outputs, _sent(message), strict=True):
            assert request_id == delta.request_id == output.request_id
            yield output, delta


def test_accumulated_outputs_equal_the_engines(llm):
    requests = {
        "greedy": (list(range(3, 30)), SamplingParams(temperature=0.0, max_tokens=24, logprobs=2,
                                                      prompt_logprobs=1)),
        "n3": (list(range(40, 52)), SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=20, logprobs=1)),
        "stop": (list(range(5, 17)), SamplingParams(temperature=0.8, seed=3, max_tokens=30, stop=["e", " t"])),
        "plain": (list(range(60, 64)), SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)),
    }
    accumulators = {rid: OutputAccumulator(rid, None, prompt) for rid, (prompt, _) in requests.items()}
    num_finished = {rid: 0 for rid in requests}
    last = {}
    for output, delta in _run(llm, requests):
        rebuilt = accumulators[output.request_id].add(delta)
        assert rebuilt.finished == output.finished
        assert rebuilt.prompt_logprobs == output.prompt_logprobs
        assert rebuilt.metrics == output.metrics
        engine_samples = sorted(output.outputs, key=lambda c: c.index)
        assert [c.index for c in rebuilt.outputs] == [c.index for c in engine_samples]
        for mine, theirs in zip(rebuilt.outputs, engine_samples):
            for name in FIELDS:
                assert getattr(mine, name) == getattr(theirs, name), (output.request_id, name)
            num_finished[output.request_id] += mine.is_newly_finished
        last[output.request_id] = rebuilt
    assert num_finished == {"greedy": 1, "n3": 3, "stop": 1, "plain": 1}
    assert len(last["n3"].outputs) == 3 and all(len(c.logprobs) == len(c.token_ids) for c in last["n3"].outputs)
    assert len(last["greedy"].prompt_logprobs) == len(requests["greedy"][0])
    llm.engine.check_integrity()
    assert llm.engine.num_used_blocks() == 0


def _step_deltas(llm: LLM, requests: dict[str, tuple[list[int], SamplingParams]], direct: bool,
                 abort: tuple[int, str]) -> list[list[OutputDelta]]:
    """Each step's deltas: made by the engine itself (``delta_encoder``, as an output channel's
    requests are), or encoded from its ``RequestOutput``s as before. ``abort``: (step, request)."""
    engine = llm.engine
    engine.reset_prefix_cache()   # the same cached-token counts in both runs
    encoders = {rid: DeltaEncoder() for rid in requests}
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, None, params, prompt_token_ids=prompt,
                           delta_encoder=encoders[rid] if direct else None)
    steps = []
    while engine.has_unfinished_requests():
        if len(steps) == abort[0]:
            assert engine.abort_request(abort[1])
        outputs = engine.step()
        if direct:   # a beam search's outputs are its own, made at its end
            assert all(type(o) is OutputDelta or o.request_id == "beam" for o in outputs)
        steps.append([o if type(o) is OutputDelta else encoders[o.request_id].encode(o) for o in outputs])
    engine.check_integrity()
    assert engine.num_used_blocks() == 0
    return steps


def test_deltas_made_by_the_engine_equal_its_outputs_encoded(llm):
    """An output channel's requests get their deltas from the output processor, with no
    ``RequestOutput`` between: step by step the same deltas as encoding the engine's outputs,
    over n > 1, logprobs, prompt logprobs, stop strings, beam search and an abort; the metrics
    on the same deltas, equal but for their clock readings."""
    requests = {**MIXED_REQUESTS,
                "aborted": (list(range(70, 90)), SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))}
    abort = (5, "aborted")
    encoded = _step_deltas(llm, requests, direct=False, abort=abort)
    direct = _step_deltas(llm, requests, direct=True, abort=abort)
    assert len(direct) == len(encoded) > 20
    clocks = {"arrival_time", "first_scheduled_time", "first_token_time", "finished_time"}
    for step, (mine, theirs) in enumerate(zip(direct, encoded)):
        assert [d.request_id for d in mine] == [d.request_id for d in theirs], step
        for a, b in zip(mine, theirs):
            assert (a.samples, a.finished, a.prompt_logprobs, a.num_generated_tokens) == \
                (b.samples, b.finished, b.prompt_logprobs, b.num_generated_tokens), (step, a.request_id)
            assert (a.metrics is None) == (b.metrics is None), (step, a.request_id)
            if a.metrics is not None:
                untimed = lambda m: {k: v for k, v in dataclasses.asdict(m).items() if k not in clocks}
                assert untimed(a.metrics) == untimed(b.metrics)
    finishes = {d.request_id: s.finish_reason for step in direct for d in step for s in d.samples
                if s.finish_reason}
    assert finishes["aborted"] == "abort" and finishes["greedy"] in ("stop", "length")


def test_text_decoded_by_the_handle_equals_the_workers(llm):
    """Workers sent token ids only (``detokenize`` off) and each sample's text decoded where the
    deltas arrive (``DeltaTextDecoder``) give, step by step and however the deltas are merged,
    the text and deltas the worker would have streamed: sampling and n > 1, a stop token id
    (its text left out, or kept with include_stop_str_in_output), EOS with special tokens kept,
    the length limit, a grammar's end (the text held back flushed), an abort (held back kept)."""
    from pagedserve.workers.detokenizer import DeltaTextDecoder
    from pagedserve.workers.sampling_params import StructuredOutputsParams

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
    worker = _step_deltas(llm, requests, direct=True, abort=abort)
    undecoded = {rid: (prompt, dataclasses.replace(params, detokenize=False)) for rid, (prompt, params) in requests.items()}
    tokens_only = _step_deltas(llm, undecoded, direct=True, abort=abort)
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


def test_merged_runs_of_deltas_rebuild_the_same_outputs(llm):
    """A worker whose stream falls behind the engine sends the deltas made since its last
    message as one (``merge_deltas``): any grouping of a request's deltas rebuilds the same
    cumulative output (tokens, text, logprobs, running totals, finishes, prompt logprobs)."""
    requests = MIXED_REQUESTS
    deltas: dict[str, list[OutputDelta]] = {rid: [] for rid in requests}
    finals = {}
    for output, delta in _run(llm, requests):
        deltas[output.request_id].append(delta)
        if output.finished:
            finals[output.request_id] = output
    before = pickle.dumps(deltas)
    for rid, run in deltas.items():
        for group in (1, 2, 3, 7, len(run)):
            accumulator = OutputAccumulator(rid, None, requests[rid][0])
            merged = [merge_deltas(run[i:i + group]) for i in range(0, len(run), group)]
            rebuilt = [accumulator.add(pickle.loads(pickle.dumps(m, protocol=5))) for m in merged][-1]
            final = finals[rid]
            assert rebuilt.finished and rebuilt.prompt_logprobs == final.prompt_logprobs, (rid, group)
            assert rebuilt.metrics == final.metrics
            for mine, theirs in zip(rebuilt.outputs, sorted(final.outputs, key=lambda c: c.index), strict=True):
                for name in ("index", "text", "token_ids", "cumulative_logprob", "logprobs", "finish_reason",
                             "stop_reason"):
                    assert getattr(mine, name) == getattr(theirs, name), (rid, group, name)
    assert pickle.dumps(deltas) == before and len(deltas["greedy"]) > 20  # nothing merged in place
    assert merge_deltas(deltas["greedy"][:1]) is deltas["greedy"][0]


def test_a_delta_carries_only_news(llm):
    params = SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=12, logprobs=1)
    for output, delta in _run(llm, {"news": (list(range(3, 20)), params)}):
        by_index = {c.index: c for c in output.outputs}
        for sample in delta.samples:
            completion = by_index[sample.index]
            assert sample.token_ids == completion.delta_token_ids
            assert sample.logprobs == completion.delta_logprobs
        quiet = {c.index for c in output.outputs
                 if not (c.delta_token_ids or c.delta_text or c.is_newly_finished)}
        assert quiet.isdisjoint(s.index for s in delta.samples)


def test_metrics_travel_when_a_milestone_changes_and_at_the_end(llm):
    """A delta carries the request's metrics on its first output, when a milestone changes and at
    its end; the others carry only the generated-token count, and the rebuilt outputs' metrics
    still equal the engine's at every output (``test_accumulated_outputs_equal_the_engines``)."""
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    carried, sizes = [], {True: [], False: []}
    accumulator = OutputAccumulator("m", None, list(range(3, 11)))
    for output, delta in _run(llm, {"m": (list(range(3, 11)), params)}):
        carried.append(delta.metrics is not None)
        sizes[delta.metrics is not None].append(len(pickle.dumps(delta, protocol=5)))
        rebuilt = accumulator.add(delta)
        assert rebuilt.metrics == output.metrics
        assert rebuilt.metrics.num_generated_tokens == delta.num_generated_tokens == len(output.outputs[0].token_ids)
    assert carried[0] and carried[-1] and sum(carried) <= 3 and len(carried) >= 40, carried
    assert max(sizes[False]) < min(sizes[True]) / 1.5
    llm.engine.check_integrity()
    assert llm.engine.num_used_blocks() == 0


def test_bytes_per_streamed_token_do_not_grow_with_the_sequence(llm):
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True, logprobs=2)
    delta_sizes, cumulative_sizes = [], []
    for output, delta in _run(llm, {"long": (list(range(3, 11)), params)}):
        if output.finished:
            break
        delta_sizes.append(len(pickle.dumps(delta, protocol=5)))
        cumulative_sizes.append(len(pickle.dumps(output, protocol=5)))
    assert len(delta_sizes) > 350
    # Integers pickle in 1, 2 or 4 bytes: a delta may vary by a few bytes, never with the length.
    assert max(delta_sizes[10:]) - min(delta_sizes[10:]) <= 16
    assert cumulative_sizes[-1] > 10 * cumulative_sizes[10]


def test_a_message_arrives_as_it_was_sent_and_smaller_than_its_items_pickled_as_they_are():
    """A ``ChannelMessage`` pickles its deltas as tuples: every field of every delta and its
    samples (logprobs, metrics, prompt logprobs, finishes) arrives, other items arrive as they
    are, in order, and the message takes fewer bytes than a list of the same items."""
    from ray import cloudpickle

    metrics = RequestMetrics(1.5, first_token_time=2.0, num_prompt_tokens=7)
    logprobs = [SampleLogprobs(9, -0.5, [(9, -0.5), (4, -1.25)])]
    message = ChannelMessage([
        ("a", OutputDelta("a", [SampleDelta(0, [9], "x", logprobs, -0.5)], False, metrics,
                          [None, SampleLogprobs(3, -2.0)], 1)),
        ("b", OutputDelta("b~2", [SampleDelta(1, [4, 5], "yz", None, None, "stop", "z"),
                                  SampleDelta(0, [], "", None, None, "length", None)], True, None, None, 30)),
        ("c", Migrated("c", "worker-1", ("held", "c"))),
        ("a", OutputDelta("a", [], False, None)),
        ("d", ValueError("the engine loop failed")),
    ])
    received = _sent(message)
    assert received[:4] == message[:4]
    assert received[4][0] == "d" and type(received[4][1]) is ValueError
    assert received[4][1].args == ("the engine loop failed",)
    assert received[0][1].samples[0].logprobs == logprobs and received[0][1].metrics == metrics
    assert len(cloudpickle.dumps(message, protocol=5)) < len(cloudpickle.dumps(list(message), protocol=5))
    assert _sent(ChannelMessage()) == []
    # The wire form lists the fields by name, in this order: a field added to either class must be
    # added to ``ChannelMessage.__reduce__`` and ``_channel_message`` too.
    assert [f.name for f in dataclasses.fields(SampleDelta)] == [
        "index", "token_ids", "text", "logprobs", "cumulative_logprob", "finish_reason", "stop_reason"]
    assert [f.name for f in dataclasses.fields(OutputDelta)] == [
        "request_id", "samples", "finished", "metrics", "prompt_logprobs", "num_generated_tokens"]


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
