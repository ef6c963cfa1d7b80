"""Constraining generation to tool calls: ``tool_choice`` "required" or a named function.

As vLLM does, a named choice constrains the output to that function's
parameters (a JSON object), and "required" to a JSON array of
``{"name": ..., "parameters": ...}`` objects, one schema branch per tool; the
output is then parsed by ``NamedToolParser`` / ``RequiredToolParser``, whatever
the model's own tool-call format (save a format with a constrained form of its
own: ``ToolParser.call_constraint``, gpt-oss's harmony). The JSON is compact (no
whitespace between tokens): arguments are read by programs. "auto" leaves
generation free and parses the chat template's format with the configured
parser; "none" parses nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pagedserve.workers.sample.sampling_params import StructuredOutputsParams

from .base import ToolParser
from .json_calls import NamedToolParser, RequiredToolParser

ANY_OBJECT = {"type": "object"}


def function_name(tool_choice: Any) -> str | None:
    """The function a named ``tool_choice`` names (None for "none"/"auto"/"required")."""
    if isinstance(tool_choice, Mapping):
        function = tool_choice.get("function") or {}
        return function.get("name") if isinstance(function, Mapping) else None
    return None


def tools_by_name(tools: Sequence[Mapping[str, Any]]) -> dict[str, Mapping[str, Any]]:
    """``{name: function}`` of OpenAI ``tools`` entries (``{"type": "function", "function": {...}}``)."""
    return {tool["function"]["name"]: tool["function"] for tool in tools}


def tool_choice_constraint(tools: Sequence[Mapping[str, Any]], tool_choice: Any,
                           parallel_tool_calls: bool = True) -> StructuredOutputsParams | None:
    """The structured-output spec that ``tool_choice`` imposes (None: unconstrained).

    Raises ValueError naming ``tool_choice`` when it names a function that is not
    among ``tools``, or asks for calls without tools.
    """
    if tool_choice in (None, "none", "auto"):
        return None
    functions = tools_by_name(tools)
    name = function_name(tool_choice)
    if name is not None:
        if name not in functions:
            raise ValueError(f"tool_choice: function {name!r} is not among the request's tools "
                             f"({', '.join(sorted(functions)) or 'none given'})")
        return StructuredOutputsParams(json=parameters_schema(functions[name]), disable_any_whitespace=True)
    if tool_choice != "required":
        raise ValueError(f"tool_choice must be 'none', 'auto', 'required' or a named function, "
                         f"got {tool_choice!r}")
    if not functions:
        raise ValueError("tool_choice: 'required' needs at least one tool")
    branches = [{"type": "object",
                 "properties": {"name": {"const": fn_name}, "parameters": parameters_schema(function)},
                 "required": ["name", "parameters"], "additionalProperties": False}
                for fn_name, function in functions.items()]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": branches[0] if len(branches) == 1 else {"anyOf": branches}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    return StructuredOutputsParams(json=schema, disable_any_whitespace=True)


def constrained_parser(tool_choice: Any, **kwargs) -> ToolParser | None:
    """The parser for an output generated under ``tool_choice_constraint`` (None if unconstrained)."""
    name = function_name(tool_choice)
    if name is not None:
        return NamedToolParser(name, **kwargs)
    if tool_choice == "required":
        return RequiredToolParser(**kwargs)
    return None


def parameters_schema(function: Mapping[str, Any]) -> dict[str, Any]:
    """A function's parameters' JSON schema (any object where it gives none)."""
    parameters = function.get("parameters")
    return dict(parameters) if isinstance(parameters, Mapping) and parameters else dict(ANY_OBJECT)
