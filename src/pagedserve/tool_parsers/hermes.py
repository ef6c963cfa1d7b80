"""Hermes / Qwen style: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks.

Text outside the blocks is content. Text that might be the start of a
``<tool_call>`` tag is held back while streaming, and trailing whitespace is
held until more content follows (so it is dropped before, between and after
calls). A block that is not a valid call is passed on as content, tags
included, when it closes (while streaming, only if nothing of it was sent yet).
"""

from __future__ import annotations

from .base import BufferedToolParser, ParserDelta, partial_tag_length
from .call_stream import CallStream
from .json_scan import skip_whitespace

START_TAG = "<tool_call>"
END_TAG = "</tool_call>"


class HermesToolParser(BufferedToolParser):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._pending_space = ""
        self._stream: CallStream | None = None  # set while inside a block
        self._is_broken = False

    def _flush(self, delta: ParserDelta) -> None:
        if self._pending_space and not self._calls:
            self._emit_content(delta, self._pending_space)
        self._pending_space = ""

    def _advance(self, delta: ParserDelta, is_final: bool) -> None:
        while True:
            if self._stream is None:
                index = self._buffer.find(START_TAG)
                if index == -1:
                    keep = 0 if is_final else partial_tag_length(self._buffer, START_TAG)
                    self._content_text(delta, self._buffer[:len(self._buffer) - keep])
                    self._buffer = self._buffer[len(self._buffer) - keep:]
                    return
                self._content_text(delta, self._buffer[:index])
                self._buffer = self._buffer[index + len(START_TAG):]
                self._stream, self._is_broken = CallStream(), False
                continue
            end = self._buffer.find(END_TAG)
            body = self._buffer if end == -1 else self._buffer[:end]
            is_closed = False
            if not self._is_broken:
                try:
                    start = skip_whitespace(body, 0)
                    if start < len(body):
                        is_closed = self._stream.update(self, delta, body, start) is not None
                except ValueError:
                    self._is_broken = True
            if end == -1 and not is_final:
                return
            is_call = not self._is_broken and is_closed
            if not is_call and self._stream.call is None:
                closing = END_TAG if end != -1 else ""
                self._content_text(delta, START_TAG + body + closing)
            self._buffer = "" if end == -1 else self._buffer[end + len(END_TAG):]
            self._stream = None
            if end == -1:
                return

    def _content_text(self, delta: ParserDelta, text: str) -> None:
        """Content, but trailing whitespace waits for more content (a call may follow)."""
        body = text.rstrip()
        if body:
            self._emit_content(delta, self._pending_space + body)
            self._pending_space = ""
        self._pending_space += text[len(body):]
