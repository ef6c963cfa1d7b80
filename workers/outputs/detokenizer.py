"""Incremental detokenization, stop strings and the finish check for one sequence.

Three pieces, usable alone or together:
  - ``IncrementalDetokenizer`` turns output tokens into text one token at a time,
    never emitting a half-decoded multi-byte character (prefix/read offsets).
  - ``StopStringMatcher`` finds stop strings in the growing text and says how much
    of the tail to hold back while streaming, so a client never sees part of one.
  - ``check_stop`` is the token-level finish logic: EOS / ``stop_token_ids`` give
    "stop", ``max_tokens`` (or the model's context length) gives "length".
``StreamingDetokenizer`` combines them into what the engine calls per new token.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

from ..sample.sampling_params import SamplingParams

REPLACEMENT_CHAR = "\ufffd"
# How a ``tokenizers`` ``DecodeStream`` says a decoder rewrote text it had emitted.
INVALID_PREFIX = "Invalid prefix"
# Prompt tokens decoded along with the output so that tokenizers which strip a
# leading space at the start of a decode (SentencePiece) keep it mid-text.
NUM_CONTEXT_TOKENS = 5

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
# ``StreamingDetokenizer.append``'s default: find the finish reason with ``check_stop``.
CHECK_STOP = object()


def check_stop(
    params: SamplingParams,
    output_token_ids: Sequence[int],
    eos_token_id: int | Collection[int] | None,
    num_prompt_tokens: int = 0,
    max_model_len: int | None = None,
) -> str | None:
    """Finish reason after the last output token, from token ids alone.

    Returns "stop" when the last token is EOS (unless ``ignore_eos``) or one of
    ``stop_token_ids``, else "length" when ``max_tokens`` outputs exist or prompt
    plus output reach ``max_model_len``, else None. A stop token that lands exactly
    on the length limit counts as "stop", since the model ended on its own. Stop
    strings are found on text, by ``StopStringMatcher``.
    """
    num_outputs = len(output_token_ids)
    if num_outputs:
        last = output_token_ids[-1]
        if not params.ignore_eos and _is_eos(last, eos_token_id):
            return FINISH_STOP
        if last in params.stop_token_ids:
            return FINISH_STOP
    if num_outputs >= params.max_tokens:
        return FINISH_LENGTH
    if max_model_len is not None and num_prompt_tokens + num_outputs >= max_model_len:
        return FINISH_LENGTH
    return None


def _is_eos(token_id: int, eos_token_id: int | Collection[int] | None) -> bool:
    if eos_token_id is None:
        return False
    if isinstance(eos_token_id, int):
        return token_id == eos_token_id
    return token_id in eos_token_id


class IncrementalDetokenizer:
    """Decodes a sequence's output tokens to text, one token at a time.

    ``tokenizer`` is anything with ``decode(ids, skip_special_tokens=...)``: a
    ``tokenizers.Tokenizer`` or a transformers tokenizer. Each call to ``append``
    returns the newly stable text: a token that ends mid-way through a UTF-8
    character (byte-level BPE) yields "" until the character completes, and so does
    one whose text is empty (a skipped special token): the window of tokens decoded
    moves on only with new text, so a decoder that strips the first token's leading
    space (SentencePiece) or marks continuations (WordPiece's "##") never sees a
    word start it. The concatenation of all returned pieces plus ``flush()`` equals
    decoding the output tokens (in the context of the prompt's last few tokens).

    A Rust tokenizer whose decode is exactly ``tokenizer.decode`` is followed by a
    ``tokenizers`` ``DecodeStream``: the same prefix/read-offset decoding, without two
    Python calls into the tokenizer per token (0.9 against 1.9 us a token, measured
    on the tiny model's tokenizer). Kept special tokens (joined here with spaces) and a
    decoder whose text is not monotonic (the stream raises "Invalid prefix") take the
    Python route, from the start or from that token on. A prompt context whose text is
    empty or ends inside a character takes it only until text is emitted: a stream is
    then started on the window the Python route stands on, whose state it reproduces.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self._skip_special_tokens = skip_special_tokens
        self._decode_ids = decode_function(tokenizer, skip_special_tokens)
        # Kept special tokens are decoded on their own and joined to their
        # neighbours with a space or nothing, as transformers' slow tokenizers do.
        self._special_ids = frozenset() if skip_special_tokens else special_token_ids(tokenizer)
        self._special_separator = " " if spaces_between_special_tokens else ""
        self._token_ids: list[int] = list(prompt_token_ids[-NUM_CONTEXT_TOKENS:])
        # Text of token_ids[prefix_offset:read_offset] has already been emitted.
        self._prefix_offset = 0
        self._read_offset = len(self._token_ids)
        self._num_outputs = 0
        self._pieces: list[str] = []
        self._backend = None if self._special_ids else rust_tokenizer(tokenizer)
        self._stream = self._start_stream() if self._backend is not None else None
        # Whether the Python route may hand over to a stream (after its next emitted text).
        self._may_start_stream = self._backend is not None and self._stream is None
        # A byte-level decoder's text is its tokens' bytes, decoded: a stream stepped with
        # many tokens at once ends on the text that stepping them one at a time ends on.
        self._steps_in_bulk = self._backend is not None and _is_byte_level(self._backend)

    def _start_stream(self):
        """A ``DecodeStream`` in the state the offsets describe, or None where the window's
        text is empty or ends inside a character. Stepped with the window
        ``token_ids[prefix_offset:]``, a fresh stream keeps that window and its text, which
        is what the Python route compares the next token's text with, as long as the read
        offset is at the end (at the start, and right after text was emitted)."""
        from tokenizers.decoders import DecodeStream

        stream = DecodeStream(skip_special_tokens=self._skip_special_tokens)
        window = self._token_ids[self._prefix_offset:]
        if window and stream.step(self._backend, window) is None:
            return None
        return stream

    @property
    def num_output_tokens(self) -> int:
        return self._num_outputs

    @property
    def output_text(self) -> str:
        """The text emitted so far (joined on read)."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def append(self, token_id: int) -> str:
        """Add one output token; return the text that became stable (maybe "")."""
        self._token_ids.append(token_id)
        self._num_outputs += 1
        if self._stream is None:
            new_text = self._decode_new_text()
            if new_text and self._may_start_stream:
                self._stream = self._start_stream()
                self._may_start_stream = self._stream is None
            return new_text
        try:
            new_text = self._stream.step(self._backend, token_id)
        except Exception as exc:
            if not str(exc).startswith(INVALID_PREFIX):
                raise
            self._stream = None   # the decoder rewrote earlier text: as before, by lengths
            self._may_start_stream = False
            return self._decode_new_text()
        if new_text is None:
            return ""
        self._advance(new_text)
        return new_text

    def extend(self, token_ids: list[int]) -> str:
        """``append`` of each of ``token_ids``: in one step of the stream where the decoder is
        byte-level (about a tenth of the time a token), else token by token. The text so far
        ends the same either way, but a bulk step whose tokens end inside a character returns
        nothing, where stepping returns the complete text before it: the rest comes with the
        token that completes the character (or ``flush``). For whole runs (text decoded at a
        sequence's end), not for streaming piece by piece."""
        if not (self._steps_in_bulk and self._stream is not None) or len(token_ids) < 2:
            return "".join([self.append(token_id) for token_id in token_ids])
        self._token_ids.extend(token_ids)
        self._num_outputs += len(token_ids)
        new_text = self._stream.step(self._backend, token_ids)
        if new_text is None:
            return ""
        self._advance(new_text)
        return new_text

    def flush(self) -> str:
        """Emit text still held back (an incomplete character decodes to U+FFFD)."""
        if self._read_offset == len(self._token_ids):
            return ""
        prefix_text = self._decode(self._token_ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._token_ids[self._prefix_offset :])
        new_text = full_text[len(prefix_text) :]
        self._advance(new_text)
        self._stream = None   # its window no longer matches the offsets
        self._may_start_stream = False
        return new_text

    def _decode_new_text(self) -> str:
        prefix_text = self._decode(self._token_ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._token_ids[self._prefix_offset :])
        if full_text.endswith(REPLACEMENT_CHAR) or len(full_text) <= len(prefix_text):
            return ""
        new_text = full_text[len(prefix_text) :]
        self._advance(new_text)
        return new_text

    def _advance(self, new_text: str) -> None:
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        if new_text:
            self._pieces.append(new_text)

    def _decode(self, token_ids: list[int]) -> str:
        if not self._special_ids or not self._special_ids.intersection(token_ids):
            return self._decode_ids(token_ids)
        pieces: list[str] = []
        run: list[int] = []
        for token_id in token_ids:
            if token_id in self._special_ids:
                if run:
                    pieces.append(self._decode_ids(run))
                    run = []
                pieces.append(self._decode_ids([token_id]))
            else:
                run.append(token_id)
        if run:
            pieces.append(self._decode_ids(run))
        return self._special_separator.join(pieces)


def special_token_ids(tokenizer: Any) -> frozenset[int]:
    """Ids of the special tokens of a transformers or ``tokenizers`` tokenizer."""
    ids = getattr(tokenizer, "all_special_ids", None)
    if ids is not None:
        return frozenset(ids)
    decoder = getattr(tokenizer, "get_added_tokens_decoder", None)
    if decoder is None:
        return frozenset()
    return frozenset(i for i, token in decoder().items() if getattr(token, "special", False))


def decode_function(tokenizer: Any, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """``ids -> text`` as ``tokenizer.decode`` gives it without cleaning up spaces, by the
    cheapest exact route: a transformers fast tokenizer that does not override decoding
    is asked through its Rust tokenizer directly (its Python wrapper costs ~5x the decode,
    and the engine decodes twice per output token)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and _decodes_through_backend(type(tokenizer)):
        decode = backend.decode
        return lambda ids: decode(ids, skip_special_tokens=skip_special_tokens)
    kwargs = _decode_kwargs(tokenizer, skip_special_tokens)
    decode = tokenizer.decode
    return lambda ids: decode(ids, **kwargs)


def rust_tokenizer(tokenizer: Any):
    """The ``tokenizers.Tokenizer`` whose ``decode`` is exactly ``tokenizer``'s (spaces not
    cleaned up), or None: the tokenizer itself, or a transformers fast tokenizer's
    backend when its class does not override decoding."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return None
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if isinstance(backend, Tokenizer) and _decodes_through_backend(type(tokenizer)):
        return backend
    return None


def _decodes_through_backend(tokenizer_class: type) -> bool:
    """Whether ``decode(ids, skip_special_tokens=s, clean_up_tokenization_spaces=False)`` of
    this transformers class is its backend's ``decode(ids, skip_special_tokens=s)``: true of
    the fast-tokenizer base class (``_decode`` calls the backend, then only cleans up
    spaces) unless a subclass overrides ``decode`` or ``_decode``."""
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        return False
    return (issubclass(tokenizer_class, PreTrainedTokenizerFast)
            and tokenizer_class._decode is PreTrainedTokenizerFast._decode
            and tokenizer_class.decode is PreTrainedTokenizerFast.decode)


def _decode_kwargs(tokenizer: Any, skip_special_tokens: bool) -> dict[str, Any]:
    # transformers tokenizers may "clean up" spaces (" ." -> "."), which changes
    # earlier text as later tokens arrive; turn that off where it exists.
    kwargs: dict[str, Any] = {"skip_special_tokens": skip_special_tokens}
    try:
        tokenizer.decode([], clean_up_tokenization_spaces=False, **kwargs)
    except TypeError:
        return kwargs
    kwargs["clean_up_tokenization_spaces"] = False
    return kwargs


class StopStringMatcher:
    """Finds stop strings in growing text and how much of its tail to hold back."""

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        self.stop = [s for s in stop if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        self.max_len = max((len(s) for s in self.stop), default=0)

    def find(self, text: str, num_new_chars: int) -> tuple[int, str] | None:
        """Earliest stop string that ends in the last ``num_new_chars`` of ``text``.

        Returns (length to keep, stop string) or None. The kept length excludes the
        stop string unless ``include_stop_str_in_output``. Earlier text is assumed
        to have been checked already.
        """
        if not self.stop or num_new_chars <= 0:
            return None
        best: tuple[int, str] | None = None
        for stop in self.stop:
            start = max(0, len(text) - num_new_chars - len(stop) + 1)
            index = text.find(stop, start)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return None
        index, stop = best
        return (index + len(stop) if self.include_stop_str_in_output else index), stop

    def num_held_back(self, text: str) -> int:
        """Length of the longest tail of ``text`` that could start a stop string."""
        for length in range(min(self.max_len - 1, len(text)), 0, -1):
            tail = text[-length:]
            if any(stop.startswith(tail) for stop in self.stop):
                return length
        return 0


class StreamingDetokenizer:
    """Per-sequence text stream: tokens in, safe-to-show text and finish state out.

    The streamed pieces concatenate to ``output_text``, the final text: the
    decoded output without a trailing EOS/stop token and cut before the earliest
    stop string (both kept when ``include_stop_str_in_output``). While a sequence
    runs, text that might be the start of a stop string is held back.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        eos_token_id: int | Collection[int] | None,
        max_model_len: int | None = None,
    ) -> None:
        self.params = params
        self._eos_token_id = eos_token_id
        self._num_prompt_tokens = len(prompt_token_ids)
        self._max_model_len = max_model_len
        self._detokenizer = IncrementalDetokenizer(
            tokenizer, prompt_token_ids, params.skip_special_tokens,
            params.spaces_between_special_tokens,
        )
        self._stop_matcher = StopStringMatcher(params.stop, params.include_stop_str_in_output)
        self.output_token_ids: list[int] = []
        # The output text in pieces (appending to one string copies it whole, O(length) a
        # token), and its recent part, from _recent_start on: what stop strings and the
        # next delta can still need (the text not streamed yet and the longest stop's tail).
        self._pieces: list[str] = []
        self._num_chars = 0
        self._recent = ""
        self._recent_start = 0
        self._num_streamed_chars = 0
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def output_text(self) -> str:
        """The output's text so far (joined on read)."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    @property
    def streamed_text(self) -> str:
        """The text streamed so far: always a prefix of the final ``output_text``
        (it excludes a tail held back as a possible stop string)."""
        return self.output_text[: self._num_streamed_chars]

    def append(self, token_id: int, finish_reason: str | None | object = CHECK_STOP) -> str:
        """Account for one sampled token; return the text to stream now (``finish_reason``
        and ``stop_reason`` say whether it ended the sequence, and why).

        ``finish_reason`` is what ``check_stop`` says of the outputs with this
        token: computed here unless the caller already knows it (the engine
        checks a whole batch at once).
        """
        if self.finish_reason is not None:
            raise ValueError("sequence already finished; no more tokens may be appended")
        params = self.params
        self.output_token_ids.append(token_id)
        if finish_reason is CHECK_STOP:
            finish_reason = check_stop(params, self.output_token_ids, self._eos_token_id,
                                       self._num_prompt_tokens, self._max_model_len)
        if finish_reason is None:
            new_text = self._detokenizer.append(token_id)
        else:
            new_text = ""
            if finish_reason == FINISH_STOP and token_id in params.stop_token_ids:
                self.stop_reason = token_id
            if finish_reason != FINISH_STOP or params.include_stop_str_in_output:
                new_text = self._detokenizer.append(token_id)
            new_text += self._detokenizer.flush()
        if not self._stop_matcher.stop:   # all of the text streams at once
            if new_text:
                self._pieces.append(new_text)
                self._num_chars += len(new_text)
                self._num_streamed_chars = self._recent_start = self._num_chars
            self.finish_reason = finish_reason
            return new_text
        self._add_text(new_text)
        match = None
        if len(self.output_token_ids) > params.min_tokens:
            match = self._stop_matcher.find(self._recent, len(new_text))
        if match is not None:
            keep, stop = match
            self._truncate(self._recent_start + keep)
            finish_reason, self.stop_reason = FINISH_STOP, stop
        self.finish_reason = finish_reason
        return self._take_streamable()

    def extend(self, token_ids: list[int]) -> str:
        """``append`` of each of ``token_ids``, none of which ends the sequence (the caller
        knows): the detokenizer takes them all at once (``IncrementalDetokenizer.extend``: the
        same text in the end, maybe later). Only for a sequence without stop strings (any
        token of such a one may end it)."""
        if self._stop_matcher.stop:
            raise ValueError("a sequence with stop strings takes its tokens one at a time")
        if self.finish_reason is not None:
            raise ValueError("sequence already finished; no more tokens may be appended")
        self.output_token_ids.extend(token_ids)
        new_text = self._detokenizer.extend(token_ids)
        if new_text:
            self._pieces.append(new_text)
            self._num_chars += len(new_text)
            self._num_streamed_chars = self._recent_start = self._num_chars
        return new_text

    def finish(self, finish_reason: str) -> str:
        """End the sequence now (its grammar is complete, or it failed): flush the
        text held back and return what is left to stream."""
        if self.is_finished:
            raise ValueError("sequence already finished")
        self._add_text(self._detokenizer.flush())
        self.finish_reason = finish_reason
        return self._take_streamable()

    def _add_text(self, text: str) -> None:
        if text:
            self._pieces.append(text)
            self._num_chars += len(text)
            self._recent += text

    def _truncate(self, num_chars: int) -> None:
        """Cut the text to its first ``num_chars`` (a stop string ends it: once)."""
        self._pieces = [self.output_text[:num_chars]]
        self._num_chars = num_chars
        self._recent = self._recent[:num_chars - self._recent_start]

    def _take_streamable(self) -> str:
        end = self._num_chars
        if not self.is_finished:
            end -= self._stop_matcher.num_held_back(self._recent)
        end = max(end, self._num_streamed_chars)
        start = self._recent_start
        text = self._recent[self._num_streamed_chars - start : end - start]
        self._num_streamed_chars = end
        # Keep what a later stop string or delta can reach: the unstreamed text and the
        # longest stop string's length - 1 before the end.
        new_start = max(start, min(self._num_streamed_chars, self._num_chars - self._stop_matcher.max_len))
        self._recent = self._recent[new_start - start:]
        self._recent_start = new_start
        return text


class TokenBytes:
    """The raw bytes of each token, so that a character split across tokens can be
    rebuilt from the pieces (OpenAI's ``bytes`` in chat logprobs).

    Byte-level BPE vocabularies (GPT-2, Llama 3, Qwen) map each byte to a
    printable character, and SentencePiece ones spell a byte as ``<0xAB>`` and a
    space as U+2581; both are inverted here. Special tokens are their text in
    UTF-8. Other tokenizers fall back to the UTF-8 of the token's decoded text.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._special_ids = special_token_ids(tokenizer)
        self._decoder_types = _decoder_types(tokenizer)
        self._byte_decoder = {char: byte for byte, char in _byte_level_alphabet().items()}
        self._cache: dict[int, bytes] = {}

    def __call__(self, token_id: int) -> bytes:
        value = self._cache.get(token_id)
        if value is None:
            value = self._cache[token_id] = self._compute(token_id)
        return value

    def _compute(self, token_id: int) -> bytes:
        convert = getattr(self._tokenizer, "convert_ids_to_tokens", None)
        piece = convert(token_id) if convert is not None else self._tokenizer.id_to_token(token_id)
        if piece is None:
            return b""
        if token_id in self._special_ids:
            return piece.encode("utf-8")
        if "ByteLevel" in self._decoder_types and all(c in self._byte_decoder for c in piece):
            return bytes(self._byte_decoder[c] for c in piece)
        if "ByteFallback" in self._decoder_types or "Metaspace" in self._decoder_types:
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                return bytes([int(piece[3:5], 16)])
            return piece.replace("\u2581", " ").encode("utf-8")
        return self._tokenizer.decode([token_id]).encode("utf-8")


def _is_byte_level(backend: Any) -> bool:
    """Whether a ``tokenizers.Tokenizer`` decodes with byte-level BPE's decoder alone."""
    from tokenizers import decoders

    return isinstance(backend.decoder, decoders.ByteLevel)


def _decoder_types(tokenizer: Any) -> set[str]:
    """The ``tokenizers`` decoder types of a fast tokenizer (nested sequences included)."""
    import json

    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    to_str = getattr(backend, "to_str", None)
    if to_str is None:
        return set()
    found: set[str] = set()
    stack = [json.loads(to_str()).get("decoder")]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if "type" in node:
                found.add(node["type"])
            stack.extend(node.get("decoders") or [])
    return found


def _byte_level_alphabet() -> dict[int, str]:
    """GPT-2's map from each byte to the printable character that stands for it."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1))
                 + list(range(ord("\xae"), ord("\xff") + 1)))
    mapping = {byte: chr(byte) for byte in printable}
    extra = 0
    for byte in range(256):
        if byte not in mapping:
            mapping[byte] = chr(256 + extra)
            extra += 1
    return mapping


class DeltaTextDecoder:
    """One sample's text, decoded where its deltas' token ids arrive (the cluster's handle),
    from workers that did not decode it (``SamplingParams.detokenize`` off): the text the
    worker's own ``StreamingDetokenizer`` would have streamed, piece for piece.

    The worker's finish rules: each token goes through ``check_stop``, as the engine's does,
    so a token that ends the sample itself (EOS unless ``ignore_eos``, a stop token id, the
    length limit) ends the text the same way (a stop token's text stays out); a sample
    ended after its last token (its grammar completed) flushes the text held back; an abort
    or a migration leaves it held (a migrated sample goes on with its next worker's tokens).
    A request with stop strings is decoded on its worker, which finds them; here only with
    ``with_stop_strings`` (a stream read token by token, for each token's own piece): the same
    rules on the same tokens find them at the same token and hold back the same text."""

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], params: SamplingParams,
                 eos_token_ids: Collection[int], max_model_len: int | None = None,
                 with_stop_strings: bool = False) -> None:
        if params.stop and not with_stop_strings:
            raise ValueError("a request with stop strings is decoded where they are found, on its worker")
        self._text = StreamingDetokenizer(tokenizer, prompt_token_ids, params, eos_token_ids, max_model_len)

    def add(self, token_ids: Sequence[int], finish_reason: str | None) -> str:
        """The text that ``token_ids`` (the delta's new tokens) and its finish make streamable."""
        text = self._text
        if finish_reason is None:
            # The sample goes on: by the worker's rules none of these tokens ended it, so none
            # needs ``check_stop`` (most deltas: one token, mid-stream).
            if len(token_ids) == 1:
                return text.append(token_ids[0], None)
            return "".join([text.append(token_id, None) for token_id in token_ids])
        # A token at a time, as the worker would: a bulk step holds all of a run's text back when
        # the run ends inside a character, where stepping emits its complete part.
        pieces = [text.append(token_id) for token_id in token_ids if not text.is_finished]
        if finish_reason is not None and not text.is_finished and finish_reason not in ("abort", "migrated"):
            pieces.append(text.finish(finish_reason))
        return "".join(pieces)
