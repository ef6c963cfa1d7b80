"""Request and response bodies of OpenAI's Responses API (``POST /v1/responses``).

A response is one generation over a conversation: ``input`` (text, or a list
of items: messages, earlier ``function_call`` items and their
``function_call_output``, and ``item_reference`` items naming stored ones)
after ``instructions`` (a system message). It runs
as a chat completion does (``serving_responses``), so the chat template,
function tools, structured output (``text.format``) and sampling behave the
same. Requests reject unknown fields like every other route.

What this server cannot honour is a 400 naming the field, never ignored:
``store: true``, ``previous_response_id``, ``background`` and item references
unless ``server.store_responses`` is on (``serving_responses`` decides), no
``conversation`` objects or ``prompt`` templates are kept, a reasoning item's
``encrypted_content`` is not read (this server never writes one), models are text-only
(image, file and audio parts), tools are functions only (no hosted tools), reasoning is
not summarised (``reasoning.summary``), and ``truncation: "auto"`` does not apply.
``reasoning.effort`` is the chat template's ``reasoning_effort``.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from .protocol import (MAX_INT32, MAX_INT64, MAX_REPETITION_PENALTY, MIN_REPETITION_PENALTY, NOT_A_BOOLEAN, Bool,
                       TEXT_ONLY, Float, FunctionDefinition, Int, ReasoningEffort, TokenLogprob, _Request)

# Fields of OpenAI's Responses API that this server cannot honour with any value but a harmless one.
REFUSED_RESPONSE_FIELDS = {
    "conversation": "conversation objects are not kept by this server; send the conversation as input, or "
                    "continue a stored response with previous_response_id",
    "prompt": "stored prompt templates are not kept by this server",
    "max_tool_calls": "a limit on tool calls is not supported",
    "context_management": "context management is not supported",
    "truncation": "the input is never truncated here (truncation: 'disabled')",
    "service_tier": "this server has one service tier ('auto' or 'default')",
    "prompt_cache_retention": "cached prefixes are kept for as long as the KV cache has room ('in_memory')",
}
_HARMLESS_RESPONSE_VALUES: dict[str, tuple] = {
    "truncation": ("disabled",), "service_tier": ("auto", "default"),
    "prompt_cache_retention": ("in_memory",),
}
# ``include`` values this server honours.
LOGPROBS_INCLUDE = "message.output_text.logprobs"
MAX_METADATA_PAIRS = 16


class InputText(_Request):
    type: Literal["input_text", "output_text"]
    text: str
    # An assistant's earlier output_text sent back as input carries these; they do not change the prompt.
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


def _check_text_parts(parts: Any, where: str) -> None:
    """Content parts are text: a clear refusal for the kinds a text-only model cannot read."""
    for index, part in enumerate(parts if isinstance(parts, list) else ()):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_image", "input_file", "input_audio"):
            raise ValueError(f"{where}[{index}] is {kind}: {TEXT_ONLY}")
        if kind == "refusal":
            raise ValueError(f"{where}[{index}] is a refusal, which this server's models do not write")


TextContent = Annotated[str | list[InputText], NOT_A_BOOLEAN]


class MessageItem(_Request):
    """A message of the conversation (OpenAI's easy input message, or an input/output message item)."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: TextContent
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    phase: Literal["commentary", "final_answer"] | None = None


    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class FunctionCallItem(_Request):
    """An earlier function call of the model (as the API returned it)."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str
    arguments: str
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(_Request):
    """The caller's result of a function call."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: TextContent
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(part.text for part in self.output)


class ItemReference(_Request):
    """A stored response's input or output item, named by its id (resolved from the store)."""

    type: Literal["item_reference"]
    id: str = Field(min_length=1, max_length=256)


class ReasoningText(_Request):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(_Request):
    """A reasoning model's earlier reasoning (as the API returned it): the assistant turn that
    follows it in the input gets it back, as chat's ``reasoning``."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ReasoningText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: None = Field(None, description="never written by this server, so never read")
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        """The reasoning's text (its summary's where it has no content)."""
        return "".join(part.text for part in (self.content if self.content is not None else self.summary))


InputItem = Annotated[MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem | ItemReference,
                      Field(discriminator="type")]


class FunctionTool(_Request):
    """A function the model may call (the Responses API's flat form of chat's tool)."""

    type: Literal["function"]
    name: str = FunctionDefinition.model_fields["name"]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: Bool | None = None


class FunctionToolChoice(_Request):
    type: Literal["function"]
    name: str


class TextFormat(_Request):
    """``text.format``: free text, any JSON object, or a JSON schema."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, max_length=64)
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: Bool | None = None

    @model_validator(mode="after")
    def _schema_needs_name_and_schema(self):
        if self.type == "json_schema" and (self.name is None or self.schema_ is None):
            raise ValueError("a json_schema format needs a name and a schema")
        return self


class TextConfig(_Request):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None   # the only one a model not trained for it honours


class ResponseStreamOptions(_Request):
    # OpenAI pads each delta with random characters on request; this server's deltas are not padded.
    include_obfuscation: Literal[False] | None = None


class ReasoningOptions(_Request):
    """``reasoning``: ``effort`` goes to the chat template as ``reasoning_effort`` (as chat's
    field does); a summary is refused, a reasoning item carrying the whole reasoning as content."""

    effort: ReasoningEffort | None = None
    summary: Any = None
    generate_summary: Any = None

    @field_validator("summary", "generate_summary")
    @classmethod
    def _refuse_summaries(cls, value, info):
        if value is not None:
            raise ValueError(f"reasoning.{info.field_name} cannot be honoured: reasoning is not summarised here; "
                             "a reasoning item carries the whole reasoning as its content")
        return value


class ResponsesRequest(_Request):
    """``POST /v1/responses``: ``input`` after ``instructions``, answered as one chat turn."""

    model: str | None = None
    input: str | list[InputItem] = Field(description="text (one user message) or the conversation's items")
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1, le=MAX_INT64), NOT_A_BOOLEAN] | None = None
    temperature: Annotated[float, Field(ge=0, le=2), NOT_A_BOOLEAN] | None = None
    top_p: Annotated[float, Field(gt=0, le=1), NOT_A_BOOLEAN] | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20), NOT_A_BOOLEAN] | None = None
    include: list[str] | None = None
    stream: Bool = False
    stream_options: ResponseStreamOptions | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: Bool = True
    text: TextConfig | None = None
    metadata: dict[str, Annotated[str, Field(max_length=512)]] | None = None
    user: str | None = None
    safety_identifier: str | None = Field(None, max_length=1024)
    prompt_cache_key: str | None = Field(None, max_length=1024)
    # vLLM's extensions.
    request_id: str | None = Field(None, min_length=1, max_length=256)
    priority: Int = Field(0, ge=-MAX_INT32 - 1, le=MAX_INT32)
    cache_salt: str | None = Field(None, min_length=1, max_length=1024)
    top_k: Annotated[int, Field(ge=-1, le=MAX_INT32), NOT_A_BOOLEAN] | None = None
    min_p: Float = Field(0.0, ge=0, le=1)
    repetition_penalty: Float = Field(1.0, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)
    reasoning: ReasoningOptions | None = None
    # Honoured with server.store_responses on (else refused by serving_responses).
    store: Bool | None = None
    previous_response_id: str | None = Field(None, min_length=1, max_length=256)
    background: Bool | None = None
    # Refused unless harmless (REFUSED_RESPONSE_FIELDS).
    conversation: Any = None
    prompt: Any = None
    max_tool_calls: Any = None
    context_management: Any = None
    truncation: Any = None
    service_tier: Any = None
    prompt_cache_retention: Any = None

    @field_validator(*REFUSED_RESPONSE_FIELDS)
    @classmethod
    def _refuse(cls, value, info):
        name = info.field_name
        if value is None or value in _HARMLESS_RESPONSE_VALUES.get(name, ()):
            return value
        raise ValueError(f"{name} cannot be honoured: {REFUSED_RESPONSE_FIELDS[name]}")

    @field_validator("input", mode="before")
    @classmethod
    def _items(cls, value):
        """Messages and item references may leave ``type`` out; parts that are not text, and
        encrypted reasoning, are refused by name."""
        if not isinstance(value, list):
            return value
        items = []
        for index, item in enumerate(value):
            if isinstance(item, dict):
                kind = item.get("type")
                if kind is None and "role" in item:
                    item = {**item, "type": "message"}
                elif kind is None and set(item) == {"id"}:   # OpenAI's reference may leave its type out
                    item = {**item, "type": "item_reference"}
                elif kind == "reasoning" and item.get("encrypted_content") is not None:
                    raise ValueError(f"input[{index}].encrypted_content cannot be read: this server's reasoning "
                                     "items carry their text as content")
                _check_text_parts(item.get("content"), f"input[{index}].content")
                _check_text_parts(item.get("output"), f"input[{index}].output")
            items.append(item)
        return items

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools_only(cls, value):
        for index, tool in enumerate(value if isinstance(value, list) else ()):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind is not None and kind != "function":
                raise ValueError(f"tools[{index}] is a {kind} tool: this server runs function tools only")
        return value

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _function_choice_only(cls, value):
        if isinstance(value, dict) and value.get("type") not in (None, "function"):
            raise ValueError(f"tool_choice {value.get('type')!r} names a kind of tool this server does not run "
                             "(function tools only)")
        return value

    @field_validator("include")
    @classmethod
    def _includable(cls, value):
        for entry in value or ():
            if entry != LOGPROBS_INCLUDE:
                raise ValueError(f"include {entry!r} cannot be honoured: this server includes only "
                                 f"{LOGPROBS_INCLUDE!r}")
        return value

    @field_validator("metadata")
    @classmethod
    def _metadata_size(cls, value):
        if value is not None and (len(value) > MAX_METADATA_PAIRS or any(len(key) > 64 for key in value)):
            raise ValueError(f"metadata holds at most {MAX_METADATA_PAIRS} pairs with keys of at most 64 characters")
        return value

    @property
    def wants_logprobs(self) -> bool:
        return bool(self.include and LOGPROBS_INCLUDE in self.include) or bool(self.top_logprobs)


# ---- the response ---------------------------------------------------------------------------------
class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class OutputReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class OutputReasoning(BaseModel):
    """A reasoning model's thinking, apart from its answer (``server.reasoning_parser``)."""

    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[Any] = Field(default_factory=list)
    content: list[OutputReasoningText]
    status: Literal["in_progress", "completed", "incomplete"]


class OutputFunctionCall(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(BaseModel):
    """A response (the API's ``Response``), with the request's settings as they were applied."""

    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"]
    completed_at: int | None = None
    error: dict[str, Any] | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputReasoning | OutputMessage | OutputFunctionCall] = Field(default_factory=list)
    parallel_tool_calls: bool
    previous_response_id: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    text: dict[str, Any]
    tool_choice: Any
    tools: list[dict[str, Any]]
    truncation: Literal["disabled"] = "disabled"
    background: bool = False
    store: bool = False
    service_tier: Literal["default"] = "default"
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    usage: ResponseUsage | None = None
    reasoning: dict[str, Any] = Field(default_factory=lambda: {"effort": None, "summary": None})
