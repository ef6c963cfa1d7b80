"""``POST /v1/responses``: OpenAI's Responses API over the chat path.

A request becomes the chat completion it means (``chat_request``):
``instructions`` a system message, ``input`` the messages, an earlier
``function_call`` item an assistant's tool call and its
``function_call_output`` the tool's message, function tools and
``tool_choice`` chat's, ``text.format`` chat's ``response_format``,
``max_output_tokens`` the token limit. ``ServingChat.prepare`` checks and
renders it, so a response and the chat completion of the same conversation
generate the same tokens. Errors name the Responses API's fields.

The output is a ``message`` item with one ``output_text`` part (its logprobs
with ``include: ["message.output_text.logprobs"]`` or ``top_logprobs``), and a
``function_call`` item per parsed call. With ``server.reasoning_parser`` and a reply
that starts in the reasoning, a ``reasoning`` item with one ``reasoning_text`` part
comes first (``usage.output_tokens_details.reasoning_tokens`` counts its tokens); a
reasoning item in the input goes back to the template with the assistant turn
after it. An output cut off by the token limit makes the response
``incomplete`` (``incomplete_details.reason: "max_output_tokens"``).

With a store (``server.store_responses``), a finished response whose ``store``
is not false is kept before it (or its last event) goes out, with its own
input items, each given an id; ``previous_response_id`` puts the stored
conversation (every earlier input and output item) before the new input, and
an ``item_reference`` input item is the stored input or output item of that id.
Instructions are not carried over, as OpenAI's are not. A ``background``
request is checked and admitted as any other and, once its first token is out
(as every request's is before its answer starts), stored ``in_progress`` and
answered; it runs in a task of the replica (``response_store.BackgroundRuns``)
and its stored copy becomes its last word: finished, ``failed`` with its error,
or ``cancelled``. Streamed too, its events go to an ``EventLog`` that the
client's stream follows (a client that leaves stops reading, not the
response), and are stored with it: ``stream_stored`` streams them again.

Streamed, the events are OpenAI's, each a named server-sent event with its
``sequence_number``: ``response.created`` and ``response.in_progress``; per
item ``response.output_item.added``, then for a message
``response.content_part.added``, ``response.output_text.delta`` per step and
the ``.done`` events (for a reasoning item ``response.reasoning_text.delta``
and its ``.done``), for a call ``response.function_call_arguments.delta`` and
``.done``, then ``response.output_item.done``; last
``response.completed`` or ``response.incomplete`` with the usage. One item is
open at a time. A failure mid-stream ends it with ``response.failed``: the
response ``failed``, its ``error`` the failure's code and message.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from json.encoder import encode_basestring as _json_str  # as pydantic writes strings: non-ASCII kept
from typing import Any

from pydantic import TypeAdapter, ValidationError

from pagedserve.reasoning_parsers import ReasoningDelta, ReasoningParser
from pagedserve.reasoning_parsers.base import FUNCTION_CALL, REASONING
from pagedserve.tool_parsers import ToolCall, ToolParser
from pagedserve.workers.outputs.request_output import CompletionOutput, RequestOutput

from ..response_store import EventLog, StoredEvents, StoredResponse
from .errors import APIError
from .frontend import Generation
from .protocol import ChatCompletionRequest, TokenLogprob
from .responses_protocol import (FunctionCallItem, FunctionCallOutputItem, IncompleteDetails, InputItem,
                                 InputTokensDetails, ItemReference, MessageItem, OutputFunctionCall, OutputMessage,
                                 OutputReasoning, OutputReasoningText, OutputText, OutputTokensDetails,
                                 ReasoningItem, ResponseObject, ResponsesRequest, ResponseUsage)
from .serving_chat import ServingChat
from .streaming import ChunkStream, generation_batches

# Chat's names for what a Responses request calls otherwise (for the errors the chat path raises).
_PARAM_NAMES = {"messages": "input", "response_format": "text.format", "max_completion_tokens": "max_output_tokens",
                "logprobs": "include", "reasoning_effort": "reasoning.effort"}


logger = logging.getLogger("pagedserve.server")

_STORED_ITEMS = TypeAdapter(list[InputItem])
_STORED_ITEM = TypeAdapter(InputItem)
NOT_STORED = "responses are not stored by this server (server.store_responses is off)"
_ITEM_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}
FOLLOW_POLL_S = 0.1   # a stream of a background response running in another replica reads the store this often


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _input_list(request: ResponsesRequest) -> list:
    """The request's input as a list of items (text is one user message)."""
    return request.input if isinstance(request.input, list) else [MessageItem(role="user", content=request.input)]


def own_input_items(request: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input as items, as the API lists them: each with an id, text as parts."""
    listed = []
    for item in _input_list(request):
        entry = item.model_dump(mode="json", exclude_none=True)
        entry.setdefault("id", _item_id(_ITEM_ID_PREFIXES[item.type]))
        if isinstance(item, MessageItem):
            if isinstance(item.content, str):
                kind = "output_text" if item.role == "assistant" else "input_text"
                entry["content"] = [{"type": kind, "text": item.content}]
            entry.setdefault("status", "completed")
        listed.append(entry)
    return listed


def _renamed(error: APIError) -> APIError:
    """``error`` naming the Responses API's field where the chat path named its own."""
    param = error.param
    if param is None:
        return error
    head, dot, rest = param.partition(".")
    if head not in _PARAM_NAMES:
        return error
    name = _PARAM_NAMES[head] + dot + rest
    message = error.message.replace(head, _PARAM_NAMES[head]) if head == "response_format" else error.message
    return APIError(error.status, message, error.type, name, error.code, error.headers)


def _chat_messages(request: ResponsesRequest) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if request.instructions:
        messages.append({"role": "system", "content": request.instructions})
    if isinstance(request.input, str):
        messages.append({"role": "user", "content": request.input})
        return messages
    reasoning: str | None = None   # a reasoning item's text, for the assistant turn it led to
    for item in request.input:
        if reasoning is not None and not (isinstance(item, (FunctionCallItem, ReasoningItem))
                                          or isinstance(item, MessageItem) and item.role == "assistant"):
            # A turn that only thought (cut off, say): an assistant message with no content.
            messages.append({"role": "assistant", "content": "", "reasoning": reasoning})
            reasoning = None
        if isinstance(item, ReasoningItem):   # several in a row (harmony's messages): one reasoning
            reasoning = item.text() if reasoning is None else f"{reasoning}\n{item.text()}"
            continue
        if isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if reasoning is None and last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)   # parallel calls: one assistant message
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
        else:
            messages.append({"role": item.role, "content": item.text()})
        if reasoning is not None:
            messages[-1]["reasoning"] = reasoning
            reasoning = None
    if reasoning is not None:
        messages.append({"role": "assistant", "content": "", "reasoning": reasoning})
    return messages


def reasoning_token_count(tokenizer, token_ids: Sequence[int], end_tag: str) -> int:
    """How many of ``token_ids`` are reasoning: up to the one that completes ``end_tag``, or all
    of them (a reply cut off while thinking). Where the tag is one token of the vocabulary (Qwen3's
    and DeepSeek-R1's ``</think>``) and the reply has it, its position; else a binary search over
    decoded prefixes (whether a prefix holds the tag only grows with it)."""
    tag_id = tokenizer.convert_tokens_to_ids(end_tag)
    if isinstance(tag_id, int) and tag_id != tokenizer.unk_token_id:
        with contextlib.suppress(ValueError):
            return list(token_ids).index(tag_id) + 1
    low, high = 0, len(token_ids)   # the tag is not in the first ``low`` tokens; it is in all ``high`` or none
    if end_tag not in tokenizer.decode(list(token_ids), skip_special_tokens=False):
        return len(token_ids)
    while low + 1 < high:
        middle = (low + high) // 2
        if end_tag in tokenizer.decode(list(token_ids[:middle]), skip_special_tokens=False):
            high = middle
        else:
            low = middle
    return high


def chat_request(request: ResponsesRequest):
    """The chat completion request ``request`` means (``APIError`` 400 if it cannot be one)."""
    if request.wants_logprobs and request.tools:
        raise APIError(400, "logprobs (include message.output_text.logprobs, top_logprobs) cannot be combined with "
                            "tools here", param="include" if request.include else "top_logprobs")
    messages = _chat_messages(request)
    if not messages:
        raise APIError(400, "the conversation is empty: input holds no item and there are no instructions",
                       param="input")
    fields: dict[str, Any] = {
        "model": request.model, "messages": messages, "stream": request.stream,
        "max_completion_tokens": request.max_output_tokens, "temperature": request.temperature,
        "top_p": request.top_p, "parallel_tool_calls": request.parallel_tool_calls, "user": request.user,
        "safety_identifier": request.safety_identifier, "prompt_cache_key": request.prompt_cache_key,
        "priority": request.priority, "cache_salt": request.cache_salt, "top_k": request.top_k,
        "reasoning_effort": request.reasoning.effort if request.reasoning else None,
    }
    for name in ("min_p", "repetition_penalty"):
        if name in request.model_fields_set:
            fields[name] = getattr(request, name)
    if request.wants_logprobs:
        fields.update(logprobs=True, top_logprobs=request.top_logprobs or 0)
    if request.tools:
        fields["tools"] = [{"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
                           for tool in request.tools]
    choice = request.tool_choice
    if choice is not None:
        fields["tool_choice"] = choice if isinstance(choice, str) else {"type": "function",
                                                                        "function": {"name": choice.name}}
    text_format = request.text.format if request.text else None
    if text_format is not None and text_format.type == "json_schema":
        fields["response_format"] = {"type": "json_schema", "json_schema": text_format.model_dump(
            exclude={"type"}, exclude_none=True, by_alias=True)}
    elif text_format is not None:
        fields["response_format"] = {"type": text_format.type}
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as exc:
        raise APIError(400, f"invalid request: {exc.errors(include_url=False)}") from None


class ServingResponses:
    """Answers Responses API requests for one ``Frontend``, through its chat path, and keeps
    them in the frontend's ``response_store`` (if it has one)."""

    def __init__(self, chat: ServingChat) -> None:
        self.chat = chat
        self.frontend = chat.frontend
        self.store = chat.frontend.response_store

    def _check_background(self, request: ResponsesRequest, is_stored: bool) -> None:
        if self.store is None:
            raise APIError(400, f"background cannot be honoured: a background response lives in the store, and "
                                f"{NOT_STORED}", param="background")
        if not is_stored:
            raise APIError(400, "a background response must be stored: leave store out, or send store: true",
                           param="store")

    def _stores(self, request: ResponsesRequest) -> bool:
        """Whether ``request``'s response is to be kept: ``store``, else the server's default."""
        if request.store is None:
            return self.store is not None
        if request.store and self.store is None:
            raise APIError(400, f"store cannot be honoured: {NOT_STORED}; send store: false", param="store")
        return request.store

    async def _continued(self, request: ResponsesRequest) -> ResponsesRequest:
        """``request`` with its previous response's conversation before its own input."""
        previous_id = request.previous_response_id
        if self.store is None:
            raise APIError(400, f"previous_response_id cannot be honoured: {NOT_STORED}; send the conversation "
                                "as input", param="previous_response_id")
        conversation = await self.store.conversation(previous_id)
        if conversation is None:
            raise APIError(404, f"Previous response with id {previous_id!r} not found", param="previous_response_id")
        if conversation.missing is not None:
            raise APIError(404, f"Previous response with id {previous_id!r} continues response "
                                f"{conversation.missing!r}, which is no longer stored", param="previous_response_id")
        return request.model_copy(update={"input": _STORED_ITEMS.validate_python(conversation.items)
                                                    + _input_list(request)})

    async def _dereferenced(self, request: ResponsesRequest) -> ResponsesRequest:
        """``request`` with each ``item_reference`` in its input replaced by the stored item it
        names (404 naming ``input`` if none is stored)."""
        items = _input_list(request)
        references = [(index, item.id) for index, item in enumerate(items) if isinstance(item, ItemReference)]
        if not references:
            return request
        if self.store is None:
            raise APIError(400, f"input[{references[0][0]}] is item_reference: items are referenced by id only in "
                                f"the store, and {NOT_STORED}; send the item itself", param="input")
        found = await self.store.items([item_id for _, item_id in references])
        for index, item_id in references:
            if item_id not in found:
                raise APIError(404, f"Item with id {item_id!r} not found (input[{index}]): no stored response "
                                    "holds it", param="input")
        return request.model_copy(update={"input": [
            _STORED_ITEM.validate_python(found[item.id]) if isinstance(item, ItemReference) else item
            for item in items]})

    async def keep(self, response: ResponseObject, input_items: list[dict[str, Any]] | None,
                   events: list[str] | None = None) -> None:
        """Store ``response`` (finished) if its request asked for it (``input_items`` not None);
        ``events``: a streamed background response's every event."""
        if input_items is None:
            return
        try:
            await self.store.put(StoredResponse(response.model_dump(mode="json"), input_items,
                                                response.previous_response_id), events)
        except Exception as exc:
            raise APIError(503, f"the response was generated but could not be stored: {exc!r}", param="store",
                           code="store_unavailable") from None

    async def retrieve(self, response_id: str) -> StoredResponse:
        """The stored response ``response_id`` (404 naming it if none)."""
        stored = await self.store.get(response_id) if self.store is not None else None
        if stored is None:
            raise self.not_found(response_id)
        return stored

    async def delete(self, response_id: str) -> dict[str, Any]:
        if self.store is None or not await self.store.delete(response_id):
            raise self.not_found(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    async def input_items(self, response_id: str, limit: int = 20, order: str = "desc",
                          after: str | None = None) -> dict[str, Any]:
        """A page of the stored response's own input items (OpenAI's list object): ``limit``
        (1-100) of them in ``order`` ("asc" or "desc"), after the item ``after`` if given."""
        if not 1 <= limit <= 100:
            raise APIError(400, f"limit must be between 1 and 100, not {limit}", param="limit")
        if order not in ("asc", "desc"):
            raise APIError(400, f"order must be 'asc' or 'desc', not {order!r}", param="order")
        items = (await self.retrieve(response_id)).input_items
        if order == "desc":
            items = items[::-1]
        if after is not None:
            ids = [item["id"] for item in items]
            if after not in ids:
                raise APIError(400, f"after {after!r} is not an input item of response {response_id!r}",
                               param="after")
            items = items[ids.index(after) + 1:]
        page = items[:limit]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}

    def not_found(self, response_id: str) -> APIError:
        why = f": {NOT_STORED}" if self.store is None else ""
        return APIError(404, f"Response with id {response_id!r} not found{why}", param="response_id")

    async def create_response(self, request: ResponsesRequest, client: str = "") -> ResponseObject | ChunkStream:
        """The response, or a ``ChunkStream`` of its events (SSE text) when ``stream`` is set."""
        frontend = self.frontend
        is_stored = self._stores(request)
        if request.background:
            self._check_background(request, is_stored)
        request = await self._dereferenced(request)
        input_items = own_input_items(request) if is_stored else None
        if request.previous_response_id is not None:
            request = await self._continued(request)
        chat = chat_request(request)
        try:
            prompt, params, lora_request = self.chat.prepare(chat, "max_output_tokens")
        except APIError as exc:
            raise _renamed(exc) from None
        if self.chat.reasoning_parser(prompt.text) is not None and request.wants_logprobs:
            raise APIError(400, "logprobs cannot be combined with a reply that starts in a reasoning model's "
                                f"reasoning (server.reasoning_parser {frontend.config.reasoning_parser!r}): "
                                "the output's logprobs would mix the reasoning's tokens into the message's",
                           param="include" if request.include else "top_logprobs")
        engine_id = _item_id("resp")
        response = ResponseObject(
            id=request.request_id or engine_id, status="in_progress", model=frontend.response_model(lora_request),
            instructions=request.instructions, max_output_tokens=request.max_output_tokens,
            temperature=params.temperature, top_p=params.top_p, top_logprobs=request.top_logprobs,
            parallel_tool_calls=request.parallel_tool_calls,
            text=request.text.model_dump(exclude_none=True, by_alias=True) if request.text and request.text.format
            else {"format": {"type": "text"}},
            tool_choice=(request.tool_choice.model_dump() if request.tool_choice is not None
                         and not isinstance(request.tool_choice, str) else request.tool_choice or "auto"),
            tools=[tool.model_dump(exclude_none=True) for tool in request.tools or ()],
            metadata=request.metadata, user=request.user, safety_identifier=request.safety_identifier,
            prompt_cache_key=request.prompt_cache_key, previous_response_id=request.previous_response_id,
            store=input_items is not None, background=bool(request.background),
            reasoning={"effort": chat.reasoning_effort, "summary": None})
        generation, first = await frontend.start_generation(engine_id, [prompt], params, request.priority, client,
                                                            is_streamed=request.stream, lora_request=lora_request)
        if request.background and request.stream:
            return await self._start_background_stream(chat, request, response, generation, first, input_items,
                                                       prompt.text)
        if request.background:
            return await self._start_background(chat, request, response, generation, first, input_items, prompt.text)
        if request.stream:
            stream = _ResponseEvents(self, chat, request, response, generation, input_items, prompt_text=prompt.text)
            return ChunkStream(lambda _: stream.batches(first), generation, stream.error_event)
        response = await self._run_to_end(chat, request, response, generation, first, prompt.text)
        await self.keep(response, input_items)
        return response

    async def _run_to_end(self, chat, request: ResponsesRequest, response: ResponseObject, generation: Generation,
                          first, prompt_text: str | None) -> ResponseObject:
        """``response`` finished with the output of ``generation`` run to its end."""
        await generation.run_to_end(first)
        last = generation.progress[0].last
        completion = last.outputs[0] if last is not None and last.outputs else None
        output = self._output(chat, request, completion, prompt_text)
        return finished(response, output, completion, generation, self.reasoning_tokens(completion, prompt_text))

    def reasoning_tokens(self, completion: CompletionOutput | None, prompt_text: str | None) -> int:
        """How many of ``completion``'s tokens are reasoning (none where the reply does not start in it)."""
        parser = self.chat.reasoning_parser(prompt_text)
        if parser is None or completion is None:
            return 0
        return reasoning_token_count(self.frontend.tokenizer, completion.token_ids, parser.end_tag)

    async def _start_background(self, chat, request: ResponsesRequest, response: ResponseObject,
                                generation: Generation, first, input_items: list[dict[str, Any]],
                                prompt_text: str | None) -> ResponseObject:
        """Store ``response`` (``in_progress``: its first output is out) and run the rest of its
        generation in the background; return it."""

        async def run() -> None:
            try:
                final = await self._run_to_end(chat, request, response, generation, first, prompt_text)
            except Exception as exc:   # CancelledError is not one: a cancelled response stays as the store has it
                final, _ = _failed(response, exc)
            await self._keep_last_word(final, input_items)

        await self._run_in_background(response, generation, input_items, run)
        return response

    async def _keep_last_word(self, final: ResponseObject, input_items: list[dict[str, Any]],
                              events: list[str] | None = None) -> None:
        """Store a background response's last word; if the store cannot take it, its lease
        lapses and the store marks it failed."""
        try:
            await self.keep(final, input_items, events)
        except APIError as exc:
            logger.warning("background response %s: %s", final.id, exc.message)

    async def _run_in_background(self, response: ResponseObject, generation: Generation,
                                 input_items: list[dict[str, Any]], run, log: EventLog | None = None) -> None:
        try:
            await self.frontend.background_runs.start(
                StoredResponse(response.model_dump(mode="json"), input_items, response.previous_response_id), run,
                log)
        except Exception as exc:
            await generation.aclose()
            raise APIError(503, f"the background response could not be stored: {exc!r}", param="store",
                           code="store_unavailable") from None

    async def _start_background_stream(self, chat, request: ResponsesRequest, response: ResponseObject,
                                       generation: Generation, first, input_items: list[dict[str, Any]],
                                       prompt_text: str | None) -> ChunkStream:
        """Run the streamed response in the background, its events written to an ``EventLog``
        (stored with it when it ends, in the store meanwhile too); the stream returned follows
        the log, so a client that leaves stops reading, not the response."""
        log = EventLog()

        async def keep_whole(final: ResponseObject, last_events: list[str]) -> None:
            await self.keep(final, input_items, log.events + last_events)

        events = _ResponseEvents(self, chat, request, response, generation, on_finished=keep_whole,
                                 prompt_text=prompt_text)

        async def run() -> None:
            try:
                async for batch in events.batches(first):
                    log.extend(batch)
            except Exception as exc:   # CancelledError is not one: a cancelled response stays as the store has it
                failed, _ = _failed(response, exc)
                last = [events.failed_event(failed)]
                await self._keep_last_word(failed, input_items, log.events + last)
                log.extend(last)

        await self._run_in_background(response, generation, input_items, run, log)
        return ChunkStream(lambda _: log.follow(-1), None, events.error_event)

    async def stream_stored(self, response_id: str, starting_after: int | None) -> ChunkStream:
        """The events of the background response ``response_id`` created with ``stream``, after
        sequence number ``starting_after`` (all if None): those made, then the rest as they are
        made, until it ends. Read from this replica's log if it runs here, else from the store
        every ``FOLLOW_POLL_S``."""
        after = -1 if starting_after is None else starting_after
        runs = self.frontend.background_runs
        log = runs.logs.get(response_id) if runs is not None else None
        if log is not None:
            return ChunkStream(lambda _: log.follow(after), None, _follower_error)
        page = await self.store.events(response_id, after) if self.store is not None else None
        if page is None:
            raise self.not_found(response_id)
        if page.events is None:
            raise APIError(400, f"response {response_id!r} cannot be streamed: only a background response created "
                                "with stream: true keeps its events", param="stream")
        return ChunkStream(lambda _: self._follow_store(response_id, after, page), None, _follower_error)

    async def _follow_store(self, response_id: str, after: int, page: StoredEvents) -> AsyncIterator[list[str]]:
        while True:
            if page.events:
                yield page.events
                after += len(page.events)
            if page.is_finished:
                return
            await asyncio.sleep(FOLLOW_POLL_S)
            page = await self.store.events(response_id, after)
            if page is None or page.events is None:
                raise APIError(404, f"response {response_id!r} was deleted while it was streamed",
                               param="response_id")

    async def cancel(self, response_id: str) -> dict[str, Any]:
        """Cancel the background response ``response_id`` (at once if it runs in this replica,
        else at its replica's next lease renewal); it is returned as it now stands."""
        stored = await self.store.cancel(response_id) if self.store is not None else None
        if stored is None:
            raise self.not_found(response_id)
        if not stored.response.get("background"):
            raise APIError(400, f"response {response_id!r} cannot be cancelled: only background responses can be",
                           param="response_id")
        self.frontend.background_runs.cancel_here(response_id)
        return stored.response

    def _output(self, chat, request: ResponsesRequest, completion: CompletionOutput | None,
                prompt_text: str | None = None) -> list[OutputReasoning | OutputMessage | OutputFunctionCall]:
        text = completion.text if completion is not None else ""
        is_cut_off = _is_cut_off(completion)
        items: list[OutputReasoning | OutputMessage | OutputFunctionCall] = []
        reasoning_parser = self.chat.reasoning_parser(prompt_text)
        if reasoning_parser is not None and reasoning_parser.reads_messages:
            return self._message_items(chat, reasoning_parser, text, is_cut_off)
        if reasoning_parser is not None:
            reasoning, content = reasoning_parser.parse(text)
            text = content or ""
            if reasoning is not None:
                items.append(OutputReasoning(id=_item_id("rs"), content=[OutputReasoningText(text=reasoning)],
                                             status="incomplete" if is_cut_off and content is None else "completed"))
            if content is None and is_cut_off:   # cut off while thinking: no answer began
                return items
        calls = []
        parser = self.chat.output_parser(chat, reasoning_parser)
        if parser is not None:
            parsed = parser.parse(text, is_cut_off=is_cut_off)
            text, calls = parsed.content or "", parsed.tool_calls
        if text or not calls:
            logprobs = (self.chat.logprobs.chat(completion.logprobs or []).content
                        if request.wants_logprobs and completion is not None else None)
            items.append(OutputMessage(id=_item_id("msg"), status="incomplete" if is_cut_off and not calls
                                       else "completed", content=[OutputText(text=text, logprobs=logprobs)]))
        items += _call_items(calls)
        return items

    def _message_items(self, chat, reasoning_parser: ReasoningParser, text: str,
                       is_cut_off: bool) -> list[OutputReasoning | OutputMessage | OutputFunctionCall]:
        """The output of a reply its parser reads as several messages (harmony's): an item for each
        message, in order (vLLM's), the last one incomplete where the reply was cut off."""
        items: list[OutputReasoning | OutputMessage | OutputFunctionCall] = []
        for kind, body in reasoning_parser.parse_messages(text):
            parser = self.chat.output_parser(chat, reasoning_parser) if kind == FUNCTION_CALL else None
            if kind == REASONING:
                items.append(OutputReasoning(id=_item_id("rs"), content=[OutputReasoningText(text=body)],
                                             status="completed"))
            elif parser is None:   # an answer, or a call where none was asked for: its text
                items.append(OutputMessage(id=_item_id("msg"), status="completed", content=[OutputText(text=body)]))
            else:
                parsed = parser.parse(body, is_cut_off=is_cut_off)
                if parsed.content:
                    items.append(OutputMessage(id=_item_id("msg"), status="completed",
                                               content=[OutputText(text=parsed.content)]))
                items += _call_items(parsed.tool_calls)
        if not any(not isinstance(item, OutputReasoning) for item in items) and not is_cut_off:
            items.append(OutputMessage(id=_item_id("msg"), status="completed", content=[OutputText(text="")]))
        if is_cut_off and items and not isinstance(items[-1], OutputFunctionCall):
            items[-1].status = "incomplete"
        return items


def _call_items(calls: Sequence[ToolCall]) -> list[OutputFunctionCall]:
    """A ``function_call`` item for each of a whole reply's parsed ``calls``."""
    return [OutputFunctionCall(id=_item_id("fc"), call_id=call.id, name=call.name, arguments=call.arguments,
                               status="completed" if call.is_complete else "incomplete") for call in calls]


def _failed(response: ResponseObject, exc: Exception) -> tuple[ResponseObject, APIError]:
    """``response`` failed with ``exc`` (a server error unless an ``APIError``), and that error."""
    if not isinstance(exc, APIError):
        logger.error("background response %s failed", response.id, exc_info=exc)
        exc = APIError(500, repr(exc), "server_error", code="server_error")
    return response.model_copy(update=dict(status="failed", error={"code": exc.code or exc.type,
                                                                   "message": exc.message})), exc


def _error_fields(error: APIError) -> dict[str, Any]:
    """An ``error`` event's fields for ``error``."""
    return {"code": error.code or error.type, "message": error.message, "param": error.param}


def _follower_error(error: APIError) -> str:
    """The last event of a stream that follows a stored response and cannot go on."""
    return f"event: error\ndata: {json.dumps({'type': 'error', **_error_fields(error)})}\n\n"


def _is_cut_off(completion: CompletionOutput | None) -> bool:
    """The output ran out of tokens (the token limit, or the context)."""
    return completion is not None and completion.finish_reason == "length"


def finished(response: ResponseObject, output: list, completion: CompletionOutput | None,
             generation: Generation, reasoning_tokens: int = 0) -> ResponseObject:
    """``response`` completed (or incomplete, cut off by the token limit) with ``output``."""
    usage = generation.usage()
    is_cut_off = _is_cut_off(completion)
    return response.model_copy(update=dict(
        status="incomplete" if is_cut_off else "completed", completed_at=int(time.time()), output=output,
        incomplete_details=IncompleteDetails(reason="max_output_tokens") if is_cut_off else None,
        usage=ResponseUsage(input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens,
                            total_tokens=usage.total_tokens,
                            output_tokens_details=OutputTokensDetails(reasoning_tokens=reasoning_tokens),
                            input_tokens_details=InputTokensDetails(
                                cached_tokens=usage.prompt_tokens_details.cached_tokens))))


class _ResponseEvents:
    """The SSE events of one streamed response, built as its outputs arrive."""

    def __init__(self, serving: ServingResponses, chat, request: ResponsesRequest, response: ResponseObject,
                 generation: Generation, input_items: list[dict[str, Any]] | None = None,
                 on_finished: Callable[[ResponseObject, list[str]], Awaitable[None]] | None = None,
                 prompt_text: str | None = None) -> None:
        self.serving = serving
        self.prompt_text = prompt_text
        # The reply's thinking goes to a reasoning item, its answer on to the items below.
        self.reasoning_parser: ReasoningParser | None = serving.chat.reasoning_parser(prompt_text)
        self.is_answering = self.reasoning_parser is None
        # Awaited with the finished response and its last events before they go out; by default
        # the response is stored with ``input_items`` (None: not stored).
        self.on_finished = on_finished or (lambda response, _: serving.keep(response, input_items))
        self.logprobs = serving.chat.logprobs
        self.wants_logprobs = request.wants_logprobs
        self.response = response
        self.generation = generation
        self.parser: ToolParser | None = serving.chat.output_parser(chat, self.reasoning_parser)
        self.sequence = 0
        self.items: list[OutputReasoning | OutputMessage | OutputFunctionCall] = []
        self.open: OutputReasoning | OutputMessage | OutputFunctionCall | None = None
        self.calls: dict[int, OutputFunctionCall] = {}   # the parser's call index -> its item
        self.parsed_calls: dict[str, ToolCall] = {}      # an item's id -> the parser's call
        self.text_pieces: list[str] = []                 # the open message's text so far
        self.delta_head = ""                             # the open message's delta events, up to the delta
        self.completion: CompletionOutput | None = None
        self.is_started = False
        self.is_finished = False

    def event(self, kind: str, **fields) -> str:
        fields["type"] = kind
        fields["sequence_number"] = self.sequence
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(fields)}\n\n"

    def error_event(self, error: APIError) -> str:
        """The stream's last event when the generation fails mid-way: ``response.failed``, as
        OpenAI ends a response that failed, its ``error`` the failure's code and message."""
        return self.failed_event(_failed(self.response, error)[0])

    def failed_event(self, failed: ResponseObject) -> str:
        return self.event("response.failed", response=failed.model_dump(mode="json"))

    def batches(self, first) -> AsyncIterator[list[str]]:
        return generation_batches(self.generation, first, self._output_events, self._last_events)

    def _start(self, events: list[str]) -> None:
        self.is_started = True
        response = self.response.model_dump(mode="json")
        events.append(self.event("response.created", response=response))
        events.append(self.event("response.in_progress", response=response))

    def _output_events(self, _: int, output: RequestOutput) -> list[str]:
        events: list[str] = []
        if not self.is_started:
            self._start(events)
        if self.is_finished or not output.outputs:
            return events
        completion = self.completion = output.outputs[0]
        text = completion.delta_text
        if self.reasoning_parser is not None:
            text = self._add_reply(events, self.reasoning_parser.feed(text))
        if self.parser is None:
            logprobs = self.logprobs.chat(completion.delta_logprobs or []).content if self.wants_logprobs else ()
            if text or logprobs:   # a token's logprobs go out while its text waits for more bytes
                self._add_text(events, text, logprobs)
        elif text:
            self._add_parsed(events, self.parser.feed(text))
        if completion.finish_reason is not None:
            self.is_finished = True
            if self.reasoning_parser is not None:
                text = self._add_reply(events, self.reasoning_parser.finish())
                if text:
                    self._add_answer(events, text)
            if self.parser is not None:
                self._add_parsed(events, self.parser.finish())
            answered = any(not isinstance(item, OutputReasoning) for item in self.items)
            if not answered and (self.is_answering or not _is_cut_off(completion)):
                self._open_message(events)   # no text and no call: the message is there, empty
            self._close(events, is_last=True)
        return events

    def _add_answer(self, events: list[str], text: str) -> None:
        if self.parser is None:
            self._add_text(events, text, ())
        else:
            self._add_parsed(events, self.parser.feed(text))

    def _add_reply(self, events: list[str], piece: ReasoningDelta) -> str:
        """The reasoning of ``piece`` as ``response.reasoning_text.delta`` events (the reasoning
        item opened first); its answer, returned. A reply read as several messages (``parts``) is
        added whole here, an item for each message, and nothing is returned."""
        if piece.parts is not None:
            for kind, starts, text in piece.parts:
                self._add_part(events, kind, starts, text)
            return ""
        if piece.reasoning:
            self._add_reasoning(events, piece.reasoning, starts=False)
        if piece.content:
            self.is_answering = True
        return piece.content

    def _add_part(self, events: list[str], kind: str, starts: bool, text: str) -> None:
        if kind == REASONING:
            self._add_reasoning(events, text, starts)
            return
        self.is_answering = True
        if kind == FUNCTION_CALL and self.parser is not None:
            self._add_parsed(events, self.parser.feed(text))
            return
        if starts and isinstance(self.open, OutputMessage):
            self._close(events)
        self._add_text(events, text, ())

    def _add_reasoning(self, events: list[str], text: str, starts: bool) -> None:
        """``text`` in the open reasoning item (a new one where none is open, or ``starts``)."""
        item = self.open if isinstance(self.open, OutputReasoning) and not starts else self._open_reasoning(events)
        self.text_pieces.append(text)
        events.append(self.event("response.reasoning_text.delta", item_id=item.id,
                                 output_index=len(self.items) - 1, content_index=0, delta=text))

    def _open_reasoning(self, events: list[str]) -> OutputReasoning:
        self._close(events)
        item = OutputReasoning(id=_item_id("rs"), status="in_progress", content=[])
        self._add_item(events, item)
        events.append(self.event("response.content_part.added", item_id=item.id, output_index=len(self.items) - 1,
                                 content_index=0, part={"type": "reasoning_text", "text": ""}))
        return item

    async def _last_events(self) -> list[str]:
        events: list[str] = []
        sequence = self.sequence
        if not self.is_started:
            self._start(events)
        response = finished(self.response, self.items, self.completion, self.generation,
                            self.serving.reasoning_tokens(self.completion, self.prompt_text))
        kind = "response.incomplete" if response.status == "incomplete" else "response.completed"
        events.append(self.event(kind, response=response.model_dump(mode="json")))
        try:
            await self.on_finished(response, events)
        except BaseException:
            # These events never go out: the failure's event takes their numbers, so that the
            # stream's sequence numbers stay gapless.
            self.sequence = sequence
            raise
        return events

    def _add_parsed(self, events: list[str], parsed) -> None:
        if parsed.content:
            self._add_text(events, parsed.content, [])
        for piece in parsed.tool_calls:
            item = self.calls.get(piece.index)
            if item is None:
                self._close(events)
                item = self.calls[piece.index] = OutputFunctionCall(
                    id=_item_id("fc"), call_id=piece.id or "", name=piece.name or "", arguments="",
                    status="in_progress")
                self.parsed_calls[item.id] = self.parser.started_calls[piece.index]
                self._add_item(events, item)
            if piece.arguments:
                item.arguments += piece.arguments
                events.append(self.event("response.function_call_arguments.delta", item_id=item.id,
                                         output_index=self.items.index(item), delta=piece.arguments))

    def _add_text(self, events: list[str], text: str, logprobs: Sequence[TokenLogprob]) -> None:
        """A ``response.output_text.delta`` event, written directly: one per step on the token path."""
        message = self.open if isinstance(self.open, OutputMessage) else self._open_message(events)
        self.text_pieces.append(text)   # joined when the message closes: no copy of the text a step
        entries = "[]"
        if logprobs:
            message.content[0].logprobs.extend(logprobs)
            entries = json.dumps([entry.model_dump() for entry in logprobs])
        sequence = self.sequence
        self.sequence += 1
        events.append(f'{self.delta_head}{_json_str(text)},"logprobs":{entries},"sequence_number":{sequence}}}\n\n')

    def _open_message(self, events: list[str]) -> OutputMessage:
        self._close(events)
        message = OutputMessage(id=_item_id("msg"), status="in_progress",
                                content=[OutputText(text="", logprobs=[] if self.wants_logprobs else None)])
        self._add_item(events, message)
        self.delta_head = ('event: response.output_text.delta\ndata: {"type":"response.output_text.delta",'
                           f'"item_id":"{message.id}","output_index":{len(self.items) - 1},"content_index":0,'
                           '"delta":')
        events.append(self.event("response.content_part.added", item_id=message.id,
                                 output_index=len(self.items) - 1, content_index=0,
                                 part={"type": "output_text", "text": "", "annotations": []}))
        return message

    def _add_item(self, events: list[str], item) -> None:
        self.items.append(item)
        self.open = item
        events.append(self.event("response.output_item.added", output_index=len(self.items) - 1,
                                 item=item.model_dump(mode="json")))

    def _close(self, events: list[str], is_last: bool = False) -> None:
        """End the open item (if any): its ``.done`` events. The last item of a reply that was cut
        off (``is_last``) is incomplete."""
        item, self.open = self.open, None
        if item is None:
            return
        index = self.items.index(item)
        is_cut_off = is_last and _is_cut_off(self.completion)
        if isinstance(item, OutputReasoning):
            part = OutputReasoningText(text="".join(self.text_pieces))
            self.text_pieces = []
            item.content = [part]
            item.status = "incomplete" if is_cut_off else "completed"
            events.append(self.event("response.reasoning_text.done", item_id=item.id, output_index=index,
                                     content_index=0, text=part.text))
            events.append(self.event("response.content_part.done", item_id=item.id, output_index=index,
                                     content_index=0, part=part.model_dump(mode="json")))
        elif isinstance(item, OutputMessage):
            part = item.content[0]
            part.text = "".join(self.text_pieces)
            self.text_pieces = []
            item.status = "incomplete" if is_cut_off else "completed"
            events.append(self.event("response.output_text.done", item_id=item.id, output_index=index,
                                     content_index=0, text=part.text,
                                     logprobs=[entry.model_dump() for entry in part.logprobs or ()]))
            events.append(self.event("response.content_part.done", item_id=item.id, output_index=index,
                                     content_index=0, part=part.model_dump(mode="json", exclude_none=True)))
        else:
            # The parser's verdict, as for a response that is not streamed.
            item.status = "completed" if self.parsed_calls[item.id].is_complete else "incomplete"
            events.append(self.event("response.function_call_arguments.done", item_id=item.id,
                                     output_index=index, name=item.name, arguments=item.arguments))
        events.append(self.event("response.output_item.done", output_index=index,
                                 item=item.model_dump(mode="json", exclude_none=True)))

