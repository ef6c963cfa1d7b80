"""Calls written as bare JSON objects: Llama 3's JSON tool calling, and the JSON
array that ``tool_choice: "required"`` constrains generation to."""

from __future__ import annotations

import json

from .base import ParserDelta, ToolParser
from .call_stream import CallStream
from .json_scan import skip_whitespace

PYTHON_TAG = "<|python_tag|>"


class _CallSequence:
    """Objects ``{...}`` one after another, with a separator between them and an
    optional closing character; fed the text that follows the opening."""

    def __init__(self, separator: str, closing: str | None) -> None:
        self.separator = separator
        self.closing = closing
        self.pos = 0
        self.stream = CallStream()
        self.expects_separator = False
        self.is_closed = False

    def advance(self, parser: ToolParser, delta: ParserDelta, text: str) -> None:
        """Stream what ``text`` (everything so far) adds; ValueError if it cannot parse."""
        while not self.is_closed:
            pos = skip_whitespace(text, self.pos)
            if pos >= len(text):
                return
            char = text[pos]
            if self.closing is not None and char == self.closing and (
                    self.expects_separator or not parser._calls):
                self.pos, self.is_closed = pos + 1, True
                return
            if self.expects_separator:
                if char != self.separator:
                    raise ValueError(f"expected {self.separator!r} between calls at {pos}")
                self.pos, self.expects_separator = pos + 1, False
                continue
            if char != "{":
                raise ValueError(f"expected a call object at {pos}")
            end = self.stream.update(parser, delta, text, pos)
            if end is None:
                return
            self.pos, self.stream, self.expects_separator = end, CallStream(), True


class Llama3JsonToolParser(ToolParser):
    """Llama 3.x JSON tool calling: an output that starts with ``{`` (or
    ``<|python_tag|>``) is one or more ``{"name": ..., "parameters": {...}}``
    objects separated by ``;``; any other output is content. An output that
    starts like a call but is not one is returned as content."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._text = ""
        self._mode: str | None = None  # None (undecided), "content" or "calls"
        self._start = 0
        self._sequence = _CallSequence(";", None)
        self._is_broken = False

    def feed(self, text: str) -> ParserDelta:
        delta = ParserDelta()
        self._text += text
        if self._mode is None:
            self._decide()
        if self._mode == "content":
            self._emit_content(delta, text if self._start is None else self._text)
            self._start = None
        elif self._mode == "calls" and not self._is_broken:
            try:
                self._sequence.advance(self, delta, self._text[self._start:])
            except ValueError:
                self._is_broken = True
        return delta

    def finish(self) -> ParserDelta:
        delta = ParserDelta()
        if self._mode is None or (self._mode == "calls" and not self._calls):
            self._emit_content(delta, self._text)
        elif self._mode == "calls" and self._is_broken:
            self._emit_content(delta, self._text[self._start + self._sequence.pos:].lstrip(" ;\n"))
        return delta

    def _decide(self) -> None:
        stripped = self._text.lstrip()
        if not stripped or PYTHON_TAG.startswith(stripped):
            return
        offset = len(self._text) - len(stripped)
        if stripped.startswith(PYTHON_TAG):
            self._mode, self._start = "calls", offset + len(PYTHON_TAG)
        elif stripped.startswith("{"):
            self._mode, self._start = "calls", offset
        else:
            self._mode, self._start = "content", 0


class RequiredToolParser(ToolParser):
    """The output of ``tool_choice: "required"``: a JSON array of
    ``{"name": ..., "parameters": {...}}`` objects (generation is constrained to it).

    The array is this server's wrapper, not the model's words: none of it is ever
    content, even when the output was cut off before a call's name was complete."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._text = ""
        self._sequence = _CallSequence(",", "]")
        self._is_broken = False

    def feed(self, text: str) -> ParserDelta:
        delta = ParserDelta()
        self._text += text
        start = skip_whitespace(self._text, 0)
        if self._is_broken or start >= len(self._text):
            return delta
        try:
            if self._text[start] != "[":
                raise ValueError("expected a JSON array of calls")
            self._sequence.advance(self, delta, self._text[start + 1:])
        except ValueError:
            self._is_broken = True
        return delta

    def finish(self) -> ParserDelta:
        return ParserDelta()


class NamedToolParser(ToolParser):
    """The output of a named ``tool_choice``: the arguments object of that one function
    (generation is constrained to its parameters' schema)."""

    def __init__(self, name: str, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._name = name
        self._call = None
        self._leading = ""

    def feed(self, text: str) -> ParserDelta:
        delta = ParserDelta()
        if self._call is None:
            self._leading += text
            if not self._leading.strip():
                return delta
            text, self._leading = self._leading.lstrip(), ""
            self._call = self._start_call(delta, self._name)
        self._emit_arguments(delta, self._call, text)
        return delta

    def finish(self) -> ParserDelta:
        """The arguments are complete if they are one JSON value (the grammar's
        output unless it was cut off)."""
        delta = ParserDelta()
        if self._call is None:
            self._call = self._start_call(delta, self._name)
            self._emit_arguments(delta, self._call, "{}")
        try:
            json.loads(self._call.arguments)
            self._call.is_complete = True
        except ValueError:
            pass
        return delta
