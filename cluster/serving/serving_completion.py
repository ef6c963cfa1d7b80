"""``POST /v1/completions``: OpenAI completion responses and their SSE stream
over the frontend (prompts as text, token ids or a batch; ``echo``, ``logprobs``)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from pagedserve.workers.request import RequestOutput
from pagedserve.workers.sampler import SampleLogprobs

from .errors import APIError
from .frontend import Frontend, Generation
from .protocol import (DEFAULT_MAX_TOKENS, CompletionChoice, CompletionLogprobs, CompletionRequest,
                       CompletionResponse)
from .sse import DONE, EventStream, sse, stream_events


class ServingCompletion:
    """Answers completion requests for one ``Frontend``."""

    def __init__(self, frontend: Frontend) -> None:
        self.frontend = frontend

    def _completion_logprobs(self, samples: list[SampleLogprobs], text_offset: int) -> CompletionLogprobs:
        """OpenAI's logprobs for ``samples``, the first token at ``text_offset`` in the choice's text."""
        result = CompletionLogprobs()
        for sample in samples:
            token = self.frontend.token_text(sample.token_id)
            result.tokens.append(token)
            result.token_logprobs.append(sample.logprob)
            result.top_logprobs.append({self.frontend.token_text(t): lp for t, lp in sample.top})
            result.text_offset.append(text_offset)
            text_offset += len(token)
        return result

    async def create_completion(self, request: CompletionRequest, client: str = ""
                                ) -> CompletionResponse | EventStream:
        """The response body, or an ``EventStream`` when ``stream`` is set."""
        self.frontend.check_model(request.model)
        if request.best_of is not None and request.best_of != request.n:
            raise APIError(400, "best_of must equal n (or be unset)", param="best_of")
        prompts_in = request.prompts()
        if not prompts_in:
            raise APIError(400, "the prompt is empty", param="prompt")
        prompts = [self.frontend.tokenize(p) for p in prompts_in]
        params = self.frontend.sampling_params(request, request.max_tokens or DEFAULT_MAX_TOKENS,
                                               request.logprobs)
        decode = self.frontend.tokenizer.decode
        echoes = [(p.text if p.text is not None else decode(p.token_ids)) if request.echo else ""
                  for p in prompts]
        request_id = f"cmpl-{uuid.uuid4().hex}"
        generation, first = await self.frontend.start_generation(request_id, prompts, params,
                                                                 request.priority, client)
        if request.stream:
            return EventStream(self._stream_completion(request, request_id, generation, first, echoes),
                               generation)
        await generation.run_to_end(first)
        choices = []
        n = params.n
        for index, progress in enumerate(generation.progress):
            for completion in (progress.last.outputs if progress.last else []):
                logprobs = None
                if request.logprobs is not None:
                    logprobs = self._completion_logprobs(completion.logprobs or [], len(echoes[index]))
                choices.append(CompletionChoice(index=index * n + completion.index,
                                                text=echoes[index] + completion.text, logprobs=logprobs,
                                                finish_reason=completion.finish_reason))
        choices.sort(key=lambda c: c.index)
        return CompletionResponse(id=request_id, model=self.frontend.model_name, choices=choices,
                                  usage=generation.usage())

    async def _stream_completion(self, request: CompletionRequest, request_id: str, generation: Generation,
                                 first, echoes: list[str]) -> AsyncIterator[str]:
        started: set[int] = set()  # choices whose first chunk (with the echo) went out
        n = generation.params.n
        created = int(time.time())

        def chunks(index: int, output: RequestOutput):
            for completion in output.outputs:
                choice_index = index * n + completion.index
                text = completion.delta_text
                if choice_index not in started:
                    started.add(choice_index)
                    text = echoes[index] + text
                logprobs = None
                if request.logprobs is not None:
                    offset = len(echoes[index]) + len(completion.text) - len(completion.delta_text)
                    logprobs = self._completion_logprobs(completion.delta_logprobs or [], offset)
                if not (text or completion.is_newly_finished or (logprobs and logprobs.tokens)):
                    continue
                choice = CompletionChoice(index=choice_index, text=text, logprobs=logprobs,
                                          finish_reason=completion.finish_reason)
                yield sse(CompletionResponse(id=request_id, created=created, model=self.frontend.model_name,
                                             choices=[choice]))

        async for line in stream_events(generation, first, chunks):
            yield line
        if request.include_usage:
            yield sse(CompletionResponse(id=request_id, created=created, model=self.frontend.model_name,
                                         choices=[], usage=generation.usage()))
        yield DONE
