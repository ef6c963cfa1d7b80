"""Log-probabilities in the API's shapes, from the engine's ``SampleLogprobs``.

- Completions (OpenAI's legacy shape): ``tokens``, ``token_logprobs``,
  ``top_logprobs`` (``{token text: logprob}``, the chosen token included) and
  ``text_offset``: where each token's text starts in the returned text.
  ``TextOffsets`` decodes the tokens incrementally, exactly as the text is
  built, so the offsets index into it (a token that ends inside a character
  split across tokens starts where that character starts).
- Chat: ``content`` entries with ``bytes``, the token's raw bytes, so that a
  character split across tokens can be rebuilt by concatenation.
- vLLM's ``prompt_logprobs``: per prompt position (the first None),
  ``{token id: {logprob, rank, decoded_token}}`` for the prompt's token and the
  top k; ``rank`` is known for the top k only.

With vLLM's ``return_tokens_as_token_ids``, completions' and chat's logprobs
name each token ``"token_id:<id>"`` instead of its text (text offsets and chat's
``bytes`` stay the token's own): a token whose text is not valid UTF-8 alone
stays identifiable.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedserve.workers.outputs.detokenizer import IncrementalDetokenizer, TokenBytes
from pagedserve.workers.outputs.request_output import SampleLogprobs

from .protocol import ChoiceLogprobs, CompletionLogprobs, PromptLogprob, TokenLogprob, TopLogprob


class TextOffsets:
    """Decodes tokens one at a time, recording where each one's text starts."""

    def __init__(self, tokenizer, context_ids: Sequence[int] = (), start: int = 0,
                 skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True) -> None:
        self._detokenizer = IncrementalDetokenizer(tokenizer, list(context_ids), skip_special_tokens,
                                                   spaces_between_special_tokens)
        self._start = start

    def add(self, token_id: int) -> int:
        """The offset of ``token_id``'s text; then decodes it."""
        offset = self._start + len(self._detokenizer.output_text)
        self._detokenizer.append(token_id)
        return offset

    def finish(self) -> str:
        """All the text decoded (held-back bytes flushed)."""
        self._detokenizer.flush()
        return self._detokenizer.output_text


class LogprobFormatter:
    """Formats logprobs for one tokenizer (token texts and bytes cached)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.token_bytes = TokenBytes(tokenizer)
        self._texts: dict[int, str] = {}

    def token_text(self, token_id: int) -> str:
        """One token as text (how logprobs name tokens)."""
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def completion(self, samples: Sequence[SampleLogprobs | None], offsets: Sequence[int],
                   token_ids: Sequence[int], as_token_ids: bool = False) -> CompletionLogprobs:
        """Entries for ``token_ids`` (a None sample: the prompt's first token, which has none);
        ``as_token_ids``: tokens named by id (``return_tokens_as_token_ids``)."""
        name = _token_id_name if as_token_ids else self.token_text
        result = CompletionLogprobs()
        for sample, offset, token_id in zip(samples, offsets, token_ids, strict=True):
            result.tokens.append(name(token_id))
            result.text_offset.append(offset)
            if sample is None:
                result.token_logprobs.append(None)
                result.top_logprobs.append(None)
                continue
            result.token_logprobs.append(sample.logprob)
            top = {name(t): lp for t, lp in sample.top}
            top.setdefault(name(sample.token_id), sample.logprob)
            result.top_logprobs.append(top)
        return result

    def chat(self, samples: Sequence[SampleLogprobs], as_token_ids: bool = False) -> ChoiceLogprobs:
        name = _token_id_name if as_token_ids else self.token_text
        content = []
        for sample in samples:
            top = [TopLogprob(token=name(t), logprob=lp, bytes=list(self.token_bytes(t)))
                   for t, lp in sample.top]
            content.append(TokenLogprob(token=name(sample.token_id), logprob=sample.logprob,
                                        bytes=list(self.token_bytes(sample.token_id)), top_logprobs=top))
        return ChoiceLogprobs(content=content)

    def prompt(self, entries: Sequence[SampleLogprobs | None]) -> list[dict[str, PromptLogprob] | None]:
        result: list[dict[str, PromptLogprob] | None] = []
        for entry in entries:
            if entry is None:
                result.append(None)
                continue
            candidates = {str(t): PromptLogprob(logprob=lp, rank=rank, decoded_token=self.token_text(t))
                          for rank, (t, lp) in enumerate(entry.top, start=1)}
            candidates.setdefault(str(entry.token_id), PromptLogprob(
                logprob=entry.logprob, rank=None, decoded_token=self.token_text(entry.token_id)))
            result.append(candidates)
        return result


def _token_id_name(token_id: int) -> str:
    """A token named by its id, as vLLM's ``return_tokens_as_token_ids`` names it."""
    return f"token_id:{token_id}"
