"""``POST /v1/chat/completions``: OpenAI chat responses and their SSE stream over
the frontend (messages through the chat template; ``logprobs`` + ``top_logprobs``
with raw token ``bytes``; vLLM's ``prompt_logprobs`` at the response's top level).

Tool calling: the request's ``tools`` are rendered by the chat template. With
``tool_choice`` "required" or a named function the output is constrained to
the tools' parameter schemas (``structured.py``) and parsed by the matching
parser, or, where the reasoning parser's format has calls of its own (gpt-oss's
harmony), to one call in that form (``ToolParser.call_constraint``); with
"auto" (the default when tools are given) the model's own format is parsed by
the server's ``tool_call_parser`` (hermes, llama3_json, openai); "none" parses
nothing. Parsed calls become ``message.tool_calls`` with
``finish_reason: "tool_calls"``; streamed, they arrive as OpenAI's
``delta.tool_calls`` pieces (id, type and name first, then argument text).
An output cut off by ``max_tokens`` inside a call returns, as vLLM does, the
calls it started with the arguments written so far, and ``finish_reason:
"length"``; the constrained formats' wrapper never reaches ``content``.

Reasoning: with ``server.reasoning_parser`` a reasoning model's thinking is split from its
answer (``pagedserve.reasoning_parsers``) into ``message.reasoning`` (and vLLM's earlier
``reasoning_content``), streamed as ``delta.reasoning`` pieces before the content; tool calls
are read from the answer alone. ``include_reasoning: false`` leaves the reasoning out. A
constrained output (``response_format``, ``structured_outputs``, ``tool_choice`` "required" or
named) of a reply that starts in the reasoning holds after the parser's end tag
(``StructuredOutputsParams.reasoning_end``): the thinking stays free.

Transport-neutral: the response is a ``ChatCompletionResponse``, or, when
streaming, a ``ChunkStream`` of ``ChatCompletionChunk`` or of their JSON text
(``chunks``); HTTP frames the text as server-sent events, gRPC the models as
``ChatResponse`` messages.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from pagedserve.reasoning_parsers import ReasoningParser, get_reasoning_parser
from pagedserve.tool_parsers import (ParserDelta, ToolParser, constrained_parser, function_name, get_tool_parser,
                                    tools_by_name)
from pagedserve.workers.lora.lora_request import LoRARequest
from pagedserve.workers.outputs.request_output import CompletionOutput, RequestOutput
from pagedserve.workers.sample.sampling_params import SamplingParams, StructuredOutputsParams

from .chunks import ChatChunkJSON, ChatChunkModels
from .errors import APIError
from .frontend import Frontend, Generation, PromptInput
from .logprobs import LogprobFormatter
from .protocol import (ChatChoice, ChatCompletionRequest, ChatCompletionResponse, ChatMessageOut, ChoiceLogprobs,
                       DeltaFunctionCall, DeltaToolCall, FunctionCallOut, ToolCallOut)
from .streaming import ChunkStream, generation_batches
from .structured import constraint_and_field


@dataclass
class _Cursor:
    """What was already sent for one choice of a streamed response."""

    parser: ToolParser | None
    reasoning: ReasoningParser | None
    is_started: bool = False
    is_finished: bool = False


class ServingChat:
    """Answers chat completion requests for one ``Frontend``."""

    def __init__(self, frontend: Frontend) -> None:
        self.frontend = frontend
        self.logprobs = LogprobFormatter(frontend.tokenizer)
        self.tool_parser = get_tool_parser(frontend.config.tool_call_parser)
        name = frontend.config.reasoning_parser
        self.reasoning_parser_class = get_reasoning_parser(name) if name is not None else None

    def output_parser(self, request: ChatCompletionRequest, reasoning: ReasoningParser | None) -> ToolParser | None:
        """A fresh parser for one output whose reply ``reasoning`` reads, or None when tool calls are
        not parsed."""
        tool_choice = request.tool_choice
        if not request.tools or tool_choice == "none":
            return None
        if tool_choice is None or tool_choice == "auto":
            return self.tool_parser()
        native = self._native_tool_parser(reasoning)
        if native is not None:
            return native()
        return constrained_parser(request.tool_choice_spec)

    @staticmethod
    def _native_tool_parser(reasoning: ReasoningParser | None) -> type[ToolParser] | None:
        """The tool-call parser of the format ``reasoning`` reads, where a constrained reply makes
        its calls in that format (gpt-oss's harmony: after its reasoning messages)."""
        if reasoning is None or reasoning.tool_call_parser is None or not reasoning.constrains_after_end:
            return None
        parser = get_tool_parser(reasoning.tool_call_parser)
        return parser if parser.call_constraint is not None else None

    def reasoning_parser(self, prompt_text: str | None) -> ReasoningParser | None:
        """A fresh reasoning parser for one reply to ``prompt_text``, or None: no parser is set,
        or the prompt has closed the reasoning (Qwen3's template with ``enable_thinking: false``)."""
        parser_class = self.reasoning_parser_class
        if parser_class is None or not parser_class.starts_in_reasoning(prompt_text):
            return None
        return parser_class(prompt_text)

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
        constraint, constrained_field = constraint_and_field(request)
        prompt = frontend.chat_prompt(request)
        reasoning_parser = self.reasoning_parser(prompt.text)
        if reasoning_parser is not None:
            self._check_tools_of_the_format(request, reasoning_parser)
            constraint = self._after_reasoning(reasoning_parser, constraint, constrained_field)
            native = self._native_tool_parser(reasoning_parser)
            if constrained_field == "tool_choice" and native is not None:   # the format's own form
                name = function_name(request.tool_choice_spec)
                tools = tools_by_name(request.tool_specs)
                try:
                    constraint = native.call_constraint(tools, name)
                except ValueError as exc:   # the calls' grammar over the size limit
                    raise APIError(400, f"tools: {exc}", param="tools") from None
        if request.top_logprobs is not None and not request.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        stated = request.effective_max_tokens
        frontend.check_output_fits([prompt], stated, request.min_tokens, max_tokens_param or (
            "max_completion_tokens" if request.max_completion_tokens else "max_tokens"))
        room = frontend.max_model_len - len(prompt.token_ids)
        max_tokens = stated or min(room, frontend.sampling_defaults.get("max_tokens", room))
        params = frontend.sampling_params(request, max_tokens, logprobs, constraint, request.prompt_logprobs)
        if reasoning_parser is not None and reasoning_parser.reads_special_tokens:
            params.skip_special_tokens = params.spaces_between_special_tokens = False
        return prompt, params, lora_request

    def _check_tools_of_the_format(self, request: ChatCompletionRequest, parser: ReasoningParser) -> None:
        """400 where "auto" tool calls would be read by a parser that cannot read the calls ``parser``
        passes on (gpt-oss's harmony needs tool_call_parser "openai")."""
        needed = parser.tool_call_parser
        config = self.frontend.config
        if (needed is not None and request.tools and request.tool_choice in (None, "auto")
                and config.tool_call_parser != needed):
            raise APIError(400, f"tools with tool_choice \"auto\" need server.tool_call_parser {needed!r} with "
                                f"server.reasoning_parser {config.reasoning_parser!r}: the calls are in a form of "
                                "their own", param="tools")

    def _after_reasoning(self, parser: ReasoningParser, constraint: StructuredOutputsParams | None,
                         field: str | None) -> StructuredOutputsParams | None:
        """``constraint`` for a reply that starts in the reasoning: it holds after the reasoning (vLLM's
        way), the thinking staying free; 400 where ``parser``'s format cannot be held so."""
        if constraint is None:
            return None
        if not parser.constrains_after_end:
            raise APIError(400, f"{field} cannot be honoured where the prompt opened a message of "
                                f"server.reasoning_parser {self.frontend.config.reasoning_parser!r}'s format: "
                                "the grammar starts at a message's header", param=field)
        return dataclasses.replace(constraint, reasoning_end=parser.end_tag)

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
            return ChunkStream(lambda as_json: self._stream_chat(request, request_id, generation, first, prompt.text,
                                                                 as_json),
                               generation)
        await generation.run_to_end(first)
        last = generation.progress[0].last
        echo = self._echo(request)
        choices = [self._choice(request, c, prompt.text, echo) for c in (last.outputs if last else [])]
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

    def _choice(self, request: ChatCompletionRequest, completion: CompletionOutput, prompt_text: str | None,
                echo: str = "") -> ChatChoice:
        content, calls, finish_reason, reasoning = completion.text, [], completion.finish_reason, None
        reasoning_parser = self.reasoning_parser(prompt_text)
        if reasoning_parser is not None:
            reasoning, content = reasoning_parser.parse(content)
            if not request.include_reasoning:
                reasoning = None
        parser = self.output_parser(request, reasoning_parser)
        if parser is not None:
            parsed = parser.parse(content or "", is_cut_off=finish_reason == "length")
            content = parsed.content
            calls = [ToolCallOut(id=c.id, function=FunctionCallOut(name=c.name, arguments=c.arguments))
                     for c in parsed.tool_calls]
            if calls and finish_reason == "stop":
                finish_reason = "tool_calls"
        if echo:
            content = echo + (content or "")
        message = ChatMessageOut(content=content, reasoning=reasoning, reasoning_content=reasoning, tool_calls=calls)
        return ChatChoice(index=completion.index, message=message,
                          logprobs=self._chat_logprobs(request, completion.logprobs) if request.logprobs else None,
                          finish_reason=finish_reason, stop_reason=completion.stop_reason,
                          token_ids=completion.token_ids if request.return_token_ids else None)

    def _stream_chat(self, request: ChatCompletionRequest, request_id: str, generation: Generation, first,
                     prompt_text: str | None, as_json: bool) -> AsyncIterator[list]:
        """The stream's chunks, one list per output (``ChunkStream.batches``)."""
        cursors: dict[int, _Cursor] = {}
        encoder = (ChatChunkJSON if as_json else ChatChunkModels)(
            request_id, int(time.time()), self.frontend.response_model(generation.lora_request))
        echo = self._echo(request)
        has_logprobs = request.logprobs
        has_token_ids = request.return_token_ids
        is_continuous_usage = request.continuous_usage
        include_reasoning = request.include_reasoning

        def chunks(_: int, output: RequestOutput) -> list:
            batch = []
            usage = generation.usage() if is_continuous_usage else None
            for completion in output.outputs:
                index = completion.index
                cursor = cursors.get(index)
                if cursor is None:
                    reasoning = self.reasoning_parser(prompt_text)
                    cursor = cursors[index] = _Cursor(self.output_parser(request, reasoning), reasoning)
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
                reasoning, content, tool_calls = self._delta(cursor, completion.delta_text)
                reasoning = reasoning if include_reasoning else None
                # The new tokens go out even while a parser or a stop string holds their text back.
                token_ids = completion.delta_token_ids if has_token_ids else None
                if content or tool_calls or reasoning or (logprobs and logprobs.content) or token_ids:
                    batch.append(encoder.choice(index, content, tool_calls=tool_calls, logprobs=logprobs,
                                                token_ids=token_ids, usage=usage, reasoning=reasoning))
                if cursor.is_finished:
                    for reasoning, content, tool_calls in self._ending(cursor):
                        reasoning = reasoning if include_reasoning else None
                        if content or tool_calls or reasoning:
                            batch.append(encoder.choice(index, content, tool_calls=tool_calls, usage=usage,
                                                        reasoning=reasoning))
                    finish_reason = completion.finish_reason
                    if cursor.parser is not None and cursor.parser.tool_calls and finish_reason == "stop":
                        finish_reason = "tool_calls"
                    batch.append(encoder.choice(index, finish_reason=finish_reason,
                                                stop_reason=completion.stop_reason, usage=usage))
            return batch

        def usage() -> list:
            return [encoder.usage(generation.usage())] if request.include_usage else []

        return generation_batches(generation, first, chunks, usage)

    @classmethod
    def _delta(cls, cursor: _Cursor, text: str) -> tuple[str | None, str | None, list[DeltaToolCall] | None]:
        """The delta's reasoning, content and tool call pieces for the new ``text``, through the
        choice's reasoning parser and tool parser if any; None where there are none."""
        reasoning = None
        if cursor.reasoning is not None:
            split = cursor.reasoning.feed(text)
            reasoning, text = split.reasoning or None, split.content
        if cursor.parser is None:
            return reasoning, text or None, None
        return (reasoning, *cls._tool_delta(cursor.parser.feed(text)))

    @classmethod
    def _ending(cls, cursor: _Cursor) -> list[tuple[str | None, str | None, list[DeltaToolCall] | None]]:
        """The pieces the choice's parsers held back until its output ended, one delta each."""
        deltas = []
        if cursor.reasoning is not None:
            split = cursor.reasoning.finish()
            if cursor.parser is None:
                deltas.append((split.reasoning or None, split.content or None, None))
            else:
                deltas.append((split.reasoning or None, *cls._tool_delta(cursor.parser.feed(split.content))))
        if cursor.parser is not None:
            deltas.append((None, *cls._tool_delta(cursor.parser.finish())))
        return deltas

    @staticmethod
    def _tool_delta(parsed: ParserDelta) -> tuple[str | None, list[DeltaToolCall] | None]:
        """A tool parser's pieces as a delta's content and tool calls; None where there are none."""
        calls = []
        for piece in parsed.tool_calls:
            function = DeltaFunctionCall(name=piece.name, arguments=piece.arguments or None)
            calls.append(DeltaToolCall(index=piece.index, id=piece.id, type="function" if piece.id else None,
                                       function=function if (piece.name or piece.arguments) else None))
        return parsed.content or None, calls or None
