"""The HTTP transport: the FastAPI app over a ``Frontend``.

Routes: ``/v1/completions`` (``serving_completion``), ``/v1/chat/completions``
(``serving_chat``), ``/v1/responses`` (``serving_responses``), vLLM's ``/tokenize`` and
``/detokenize`` (``serving_tokenize``),
``/v1/models``, ``/health`` (and vLLM's ``/ping``), ``/version``, ``/metrics``, ``/stats`` and the dashboard. Every failure
is OpenAI's error body with a meaningful status:

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

Request bodies are only ever parsed as JSON. A client that goes away cancels
its request: the generation is closed, which aborts it on its worker and
frees its blocks.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import Request
from pydantic import BaseModel, ValidationError

from pagedserve import __version__

from ..config import LimitsConfig
from .auth import client_key
from .dashboard import add_dashboard_routes
from .errors import APIError, timeout_error, validation_error
from .frontend import Frontend
from .metrics import CONTENT_TYPE
from .protocol import (ChatCompletionRequest, ChatCompletionResponse, CompletionRequest, CompletionResponse,
                       DetokenizeRequest, DetokenizeResponse, ErrorResponse, LoadLoRAAdapterRequest, ModelCard,
                       ModelList, TokenizeChatRequest, TokenizeCompletionRequest, TokenizeResponse,
                       UnloadLoRAAdapterRequest)
from .responses_protocol import ResponseObject, ResponsesRequest
from .serving_chat import ServingChat
from .serving_completion import ServingCompletion
from .serving_lora import ServingLoRA
from .serving_responses import ServingResponses
from .serving_tokenize import ServingTokenize, TokenizeRequest
from .sse import EventStream


async def parse_body(request: Request, model: type[BaseModel] | Any, limits: LimitsConfig) -> Any:
    """Read (size-limited), decode and validate a JSON body (``model.model_validate``: a pydantic
    model, or a chooser between several such as ``TokenizeRequest``); ``APIError`` 400/413 otherwise."""
    limit = limits.max_request_body_bytes
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

    timeout = limits.body_read_timeout_s
    try:
        async with asyncio.timeout(timeout):   # in this task: ``wait_for`` made one a request
            body = await read()
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


def refuse_query(request, names: tuple[str, ...], why: str) -> None:
    """A 400 naming the first of ``names`` the request's query string holds (``why`` it cannot be honoured)."""
    for name in names:
        if name in request.query_params:
            raise APIError(400, f"{name} cannot be honoured: {why}", param=name.removesuffix("[]"))


def _query_flag(request, name: str) -> bool:
    """A true-or-false query parameter (false if absent); a 400 naming it if it is neither."""
    value = request.query_params.get(name)
    if value is None or value.lower() in ("false", "0"):
        return False
    if value.lower() in ("true", "1"):
        return True
    raise APIError(400, f"{name} must be true or false, not {value!r}", param=name)


def _query_sequence_number(request, name: str) -> int | None:
    """A sequence number in the query (None if absent); a 400 naming it if it is not one."""
    value = request.query_params.get(name)
    if value is None:
        return None
    if not (value.isascii() and value.isdigit()):
        raise APIError(400, f"{name} must be an event's sequence number (0 or more), not {value!r}", param=name)
    return int(value)


def _json_response(content: Any, status_code: int = 200, headers: dict[str, str] | None = None):
    """A JSON response with non-ASCII escaped, so any text (lone surrogates too) encodes."""
    from fastapi.responses import Response

    body = json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode()
    return Response(body, status_code=status_code, headers=headers, media_type="application/json")


class APIKeyMiddleware:
    """ASGI middleware: with an API key set, 401 for every route ``server.is_open_path`` does not open."""

    def __init__(self, app, server: Frontend) -> None:
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


def _json_body(*models: type[BaseModel]) -> dict:
    """OpenAPI for a body the route reads itself (``parse_body``): the model's schema (one of
    the models' where it takes several forms)."""
    refs = [{"$ref": f"#/components/schemas/{model.__name__}"} for model in models]
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": refs[0] if len(refs) == 1 else {"oneOf": refs}}}}}


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


def build_app(server: Frontend):
    """The FastAPI app serving ``server``'s routes (errors in OpenAI's shape)."""
    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import Response, StreamingResponse
    from ray.exceptions import TaskCancelledError
    from starlette.exceptions import HTTPException

    app = FastAPI(title="pagedserve", version="0.1.0",
                  description="OpenAI-compatible completions and chat completions on a paged KV cache.")
    app.add_middleware(APIKeyMiddleware, server=server)
    completion = ServingCompletion(server)
    chat = ServingChat(server)
    serving_responses = ServingResponses(chat)
    tokenize = ServingTokenize(server)
    lora = ServingLoRA(server)
    _install_openapi(app, [CompletionRequest, ChatCompletionRequest, ResponsesRequest, TokenizeCompletionRequest,
                           TokenizeChatRequest, DetokenizeRequest, LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest])

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
        """Streams ``stream``'s events while a plain task waits for the client to leave, and
        closes the generation however the response ends (before the body started too).

        A client that leaves mid-stream (``http.disconnect``; under Ray Serve's proxy the
        replica's ``receive`` raises ``TaskCancelledError`` instead) stops the stream quietly,
        as starlette's own ``StreamingResponse`` does, without its anyio task group: that
        group (cancel scopes, a second task) and ``parse_body``'s former ``wait_for`` task
        cost the app about a fifth of its CPU a request (``bench_frontend_stream.py --tokens 1``).
        """

        def __init__(self, stream: EventStream) -> None:
            super().__init__(stream.lines, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            self._stream = stream

        async def __call__(self, scope, receive, send) -> None:
            streaming = asyncio.current_task()

            async def listen() -> BaseException | None:
                """Stop the stream once the client leaves; what ``receive`` raised, if it broke."""
                error = None
                try:
                    while (await receive())["type"] != "http.disconnect":
                        pass
                except TaskCancelledError:   # Serve's proxy cancelled the request: the client left
                    pass
                except Exception as exc:     # raised here, as starlette's task group would
                    error = exc
                streaming.cancel()
                return error

            listener = asyncio.ensure_future(listen())
            try:
                await self.stream_response(send)
            except asyncio.CancelledError:
                if not listener.done() or streaming.uncancel() > 0:
                    raise   # not (only) the listener's: the request itself was cancelled
                if (error := listener.result()) is not None:
                    raise error from None
            finally:
                listener.cancel()
                await self._stream.aclose()

    async def generate(api: str, request: Request, model: type[BaseModel], create) -> Response:
        client = client_key(request.headers.get("authorization"),
                            request.client.host if request.client else None)
        try:
            body = await parse_body(request, model, server.limits)
            result = await create(body, client)
        except APIError as exc:
            server.metrics.observe_response(api, exc.status)
            return error_response(exc)
        server.metrics.observe_response(api, 200)
        if isinstance(result, BaseModel):
            return _json_response(result.model_dump())
        return _SSEResponse(EventStream(result))

    @app.post("/v1/completions", openapi_extra=_json_body(CompletionRequest),
              responses=_responses(CompletionResponse, is_streamable=True))
    async def completions(request: Request):
        return await generate("completions", request, CompletionRequest, completion.create_completion)

    @app.post("/v1/chat/completions", openapi_extra=_json_body(ChatCompletionRequest),
              responses=_responses(ChatCompletionResponse, is_streamable=True))
    async def chat_completions(request: Request):
        return await generate("chat", request, ChatCompletionRequest, chat.create_chat_completion)

    @app.post("/v1/responses", openapi_extra=_json_body(ResponsesRequest),
              responses=_responses(ResponseObject, is_streamable=True))
    async def responses_route(request: Request):
        return await generate("responses", request, ResponsesRequest, serving_responses.create_response)

    # OpenAI's routes for stored responses (``server.store_responses``); without a store every
    # id is unknown, and the 404 says why rather than a bare "Not Found".
    not_stored = {404: {"model": ErrorResponse, "description": "no stored response"},
                  400: {"model": ErrorResponse, "description": "a parameter that cannot be honoured"}}

    @app.get("/v1/responses/{response_id}", operation_id="responses_retrieve",
             responses={200: {"model": ResponseObject,
                              "content": {"text/event-stream": {"schema": {"type": "string"}}}}, **not_stored})
    async def retrieve_response(response_id: str, request: Request):
        """The stored response; with ``stream=true``, a streamed background response's events
        after ``starting_after``, then the rest as they are made."""
        refuse_query(request, ("include", "include[]"),
                     "a stored response is returned as it was made: include more when creating it")
        is_streamed = _query_flag(request, "stream")
        starting_after = _query_sequence_number(request, "starting_after")
        if not is_streamed:
            if starting_after is not None:
                raise APIError(400, "starting_after is for a stream: send stream=true too", param="starting_after")
            return _json_response((await serving_responses.retrieve(response_id)).response)
        return _SSEResponse(EventStream(await serving_responses.stream_stored(response_id, starting_after)))

    @app.delete("/v1/responses/{response_id}", operation_id="responses_delete", responses=not_stored)
    async def delete_response(response_id: str):
        return _json_response(await serving_responses.delete(response_id))

    @app.post("/v1/responses/{response_id}/cancel", operation_id="responses_cancel", responses=not_stored)
    async def cancel_response(response_id: str):
        return _json_response(await serving_responses.cancel(response_id))

    @app.get("/v1/responses/{response_id}/input_items", operation_id="responses_input_items",
             responses=not_stored)
    async def response_input_items(response_id: str, request: Request, limit: int = 20, order: str = "desc",
                                   after: str | None = None):
        refuse_query(request, ("before", "include", "include[]"), "input items are listed as they were sent")
        return _json_response(await serving_responses.input_items(response_id, limit, order, after))

    @app.post("/tokenize", openapi_extra=_json_body(TokenizeCompletionRequest, TokenizeChatRequest),
              responses=_responses(TokenizeResponse))
    async def tokenize_route(request: Request):
        body = await parse_body(request, TokenizeRequest, server.limits)
        return _json_response(tokenize.tokenize(body).model_dump())

    @app.post("/detokenize", openapi_extra=_json_body(DetokenizeRequest), responses=_responses(DetokenizeResponse))
    async def detokenize_route(request: Request):
        body = await parse_body(request, DetokenizeRequest, server.limits)
        return _json_response(tokenize.detokenize(body).model_dump())

    @app.post("/v1/load_lora_adapter", openapi_extra=_json_body(LoadLoRAAdapterRequest), responses=_responses(None))
    async def load_lora_adapter(request: Request):
        body = await parse_body(request, LoadLoRAAdapterRequest, server.limits)
        return Response(await lora.load(body), media_type="text/plain")

    @app.post("/v1/unload_lora_adapter", openapi_extra=_json_body(UnloadLoRAAdapterRequest),
              responses=_responses(None))
    async def unload_lora_adapter(request: Request):
        body = await parse_body(request, UnloadLoRAAdapterRequest, server.limits)
        return Response(await lora.unload(body), media_type="text/plain")

    @app.get("/v1/models", responses=_responses(ModelList))
    async def models():
        return server.models().model_dump()

    @app.get("/v1/models/{model:path}", responses=_responses(ModelCard))
    async def model(model: str):
        adapter = server.resolve_model(model)
        cards = server.models().data
        return (cards[0] if adapter is None else next(c for c in cards if c.id == adapter.lora_name)).model_dump()

    @app.get("/health")
    async def health():
        health = await server.health()
        body = {"status": "ok" if health["is_healthy"] else "unavailable", "model": server.model_name,
                "workers": health["workers"]}  # starting / ready / draining / dead
        return body if health["is_healthy"] else _json_response(body, 503)

    # vLLM's (SageMaker's probe): /health by another name, GET or POST (an operation id for each).
    for method in ("GET", "POST"):
        app.add_api_route("/ping", health, methods=[method], operation_id=f"ping_{method.lower()}")

    @app.get("/version")
    async def version():
        return {"version": __version__}   # vLLM's route and body

    @app.get("/metrics")
    async def metrics():
        return Response(await server.metrics_text(), media_type=CONTENT_TYPE)

    @app.get("/stats")
    async def stats():
        return await server.stats()

    add_dashboard_routes(app, server.handle, server.check_auth, server.metrics)
    return app
