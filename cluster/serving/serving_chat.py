"""``POST /v1/chat/completions``: OpenAI chat responses and their SSE stream over
the frontend (messages through the chat template; ``logprobs`` + ``top_logprobs``)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from pagedserve.workers.request import RequestOutput
from pagedserve.workers.sampler import SampleLogprobs

from .errors import APIError
from .frontend import Frontend, Generation
from .protocol import (ChatChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse,
                       ChatMessageOut, ChatStreamChoice, ChoiceLogprobs, DeltaMessage, TokenLogprob,
                       TopLogprob)
from .sse import DONE, EventStream, sse, stream_events


class ServingChat:
    """Answers chat completion requests for one ``Frontend``."""

    def __init__(self, frontend: Frontend) -> None:
        self.frontend = frontend

    def _chat_logprobs(self, samples: list[SampleLogprobs]) -> ChoiceLogprobs:
        """OpenAI's chat logprobs for ``samples``."""
        content = []
        for sample in samples:
            token = self.frontend.token_text(sample.token_id)
            top = [TopLogprob(token=text, logprob=lp, bytes=list(text.encode()))
                   for text, lp in ((self.frontend.token_text(t), lp) for t, lp in sample.top)]
            content.append(TokenLogprob(token=token, logprob=sample.logprob, bytes=list(token.encode()),
                                        top_logprobs=top))
        return ChoiceLogprobs(content=content)

    async def create_chat_completion(self, request: ChatCompletionRequest, client: str = ""
                                     ) -> ChatCompletionResponse | EventStream:
        """The response body, or an ``EventStream`` when ``stream`` is set."""
        self.frontend.check_model(request.model)
        prompt = self.frontend.chat_prompt(request)
        if request.top_logprobs is not None and not request.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        max_tokens = request.effective_max_tokens or self.frontend.max_model_len - len(prompt.token_ids)
        params = self.frontend.sampling_params(request, max_tokens, logprobs)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        generation, first = await self.frontend.start_generation(request_id, [prompt], params,
                                                                 request.priority, client)
        if request.stream:
            return EventStream(self._stream_chat(request, request_id, generation, first), generation)
        await generation.run_to_end(first)
        last = generation.progress[0].last
        choices = [ChatChoice(index=c.index, message=ChatMessageOut(content=c.text),
                              logprobs=self._chat_logprobs(c.logprobs or []) if request.logprobs else None,
                              finish_reason=c.finish_reason)
                   for c in (last.outputs if last else [])]
        choices.sort(key=lambda c: c.index)
        return ChatCompletionResponse(id=request_id, model=self.frontend.model_name, choices=choices,
                                      usage=generation.usage())

    async def _stream_chat(self, request: ChatCompletionRequest, request_id: str, generation: Generation,
                           first) -> AsyncIterator[str]:
        started: set[int] = set()  # choices whose role chunk went out
        created = int(time.time())

        def chunk(choice: ChatStreamChoice) -> str:
            return sse(ChatCompletionChunk(id=request_id, created=created, model=self.frontend.model_name,
                                           choices=[choice]))

        def chunks(_: int, output: RequestOutput):
            for completion in output.outputs:
                if completion.index not in started:
                    started.add(completion.index)
                    yield chunk(ChatStreamChoice(index=completion.index,
                                                 delta=DeltaMessage(role="assistant", content="")))
                logprobs = self._chat_logprobs(completion.delta_logprobs or []) if request.logprobs else None
                if completion.delta_text or (logprobs and logprobs.content):
                    yield chunk(ChatStreamChoice(index=completion.index,
                                                 delta=DeltaMessage(content=completion.delta_text),
                                                 logprobs=logprobs))
                if completion.is_newly_finished:
                    yield chunk(ChatStreamChoice(index=completion.index, delta=DeltaMessage(),
                                                 finish_reason=completion.finish_reason))

        async for line in stream_events(generation, first, chunks):
            yield line
        if request.include_usage:
            yield sse(ChatCompletionChunk(id=request_id, created=created, model=self.frontend.model_name,
                                          choices=[], usage=generation.usage()))
        yield DONE
