"""Streaming one call object's text into tool-call deltas as the text grows."""

from __future__ import annotations

import json

from .base import ParserDelta, ToolCall, ToolParser
from .json_scan import ARGUMENT_KEYS, scan_call


class CallStream:
    """One ``{"name": ..., "arguments": {...}}`` object, seen a prefix at a time.

    The call starts (id and name) once its name is complete; the arguments'
    text streams as it arrives, exactly as the model wrote it, so the deltas
    concatenate to the final ``arguments`` (arguments written as a JSON string
    are sent decoded, in one piece, once complete).
    """

    def __init__(self) -> None:
        self.call: ToolCall | None = None

    def update(self, parser: ToolParser, delta: ParserDelta, text: str, start: int = 0) -> int | None:
        """Take the object's text so far (opening at ``text[start]``); return the index
        just past the object once it is closed. Raises ValueError if it cannot be JSON."""
        scan = scan_call(text, start)
        if self.call is None and scan.name is not None:
            self.call = parser._start_call(delta, scan.name)
        if self.call is not None and scan.args_start is not None and text[scan.args_start] != '"':
            end = scan.args_end if scan.args_end is not None else len(text)
            raw = text[scan.args_start:end]
            parser._emit_arguments(delta, self.call, raw[len(self.call.arguments):])
        if scan.end is None:
            return None
        self._complete(parser, delta, text[start:scan.end], scan, start)
        return scan.end

    def _complete(self, parser: ToolParser, delta: ParserDelta, obj_text: str, scan, start: int) -> None:
        obj = json.loads(obj_text)
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            raise ValueError("a call needs a string 'name'")
        key = next((k for k in ARGUMENT_KEYS if k in obj), None)
        if key is None:
            arguments = "{}"
        elif isinstance(obj[key], str):
            arguments = obj[key]
        elif isinstance(obj[key], dict):
            arguments = obj_text[scan.args_start - start:scan.args_end - start]
        else:
            raise ValueError("a call's arguments must be an object")
        if self.call is None:
            self.call = parser._start_call(delta, obj["name"])
        if arguments.startswith(self.call.arguments):
            parser._emit_arguments(delta, self.call, arguments[len(self.call.arguments):])
        self.call.is_complete = True
