"""The transport-neutral frontend: what HTTP and gRPC share.

``Frontend`` (one per Serve replica, over a ``ClusterHandle``) checks the
model name and the prompt (the single prompt check: non-empty, within the
context, token ids in the vocabulary), builds prompts (text, token ids, chat
template) and ``SamplingParams`` within ``server.limits``, admits requests
(``limits``), and starts a ``Generation``: the merged output stream of one API
request's prompts, with the request's deadline and idle timeout. It also
answers health, stats and metrics.

Prompts and completions are logged only with ``server.log_requests``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedserve.workers.lora.adapter_source import AdapterSourceError
from pagedserve.workers.lora.lora_request import LoRARequest
from pagedserve.workers.offline.chat_template import (ChatTemplateError, render_conversation, template_message,
                                                      template_reads)
from pagedserve.workers.process.gc_heap import GCPauses
from pagedserve.workers.outputs.request_output import RequestOutput
from pagedserve.workers.sample.generation_defaults import sampling_defaults
from pagedserve.workers.sample.sampling_params import SamplingParams, StructuredOutputsParams

from .. import ray_compat
from ..config import ServerConfig
from ..lora_adapters import LoRAAdapters
from ..response_store import BackgroundRuns
from ..stats import gather_stats
from .auth import API_KEY_ENV, check_api_key, is_open_path
from .errors import APIError, error_from_exception, timeout_error
from .limits import ClientLimiter, RequestLimiter
from .metrics import ServerMetrics
from .protocol import ChatCompletionRequest, ModelCard, ModelList, Usage
from .prompt_encoder import PromptEncoder

logger = logging.getLogger("pagedserve.server")


def check_unicode(text: str, param: str) -> None:
    """400 unless ``text`` is valid Unicode (no lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(400, f"{param} is not valid Unicode (it holds a lone surrogate)", param=param) from None


def _enable_request_logging() -> None:
    """Make the request log reach stderr (the replica's log file under Ray) at INFO."""
    logger.setLevel(logging.INFO)
    if not any(getattr(h, "is_request_log", False) for h in logger.handlers):
        handler = logging.StreamHandler()
        handler.is_request_log = True
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s -- %(message)s"))
        logger.addHandler(handler)


# Model types whose chat replies come in a format of their own: the reasoning parser and the tool-call
# parser that read it, wherever the configuration leaves them unset (vLLM reads gpt-oss's harmony always).
REPLY_FORMATS = {"gpt_oss": ("openai_gptoss", "openai")}


def _model_config(model_path: str) -> dict:
    """The checkpoint's config.json (empty where there is none to read: a hub id, say)."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def _model_vocab_size(model_config: dict, tokenizer) -> int:
    vocab = model_config.get("vocab_size") or (model_config.get("text_config") or {}).get("vocab_size")
    return int(vocab) if vocab else len(tokenizer)


def _with_reply_format(config: ServerConfig, model_type: str | None) -> ServerConfig:
    """``config`` with the parsers of ``model_type``'s reply format where it leaves them unset."""
    if model_type not in REPLY_FORMATS:
        return config
    reasoning_parser, tool_call_parser = REPLY_FORMATS[model_type]
    update = {}
    if config.reasoning_parser is None:
        update["reasoning_parser"] = reasoning_parser
    if "tool_call_parser" not in config.model_fields_set and config.reasoning_parser in (None, reasoning_parser):
        update["tool_call_parser"] = tool_call_parser
    if update:
        logger.info("model type %s writes its replies in a format of its own: %s", model_type,
                    ", ".join(f"server.{name} {value!r}" for name, value in update.items()))
    return config.model_copy(update=update)


@dataclass
class PromptInput:
    """One prompt, tokenized; ``text`` is None when it was sent as token ids."""

    text: str | None
    token_ids: list[int]


@dataclass
class _PromptProgress:
    arrival: float
    first_token: float | None = None
    last: RequestOutput | None = None
    # When each sample's latest tokens arrived, and how many it had (inter-token latency).
    token_times: dict[int, tuple[float, int]] = dataclasses.field(default_factory=dict)


# Put in a request's queue when its wait for the next item ran out.
_EXPIRED = object()


async def _failed(exc: Exception) -> AsyncIterator[RequestOutput]:
    """A stream that fails with ``exc`` at once."""
    raise exc
    yield  # pragma: no cover - makes this an async generator


class Generation:
    """The merged output stream of one API request's prompts.

    ``__anext__`` yields ``(prompt_index, RequestOutput)`` in arrival order and
    raises ``APIError`` for a failed generation, or 408 past the request's
    deadline or after an idle spell. A single prompt's stream from
    ``ClusterHandle.generate`` is read directly; several prompts stream each
    in its own task into one queue. ``aclose`` (idempotent) cancels what still
    runs, which aborts it on the worker, and frees the request's limiter slot.
    """

    def __init__(self, server: "Frontend", request_id: str, prompts: list[PromptInput],
                 params: SamplingParams, priority: int, client: str = "", is_streamed: bool = False,
                 lora_request: LoRARequest | None = None, token_by_token: bool = False) -> None:
        self.server = server
        self.lora_request = lora_request
        self.request_id = request_id
        self.prompts = prompts
        self.params = params
        self.priority = priority
        self.client = client
        self.is_streamed = is_streamed  # the client gets deltas as they come (see ClusterHandle.generate)
        self.token_by_token = token_by_token   # an output per new token
        self.progress = [_PromptProgress(time.time()) for _ in prompts]
        self.deadline = time.monotonic() + server.limits.request_timeout_s
        self._has_output = False
        self._queue: asyncio.Queue = asyncio.Queue()
        # A single prompt's output stream, read directly (no task, no queue: one wake-up per output).
        self._stream: AsyncIterator[RequestOutput] | None = None
        # The task awaiting the single prompt's next output, and whether its wait ran out.
        self._waiter: asyncio.Task | None = None
        self._is_expired = False
        # The wait for the next item ends by this time (monotonic), and whether that bound is the idle
        # timeout (not the deadline); None while not waiting. One timer checks it (``_check_wait``).
        self._wait_expiry: float | None = None
        self._wait_is_idle_bound = False
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self._num_live = len(prompts)
        self._tasks: list[asyncio.Task] = []
        self._is_closed = False
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        # Kept: ``asyncio.get_running_loop`` makes a system call (getpid) on each call in Python 3.11.
        self._loop = asyncio.get_running_loop()
        if len(self.prompts) == 1:
            try:
                self._stream = self._open(0, self.prompts[0])
            except Exception as exc:  # reported by the first ``__anext__``, as a failed stream is
                self._stream = _failed(exc)
            return
        for index, prompt in enumerate(self.prompts):
            self._tasks.append(asyncio.create_task(self._pump(index, prompt)))

    def _open(self, index: int, prompt: PromptInput) -> AsyncIterator[RequestOutput]:
        return self.server.handle.generate(prompt.text, self._fitted(prompt), f"{self.request_id}-{index}",
                                           self.priority, prompt_token_ids=prompt.token_ids,
                                           is_streamed=self.is_streamed, lora_request=self.lora_request,
                                           token_by_token=self.token_by_token)

    async def _pump(self, index: int, prompt: PromptInput) -> None:
        # Whatever fails here reaches the consumer, and the end marker always follows: a prompt
        # whose stream never started must not leave the request waiting for it.
        try:
            async with aclosing(self._open(index, prompt)) as stream:
                async for output in stream:
                    self._queue.put_nowait((index, output))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # reported to the consumer, which maps it to an APIError
            self._queue.put_nowait((index, exc))
        finally:
            self._queue.put_nowait((index, None))

    def _fitted(self, prompt: PromptInput) -> SamplingParams:
        """The request's params with ``max_tokens`` (a default, since ``Frontend.check_output_fits``
        refused a stated one that does not fit) cut to what the context leaves after ``prompt``:
        the engine would stop there anyway, and routing estimates stay honest."""
        room = self.server.max_model_len - len(prompt.token_ids)
        params = self.params
        if params.max_tokens > room:
            params = dataclasses.replace(params, max_tokens=room, min_tokens=min(params.min_tokens, room))
        return params

    def __aiter__(self) -> "Generation":
        return self

    def _arm_wait(self) -> None:
        """Bound the wait that starts now: by the idle timeout once there was output (if it comes
        before the deadline), else by the deadline.

        Most waits last one engine step, so no wait has a timer of its own: one timer per request
        checks the current wait when it fires, and sets itself again for that wait's end."""
        limits = self.server.limits
        now = time.monotonic()
        self._wait_is_idle_bound = self._has_output and now + limits.stream_idle_timeout_s < self.deadline
        self._wait_expiry = now + limits.stream_idle_timeout_s if self._wait_is_idle_bound else self.deadline
        if self._timer is None or self._timer_at > self._wait_expiry:
            self._set_timer(self._wait_expiry)

    def _timeout(self) -> APIError:
        """The 408 for the wait that ran out."""
        limits = self.server.limits
        if self._wait_is_idle_bound:
            return timeout_error(f"no output for {limits.stream_idle_timeout_s:g} s; the request was "
                                 "aborted", "stream_idle_timeout")
        return timeout_error(f"the request took longer than {limits.request_timeout_s:g} s and was "
                             "aborted", "request_timeout")

    async def _next_item(self) -> tuple[int, Any]:
        """The next queued item (several prompts); 408 when the wait runs out."""
        if self._queue.empty():
            self._arm_wait()
            try:
                item = await self._queue.get()
            finally:
                self._wait_expiry = None
        else:
            item = self._queue.get_nowait()
        if item is _EXPIRED:
            raise self._timeout()
        return item

    def _set_timer(self, at: float) -> None:
        """Set the timer for ``at`` (``time.monotonic()``'s clock); if the loop runs it a little
        early, ``_check_wait`` sets it again."""
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = at
        self._timer = self._loop.call_later(max(at - time.monotonic(), 0.0), self._check_wait)

    def _check_wait(self) -> None:
        """The timer fired: end the current wait if it has run out, else set the timer for its end."""
        self._timer = None
        if self._wait_expiry is None or self._is_closed:
            return  # not waiting: the next wait sets the timer
        if time.monotonic() < self._wait_expiry or not self._queue.empty():
            self._set_timer(self._wait_expiry)  # a later wait, or an item the consumer has yet to take
            return
        if self._stream is None:
            self._queue.put_nowait(_EXPIRED)
        elif self._waiter is not None:
            self._is_expired = True
            self._waiter.cancel()

    async def __anext__(self) -> tuple[int, RequestOutput]:
        if self._stream is None:
            return await self._next_merged()
        if self._num_live == 0:
            raise StopAsyncIteration
        # The single prompt's next output. When the wait runs out, the timer cancels this task
        # (which closes the stream: the request is aborted), and the wait ends with a 408.
        self._arm_wait()
        task = self._waiter = asyncio.current_task(self._loop)
        num_cancelling = task.cancelling()
        try:
            output = await anext(self._stream)
        except asyncio.CancelledError:
            # Ours alone (not also the task's own cancellation, say the client leaving): a timeout.
            if self._is_expired and task.uncancel() <= num_cancelling:
                self._num_live = 0
                raise self._timeout() from None
            raise
        except StopAsyncIteration:
            self._num_live = 0
            raise
        except Exception as exc:  # the stream ended with it
            self._num_live = 0
            raise error_from_exception(exc) from None
        finally:
            self._wait_expiry = None
            self._waiter = None
        if self._is_expired:  # the output came as the wait ran out, and the stream swallowed the cancellation
            self._is_expired = False
            task.uncancel()
        self._observe(0, output)
        return 0, output

    async def _next_merged(self) -> tuple[int, RequestOutput]:
        """The next output of several prompts' streams."""
        while True:
            if self._num_live == 0:
                raise StopAsyncIteration
            index, item = await self._next_item()
            if item is None:
                self._num_live -= 1
                continue
            if isinstance(item, BaseException):
                raise error_from_exception(item)
            self._observe(index, item)
            return index, item

    def _observe(self, index: int, output: RequestOutput) -> None:
        self._has_output = True
        progress = self.progress[index]
        progress.last = output
        now = time.time()
        metrics = self.server.metrics
        token_times = progress.token_times
        for completion in output.outputs:
            num_tokens = completion.num_tokens
            previous = token_times.get(completion.index)
            if previous is None:
                if num_tokens:  # the sample's first tokens
                    token_times[completion.index] = (now, num_tokens)
                    if progress.first_token is None:
                        progress.first_token = now
            elif num_tokens > previous[1]:
                metrics.observe_inter_token(now - previous[0], num_tokens - previous[1])
                token_times[completion.index] = (now, num_tokens)
        if output.finished:
            self.server.log_completion(f"{self.request_id}-{index}", output)
            timings = output.metrics
            metrics.observe_generation(
                progress.arrival, progress.first_token, now, len(output.prompt_token_ids),
                timings.num_cached_tokens if timings else 0,
                sum(c.num_tokens for c in output.outputs),
                [c.finish_reason or "" for c in output.outputs], max_tokens=self.params.max_tokens,
                max_sample_tokens=max((c.num_tokens for c in output.outputs), default=0))
            if timings is not None:
                metrics.observe_phases(timings.arrival_time, timings.first_scheduled_time,
                                       timings.first_token_time, timings.finished_time)

    async def run_to_end(self, first) -> None:
        """Consume every output (``first`` being what ``start_generation`` returned), then close."""
        try:
            if first is not None:
                async for _ in self:
                    pass
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        if self._is_closed:
            return
        self._is_closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.server.release_slots(len(self.prompts), self.client)
        if self._stream is not None:
            waiter = self._waiter
            if waiter is not None and waiter is not asyncio.current_task():
                waiter.cancel()  # it waits in another task: its cancellation closes the stream
                return
            if self._num_live:  # not yet ended: close it, which aborts the request
                self._num_live = 0
                try:
                    await asyncio.shield(self._stream.aclose())
                except asyncio.CancelledError:
                    pass
            return
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            try:
                await asyncio.shield(asyncio.gather(*self._tasks, return_exceptions=True))
            except asyncio.CancelledError:
                pass

    def usage(self) -> Usage:
        """Token counts so far, over all prompts and samples."""
        usage = Usage()
        for prompt, progress in zip(self.prompts, self.progress):
            usage.prompt_tokens += len(prompt.token_ids)
            if progress.last is not None:
                usage.completion_tokens += sum(c.num_tokens for c in progress.last.outputs)
                if progress.last.metrics is not None:
                    usage.prompt_tokens_details.cached_tokens += progress.last.metrics.num_cached_tokens
        usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
        return usage


class Frontend:
    """The API's transport-neutral logic over a ``ClusterHandle``; ``http_app.build_app`` and
    ``grpc_service.GrpcService`` put their transports on it.

    One instance per Serve replica. ``server_config`` supplies the API key
    (else ``$PAGEDSERVE_API_KEY``) and the limits.
    """

    def __init__(self, handle, server_config: ServerConfig | None = None) -> None:
        self.handle = handle
        model_config = _model_config(handle.model_path)
        self.config = _with_reply_format(server_config or ServerConfig(), model_config.get("model_type"))
        self.limits = self.config.limits
        self.api_key = self.config.api_key or os.environ.get(API_KEY_ENV) or None
        self.model_name = handle.model_name
        # The LoRA adapters clients may name as "model" (``model.lora_modules``,
        # ``model.dynamic_lora_loading_path``'s and those loaded at run time): the handle's own.
        adapters = getattr(handle, "adapters", None)
        self.adapters: LoRAAdapters = adapters if adapters is not None else LoRAAdapters()
        self.max_model_len = handle.max_model_len
        # Some worker speculates: beam search is refused (``ClusterConfig.speculates``).
        self.speculates = bool(getattr(getattr(handle, "config", None), "speculates", False))
        self.tokenizer = handle.tokenizer
        self.prompt_encoder = PromptEncoder(self.tokenizer)
        self.vocab_size = _model_vocab_size(model_config, self.tokenizer)
        # What a request that leaves a sampling field out gets (vLLM's --generation-config).
        self.sampling_defaults = sampling_defaults(handle.model_path, self.config.generation_config,
                                                   self.config.override_generation_config)
        if self.sampling_defaults:
            logger.info("sampling defaults from the model's generation config: %s (server.generation_config "
                        "'vllm' for OpenAI's)", self.sampling_defaults)
        # Where the Responses API keeps finished responses (``server.store_responses``): the cluster's one store.
        self.response_store = (handle.response_store(self.config.max_stored_responses,
                                                     self.config.max_stored_response_bytes)
                               if self.config.store_responses else None)
        self.background_runs = BackgroundRuns(self.response_store) if self.response_store is not None else None
        self.limiter = RequestLimiter(self.limits.max_queued_requests)
        self.client_limiter = ClientLimiter(self.limits.max_requests_per_client)
        self.metrics = ServerMetrics(self.model_name)
        # The process's garbage-collection timer, where it serves (the Serve replica sets it).
        self.gc_pauses: GCPauses | None = None
        if self.config.log_requests:
            _enable_request_logging()

    # ---- request logging (off unless server.log_requests) ------------------------------------
    def log_prompts(self, request_id: str, prompts: list[PromptInput], params: SamplingParams) -> None:
        if self.config.log_requests:
            for index, prompt in enumerate(prompts):
                logger.info("request %s-%d: prompt %r (%d tokens), %s", request_id, index,
                            prompt.text if prompt.text is not None else prompt.token_ids,
                            len(prompt.token_ids), params)

    def log_completion(self, request_id: str, output: RequestOutput) -> None:
        if self.config.log_requests:
            for completion in output.outputs:
                logger.info("request %s: completion %d %r (%s)", request_id, completion.index,
                            completion.text, completion.finish_reason)

    def is_open_path(self, path: str) -> bool:
        """True for the routes that answer without the API key."""
        return is_open_path(path, self.config.metrics_require_api_key)

    # ---- checks --------------------------------------------------------------------------
    def check_auth(self, authorization: str | None) -> None:
        check_api_key(self.api_key, authorization)

    def resolve_model(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter ``model`` names (by its name, or as "BASE:NAME", Ray Serve LLM's
        form); None for the base model (or no model). 404 for a model this server does not
        serve, worded so that both Ray Serve LLM's ("Could not find model") and vLLM's ("The
        model `x` does not exist.") clients recognise it. 503 when the adapter would be looked
        up in a ``dynamic_lora_loading_path`` that cannot be read now."""
        if not model or model == self.model_name:
            return None
        adapter = None
        if self.adapters:
            base, sep, name = model.rpartition(":")
            try:
                adapter = self.adapters.get(name) if sep and base == self.model_name else self.adapters.get(model)
            except AdapterSourceError as exc:
                raise APIError(503, f"model '{model}': {exc}", type="service_unavailable", param="model",
                               code="adapter_source_unavailable") from None
        if adapter is not None:
            return adapter
        known = self.adapters.known()
        served = f"'{self.model_name}'" + (f" and its adapters {', '.join(map(repr, known))}" if known else "")
        raise APIError(404, f"Could not find model '{model}': the model `{model}` does not exist; "
                            f"this server serves {served}", param="model", code="model_not_found")

    def response_model(self, lora_request: LoRARequest | None) -> str:
        """The "model" of a response: the adapter's name, else the served model's (vLLM's)."""
        return self.model_name if lora_request is None else lora_request.lora_name

    def check_output_fits(self, prompts: list[PromptInput], max_tokens: int | None, min_tokens: int,
                          max_tokens_param: str = "max_tokens") -> None:
        """400 when the longest prompt plus the ``max_tokens`` the client stated (None: it stated
        none), or plus ``min_tokens``, exceeds the context: the request could never finish as
        asked. vLLM and OpenAI refuse these too; the message names the field and both numbers."""
        num_prompt_tokens = max(len(prompt.token_ids) for prompt in prompts)
        room = self.max_model_len - num_prompt_tokens
        for value, param in ((max_tokens, max_tokens_param), (min_tokens, "min_tokens")):
            if value is not None and value > room:
                raise APIError(400, f"'{param}' is too large: {value}. This model's maximum context length "
                                    f"is {self.max_model_len} tokens and your request has {num_prompt_tokens} "
                                    f"input tokens ({value} > {self.max_model_len} - {num_prompt_tokens})",
                               param=param, code="context_length_exceeded")

    def check_prompt(self, token_ids: list[int], param: str = "prompt") -> None:
        if not token_ids:
            raise APIError(400, "the prompt is empty", param=param)
        if len(token_ids) >= self.max_model_len:
            raise APIError(400, f"the prompt has {len(token_ids)} tokens, but this model's maximum context "
                                f"length is {self.max_model_len} tokens (prompt plus at least one output "
                                f"token)", param=param, code="context_length_exceeded")
        bad = [t for t in token_ids if isinstance(t, bool) or not isinstance(t, int)
               or not 0 <= t < self.vocab_size]
        if bad:
            raise APIError(400, f"prompt token ids must be integers in [0, {self.vocab_size}); got "
                                f"{bad[:5]}", param=param)

    def tokenize(self, prompt: str | list[int], param: str = "prompt",
                 truncate_prompt_tokens: int | None = None) -> PromptInput:
        if isinstance(prompt, str):
            check_unicode(prompt, param)
            token_ids = self.prompt_encoder.encode(prompt)
            text = prompt
        else:
            token_ids, text = list(prompt), None
        return self._truncated(PromptInput(text, token_ids), truncate_prompt_tokens, param)

    def _truncated(self, prompt: PromptInput, truncate_prompt_tokens: int | None, param: str) -> PromptInput:
        """Keep the last ``truncate_prompt_tokens`` tokens (-1: as many as the context allows), then check."""
        if truncate_prompt_tokens is not None:
            keep = self.max_model_len - 1 if truncate_prompt_tokens == -1 else truncate_prompt_tokens
            if len(prompt.token_ids) > keep:
                prompt = PromptInput(None, prompt.token_ids[len(prompt.token_ids) - keep:])
        self.check_prompt(prompt.token_ids, param)
        return prompt

    def chat_prompt(self, request: ChatCompletionRequest) -> PromptInput:
        """The rendered conversation (``render_chat``), truncated as the request asks and checked
        against the model's context."""
        return self._truncated(self.render_chat(request), request.truncate_prompt_tokens, "messages")

    def render_chat(self, request) -> PromptInput:
        """The rendered conversation: messages (assistant tool calls and tool results included),
        the request's tools and ``chat_template_kwargs`` through the tokenizer's chat template
        (``workers.offline.chat_template``); ``request`` is a chat completion's or a ``/tokenize`` request's."""
        template_kwargs = request.chat_template_kwargs
        effort = getattr(request, "reasoning_effort", None)
        documents = getattr(request, "documents", None)
        if documents:
            self._check_template_reads("documents", bool(request.tools), "documents")
        if effort is not None:
            self._check_template_reads("reasoning_effort", bool(request.tools), "a reasoning effort")
            if (template_kwargs or {}).get("reasoning_effort", effort) != effort:
                raise APIError(400, "reasoning_effort and chat_template_kwargs.reasoning_effort differ",
                               param="reasoning_effort")
            template_kwargs = {**(template_kwargs or {}), "reasoning_effort": effort}
        try:
            messages = [self._template_message(message) for message in request.messages]
            text = render_conversation(
                self.tokenizer, messages, add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message,
                tools=request.tool_specs,
                chat_template_kwargs=template_kwargs, chat_template=self.config.chat_template, documents=documents)
        except ChatTemplateError as exc:
            if not self._chat_template():
                raise APIError(400, f"the model '{self.model_name}' has no chat template (server.chat_template, "
                                    "--chat-template, gives it one); use /v1/completions",
                               param="messages") from None
            raise APIError(400, str(exc), param=exc.param) from None
        # The template writes the special tokens; add_special_tokens (vLLM) adds the tokenizer's too.
        return PromptInput(text, self.prompt_encoder.encode(text, add_special_tokens=request.add_special_tokens))

    def _chat_template(self):
        """The template chats render with: ``server.chat_template``, else the tokenizer's (None: neither)."""
        return self.config.chat_template or getattr(self.tokenizer, "chat_template", None)

    def _check_template_reads(self, variable: str, with_tools: bool, what: str) -> None:
        """A request field the chat template's ``variable`` carries (``reasoning_effort``,
        ``documents``): a 400 naming it where the template the request renders with does not
        read that variable, which would leave the field silently unused."""
        if not template_reads(self._chat_template(), variable, with_tools):
            whose = {"reasoning_effort": "a reasoning model's template, gpt-oss's say",
                     "documents": "a retrieval template, Command R's or Granite's say"}[variable]
            raise APIError(400, f"the chat template of '{self.model_name}' does not read {variable}, so {what} "
                                f"cannot be honoured ({whose}, reads it)", param=variable)

    @staticmethod
    def _template_message(message) -> dict[str, Any]:
        check_unicode(message.text() + (message.name or ""), "messages")
        for call in message.tool_calls or ():
            check_unicode(call.function.name + call.function.arguments, "messages")
        return template_message(message.model_dump(exclude_none=True))

    def sampling_params(self, request, max_tokens: int, logprobs: int | None,
                        structured_outputs: StructuredOutputsParams | None = None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        """The engine's options for ``request`` (either API's fields), 400 naming a bad one.

        ``truncate_prompt_tokens`` is applied by ``tokenize``/``chat_prompt``, so the
        prompt's token count (usage, limits) is the truncated one.
        """
        if request.n > self.limits.max_n:
            raise APIError(400, f"n must be <= {self.limits.max_n}, got {request.n}", param="n")
        stop = request.stop_strings
        if len(stop) > self.limits.max_stop_strings:
            raise APIError(400, f"at most {self.limits.max_stop_strings} stop strings are allowed, got "
                                f"{len(stop)}", param="stop")
        for text in stop:
            check_unicode(text, "stop")
        if request.streams_token_by_token and request.use_beam_search:
            raise APIError(400, "stream_options.token_by_token cannot be honoured with beam search: its "
                                "beams' text is its engine's", param="stream_options.token_by_token")
        if request.use_beam_search and self.speculates:
            raise APIError(400, "use_beam_search cannot be combined with speculative decoding, which this "
                                "server runs (engine.speculative_config)", param="use_beam_search")
        # Beam search samples nothing: the model's sampling defaults do not apply to it.
        defaults = {} if request.use_beam_search else self.sampling_defaults
        given = request.model_fields_set
        temperature = request.temperature
        if temperature is None:
            temperature = 0.0 if request.use_beam_search else defaults.get("temperature", 1.0)
        min_p, repetition_penalty = request.min_p, request.repetition_penalty
        if "min_p" not in given:
            min_p = defaults.get("min_p", min_p)
        if "repetition_penalty" not in given:
            repetition_penalty = defaults.get("repetition_penalty", repetition_penalty)
        try:
            params = SamplingParams(
                n=request.n, max_tokens=max_tokens, temperature=temperature,
                top_p=defaults.get("top_p", 1.0) if request.top_p is None else request.top_p,
                top_k=defaults.get("top_k") if request.top_k is None else request.top_k,
                min_p=min_p, seed=request.seed, presence_penalty=request.presence_penalty,
                frequency_penalty=request.frequency_penalty, repetition_penalty=repetition_penalty,
                stop=stop, stop_token_ids=request.stop_token_ids, ignore_eos=request.ignore_eos,
                logprobs=logprobs, skip_special_tokens=request.skip_special_tokens,
                spaces_between_special_tokens=request.spaces_between_special_tokens,
                include_stop_str_in_output=request.include_stop_str_in_output,
                min_tokens=request.min_tokens, prompt_logprobs=prompt_logprobs,
                structured_outputs=structured_outputs, use_beam_search=request.use_beam_search,
                length_penalty=request.length_penalty, early_stopping=request.early_stopping,
                logit_bias=request.logit_bias or None, allowed_token_ids=request.allowed_token_ids,
                bad_words=request.bad_words, cache_salt=request.cache_salt)
            params.check_token_ids(self.vocab_size)
            return params
        except ValueError as exc:
            raise APIError(400, str(exc), param=str(exc).split(" ", 1)[0]) from None

    # ---- generation ------------------------------------------------------------------------
    def release_slots(self, num_requests: int, client: str = "") -> None:
        """Free the limiter slots of a finished or abandoned request."""
        self.limiter.release(num_requests)
        self.client_limiter.release(client, num_requests)
        self.metrics.set_in_flight(self.limiter.num_in_flight)

    async def start_generation(self, request_id: str, prompts: list[PromptInput], params: SamplingParams,
                               priority: int, client: str = "", is_streamed: bool = False,
                               lora_request: LoRARequest | None = None, token_by_token: bool = False
                               ) -> tuple[Generation, tuple[int, RequestOutput] | None]:
        """Admit the request (429 when the replica or ``client`` is full), start it, await its first output.
        ``token_by_token``: an output per new token (``ClusterHandle.generate``).

        Returns the running generation and its first item (None if it ended
        without output). Failures before the first output raise ``APIError``,
        so a streamed response can still get a proper status.
        """
        max_batch = min(self.limits.max_queued_requests, self.limits.max_requests_per_client)
        if len(prompts) > max_batch:  # could never be admitted: retrying would not help
            raise APIError(400, f"a batch of {len(prompts)} prompts exceeds this server's limit of {max_batch} "
                                "requests in flight", param="prompt")
        self.client_limiter.acquire(client, len(prompts))
        try:
            self.limiter.acquire(len(prompts))
        except APIError:
            self.client_limiter.release(client, len(prompts))
            raise
        self.metrics.set_in_flight(self.limiter.num_in_flight)
        self.log_prompts(request_id, prompts, params)
        generation = Generation(self, request_id, prompts, params, priority, client, is_streamed, lora_request,
                                token_by_token)
        try:
            generation.start()
            first = await anext(generation, None)
        except BaseException:
            await generation.aclose()
            raise
        return generation, first

    def token_text(self, token_id: int) -> str:
        """One token as text (how logprobs name tokens)."""
        return self.tokenizer.decode([token_id])

    # ---- the rest ------------------------------------------------------------------------------
    def models(self) -> ModelList:
        """The base model, then its LoRA adapters (vLLM's cards: ``root`` the checkpoint, ``parent``
        the base model for an adapter)."""
        base = ModelCard(id=self.model_name, root=self.handle.model_path, max_model_len=self.max_model_len)
        return ModelList(data=[base] + [
            ModelCard(id=name, root=adapter.lora_path, parent=self.model_name, max_model_len=self.max_model_len)
            for name, adapter in self.adapters.known().items()])

    async def health(self, timeout_s: float = 2.0) -> dict:
        """``is_healthy``: at least one routable worker answers a ping within ``timeout_s``;
        ``workers``: how many are starting, ready, draining and dead."""
        async def ping(worker) -> bool:
            try:
                await asyncio.wait_for(worker.ping.remote(), timeout_s)
                return True
            except Exception:
                return False

        handle = self.handle
        if hasattr(handle, "refresh_workers"):
            await handle.refresh_workers()
        states = getattr(handle, "states", {})
        routable = [w for w in handle.workers if states.get(w) != "draining"]
        answers = await asyncio.gather(*(ping(handle.workers[w]) for w in routable))
        try:
            counts = (await asyncio.wait_for(handle.controller.worker_states.remote(), timeout_s))["counts"]
        except Exception:  # no controller answer: what this replica saw
            counts = {"ready": sum(answers)}
        return {"is_healthy": any(answers), "workers": counts}

    async def is_healthy(self, timeout_s: float = 2.0) -> bool:
        """True if at least one routable worker answers a ping within ``timeout_s``."""
        return (await self.health(timeout_s))["is_healthy"]

    async def stats(self) -> dict:
        """The cluster's stats (``gather_stats``) plus this replica's admission figures."""
        stats = await gather_stats(self.handle)
        stats["server"] = {"num_in_flight": self.limiter.num_in_flight,
                           "max_queued_requests": self.limiter.max_in_flight,
                           "num_admitted": self.limiter.num_admitted, "pid": os.getpid(),
                           "event_loop": ray_compat.running_event_loop()}
        if self.gc_pauses is not None:
            stats["server"]["gc"] = self.gc_pauses.snapshot()
        if self.response_store is not None:   # the cluster's store, and what this replica runs in the background
            stats["server"]["responses"] = {**await self.response_store.stats(),
                                            "num_background_here": len(self.background_runs.tasks)}
        return stats

    async def metrics_text(self) -> bytes:
        return self.metrics.render(await gather_stats(self.handle))
