"""``POST /v1/chat/completions``: OpenAI chat responses and their SSE stream over
the frontend (messages through the chat template; ``logprobs`` + ``top_logprobs``
with raw token ``bytes``; vLLM's ``prompt_logprobs`` at the response's top level).

Tool calling: the request's ``tools`` are rendered by the chat template. With
``tool_choice`` "required" or a named function the output is constrained to
the tools' parameter schemas (``structured.py``) and parsed by the matching
parser; with "auto" (the default when tools are given) the model's own
format is parsed by the server's ``tool_call_parser`` (hermes, llama3_json);
"none" parses nothing. Parsed calls become ``message.tool_calls`` with
``finish_reason: "tool_calls"``; streamed, they arrive as OpenAI's
``delta.tool_calls`` pieces (id, type and name first, then argument text).
An output cut off by ``max_tokens`` inside a call returns, as vLLM does, the
calls it started with the arguments written so far, and ``finish_reason:
"length"``; the constrained formats' wrapper never reaches ``content``.

Transport-neutral: the response is a ``ChatCompletionResponse``, or, when
streaming, a ``ChunkStream`` of ``ChatCompletionChunk`` or of their JSON text
(``chunks``); HTTP frames the text as server-sent events, gRPC the models as
``ChatResponse`` messages.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from pagedserve.tool_parsers import ParserDelta, ToolParser, constrained_parser, get_tool_parser
from pagedserve.workers.lora.lora_request import LoRARequest
from pagedserve.workers.outputs.request_output import CompletionOutput, RequestOutput
from pagedserve.workers.sample.sampling_params import SamplingParams

from .chunks import ChatChunkJSON, ChatChunkModels
from .errors import APIError
from .frontend import Frontend, Generation, PromptInput
from .logprobs import LogprobFormatter
from .protocol import (ChatChoice, ChatCompletionRequest, ChatCompletionResponse, ChatMessageOut, ChoiceLogprobs,
                       DeltaFunctionCall, DeltaToolCall, FunctionCallOut, ToolCallOut)
from .streaming import ChunkStream, generation_batches
from .structured import output_constraint


@dataclass
class _Cursor:
    """What was already sent for one choice of a streamed response."""

    parser: ToolParser | None
    is_started: bool = False
    is_finished: bool = False


class ServingChat:
    """Answers chat completion requests for one ``Frontend``."""

    def __init__(self, frontend: Frontend) -> None:
        self.frontend = frontend
        self.logprobs = LogprobFormatter(frontend.tokenizer)
        self.tool_parser = get_tool_parser(frontend.config.tool_call_parser)

    def output_parser(self, request: ChatCompletionRequest) -> ToolParser | None:
        """A fresh parser for one output, or None when tool calls are not parsed."""
        tool_choice = request.tool_choice
        if not request.tools or tool_choice == "none":
            return None
        if tool_choice is None or tool_choice == "auto":
            return self.tool_parser()
        return constrained_parser(tool_choice if isinstance(tool_choice, str) else tool_choice.model_dump())

    def _chat_logprobs(self, request: ChatCompletionRequest, samples) -> ChoiceLogprobs:
        return self.logprobs.chat(samples or [], bool(request.return_tokens_as_token_ids))

    def prepare(self, request: ChatCompletionRequest, max_tokens_param: str | None = None
                ) -> tuple[PromptInput, SamplingParams, LoRARequest | None]:
        """Check ``request`` and build its prompt, sampling params and the LoRA adapter its
        ``model`` names (``APIError`` naming what is wrong); what both transports (and the
        Responses API, whose name for the token limit is ``max_tokens_param``) run before a chat
        completion starts."""
        frontend = self.frontend
        lora_request = frontend.resolve_model(request.model)
        if request.tool_choice not in (None, "none") and not request.tools:
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        constraint = output_constraint(request)
        prompt = frontend.chat_prompt(request)
        if request.top_logprobs is not None and not request.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        stated = request.effective_max_tokens
        frontend.check_output_fits([prompt], stated, request.min_tokens, max_tokens_param or (
            "max_completion_tokens" if request.max_completion_tokens else "max_tokens"))
        room = frontend.max_model_len - len(prompt.token_ids)
        max_tokens = stated or min(room, frontend.sampling_defaults.get("max_tokens", room))
        params = frontend.sampling_params(request, max_tokens, logprobs, constraint, request.prompt_logprobs)
        return prompt, params, lora_request

    async def create_chat_completion(self, request: ChatCompletionRequest, client: str = ""
                                     ) -> ChatCompletionResponse | ChunkStream:
        """The response body, or a ``ChunkStream`` of ``ChatCompletionChunk`` when ``stream`` is set."""
        frontend = self.frontend
        prompt, params, lora_request = self.prepare(request)
        # The engine's ids are always the server's own (clients' ids may collide); vLLM's
        # request_id names the response.
        engine_id = f"chatcmpl-{uuid.uuid4().hex}"
        request_id = request.request_id or engine_id
        generation, first = await frontend.start_generation(engine_id, [prompt], params, request.priority, client,
                                                            is_streamed=bool(request.stream),
                                                            lora_request=lora_request,
                                                            token_by_token=request.streams_token_by_token)
        if request.stream:
            return ChunkStream(lambda as_json: self._stream_chat(request, request_id, generation, first, as_json),
                               generation)
        await generation.run_to_end(first)
        last = generation.progress[0].last
        echo = self._echo(request)
        choices = [self._choice(request, c, echo) for c in (last.outputs if last else [])]
        choices.sort(key=lambda c: c.index)
        prompt_logprobs = None
        if request.prompt_logprobs is not None and last is not None and last.prompt_logprobs is not None:
            prompt_logprobs = self.logprobs.prompt(last.prompt_logprobs[:len(prompt.token_ids)])
        return ChatCompletionResponse(id=request_id, model=frontend.response_model(lora_request), choices=choices,
                                      usage=generation.usage(), prompt_logprobs=prompt_logprobs,
                                      prompt_token_ids=prompt.token_ids if request.return_token_ids else None)

    @staticmethod
    def _echo(request: ChatCompletionRequest) -> str:
        """vLLM's chat ``echo``: the last message's text, if it is the reply's own role (the
        assistant's, or with no generation prompt the last message's)."""
        if not request.echo:
            return ""
        last = request.messages[-1]
        role = "assistant" if request.add_generation_prompt else last.role
        return last.text() if last.role == role else ""

    def _choice(self, request: ChatCompletionRequest, completion: CompletionOutput, echo: str = "") -> ChatChoice:
        content, calls, finish_reason = completion.text, [], completion.finish_reason
        parser = self.output_parser(request)
        if parser is not None:
            parsed = parser.parse(completion.text, is_cut_off=finish_reason == "length")
            content = parsed.content
            calls = [ToolCallOut(id=c.id, function=FunctionCallOut(name=c.name, arguments=c.arguments))
                     for c in parsed.tool_calls]
            if calls and finish_reason == "stop":
                finish_reason = "tool_calls"
        if echo:
            content = echo + (content or "")
        return ChatChoice(index=completion.index, message=ChatMessageOut(content=content, tool_calls=calls),
                          logprobs=self._chat_logprobs(request, completion.logprobs) if request.logprobs else None,
                          finish_reason=finish_reason, stop_reason=completion.stop_reason,
                          token_ids=completion.token_ids if request.return_token_ids else None)

    def _stream_chat(self, request: ChatCompletionRequest, request_id: str, generation: Generation, first,
                     as_json: bool) -> AsyncIterator[list]:
        """The stream's chunks, one list per output (``ChunkStream.batches``)."""
        cursors: dict[int, _Cursor] = {}
        encoder = (ChatChunkJSON if as_json else ChatChunkModels)(
            request_id, int(time.time()), self.frontend.response_model(generation.lora_request))
        echo = self._echo(request)
        has_logprobs = request.logprobs
        has_token_ids = request.return_token_ids
        is_continuous_usage = request.continuous_usage

        def chunks(_: int, output: RequestOutput) -> list:
            batch = []
            usage = generation.usage() if is_continuous_usage else None
            for completion in output.outputs:
                index = completion.index
                cursor = cursors.get(index)
                if cursor is None:
                    cursor = cursors[index] = _Cursor(self.output_parser(request))
                if cursor.is_finished:
                    continue
                if not cursor.is_started:
                    cursor.is_started = True
                    prompt_logprobs = None
                    if request.prompt_logprobs is not None and output.prompt_logprobs is not None:
                        prompt_logprobs = self.logprobs.prompt(output.prompt_logprobs[:len(output.prompt_token_ids)])
                    batch.append(encoder.choice(index, "", role="assistant", usage=usage,
                                                prompt_logprobs=prompt_logprobs,
                                                prompt_token_ids=output.prompt_token_ids if has_token_ids else None))
                    if echo:
                        batch.append(encoder.choice(index, echo, usage=usage))
                logprobs = self._chat_logprobs(request, completion.delta_logprobs) if has_logprobs else None
                cursor.is_finished = completion.finish_reason is not None
                content, tool_calls = self._delta(cursor, completion.delta_text)
                # The new tokens go out even while a tool parser or a stop string holds their text back.
                token_ids = completion.delta_token_ids if has_token_ids else None
                if content or tool_calls or (logprobs and logprobs.content) or token_ids:
                    batch.append(encoder.choice(index, content, tool_calls=tool_calls, logprobs=logprobs,
                                                token_ids=token_ids, usage=usage))
                if cursor.is_finished:
                    if cursor.parser is not None:
                        content, tool_calls = self._delta(cursor, None)
                        if content or tool_calls:
                            batch.append(encoder.choice(index, content, tool_calls=tool_calls, usage=usage))
                    finish_reason = completion.finish_reason
                    if cursor.parser is not None and cursor.parser.tool_calls and finish_reason == "stop":
                        finish_reason = "tool_calls"
                    batch.append(encoder.choice(index, finish_reason=finish_reason,
                                                stop_reason=completion.stop_reason, usage=usage))
            return batch

        def usage() -> list:
            return [encoder.usage(generation.usage())] if request.include_usage else []

        return generation_batches(generation, first, chunks, usage)

    @staticmethod
    def _delta(cursor: _Cursor, text: str | None) -> tuple[str | None, list[DeltaToolCall] | None]:
        """The delta's content and tool call pieces for ``text`` (None: the output ended),
        through the choice's tool parser if any; None where there are none."""
        if cursor.parser is None:
            return text or None, None
        parsed: ParserDelta = cursor.parser.feed(text) if text is not None else cursor.parser.finish()
        calls = []
        for piece in parsed.tool_calls:
            function = DeltaFunctionCall(name=piece.name, arguments=piece.arguments or None)
            calls.append(DeltaToolCall(index=piece.index, id=piece.id, type="function" if piece.id else None,
                                       function=function if (piece.name or piece.arguments) else None))
        return parsed.content or None, calls or None
