"""From sampled tokens to what each request's caller sees: text, stop strings, outputs.

The engine's step ends with token ids (an ``EngineStep``); the ``OutputProcessor``
turns them into ``RequestOutput`` objects, as vLLM's output processor does. It may
run on the engine's own thread (``LLMEngine.step``) or on a thread of its own
(``AsyncLLMEngine``), so that detokenizing and building outputs stay off the
step's path. Either way it alone touches the per-sequence ``SequenceStream``
state, and reads of the engine's lists (output token ids, logprobs) are bounded
by the counts it keeps itself: those lists only grow.

The engine decides the token-level finishes (EOS, stop token ids, length,
grammars, aborts). Stop strings are found here, on the text: such a sequence is
reported in ``ProcessedStep.stopped`` and the engine ends it when it is told
(at once on its own thread; a step or two later from another thread, whose
tokens are then dropped here).

A request with ``output_kind="final"`` (the offline ``LLM.generate``) and no stop
strings gets one output, at its end, and its text is decoded then: its tokens
cost nothing here while it runs.

A request with a ``stream_target`` (an output channel's, in the engine core) gets no output
objects at all: its news goes into its channel's ``StreamBatch`` for the step, column by
column (``batches``), which the core packs and sends as one message per channel. With
``stream_interval`` N > 1 a sample's tokens go out once N have gathered (its first at once,
its finish at once), as vLLM's ``--stream-interval``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..engine.request import Request, Sequence
from .detokenizer import StreamingDetokenizer
from .request_output import CompletionOutput, ListPrefix, RequestOutput, SampleLogprobs, TextPrefix
from .sequence_stream import SequenceStream, UndecodedText
from .stream_batch import StreamBatch, StreamTarget, pack_logprobs, pack_metrics

OUTPUT_KINDS = ("stream", "final")


def _add_common_row(batch: StreamBatch, target: StreamTarget, request: Request, seq: Sequence,
                    stream: SequenceStream) -> None:
    """A stream target's common row: one sample's tokens not streamed yet (at least one), without
    text, logprobs or a finish; and its metrics when a milestone moved."""
    num_tokens, num_streamed = stream.num_tokens, stream.num_streamed_tokens
    stream.num_streamed_tokens = num_tokens
    if num_tokens - num_streamed == 1 and batch.counts is None and batch.indexes is None and not seq.sample_index:
        batch.keys.append(target.key)   # what ``batch.add`` does for one token of sample 0
        batch.token_ids.append(seq.output_token_ids[num_streamed])
    else:
        batch.add(target.key, seq.sample_index, seq.output_token_ids[num_streamed:num_tokens])
    metrics = request.metrics
    metrics.num_generated_tokens = num_tokens
    if target.milestones_moved(metrics, False):
        batch.metrics.append((target.key, pack_metrics(metrics)))


@dataclass
class SeqFinish:
    """The engine ended ``seq`` this step. ``by_token``: the sampled token itself decided it
    (EOS or a stop token id: "stop"; the length limit: "length"); otherwise the sequence
    ended after that token (its grammar completed or failed) or without one (abort)."""

    seq: Sequence
    reason: str
    by_token: bool = True


@dataclass
class StepTokens:
    """The tokens one step sampled: ``seqs[i]`` sampled ``token_ids[i]`` (``logprobs[i]``
    when its request asked; ``logprobs`` is None when none did). ``text_positions`` lists
    the positions whose text is followed token by token (None: all of them);
    ``finished``: the sequences that end with these tokens."""

    seqs: list[Sequence]
    token_ids: list[int]
    logprobs: list[SampleLogprobs | None] | None = None
    text_positions: list[int] | None = None
    finished: list[SeqFinish] = field(default_factory=list)


@dataclass
class EngineStep:
    """What one call of the engine's step produced, for the output processor: the tokens
    of the steps it read (two with overlapped scheduling when it had to read the running
    step's early; in order), the requests aborted since the last call, the sequences
    migrated (sequence, KV transfer (header, payload), target worker), and the outputs
    of requests the engine finished with outputs of its own (beam search), each with its
    request."""

    tokens: list[StepTokens] = field(default_factory=list)
    aborted: list[Request] = field(default_factory=list)
    migrated: list[tuple[Sequence, tuple, str]] = field(default_factory=list)
    final_outputs: list[tuple[Request, RequestOutput]] = field(default_factory=list)


@dataclass
class ProcessedStep:
    """The outputs of one ``EngineStep``, the sequences stop strings ended, and the
    stream-target requests migrated away (request, KV transfer (header, payload), target
    worker): their last news is in ``OutputProcessor.batches``, without a finish."""

    outputs: list[RequestOutput]
    stopped: list[Sequence]
    migrated: list[tuple[Request, tuple, str]] = field(default_factory=list)


def new_stream(seq: Sequence, tokenizer, eos_token_ids: list[int], max_model_len: int,
               output_token_ids: list[int]) -> SequenceStream:
    """A sequence's stream, primed with output tokens already streamed elsewhere (a
    resumed or migrated request): they count as streamed, and its text continues them."""
    request = seq.request
    if not request.params.detokenize:
        return SequenceStream(UndecodedText(request.params.stop_token_ids), len(output_token_ids))
    text = StreamingDetokenizer(tokenizer, request.prompt_token_ids, request.params, eos_token_ids,
                                max_model_len)
    for token_id in output_token_ids:
        text.append(token_id)
    stream = SequenceStream(text, len(output_token_ids))
    if text.streamed_text:
        stream.streamed_text_pieces.append(text.streamed_text)
    return stream


class OutputProcessor:
    """Turns ``EngineStep``s into ``RequestOutput``s, or stream targets' rows (see the module
    docstring).

    Not thread-safe: one thread processes the steps, in order.
    """

    def __init__(self, stream_interval: int = 1) -> None:
        self.num_tokens_processed = 0
        self.stream_interval = stream_interval
        # The stream targets' news since ``take_batches``, one batch per channel.
        self.batches: dict[str, StreamBatch] = {}

    def take_batches(self) -> dict[str, StreamBatch]:
        """The channels' batches made since the last call (each non-empty), and a fresh start."""
        batches, self.batches = self.batches, {}
        return batches

    def process(self, step: EngineStep) -> ProcessedStep:
        touched: dict[str, Request] = {}
        stopped: list[Sequence] = []
        # A step of one sample's tokens, nothing aborted or migrated: a stream target's common
        # row goes into its batch as its token is taken (``_take_stream_rows``).
        if (len(step.tokens) == 1 and self.stream_interval == 1 and not step.aborted and not step.migrated
                and step.tokens[0].logprobs is None):
            self._take_stream_rows(step.tokens[0], touched, stopped)
        else:
            for tokens in step.tokens:
                self._take_tokens(tokens, touched, stopped)
        for seq, transfer, target in step.migrated:
            self._end(seq, "migrated")
            seq.stream.kv_transfer, seq.stream.migrate_to = transfer, target
            touched[seq.request.request_id] = seq.request
        for request in step.aborted:
            for seq in request.seqs:
                self._end(seq, "abort")
            touched[request.request_id] = request
        aborted = {id(request) for request in step.aborted}
        migrated = {id(seq.request) for seq, _, _ in step.migrated}
        outputs = []
        migrations = []
        for request in touched.values():
            if request.is_final_streamed:
                continue  # ended by stop strings, then aborted or migrated before the engine heard
            seqs = request.seqs
            # Not ``request.is_aborted``: the engine may have aborted it since this step ran.
            if aborted and id(request) in aborted:
                is_finished = True
            elif len(seqs) == 1:
                is_finished = request.params.n == 1 and seqs[0].stream.finish_reason is not None
            else:
                is_finished = len(seqs) == request.params.n and all(s.stream.is_finished for s in seqs)
            target = request.stream_target
            is_migrated = migrated and id(request) in migrated
            if target is not None:   # a migrated request goes on elsewhere: not its end
                self._emit(request, target, is_finished and not is_migrated, is_migrated)
                if is_migrated:
                    stream = next(s.stream for s in seqs if s.stream.kv_transfer is not None)
                    migrations.append((request, stream.kv_transfer, stream.migrate_to))
                    is_finished = True
            elif is_finished or request.output_kind != "final":
                outputs.append(self._make_output(request, is_finished))
            else:
                continue
            request.is_final_streamed = is_finished
        for request, output in step.final_outputs:
            if request.stream_target is not None:
                self._emit_output(request.stream_target, output)
            else:
                outputs.append(output)
        return ProcessedStep(outputs, stopped, migrations)

    def _take_tokens(self, tokens: StepTokens, touched: dict[str, Request], stopped: list[Sequence]) -> None:
        logprobs = tokens.logprobs
        seqs, token_ids = tokens.seqs, tokens.token_ids
        finishes = {id(f.seq): f for f in tokens.finished}
        positions = range(len(seqs)) if tokens.text_positions is None else tokens.text_positions
        for i in positions:
            seq = seqs[i]
            stream = seq.stream
            if stream.finish_reason is not None:
                continue  # a stop string ended it; the engine had not heard yet
            finish = finishes.get(id(seq)) if finishes else None
            stream.add_token(token_ids[i], finish.reason if finish is not None and finish.by_token else None)
            if logprobs is not None and logprobs[i] is not None:
                stream.add_logprob(logprobs[i])
            if finish is None and stream.finish_reason is not None:
                stopped.append(seq)
            request = seq.request
            touched[request.request_id] = request
        self.num_tokens_processed += len(positions)
        for finish in tokens.finished:
            seq, stream = finish.seq, finish.seq.stream
            if stream.is_finish_streamed:
                continue  # a stop string ended it before the engine did
            if not seq.request.follows_text:
                self._catch_up(seq, finish.reason if finish.by_token else None)
            if not stream.is_finished:
                stream.end(finish.reason)
            touched[seq.request.request_id] = seq.request

    def _take_stream_rows(self, tokens: StepTokens, touched: dict[str, Request], stopped: list[Sequence]) -> None:
        """``_take_tokens``, where a stream target's common row (one sample, not finished, no
        text decoded here, no logprobs) goes into its channel's batch at once: what ``process``
        and ``_emit``'s short way would make of it, without a second pass over the requests.
        Every other sequence is taken as ``_take_tokens`` takes it, for ``process`` to emit."""
        seqs, token_ids = tokens.seqs, tokens.token_ids
        if tokens.text_positions is not None:   # some tokens' text is not followed: the general way
            self._take_tokens(tokens, touched, stopped)
            return
        positions: range | list[int] = range(len(seqs))
        if tokens.finished:   # the sequences that end here go the general way
            finishing = {id(finish.seq) for finish in tokens.finished}
            ending = [i for i in positions if id(seqs[i]) in finishing]
            positions = [i for i in positions if id(seqs[i]) not in finishing]
            self._take_tokens(StepTokens([seqs[i] for i in ending], [token_ids[i] for i in ending],
                                         finished=tokens.finished), touched, stopped)
        channel_id, batch = None, None
        for i in positions:
            seq = seqs[i]
            stream = seq.stream
            if stream.finish_reason is not None:
                continue  # a stop string ended it; the engine had not heard yet
            request = seq.request
            target = request.stream_target
            if (target is None or stream.text.__class__ is not UndecodedText or stream.delta_text
                    or len(request.seqs) != 1 or request.is_final_streamed
                    or request.params.logprobs is not None or request.prompt_logprobs is not None):
                stream.add_token(token_ids[i], None)
                if stream.finish_reason is not None:
                    stopped.append(seq)
                touched[request.request_id] = request
                continue
            stream.num_tokens += 1   # all that UndecodedText.append of a token ending nothing changes
            if target.channel_id != channel_id:   # most steps' targets share one channel
                channel_id, batch = target.channel_id, self._batch(target)
            _add_common_row(batch, target, request, seq, stream)
        self.num_tokens_processed += len(positions)

    def _end(self, seq: Sequence, reason: str) -> None:
        """An abort or a migration: the stream stops where it is."""
        if not seq.request.follows_text:
            self._catch_up(seq, None)
        if not seq.stream.is_finished:
            seq.stream.cut(reason)

    @staticmethod
    def _catch_up(seq: Sequence, last_reason: str | None) -> None:
        """Account for the tokens of a sequence decoded only at its end (its list is
        final: the engine appends nothing to an ended sequence); ``last_reason`` is
        the finish its last token decided, if it decided one."""
        stream = seq.stream
        token_ids = seq.output_token_ids
        num_tokens = len(token_ids)
        if stream.num_tokens < num_tokens:
            # No stop strings (the text would have followed): only the last token may end it.
            if stream.num_tokens < num_tokens - 1:
                stream.add_tokens(token_ids[stream.num_tokens:num_tokens - 1])
            stream.add_token(token_ids[num_tokens - 1], last_reason)
        for logprob in seq.logprobs[stream.num_logprobs:]:
            stream.add_logprob(logprob)

    @staticmethod
    def _make_output(request: Request, is_finished: bool) -> RequestOutput:
        """The request's output now: deltas since the last one, and prefixes of the
        sequences' growing lists for the cumulative fields (O(new tokens) per call)."""
        completions = []
        wants_logprobs = request.params.logprobs is not None
        transfer = migrate_to = None
        num_generated_tokens = 0
        for seq in request.seqs:
            stream = seq.stream
            num_tokens = stream.num_tokens
            num_generated_tokens += num_tokens
            if not num_tokens and stream.finish_reason is None and seq.sample_index:
                continue  # forked, but its first token is in a later step than this one
            output_token_ids = seq.output_token_ids
            num_streamed = stream.num_streamed_tokens
            stream.num_streamed_tokens = num_tokens
            finish_reason = stream.finish_reason
            is_newly_finished = finish_reason is not None and not stream.is_finish_streamed
            stream.is_finish_streamed = finish_reason is not None
            delta_text = stream.delta_text
            if delta_text:
                stream.streamed_text_pieces.append(delta_text)
            if wants_logprobs:
                # One logprob per sampled token: the new tokens' are the last ones.
                num_logprobs = stream.num_logprobs
                cumulative_logprob = stream.cumulative_logprob
                logprobs = ListPrefix(seq.logprobs, num_logprobs)
                delta_logprobs = seq.logprobs[max(0, num_logprobs - (num_tokens - num_streamed)):num_logprobs]
            else:
                cumulative_logprob = logprobs = delta_logprobs = None
            # Positional: index, text, token_ids, cumulative_logprob, logprobs, finish_reason,
            # stop_reason, delta_text, delta_token_ids, delta_logprobs, is_newly_finished.
            completions.append(CompletionOutput(
                seq.sample_index, TextPrefix(stream.streamed_text_pieces),
                ListPrefix(output_token_ids, num_tokens), cumulative_logprob, logprobs, finish_reason,
                stream.stop_reason, delta_text, output_token_ids[num_streamed:num_tokens], delta_logprobs,
                is_newly_finished))
            stream.delta_text = ""
            if stream.kv_transfer is not None:
                transfer, migrate_to = stream.kv_transfer, stream.migrate_to
        metrics, prompt_logprobs = _request_figures(request, is_finished, num_generated_tokens)
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids,
                             completions, is_finished, metrics, prompt_logprobs, transfer, migrate_to)

    def _batch(self, target: StreamTarget) -> StreamBatch:
        batch = self.batches.get(target.channel_id)
        if batch is None:
            batch = self.batches[target.channel_id] = StreamBatch()
        return batch

    def _emit(self, request: Request, target: StreamTarget, is_finished: bool, is_migrated: bool) -> None:
        """A stream target's news into its channel's batch: a row per sample with new tokens or
        text, or a finish not reported yet (held back while fewer than ``stream_interval`` new
        tokens gathered, after the first); its metrics when a milestone moved or it ends; its
        prompt logprobs once all are computed. A migrated request's last rows carry no finish:
        it goes on elsewhere."""
        batch = self._batch(target)
        key = target.key
        interval = self.stream_interval
        seqs = request.seqs
        if (interval == 1 and len(seqs) == 1 and not is_finished and not is_migrated
                and request.params.logprobs is None and request.prompt_logprobs is None):
            # The common row, by a short way (what the loop below does for it): one sample's new
            # tokens, without text, logprobs or a finish.
            seq = seqs[0]
            stream = seq.stream
            if stream.num_tokens > stream.num_streamed_tokens and stream.finish_reason is None \
                    and not stream.delta_text:
                _add_common_row(batch, target, request, seq, stream)
                return
        wants_logprobs = request.params.logprobs is not None
        num_generated_tokens = 0
        for seq in seqs:
            stream = seq.stream
            num_tokens = stream.num_tokens
            num_generated_tokens += num_tokens
            num_streamed = stream.num_streamed_tokens
            finish_reason = None if is_migrated else stream.finish_reason
            is_newly_finished = finish_reason is not None and not stream.is_finish_streamed
            delta_text = stream.delta_text
            if not is_newly_finished and (
                    (num_tokens == num_streamed and not delta_text)
                    or (interval > 1 and not is_migrated and num_streamed > stream.num_initial_tokens
                        and num_tokens - num_streamed < interval)):
                continue
            stream.num_streamed_tokens = num_tokens
            stream.is_finish_streamed = finish_reason is not None
            row = batch.add(key, seq.sample_index, seq.output_token_ids[num_streamed:num_tokens])
            if delta_text:
                stream.streamed_text_pieces.append(delta_text)
                stream.delta_text = ""
                batch.texts.append((row, delta_text))
            if wants_logprobs:
                num_logprobs = stream.num_logprobs
                new = seq.logprobs[max(0, num_logprobs - (num_tokens - num_streamed)):num_logprobs]
                batch.logprobs.append((row, pack_logprobs(new), stream.cumulative_logprob))
            if finish_reason is not None:
                batch.finishes.append((row, finish_reason, stream.stop_reason))
        metrics, prompt_logprobs = _request_figures(request, is_finished, num_generated_tokens)
        self._emit_figures(batch, target, metrics, prompt_logprobs, is_finished)
        if is_finished:
            batch.end(key, num_generated_tokens)

    def _emit_output(self, target: StreamTarget, output: RequestOutput) -> None:
        """A finished output the engine made itself (a beam search's) into its target's batch."""
        batch = self._batch(target)
        for completion in output.outputs:
            row = batch.add(target.key, completion.index, list(completion.delta_token_ids))
            if completion.delta_text:
                batch.texts.append((row, completion.delta_text))
            if completion.logprobs is not None or completion.cumulative_logprob is not None:
                logprobs = completion.delta_logprobs
                batch.logprobs.append((row, None if logprobs is None else pack_logprobs(logprobs),
                                       completion.cumulative_logprob))
            if completion.finish_reason is not None:
                batch.finishes.append((row, completion.finish_reason, completion.stop_reason))
        self._emit_figures(batch, target, output.metrics, output.prompt_logprobs, output.finished)
        if output.finished:
            batch.end(target.key, output.metrics.num_generated_tokens)

    @staticmethod
    def _emit_figures(batch: StreamBatch, target: StreamTarget, metrics, prompt_logprobs,
                      is_finished: bool) -> None:
        if prompt_logprobs is not None and not target.sent_prompt_logprobs:
            target.sent_prompt_logprobs = True
            batch.prompt_logprobs.append(
                (target.key, [None if lp is None else pack_logprobs([lp])[0] for lp in prompt_logprobs]))
        if metrics is not None and target.milestones_moved(metrics, is_finished):
            batch.metrics.append((target.key, pack_metrics(metrics)))


def _request_figures(request: Request, is_finished: bool, num_generated_tokens: int):
    """What an output of ``request`` carries besides its samples: its metrics, brought up to
    date, and its prompt logprobs once all are computed (never changed again: shared, read-only)."""
    metrics = request.metrics
    metrics.num_generated_tokens = num_generated_tokens
    if is_finished and metrics.finished_time is None:
        metrics.finished_time = time.time()
    prompt_logprobs = None
    if request.prompt_logprobs is not None and not request.needs_prompt_logprobs:
        prompt_logprobs = request.prompt_logprobs
    return metrics, prompt_logprobs
