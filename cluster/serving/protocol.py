"""Request and response bodies of the OpenAI-compatible HTTP API (pydantic).

Requests reject unknown fields, so a misspelt option is a 400 naming the
field rather than silently ignored; numbers must be finite, not ``true`` or
``false``, and integers within 64 bits (``priority``, token ids: 32); flags
are ``true`` or ``false``. Besides OpenAI's fields
(``response_format``, ``tools``/``tool_choice``/``parallel_tool_calls``,
``stream_options``, ``logit_bias``), requests take vLLM's extensions: sampling (``top_k``,
``min_p``, ``repetition_penalty``, ``ignore_eos``, ``stop_token_ids``,
``min_tokens``, ``allowed_token_ids``, ``bad_words``), output (``skip_special_tokens``,
``spaces_between_special_tokens``, ``include_stop_str_in_output``,
``prompt_logprobs``), ``truncate_prompt_tokens``, ``structured_outputs``,
``chat_template_kwargs``, ``stream_options.continuous_usage_stats``, ``return_token_ids``,
``return_tokens_as_token_ids``, ``cache_salt``, and
``priority``, ``request_id`` (the response's id), vLLM's earlier ``guided_json``/
``guided_regex``/``guided_choice``/``guided_grammar``, chat's ``continue_final_message``
and ``add_special_tokens``, and Ray Serve LLM's JSON mode (``response_format``
``json_object`` with a ``schema``). Fields those APIs accept that this server
cannot honour (``REFUSED_FIELDS``) are a 400 naming the field and the reason.
Structured-output specs are checked in ``structured.py``.

Stream deltas (``DeltaMessage``, ``DeltaToolCall``) leave out keys that have
no value, as OpenAI's do.
"""

from __future__ import annotations

import time
from functools import cached_property
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, field_validator, model_validator
from pydantic_core import PydanticCustomError

from pagedserve.workers.sample.sampling_params import (
    MAX_LOGPROBS,
    MAX_REPETITION_PENALTY,
    MIN_REPETITION_PENALTY,
)

DEFAULT_MAX_TOKENS = 16
TEXT_ONLY = "this server serves text-only models"
MAX_INT32 = 2**31 - 1
MAX_INT64 = 2**63 - 1


def _not_a_boolean(value: Any) -> Any:
    """JSON's true and false are not numbers in a request: read as 1 and 0 they would change
    what was asked (``"logprobs": false``, chat's boolean sent to completions, would ask for
    logprobs; ``"prompt_logprobs": false`` for prompt logprobs)."""
    if isinstance(value, bool):
        raise PydanticCustomError("number_type", "Input should be a number, not a boolean")
    return value


# A request's numbers: JSON numbers (or numeric strings, as pydantic reads them), never true/false.
# The check comes after a field's bounds in its ``Annotated`` (outermost), so that the JSON schema
# keeps them as ``minimum``/``maximum``.
NOT_A_BOOLEAN = BeforeValidator(_not_a_boolean)
Int = Annotated[int, NOT_A_BOOLEAN]
Float = Annotated[float, NOT_A_BOOLEAN]
# A request's flags: true or false only (pydantic would also read 0, 1, 0.0, "yes", "off", ...).
Bool = StrictBool
TokenId = Annotated[int, Field(ge=0, le=MAX_INT32), NOT_A_BOOLEAN]
# Every step checks each bad word's tokens against a sequence's output, in Python.
MAX_BAD_WORDS = 128
MAX_BAD_WORD_CHARS = 256


def _nullable_defaults(schema: dict[str, Any], model: type[BaseModel]) -> None:
    """The JSON schema says what ``_null_is_unset`` does: a field with a default takes null too."""
    properties = schema.get("properties", {})
    for name, field in model.model_fields.items():
        prop = properties.get(field.alias or name)
        if prop is None or field.is_required() or field.default is None:
            continue   # required, or a null is already its default
        kept = {key: prop.pop(key) for key in ("title", "description", "default") if key in prop}
        properties[field.alias or name] = {"anyOf": [prop, {"type": "null"}], **kept}


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, json_schema_extra=_nullable_defaults)

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        """An explicit null for a field with a default takes the default, as OpenAI's API and
        vLLM read it (clients send ``"n": null``, ``"stream": null``, ...)."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {name: value for name, value in data.items()
                if value is not None or name not in fields or fields[name].default is None}


class StreamOptions(_Request):
    include_usage: Bool = False
    # vLLM: usage on every chunk, not only in the last event.
    continuous_usage_stats: Bool = False
    # pagedserve: an event per token where several come together (a step's accepted speculative
    # tokens, engine.stream_interval, steps merged for a reader behind); not with beam search,
    # whose text is its engine's.
    token_by_token: Bool = False


class JsonSchemaFormat(_Request):
    name: str = Field(max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: Bool | None = None


class ResponseFormat(_Request):
    """OpenAI's ``response_format``: free text, any JSON object, or a JSON schema; and Ray Serve
    LLM's JSON mode, ``json_object`` with a ``schema`` (an object or its JSON text)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
    schema_: dict[str, Any] | str | None = Field(None, alias="schema")


# Fields that OpenAI's, vLLM's or Ray Serve LLM's APIs accept and that this server cannot honour
# (with any value but the harmless ones of ``HARMLESS_VALUES``): each is a 400 naming the field
# and why, rather than "unknown field", and never silently ignored.
REFUSED_FIELDS = {
    "store": "stored completions are not kept by this server",
    "metadata": "metadata belongs to stored completions, which this server does not keep",
    "service_tier": "this server has one service tier ('auto' or 'default')",
    "verbosity": "verbosity needs a model trained for it",
    "functions": "the deprecated functions field is not supported; send tools",
    "function_call": "the deprecated function_call field is not supported; send tool_choice",
    "modalities": "this server generates text only (modalities ['text'])",
    "audio": "this server generates text only",
    "prediction": "predicted outputs (speculative decoding) are not supported",
    "web_search_options": "this server does not search the web",
    "chat_template": "a request may not bring its own chat template (server-side templates only)",
    "logits_processors": "custom logits processors are not supported",
    "vllm_xargs": "vLLM's extra arguments (vllm_xargs) are not supported",
    "kv_transfer_params": "KV transfer between servers is managed by the cluster, not the request",
    "mm_processor_kwargs": "this server serves text-only models",
    "structural_tag": "structural tags are not supported; use structured_outputs",
    "guided_whitespace_pattern": "a custom whitespace pattern is not supported; use "
                                 "structured_outputs.disable_any_whitespace",
    "guided_decoding_backend": "the grammar engine is llguidance ('guidance'), whose one option here "
                               "is 'disable-any-whitespace'",
}
# OpenAI's reasoning efforts; a chat template that reads ``reasoning_effort`` gets the value as sent.
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]
HARMLESS_VALUES: dict[str, tuple] = {
    "store": (False,), "service_tier": ("auto", "default"), "modalities": (["text"],),
}
# vLLM's guided_decoding_backend: "<backend>" or "<backend>:<option>,..."; the grammar engine is
# llguidance ("guidance"), and its one option here is vLLM's disable-any-whitespace.
GRAMMAR_BACKENDS = ("auto", "guidance", "llguidance")
GRAMMAR_BACKEND_OPTIONS = ("disable-any-whitespace",)


def _is_harmless(field: str, value) -> bool:
    if field == "guided_decoding_backend" and isinstance(value, str):
        backend, _, options = value.partition(":")
        return backend in GRAMMAR_BACKENDS and all(o in GRAMMAR_BACKEND_OPTIONS for o in options.split(",") if o)
    return value in HARMLESS_VALUES.get(field, ())


class _RefusedFields(_Request):
    """The ``REFUSED_FIELDS`` a request body may carry: None or a harmless value passes."""

    store: Any = None
    metadata: Any = None
    service_tier: Any = None
    verbosity: Any = None
    functions: Any = None
    function_call: Any = None
    modalities: Any = None
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None
    chat_template: Any = None
    logits_processors: Any = None
    vllm_xargs: Any = None
    kv_transfer_params: Any = None
    mm_processor_kwargs: Any = None
    structural_tag: Any = None
    guided_whitespace_pattern: Any = None
    guided_decoding_backend: Any = None

    @field_validator(*REFUSED_FIELDS)
    @classmethod
    def _refuse(cls, value, info):
        if value is None or _is_harmless(info.field_name, value):
            return value
        raise ValueError(f"{info.field_name} cannot be honoured: {REFUSED_FIELDS[info.field_name]}")


class _SamplingFields(_RefusedFields):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1, le=MAX_INT64), NOT_A_BOOLEAN] | None = None
    temperature: Annotated[float, Field(ge=0), NOT_A_BOOLEAN] | None = None
    top_p: Annotated[float, Field(gt=0, le=1), NOT_A_BOOLEAN] | None = None
    n: Int = Field(1, ge=1, le=MAX_INT32)
    stream: Bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: Annotated[int, Field(ge=-MAX_INT64 - 1, le=MAX_INT64), NOT_A_BOOLEAN] | None = None
    presence_penalty: Float = Field(0.0, ge=-2, le=2)
    frequency_penalty: Float = Field(0.0, ge=-2, le=2)
    # OpenAI's: token id (as JSON text) -> a bias in [-100, 100] added to its logit.
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100), NOT_A_BOOLEAN]] | None = None
    user: str | None = None
    # OpenAI's caching and abuse-monitoring hints: the prefix cache needs no key (every
    # prompt's prefix is cached), and the identifier is kept like ``user``.
    prompt_cache_key: str | None = Field(None, max_length=1024)
    safety_identifier: str | None = Field(None, max_length=1024)
    # Extensions (vLLM's names).
    top_k: Annotated[int, Field(ge=-1, le=MAX_INT32), NOT_A_BOOLEAN] | None = None
    min_p: Float = Field(0.0, ge=0, le=1)
    # Beyond this range the scaled float32 logits overflow (a penalty of 1e-297 is 0 in float32).
    repetition_penalty: Float = Field(1.0, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)
    ignore_eos: Bool = False
    stop_token_ids: list[TokenId] | None = None
    allowed_token_ids: list[TokenId] | None = Field(None, min_length=1)
    bad_words: list[Annotated[str, Field(min_length=1, max_length=MAX_BAD_WORD_CHARS)]] | None = Field(
        None, max_length=MAX_BAD_WORDS)
    skip_special_tokens: Bool = True
    spaces_between_special_tokens: Bool = True
    include_stop_str_in_output: Bool = False
    min_tokens: Int = Field(0, ge=0, le=MAX_INT64)
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, le=MAX_INT64), NOT_A_BOOLEAN] | None = None
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS), NOT_A_BOOLEAN] | None = None
    response_format: ResponseFormat | None = None
    # vLLM's StructuredOutputsParams as a mapping; checked by structured.py (naming its key).
    structured_outputs: dict[str, Any] | None = None
    # vLLM's earlier names for structured_outputs' kinds (Ray Serve LLM's clients still send them).
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM: the prompt's and the output's token ids in the response (``prompt_token_ids``,
    # ``token_ids``); streamed, the prompt's come once, in the first chunk, and each chunk has its
    # new output tokens.
    return_token_ids: Bool | None = None
    # vLLM: logprobs name each token "token_id:<id>" instead of its text.
    return_tokens_as_token_ids: Bool | None = None
    # vLLM: the request shares prefix-cache blocks only with requests of the same salt.
    cache_salt: str | None = Field(None, min_length=1, max_length=1024)
    # vLLM: the id of the request, returned as the response's id.
    request_id: str | None = Field(None, min_length=1, max_length=256)
    priority: Int = Field(0, ge=-MAX_INT32 - 1, le=MAX_INT32)
    # vLLM's beam search extension: n beams, the n best returned (temperature unset or 0);
    # early_stopping is transformers' rule (vLLM 0.x's field).
    use_beam_search: Bool = False
    length_penalty: Float = 1.0
    early_stopping: Bool | Literal["never"] = False

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, value):
        for key in value or ():
            if not (key.isascii() and key.isdigit()) or int(key) > MAX_INT32:
                raise ValueError(f"logit_bias keys must be token ids (non-negative integers), got {key!r}")
        return value

    @property
    def disables_any_whitespace(self) -> bool:
        """vLLM's ``guided_decoding_backend`` option ``disable-any-whitespace`` is set."""
        options = (self.guided_decoding_backend or "").partition(":")[2]
        return "disable-any-whitespace" in options.split(",")

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def streams_token_by_token(self) -> bool:
        """A stream of one event per token (``stream_options.token_by_token``)."""
        return bool(self.stream and self.stream_options and self.stream_options.token_by_token)

    @property
    def continuous_usage(self) -> bool:
        """Usage on every streamed chunk (vLLM's ``continuous_usage_stats``, with ``include_usage``)."""
        return bool(self.stream_options and self.stream_options.include_usage
                    and self.stream_options.continuous_usage_stats)


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``: a prompt (text or token ids), or a batch of them."""

    prompt: str | list[Int] | list[str] | list[list[Int]] = Field(
        description="text, token ids, or a batch of either; token ids must be in [0, vocab size)")
    # 0 only with echo: the prompt is scored, nothing generated (vLLM).
    max_tokens: Annotated[int, Field(ge=0, le=MAX_INT64), NOT_A_BOOLEAN] | None = None
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS), NOT_A_BOOLEAN] | None = None
    echo: Bool = False
    best_of: Annotated[int, Field(ge=1, le=MAX_INT32), NOT_A_BOOLEAN] | None = None
    suffix: str | None = None

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value):
        if value:
            raise ValueError("suffix is not supported")
        return value

    def prompts(self) -> list[str | list[int]]:
        """The prompts, as a list (one entry unless a batch was sent)."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if prompt and isinstance(prompt[0], int):
            return [prompt]
        return list(prompt)


class TextPart(_Request):
    type: Literal["text"]
    text: str


class FunctionCallIn(_Request):
    name: str
    arguments: str  # JSON text, as the API returned it


class ToolCallIn(_Request):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessageIn(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None             # a tool message answers this call
    # An assistant's earlier reasoning, as a reply returned it (vLLM's ``reasoning``, formerly
    # ``reasoning_content``); the template reads ``reasoning_content`` (Qwen3's does).
    reasoning: str | None = None
    reasoning_content: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content):
        """A part the model cannot read (an image, audio, a file) is refused by its kind, not
        with every way the part fails to be text."""
        for index, part in enumerate(content if isinstance(content, list) else ()):
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind != "text":
                reason = ("this server's models do not write refusals" if kind == "refusal"
                          else f"{TEXT_ONLY}, which read parts of type 'text'")
                raise ValueError(f"content[{index}] is of type {kind!r}: {reason}")
        return content

    @model_validator(mode="after")
    def _reasoning_of_an_assistant(self):
        reasoning = self.reasoning if self.reasoning is not None else self.reasoning_content
        if reasoning is not None and self.role != "assistant":
            raise ValueError(f"reasoning belongs to an assistant's message, not a {self.role}'s")
        if self.reasoning is not None and self.reasoning_content is not None \
                and self.reasoning != self.reasoning_content:
            raise ValueError("reasoning and reasoning_content differ; send one")
        self.reasoning = self.reasoning_content = reasoning
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionDefinition(_Request):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: Bool | None = None


class ToolDefinition(_Request):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"] = "function"
    function: NamedFunction


class _ToolSpecs:
    """``tool_specs``, for the requests whose ``tools`` the chat template renders (a mixin: the
    model declares ``tools``)."""

    @cached_property
    def tool_specs(self) -> list[dict[str, Any]]:
        """``tools`` as plain data (unset fields left out), dumped once per request."""
        return [tool.model_dump(exclude_none=True) for tool in self.tools or ()]


class ChatCompletionRequest(_ToolSpecs, _SamplingFields):
    """``POST /v1/chat/completions``: messages rendered with the tokenizer's chat template."""

    messages: list[ChatMessageIn] = Field(min_length=1)
    max_completion_tokens: Annotated[int, Field(ge=1, le=MAX_INT64), NOT_A_BOOLEAN] | None = None
    logprobs: Bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS), NOT_A_BOOLEAN] | None = None
    add_generation_prompt: Bool = True
    tools: list[ToolDefinition] | None = None
    # Default: "auto" with tools, "none" without (OpenAI's).
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: Bool = True
    # Extra variables for the chat template (vLLM), e.g. {"enable_thinking": false}.
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM: the last (assistant) message is continued rather than a new one started.
    continue_final_message: Bool = False
    # vLLM: the tokenizer's special tokens (BOS) on top of what the template writes.
    add_special_tokens: Bool = False

    # vLLM: with a reasoning parser, false leaves the reply's reasoning out of the response.
    include_reasoning: Bool = True
    # OpenAI's: the chat template's ``reasoning_effort`` (gpt-oss's, say); refused by a template
    # that does not read it.
    reasoning_effort: ReasoningEffort | None = None
    # vLLM's: documents for a retrieval template (Command R's, Granite's), as transformers'
    # apply_chat_template takes them; refused by a template that does not read ``documents``.
    documents: list[dict[str, str]] | None = None

    # vLLM: the last message's text starts the reply's content when it is the reply's own role
    # (an assistant message continued with continue_final_message, say).
    echo: Bool = False

    @field_validator("use_beam_search")
    @classmethod
    def _no_chat_beam_search(cls, value):
        if value:
            raise ValueError("use_beam_search cannot be honoured in chat completions; use /v1/completions "
                             "(or gRPC Generate) with use_beam_search")
        return value

    @property
    def effective_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def tool_choice_spec(self) -> str | dict[str, Any] | None:
        """``tool_choice`` as plain data: its string, or a named choice as a dict."""
        choice = self.tool_choice
        return choice.model_dump() if isinstance(choice, NamedToolChoice) else choice


class TokenizeCompletionRequest(_Request):
    """``POST /tokenize`` with a prompt (vLLM's): its token ids."""

    model: str | None = None
    prompt: str
    add_special_tokens: Bool = True
    return_token_strs: Bool | None = False


class TokenizeChatRequest(_ToolSpecs, _Request):
    """``POST /tokenize`` with messages (vLLM's): the token ids of the rendered chat template,
    as a chat completion of the same fields would see them."""

    model: str | None = None
    messages: list[ChatMessageIn] = Field(min_length=1)
    add_generation_prompt: Bool = True
    continue_final_message: Bool = False
    add_special_tokens: Bool = False
    return_token_strs: Bool | None = False
    tools: list[ToolDefinition] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # Passed to the template as a chat completion passes them (``ChatCompletionRequest``'s).
    reasoning_effort: ReasoningEffort | None = None
    documents: list[dict[str, str]] | None = None


class DetokenizeRequest(_Request):
    """``POST /detokenize`` (vLLM's): token ids to text."""

    model: str | None = None
    tokens: list[TokenId]


class LoadLoRAAdapterRequest(_Request):
    """``POST /v1/load_lora_adapter`` (vLLM's): serve the PEFT adapter at ``lora_path`` as
    ``lora_name``."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(_Request):
    """``POST /v1/unload_lora_adapter`` (vLLM's): stop serving ``lora_name`` (``lora_int_id``,
    when given, must be its id)."""

    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None


# ---- responses ------------------------------------------------------------------------
def _is_none(value: Any) -> bool:
    return value is None


def _omitted_if_none() -> Any:
    """A field that defaults to None and is left out of the serialised model while None
    (a stream delta's keys, as OpenAI sends them; vLLM's
    extensions where a request did not ask for them)."""
    return Field(default=None, exclude_if=_is_none)


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """One candidate at a prompt position (vLLM's ``prompt_logprobs`` entries, keyed by token id).
    ``rank`` is 1 for the most likely token; None where it is not known (a prompt token
    outside the top k)."""

    logprob: float
    rank: int | None = None
    decoded_token: str


PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    # vLLM's: the stop string or stop token id that ended the choice (None for EOS, a length
    # limit, or while it runs).
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None
    # vLLM's ``return_token_ids``: the choice's prompt and its output tokens (streamed: the
    # prompt's in the choice's first chunk, the output's new ones in every chunk).
    prompt_token_ids: list[int] | None = _omitted_if_none()
    token_ids: list[int] | None = _omitted_if_none()


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class FunctionCallOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    # A reasoning model's thinking (server.reasoning_parser): vLLM's ``reasoning``, and its
    # earlier name ``reasoning_content``, which clients still read.
    reasoning: str | None = _omitted_if_none()
    reasoning_content: str | None = _omitted_if_none()
    tool_calls: list[ToolCallOut] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None   # vLLM's, as in completions
    token_ids: list[int] | None = _omitted_if_none()   # vLLM's return_token_ids


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = _omitted_if_none()   # vLLM's return_token_ids


class DeltaFunctionCall(BaseModel):
    name: str | None = _omitted_if_none()
    arguments: str | None = _omitted_if_none()


class DeltaToolCall(BaseModel):
    """A piece of call ``index``: the first carries ``id``, ``type`` and the name."""

    index: int
    id: str | None = _omitted_if_none()
    type: Literal["function"] | None = _omitted_if_none()
    function: DeltaFunctionCall | None = _omitted_if_none()


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = _omitted_if_none()
    content: str | None = _omitted_if_none()
    reasoning: str | None = _omitted_if_none()
    reasoning_content: str | None = _omitted_if_none()
    tool_calls: list[DeltaToolCall] | None = _omitted_if_none()


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None   # vLLM's, on the choice's last chunk
    token_ids: list[int] | None = _omitted_if_none()   # vLLM's return_token_ids: the new ones


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None
    # vLLM: the prompt's logprobs, in the first chunk only (the key is absent elsewhere).
    prompt_logprobs: PromptLogprobs | None = _omitted_if_none()
    prompt_token_ids: list[int] | None = _omitted_if_none()   # vLLM's return_token_ids: the first chunk's


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None   # with return_token_strs: the tokenizer's token strings


class DetokenizeResponse(BaseModel):
    prompt: str


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedserve"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorInfo
