"""Reading JSON that is still arriving: where a value ends, and a call object's parts.

Only the structure is scanned (strings with their escapes, nesting, scalars up
to a delimiter); complete text is checked with ``json.loads`` by the callers.
A value cut off by the end of the text is "not complete yet" (None), never an
error; text that can never become JSON raises ``ValueError``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

WHITESPACE = " \t\n\r"
_SCALAR_END = ",}]" + WHITESPACE


def skip_whitespace(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in WHITESPACE:
        pos += 1
    return pos


def string_end(text: str, pos: int) -> int | None:
    """Index just past the string literal opening at ``text[pos]`` (a quote)."""
    if text[pos] != '"':
        raise ValueError(f"expected a string at {pos}")
    i = pos + 1
    while i < len(text):
        char = text[i]
        if char == "\\":
            i += 2
            continue
        if char == '"':
            return i + 1
        i += 1
    return None


def value_end(text: str, pos: int) -> int | None:
    """Index just past the JSON value starting at ``text[pos]``; None if the text ends
    first (a number at the very end may still grow, so it is not complete either)."""
    if pos >= len(text):
        return None
    char = text[pos]
    if char == '"':
        return string_end(text, pos)
    if char in "{[":
        depth = 0
        i = pos
        while i < len(text):
            char = text[i]
            if char == '"':
                end = string_end(text, i)
                if end is None:
                    return None
                i = end
                continue
            if char in "{[":
                depth += 1
            elif char in "}]":
                depth -= 1
                if depth == 0:
                    return i + 1
            i += 1
        return None
    if char in "}],:":
        raise ValueError(f"expected a value at {pos}, found {char!r}")
    i = pos
    while i < len(text) and text[i] not in _SCALAR_END:
        i += 1
    return i if i < len(text) else None


@dataclass
class CallScan:
    """What a (maybe partial) call object ``{"name": ..., "arguments": ...}`` shows so far.

    ``args_start``/``args_end`` delimit the arguments value's text (``args_end``
    None while it is incomplete); ``end`` is set once the object is closed.
    """

    name: str | None = None
    args_start: int | None = None
    args_end: int | None = None
    end: int | None = None


ARGUMENT_KEYS = ("arguments", "parameters")


def scan_call(text: str, pos: int = 0) -> CallScan:
    """Scan the call object opening at ``text[pos]`` (a ``{``)."""
    scan = CallScan()
    if text[pos] != "{":
        raise ValueError(f"expected an object at {pos}")
    pos += 1
    while True:
        pos = skip_whitespace(text, pos)
        if pos >= len(text):
            return scan
        if text[pos] == "}":
            scan.end = pos + 1
            return scan
        if text[pos] == ",":
            pos += 1
            continue
        key_end = string_end(text, pos)
        if key_end is None:
            return scan
        key = json.loads(text[pos:key_end])
        pos = skip_whitespace(text, key_end)
        if pos >= len(text):
            return scan
        if text[pos] != ":":
            raise ValueError(f"expected ':' at {pos}")
        pos = skip_whitespace(text, pos + 1)
        if pos >= len(text):
            return scan
        end = value_end(text, pos)
        if key == "name" and end is not None:
            name = json.loads(text[pos:end])
            if not isinstance(name, str):
                raise ValueError("a call's name must be a string")
            scan.name = name
        elif key in ARGUMENT_KEYS and scan.args_start is None:
            scan.args_start, scan.args_end = pos, end
        if end is None:
            return scan
        pos = end
