"""Tool-call parsing, chosen by name like vLLM's ``--tool-call-parser``.

``get_tool_parser(name)`` returns the parser class for a chat template's
format; each output gets a fresh instance (``feed`` pieces while streaming,
``finish`` at the end, or ``parse`` a whole text). ``tool_choice`` helpers
build the grammar for "required" and named choices and their parsers.
"""

from __future__ import annotations

from .base import ParsedOutput, ParserDelta, ToolCall, ToolCallDelta, ToolParser, new_call_id
from .harmony_calls import HarmonyToolParser
from .hermes import HermesToolParser
from .json_calls import Llama3JsonToolParser, NamedToolParser, RequiredToolParser
from .tool_choice import constrained_parser, function_name, tool_choice_constraint, tools_by_name

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,       # Hermes, Qwen 2.5/3, make-model's template
    "llama3_json": Llama3JsonToolParser,
    "openai": HarmonyToolParser,      # gpt-oss, with reasoning_parser "openai_gptoss"
}


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class registered as ``name``; ValueError listing the known ones."""
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(sorted(TOOL_PARSERS))}") from None


__all__ = [
    "TOOL_PARSERS", "HarmonyToolParser", "HermesToolParser", "Llama3JsonToolParser", "NamedToolParser", "ParsedOutput",
    "ParserDelta", "RequiredToolParser", "ToolCall", "ToolCallDelta", "ToolParser", "constrained_parser",
    "function_name", "get_tool_parser", "new_call_id", "tool_choice_constraint", "tools_by_name",
]
