"""What a request constrains its output to, checked once at the ingress.

A request may ask for structured output in one of these ways: OpenAI's
``response_format`` (``json_object``, ``json_schema``; Ray Serve LLM's
``json_object`` with a ``schema``, which still promises an object), vLLM's ``structured_outputs`` (``json``,
``regex``, ``choice``, ``grammar``) or its earlier ``guided_json``,
``guided_regex``, ``guided_choice`` and ``guided_grammar``, or a chat
``tool_choice`` of "required" or a named function (the tools' parameter
schemas). At most one may apply. JSON may carry at most one space or line
break between tokens (``workers/sample/grammar.py``), none with vLLM's
``disable_any_whitespace`` (``structured_outputs.disable_any_whitespace``, or
``guided_decoding_backend: "guidance:disable-any-whitespace"``). ``output_constraint`` turns it into a
``StructuredOutputsParams`` and compiles it (without a tokenizer), so that a
bad schema, regex or grammar, or one over the size limit, is a 400 naming
the field it came from, before anything reaches a worker.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pagedserve.tool_parsers import tool_choice_constraint
from pagedserve.workers.sample.grammar import check_structured_outputs
from pagedserve.workers.sample.sampling_params import StructuredOutputsParams

from .errors import APIError

PREFIX = "structured_outputs"
GUIDED_KINDS = ("json", "regex", "choice", "grammar")


def output_constraint(request) -> StructuredOutputsParams | None:
    """The constraint ``request`` asks for (None: free text); ``APIError`` 400 naming the field."""
    return constraint_and_field(request)[0]


def constraint_and_field(request) -> tuple[StructuredOutputsParams | None, str | None]:
    """``output_constraint``, and the request field it came from (None with it)."""
    sources = []
    if request.structured_outputs is not None:
        sources.append(("structured_outputs", _from_structured_outputs(request.structured_outputs)))
    for kind in GUIDED_KINDS:
        value = getattr(request, f"guided_{kind}", None)
        if value is not None:
            sources.append((f"guided_{kind}", _from_guided(kind, value)))
    if request.response_format is not None and request.response_format.type != "text":
        sources.append(("response_format", _from_response_format(request.response_format)))
    tool_choice = getattr(request, "tool_choice", None)
    if getattr(request, "tools", None) is not None or tool_choice is not None:
        tool_spec = _from_tool_choice(request)
        if tool_spec is not None:
            sources.append(("tool_choice", tool_spec))
    if len(sources) > 1:
        names = " and ".join(name for name, _ in sources)
        raise APIError(400, f"{names} both constrain the output; set only one of them", param=sources[1][0])
    field, spec = sources[0] if sources else (None, None)
    if spec is not None and spec.kind in ("json", "json_object") and getattr(request, "disables_any_whitespace",
                                                                               False):
        spec = dataclasses.replace(spec, disable_any_whitespace=True)
    return spec, field


def _from_structured_outputs(options: dict[str, Any]) -> StructuredOutputsParams:
    try:
        spec = StructuredOutputsParams.from_dict(options)
    except ValueError as exc:
        raise APIError(400, str(exc), param=_structured_param(str(exc), options)) from None
    _compile(spec, f"{PREFIX}.{spec.kind}")
    return spec


def _from_guided(kind: str, value) -> StructuredOutputsParams:
    """vLLM's earlier ``guided_<kind>`` fields: the same specs as ``structured_outputs.<kind>``."""
    param = f"guided_{kind}"
    try:
        spec = StructuredOutputsParams(**{kind: value})
    except ValueError as exc:
        raise APIError(400, _renamed(str(exc), f"{PREFIX}.{kind}", param), param=param) from None
    _compile(spec, param)
    return spec


def json_object_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """JSON mode's schema: what ``schema`` allows that is also an object (JSON mode promises
    an object). The object joins ``schema``'s ``allOf``, so that its ``$defs`` stay at the
    root, where its references point."""
    return {**schema, "allOf": [*schema.get("allOf", []), {"type": "object"}]}


def _from_response_format(response_format) -> StructuredOutputsParams:
    if response_format.type == "json_object":
        if response_format.schema_ is not None:  # Ray Serve LLM's JSON mode: an object of this schema
            param = "response_format.schema"
            given = _schema_spec(response_format.schema_, param)
            try:
                return _schema_spec(json_object_schema(given.json), param)
            except APIError as exc:
                reason = exc.message.removeprefix(f"{param}: ")
                raise APIError(400, f"{param} with the object type 'json_object' promises: {reason}",
                               param=param) from None
        spec = StructuredOutputsParams(json_object=True)
        _compile(spec, "response_format")
        return spec
    if response_format.schema_ is not None:
        raise APIError(400, "response_format.schema goes with type 'json_object' (Ray Serve LLM's JSON mode); "
                            "with 'json_schema' send response_format.json_schema.schema",
                       param="response_format.schema")
    field = "response_format.json_schema"
    if response_format.json_schema is None:
        raise APIError(400, f"{field} is required when response_format.type is 'json_schema'", param=field)
    schema = response_format.json_schema.schema_
    # OpenAI's default when no schema is given: any JSON object.
    return _schema_spec({"type": "object"} if schema is None else schema, f"{field}.schema")


def _schema_spec(schema, param: str) -> StructuredOutputsParams:
    """A JSON-schema constraint (the schema as an object or its JSON text), checked, 400 naming ``param``."""
    try:
        spec = StructuredOutputsParams(json=schema)
    except ValueError as exc:
        raise APIError(400, _renamed(str(exc), f"{PREFIX}.json", param), param=param) from None
    _compile(spec, param)
    return spec


def _from_tool_choice(request) -> StructuredOutputsParams | None:
    tools = request.tool_specs
    tool_choice = request.tool_choice_spec
    names = [tool["function"]["name"] for tool in tools]
    if len(set(names)) != len(names):
        raise APIError(400, f"tools: function names must be unique, got {names}", param="tools")
    try:
        spec = tool_choice_constraint(tools, tool_choice, request.parallel_tool_calls)
    except ValueError as exc:
        raise APIError(400, str(exc), param="tool_choice") from None
    if spec is not None:
        _compile(spec, "tools")  # the tools' parameter schemas
    return spec


def _compile(spec: StructuredOutputsParams, param: str) -> None:
    try:
        check_structured_outputs(spec)
    except ValueError as exc:
        raise APIError(400, _renamed(str(exc), f"{PREFIX}.{spec.kind}", param), param=param) from None


def _renamed(message: str, name: str, param: str) -> str:
    """The engine's message names ``structured_outputs.<kind>``; the client sent ``param``."""
    if name == param:
        return message
    return message.replace(name, param, 1) if message.startswith(name) else f"{param}: {message}"


def _structured_param(message: str, options: dict[str, Any]) -> str:
    """The most specific field a ``StructuredOutputsParams`` error is about."""
    for key in sorted(options, key=len, reverse=True):
        if f"{PREFIX}.{key}" in message or (message.startswith("unknown") and key in message):
            return f"{PREFIX}.{key}"
    return PREFIX
