"""The handle's resilience paths as a state machine (``cluster/request_flow.py``): which run
follows a failure, a migration or a broken disaggregated path, and what it is sent.
The live paths (a worker killed mid-stream, migration, disaggregation) run in
``test_distributed.py`` and ``test_distributed_layouts.py``."""

from __future__ import annotations

import pytest

from pagedserve.cluster.request_flow import (DISAGGREGATED, FALL_BACK, FIRST, MIGRATE, RESUME, RETRY,
                                             AttemptsExhausted, RepeatedEngineFailure, RequestFlow,
                                             StreamNotResumable)
from pagedserve.workers.actor.protocol import Migrated, OutputDelta, SampleDelta
from pagedserve.workers.outputs.request_output import RequestMetrics
from pagedserve.workers.sample.sampling_params import SamplingParams

PROMPT = [5, 6, 7]


def _flow(n: int = 1, max_attempts: int = 5, is_streamed: bool = False) -> RequestFlow:
    return RequestFlow("req", "text", PROMPT, SamplingParams(n=n, max_tokens=10, temperature=1.0, seed=1), 0,
                       max_attempts, is_streamed)


def _stream(flow: RequestFlow, index: int, token_ids: list[int]) -> None:
    flow.accumulator.add(OutputDelta("any", [SampleDelta(index, token_ids, "x" * len(token_ids))], False,
                                     RequestMetrics(0.0)))


def test_first_run_and_a_failure_before_any_token_retries_from_the_prompt():
    flow = _flow()
    first = flow.start()
    assert (first.kind, first.number, first.request.request_id) == (FIRST, 1, "req")
    assert first.request.prompt_token_ids == PROMPT and not first.is_recompute
    retry = flow.after_failure()
    assert (retry.kind, retry.request.request_id) == (RETRY, "req~2")
    assert retry.request.prompt_token_ids == PROMPT and retry.request.params.max_tokens == 10
    assert retry.is_recompute


def test_a_failure_after_streamed_tokens_resumes_after_them():
    flow = _flow()
    flow.start()
    _stream(flow, 0, [11, 12, 13])
    resumed = flow.after_failure()
    assert resumed.kind == RESUME
    # The tokens go as outputs (the engine counts them against max_tokens, and penalties, seeded
    # draws and a grammar go on from them), not as more prompt.
    assert resumed.request.prompt_token_ids == PROMPT and resumed.request.output_token_ids == [11, 12, 13]
    assert resumed.request.params == flow.params
    # The output runs on: the accumulator kept the tokens, the resumed run adds to them.
    _stream(flow, 0, [14])
    assert flow.accumulator.token_ids() == [11, 12, 13, 14]


def test_several_samples_cannot_resume_and_start_again():
    flow = _flow(n=2)
    flow.start()
    _stream(flow, 0, [11])
    _stream(flow, 1, [21])
    assert not flow.can_resume
    retry = flow.after_failure()
    assert retry.kind == RETRY and retry.request.prompt_token_ids == PROMPT
    assert flow.accumulator.num_tokens(0) == flow.accumulator.num_tokens(1) == 0
    with pytest.raises(ValueError):
        flow.resume()


def test_a_streamed_request_with_several_samples_ends_rather_than_start_again():
    """Its client already has the failed run's tokens: a new run from the prompt would repeat or
    contradict them. Before any token, and for one sample (which resumes), it goes on as ever."""
    flow = _flow(n=2, is_streamed=True)
    flow.start()
    assert flow.after_failure().kind == RETRY  # nothing streamed yet
    _stream(flow, 1, [21, 22])
    with pytest.raises(StreamNotResumable, match="after 2 tokens had been streamed; 2 samples cannot"):
        flow.after_failure()
    assert flow.accumulator.token_ids(1) == [21, 22]  # what the client has is not forgotten
    single = _flow(n=1, is_streamed=True)
    single.start()
    _stream(single, 0, [11])
    assert single.after_failure().kind == RESUME


def test_an_engine_failure_goes_on_elsewhere_once_and_a_second_one_ends_the_request():
    flow = _flow(max_attempts=9)
    flow.start()
    _stream(flow, 0, [11, 12])
    resumed = flow.after_engine_failure("w0", "e1")   # like a dead worker: after the streamed tokens
    assert resumed.kind == RESUME and resumed.request.output_token_ids == [11, 12]
    flow.after_failure()                              # a dead worker in between does not count,
    flow.after_engine_failure("w0", "e1")             # nor the same dead engine seen again
    with pytest.raises(RepeatedEngineFailure, match=r"2 engines \(of workers w0, w1\) failed"):
        flow.after_engine_failure("w1", "e2")         # this request may be what makes engines fail
    assert flow.num_attempts == 4


def test_a_restarted_workers_new_engine_failing_too_ends_the_request():
    """With one worker, a request that made its engine fail comes back to it once it has
    restarted: failing the new engine too ends the request (before, engines were counted by
    worker, and such a request failed every incarnation until it ran out of attempts)."""
    flow = _flow(max_attempts=5)
    flow.start()
    flow.after_engine_failure("w0", "first")
    with pytest.raises(RepeatedEngineFailure, match=r"2 engines \(of workers w0\)"):
        flow.after_engine_failure("w0", "second")
    assert flow.num_attempts == 2


def test_a_migration_continues_on_its_target_from_the_transferred_kv():
    flow = _flow()
    flow.start()
    _stream(flow, 0, [11, 12])
    kv = object()
    moved = flow.migrate(Migrated("req", "worker-3", kv))
    assert (moved.kind, moved.target, moved.request.request_id) == (MIGRATE, "worker-3", "req~2")
    assert moved.request.kv == [kv] and moved.request.output_token_ids == [11, 12]
    assert moved.request.prompt_token_ids == PROMPT and moved.request.params.max_tokens == 10
    assert not moved.is_recompute


def test_a_broken_disaggregated_run_falls_back_colocated():
    flow = _flow()
    assert flow.start(is_disaggregated=True).kind == DISAGGREGATED
    fallback = flow.fall_back()  # nothing streamed: from the prompt
    assert fallback.kind == FALL_BACK and fallback.request.prompt_token_ids == PROMPT
    flow = _flow()
    flow.start(is_disaggregated=True)
    _stream(flow, 0, [11])  # the prefill worker's first token reached the caller
    fallback = flow.fall_back()
    assert fallback.kind == FALL_BACK and fallback.request.prompt_token_ids == PROMPT
    assert fallback.request.output_token_ids == [11] and fallback.request.params.max_tokens == 10


def test_attempts_are_bounded():
    flow = _flow(max_attempts=3)
    flow.start()
    flow.after_failure()
    flow.after_failure()
    with pytest.raises(AttemptsExhausted, match="3 attempts"):
        flow.after_failure()


def test_the_failed_engine_is_named_through_rays_error():
    """The handle counts engines by the id the worker's ``EngineDeadError`` carries; through
    Ray it arrives pickled, inside the dual ``RayTaskError(EngineDeadError)``."""
    import pickle

    from ray.exceptions import RayTaskError

    from pagedserve.cluster.handle import _engine_id
    from pagedserve.workers.actor.protocol import EngineDeadError

    cause = pickle.loads(pickle.dumps(EngineDeadError("the engine loop failed: boom", "e7")))
    error = RayTaskError("generate", "Traceback ...", cause).as_instanceof_cause()
    assert isinstance(error, EngineDeadError) and _engine_id(error) == "e7"
    assert _engine_id(EngineDeadError("the engine is shut down")) is None


def test_a_handle_that_decodes_text_sends_every_attempt_token_ids_only(tiny_model):
    """The handle decodes a request's text itself (its workers' output threads then spend nothing
    on it) unless its workers must: stop strings are found in their text, a beam search's outputs
    are the engine's, a request may ask for no text, and older workers do not say their EOS ids.
    Such a flow sends every attempt ``detokenize`` off and keeps the caller's params as they are."""
    from transformers import AutoTokenizer

    from pagedserve.cluster.handle import ClusterHandle

    handle = object.__new__(ClusterHandle)
    handle.info, handle.max_model_len = {"eos_token_ids": [2]}, 512
    handle._tokenizer = AutoTokenizer.from_pretrained(tiny_model("llama"))
    prompt = [5, 6, 7]
    assert handle._text_decoder(prompt, SamplingParams(max_tokens=4)) is not None
    for params in (SamplingParams(stop=["x"]), SamplingParams(n=2, use_beam_search=True, temperature=0.0),
                   SamplingParams(detokenize=False)):
        assert handle._text_decoder(prompt, params) is None
    handle.info = {}
    assert handle._text_decoder(prompt, SamplingParams()) is None
    handle.info = {"eos_token_ids": [2]}
    params = SamplingParams(max_tokens=4)
    flow = RequestFlow("r", None, prompt, params, 0, max_attempts=5, text_decoder=handle._text_decoder(prompt, params))
    attempts = [flow.start()]
    _stream(flow, 0, [9, 10])
    attempts.append(flow.after_failure())
    assert [a.kind for a in attempts] == [FIRST, RESUME]
    assert all(not a.request.params.detokenize for a in attempts) and flow.params is params and params.detokenize
    assert flow.accumulator.text_decoder is not None
