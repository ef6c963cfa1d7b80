"""gpt-oss's function calls (vLLM's ``openai`` tool-call parser), as the ``openai_gptoss``
reasoning parser passes them on in the answer:

    <|channel|>commentary to=functions.NAME<|message|>ARGUMENTS<|call|>

A call starts (id and name) once its header is complete; its arguments stream as the model writes
them (harmony's calls are JSON text, given as written) and it is complete at ``<|call|>``. Text
outside the calls is content; a block to a recipient that is not a function is content, whole.

``tool_choice`` "required" or named holds a reply to one such call (``harmony_call_constraint``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from pagedserve.reasoning_parsers.harmony import CALL, CHANNEL, CONSTRAIN, FUNCTIONS, MESSAGE, RECIPIENT
from pagedserve.workers.sample.grammar import HARMONY_CALL, lark_text
from pagedserve.workers.sample.sampling_params import StructuredOutputsParams

from .base import BufferedToolParser, ParserDelta, ToolCall, partial_tag_length
from .tool_choice import parameters_schema

CALL_START = CHANNEL
HEADER_END = MESSAGE
CALL_END = CALL
# A call's header after its recipient, as gpt-oss writes it: the arguments are JSON.
ARGUMENTS_HEADER = f" {CONSTRAIN}json{MESSAGE}"
# The arguments' JSON under a constraint: compact, and no schema may make llguidance lenient.
_COMPACT_JSON = {"whitespace_flexible": False, "lenient": False}


def harmony_call_constraint(functions: Mapping[str, Mapping[str, Any]], name: str | None) -> StructuredOutputsParams:
    """One call in harmony's own form, after any reasoning messages and preambles: its header from
    the recipient's name on, then its arguments as JSON that the function's schema holds. The grammar ends with the
    arguments; the model's end of sequence (``<|call|>`` among gpt-oss's) closes the call. One call
    a reply, as harmony makes them (a reply ends at its call)."""
    names = list(functions) if name is None else [name]
    rules = [f"start: {' | '.join(f'call_{index}' for index in range(len(names)))}"]
    for index, function_name in enumerate(names):
        schema = {**parameters_schema(functions[function_name]), "x-guidance": _COMPACT_JSON}
        rules.append(f"call_{index}: {lark_text(function_name + ARGUMENTS_HEADER)} arguments_{index}")
        rules.append(f"arguments_{index}: %json {json.dumps(schema)}")
    return StructuredOutputsParams(grammar="\n".join(rules) + "\n", reasoning_end=HARMONY_CALL)


class HarmonyToolParser(BufferedToolParser):
    call_constraint = staticmethod(harmony_call_constraint)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._header: str | None = None    # set while inside a block, before its arguments
        self._call: ToolCall | None = None  # set while inside a call's arguments

    def _flush(self, delta: ParserDelta) -> None:
        if self._header is not None:   # cut off inside a header: what it was is unknown
            self._emit_content(delta, CALL_START + self._header)
        self._header = self._call = None

    def _advance(self, delta: ParserDelta, is_final: bool) -> None:
        while self._buffer:
            buffer = self._buffer
            if self._call is not None:
                end = buffer.find(CALL_END)
                keep = 0 if end >= 0 or is_final else partial_tag_length(buffer, CALL_END)
                arguments = buffer[:end] if end >= 0 else buffer[:len(buffer) - keep]
                self._emit_arguments(delta, self._call, arguments)
                if end < 0:
                    self._buffer = buffer[len(buffer) - keep:]
                    return
                self._call.is_complete = True
                self._call, self._buffer = None, buffer[end + len(CALL_END):]
            elif self._header is not None:
                end = buffer.find(HEADER_END)
                if end < 0:
                    self._header, self._buffer = self._header + buffer, ""
                    return
                header, self._header, self._buffer = self._header + buffer[:end], None, buffer[end + len(HEADER_END):]
                recipient = RECIPIENT.search(header)
                if recipient is not None and recipient.group(1).startswith(FUNCTIONS):
                    self._call = self._start_call(delta, recipient.group(1)[len(FUNCTIONS):])
                else:
                    self._emit_content(delta, CALL_START + header + HEADER_END)
            else:
                start = buffer.find(CALL_START)
                if start < 0:
                    keep = 0 if is_final else partial_tag_length(buffer, CALL_START)
                    self._emit_content(delta, buffer[:len(buffer) - keep])
                    self._buffer = buffer[len(buffer) - keep:]
                    return
                self._emit_content(delta, buffer[:start])
                self._header, self._buffer = "", buffer[start + len(CALL_START):]
