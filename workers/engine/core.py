"""The engine core's loop: schedule -> forward -> sample -> finish checks, and nothing else.

``EngineCore`` runs in a process of its own, one per worker (``core_process``), on one
thread: no event loop, no Ray, no output thread shares its GIL. Between steps it reads its
inbox (requests to add, aborts, utility calls: ``core_messages.ToCore``), and after each step
it sends each output channel one packed ``StreamBatch`` (the step's rows for that handle's
requests): straight to the handle's socket for a channel of the socket transport
(``output_sockets``), else to the worker actor, which forwards the bytes unopened.

Block accounting stays here (``LocalKVManager``): the KV publisher drains and packs events
after steps as before, and hands the packed batches to the actor, which owns the transport to
the central KV manager (``CoreKVTransport``: a ``KVTransport`` whose calls are messages).
The rare blocking question, how to preempt, is asked of the actor the same way
(``ask``), with its own timeout.

The actor reads the core's progress (last step's time, unfinished requests, steps, tokens)
from a small shared mapping (``CoreProgress``), so a heartbeat costs the core nothing.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from typing import Any, Callable

from pagedserve.kvmanager import AdapterReport

from ..actor.protocol import EngineDeadError, Migrated
from ..lora.lora_request import LoRARequest
from ..outputs.stream_batch import StreamBatch, StreamTarget
from .core_messages import (ZERO_COPY_BYTES, AddRequest, FromCore, ToCore, error_to_wire, pack, payload_from_frame,
                            unpack)
from .core_progress import CoreProgress
from .engine import LLMEngine
from .kv_transfer import KVTransfer
from .output_sockets import OutputSockets

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.5             # an idle core re-checks its parent and its KV link at least this often
KV_IDLE_WAKEUP_S = 0.025      # an idle core's due KV flushes and acks: no need to wake more often
PARENT_CHECK_S = 1.0          # how often the core checks that its worker actor still lives
ASK_MARGIN_S = 0.5            # an ask's own timeout plus this, for the actor's reply to arrive


class ActorLink:
    """The core's two sockets to its worker actor: ``inbox`` (PULL) and ``outbox`` (PUSH).

    ``receive`` takes what came: KV replies and answers to the core's own asks at once, every
    other message queued in ``commands`` for the loop, in order; ``ask`` waits for one answer,
    reading (and queueing) whatever else comes meanwhile.
    """

    def __init__(self, inbox, outbox) -> None:
        import zmq

        self._zmq = zmq
        self.inbox = inbox
        self.outbox = outbox
        self.commands: deque[list] = deque()
        self.kv_transport = CoreKVTransport(self)
        self._answers: dict[int, list] = {}
        self._next_ask = 0
        self._poller = zmq.Poller()
        self._poller.register(inbox, zmq.POLLIN)

    def watch(self, socket) -> None:
        """Wake ``receive``'s wait when ``socket`` has input too (a channel's socket)."""
        self._poller.register(socket, self._zmq.POLLIN)

    def unwatch(self, socket) -> None:
        self._poller.unregister(socket)

    def send(self, kind: bytes, *frames) -> None:
        self.outbox.send_multipart([kind, *frames], copy=all(memoryview(f).nbytes < ZERO_COPY_BYTES for f in frames))

    def receive(self, timeout_s: float) -> None:
        """Read what the inbox holds, waiting up to ``timeout_s`` for the first message."""
        zmq = self._zmq
        if timeout_s > 0 and not self._poller.poll(max(1, int(timeout_s * 1e3))):
            return
        while True:
            try:
                frames = self.inbox.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            kind = frames[0].bytes
            if kind == ToCore.KV_ENDED:
                token_id, reply, error = unpack(frames[1].buffer)
                self.kv_transport.ended(token_id, reply, error)
            elif kind == ToCore.ANSWER:
                ask_id, ok, result = unpack(frames[1].buffer)
                self._answers[ask_id] = [ok, result]
            else:
                self.commands.append(frames)

    def ask(self, method: str, args: list, timeout_s: float) -> Any:
        """Ask the worker actor (``method``: an operation only its process can make, on Ray)
        and wait for its answer: ``TimeoutError`` after ``timeout_s``, ``RuntimeError`` naming
        the actor's error if it failed."""
        ask_id = self._next_ask
        self._next_ask += 1
        self.send(FromCore.ASK, pack([ask_id, method, args]))
        deadline = time.monotonic() + timeout_s
        while ask_id not in self._answers:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"the worker actor did not answer {method!r} in {timeout_s:g} s")
            self.receive(left)
        ok, result = self._answers.pop(ask_id)
        if not ok:
            raise RuntimeError(f"the worker actor could not {method}: {result}")
        return result


class CoreKVTransport:
    """A ``KVTransport`` (``kvmanager.publisher``) whose calls are messages to the worker actor,
    which makes them on its real transport and sends back how each ended."""

    def __init__(self, link: ActorLink) -> None:
        self.link = link
        self._next_token = 0
        self._ended: dict[int, tuple[bytes | None, BaseException | None]] = {}

    def send(self, method: str, packed: bytes, want_ack: bool = True) -> "_KVToken":
        token = _KVToken(self._next_token)
        self._next_token += 1
        self.link.send(FromCore.KV_SEND, pack([token.id, method, want_ack]), packed)
        return token

    def ended(self, token_id: int, reply: bytes | None, error: str | None) -> None:
        self._ended[token_id] = (reply, None if error is None else ConnectionError(error))

    def poll(self, tokens: list) -> list:
        self.link.receive(0.0)
        return [(token, *self._ended.pop(token.id)) for token in tokens if token.id in self._ended]

    def wait(self, tokens: list, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while any(token.id not in self._ended for token in tokens):
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self.link.receive(left)

    def call(self, method: str, packed: bytes, timeout_s: float) -> bytes:
        return self.link.ask("kv_call", [method, packed, timeout_s], timeout_s + ASK_MARGIN_S)


class _KVToken:
    __slots__ = ("id",)

    def __init__(self, token_id: int) -> None:
        self.id = token_id


class PhaseClock:
    """The core thread's CPU time by phase of its loop (``time.thread_time``: waiting costs none):
    ``mark(phase)`` charges the time since the last mark to ``phase``."""

    PHASES = ("inbox", "step", "outputs", "send", "kv")

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(self.PHASES, 0.0)
        self._last = time.thread_time()

    def mark(self, phase: str) -> None:
        now = time.thread_time()
        self.seconds[phase] += now - self._last
        self._last = now


class EngineCore:
    """One worker's engine, driven in a loop by its inbox (see the module docstring).

    ``link`` carries its messages to and from the worker actor; ``parent_pid`` is the actor's
    process: the core ends when it is gone.
    """

    def __init__(self, engine: LLMEngine, link: ActorLink, progress: CoreProgress, engine_id: str,
                 parent_pid: int | None = None) -> None:
        self.engine = engine
        self.processor = engine.output_processor
        self.link = link
        self.send = link.send
        self.progress = progress
        self.engine_id = engine_id
        self.parent_pid = parent_pid
        self.publisher = None
        self.preemption = None      # the worker's RemotePreemptionPolicy (its counters, for stats)
        self.gc_pauses = None       # this process's collections (``process.gc_heap``)
        self._kv_flush_at: float | None = None
        self._exports: dict[str, StreamTarget] = {}   # prefill requests whose KV export goes out at their end
        self._is_stopping = False
        self._pending_stall_s = 0.0
        self._pending_failure: str | None = None
        self._reported_adapters = 0   # the LoRA residency version last reported to the central manager
        self._next_parent_check = 0.0
        self.clock = PhaseClock()
        self.sockets = OutputSockets(link.watch, link.unwatch)
        self._calls: dict[str, Callable[..., Any]] = {
            "stats": self._stats, "block_map": engine.block_map, "check_integrity": engine.check_integrity,
            "num_used_blocks": engine.num_used_blocks, "kv_sync": self._kv_sync,
            "start_draining": self._start_draining, "drain_status": self._drain_status,
            "inject_stall": self._inject_stall, "inject_failure": self._inject_failure,
            "close_channel": self._close_channel, "open_output_socket": self.sockets.open,
            "add_lora": self._add_lora,
            "remove_lora": engine.remove_lora}

    def attach_publisher(self, publisher, preemption=None) -> None:
        """The worker's ``KVPublisher`` (over ``link.kv_transport``): flushed after steps and
        when due while idle; on a tick (``publisher.tick_s``) just before each tick. And its
        preemption policy, whose counters the stats report."""
        self.publisher = publisher
        self.preemption = preemption
        if publisher.tick_s is not None:
            self._kv_flush_at = publisher.next_flush_at()

    # ---- the loop -----------------------------------------------------------------------------
    def run(self) -> None:
        """Serve until told to stop or the worker actor is gone. An engine failure is sent to
        the actor (``FromCore.DEAD``) and re-raised."""
        engine, link, clock = self.engine, self.link, self.clock
        try:
            while not self._is_stopping:
                is_busy = engine.has_unfinished_requests() or engine.has_pending_outputs()
                link.receive(0.0 if is_busy or link.commands else self._idle_wait_s())
                self._apply()
                clock.mark("inbox")
                if self._is_stopping:
                    break
                if engine.has_unfinished_requests() or engine.has_pending_outputs():
                    self._step()
                self._flush_batches()
                clock.mark("send")
                self._tend()
                clock.mark("kv")
        except Exception as exc:
            logger.exception("engine core %s failed", self.engine_id)
            message = f"the engine loop failed: {exc!r}"
            self.sockets.close_all(EngineDeadError(message, self.engine_id))
            self.send(FromCore.DEAD, pack([self.engine_id, message]))
            raise
        self.sockets.close_all()

    def _step(self) -> None:
        if self._pending_failure is not None:
            raise RuntimeError(self._pending_failure)
        if self._pending_stall_s > 0:
            seconds, self._pending_stall_s = self._pending_stall_s, 0.0
            logger.warning("engine core %s: stalling for %.1f s (fault injection)", self.engine_id, seconds)
            time.sleep(seconds)
        engine, clock = self.engine, self.clock
        step = engine.step_tokens()
        clock.mark("step")
        processed = self.processor.process(step)
        if processed.stopped:
            engine.stop_sequences(processed.stopped)
        clock.mark("outputs")
        # Progress first: whoever sees this step's outputs sees the progress that made them.
        self.progress.note_step(engine.num_steps, len(engine.requests), engine.num_generated_tokens)
        self._flush_batches()
        for request, (header, payload), target in processed.migrated:
            stream = request.stream_target
            # The actor holds the KV for the handle (``Worker.export_ref``); a socket channel's
            # handle hears of the migration here, after the request's last rows.
            self.send(FromCore.MIGRATED, pack([stream.channel_id, stream.key, request.request_id, target]),
                      header, payload)
            self.sockets.put(stream.channel_id, Migrated(request.request_id, target, None))
        if self._exports:
            self._send_exports()

    def _flush_batches(self) -> None:
        sockets = self.sockets
        for channel_id, batch in self.processor.take_batches().items():
            if batch:
                packed = batch.pack()
                if not sockets.put(channel_id, packed):
                    self.send(FromCore.OUTPUTS, channel_id.encode(), packed)
        if sockets.senders:
            for channel_id in sockets.service():
                aborted = self._close_channel(channel_id)
                if aborted:
                    logger.warning("engine core %s: the reader of output channel %s disconnected; aborted its %d "
                                   "running request(s)", self.engine_id, channel_id, aborted)
                else:   # a handle that closed its channel with nothing running (e.g. a replica stopping)
                    logger.info("engine core %s: the reader of output channel %s disconnected; closed it, no "
                                "request ran on it", self.engine_id, channel_id)
                self.send(FromCore.CHANNEL_GONE, channel_id.encode())

    def _send_exports(self) -> None:
        """The prompt KV of each prefill request that ended, after its last outputs."""
        for request_id in [r for r in self._exports if r not in self.engine.requests]:
            target = self._exports.pop(request_id)
            transfer = self.engine.take_kv_export(request_id)
            head = pack([target.channel_id, target.key, request_id, transfer is not None])
            if transfer is None:
                self.send(FromCore.EXPORT, head)
            else:
                self.send(FromCore.EXPORT, head, transfer.header, transfer.payload)

    def _tend(self) -> None:
        """After each pass: KV events out (when due, or at the tick), the LoRA adapters held
        when they changed, and the parent's check."""
        publisher = self.publisher
        if publisher is not None:
            lora = self.engine.lora
            if lora is not None and lora.residency_version != self._reported_adapters:
                self._reported_adapters = lora.residency_version
                log = publisher.log
                publisher.report_adapters(AdapterReport(log.worker_id, log.incarnation, lora.residency_version,
                                                        lora.resident_keys()).pack())
            if self._kv_flush_at is not None and time.time() >= self._kv_flush_at:
                self._kv_flush_at = publisher.next_flush_at()
                publisher.flush_on_tick()
            publisher.maybe_flush()
        now = time.monotonic()
        if self.parent_pid is not None and now >= self._next_parent_check:
            self._next_parent_check = now + PARENT_CHECK_S
            if os.getppid() != self.parent_pid:
                logger.error("engine core %s: its worker actor (pid %d) is gone; exiting", self.engine_id,
                             self.parent_pid)
                self._is_stopping = True

    def _idle_wait_s(self) -> float:
        wait_s = IDLE_WAIT_S
        publisher = self.publisher
        if publisher is not None:
            wait_s = min(wait_s, max(publisher.max_batch_age_s / 2, KV_IDLE_WAKEUP_S))
            if self._kv_flush_at is not None:
                wait_s = min(wait_s, max(0.0, self._kv_flush_at - time.time()))
        return wait_s

    # ---- commands -----------------------------------------------------------------------------
    def _apply(self) -> None:
        """Carry out queued commands in the order they came."""
        commands = self.link.commands
        while commands:
            frames = commands.popleft()
            kind = frames[0].bytes
            if kind == ToCore.ADD:
                self._add(frames)
            elif kind == ToCore.ABORT:
                for request_id in unpack(frames[1].buffer):
                    self.engine.abort_request(request_id)
            elif kind == ToCore.CALL:
                self._call(*unpack(frames[1].buffer))
            elif kind == ToCore.STOP:
                self._is_stopping = True
                return
            else:
                logger.error("engine core %s: unknown message kind %r", self.engine_id, kind)

    def _add(self, frames: list) -> None:
        message = AddRequest.from_body(frames[1].buffer)
        target = StreamTarget(message.channel_id, message.key)
        engine = self.engine
        try:
            transfer = None
            if message.kv_header is not None:
                transfer = KVTransfer(message.kv_header, payload_from_frame(message.kv_header, frames[2].buffer))
            request = engine.make_request(
                message.request_id, message.prompt, message.params, message.priority, message.prompt_token_ids,
                export_kv=message.export_kv, kv_transfer=transfer,
                output_token_ids=message.output_token_ids or None, stream_target=target,
                lora_request=message.lora_request)
            if message.transfer_s is not None:
                fetch_s, memcpy_s = message.transfer_s
                request.metrics.kv_transfer_s += fetch_s
                request.metrics.kv_memcpy_s += memcpy_s
            was_idle = not engine.requests
            engine.admit(request)
            self.progress.note_admitted(len(engine.requests), was_idle)
        except Exception as exc:   # refused: the request ends with the error, nothing else changes
            batch = self.processor.batches.setdefault(message.channel_id, StreamBatch())
            batch.add_error(message.key, exc)
            return
        if message.export_kv:
            self._exports[message.request_id] = target

    def _call(self, call_id: int, method: str, args: list) -> None:
        try:
            result = self._calls[method](*args)
        except Exception as exc:
            self.send(FromCore.REPLY, pack([call_id, False, error_to_wire(exc)]))
            return
        self.send(FromCore.REPLY, pack([call_id, True, result]))

    # ---- utility calls --------------------------------------------------------------------------
    def _stats(self) -> dict:
        engine = self.engine
        pool_stats = engine.kv_manager.stats(engine.worker_id)   # once: O(sequences)
        stats = engine.stats(pool_stats)
        preemption = self.preemption
        return {"engine": stats, "kv_pool": pool_stats,
                "kv_link": {} if self.publisher is None else self.publisher.stats(),
                "preemption": {} if preemption is None else {
                    "num_central_preemption_calls": preemption.num_calls,
                    "num_central_preemption_failures": preemption.num_failures,
                    "num_local_preemption_decisions": preemption.num_local},
                "is_draining": engine.scheduler.is_draining,
                "num_drain_migrations": engine.scheduler.num_drain_migrations,
                "gc": {} if self.gc_pauses is None else self.gc_pauses.snapshot(),
                "cpu_seconds": dict(self.clock.seconds)}

    def _kv_sync(self, timeout_s: float) -> bytes | None:
        if self.publisher is None or not self.publisher.flush_and_wait(timeout_s):
            return None
        return self.publisher.local.snapshot().pack()

    def _start_draining(self) -> int:
        self.engine.scheduler.is_draining = True
        return len(self.engine.requests)

    def _drain_status(self) -> dict:
        scheduler = self.engine.scheduler
        return {"is_draining": scheduler.is_draining, "num_unfinished": len(self.engine.requests),
                "num_drain_migrations": scheduler.num_drain_migrations}

    def _add_lora(self, lora_name: str, lora_int_id: int, lora_path: str) -> bool:
        return self.engine.add_lora(LoRARequest(lora_name, lora_int_id, lora_path))

    def _close_channel(self, channel_id: str) -> int:
        """Abort every request of output channel ``channel_id`` (its handle is gone) and end its
        socket if it has one; how many requests."""
        engine = self.engine
        request_ids = [rid for rid, request in engine.requests.items()
                       if request.stream_target is not None and request.stream_target.channel_id == channel_id]
        for request_id in request_ids:
            engine.abort_request(request_id)
        self.sockets.close(channel_id)
        return len(request_ids)

    # Fault injection for tests; the worker actor, the core's only caller, checks that it is on.
    def _inject_stall(self, seconds: float) -> None:
        self._pending_stall_s = float(seconds)

    def _inject_failure(self, message: str) -> None:
        """The next step raises: the engine loop fails as a bug or a device error would."""
        self._pending_failure = f"injected: {message}"



__all__ = ["CoreKVTransport", "EngineCore"]
