"""The one place where a request's cumulative output is rebuilt from its deltas.

``ClusterHandle.generate`` feeds every ``OutputDelta`` a worker streams into
an ``OutputAccumulator`` and yields its ``RequestOutput``s; HTTP and gRPC read
them (the cumulative fields for whole responses and usage, the ``delta_*``
fields for streams). A resumed or migrated request keeps its accumulator, so
its output runs on across workers as one. With a ``text_decoder``, the workers
send token ids only and the text is decoded here, as vLLM's front end decodes
it: the workers' output threads, which share their process with the engine's
step, spend nothing on it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ..actor.protocol import OutputDelta, SampleDelta
from .detokenizer import DeltaTextDecoder
from .request_output import CompletionOutput, ListPrefix, RequestMetrics, RequestOutput, SampleLogprobs, TextPrefix


_NO_NEWS = (None, "", False)


@dataclass
class _Sample:
    """One sample's news so far; the lists only ever grow (outputs hold prefixes of them)."""

    token_ids: list[int] = field(default_factory=list)
    text_pieces: list[str] = field(default_factory=list)
    logprobs: list[SampleLogprobs] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class OutputAccumulator:
    """A request's samples so far; ``add`` takes a delta and returns the request's output.

    Each returned ``RequestOutput`` holds every sample seen so far, with its
    cumulative ``token_ids``/``text``/``logprobs`` (prefixes copied on first
    read: later deltas do not change an output already returned, and a
    consumer of the deltas alone pays O(new tokens) per ``add``) and, for the samples this delta
    touched, ``delta_token_ids``/``delta_text``/``delta_logprobs``; a sample
    is reported finished by exactly one output.
    """

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 text_decoder: Callable[[], DeltaTextDecoder] | None = None) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        # Makes a sample's decoder when its workers send token ids without text (the handle
        # decodes them: ``SamplingParams.detokenize`` off on the workers' requests).
        self.text_decoder = text_decoder
        self._decoders: dict[int, DeltaTextDecoder] = {}
        self._samples: dict[int, _Sample] = {}
        self._prompt_logprobs: list[SampleLogprobs | None] | None = None
        self._metrics: RequestMetrics | None = None
        self._num_generated_tokens = 0

    def add(self, delta: OutputDelta) -> RequestOutput:
        news = delta.samples
        if (len(news) == 1 and len(self._samples) == 1 and news[0].logprobs is None
                and delta.metrics is None and delta.prompt_logprobs is None and delta.num_generated_tokens is None):
            sample = self._samples.get(news[0].index)
            if sample is not None and sample.logprobs is None:
                return self._add_plain(news[0], sample, delta.finished)
        return self._add_any(delta)

    def _add_plain(self, news: SampleDelta, sample: _Sample, finished: bool) -> RequestOutput:
        """``add`` for the delta of most decoding steps: the request's one sample so far, without
        logprobs, metrics or a count (the same output as ``_add_any``, for a few µs less a token)."""
        token_ids = news.token_ids
        sample.token_ids.extend(token_ids)
        text = news.text if self.text_decoder is None else self._decode(news)
        if text:
            sample.text_pieces.append(text)
        sample.cumulative_logprob = news.cumulative_logprob
        is_newly_finished = news.finish_reason is not None and sample.finish_reason is None
        sample.finish_reason = news.finish_reason
        sample.stop_reason = news.stop_reason
        self._num_generated_tokens += len(token_ids)
        if self._metrics is not None:
            self._metrics.num_generated_tokens = self._num_generated_tokens
        completion = CompletionOutput(
            news.index, TextPrefix(sample.text_pieces), ListPrefix(sample.token_ids), sample.cumulative_logprob,
            None, sample.finish_reason, sample.stop_reason, text, list(token_ids), None, is_newly_finished)
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, [completion], finished,
                             self._metrics, self._prompt_logprobs)

    def _add_any(self, delta: OutputDelta) -> RequestOutput:
        news_by_index = {}
        for news in delta.samples:
            sample = self._samples.get(news.index)
            if sample is None:
                sample = self._samples[news.index] = _Sample()
            sample.token_ids.extend(news.token_ids)
            text = news.text if self.text_decoder is None else self._decode(news)
            if text:
                sample.text_pieces.append(text)
            if news.logprobs is not None:
                if sample.logprobs is None:
                    sample.logprobs = []
                    sample.cumulative_logprob = 0.0
                sample.logprobs.extend(news.logprobs)
                # Summed here, in the engine's order, not taken from the worker: a resumed or
                # migrated run's worker counts only the tokens it sampled itself.
                for logprob in news.logprobs:
                    sample.cumulative_logprob += logprob.logprob
            else:  # no per-token logprobs (a beam's score): the worker's figure
                sample.cumulative_logprob = news.cumulative_logprob
            news_by_index[news.index] = (news, text, news.finish_reason is not None and sample.finish_reason is None)
            sample.finish_reason = news.finish_reason
            sample.stop_reason = news.stop_reason
        if delta.prompt_logprobs is not None:
            self._prompt_logprobs = delta.prompt_logprobs
        if delta.metrics is not None:
            self._metrics = delta.metrics
        if delta.num_generated_tokens is not None:   # the worker's count, on a request's last delta
            self._num_generated_tokens = delta.num_generated_tokens
        else:
            self._num_generated_tokens += sum(len(news.token_ids) for news in delta.samples)
        if self._metrics is not None:
            # As the engine's own outputs do, every output of the request shares one metrics object.
            self._metrics.num_generated_tokens = self._num_generated_tokens
        samples = self._samples
        completions = []
        for index in (samples if len(samples) == 1 else sorted(samples)):
            sample = samples[index]
            news, text, is_newly_finished = news_by_index.get(index, _NO_NEWS)
            logprobs = sample.logprobs
            if news is None:
                delta_text, delta_token_ids, delta_logprobs = "", [], None if logprobs is None else []
            else:
                delta_text, delta_token_ids = text, list(news.token_ids)
                delta_logprobs = (list(news.logprobs) if news.logprobs is not None
                                  else None if logprobs is None else [])
            # Positional: index, text, token_ids, cumulative_logprob, logprobs, finish_reason,
            # stop_reason, delta_text, delta_token_ids, delta_logprobs, is_newly_finished.
            completions.append(CompletionOutput(
                index, TextPrefix(sample.text_pieces), ListPrefix(sample.token_ids), sample.cumulative_logprob,
                None if logprobs is None else ListPrefix(logprobs), sample.finish_reason, sample.stop_reason,
                delta_text, delta_token_ids, delta_logprobs, is_newly_finished))
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, completions, delta.finished,
                             self._metrics, self._prompt_logprobs)

    def _decode(self, news) -> str:
        decoder = self._decoders.get(news.index)
        if decoder is None:
            decoder = self._decoders[news.index] = self.text_decoder()
        return decoder.add(news.token_ids, news.finish_reason)

    # ---- what a resumed attempt continues from -------------------------------------------------
    def token_ids(self, index: int = 0) -> list[int]:
        """Sample ``index``'s output tokens so far (a copy)."""
        sample = self._samples.get(index)
        return list(sample.token_ids) if sample is not None else []

    def num_tokens(self, index: int = 0) -> int:
        sample = self._samples.get(index)
        return len(sample.token_ids) if sample is not None else 0

    def num_tokens_all(self) -> int:
        """Output tokens so far, over every sample."""
        return sum(len(sample.token_ids) for sample in self._samples.values())

    def reset(self) -> None:
        """Forget every sample: the request starts again from its prompt."""
        self._samples.clear()
        self._decoders.clear()
        self._prompt_logprobs = None
        self._num_generated_tokens = 0


__all__ = ["OutputAccumulator"]
