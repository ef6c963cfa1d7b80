"""Streaming on top of the engine: ``async for output in engine.generate(...)``.

The engine loop runs in one background thread. Each request's outputs go to
its own asyncio queue on the caller's event loop. A caller that stops
iterating (a client that disconnects, a cancelled task) aborts its request,
so its blocks return to the pool at once.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from typing import AsyncIterator

from .engine import EngineConfig, LLMEngine
from .request import RequestOutput
from .sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop failed; requests in flight end with this error."""


class AsyncLLMEngine:
    """Thread-safe, streaming front of an ``LLMEngine``.

    ``generate`` validates the request synchronously (a bad request raises
    before anything is queued, and other requests are unaffected), then
    yields a ``RequestOutput`` per step that produced tokens for it; the last
    one has ``finished=True``.
    """

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._lock = threading.Lock()
        self._wakeup = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._ids = itertools.count()
        self._stopped = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="pagedserve-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig, **engine_kwargs) -> "AsyncLLMEngine":
        return cls(LLMEngine(config, **engine_kwargs))

    # ---- requests -----------------------------------------------------------------
    async def generate(self, prompt: str | list[int] | None, params: SamplingParams | None = None,
                       request_id: str | None = None, priority: int = 0,
                       prompt_token_ids: list[int] | None = None,
                       **transfer_options) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs. ``transfer_options`` are ``LLMEngine.add_request``'s
        disaggregation options (``export_kv``, ``kv_transfer``, ``output_token_ids``)."""
        if self.error is not None:
            raise EngineDeadError(f"the engine loop failed: {self.error!r}")
        request_id = request_id or f"req-{next(self._ids)}"
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            self.engine.add_request(request_id, prompt, params, priority, prompt_token_ids,
                                    **transfer_options)
            self._streams[request_id] = (loop, queue)
        self._wakeup.set()
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> bool:
        """Abort a request; its stream ends with a final output (finish_reason "abort")."""
        with self._lock:
            aborted = self.engine.abort_request(request_id)
        self._wakeup.set()
        return aborted

    # ---- the loop -------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopped:
            with self._lock:
                busy = self.engine.has_unfinished_requests() or self.engine.has_pending_outputs()
            if not busy:
                self._wakeup.wait(timeout=0.5)
                self._wakeup.clear()
                continue
            try:
                with self._lock:
                    outputs = self.engine.step()
                    deliveries = []
                    for output in outputs:
                        stream = self._streams.get(output.request_id)
                        if stream is not None:
                            deliveries.append((stream, output))
                            if output.finished:
                                del self._streams[output.request_id]
            except Exception as exc:  # a bug or a device failure: fail loudly, keep nothing hanging
                logger.exception("engine step failed")
                self._fail(exc)
                return
            for (loop, queue), output in deliveries:
                if not _deliver(loop, queue, output) and not output.finished:
                    self.abort(output.request_id)

    def _fail(self, exc: BaseException) -> None:
        self.error = exc
        with self._lock:
            streams, self._streams = self._streams, {}
        error = EngineDeadError(f"the engine loop failed: {exc!r}")
        for loop, queue in streams.values():
            _deliver(loop, queue, error)

    def take_kv_export(self, request_id: str):
        with self._lock:
            return self.engine.take_kv_export(request_id)

    def note_transfer(self, request_id: str, fetch_s: float, memcpy_s: float) -> None:
        """Add the worker-side transfer timings to a request's metrics."""
        with self._lock:
            request = self.engine.requests.get(request_id)
            if request is not None:
                request.metrics.kv_transfer_s += fetch_s
                request.metrics.kv_memcpy_s += memcpy_s

    # ---- introspection ----------------------------------------------------------------
    def stats(self) -> dict:
        with self._lock:
            return self.engine.stats()

    def check_integrity(self) -> None:
        with self._lock:
            self.engine.check_integrity()

    def num_used_blocks(self) -> int:
        with self._lock:
            return self.engine.num_used_blocks()

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def shutdown(self) -> None:
        self._stopped = True
        self._wakeup.set()
        self._thread.join(timeout=10)


def _deliver(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, item) -> bool:
    """Hand ``item`` to a caller's queue on its event loop; False when that loop has
    closed (the caller is gone), which must not take the engine loop down."""
    try:
        loop.call_soon_threadsafe(queue.put_nowait, item)
    except RuntimeError:
        return False
    return True
