"""The handle <-> worker protocol: typed messages across the actor boundary.

A request goes to a worker as a ``GenerateRequest``, under a key its handle chose for it on
that worker's output channel. The worker's channel message (``ChannelMessage``, one per
engine step for all of a handle's requests, or several steps' when the handle fell behind) is
a list of packed ``StreamBatch``es, the engine core's bytes forwarded unopened, and control
items: ``Migrated`` ends a request the KV manager moved to another worker. Only what is new
travels (token ids, text where the worker decodes it, logprobs, a sample's finish the first
time, the request's metrics when a milestone moved), so the bytes per streamed token stay the
same however long the sequence grows. A channel whose worker's engine loop ended (failed or
shut down) ends with ``EngineDeadError``.

``deltas_from_batch`` reads a batch as one ``OutputDelta`` per request; the cumulative view an
API needs (non-streaming bodies, n > 1, resuming after a failure) is rebuilt from the deltas by
``accumulator.OutputAccumulator``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ..lora.lora_request import LoRARequest
from ..outputs.request_output import RequestMetrics, SampleLogprobs
from ..outputs.stream_batch import StreamBatch, unpack_logprobs, unpack_metrics
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
    ``key`` names the request in its channel's batches (the handle's choice, unique
    among the requests it has on that channel). ``lora_request``: the LoRA adapter to
    generate with (the worker's engine has ``enable_lora``).
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    prompt: str | None = None
    kv: list | None = None
    output_token_ids: list[int] = field(default_factory=list)
    key: int = 0
    lora_request: LoRARequest | None = None


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
    changed (``stream_batch.milestones``: scheduled, first token, cached tokens,
    preemptions, KV transfer); otherwise None. ``num_generated_tokens`` is the
    request's count on its last delta; None on the others (the reader counts the
    tokens). ``prompt_logprobs`` comes once, on the delta where they are all computed.
    """

    request_id: str
    samples: list[SampleDelta]
    finished: bool
    metrics: RequestMetrics | None
    prompt_logprobs: list[SampleLogprobs | None] | None = None
    num_generated_tokens: int | None = None


def merge_deltas(deltas: list[OutputDelta]) -> OutputDelta:
    """One delta saying what ``deltas`` (consecutive, of one request, oldest first) say: each
    sample's tokens, text and logprobs joined, its latest running total and finish, the
    latest metrics, and the prompt logprobs if one of them carried them."""
    if len(deltas) == 1:
        return deltas[0]
    # Most merges: one sample each, no per-token logprobs (a stream read behind the engine).
    token_ids: list[int] = []
    texts: list[str] = []
    cumulative_logprob = prompt_logprobs = metrics = None
    for delta in deltas:
        samples = delta.samples
        if len(samples) != 1 or samples[0].index != 0 or samples[0].logprobs is not None:
            return _merge_samples(deltas)
        news = samples[0]
        token_ids += news.token_ids
        if news.text:
            texts.append(news.text)
        if news.cumulative_logprob is not None:
            cumulative_logprob = news.cumulative_logprob
        if prompt_logprobs is None:
            prompt_logprobs = delta.prompt_logprobs
        if delta.metrics is not None:
            metrics = delta.metrics
    last = deltas[-1]
    news = last.samples[0]
    return OutputDelta(last.request_id, [SampleDelta(0, token_ids, "".join(texts), None, cumulative_logprob,
                                                     news.finish_reason, news.stop_reason)],
                       last.finished, metrics, prompt_logprobs, last.num_generated_tokens)


def _merge_samples(deltas: list[OutputDelta]) -> OutputDelta:
    """``merge_deltas`` of deltas with several samples or logprobs."""
    samples: dict[int, SampleDelta] = {}
    for delta in deltas:
        for news in delta.samples:
            seen = samples.get(news.index)
            if seen is None:
                samples[news.index] = dataclasses.replace(news, token_ids=list(news.token_ids))
                continue
            _join(seen, news)
    prompt_logprobs = next((d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None), None)
    metrics = next((d.metrics for d in reversed(deltas) if d.metrics is not None), None)
    last = deltas[-1]
    return OutputDelta(last.request_id, list(samples.values()), last.finished, metrics, prompt_logprobs,
                       last.num_generated_tokens)


def split_delta(delta: OutputDelta, drop_text: bool = False) -> list[OutputDelta]:
    """``delta`` as one delta per new token (the j-th holds each sample's j-th new token), for a
    stream read token by token: the metrics and prompt logprobs go with the first, the request's
    end with the last, and a sample's finish with its last token. A delta whose samples carry
    text (decoded on the worker) stays whole, since text is not split by token, unless
    ``drop_text`` (its reader decodes the text itself)."""
    longest = max((len(news.token_ids) for news in delta.samples), default=0)
    if longest < 2 or (not drop_text and any(news.text for news in delta.samples)):
        return [delta]
    pieces = []
    for j in range(longest):
        samples = []
        for news in delta.samples:
            num_tokens = len(news.token_ids)
            if j >= num_tokens:
                continue
            is_last = j == num_tokens - 1
            samples.append(SampleDelta(
                news.index, [news.token_ids[j]], "",
                None if news.logprobs is None else [news.logprobs[j]], news.cumulative_logprob,
                news.finish_reason if is_last else None, news.stop_reason if is_last else None))
        is_first, is_end = j == 0, j == longest - 1
        pieces.append(OutputDelta(delta.request_id, samples, delta.finished and is_end,
                                  delta.metrics if is_first else None,
                                  delta.prompt_logprobs if is_first else None,
                                  delta.num_generated_tokens if is_end else None))
    return pieces


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
# A channel message: the engine core's packed batches and control items, in order.
ChannelMessage = list


def error_from_batch(kind: str, message: str, engine_id: str | None) -> BaseException:
    """A request's error as the engine core named it, rebuilt as its own type where it is a
    common one (a refused request's ValueError, a dead engine's EngineDeadError)."""
    if kind == "EngineDeadError" or kind == "CoreDead":
        return EngineDeadError(message, engine_id)
    known = {"ValueError": ValueError, "TypeError": TypeError}
    return known[kind](message) if kind in known else RuntimeError(f"{kind}: {message}")


def deltas_from_batch(batch: StreamBatch) -> list[tuple[int, OutputDelta | BaseException]]:
    """A batch's news as ``(key, item)`` pairs in the order the requests first appear: one
    ``OutputDelta`` per request (a sample's rows joined), or the error that ended it."""
    keys = batch.keys
    if not (batch.texts or batch.logprobs or batch.finishes or batch.metrics or batch.prompt_logprobs
            or batch.ends or batch.errors) and batch.indexes is None and batch.counts is None \
            and len(set(keys)) == len(keys):
        # Most decoding steps: one token a request, and nothing else to say (``_deltas_any``'s
        # deltas, without its lookups a row).
        return [(key, OutputDelta("", [SampleDelta(0, [token], "")], False, None))
                for key, token in zip(keys, batch.token_ids)]
    return _deltas_any(batch)


def _deltas_any(batch: StreamBatch) -> list[tuple[int, OutputDelta | BaseException]]:
    keys, token_ids = batch.keys, batch.token_ids
    texts = dict(batch.texts) if batch.texts else None
    logprobs = {row: (packed, cumulative) for row, packed, cumulative in batch.logprobs} if batch.logprobs else None
    finishes = {row: (reason, stop) for row, reason, stop in batch.finishes} if batch.finishes else None
    metrics = {key: unpack_metrics(packed) for key, packed in batch.metrics} if batch.metrics else {}
    prompt_logprobs = ({key: [None if entry is None else unpack_logprobs([entry])[0] for entry in packed]
                        for key, packed in batch.prompt_logprobs} if batch.prompt_logprobs else {})
    ends = dict(batch.ends) if batch.ends else {}
    items: list[tuple[int, OutputDelta | BaseException]] = []
    if batch.indexes is None and batch.counts is None and len(set(keys)) == len(keys):
        # A row a request, one token a row: each row is its request's delta (decoding steps).
        for row, key in enumerate(keys):
            news = SampleDelta(0, [token_ids[row]], texts.get(row, "") if texts else "")
            if logprobs is not None or finishes is not None:
                _add_sparse(news, row, logprobs, finishes)
            items.append((key, OutputDelta("", [news], key in ends, metrics.get(key), prompt_logprobs.get(key),
                                           ends.get(key))))
        seen = set(keys)
    else:
        starts = batch.starts()
        indexes = batch.indexes
        samples: dict[int, dict[int, SampleDelta]] = {}
        for row, key in enumerate(keys):
            index = 0 if indexes is None else indexes[row]
            news = SampleDelta(index, token_ids[starts[row]:starts[row + 1]], texts.get(row, "") if texts else "")
            if logprobs is not None or finishes is not None:
                _add_sparse(news, row, logprobs, finishes)
            by_index = samples.setdefault(key, {})
            earlier = by_index.get(index)
            if earlier is None:
                by_index[index] = news
            else:
                _join(earlier, news)
        for key, by_index in samples.items():
            items.append((key, OutputDelta("", list(by_index.values()), key in ends, metrics.get(key),
                                           prompt_logprobs.get(key), ends.get(key))))
        seen = set(samples)
    for key in dict.fromkeys([*metrics, *prompt_logprobs, *ends]):   # news without rows
        if key not in seen:
            items.append((key, OutputDelta("", [], key in ends, metrics.get(key), prompt_logprobs.get(key),
                                           ends.get(key))))
    items.extend((key, error_from_batch(kind, message, engine_id)) for key, kind, message, engine_id in batch.errors)
    return items


def _add_sparse(news: SampleDelta, row: int, logprobs: dict | None, finishes: dict | None) -> None:
    if logprobs is not None and row in logprobs:
        packed, news.cumulative_logprob = logprobs[row]
        news.logprobs = None if packed is None else unpack_logprobs(packed)
    if finishes is not None and row in finishes:
        news.finish_reason, news.stop_reason = finishes[row]


def _join(seen: SampleDelta, news: SampleDelta) -> None:
    seen.token_ids.extend(news.token_ids)
    seen.text += news.text
    if news.logprobs is not None:
        seen.logprobs = [*(seen.logprobs or []), *news.logprobs]
    if news.cumulative_logprob is not None:
        seen.cumulative_logprob = news.cumulative_logprob
    seen.finish_reason, seen.stop_reason = news.finish_reason, news.stop_reason


__all__ = ["ChannelItem", "ChannelMessage", "EngineDeadError", "GenerateRequest", "Migrated", "OutputDelta",
           "SampleDelta", "deltas_from_batch", "error_from_batch", "merge_deltas", "split_delta"]
