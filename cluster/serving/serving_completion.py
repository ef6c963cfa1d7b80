"""``POST /v1/completions``: OpenAI completion responses and their SSE stream
over the frontend (prompts as text, token ids or a batch; ``echo``, ``logprobs``).

With ``echo``, the returned text starts with the prompt decoded from its
tokens, and ``logprobs`` covers the prompt's tokens too (the first None),
computed in the prefill's forward; ``max_tokens: 0`` with ``echo`` scores the
prompt alone, as harnesses (lm-eval's ``local-completions``) and vLLM do.
``prompt_logprobs`` (vLLM) adds the per-position candidates to each choice.

Transport-neutral: the response is a ``CompletionResponse``, or, when
streaming, a ``ChunkStream`` of them (one choice each) or of their JSON text
(``chunks``); ``prepare`` is the checking and building that gRPC's
``Generate`` shares.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from pagedserve.workers.lora.lora_request import LoRARequest
from pagedserve.workers.outputs.request_output import CompletionOutput, RequestOutput
from pagedserve.workers.sample.sampling_params import SamplingParams

from .chunks import CompletionChunkJSON, CompletionChunkModels
from .errors import APIError
from .frontend import Frontend, Generation, PromptInput
from .logprobs import LogprobFormatter, TextOffsets
from .protocol import (DEFAULT_MAX_TOKENS, CompletionChoice, CompletionLogprobs, CompletionRequest,
                       CompletionResponse, Usage)
from .streaming import ChunkStream, generation_batches
from .structured import output_constraint


@dataclass
class _Echo:
    """A prompt as echoed: its text and where each of its tokens starts in it."""

    text: str = ""
    offsets: list[int] = field(default_factory=list)


@dataclass
class _Cursor:
    """Where one choice of a streamed response stands."""

    offsets: TextOffsets | None = None
    is_started: bool = False
    is_finished: bool = False


class ServingCompletion:
    """Answers completion requests for one ``Frontend``."""

    def __init__(self, frontend: Frontend) -> None:
        self.frontend = frontend
        self.logprobs = LogprobFormatter(frontend.tokenizer)

    def _echo(self, request: CompletionRequest, prompt: PromptInput) -> _Echo:
        if not request.echo:
            return _Echo()
        offsets = TextOffsets(self.frontend.tokenizer, skip_special_tokens=request.skip_special_tokens,
                              spaces_between_special_tokens=request.spaces_between_special_tokens)
        positions = [offsets.add(token_id) for token_id in prompt.token_ids]
        return _Echo(offsets.finish(), positions)

    def _choice_logprobs(self, request: CompletionRequest, prompt: PromptInput, echo: _Echo,
                         output: RequestOutput, completion: CompletionOutput, cursor: _Cursor,
                         is_first: bool, is_scoring_only: bool) -> CompletionLogprobs | None:
        """This chunk's entries (all of them when not streaming): the echoed prompt's the first
        time, then the completion's tokens: all so far in the first chunk (it catches up when it
        waited for the prompt's logprobs), the output's delta after."""
        if request.logprobs is None:
            return None
        samples, offsets, token_ids = [], [], []
        if is_first and request.echo:
            samples += _prompt_entries(output, prompt)
            offsets += echo.offsets
            token_ids += prompt.token_ids
        if not is_scoring_only:
            new = (completion.logprobs if is_first else completion.delta_logprobs) or []
            if cursor.offsets is None:
                cursor.offsets = TextOffsets(self.frontend.tokenizer, prompt.token_ids, len(echo.text),
                                             request.skip_special_tokens, request.spaces_between_special_tokens)
            samples += new
            offsets += [cursor.offsets.add(sample.token_id) for sample in new]
            token_ids += [sample.token_id for sample in new]
        return self.logprobs.completion(samples, offsets, token_ids, bool(request.return_tokens_as_token_ids))

    def prepare(self, request: CompletionRequest) -> tuple[list[PromptInput], SamplingParams, LoRARequest | None]:
        """Check ``request`` and build its prompts, sampling params and the LoRA adapter its
        ``model`` names (``APIError`` naming what is wrong); what both transports run before a
        completion starts."""
        frontend = self.frontend
        lora_request = frontend.resolve_model(request.model)
        if request.best_of is not None and request.best_of != request.n:
            raise APIError(400, "best_of must equal n (or be unset)", param="best_of")
        is_scoring_only = request.max_tokens == 0
        if is_scoring_only and not request.echo:
            raise APIError(400, "max_tokens must be >= 1 (0 only with echo, to score the prompt)",
                           param="max_tokens")
        prompts_in = request.prompts()
        if not prompts_in:
            raise APIError(400, "the prompt is empty", param="prompt")
        prompts = [frontend.tokenize(p, truncate_prompt_tokens=request.truncate_prompt_tokens)
                   for p in prompts_in]
        frontend.check_output_fits(prompts, request.max_tokens or None, request.min_tokens)
        prompt_logprobs = request.prompt_logprobs
        if request.echo and request.logprobs is not None:
            prompt_logprobs = max(prompt_logprobs or 0, request.logprobs)
        # Scoring only: one token is sampled from the prefill's own logits (no extra forward) and dropped.
        max_tokens = 1 if is_scoring_only else (request.max_tokens or DEFAULT_MAX_TOKENS)
        params = frontend.sampling_params(request, max_tokens, request.logprobs, output_constraint(request),
                                          prompt_logprobs)
        return prompts, params, lora_request

    async def create_completion(self, request: CompletionRequest, client: str = ""
                                ) -> CompletionResponse | ChunkStream:
        """The response body, or a ``ChunkStream`` of ``CompletionResponse`` when ``stream`` is set."""
        frontend = self.frontend
        prompts, params, lora_request = self.prepare(request)
        is_scoring_only = request.max_tokens == 0
        echoes = [self._echo(request, p) for p in prompts]
        # The engine's ids are always the server's own (clients' ids may collide); vLLM's
        # request_id names the response.
        engine_id = f"cmpl-{uuid.uuid4().hex}"
        request_id = request.request_id or engine_id
        generation, first = await frontend.start_generation(engine_id, prompts, params, request.priority, client,
                                                            is_streamed=bool(request.stream),
                                                            lora_request=lora_request,
                                                            token_by_token=request.streams_token_by_token)
        if request.stream:
            return ChunkStream(lambda as_json: self._stream_completion(request, request_id, generation, first,
                                                                       echoes, is_scoring_only, as_json),
                               generation)
        await generation.run_to_end(first)
        choices = []
        n = params.n
        for index, progress in enumerate(generation.progress):
            output = progress.last
            for completion in (output.outputs if output else []):
                logprobs = self._choice_logprobs(request, prompts[index], echoes[index], output, completion,
                                                 _Cursor(), True, is_scoring_only)
                text = echoes[index].text + ("" if is_scoring_only else completion.text)
                choice = CompletionChoice(
                    index=index * n + completion.index, text=text, logprobs=logprobs,
                    finish_reason="length" if is_scoring_only else completion.finish_reason,
                    stop_reason=None if is_scoring_only else completion.stop_reason,
                    prompt_logprobs=self._prompt_logprobs(request, output, prompts[index]))
                if request.return_token_ids:
                    choice.prompt_token_ids = prompts[index].token_ids
                    choice.token_ids = [] if is_scoring_only else completion.token_ids
                choices.append(choice)
        choices.sort(key=lambda c: c.index)
        return CompletionResponse(id=request_id, model=frontend.response_model(lora_request), choices=choices,
                                  usage=self._usage(generation, is_scoring_only))

    def _prompt_logprobs(self, request: CompletionRequest, output: RequestOutput, prompt: PromptInput):
        if request.prompt_logprobs is None:
            return None
        return self.logprobs.prompt(_prompt_entries(output, prompt))

    @staticmethod
    def _usage(generation: Generation, is_scoring_only: bool) -> Usage:
        usage = generation.usage()
        if is_scoring_only:
            usage.completion_tokens = 0
            usage.total_tokens = usage.prompt_tokens
        return usage

    def _stream_completion(self, request: CompletionRequest, request_id: str, generation: Generation, first,
                           echoes: list[_Echo], is_scoring_only: bool, as_json: bool) -> AsyncIterator[list]:
        """The stream's chunks, one list per output (``ChunkStream.batches``)."""
        cursors: dict[int, _Cursor] = {}
        n = generation.params.n
        prompts = generation.prompts
        encoder = (CompletionChunkJSON if as_json else CompletionChunkModels)(
            request_id, int(time.time()), self.frontend.response_model(generation.lora_request))
        needs_prompt_logprobs = request.echo and request.logprobs is not None or request.prompt_logprobs is not None
        has_logprobs = request.logprobs is not None
        has_token_ids = bool(request.return_token_ids)
        is_continuous_usage = request.continuous_usage

        def chunks(index: int, output: RequestOutput) -> list:
            batch = []
            for completion in output.outputs:
                key = index * n + completion.index
                cursor = cursors.get(key)
                if cursor is None:
                    cursor = cursors[key] = _Cursor()
                if cursor.is_finished:
                    continue
                if not cursor.is_started and needs_prompt_logprobs and output.prompt_logprobs is None:
                    continue  # the prompt's logprobs come with its first chunk
                # A choice's first chunk catches up with everything before it (text, logprobs,
                # token ids); until a chunk is sent, the next output's is the first.
                is_first = not cursor.is_started
                prompt = prompts[index]
                text = echoes[index].text if is_first else ""
                logprobs = self._choice_logprobs(request, prompt, echoes[index], output, completion, cursor,
                                                 is_first, is_scoring_only) if has_logprobs else None
                finish_reason = completion.finish_reason
                token_ids = None
                if is_scoring_only:
                    finish_reason = "length"
                else:
                    text += completion.text if is_first else completion.delta_text
                    if has_token_ids:
                        token_ids = completion.token_ids if is_first else completion.delta_token_ids
                is_finished = finish_reason is not None
                if not (text or is_finished or token_ids or (logprobs and logprobs.tokens)):
                    continue
                cursor.is_started, cursor.is_finished = True, is_finished
                batch.append(encoder.choice(
                    key, text, finish_reason, None if is_scoring_only else completion.stop_reason, logprobs,
                    prompt_logprobs=self._prompt_logprobs(request, output, prompt) if is_first else None,
                    token_ids=(token_ids or []) if has_token_ids else None,
                    prompt_token_ids=prompt.token_ids if has_token_ids and is_first else None,
                    usage=self._usage(generation, is_scoring_only) if is_continuous_usage else None))
            return batch

        def usage() -> list:
            return [encoder.usage(self._usage(generation, is_scoring_only))] if request.include_usage else []

        return generation_batches(generation, first, chunks, usage)


def _prompt_entries(output: RequestOutput, prompt: PromptInput) -> list:
    """The prompt's logprobs, one per prompt token (a resumed run also scored its output tokens)."""
    if output.prompt_logprobs is None or len(output.prompt_logprobs) < len(prompt.token_ids):
        raise APIError(500, "the prompt's logprobs are missing from the generation's output",
                       "internal_server_error")
    return list(output.prompt_logprobs[:len(prompt.token_ids)])
