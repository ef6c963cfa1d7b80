"""Streaming on top of the engine: ``async for output in engine.generate(...)``.

The engine loop runs in one background thread, which alone touches the
``LLMEngine`` once it has started. Callers never wait for a step: ``generate``
validates its request on the caller's thread (``LLMEngine.make_request`` reads
only what never changes), then posts it to an inbox that the engine thread
drains between steps; aborts and introspection calls go through the same
inbox. A second thread, the output thread, turns each step's sampled tokens
into outputs (``OutputProcessor``: detokenizing, stop strings, deltas), so the
engine thread goes on to the next step meanwhile; sequences a stop string
ended go back to the engine thread through the inbox, before their final
output is delivered. Each request's outputs go to its own asyncio queue (or,
through ``add_stream``, any sink) on the caller's event loop, one wake-up of
that loop per step however many of its requests the step fed, so an event
loop that serves many streams is never blocked by the engine. A caller that stops iterating (a client that
disconnects, a cancelled task) aborts its request, so its blocks return to the
pool at once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import queue
import threading
import uuid
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Protocol

from ..actor.protocol import EngineDeadError
from ..engine.engine import EngineConfig, LLMEngine
from ..engine.request import Request, Sequence
from ..outputs.output_processor import EngineStep
from ..outputs.request_output import RequestOutput
from ..sample.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.5  # an idle engine thread re-checks its inbox at least this often


@dataclass
class _Add:
    request: Request


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    fn: Callable[[LLMEngine], Any]
    future: concurrent.futures.Future


@dataclass
class _Stop:
    seqs: list[Sequence]   # stop strings ended them (found by the output thread)


class OutputSink(Protocol):
    """Where a request's outputs go (``AsyncLLMEngine.add_stream``): an ``asyncio.Queue`` fits."""

    def put_nowait(self, item: RequestOutput | BaseException) -> None: ...


# Ends the output thread's queue.
_NO_MORE_STEPS = None


class AsyncLLMEngine:
    """Thread-safe, streaming front of an ``LLMEngine``.

    ``generate`` validates the request synchronously (a bad request raises
    before anything is queued, and other requests are unaffected), then
    yields a ``RequestOutput`` per step that produced tokens for it; the last
    one has ``finished=True``. No method waits for a step to end except the
    synchronous introspection calls (``stats``, ``check_integrity``,
    ``num_used_blocks``), which run on the engine thread between steps.
    """

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._wakeup = threading.Event()
        self._inbox: list[_Add | _Abort | _Call] = []
        self._inbox_lock = threading.Lock()
        self._is_accepting = True
        # request id -> (event loop, sink) of every request whose final output is not delivered yet
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, OutputSink]] = {}
        self._streams_lock = threading.Lock()
        self._ids = itertools.count()
        self.engine_id = uuid.uuid4().hex[:12]  # this engine loop, in EngineDeadError
        self._stopped = False
        self.error: BaseException | None = None
        self._steps: queue.SimpleQueue[EngineStep | None] = queue.SimpleQueue()
        self._output_thread = threading.Thread(target=self._process_outputs, name="pagedserve-outputs",
                                               daemon=True)
        self._thread = threading.Thread(target=self._run, name="pagedserve-engine", daemon=True)
        engine.attach_driver(self._thread)
        self._output_thread.start()
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
        async with aclosing(self.generate_batches(prompt, params, request_id, priority, prompt_token_ids,
                                                  **transfer_options)) as batches:
            async for batch in batches:
                for output in batch:
                    yield output

    async def generate_batches(self, prompt: str | list[int] | None, params: SamplingParams | None = None,
                               request_id: str | None = None, priority: int = 0,
                               prompt_token_ids: list[int] | None = None,
                               **transfer_options) -> AsyncIterator[list[RequestOutput]]:
        """``generate``, one list at a time: every output the engine has made for the request
        since the caller last asked (one, unless the caller fell behind the steps). A caller
        whose own sending costs more than a step can send each list as one message."""
        queue: asyncio.Queue = asyncio.Queue()
        request_id = self.add_stream(queue, prompt, params, request_id, priority, prompt_token_ids,
                                     **transfer_options)
        finished = False
        try:
            while not finished:
                items = [await queue.get()]
                while not queue.empty():
                    items.append(queue.get_nowait())
                batch = []
                for item in items:
                    if isinstance(item, BaseException):
                        finished = True  # the engine thread already forgot this request
                        if batch:
                            yield batch
                        raise item
                    batch.append(item)
                    finished = item.finished
                yield batch
        finally:
            if not finished:
                self.abort(request_id)

    def add_stream(self, sink: OutputSink, prompt: str | list[int] | None, params: SamplingParams | None = None,
                   request_id: str | None = None, priority: int = 0, prompt_token_ids: list[int] | None = None,
                   **transfer_options) -> str:
        """Start a request whose outputs go to ``sink.put_nowait``, called on this event loop in
        step order: each ``RequestOutput``, the last one ``finished``, or the ``EngineDeadError``
        that ends it. Returns its id. A bad request raises here and nothing is queued.
        ``transfer_options`` are ``LLMEngine.add_request``'s.

        ``generate`` without a coroutine per request: a caller that serves many requests
        handles each step's outputs in one pass (one wake-up of its loop per step). The caller
        aborts the requests it stops reading."""
        self._check_alive()
        request_id = request_id or f"req-{next(self._ids)}"
        request = self.engine.make_request(request_id, prompt, params, priority, prompt_token_ids,
                                           **transfer_options)
        loop = asyncio.get_running_loop()
        with self._streams_lock:
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = (loop, sink)
        if not self._post(_Add(request)):
            self._drop_stream(request_id)
            self._check_alive()
            raise EngineDeadError("the engine is shut down", self.engine_id)
        return request_id

    def abort(self, request_id: str) -> bool:
        """Abort a request; its stream ends with a final output (finish_reason "abort").

        Returns at once (the engine thread applies it before its next step):
        True if the request was still streaming, False if it is unknown or done.
        """
        with self._streams_lock:
            is_known = request_id in self._streams
        self._post(_Abort(request_id))
        return is_known

    def submit(self, fn: Callable[[LLMEngine], Any]) -> concurrent.futures.Future:
        """Run ``fn(engine)`` on the engine thread between two steps; a future of its result.

        Once the engine thread has ended (shut down or failed) nothing else
        touches the engine, so ``fn`` then runs at once on the caller's thread.
        """
        future: concurrent.futures.Future = concurrent.futures.Future()
        if not self._post(_Call(fn, future)):
            _run_call(self.engine, _Call(fn, future))
        return future

    def take_kv_export(self, request_id: str):
        """The prompt KV kept for a request generated with ``export_kv`` (once).

        Safe from any thread once the request's final output arrived: the
        engine thread stored the export before it delivered that output, and
        taking it is a single dict pop.
        """
        return self.engine.take_kv_export(request_id)

    def note_transfer(self, request_id: str, fetch_s: float, memcpy_s: float) -> None:
        """Add the worker-side transfer timings to a request's metrics (without waiting)."""
        def note(engine: LLMEngine) -> None:
            request = engine.requests.get(request_id)
            if request is not None:
                request.metrics.kv_transfer_s += fetch_s
                request.metrics.kv_memcpy_s += memcpy_s

        self.submit(note)

    @property
    def num_streams(self) -> int:
        """Requests accepted whose final output has not been delivered yet."""
        with self._streams_lock:
            return len(self._streams)

    # ---- the loop -------------------------------------------------------------------
    def _post(self, command: _Add | _Abort | _Call | _Stop) -> bool:
        """Queue a command for the engine thread; False once it no longer takes any."""
        with self._inbox_lock:
            if not self._is_accepting:
                return False
            self._inbox.append(command)
        self._wakeup.set()
        return True

    def _take_inbox(self) -> list[_Add | _Abort | _Call | _Stop]:
        with self._inbox_lock:
            commands, self._inbox = self._inbox, []
        return commands

    def _run(self) -> None:
        engine = self.engine
        try:
            while not self._stopped:
                self._wakeup.clear()
                self._apply(self._take_inbox())
                if not (engine.has_unfinished_requests() or engine.has_pending_outputs()):
                    self._wakeup.wait(timeout=IDLE_WAIT_S)
                    continue
                self._steps.put(engine.step_tokens())
        except Exception as exc:  # a bug or a device failure: fail loudly, keep nothing hanging
            logger.exception("engine step failed")
            self.error = exc
        finally:
            self._close()

    def _process_outputs(self) -> None:
        """The output thread: each step's tokens become outputs, in step order."""
        processor = self.engine.output_processor
        while True:
            step = self._steps.get()
            if step is _NO_MORE_STEPS:
                return
            try:
                processed = processor.process(step)
            except Exception as exc:  # a bug: end everything rather than leave streams hanging
                logger.exception("output processing failed")
                self.error = self.error or exc
                self._stopped = True
                self._wakeup.set()
                return
            if processed.stopped:
                # Before the final outputs: a call posted after one (a caller checking that
                # the blocks are back) finds the sequences ended.
                self._post(_Stop(processed.stopped))
            self._deliver_all(processed.outputs)

    def _apply(self, commands: list[_Add | _Abort | _Call | _Stop]) -> None:
        """Carry out queued commands in the order they were posted (engine thread)."""
        for command in commands:
            if isinstance(command, _Add):
                try:
                    self.engine.admit(command.request)
                except Exception as exc:  # e.g. an id the engine already holds
                    self._end_stream(command.request.request_id, exc)
            elif isinstance(command, _Abort):
                self.engine.abort_request(command.request_id)
            elif isinstance(command, _Stop):
                self.engine.stop_sequences(command.seqs)
            else:
                _run_call(self.engine, command)

    def _deliver_all(self, outputs: list[RequestOutput]) -> None:
        """Hand a step's outputs to their callers' queues: one wake-up per event loop, however
        many of its streams the step fed."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[OutputSink, RequestOutput]]] = {}
        with self._streams_lock:
            for output in outputs:
                stream = self._streams.get(output.request_id)
                if stream is None:
                    continue
                if output.finished:
                    del self._streams[output.request_id]
                by_loop.setdefault(stream[0], []).append((stream[1], output))
        for loop, items in by_loop.items():
            if not _deliver_many(loop, items):  # that loop has closed: its callers are gone
                for _, output in items:
                    if not output.finished:
                        self.abort(output.request_id)

    def _end_stream(self, request_id: str, error: BaseException) -> None:
        stream = self._drop_stream(request_id)
        if stream is not None:
            _deliver(*stream, error)

    def _drop_stream(self, request_id: str):
        with self._streams_lock:
            return self._streams.pop(request_id, None)

    def _close(self) -> None:
        """The thread ends: refuse new commands, deliver the outputs of the steps that
        ran, answer queued calls, end every stream."""
        with self._inbox_lock:
            self._is_accepting = False
        self._steps.put(_NO_MORE_STEPS)
        if threading.current_thread() is not self._output_thread:
            self._output_thread.join(timeout=10)
        for command in self._take_inbox():
            if isinstance(command, _Call):
                _run_call(self.engine, command)
        self.engine.detach_driver(self._thread)
        reason = "the engine loop failed" if self.error is not None else "the engine was shut down"
        with self._streams_lock:
            streams, self._streams = self._streams, {}
        error = EngineDeadError(f"{reason}: {self.error!r}" if self.error is not None else reason, self.engine_id)
        for loop, sink in streams.values():
            _deliver(loop, sink, error)

    def _check_alive(self) -> None:
        if self.error is not None:
            raise EngineDeadError(f"the engine loop failed: {self.error!r}", self.engine_id)

    # ---- introspection ----------------------------------------------------------------
    def stats(self) -> dict:
        """``LLMEngine.stats`` (blocks the calling thread until the engine thread answers)."""
        return self.submit(LLMEngine.stats).result()

    def check_integrity(self) -> None:
        self.submit(LLMEngine.check_integrity).result()

    def num_used_blocks(self) -> int:
        return self.submit(LLMEngine.num_used_blocks).result()

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def shutdown(self) -> None:
        """Stop the engine thread; requests still streaming end with ``EngineDeadError``."""
        self._stopped = True
        self._wakeup.set()
        self._thread.join(timeout=10)


def _run_call(engine: LLMEngine, call: _Call) -> None:
    if not call.future.set_running_or_notify_cancel():
        return
    try:
        call.future.set_result(call.fn(engine))
    except BaseException as exc:  # the caller gets it from the future
        call.future.set_exception(exc)


def _put_many(items: list[tuple[OutputSink, Any]]) -> None:
    for sink, item in items:
        try:
            sink.put_nowait(item)
        except Exception:  # a sink's own bug must not cost the other requests their outputs
            logger.exception("delivering an output of request %s failed", getattr(item, "request_id", "?"))


def _deliver_many(loop: asyncio.AbstractEventLoop, items: list[tuple[OutputSink, Any]]) -> bool:
    """``_deliver`` for several sinks of one event loop, in one call."""
    try:
        loop.call_soon_threadsafe(_put_many, items)
    except RuntimeError:
        return False
    return True


def _deliver(loop: asyncio.AbstractEventLoop, sink: OutputSink, item) -> bool:
    """Hand ``item`` to a caller's sink on its event loop; False when that loop has
    closed (the caller is gone), which must not take the engine loop down."""
    try:
        loop.call_soon_threadsafe(sink.put_nowait, item)
    except RuntimeError:
        return False
    return True
