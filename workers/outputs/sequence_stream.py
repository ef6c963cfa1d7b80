"""One sample's stream as its caller sees it (``SequenceStream``): its text so far, what is not
streamed yet, and its finish. The output processor alone reads and writes it; the engine's
``Sequence`` holds it for the processor (``Sequence.stream``)."""

from __future__ import annotations

from .detokenizer import FINISH_STOP, StreamingDetokenizer
from .request_output import SampleLogprobs


class SequenceStream:
    """One sample's stream as its caller sees it: text, deltas and finish."""

    def __init__(self, text: StreamingDetokenizer | UndecodedText, num_initial_tokens: int) -> None:
        self.text = text
        self.num_tokens = num_initial_tokens           # output tokens accounted for
        self.num_initial_tokens = num_initial_tokens   # streamed elsewhere before (a resumed request)
        self.num_logprobs = 0
        self.num_streamed_tokens = num_initial_tokens
        self.streamed_text_pieces: list[str] = []
        self.delta_text = ""
        self.cumulative_logprob = 0.0
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.is_finish_streamed = False
        self.kv_transfer: tuple | None = None
        self.migrate_to: str | None = None

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    def add_token(self, token_id: int, reason: str | None) -> None:
        text = self.text
        new_text = text.append(token_id, reason)
        self.num_tokens += 1
        if new_text:
            self.delta_text += new_text
        if text.finish_reason is not None:
            self.finish_reason, self.stop_reason = text.finish_reason, text.stop_reason

    def add_tokens(self, token_ids: list[int]) -> None:
        """``add_token`` of each of ``token_ids``, none of which ends the sequence."""
        new_text = self.text.extend(token_ids)
        self.num_tokens += len(token_ids)
        if new_text:
            self.delta_text += new_text

    def end(self, reason: str) -> None:
        """End after the tokens so far, its text complete (a grammar completed or failed):
        what was held back (an unfinished character, a possible stop string) is emitted."""
        if self.text.is_finished:   # a stop string ended it on the same token
            self.finish_reason, self.stop_reason = self.text.finish_reason, self.text.stop_reason
            return
        self.delta_text += self.text.finish(reason)
        self.finish_reason, self.stop_reason = reason, self.text.stop_reason

    def cut(self, reason: str) -> None:
        """End here without completing the text (an abort, a migration): text held back
        stays unemitted. A migrated stream continues elsewhere from its tokens, whose
        decoder emits that text once the tokens after it complete it."""
        if self.text.is_finished:
            self.finish_reason, self.stop_reason = self.text.finish_reason, self.text.stop_reason
        else:
            self.finish_reason = reason

    def add_logprob(self, logprob: SampleLogprobs) -> None:
        self.num_logprobs += 1
        self.cumulative_logprob += logprob.logprob


class UndecodedText:
    """A stream's text where it is not decoded (``SamplingParams.detokenize`` off): it stays
    empty, and only the finish is kept, as ``StreamingDetokenizer`` keeps it (the stop token
    id that ended it, if one did). What follows its tokens costs no decoding."""

    streamed_text = ""

    def __init__(self, stop_token_ids: list[int]) -> None:
        self._stop_token_ids = stop_token_ids
        self.finish_reason: str | None = None
        self.stop_reason: int | None = None

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, token_id: int, finish_reason: str | None = None) -> str:
        if finish_reason is not None:
            self.finish_reason = finish_reason
            if finish_reason == FINISH_STOP and token_id in self._stop_token_ids:
                self.stop_reason = token_id
        return ""

    def extend(self, token_ids: list[int]) -> str:
        return ""

    def finish(self, finish_reason: str) -> str:
        self.finish_reason = finish_reason
        return ""
