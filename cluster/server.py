"""The OpenAI-compatible HTTP server (and its Ray Serve deployment).

``OpenAIServer`` turns API requests into ``ClusterHandle.generate`` calls:
it checks the API key, the model name and the limits of ``server.limits``,
tokenizes (chat template for chat), streams server-sent events, and maps
every failure to OpenAI's error body with a meaningful status:

* 400 malformed JSON, invalid or unknown fields, a prompt too long (the
  message states the limit); 413 a body over ``max_request_body_bytes``;
* 401 a missing or wrong ``Authorization: Bearer`` key (when one is set);
* 404 an unknown model; 429 (with ``Retry-After``) when this replica already
  has ``max_queued_requests`` requests admitted and unfinished, or the client
  (its bearer token, else its address) ``max_requests_per_client``;
* 408 a body not received within ``body_read_timeout_s``, a request past
  ``request_timeout_s``, or a generation silent for ``stream_idle_timeout_s``
  (in a stream: an error event); the request is aborted and its blocks freed;
* 503 only when no worker can take the request (``NoCapacityError``).

With an API key set, every route but ``/health`` (and ``/metrics`` when
``metrics_require_api_key`` is off) needs it; the dashboard has its own login.
Request bodies are only ever parsed as JSON. Prompts and completions are
logged only with ``server.log_requests``.

A client that goes away cancels its request: the generation tasks are
cancelled, which aborts the request on its worker and frees its blocks.

``PagedServeDeployment`` is the Ray Serve replica class: FastAPI ingress for
HTTP plus the ``Generate``/``GenerateStream`` gRPC methods (see
``grpc_service.py``). ``deploy`` starts Serve and runs the application.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import hmac
import ipaddress
import json
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import Request
from pydantic import BaseModel, ValidationError

from pagedserve.workers.request import CompletionOutput, RequestOutput
from pagedserve.workers.sampling_params import SamplingParams

from . import ray_compat
from .config import ClusterConfig, ServerConfig
from .dashboard import add_dashboard_routes
from .handle import NoCapacityError
from .metrics import CONTENT_TYPE, ServerMetrics
from .openai_protocol import (DEFAULT_MAX_TOKENS, ChatChoice, ChatCompletionChunk, ChatCompletionRequest,
                              ChatCompletionResponse, ChatMessageOut, ChatStreamChoice, ChoiceLogprobs,
                              CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse,
                              DeltaMessage, ErrorInfo, ErrorResponse, ModelCard, ModelList,
                              TokenLogprob, TopLogprob, Usage)

logger = logging.getLogger("pagedserve.server")

API_KEY_ENV = "PAGEDSERVE_API_KEY"
APP_NAME = "pagedserve"
GRPC_SERVICER_FUNCTION = "pagedserve.cluster.protos.servicer.add_servicer_to_server"
RETRY_AFTER_S = 1
STATS_TIMEOUT_S = 5.0
OPEN_PATHS = ("/health",)
SELF_AUTHENTICATED_PREFIXES = ("/dashboard",)  # the dashboard checks the key itself (login form)


class APIError(Exception):
    """A client-visible failure: HTTP status plus OpenAI's error fields."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def __reduce__(self):
        return APIError, (self.status, self.message, self.type, self.param, self.code, self.headers)

    def body(self) -> dict:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param,
                                             code=self.code)).model_dump()


def error_from_exception(exc: BaseException) -> APIError:
    """Map a failure of a generation to the error the client sees."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, NoCapacityError):
        return APIError(503, f"no worker can take the request: {exc}", "service_unavailable_error",
                        code="no_capacity", headers={"Retry-After": str(RETRY_AFTER_S)})
    cause = getattr(exc, "cause", None)  # a RayTaskError carries the worker's exception
    if isinstance(cause, (ValueError, TypeError)):
        exc = cause
    if isinstance(exc, (ValueError, TypeError)):
        return APIError(400, str(exc))
    logger.error("request failed: %r", exc)
    return APIError(500, f"internal error: {type(exc).__name__}", "internal_server_error")


def check_api_key(expected: str | None, authorization: str | None) -> None:
    """Raise a 401 ``APIError`` unless no key is configured or ``authorization`` is ``Bearer <key>``."""
    if not expected:
        return
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), expected.encode()):
        raise APIError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                       "authentication_error", code="invalid_api_key")


class RequestLimiter:
    """Admits at most ``max_in_flight`` unfinished requests (a batch counts each prompt);
    beyond that, a 429 with ``Retry-After``."""

    def __init__(self, max_in_flight: int) -> None:
        self.max_in_flight = max_in_flight
        self.num_in_flight = 0

    def acquire(self, num_requests: int = 1) -> None:
        if self.num_in_flight + num_requests > self.max_in_flight:
            raise APIError(429, f"the server is busy ({self.num_in_flight} requests queued or running, "
                                f"limit {self.max_in_flight}); retry later", "rate_limit_error",
                           code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)})
        self.num_in_flight += num_requests

    def release(self, num_requests: int = 1) -> None:
        self.num_in_flight = max(0, self.num_in_flight - num_requests)


class ClientLimiter:
    """Admits at most ``max_per_client`` unfinished requests per client key; beyond that, a 429."""

    def __init__(self, max_per_client: int) -> None:
        self.max_per_client = max_per_client
        self.num_in_flight: dict[str, int] = {}

    def acquire(self, client: str, num_requests: int = 1) -> None:
        current = self.num_in_flight.get(client, 0)
        if current + num_requests > self.max_per_client:
            raise APIError(429, f"too many concurrent requests from this client ({current} unfinished, "
                                f"limit {self.max_per_client}); retry later", "rate_limit_error",
                           code="client_limit", headers={"Retry-After": str(RETRY_AFTER_S)})
        self.num_in_flight[client] = current + num_requests

    def release(self, client: str, num_requests: int = 1) -> None:
        remaining = self.num_in_flight.get(client, 0) - num_requests
        if remaining > 0:
            self.num_in_flight[client] = remaining
        else:
            self.num_in_flight.pop(client, None)


def client_key(authorization: str | None, address: str | None) -> str:
    """Who a request counts against: its bearer token (hashed), else its address."""
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return "key:" + hashlib.sha256(token.strip().encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return f"addr:{address or 'unknown'}"


def timeout_error(message: str, code: str) -> APIError:
    return APIError(408, message, "timeout_error", code=code)


def check_unicode(text: str, param: str) -> None:
    """400 unless ``text`` is valid Unicode (no lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(400, f"{param} is not valid Unicode (it holds a lone surrogate)", param=param) from None


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _enable_request_logging() -> None:
    """Make the request log reach stderr (the replica's log file under Ray) at INFO."""
    logger.setLevel(logging.INFO)
    if not any(getattr(h, "is_request_log", False) for h in logger.handlers):
        handler = logging.StreamHandler()
        handler.is_request_log = True
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s -- %(message)s"))
        logger.addHandler(handler)


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


class Generation:
    """The merged output stream of one API request's prompts.

    Each prompt streams from ``ClusterHandle.generate`` in its own task;
    ``__anext__`` yields ``(prompt_index, RequestOutput)`` in arrival order and
    raises ``APIError`` for a failed generation. ``aclose`` (idempotent)
    cancels what still runs, which aborts it on the worker, and frees the
    request's limiter slot.
    """

    def __init__(self, server: "OpenAIServer", request_id: str, prompts: list[PromptInput],
                 params: SamplingParams, priority: int, client: str = "") -> None:
        self.server = server
        self.request_id = request_id
        self.prompts = prompts
        self.params = params
        self.priority = priority
        self.client = client
        self.progress = [_PromptProgress(time.time()) for _ in prompts]
        self.deadline = time.monotonic() + server.limits.request_timeout_s
        self._has_output = False
        self._queue: asyncio.Queue = asyncio.Queue()
        self._num_live = len(prompts)
        self._tasks: list[asyncio.Task] = []
        self._is_closed = False

    def start(self) -> None:
        for index, prompt in enumerate(self.prompts):
            self._tasks.append(asyncio.create_task(self._pump(index, prompt)))

    async def _pump(self, index: int, prompt: PromptInput) -> None:
        limit = self.server.max_model_len - len(prompt.token_ids)
        params = self.params
        if params.max_tokens > limit:  # the engine would stop there anyway; keep routing estimates honest
            params = dataclasses.replace(params, max_tokens=limit)
        stream = self.server.handle.generate(prompt.text, params, f"{self.request_id}-{index}",
                                             self.priority, prompt_token_ids=prompt.token_ids)
        try:
            async with aclosing(stream):
                async for output in stream:
                    self._queue.put_nowait((index, output))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # reported to the consumer, which maps it to an APIError
            self._queue.put_nowait((index, exc))
        finally:
            self._queue.put_nowait((index, None))

    def __aiter__(self) -> "Generation":
        return self

    async def _next_item(self) -> tuple[int, Any]:
        """The next queued item; 408 past the request's deadline or after an idle spell."""
        limits = self.server.limits
        remaining = self.deadline - time.monotonic()
        is_idle_bound = self._has_output and limits.stream_idle_timeout_s < remaining
        timeout = limits.stream_idle_timeout_s if is_idle_bound else remaining
        try:
            return await asyncio.wait_for(self._queue.get(), max(timeout, 0.0))
        except TimeoutError:
            if is_idle_bound:
                raise timeout_error(f"no output for {limits.stream_idle_timeout_s:g} s; the request was "
                                    "aborted", "stream_idle_timeout") from None
            raise timeout_error(f"the request took longer than {limits.request_timeout_s:g} s and was "
                                "aborted", "request_timeout") from None

    async def __anext__(self) -> tuple[int, RequestOutput]:
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
        if progress.first_token is None and any(c.token_ids for c in output.outputs):
            progress.first_token = now
        if output.finished:
            self.server.log_completion(f"{self.request_id}-{index}", output)
            self.server.metrics.observe_generation(
                progress.arrival, progress.first_token, now, len(output.prompt_token_ids),
                output.metrics.num_cached_tokens if output.metrics else 0,
                sum(len(c.token_ids) for c in output.outputs),
                [c.finish_reason or "" for c in output.outputs])

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
        self.server.release_slots(len(self.prompts), self.client)
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
                usage.completion_tokens += sum(len(c.token_ids) for c in progress.last.outputs)
                if progress.last.metrics is not None:
                    usage.prompt_tokens_details.cached_tokens += progress.last.metrics.num_cached_tokens
        usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
        return usage


@dataclass
class EventStream:
    """A streamed response: its SSE lines and the generation they come from."""

    lines: AsyncIterator[str]
    generation: Generation

    async def aclose(self) -> None:
        """Stop streaming and release the request, even if iteration never started."""
        try:
            await self.lines.aclose()
        except RuntimeError:  # still being iterated elsewhere: closing the generation suffices
            pass
        await self.generation.aclose()


@dataclass
class _ChoiceCursor:
    """What was already sent for one choice of a streamed response."""

    num_tokens: int = 0
    text_offset: int = 0
    is_started: bool = False
    is_finished: bool = False


@dataclass
class _StreamState:
    cursors: dict[int, _ChoiceCursor] = field(default_factory=dict)

    def cursor(self, index: int) -> _ChoiceCursor:
        return self.cursors.setdefault(index, _ChoiceCursor())


def _sse(payload: BaseModel | dict) -> str:
    text = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {text}\n\n"


def _model_vocab_size(model_path: str, tokenizer) -> int:
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
        vocab = config.get("vocab_size") or config.get("text_config", {}).get("vocab_size")
        if vocab:
            return int(vocab)
    except (OSError, ValueError):
        pass
    return len(tokenizer)


async def collect_stats(handle, timeout_s: float = STATS_TIMEOUT_S) -> dict:
    """The KV manager's pool stats and every worker's engine stats, without blocking the loop.

    A part that does not answer within ``timeout_s`` appears as ``{"error": ...}``
    (a worker additionally as ``is_healthy: False``).
    """
    async def ask(ref):
        try:
            return await asyncio.wait_for(ref, timeout_s)
        except Exception as exc:
            return {"is_healthy": False, "error": repr(exc)}

    kv_stats, *worker_stats = await asyncio.gather(
        ask(handle.kv_manager.stats.remote()), *(ask(w.stats.remote()) for w in handle.workers.values()))
    return {"model": handle.model_name, "kv_manager": kv_stats,
            "workers": dict(zip(handle.workers, worker_stats)), "router": handle.router.snapshot()}


class OpenAIServer:
    """The API's logic over a ``ClusterHandle``; ``build_app`` puts HTTP routes on it.

    One instance per Serve replica. ``server_config`` supplies the API key
    (else ``$PAGEDSERVE_API_KEY``) and the limits.
    """

    def __init__(self, handle, server_config: ServerConfig | None = None) -> None:
        self.handle = handle
        self.config = server_config or ServerConfig()
        self.limits = self.config.limits
        self.api_key = self.config.api_key or os.environ.get(API_KEY_ENV) or None
        self.model_name = handle.model_name
        self.max_model_len = handle.max_model_len
        self.tokenizer = handle.tokenizer
        self.vocab_size = _model_vocab_size(handle.model_path, self.tokenizer)
        self.limiter = RequestLimiter(self.limits.max_queued_requests)
        self.client_limiter = ClientLimiter(self.limits.max_requests_per_client)
        self.metrics = ServerMetrics(self.model_name)
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
        if path in OPEN_PATHS or path.startswith(SELF_AUTHENTICATED_PREFIXES):
            return True
        return path == "/metrics" and not self.config.metrics_require_api_key

    # ---- checks --------------------------------------------------------------------------
    def check_auth(self, authorization: str | None) -> None:
        check_api_key(self.api_key, authorization)

    def check_model(self, model: str | None) -> None:
        if model and model != self.model_name:
            raise APIError(404, f"the model '{model}' does not exist; this server serves "
                                f"'{self.model_name}'", param="model", code="model_not_found")

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

    def tokenize(self, prompt: str | list[int], param: str = "prompt") -> PromptInput:
        if isinstance(prompt, str):
            check_unicode(prompt, param)
            token_ids = self.tokenizer.encode(prompt)
            text = prompt
        else:
            token_ids, text = list(prompt), None
        self.check_prompt(token_ids, param)
        return PromptInput(text, token_ids)

    def chat_prompt(self, request: ChatCompletionRequest) -> PromptInput:
        if not getattr(self.tokenizer, "chat_template", None):
            raise APIError(400, f"the model '{self.model_name}' has no chat template; use /v1/completions",
                           param="messages")
        messages = []
        for message in request.messages:
            check_unicode(message.text() + (message.name or ""), "messages")
            entry = {"role": message.role, "content": message.text()}
            if message.name:
                entry["name"] = message.name
            messages.append(entry)
        try:
            text = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=request.add_generation_prompt, tokenize=False)
        except Exception as exc:  # the template rejects the conversation (e.g. role order)
            raise APIError(400, f"the chat template could not render these messages: {exc}",
                           param="messages") from None
        token_ids = self.tokenizer.encode(text, add_special_tokens=False)  # the template adds them
        self.check_prompt(token_ids, "messages")
        return PromptInput(text, token_ids)

    def sampling_params(self, request, max_tokens: int, logprobs: int | None) -> SamplingParams:
        if request.n > self.limits.max_n:
            raise APIError(400, f"n must be <= {self.limits.max_n}, got {request.n}", param="n")
        stop = request.stop_strings
        if len(stop) > self.limits.max_stop_strings:
            raise APIError(400, f"at most {self.limits.max_stop_strings} stop strings are allowed, got "
                                f"{len(stop)}", param="stop")
        for text in stop:
            check_unicode(text, "stop")
        try:
            return SamplingParams(
                n=request.n, max_tokens=max_tokens,
                temperature=1.0 if request.temperature is None else request.temperature,
                top_p=1.0 if request.top_p is None else request.top_p, top_k=request.top_k,
                min_p=request.min_p, seed=request.seed, presence_penalty=request.presence_penalty,
                frequency_penalty=request.frequency_penalty, repetition_penalty=request.repetition_penalty,
                stop=stop, stop_token_ids=request.stop_token_ids, ignore_eos=request.ignore_eos,
                logprobs=logprobs, skip_special_tokens=request.skip_special_tokens)
        except ValueError as exc:
            raise APIError(400, str(exc), param=str(exc).split(" ", 1)[0]) from None

    # ---- generation ------------------------------------------------------------------------
    def release_slots(self, num_requests: int, client: str = "") -> None:
        """Free the limiter slots of a finished or abandoned request."""
        self.limiter.release(num_requests)
        self.client_limiter.release(client, num_requests)
        self.metrics.set_in_flight(self.limiter.num_in_flight)

    async def start_generation(self, request_id: str, prompts: list[PromptInput], params: SamplingParams,
                               priority: int, client: str = ""
                               ) -> tuple[Generation, tuple[int, RequestOutput] | None]:
        """Admit the request (429 when the replica or ``client`` is full), start it, await its first output.

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
        generation = Generation(self, request_id, prompts, params, priority, client)
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

    def _completion_logprobs(self, completion: CompletionOutput, start: int, text_offset: int
                             ) -> CompletionLogprobs:
        result = CompletionLogprobs()
        for sample in (completion.logprobs or [])[start:]:
            token = self.token_text(sample.token_id)
            result.tokens.append(token)
            result.token_logprobs.append(sample.logprob)
            result.top_logprobs.append({self.token_text(t): lp for t, lp in sample.top})
            result.text_offset.append(text_offset)
            text_offset += len(token)
        return result

    def _chat_logprobs(self, completion: CompletionOutput, start: int) -> ChoiceLogprobs:
        content = []
        for sample in (completion.logprobs or [])[start:]:
            token = self.token_text(sample.token_id)
            top = [TopLogprob(token=self.token_text(t), logprob=lp, bytes=list(self.token_text(t).encode()))
                   for t, lp in sample.top]
            content.append(TokenLogprob(token=token, logprob=sample.logprob, bytes=list(token.encode()),
                                        top_logprobs=top))
        return ChoiceLogprobs(content=content)

    # ---- /v1/completions ----------------------------------------------------------------------
    async def create_completion(self, request: CompletionRequest, client: str = ""
                                ) -> CompletionResponse | EventStream:
        """The response body, or an ``EventStream`` when ``stream`` is set."""
        self.check_model(request.model)
        if request.best_of is not None and request.best_of != request.n:
            raise APIError(400, "best_of must equal n (or be unset)", param="best_of")
        prompts_in = request.prompts()
        if not prompts_in:
            raise APIError(400, "the prompt is empty", param="prompt")
        prompts = [self.tokenize(p) for p in prompts_in]
        params = self.sampling_params(request, request.max_tokens or DEFAULT_MAX_TOKENS, request.logprobs)
        echoes = [(p.text if p.text is not None else self.tokenizer.decode(p.token_ids)) if request.echo
                  else "" for p in prompts]
        request_id = f"cmpl-{uuid.uuid4().hex}"
        generation, first = await self.start_generation(request_id, prompts, params, request.priority, client)
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
                    logprobs = self._completion_logprobs(completion, 0, len(echoes[index]))
                choices.append(CompletionChoice(index=index * n + completion.index,
                                                text=echoes[index] + completion.text, logprobs=logprobs,
                                                finish_reason=completion.finish_reason))
        choices.sort(key=lambda c: c.index)
        return CompletionResponse(id=request_id, model=self.model_name, choices=choices,
                                  usage=generation.usage())

    async def _stream_completion(self, request: CompletionRequest, request_id: str, generation: Generation,
                                 first, echoes: list[str]) -> AsyncIterator[str]:
        state = _StreamState()
        n = generation.params.n
        created = int(time.time())

        def chunks(index: int, output: RequestOutput):
            for completion in output.outputs:
                cursor = state.cursor(index * n + completion.index)
                if cursor.is_finished:
                    continue
                text = completion.delta_text
                if not cursor.is_started:
                    cursor.is_started = True
                    text = echoes[index] + text
                    cursor.text_offset = len(echoes[index])
                logprobs = None
                if request.logprobs is not None:
                    logprobs = self._completion_logprobs(completion, cursor.num_tokens, cursor.text_offset)
                cursor.num_tokens = len(completion.token_ids)
                cursor.text_offset += len(completion.delta_text)
                cursor.is_finished = completion.finish_reason is not None
                if not text and not cursor.is_finished and not (logprobs and logprobs.tokens):
                    continue
                choice = CompletionChoice(index=index * n + completion.index, text=text, logprobs=logprobs,
                                          finish_reason=completion.finish_reason)
                yield _sse(CompletionResponse(id=request_id, created=created, model=self.model_name,
                                              choices=[choice]))

        async for line in self._stream_events(generation, first, chunks):
            yield line
        if request.include_usage:
            yield _sse(CompletionResponse(id=request_id, created=created, model=self.model_name, choices=[],
                                          usage=generation.usage()))
        yield "data: [DONE]\n\n"

    async def _stream_events(self, generation: Generation, first, chunks: Callable) -> AsyncIterator[str]:
        """SSE lines for every output; a failure mid-stream becomes an error event."""
        try:
            if first is not None:
                for line in chunks(*first):
                    yield line
                async for index, output in generation:
                    for line in chunks(index, output):
                        yield line
        except APIError as exc:
            yield _sse(exc.body())
        finally:
            await generation.aclose()

    # ---- /v1/chat/completions -------------------------------------------------------------------
    async def create_chat_completion(self, request: ChatCompletionRequest, client: str = ""
                                     ) -> ChatCompletionResponse | EventStream:
        """The response body, or an ``EventStream`` when ``stream`` is set."""
        self.check_model(request.model)
        prompt = self.chat_prompt(request)
        if request.top_logprobs is not None and not request.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        max_tokens = request.effective_max_tokens or self.max_model_len - len(prompt.token_ids)
        params = self.sampling_params(request, max_tokens, logprobs)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        generation, first = await self.start_generation(request_id, [prompt], params, request.priority,
                                                        client)
        if request.stream:
            return EventStream(self._stream_chat(request, request_id, generation, first), generation)
        await generation.run_to_end(first)
        last = generation.progress[0].last
        choices = [ChatChoice(index=c.index, message=ChatMessageOut(content=c.text),
                              logprobs=self._chat_logprobs(c, 0) if request.logprobs else None,
                              finish_reason=c.finish_reason)
                   for c in (last.outputs if last else [])]
        choices.sort(key=lambda c: c.index)
        return ChatCompletionResponse(id=request_id, model=self.model_name, choices=choices,
                                      usage=generation.usage())

    async def _stream_chat(self, request: ChatCompletionRequest, request_id: str, generation: Generation,
                           first) -> AsyncIterator[str]:
        state = _StreamState()
        created = int(time.time())

        def chunk(choice: ChatStreamChoice) -> str:
            return _sse(ChatCompletionChunk(id=request_id, created=created, model=self.model_name,
                                            choices=[choice]))

        def chunks(_: int, output: RequestOutput):
            for completion in output.outputs:
                cursor = state.cursor(completion.index)
                if cursor.is_finished:
                    continue
                if not cursor.is_started:
                    cursor.is_started = True
                    yield chunk(ChatStreamChoice(index=completion.index,
                                                 delta=DeltaMessage(role="assistant", content="")))
                logprobs = self._chat_logprobs(completion, cursor.num_tokens) if request.logprobs else None
                cursor.num_tokens = len(completion.token_ids)
                cursor.is_finished = completion.finish_reason is not None
                if completion.delta_text or (logprobs and logprobs.content):
                    yield chunk(ChatStreamChoice(index=completion.index,
                                                 delta=DeltaMessage(content=completion.delta_text),
                                                 logprobs=logprobs))
                if cursor.is_finished:
                    yield chunk(ChatStreamChoice(index=completion.index, delta=DeltaMessage(),
                                                 finish_reason=completion.finish_reason))

        async for line in self._stream_events(generation, first, chunks):
            yield line
        if request.include_usage:
            yield _sse(ChatCompletionChunk(id=request_id, created=created, model=self.model_name, choices=[],
                                           usage=generation.usage()))
        yield "data: [DONE]\n\n"

    # ---- the rest ------------------------------------------------------------------------------
    def models(self) -> ModelList:
        return ModelList(data=[ModelCard(id=self.model_name, max_model_len=self.max_model_len)])

    async def is_healthy(self, timeout_s: float = 2.0) -> bool:
        """True if at least one worker answers a ping within ``timeout_s``."""
        async def ping(worker) -> bool:
            try:
                await asyncio.wait_for(worker.ping.remote(), timeout_s)
                return True
            except Exception:
                return False

        return any(await asyncio.gather(*(ping(w) for w in self.handle.workers.values())))

    async def stats(self) -> dict:
        """``collect_stats`` plus this replica's in-flight count."""
        stats = await collect_stats(self.handle)
        stats["server"] = {"num_in_flight": self.limiter.num_in_flight,
                           "max_queued_requests": self.limiter.max_in_flight}
        return stats

    async def metrics_text(self) -> bytes:
        return self.metrics.render(await collect_stats(self.handle))

    async def parse_body(self, request: Request, model: type[BaseModel]) -> Any:
        """Read (size-limited), decode and validate a JSON body; ``APIError`` 400/413 otherwise."""
        limit = self.limits.max_request_body_bytes
        too_large = APIError(413, f"the request body exceeds {limit} bytes", code="request_too_large")
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit:
            raise too_large

        async def read() -> bytearray:
            body = bytearray()
            async for chunk in request.stream():
                body += chunk
                if len(body) > limit:
                    raise too_large
            return body

        timeout = self.limits.body_read_timeout_s
        try:
            body = await asyncio.wait_for(read(), timeout)
        except TimeoutError:
            raise timeout_error(f"the request body was not received within {timeout:g} s",
                                "body_read_timeout") from None
        try:
            data = json.loads(body, parse_constant=_reject_json_constant)
        except (ValueError, RecursionError) as exc:
            raise APIError(400, f"the request body is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise APIError(400, "the request body must be a JSON object")
        try:
            return model.model_validate(data)
        except ValidationError as exc:
            raise validation_error(exc) from None


def _reject_json_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _is_union_tag(part) -> bool:
    """pydantic names the union member an error came from in ``loc`` (``list[int]``, ``TextPart``)."""
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool")
                                      or part[:1].isupper() or part.startswith("function-"))


def validation_error(exc: ValidationError) -> APIError:
    """A 400 naming every invalid field (the first one as ``param``)."""
    problems: dict[str, list[str]] = {}
    for error in exc.errors():
        loc = ".".join(str(p) for p in error["loc"] if not _is_union_tag(p))
        message = "unknown field" if error["type"] == "extra_forbidden" else error["msg"]
        messages = problems.setdefault(loc, [])
        if message not in messages:
            messages.append(message)
    text = "; ".join(f"{loc}: {' or '.join(msgs)}" if loc else " or ".join(msgs)
                     for loc, msgs in problems.items())
    return APIError(400, f"invalid request: {text}", param=next(iter(problems), None) or None)


def _json_response(content: Any, status_code: int = 200, headers: dict[str, str] | None = None):
    """A JSON response with non-ASCII escaped, so any text (lone surrogates too) encodes."""
    from fastapi.responses import Response

    body = json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode()
    return Response(body, status_code=status_code, headers=headers, media_type="application/json")


class APIKeyMiddleware:
    """ASGI middleware: with an API key set, 401 for every route ``server.is_open_path`` does not open."""

    def __init__(self, app, server: OpenAIServer) -> None:
        self.app = app
        self.server = server

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] in ("http", "websocket") and self.server.api_key:
            path = scope.get("path", "")
            root = scope.get("root_path", "")
            if root and path.startswith(root):
                path = path[len(root):] or "/"
            if not self.server.is_open_path(path):
                headers = dict(scope.get("headers") or [])
                authorization = headers.get(b"authorization", b"").decode("latin-1")
                try:
                    self.server.check_auth(authorization)
                except APIError as exc:
                    if scope["type"] == "websocket":
                        await send({"type": "websocket.close", "code": 1008})
                        return
                    response = _json_response(exc.body(), exc.status, exc.headers)
                    await response(scope, receive, send)
                    return
        await self.app(scope, receive, send)


def _json_body(model: type[BaseModel]) -> dict:
    """OpenAPI for a body the route reads itself (``parse_body``): the model's schema."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


def _responses(model: type[BaseModel] | None, is_streamable: bool = False) -> dict:
    responses: dict[int | str, dict] = {}
    if model is not None:
        responses[200] = {"model": model}
        if is_streamable:
            responses[200]["content"] = {"text/event-stream": {"schema": {"type": "string"}}}
    for status, meaning in ((400, "invalid request"), (401, "missing or wrong API key"),
                            (404, "unknown model"), (408, "timed out"), (413, "body too large"),
                            (429, "too many requests (Retry-After)"), (503, "no capacity (Retry-After)")):
        responses[status] = {"model": ErrorResponse, "description": meaning}
    return responses


def _install_openapi(app, request_models: list[type[BaseModel]]) -> None:
    """Add the request models the routes parse themselves to the app's OpenAPI components."""
    from fastapi.openapi.utils import get_openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes,
                                 description=app.description)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in request_models:
                definition = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(definition.pop("$defs", {}))
                components[model.__name__] = definition
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


def build_app(server: OpenAIServer):
    """The FastAPI app serving ``server``'s routes (errors in OpenAI's shape)."""
    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import Response, StreamingResponse
    from starlette.exceptions import HTTPException

    app = FastAPI(title="pagedserve", version="0.1.0",
                  description="OpenAI-compatible completions and chat completions on a paged KV cache.")
    app.add_middleware(APIKeyMiddleware, server=server)
    _install_openapi(app, [CompletionRequest, ChatCompletionRequest])

    def error_response(error: APIError):
        return _json_response(error.body(), error.status, error.headers)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError):
        return error_response(APIError(400, f"invalid request: {exc.errors()}"))

    @app.exception_handler(HTTPException)
    async def _http(_: Request, exc: HTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(APIError(exc.status_code, str(exc.detail), kind))

    class _SSEResponse(StreamingResponse):
        """Closes the generation even if the client left before the body started."""

        def __init__(self, stream: EventStream) -> None:
            super().__init__(stream.lines, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            self._stream = stream

        async def __call__(self, scope, receive, send) -> None:
            try:
                await super().__call__(scope, receive, send)
            finally:
                await self._stream.aclose()

    async def generate(api: str, request: Request, model: type[BaseModel], create) -> Response:
        client = client_key(request.headers.get("authorization"),
                            request.client.host if request.client else None)
        try:
            body = await server.parse_body(request, model)
            result = await create(body, client)
        except APIError as exc:
            server.metrics.observe_response(api, exc.status)
            return error_response(exc)
        server.metrics.observe_response(api, 200)
        if isinstance(result, BaseModel):
            return _json_response(result.model_dump())
        return _SSEResponse(result)

    @app.post("/v1/completions", openapi_extra=_json_body(CompletionRequest),
              responses=_responses(CompletionResponse, is_streamable=True))
    async def completions(request: Request):
        return await generate("completions", request, CompletionRequest, server.create_completion)

    @app.post("/v1/chat/completions", openapi_extra=_json_body(ChatCompletionRequest),
              responses=_responses(ChatCompletionResponse, is_streamable=True))
    async def chat_completions(request: Request):
        return await generate("chat", request, ChatCompletionRequest, server.create_chat_completion)

    @app.get("/v1/models", responses=_responses(ModelList))
    async def models():
        return server.models().model_dump()

    @app.get("/v1/models/{model:path}", responses=_responses(ModelCard))
    async def model(model: str):
        server.check_model(model)
        return server.models().data[0].model_dump()

    @app.get("/health")
    async def health():
        if await server.is_healthy():
            return {"status": "ok", "model": server.model_name}
        return _json_response({"status": "unavailable", "model": server.model_name}, 503)

    @app.get("/metrics")
    async def metrics():
        return Response(await server.metrics_text(), media_type=CONTENT_TYPE)

    @app.get("/stats")
    async def stats():
        return await server.stats()

    add_dashboard_routes(app, server.handle, server.check_auth, server.metrics)
    return app


class PagedServeDeployment:
    """The Serve replica: HTTP through FastAPI, gRPC through ``Generate``/``GenerateStream``.

    Decorated with ``serve.ingress`` by ``build_application``; holds the
    cluster handle it is constructed with.
    """

    def __init__(self, handle, server_config: dict) -> None:
        from .grpc_service import GrpcService

        self.server = OpenAIServer(handle, ServerConfig.model_validate(server_config))
        self.grpc = GrpcService(self.server)

    def __serve_build_asgi_app__(self):
        return build_app(self.server)

    async def Generate(self, request, grpc_context=None):  # noqa: N802 - the RPC's name
        return await self.grpc.generate(request, grpc_context)

    async def GenerateStream(self, request, grpc_context=None):  # noqa: N802 - the RPC's name
        async for response in self.grpc.generate_stream(request, grpc_context):
            yield response

    async def status(self) -> dict:
        """Cluster and replica stats (what ``pagedserve status`` prints)."""
        return await self.server.stats()


def build_application(handle, config: ClusterConfig, num_cpus: float = 0.0):
    """The bound Serve application for ``handle``, configured by ``config.server``."""
    from ray import serve

    limits = config.server.limits
    deployment = serve.deployment(
        serve.ingress()(PagedServeDeployment), name="PagedServe",
        # Serve must not queue in front of our limiter: room for every admitted
        # request plus health checks and scrapes.
        max_ongoing_requests=limits.max_queued_requests + 32,
        # On the head node, next to the driver that resolved the model path (the tokenizer's).
        ray_actor_options={"num_cpus": num_cpus, **ray_compat.head_node_placement()},
        graceful_shutdown_timeout_s=5)
    return deployment.bind(handle, config.server.model_dump())


def deploy(handle, config: ClusterConfig, app_name: str = APP_NAME, route_prefix: str = "/",
           quiet: bool = False) -> dict[str, str]:
    """Start Serve (HTTP on ``server.host:port``, gRPC on ``server.grpc_port`` if set), run the app.

    If Serve already runs in this Ray cluster, its HTTP/gRPC options stay as
    they are and the app is added next to the others under ``route_prefix``.
    ``quiet`` keeps Serve's logs (access logs included) to warnings.
    Returns the endpoints, e.g. ``{"http": "http://127.0.0.1:8000", "grpc": "127.0.0.1:9000"}``.
    """
    from ray import serve

    server = config.server
    if not is_loopback(server.host) and not (server.api_key or os.environ.get(API_KEY_ENV)):
        logger.warning("serving on %s (not loopback) without an API key: anyone who can reach it may "
                       "use it; set server.api_key or $%s", server.host, API_KEY_ENV)
    logging_config = {"log_level": "WARNING", "enable_access_log": False} if quiet else None
    grpc_options = None
    if server.grpc_port is not None:
        # Reflection lists the services without a key: only offered when none is needed.
        grpc_options = {"port": server.grpc_port, "grpc_servicer_functions": [GRPC_SERVICER_FUNCTION],
                        "enable_reflection": not (server.api_key or os.environ.get(API_KEY_ENV))}
    serve.start(http_options={"host": server.host, "port": server.port}, grpc_options=grpc_options,
                logging_config=logging_config)
    serve.run(build_application(handle, config), name=app_name, route_prefix=route_prefix,
              logging_config=logging_config)
    prefix = "" if route_prefix == "/" else route_prefix
    endpoints = {"http": f"http://{server.host}:{server.port}{prefix}"}
    if server.grpc_port is not None:
        endpoints["grpc"] = f"{server.host}:{server.grpc_port}"
    return endpoints
