"""Request and response bodies of the OpenAI-compatible HTTP API (pydantic).

Requests reject unknown fields, so a misspelt option is a 400 naming the
field rather than silently ignored; numbers must be finite and integers
within 64 bits (``priority``, token ids: 32). Besides OpenAI's fields, requests take
vLLM's extra sampling fields (``top_k``, ``min_p``, ``repetition_penalty``,
``ignore_eos``, ``stop_token_ids``, ``skip_special_tokens``) and ``priority``.
"""

from __future__ import annotations

import time
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from pagedserve.workers.sampling_params import (
    MAX_LOGPROBS,
    MAX_REPETITION_PENALTY,
    MIN_REPETITION_PENALTY,
)

DEFAULT_MAX_TOKENS = 16
MAX_INT32 = 2**31 - 1
MAX_INT64 = 2**63 - 1

TokenId = Annotated[int, Field(ge=0, le=MAX_INT32)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class StreamOptions(_Request):
    include_usage: bool = False


class _SamplingFields(_Request):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1, le=MAX_INT64)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=MAX_INT32)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-MAX_INT64 - 1, le=MAX_INT64)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # Extensions (vLLM's names).
    top_k: int | None = Field(None, ge=-1, le=MAX_INT32)
    min_p: float = Field(0.0, ge=0, le=1)
    # Beyond this range the scaled float32 logits overflow (a penalty of 1e-297 is 0 in float32).
    repetition_penalty: float = Field(1.0, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    skip_special_tokens: bool = True
    priority: int = Field(0, ge=-MAX_INT32 - 1, le=MAX_INT32)

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, value):
        if value:
            raise ValueError("logit_bias is not supported")
        return value

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``: a prompt (text or token ids), or a batch of them."""

    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        description="text, token ids, or a batch of either; token ids must be in [0, vocab size)")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = Field(None, ge=1, le=MAX_INT32)
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


class ChatMessageIn(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``: messages rendered with the tokenizer's chat template."""

    messages: list[ChatMessageIn] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_INT64)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True

    @property
    def effective_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


# ---- responses ------------------------------------------------------------------------
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


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


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


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedserve"
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
