"""The API without Ray: a ``Frontend`` over one in-process engine, for the API tests.

``LocalHandle`` stands in for ``ClusterHandle`` (one ``AsyncLLMEngine``, with
switches to fail or stall its streams), ``ScriptedHandle`` for one that replies with
given text; ``call`` drives the FastAPI app through httpx's ASGI transport;
``GrpcServer`` serves the production gRPC registration
(``protos/servicer.py``) and ``GrpcService`` on a real local port, so tests use a
real ``grpcio`` client. It stands in for Ray Serve's gRPC proxy only in how a
failed RPC's status reaches the client (the proxy reads the code the service set
on its context; here the status is sent with ``abort``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from contextlib import aclosing

import httpx

from pagedserve.cluster.config import ServerConfig
from pagedserve.cluster.response_store import LocalResponseStore
from pagedserve.cluster.serving.frontend import Frontend
from pagedserve.cluster.serving.grpc_service import GrpcRequestError, GrpcService
from pagedserve.cluster.serving.http_app import build_app
from pagedserve.workers.offline.async_engine import AsyncLLMEngine
from pagedserve.workers.outputs.request_output import (CompletionOutput, RequestMetrics, RequestOutput,
                                                       SampleLogprobs)
from pagedserve.workers.engine.engine import EngineConfig

MODEL = "tiny-test"


class _Remote:
    """Stands in for a Ray actor method: ``.remote()`` returns an awaitable."""

    def __init__(self, fn) -> None:
        self._fn = fn

    def remote(self, *args):
        async def call():
            return self._fn(*args)
        return call()


class _Actor:
    def __init__(self, **methods) -> None:
        for name, fn in methods.items():
            setattr(self, name, _Remote(fn))


class _Router:
    def snapshot(self) -> dict:
        return {}

    def recent_decisions(self, limit: int) -> list[dict]:
        return []


class LocalHandle:
    """The subset of ``ClusterHandle`` the server uses, over one in-process engine."""

    def __init__(self, model_path: str, **engine_options) -> None:
        options = {"num_device_blocks": 128, "swap_space_gb": 0.001, **engine_options}
        self.engine = AsyncLLMEngine.from_config(EngineConfig(model=model_path, **options))
        core = self.engine.engine
        self.model_path = model_path
        self.model_name = MODEL
        self.max_model_len = core.max_model_len
        self.tokenizer = core.tokenizer
        self.router = _Router()
        self._response_store: LocalResponseStore | None = None
        self.fail_with: BaseException | None = None
        self.fail_after_first: BaseException | None = None  # raised once the first output is out
        self.stall_s = 0.0  # > 0: a pause after every output (a slow or stuck generation)
        self.streamed: dict[str, bool] = {}  # request id -> what the frontend said of it (is_streamed)
        self.kv_manager = _Actor(stats=lambda: {"workers": {"worker-0": core.kv_manager.stats("worker-0")}})
        self.workers = {"worker-0": _Actor(stats=lambda: {"is_healthy": True, **self.engine.stats()},
                                           ping=lambda: "worker-0")}

    def response_store(self, max_responses: int, max_bytes: int) -> LocalResponseStore:
        """The stored responses: in this process (the cluster's is an actor), one per handle as
        one per cluster, so that frontends over the same handle share it as replicas do."""
        if self._response_store is None:
            self._response_store = LocalResponseStore(max_responses, max_bytes)
        return self._response_store

    def generate(self, prompt, params, request_id=None, priority=0, prompt_token_ids=None, is_streamed=False,
                 lora_request=None, token_by_token=False):
        assert not token_by_token, "this stand-in streams the engine's outputs as they come"
        self.streamed[request_id] = is_streamed
        if self.fail_with is not None:
            return self._fail()
        stream = self.engine.generate(prompt, params, request_id, priority, prompt_token_ids)
        if self.fail_after_first is not None:
            return self._failing_after_first(stream, self.fail_after_first)
        return self._stalled(stream, self.stall_s) if self.stall_s else stream

    @staticmethod
    async def _failing_after_first(stream, exc: BaseException):
        async with aclosing(stream):
            async for output in stream:
                yield output
                raise exc

    @staticmethod
    async def _stalled(stream, stall_s: float):
        async with aclosing(stream):
            async for output in stream:
                yield output
                await asyncio.sleep(stall_s)

    async def _fail(self):
        raise self.fail_with
        yield  # pragma: no cover - makes this an async generator

    def num_used_blocks(self) -> int:
        return self.engine.num_used_blocks()

    def has_streams(self) -> bool:
        """True while some request's stream has not had its final output delivered."""
        return bool(self.engine._streams)


class ScriptedHandle:
    """The part of ``ClusterHandle`` the frontend uses, replaying ``script``: per sample (the
    first ``n``), its steps (new text, new token ids), finish reason and stop reason. Where
    ``script`` is empty, one sample replies with ``pieces``, one token id each, then
    ``finish_reason``. Outputs come without a pause, so a batch's prompts arrive in order."""

    def __init__(self, model_path: str, tokenizer) -> None:
        self.model_path = model_path
        self.model_name = "m"
        self.tokenizer = tokenizer
        self.max_model_len = 4096
        self.workers: dict = {}
        self.script: list = []
        self.pieces: list[str] = []
        self.finish_reason = "stop"
        self.prompts: list[str] = []
        self.params: list = []

    def has_streams(self) -> bool:
        return False

    def response_store(self, max_responses: int, max_bytes: int):
        return LocalResponseStore(max_responses, max_bytes)

    async def generate(self, prompt, params, request_id=None, priority=0, prompt_token_ids=None, is_streamed=False,
                       lora_request=None, token_by_token=False):
        self.prompts.append(prompt)
        self.params.append(params)
        samples = self.script[:params.n] or [
            ([(piece, [10 + step]) for step, piece in enumerate(self.pieces)], self.finish_reason, None)]
        wants_logprobs = params.logprobs is not None
        texts, ids, logprobs = [""] * len(samples), [[] for _ in samples], [[] for _ in samples]
        num_steps = max(len(steps) for steps, _, _ in samples)
        for step in range(num_steps):
            outputs = []
            for index, (steps, finish_reason, stop_reason) in enumerate(samples):
                delta_text, delta_ids, delta_logprobs = "", [], []
                if step < len(steps):
                    delta_text, delta_ids = steps[step]
                    delta_logprobs = [SampleLogprobs(t, -0.5, [(t, -0.5), (1, -2.0)]) for t in delta_ids]
                    texts[index] += delta_text
                    ids[index] += delta_ids
                    logprobs[index] += delta_logprobs
                is_finished = step >= len(steps) - 1
                outputs.append(CompletionOutput(
                    index, texts[index], list(ids[index]), None, list(logprobs[index]) if wants_logprobs else None,
                    finish_reason if is_finished else None, stop_reason if is_finished else None, delta_text,
                    delta_ids, delta_logprobs if wants_logprobs else None, is_newly_finished=step == len(steps) - 1))
            yield RequestOutput(request_id, prompt, prompt_token_ids, outputs, step == num_steps - 1,
                                RequestMetrics(0.0, num_prompt_tokens=len(prompt_token_ids)))


def make_frontend(handle, **server_fields) -> Frontend:
    return Frontend(handle, ServerConfig.model_validate(server_fields))


def call(server: Frontend, method: str, path: str, **kwargs) -> httpx.Response:
    """One request against ``server``'s app, in a fresh event loop."""
    async def run():
        transport = httpx.ASGITransport(app=build_app(server))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            response = await client.request(method, path, **kwargs)
        # The engine thread delivers an aborted request's final output to this loop: keep it open
        # until then (a closed loop there stops AsyncLLMEngine's thread).
        deadline = time.monotonic() + 10
        while server.handle.has_streams() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return response
    return asyncio.run(run())


def events(response: httpx.Response) -> list:
    """The JSON events of an SSE response (which must end with ``[DONE]``)."""
    lines = [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def chat(frontend: Frontend, stream: bool = False, **body) -> httpx.Response:
    """A chat completion of one user message, "hi", unless ``body`` says otherwise."""
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": stream, **body}
    return call(frontend, "POST", "/v1/chat/completions", json=body)


def streamed_chat(response: httpx.Response) -> tuple[str, str, list[dict], list[dict]]:
    """A streamed reply's reasoning and content, its tool-call pieces and its choices (each delta's
    ``reasoning`` and ``reasoning_content`` must agree)."""
    choices = [c for event in events(response) for c in event["choices"]]
    deltas = [c["delta"] for c in choices]
    for delta in deltas:
        assert delta.get("reasoning") == delta.get("reasoning_content")
    return ("".join(d.get("reasoning") or "" for d in deltas), "".join(d.get("content") or "" for d in deltas),
            [piece for d in deltas for piece in d.get("tool_calls") or []], choices)


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    """The OpenAI error body of ``response``, which must have ``status`` (and name ``param``)."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if param is not None:
        assert error["param"] == param
    return error


class _Servicer:
    """The deployment's RPC methods over ``GrpcService``. A refused unary RPC returns with its
    status set on the context, which grpc sends; a failed stream's status is sent with
    ``abort`` (Serve's proxy reads it from the context instead)."""

    def __init__(self, service: GrpcService) -> None:
        self.service = service

    @staticmethod
    async def _abort(context, exc: GrpcRequestError):
        await context.abort(context.code(), context.details() or str(exc))

    async def Generate(self, request, context):  # noqa: N802 - the RPC's name
        return await self.service.generate(request, context)

    async def Chat(self, request, context):  # noqa: N802
        return await self.service.chat(request, context)

    async def GenerateStream(self, request, context):  # noqa: N802
        try:
            async for response in self.service.generate_stream(request, context):
                yield response
        except GrpcRequestError as exc:
            await self._abort(context, exc)

    async def ChatStream(self, request, context):  # noqa: N802
        try:
            async for response in self.service.chat_stream(request, context):
                yield response
        except GrpcRequestError as exc:
            await self._abort(context, exc)


class GrpcServer:
    """``frontend``'s gRPC service on ``127.0.0.1:<port>`` in a thread of its own (its own loop),
    registered by the production ``add_servicer_to_server``. Use as a context manager."""

    def __init__(self, frontend: Frontend) -> None:
        self.frontend = frontend
        self.target = ""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server = None

    def __enter__(self) -> "GrpcServer":
        import grpc

        from pagedserve.cluster.protos.servicer import add_servicer_to_server

        async def start():
            server = grpc.aio.server()
            add_servicer_to_server(_Servicer(GrpcService(self.frontend)), server)
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            return server, port

        self._thread.start()
        self._server, port = asyncio.run_coroutine_threadsafe(start(), self._loop).result(30)
        self.target = f"127.0.0.1:{port}"
        return self

    def __exit__(self, *exc_info) -> None:
        asyncio.run_coroutine_threadsafe(self._server.stop(grace=1), self._loop).result(30)
        # The engine delivers aborted requests' final outputs to this loop: let them land.
        deadline = time.monotonic() + 10
        while self.frontend.handle.has_streams() and time.monotonic() < deadline:
            time.sleep(0.01)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


@contextlib.contextmanager
def grpc_stub(frontend: Frontend):
    """A real ``grpcio`` client's ``PagedServeStub`` on ``frontend``'s gRPC service."""
    import grpc

    from pagedserve.cluster.protos import pagedserve_pb2_grpc as pb_grpc

    with GrpcServer(frontend) as server, grpc.insecure_channel(server.target) as channel:
        yield pb_grpc.PagedServeStub(channel)


def assert_idle(handle: LocalHandle, timeout_s: float = 10.0) -> None:
    """Once the engine hands back its last blocks (a stream's end reaches the engine a
    moment after the client): none held, and the accounting checks."""
    deadline = time.time() + timeout_s
    while handle.num_used_blocks() and time.time() < deadline:
        time.sleep(0.05)
    assert handle.num_used_blocks() == 0
    handle.engine.check_integrity()


def with_context_length(source: str, target, context_length: int) -> str:
    """A copy of checkpoint ``source`` in ``target`` whose context is ``context_length`` tokens:
    the same weights, so the same logits at every position (a chat template's tools need more
    room than the tiny model's 512 tokens)."""
    import shutil
    from pathlib import Path

    path = Path(target)
    shutil.copytree(source, path)
    for name, key in (("config.json", "max_position_embeddings"), ("tokenizer_config.json", "model_max_length")):
        file = path / name
        if file.exists():
            data = json.loads(file.read_text())
            if key in data:
                data[key] = context_length
                file.write_text(json.dumps(data))
    return str(path)
