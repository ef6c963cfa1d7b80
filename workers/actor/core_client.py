"""The worker actor's end of its engine core process (``workers.engine.core_process``).

``EngineCoreClient`` starts the core, binds the two IPC sockets it connects to (one each way),
and talks to it in bulk: requests in (``add``, ``abort``, utility ``call``s), and a step's
outputs out as one packed ``StreamBatch`` per output channel, which it hands to the actor's
event loop unopened (``on_items``: one call per wake-up, however many channels and steps). A
channel of the socket transport never comes here: the core sends its batches to the handle
itself (``workers.engine.output_sockets``).

The actor connects its sending socket and binds its receiving one; the core binds and
connects the other ends. A reader thread owns the socket from the core: it routes outputs to the event loop, replies
to the callers' futures, KV transport operations to the ``KVForwarder`` (the actor's real
transport to the central KV manager, on a thread of its own), and answers the core's asks
(the central preemption decision, a tensor-parallel group's Ray ranks) itself: the core waits
for them, so nothing else is due meanwhile. The reader thread also starts the core process and
lives as long as it does: the core's ``PR_SET_PDEATHSIG`` is tied to that thread.

A core that reports its engine failed (``FromCore.DEAD``), or whose process ends without a
word, is dead: ``on_dead(message, engine_id)`` runs on the event loop, and every call still
waiting fails. The actor then answers its heartbeat as stalled, and the cluster restarts it.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import itertools
import logging
import os
import shutil
import subprocess
import sys
import threading
from typing import Any, Callable

from ..engine.core_messages import (ZERO_COPY_BYTES, AddRequest, CoreInfo, FromCore, ToCore, error_from_wire,
                                    pack, payload_from_frame, unpack)
from ..engine.core_process import INIT, CoreSpec
from ..engine.core_progress import CoreProgress
from ..process.background_loop import BackgroundLoop
from . import socket_folder

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 900.0        # loading a large model onto a GPU, compiling and capturing graphs
STOP_TIMEOUT_S = 10.0          # a stopping core's time to end before it is killed
POLL_S = 0.5                   # the reader checks the core's process at least this often
EXIT_DRAIN_S = 0.2             # once it has exited, how long its last messages may take to arrive
KV_POLL_S = 0.025              # the forwarder reads acks this often while sends are in flight


class CoreDead(RuntimeError):
    """The engine core failed or its process ended; ``engine_id`` names it (None if it never
    started)."""

    def __init__(self, message: str, engine_id: str | None = None) -> None:
        super().__init__(message)
        self.engine_id = engine_id


class KVForwarder:
    """Makes the core's KV transport operations on the actor's real ``KVTransport`` (its one
    user: ZMQ sockets are not thread-safe), and sends back how each ended."""

    def __init__(self, transport, reply: Callable[[bytes], None]) -> None:
        self.transport = transport
        self.reply = reply
        self._sends: collections.deque[tuple[int, str, bool, bytes]] = collections.deque()
        self._in_flight: dict[int, Any] = {}    # core token id -> transport token
        self.wakeup = threading.Event()
        self._loop = BackgroundLoop("pagedserve-kv-forwarder", self._pump, self._wait_s, wakeup=self.wakeup)
        self._loop.start()

    def send(self, token_id: int, method: str, want_ack: bool, packed: bytes) -> None:
        self._sends.append((token_id, method, want_ack, packed))
        self.wakeup.set()

    def call(self, method: str, packed: bytes, timeout_s: float) -> bytes:
        return self.transport.call(method, packed, timeout_s)

    def _wait_s(self) -> float:
        return KV_POLL_S if self._in_flight else POLL_S

    def _pump(self) -> None:
        transport, sends = self.transport, self._sends
        while sends:
            token_id, method, want_ack, packed = sends.popleft()
            self._in_flight[token_id] = transport.send(method, packed, want_ack)
        if not self._in_flight:
            return
        by_token = {id(token): token_id for token_id, token in self._in_flight.items()}
        for token, reply, error in transport.poll(list(self._in_flight.values())):
            token_id = by_token[id(token)]
            del self._in_flight[token_id]
            self.reply(pack([token_id, reply, None if error is None else repr(error)]))

    def stop(self) -> None:
        self._loop.stop()

    def stats(self) -> dict:
        stats = getattr(self.transport, "stats", None)
        return stats() if stats is not None else {}


class EngineCoreClient:
    """Starts and feeds one engine core (see the module docstring).

    ``on_items(items)`` gets, on the event loop given to ``bind_loop``, each batch of what the
    core sent, in order: ``("outputs", channel_id, packed)``, ``("migrated", channel_id, key,
    request_id, target, header, payload)``, ``("export", channel_id, key, request_id, header,
    payload)`` (header and payload None when the request kept no KV), ``("gone", channel_id)``
    (a socket channel's reader disconnected; the core aborted its requests). ``on_ask(method,
    args)`` answers the core's asks other than ``kv_call`` (on the reader thread).
    """

    def __init__(self, spec: CoreSpec, kv_transport, on_items: Callable[[list], None],
                 on_dead: Callable[[str, str | None], None],
                 on_ask: Callable[[str, list], Any] | None = None) -> None:
        import zmq

        self._zmq = zmq
        self.spec = spec
        self.on_items = on_items
        self.on_dead = on_dead
        self.on_ask = on_ask
        self.info: CoreInfo | None = None
        self.dead: CoreDead | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._early_items: list = []                   # outputs before a loop was bound
        socket_folder.sweep()   # what workers killed before their cores started left
        self._dir = socket_folder.make()
        self.progress = CoreProgress.create(os.path.join(self._dir, "progress"))
        self._context = zmq.Context()
        # Connected, not bound: what is sent before the core binds its end waits in the queue.
        self._to_core = self._context.socket(zmq.PUSH)
        self._to_core.setsockopt(zmq.LINGER, 0)
        self._to_core.connect(f"ipc://{self._dir}/in")
        self._from_core = self._context.socket(zmq.PULL)
        self._from_core.bind(f"ipc://{self._dir}/out")
        self._send_lock = threading.Lock()
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._call_ids = itertools.count()
        self._ready = concurrent.futures.Future()
        self._process: subprocess.Popen | None = None
        self._is_stopping = False
        self.kv = KVForwarder(kv_transport, lambda body: self._send(ToCore.KV_ENDED, body))
        self._reader = threading.Thread(target=self._read, name="pagedserve-core-reader", daemon=True)

    # ---- life ------------------------------------------------------------------------------------
    def start(self, timeout_s: float = START_TIMEOUT_S) -> CoreInfo:
        """Start the core and wait until its engine is ready; ``CoreDead`` if it could not start."""
        self._reader.start()
        self._send(INIT, self.spec.body())
        try:
            self.info = self._ready.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            self.shutdown()
            raise CoreDead(f"the engine core did not start in {timeout_s:g} s") from None
        except CoreDead:
            self.shutdown()
            raise
        return self.info

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    @property
    def is_running(self) -> bool:
        return self.dead is None and self._process is not None and self._process.poll() is None

    def bind_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """Outputs go to ``on_items`` on ``loop`` (the actor's event loop) from now on."""
        if self._loop is None:
            self._loop = loop
            if self._early_items:
                items, self._early_items = self._early_items, []
                loop.call_soon_threadsafe(self.on_items, items)

    def shutdown(self) -> None:
        """Stop the core (killed if it does not end within ``STOP_TIMEOUT_S``), its threads and
        sockets. Idempotent."""
        if self._is_stopping:
            return
        self._is_stopping = True
        try:
            self._send(ToCore.STOP, b"")
        except Exception:
            pass
        process = self._process
        if process is not None:
            try:
                process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                logger.warning("engine core (pid %d) did not stop in %.0f s; killing it", process.pid,
                               STOP_TIMEOUT_S)
                process.kill()
                process.wait(STOP_TIMEOUT_S)
        self.kv.stop()
        if self._reader.is_alive() and threading.current_thread() is not self._reader:
            self._reader.join(timeout=2 * POLL_S)
        self._fail_calls(CoreDead("the engine core was shut down"))
        self._context.destroy(linger=0)
        self.progress.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    # ---- requests --------------------------------------------------------------------------------
    def add(self, request: AddRequest, payload=None) -> None:
        """Queue ``request`` (``payload``: its KV transfer's array, with ``request.kv_header``)."""
        frames = [request.body()] if payload is None else [request.body(), payload]
        self._send(ToCore.ADD, *frames)

    def abort(self, request_ids: list[str]) -> None:
        self._send(ToCore.ABORT, pack(request_ids))

    def call(self, method: str, *args) -> concurrent.futures.Future:
        """Run the core's utility ``method`` between two steps; a future of its result (its
        error rebuilt as the same type when it is a common one; ``CoreDead`` if it died)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        if self.dead is not None:
            future.set_exception(self.dead)
            return future
        call_id = next(self._call_ids)
        self._calls[call_id] = future
        self._send(ToCore.CALL, pack([call_id, method, list(args)]))
        return future

    async def call_async(self, method: str, *args) -> Any:
        return await asyncio.wrap_future(self.call(method, *args))

    def _send(self, kind: bytes, *frames) -> None:
        with self._send_lock:
            self._to_core.send_multipart([kind, *frames], copy=all(memoryview(f).nbytes < ZERO_COPY_BYTES
                                                                  for f in frames))

    # ---- the reader thread ------------------------------------------------------------------------
    def _read(self) -> None:
        zmq = self._zmq
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "pagedserve.workers.engine.core_process", f"ipc://{self._dir}/in",
                 f"ipc://{self._dir}/out", self.progress.path, str(os.getpid())])
        except Exception as exc:
            self._ready.set_exception(CoreDead(f"the engine core could not be started: {exc!r}"))
            return
        socket, process = self._from_core, self._process
        while True:
            if not socket.poll(int(POLL_S * 1e3)):
                if process.poll() is None:
                    continue
                # A core that exits right after its last messages (DEAD with the engine's error)
                # has flushed them to the socket; ZeroMQ's I/O thread here may not have queued
                # them yet: read them first.
                if socket.poll(int(EXIT_DRAIN_S * 1e3)):
                    continue
                self._died(f"the engine core process ended (exit code {process.returncode})", None)
                return
            items = []
            while True:
                try:
                    frames = socket.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                except zmq.ContextTerminated:
                    return
                if not self._take(frames, items):
                    self._deliver(items)
                    self._outlive(process)
                    return
            self._deliver(items)

    def _outlive(self, process: subprocess.Popen) -> None:
        """Wait for a dead core to exit (``STOP_TIMEOUT_S`` at most): it still sends its socket
        channels' last messages (the engine's error) as it exits, and this thread's end would
        SIGKILL it at once (its ``PR_SET_PDEATHSIG``), those messages with it."""
        try:
            process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            logger.warning("dead engine core (pid %d) did not exit in %.0f s; killing it", process.pid,
                           STOP_TIMEOUT_S)

    def _take(self, frames: list, items: list) -> bool:
        """Route one message; False once the core is dead (the reader stops)."""
        kind = frames[0].bytes
        if kind == FromCore.OUTPUTS:
            items.append(("outputs", frames[1].bytes.decode(), frames[2].bytes))
        elif kind == FromCore.KV_SEND:
            token_id, method, want_ack = unpack(frames[1].buffer)
            self.kv.send(token_id, method, want_ack, frames[2].bytes)
        elif kind == FromCore.REPLY:
            call_id, ok, result = unpack(frames[1].buffer)
            future = self._calls.pop(call_id, None)
            if future is not None and future.set_running_or_notify_cancel():
                if ok:
                    future.set_result(result)
                else:
                    future.set_exception(error_from_wire(result, _known_errors()))
        elif kind == FromCore.MIGRATED:
            channel_id, key, request_id, target = unpack(frames[1].buffer)
            header = frames[2].bytes
            items.append(("migrated", channel_id, key, request_id, target, header,
                          payload_from_frame(header, frames[3].buffer)))
        elif kind == FromCore.CHANNEL_GONE:
            items.append(("gone", frames[1].bytes.decode()))
        elif kind == FromCore.EXPORT:
            channel_id, key, request_id, has_export = unpack(frames[1].buffer)
            header = frames[2].bytes if has_export else None
            payload = payload_from_frame(header, frames[3].buffer) if has_export else None
            items.append(("export", channel_id, key, request_id, header, payload))
        elif kind == FromCore.ASK:
            self._answer(*unpack(frames[1].buffer))
        elif kind == FromCore.STARTED:
            # Both ends are connected (this came over one, the spec over the other) and both have
            # mapped the progress file, so nothing needs the paths any more: gone now, before the
            # model loads, they are not left behind by an actor killed at any time after.
            shutil.rmtree(self._dir, ignore_errors=True)
        elif kind == FromCore.READY:
            self._ready.set_result(CoreInfo.from_body(frames[1].buffer))
        elif kind == FromCore.DEAD:
            engine_id, message = unpack(frames[1].buffer)
            self._died(message, engine_id)
            return False
        else:
            logger.error("engine core sent an unknown message kind %r", kind)
        return True

    def _answer(self, ask_id: int, method: str, args: list) -> None:
        try:
            if method == "kv_call":
                result = self.kv.call(*args)
            elif self.on_ask is not None:
                result = self.on_ask(method, args)
            else:
                raise ValueError(f"unknown ask {method!r}")
            answer = [ask_id, True, result]
        except Exception as exc:
            answer = [ask_id, False, repr(exc)]
        self._send(ToCore.ANSWER, pack(answer))

    def _deliver(self, items: list) -> None:
        if not items:
            return
        loop = self._loop
        if loop is None:
            self._early_items.extend(items)
            return
        try:
            loop.call_soon_threadsafe(self.on_items, items)
        except RuntimeError:   # the actor's loop has closed: it is going away
            pass

    def _died(self, message: str, engine_id: str | None) -> None:
        if self._is_stopping and self.dead is None and engine_id is None:
            return   # a core that ended because it was told to
        self.dead = dead = CoreDead(message, engine_id)
        if not self._ready.done():
            self._ready.set_exception(dead)
            return
        logger.error("engine core %s: %s", engine_id or "", message)
        self._fail_calls(dead)
        if self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self.on_dead, message, engine_id)
            except RuntimeError:
                pass

    def _fail_calls(self, error: BaseException) -> None:
        calls, self._calls = self._calls, {}
        for future in calls.values():
            if future.set_running_or_notify_cancel():
                future.set_exception(error)

    # ---- progress -----------------------------------------------------------------------------
    def progress_figures(self) -> tuple[float, int, int, int]:
        """(last step's end, unfinished requests, steps, generated tokens), from the core."""
        return self.progress.read()


def _known_errors() -> dict[str, type]:
    from pagedserve.kvmanager import IntegrityError

    from ..lora.peft_adapter import LoRAAdapterError

    return {"IntegrityError": IntegrityError, "LoRAAdapterError": LoRAAdapterError}


__all__ = ["CoreDead", "EngineCoreClient", "KVForwarder"]
