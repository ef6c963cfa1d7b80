"""What a tool-call parser produces, and the streaming interface every parser follows.

A parser reads a model's output text, in pieces as it streams, and separates
plain content from tool calls. ``feed`` returns the deltas that became certain
(content, a new call's id and name, more argument text) in OpenAI's chunk
shape; ``finish`` flushes what is left. ``parse`` runs a whole text through the
same path, so streamed and non-streamed results always agree: the streamed
content and argument deltas concatenate to the parsed ones.
"""

from __future__ import annotations

import secrets
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pagedserve.workers.sample.sampling_params import StructuredOutputsParams


def partial_tag_length(text: str, tag: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``tag``."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0


def new_call_id() -> str:
    """An id in OpenAI's style: ``call_`` and 24 hex digits."""
    return f"call_{secrets.token_hex(12)}"


@dataclass
class ToolCall:
    """One call: the function's name and its arguments as JSON text. ``is_complete``
    is false while (or if, the output having been cut off) its object is not closed."""

    id: str
    name: str
    arguments: str
    is_complete: bool = field(default=False, compare=False, repr=False)


@dataclass
class ToolCallDelta:
    """A piece of call ``index``: its first delta carries ``id`` and ``name``."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class ParserDelta:
    """What one ``feed`` made certain: content text and/or tool-call pieces."""

    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)


@dataclass
class ParsedOutput:
    """A whole output: the content (None when only calls were made) and the calls."""

    content: str | None
    tool_calls: list[ToolCall]


class ToolParser(ABC):
    """Incremental parser of one output (make a new one per output)."""

    # Where the format has a constrained form of its own: ``call_constraint(functions, name)``, what
    # ``tool_choice`` "required" (``name`` None) or a named function holds a reply to, with its
    # ``reasoning_end`` set. None: calls are constrained to JSON (``tool_choice_constraint``) and
    # read by the JSON parsers (``constrained_parser``).
    call_constraint: ClassVar[Callable[[Mapping[str, Mapping[str, Any]], str | None],
                                       StructuredOutputsParams] | None] = None

    def __init__(self, new_id: Callable[[], str] = new_call_id) -> None:
        self._new_id = new_id
        self._calls: list[ToolCall] = []
        self._content: list[str] = []

    @abstractmethod
    def feed(self, text: str) -> ParserDelta:
        """Take the next piece of output text; return what became certain."""

    @abstractmethod
    def finish(self) -> ParserDelta:
        """The output ended: return everything still held back."""

    def parse(self, text: str, is_cut_off: bool = False) -> ParsedOutput:
        """Parse a whole output (the same path as streaming it in one piece).

        ``is_cut_off``: the output ran out of tokens (``finish_reason`` "length"). Then
        every call it started counts, the last one with the arguments written so
        far, as vLLM returns them and as streaming sent them. Otherwise only
        complete calls count, and an output whose only calls are incomplete (the
        model ended a malformed call) is returned as content, whole.
        """
        self.feed(text)
        self.finish()
        calls = self.started_calls if is_cut_off else self.tool_calls
        if self._calls and not calls:
            return ParsedOutput(text, [])
        content = "".join(self._content)
        if not content.strip() and (calls or is_cut_off):
            content = None
        return ParsedOutput(content, calls)

    @property
    def tool_calls(self) -> list[ToolCall]:
        """The calls completed so far."""
        return [call for call in self._calls if call.is_complete]

    @property
    def started_calls(self) -> list[ToolCall]:
        """Every call started so far (its name is known), complete or not."""
        return list(self._calls)

    # ---- helpers for subclasses ----------------------------------------------------------
    def _emit_content(self, delta: ParserDelta, text: str) -> None:
        if text:
            delta.content += text
            self._content.append(text)

    def _start_call(self, delta: ParserDelta, name: str) -> ToolCall:
        call = ToolCall(self._new_id(), name, "")
        self._calls.append(call)
        delta.tool_calls.append(ToolCallDelta(len(self._calls) - 1, call.id, name))
        return call

    def _emit_arguments(self, delta: ParserDelta, call: ToolCall, text: str) -> None:
        if not text:
            return
        call.arguments += text
        index = self._calls.index(call)
        if delta.tool_calls and delta.tool_calls[-1].index == index:
            delta.tool_calls[-1].arguments += text
        else:
            delta.tool_calls.append(ToolCallDelta(index, arguments=text))


class BufferedToolParser(ToolParser):
    """A parser that holds the text it cannot place yet in ``_buffer``: ``feed`` and ``finish``
    both run ``_advance`` over it, and ``finish`` then runs ``_flush`` for what else is held."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._buffer = ""

    def feed(self, text: str) -> ParserDelta:
        delta = ParserDelta()
        self._buffer += text
        self._advance(delta, is_final=False)
        return delta

    def finish(self) -> ParserDelta:
        delta = ParserDelta()
        self._advance(delta, is_final=True)
        self._flush(delta)
        return delta

    @abstractmethod
    def _advance(self, delta: ParserDelta, is_final: bool) -> None:
        """Move through the buffer as far as its text is certain (to its end when ``is_final``)."""

    def _flush(self, delta: ParserDelta) -> None:
        """The output ended and the buffer is spent: emit anything else still held back."""
