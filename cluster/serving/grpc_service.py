"""The gRPC transport (``protos/pagedserve.proto``) over the same ``Frontend`` as HTTP.

``Generate``/``GenerateStream`` take a prompt (or plain chat messages);
``Chat``/``ChatStream`` are ``/v1/chat/completions`` with tools, ``tool_choice``,
structured outputs and logprobs. Requests become the HTTP API's models and go
through the same serving code (``ServingCompletion.prepare``, ``ServingChat``),
so both APIs accept and reject the same things and answer alike. Failures set the gRPC status from the HTTP one:
400/413 INVALID_ARGUMENT, 401 UNAUTHENTICATED, 404 NOT_FOUND, 408 DEADLINE_EXCEEDED,
429 RESOURCE_EXHAUSTED, 503 UNAVAILABLE, anything else INTERNAL. Every RPC
checks the API key first; the per-client limit counts the caller's bearer
token, else its peer address.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator

import grpc
from google.protobuf.message import Message
from pydantic import ValidationError

from pagedserve.workers.lora.lora_request import LoRARequest
from pagedserve.workers.outputs.request_output import RequestOutput, SampleLogprobs

from ..protos import pagedserve_pb2 as pb
from .auth import client_key
from .errors import APIError, validation_error
from .frontend import Frontend, Generation, PromptInput
from .protocol import (ChatChoice, ChatCompletionRequest, ChatStreamChoice, ChoiceLogprobs, CompletionRequest,
                       PromptLogprobs, Usage)
from .serving_chat import ServingChat
from .serving_completion import ServingCompletion

STATUS_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,
    408: grpc.StatusCode.DEADLINE_EXCEEDED,
    413: grpc.StatusCode.INVALID_ARGUMENT,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
}

# Optional proto fields copied as-is into the request models when set.
_OPTIONAL_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "seed",
                    "presence_penalty", "frequency_penalty", "repetition_penalty")


def _json_field(text: str, name: str, kind: type = dict):
    """A field the proto carries as JSON text (an object, or an array with ``kind=list``)."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise APIError(400, f"{name} is not valid JSON: {exc}", param=name) from None
    if not isinstance(value, kind):
        raise APIError(400, f"{name} must be a JSON {'object' if kind is dict else 'array'}", param=name)
    return value


class GrpcRequestError(Exception):
    """Raised to Serve's gRPC proxy after the status code was set on the context."""


def _early_stopping(text: str) -> bool | str:
    """``GenerateRequest.early_stopping``: "" or "false", "true", "never" (other text: the
    request model's 400 names it)."""
    return {"": False, "false": False, "true": True}.get(text, text)


def _messages(messages) -> list[dict]:
    """The proto's chat messages as the HTTP API's (validated there)."""
    result = []
    for message in messages:
        entry: dict = {"role": message.role, "content": message.content}
        if message.name:
            entry["name"] = message.name
        if message.tool_call_id:
            entry["tool_call_id"] = message.tool_call_id
        if message.reasoning:
            entry["reasoning"] = message.reasoning
        if message.tool_calls:
            entry["tool_calls"] = [{"id": call.id, "type": "function",
                                    "function": {"name": call.name, "arguments": call.arguments}}
                                   for call in message.tool_calls]
        result.append(entry)
    return result


def _tools(tools) -> list[dict]:
    result = []
    for index, tool in enumerate(tools):
        function: dict = {"name": tool.name}
        if tool.description:
            function["description"] = tool.description
        if tool.parameters:
            function["parameters"] = _json_field(tool.parameters, f"tools.{index}.function.parameters")
        if tool.HasField("strict"):
            function["strict"] = tool.strict
        result.append({"type": "function", "function": function})
    return result


def _tool_choice(request: pb.ChatRequest):
    if not request.HasField("tool_choice"):
        return None
    kind = request.tool_choice.WhichOneof("choice")
    if kind == "function":
        return {"type": "function", "function": {"name": request.tool_choice.function}}
    return request.tool_choice.mode if kind == "mode" else None


class GrpcService:
    """``Generate``/``GenerateStream`` and ``Chat``/``ChatStream`` for one replica, over the
    same transport-neutral serving code as HTTP (``ServingCompletion``, ``ServingChat``)."""

    def __init__(self, server: Frontend) -> None:
        self.server = server
        self.completions = ServingCompletion(server)
        self.chats = ServingChat(server)

    # ---- request translation ------------------------------------------------------------------
    def _authenticate(self, grpc_context) -> str:
        """Check the API key; return the caller's client key."""
        metadata = dict(grpc_context.invocation_metadata() or ()) if grpc_context is not None else {}
        authorization = metadata.get("authorization")
        self.server.check_auth(authorization)
        peer = grpc_context.peer() if grpc_context is not None and hasattr(grpc_context, "peer") else None
        return client_key(authorization, peer)

    @staticmethod
    def _common_fields(request, optional: tuple[str, ...]) -> dict:
        """The fields ``GenerateRequest`` and ``ChatRequest`` share, as the HTTP API's."""
        fields = {name: getattr(request, name) for name in optional if request.HasField(name)}
        fields.update(stop=list(request.stop), ignore_eos=request.ignore_eos, priority=request.priority,
                      min_tokens=request.min_tokens, include_stop_str_in_output=request.include_stop_str_in_output)
        if request.cache_salt:
            fields["cache_salt"] = request.cache_salt
        for name in ("stop_token_ids", "allowed_token_ids", "bad_words"):
            if getattr(request, name):
                fields[name] = list(getattr(request, name))
        if request.logit_bias:
            fields["logit_bias"] = {str(token_id): bias for token_id, bias in request.logit_bias.items()}
        for name in ("structured_outputs", "response_format"):
            if getattr(request, name):
                fields[name] = _json_field(getattr(request, name), name)
        return fields

    def _prepare(self, request: pb.GenerateRequest | None, grpc_context, is_streamed: bool = False
                 ) -> tuple[str, PromptInput, object, int, str, LoRARequest | None]:
        client = self._authenticate(grpc_context)
        if request is None:  # see protos/servicer.py: the bytes were no GenerateRequest
            raise APIError(400, "the request is not a valid pagedserve.GenerateRequest message")
        self.server.resolve_model(request.model or None)   # 404 first, before the fields' checks
        num_sources = sum([bool(request.prompt), bool(request.prompt_token_ids), bool(request.messages)])
        if num_sources != 1:
            raise APIError(400, "set exactly one of prompt, prompt_token_ids and messages", param="prompt")
        fields = self._common_fields(request, _OPTIONAL_FIELDS + ("prompt_logprobs", "truncate_prompt_tokens",
                                                                  "length_penalty"))
        fields.update(use_beam_search=request.use_beam_search,
                      early_stopping=_early_stopping(request.early_stopping))
        if is_streamed and request.token_by_token:   # checked as the HTTP API's stream_options.token_by_token
            fields.update(stream=True, stream_options={"token_by_token": True})
        try:
            if request.messages:
                chat = ChatCompletionRequest(
                    model=request.model or None, messages=_messages(request.messages),
                    logprobs=request.HasField("logprobs"),
                    top_logprobs=request.logprobs if request.HasField("logprobs") else None, **fields)
            else:
                completion = CompletionRequest(
                    model=request.model or None, prompt=request.prompt or list(request.prompt_token_ids),
                    logprobs=request.logprobs if request.HasField("logprobs") else None, **fields)
        except ValidationError as exc:
            raise validation_error(exc) from None
        if request.messages:
            prompt, params, lora_request = self.chats.prepare(chat)
        else:
            if completion.max_tokens == 0:
                raise APIError(400, "max_tokens must be >= 1", param="max_tokens")
            [prompt], params, lora_request = self.completions.prepare(completion)
        return request.request_id, prompt, params, request.priority, client, lora_request

    def _chat_request(self, request: pb.ChatRequest | None, stream: bool) -> ChatCompletionRequest:
        """The HTTP API's request for a ``ChatRequest``: validated by the same model."""
        if request is None:  # see protos/servicer.py: the bytes were no ChatRequest
            raise APIError(400, "the request is not a valid pagedserve.ChatRequest message")
        fields = self._common_fields(request, _OPTIONAL_FIELDS + (
            "top_logprobs", "prompt_logprobs", "truncate_prompt_tokens", "parallel_tool_calls",
            "add_generation_prompt", "include_reasoning"))
        if request.chat_template_kwargs:
            fields["chat_template_kwargs"] = _json_field(request.chat_template_kwargs, "chat_template_kwargs")
        if request.reasoning_effort:
            fields["reasoning_effort"] = request.reasoning_effort
        if request.documents:
            fields["documents"] = _json_field(request.documents, "documents", list)
        if request.tools:
            fields["tools"] = _tools(request.tools)
        if stream:
            fields["stream_options"] = {"include_usage": True, "token_by_token": request.token_by_token}
        try:
            return ChatCompletionRequest(model=request.model or None, messages=_messages(request.messages),
                                         logprobs=request.logprobs, tool_choice=_tool_choice(request),
                                         stream=stream, **fields)
        except ValidationError as exc:
            raise validation_error(exc) from None

    # ---- responses --------------------------------------------------------------------------
    def _logprobs(self, samples: list[SampleLogprobs]) -> list[pb.TokenLogprob]:
        decode = self.server.token_text
        return [pb.TokenLogprob(token_id=s.token_id, token=decode(s.token_id), logprob=s.logprob,
                                top_logprobs=[pb.TopLogprob(token_id=t, token=decode(t), logprob=lp)
                                              for t, lp in s.top])
                for s in samples]

    def _prompt_logprobs(self, output: RequestOutput | None, prompt: PromptInput) -> list[pb.PromptTokenLogprob]:
        if output is None or output.prompt_logprobs is None:
            return []
        decode = self.server.token_text
        entries = []
        for token_id, sample in zip(prompt.token_ids, output.prompt_logprobs):
            entry = pb.PromptTokenLogprob(token_id=token_id, token=decode(token_id))
            if sample is not None:
                entry.logprob = sample.logprob
                entry.top_logprobs.extend(pb.TopLogprob(token_id=t, token=decode(t), logprob=lp)
                                          for t, lp in sample.top)
            entries.append(entry)
        return entries

    def _response(self, request_id: str, generation: Generation, choices: list[pb.Choice],
                  with_usage: bool) -> pb.GenerateResponse:
        response = pb.GenerateResponse(request_id=request_id, model=self.server.response_model(generation.lora_request),
                                       choices=choices)
        progress = generation.progress[0]
        if progress.first_token is not None:
            response.time_to_first_token_s = progress.first_token - progress.arrival
        if with_usage:
            usage = generation.usage()
            response.usage.CopyFrom(pb.Usage(
                prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                total_tokens=usage.total_tokens, cached_tokens=usage.prompt_tokens_details.cached_tokens))
        return response

    @staticmethod
    def _set_status(error: APIError, grpc_context) -> None:
        """The gRPC status of ``error`` on the context, for Serve's proxy (or grpc) to send."""
        grpc_context.set_code(STATUS_CODES.get(error.status, grpc.StatusCode.INTERNAL))
        grpc_context.set_details(error.message)

    def _fail(self, error: BaseException, grpc_context) -> Exception:
        """What a streamed RPC raises: for an ``APIError``, its status set on the context first."""
        if not isinstance(error, APIError) or grpc_context is None:
            return error
        self._set_status(error, grpc_context)
        return GrpcRequestError(error.message)

    def _refuse(self, error: APIError, grpc_context, empty: Message) -> Message:
        """What a unary RPC returns for ``error``: ``empty``, its status set on the context,
        which Serve's proxy sends as the call's status. Raising would also have Serve log the
        refusal as a failed request, with a traceback. Without a context, it raises."""
        if grpc_context is None:
            raise error
        self._set_status(error, grpc_context)
        return empty

    # ---- the RPCs ---------------------------------------------------------------------------
    async def _start(self, request: pb.GenerateRequest | None, grpc_context, is_streamed: bool
                     ) -> tuple[str, Generation, tuple | None]:
        """Check, admit and start the request: its reply id, its generation and the first output."""
        label, prompt, params, priority, client, lora_request = self._prepare(request, grpc_context, is_streamed)
        # The engine's id is always the server's own: a client's label may collide with another's.
        generation, first = await self.server.start_generation(
            f"grpc-{uuid.uuid4().hex}", [prompt], params, priority, client, is_streamed, lora_request,
            token_by_token=is_streamed and request.token_by_token)
        return label or f"grpc-{uuid.uuid4().hex}", generation, first

    async def generate(self, request: pb.GenerateRequest, grpc_context=None) -> pb.GenerateResponse:
        """Run to completion; the whole output per choice."""
        generation = None
        try:
            request_id, generation, first = await self._start(request, grpc_context, is_streamed=False)
            await generation.run_to_end(first)
            last = generation.progress[0].last
            choices = [pb.Choice(index=c.index, text=c.text, token_ids=c.token_ids,
                                 logprobs=self._logprobs(c.logprobs or []), finish_reason=c.finish_reason or "",
                                 **_stop_fields(c.stop_reason))
                       for c in sorted(last.outputs if last else [], key=lambda c: c.index)]
            response = self._response(request_id, generation, choices, with_usage=True)
            response.prompt_logprobs.extend(self._prompt_logprobs(last, generation.prompts[0]))
            return response
        except APIError as exc:
            return self._refuse(exc, grpc_context, pb.GenerateResponse())
        finally:
            if generation is not None:
                await generation.aclose()

    async def generate_stream(self, request: pb.GenerateRequest, grpc_context=None
                              ) -> AsyncIterator[pb.GenerateResponse]:
        """One message per engine step with output: what is new per choice; usage on the last."""
        generation = None
        try:
            request_id, generation, first = await self._start(request, grpc_context, is_streamed=True)
            if first is None:
                return
            item = first
            sent_prompt_logprobs = generation.params.prompt_logprobs is None
            while item is not None:
                _, output = item
                choices = self._delta_choices(output)
                if choices or output.finished:
                    response = self._response(request_id, generation, choices, with_usage=output.finished)
                    if not sent_prompt_logprobs and output.prompt_logprobs is not None:
                        response.prompt_logprobs.extend(self._prompt_logprobs(output, generation.prompts[0]))
                        sent_prompt_logprobs = True
                    yield response
                item = await anext(generation, None)
        except APIError as exc:
            raise self._fail(exc, grpc_context) from None
        finally:
            if generation is not None:
                await generation.aclose()

    async def chat(self, request: pb.ChatRequest | None, grpc_context=None) -> pb.ChatResponse:
        """``/v1/chat/completions`` run to completion: the whole message per choice."""
        try:
            client = self._authenticate(grpc_context)
            response = await self.chats.create_chat_completion(self._chat_request(request, stream=False), client)
            return self._chat_response(request.request_id or response.id, response.model, response.choices,
                                       response.usage, response.prompt_logprobs)
        except APIError as exc:
            return self._refuse(exc, grpc_context, pb.ChatResponse())

    async def chat_stream(self, request: pb.ChatRequest | None, grpc_context=None
                          ) -> AsyncIterator[pb.ChatResponse]:
        """``/v1/chat/completions`` streamed: one message per chunk (content and tool-call
        pieces, finish reasons); the last one carries the usage and no choices."""
        stream = None
        try:
            client = self._authenticate(grpc_context)
            stream = await self.chats.create_chat_completion(self._chat_request(request, stream=True), client)
            async for batch in stream.batches():
                for chunk in batch:
                    yield self._chat_response(request.request_id or chunk.id, chunk.model, chunk.choices, chunk.usage,
                                              chunk.prompt_logprobs)
        except APIError as exc:
            raise self._fail(exc, grpc_context) from None
        finally:
            if stream is not None:
                await stream.aclose()

    def _chat_response(self, request_id: str, model: str, choices: list[ChatChoice | ChatStreamChoice],
                       usage: Usage | None, prompt_logprobs: PromptLogprobs | None) -> pb.ChatResponse:
        response = pb.ChatResponse(request_id=request_id, model=model,
                                   choices=[_chat_choice(choice) for choice in choices])
        if usage is not None:
            response.usage.CopyFrom(pb.Usage(
                prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                total_tokens=usage.total_tokens, cached_tokens=usage.prompt_tokens_details.cached_tokens))
        for position in prompt_logprobs or []:
            response.prompt_logprobs.append(pb.PromptPosition(candidates=[
                pb.PromptCandidate(token_id=int(token_id), logprob=entry.logprob, rank=entry.rank,
                                   decoded_token=entry.decoded_token)
                for token_id, entry in (position or {}).items()]))
        return response

    def _delta_choices(self, output: RequestOutput) -> list[pb.Choice]:
        """What is new per choice in ``output``."""
        return [pb.Choice(index=c.index, text=c.delta_text, token_ids=c.delta_token_ids,
                          logprobs=self._logprobs(c.delta_logprobs or []), finish_reason=c.finish_reason or "",
                          **_stop_fields(c.stop_reason))
                for c in output.outputs if c.delta_token_ids or c.delta_text or c.is_newly_finished]


def _chat_logprobs(logprobs: ChoiceLogprobs | None) -> list[pb.ChatLogprob]:
    return [pb.ChatLogprob(token=entry.token, logprob=entry.logprob, bytes=bytes(entry.bytes or ()),
                           top_logprobs=[pb.ChatLogprob(token=top.token, logprob=top.logprob,
                                                        bytes=bytes(top.bytes or ()))
                                         for top in entry.top_logprobs])
            for entry in (logprobs.content or [] if logprobs is not None else [])]


def _stop_fields(stop_reason: str | int | None) -> dict:
    """vLLM's ``stop_reason`` as the messages carry it: a stop string or a stop token id."""
    if stop_reason is None:
        return {}
    return {"stop_string": stop_reason} if isinstance(stop_reason, str) else {"stop_token_id": stop_reason}


def _chat_choice(choice: ChatChoice | ChatStreamChoice) -> pb.ChatChoice:
    """A unary choice (``message``: whole calls) or a streamed one (``delta``: pieces)."""
    result = pb.ChatChoice(index=choice.index, finish_reason=choice.finish_reason or "",
                           logprobs=_chat_logprobs(choice.logprobs), **_stop_fields(choice.stop_reason))
    if isinstance(choice, ChatChoice):
        message = choice.message
        result.tool_calls.extend(pb.ToolCall(index=index, id=call.id, name=call.function.name,
                                             arguments=call.function.arguments)
                                 for index, call in enumerate(message.tool_calls))
    else:
        message = choice.delta
        for piece in message.tool_calls or []:
            function = piece.function
            result.tool_calls.append(pb.ToolCall(index=piece.index, id=piece.id or "",
                                                 name=function.name or "" if function else "",
                                                 arguments=function.arguments or "" if function else ""))
    if message.role:
        result.role = message.role
    if message.content is not None:
        result.content = message.content
    if message.reasoning is not None:
        result.reasoning = message.reasoning
    return result


__all__ = ["GrpcService", "STATUS_CODES"]
