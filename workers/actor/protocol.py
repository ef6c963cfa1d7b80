"""The handle <-> worker protocol: typed messages across the actor boundary.

A request goes to a worker as a ``GenerateRequest``. The worker sends back
``OutputDelta``s, one per request per message of its output channel
(``output_channel``: one message per engine step for all of a handle's
requests): only what is new (token ids, text, logprobs, a sample's finish
the first time it is seen, and the request's metrics when a milestone moved),
so the bytes per streamed token stay the same however long the sequence
grows. Control messages are separate types: ``Migrated`` ends a request the
KV manager moved to another worker. A request whose worker's engine loop
ended (failed or shut down) ends with ``EngineDeadError``.

The cumulative view an API needs (non-streaming bodies, n > 1, resuming
after a failure) is rebuilt from the deltas by ``accumulator.OutputAccumulator``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ..engine.request import RequestMetrics, RequestOutput, SampleLogprobs
from ..sample.sampling_params import SamplingParams


class EngineDeadError(RuntimeError):
    """The engine loop failed or was shut down; requests in flight end with this error.

    ``engine_id`` names the engine loop (one per worker incarnation), so a request that
    meets the same dead engine twice counts one failure, and a restarted worker's new
    engine counts as another."""

    def __init__(self, message: str, engine_id: str | None = None) -> None:
        super().__init__(message)
        self.engine_id = engine_id


@dataclass
class GenerateRequest:
    """What a worker is asked to run.

    ``output_token_ids`` continue a request whose prompt and first
    ``len(output_token_ids)`` outputs already ran elsewhere (a prefill worker,
    a migration source, a worker that failed): the engine treats them as its
    own outputs (``max_tokens``, penalties, seeded draws, grammar, text).
    ``kv`` (a list holding one ObjectRef of a KV transfer, nested so the worker
    times its fetch) brings their KV along; without it they are recomputed.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    prompt: str | None = None
    kv: list | None = None
    output_token_ids: list[int] = field(default_factory=list)


@dataclass
class SampleDelta:
    """What is new for one of a request's ``n`` samples since its previous delta."""

    index: int
    token_ids: list[int]
    text: str
    logprobs: list[SampleLogprobs] | None = None  # one per new token, when asked for
    cumulative_logprob: float | None = None       # the running total (a scalar)
    finish_reason: str | None = None
    stop_reason: str | int | None = None


@dataclass
class OutputDelta:
    """One streamed step of a request: its samples with news, and its metrics so far.

    ``metrics`` come on the first delta, the last, and any delta where a milestone
    changed (``milestones``: scheduled, first token, cached tokens, preemptions, KV
    transfer); otherwise None, and ``num_generated_tokens`` alone brings the one
    figure that changes every step. ``prompt_logprobs`` comes once, on the delta
    where they are all computed.
    """

    request_id: str
    samples: list[SampleDelta]
    finished: bool
    metrics: RequestMetrics | None
    prompt_logprobs: list[SampleLogprobs | None] | None = None
    num_generated_tokens: int = 0


def milestones(metrics: RequestMetrics) -> tuple:
    """What of a request's metrics the handle needs as soon as it changes."""
    return (metrics.first_scheduled_time, metrics.first_token_time, metrics.num_cached_tokens,
            metrics.num_preemptions, metrics.kv_transfer_bytes, metrics.kv_transfer_s, metrics.kv_memcpy_s)


def merge_deltas(deltas: list[OutputDelta]) -> OutputDelta:
    """One delta saying what ``deltas`` (consecutive, of one request, oldest first) say: each
    sample's tokens, text and logprobs joined, its latest running total and finish, the
    latest metrics, and the prompt logprobs if one of them carried them."""
    if len(deltas) == 1:
        return deltas[0]
    samples: dict[int, SampleDelta] = {}
    for delta in deltas:
        for news in delta.samples:
            seen = samples.get(news.index)
            if seen is None:
                samples[news.index] = dataclasses.replace(news, token_ids=list(news.token_ids))
                continue
            seen.token_ids.extend(news.token_ids)
            seen.text += news.text
            if news.logprobs is not None:
                seen.logprobs = [*(seen.logprobs or []), *news.logprobs]
            seen.cumulative_logprob = news.cumulative_logprob
            seen.finish_reason, seen.stop_reason = news.finish_reason, news.stop_reason
    prompt_logprobs = next((d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None), None)
    metrics = next((d.metrics for d in reversed(deltas) if d.metrics is not None), None)
    last = deltas[-1]
    return OutputDelta(last.request_id, list(samples.values()), last.finished, metrics, prompt_logprobs,
                       last.num_generated_tokens)


@dataclass
class Migrated:
    """The KV manager moved the request to ``target``; the stream ends here.

    ``kv`` is the ObjectRef of the migrated KV (held by the source worker until
    the handle calls its ``release_export``); continue with a ``GenerateRequest``
    carrying ``kv=[kv]`` and the output tokens so far.
    """

    request_id: str
    target: str
    kv: object


ChannelItem = OutputDelta | Migrated | BaseException


class ChannelMessage(list):
    """One message of an output channel: ``(request id, item)`` pairs, each request's in the
    order it made them.

    Pickled compactly: each ``OutputDelta`` travels as a tuple of its fields, its samples as
    tuples of theirs, and is rebuilt on arrival; other items travel as they are. A message
    carries one delta per streaming request per engine step, and Ray's pickler makes a Python
    call per dataclass instance it meets (two per delta), where tuples, lists, strings and
    numbers are pickled in C.
    """

    __slots__ = ()

    def __reduce__(self):
        wire = []
        for request_id, item in self:
            if type(item) is OutputDelta:
                wire.append((request_id, item.request_id,
                             [(s.index, s.token_ids, s.text, s.logprobs, s.cumulative_logprob, s.finish_reason,
                               s.stop_reason) for s in item.samples],
                             item.finished, item.metrics, item.prompt_logprobs, item.num_generated_tokens))
            else:
                wire.append((request_id, item))
        return _channel_message, (wire,)


def _channel_message(wire: list[tuple]) -> ChannelMessage:
    message = ChannelMessage()
    append = message.append
    for entry in wire:
        if len(entry) == 2:
            append(entry)
            continue
        request_id, delta_id, samples, finished, metrics, prompt_logprobs, num_generated_tokens = entry
        append((request_id, OutputDelta(delta_id, [SampleDelta(*sample) for sample in samples], finished, metrics,
                                        prompt_logprobs, num_generated_tokens)))
    return message


class DeltaEncoder:
    """Makes one request's ``OutputDelta``s (one encoder per stream), from its engine outputs
    (``encode``) or, for a request the engine was handed the encoder with, from its samples'
    news directly (``delta``: the output processor's, without a ``RequestOutput`` between).

    A sample is included when it has new tokens or text, or reports its finish
    for the first time; the prompt logprobs go out once; the metrics when a
    milestone changed, and on the last delta (pickled, they were half of a
    one-token delta's bytes and of its cost to send and to read).
    """

    __slots__ = ("_sent_prompt_logprobs", "_sent_milestones")

    def __init__(self) -> None:
        self._sent_prompt_logprobs = False
        self._sent_milestones: tuple | None = None

    def encode(self, output: RequestOutput) -> OutputDelta:
        samples = [SampleDelta(c.index, list(c.delta_token_ids), c.delta_text, c.delta_logprobs,
                               c.cumulative_logprob, c.finish_reason, c.stop_reason)
                   for c in output.outputs if c.delta_token_ids or c.delta_text or c.is_newly_finished]
        return self.delta(output.request_id, samples, output.finished, output.metrics, output.prompt_logprobs)

    def delta(self, request_id: str, samples: list[SampleDelta], finished: bool, metrics: RequestMetrics | None,
              prompt_logprobs: list[SampleLogprobs | None] | None) -> OutputDelta:
        """The delta of ``samples`` (the samples with news): the prompt logprobs if these are
        the first complete ones, the metrics if a milestone moved or the request finished."""
        if prompt_logprobs is not None:
            if self._sent_prompt_logprobs:
                prompt_logprobs = None
            else:
                self._sent_prompt_logprobs = True
        num_generated_tokens = 0
        if metrics is not None:
            num_generated_tokens = metrics.num_generated_tokens
            now = milestones(metrics)
            if now == self._sent_milestones and not finished:
                metrics = None
            else:
                self._sent_milestones = now
        return OutputDelta(request_id, samples, finished, metrics, prompt_logprobs, num_generated_tokens)


__all__ = ["ChannelItem", "ChannelMessage", "DeltaEncoder", "GenerateRequest", "Migrated", "OutputDelta",
           "SampleDelta", "merge_deltas"]
