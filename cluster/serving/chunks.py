"""A streamed response's chunks, made two ways from the same calls.

``serving_completion`` and ``serving_chat`` describe each chunk of a stream by
calling its encoder (``choice``, ``usage``); the encoder makes it:

* ``CompletionChunkModels`` / ``ChatChunkModels``: the API's chunk models
  (``CompletionResponse``, ``ChatCompletionChunk``), for gRPC;
* ``CompletionChunkJSON`` / ``ChatChunkJSON``: those models' JSON text
  (``model_dump_json``, byte for byte) without a model per chunk, for SSE. What
  never changes in a stream (id, object, created, model) is rendered once; a
  content chunk is one f-string around its json-escaped text. Rare, nested
  values (logprobs, tool calls, usage) are rendered by their own models.
"""

from __future__ import annotations

from json.encoder import encode_basestring as _json_str  # as pydantic writes strings: non-ASCII kept

from pydantic import TypeAdapter

from .protocol import (ChatCompletionChunk, ChatStreamChoice, ChoiceLogprobs, CompletionChoice,
                       CompletionLogprobs, CompletionResponse, DeltaMessage, DeltaToolCall, PromptLogprobs,
                       Usage)

_PROMPT_LOGPROBS = TypeAdapter(PromptLogprobs)


def _ids(token_ids: list[int]) -> str:
    return f"[{','.join(map(str, token_ids))}]"


def _stop_reason(stop_reason: int | str | None) -> str:
    if stop_reason is None:
        return "null"
    return _json_str(stop_reason) if isinstance(stop_reason, str) else str(int(stop_reason))


class CompletionChunkModels:
    """One ``/v1/completions`` stream's chunks as ``CompletionResponse`` models (one choice each)."""

    def __init__(self, request_id: str, created: int, model: str) -> None:
        self.request_id = request_id
        self.created = created
        self.model = model

    def choice(self, index: int, text: str, finish_reason: str | None = None, stop_reason: int | str | None = None,
               logprobs: CompletionLogprobs | None = None, prompt_logprobs: PromptLogprobs | None = None,
               token_ids: list[int] | None = None, prompt_token_ids: list[int] | None = None,
               usage: Usage | None = None) -> CompletionResponse:
        """A chunk of choice ``index``; ``token_ids``/``prompt_token_ids`` None leave their keys out."""
        choice = CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=finish_reason,
                                  stop_reason=stop_reason, prompt_logprobs=prompt_logprobs,
                                  prompt_token_ids=prompt_token_ids, token_ids=token_ids)
        return CompletionResponse(id=self.request_id, created=self.created, model=self.model, choices=[choice],
                                  usage=usage)

    def usage(self, usage: Usage) -> CompletionResponse:
        """The stream's usage chunk (no choices)."""
        return CompletionResponse(id=self.request_id, created=self.created, model=self.model, choices=[],
                                  usage=usage)


class CompletionChunkJSON:
    """The JSON text of ``CompletionChunkModels``' chunks, built without them."""

    def __init__(self, request_id: str, created: int, model: str) -> None:
        self._head = (f'{{"id":{_json_str(request_id)},"object":"text_completion","created":{int(created)},'
                      f'"model":{_json_str(model)},"choices":')

    def choice(self, index: int, text: str, finish_reason: str | None = None, stop_reason: int | str | None = None,
               logprobs: CompletionLogprobs | None = None, prompt_logprobs: PromptLogprobs | None = None,
               token_ids: list[int] | None = None, prompt_token_ids: list[int] | None = None,
               usage: Usage | None = None) -> str:
        """``CompletionChunkModels.choice(...).model_dump_json()``."""
        json = (f'{self._head}[{{"index":{index},"text":{_json_str(text)},'
                f'"logprobs":{"null" if logprobs is None else logprobs.model_dump_json()},'
                f'"finish_reason":{"null" if finish_reason is None else _json_str(finish_reason)},'
                f'"stop_reason":{_stop_reason(stop_reason)},"prompt_logprobs":'
                f'{"null" if prompt_logprobs is None else _PROMPT_LOGPROBS.dump_json(prompt_logprobs).decode()}')
        if prompt_token_ids is not None:
            json += f',"prompt_token_ids":{_ids(prompt_token_ids)}'
        if token_ids is not None:
            json += f',"token_ids":{_ids(token_ids)}'
        return f'{json}}}],"usage":{"null" if usage is None else usage.model_dump_json()}}}'

    def usage(self, usage: Usage) -> str:
        """``CompletionChunkModels.usage(usage).model_dump_json()``."""
        return f'{self._head}[],"usage":{usage.model_dump_json()}}}'


class ChatChunkModels:
    """One ``/v1/chat/completions`` stream's chunks as ``ChatCompletionChunk`` models (one choice each)."""

    def __init__(self, request_id: str, created: int, model: str) -> None:
        self.request_id = request_id
        self.created = created
        self.model = model

    def choice(self, index: int, content: str | None = None, role: str | None = None,
               tool_calls: list[DeltaToolCall] | None = None, logprobs: ChoiceLogprobs | None = None,
               finish_reason: str | None = None, stop_reason: int | str | None = None,
               token_ids: list[int] | None = None, usage: Usage | None = None,
               prompt_logprobs: PromptLogprobs | None = None,
               prompt_token_ids: list[int] | None = None, reasoning: str | None = None) -> ChatCompletionChunk:
        """A chunk of choice ``index`` whose delta has ``role``, ``content``, ``reasoning`` (as
        ``reasoning`` and ``reasoning_content``) and ``tool_calls`` (each left out while None);
        ``token_ids``, ``prompt_logprobs`` and ``prompt_token_ids`` None leave their keys out."""
        delta = DeltaMessage(role=role, content=content, reasoning=reasoning, reasoning_content=reasoning,
                             tool_calls=tool_calls)
        choice = ChatStreamChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=finish_reason,
                                  stop_reason=stop_reason, token_ids=token_ids)
        return ChatCompletionChunk(id=self.request_id, created=self.created, model=self.model, choices=[choice],
                                   usage=usage, prompt_logprobs=prompt_logprobs, prompt_token_ids=prompt_token_ids)

    def usage(self, usage: Usage) -> ChatCompletionChunk:
        """The stream's usage chunk (no choices)."""
        return ChatCompletionChunk(id=self.request_id, created=self.created, model=self.model, choices=[],
                                   usage=usage)


class ChatChunkJSON:
    """The JSON text of ``ChatChunkModels``' chunks, built without them."""

    def __init__(self, request_id: str, created: int, model: str) -> None:
        self._head = (f'{{"id":{_json_str(request_id)},"object":"chat.completion.chunk","created":{int(created)},'
                      f'"model":{_json_str(model)},"choices":')

    def choice(self, index: int, content: str | None = None, role: str | None = None,
               tool_calls: list[DeltaToolCall] | None = None, logprobs: ChoiceLogprobs | None = None,
               finish_reason: str | None = None, stop_reason: int | str | None = None,
               token_ids: list[int] | None = None, usage: Usage | None = None,
               prompt_logprobs: PromptLogprobs | None = None, prompt_token_ids: list[int] | None = None,
               reasoning: str | None = None) -> str:
        """``ChatChunkModels.choice(...).model_dump_json()``."""
        if role is None and tool_calls is None and reasoning is None:  # the content chunk
            delta = "" if content is None else f'"content":{_json_str(content)}'
        else:
            fields = []
            if role is not None:
                fields.append(f'"role":{_json_str(role)}')
            if content is not None:
                fields.append(f'"content":{_json_str(content)}')
            if reasoning is not None:
                text = _json_str(reasoning)
                fields.append(f'"reasoning":{text},"reasoning_content":{text}')
            if tool_calls is not None:
                fields.append(f'"tool_calls":[{",".join(call.model_dump_json() for call in tool_calls)}]')
            delta = ",".join(fields)
        json = (f'{self._head}[{{"index":{index},"delta":{{{delta}}},'
                f'"logprobs":{"null" if logprobs is None else logprobs.model_dump_json()},'
                f'"finish_reason":{"null" if finish_reason is None else _json_str(finish_reason)},'
                f'"stop_reason":{_stop_reason(stop_reason)}')
        if token_ids is not None:
            json += f',"token_ids":{_ids(token_ids)}'
        json += f'}}],"usage":{"null" if usage is None else usage.model_dump_json()}'
        if prompt_logprobs is not None:
            json += f',"prompt_logprobs":{_PROMPT_LOGPROBS.dump_json(prompt_logprobs).decode()}'
        if prompt_token_ids is not None:
            json += f',"prompt_token_ids":{_ids(prompt_token_ids)}'
        return json + "}"

    def usage(self, usage: Usage) -> str:
        """``ChatChunkModels.usage(usage).model_dump_json()``."""
        return f'{self._head}[],"usage":{usage.model_dump_json()}}}'
