"""A worker's side of the wire to the central KV manager: events out, never blocking a step.

The worker's ``LocalKVManager`` plans every step in-process. ``KVPublisher``
ships what changed: ``maybe_flush`` (called after each engine step and by an
idle timer, on the engine's thread) drains the event log into one batch and
sends it fire-and-forget once the oldest pending change is
``max_batch_age_s`` old or ``max_batch_events`` changes are pending, and at
least every ``heartbeat_s`` (occupancy, and so a restarted central manager
hears from every worker). Acks are read without waiting; an ack that asks
for a resync, a new central incarnation or a failed call makes the next
flush a full snapshot. A publish asks for an ack of its own only every
``ack_interval_s`` (or when the in-flight window is half full): a transport
that can (``ZmqTransport``) replies to the others only when something is
wrong, and they count as acknowledged by the next reply, since replies come
in order. That cuts the central manager's replies to about one batch in
four at 50 ms flushes (the batches it receives stay as many); a lost batch
is still found, by the gap or the ack timeout. At most ``max_in_flight`` sends are outstanding:
while the central manager is down or slow, events accumulate in the log
(bounded: past its cap the next flush is a snapshot) and the worker keeps
serving.

On a tick (``tick_s``: the cluster's ``kv_events.relay_flush_s``, over ZeroMQ):
the relays forward, and central drains, once per ``tick_s`` of wall time, so a
batch sent after every step would mostly wait there. A worker then sends its
changes once per tick instead, just before it: ``flush_on_tick``, called
``send_margin_s`` before each multiple of ``tick_s`` (``next_tick``) by the
sender thread, drains the event log there and sends (the log is locked for
it: the engine's thread keeps recording) and ``maybe_flush`` sends only what
needs the engine's thread (a snapshot, an overfull log). One batch per tick,
not one per step (a third as many at 50 steps/s and a 60 ms tick): a change
waits on the worker for the tick it would have waited for at the relay, plus
the margin (a batch's oldest change is about a tick old when it is drained).
The drain and pack leave the step path too.

The only blocking call is ``decide_preemption``, made by the local manager's
``RemotePreemptionPolicy`` when a step cannot grow, with its own timeout.

Two threads may share the work (``background=True``, as a worker runs it):
the engine's thread only drains and packs into an outbox (``maybe_flush``:
pure Python, no transport call, so a step never waits to get the GIL back
from the transport's native code), and a sender thread runs ``pump``, which
sends the outbox and reads acks; ``wakeup`` tells it there is work. With
``background=False`` ``maybe_flush`` pumps itself (tests, benchmarks).

The transport is passed in (``KVTransport``): the cluster uses Ray actor
calls (``workers.kv_events.link.RayTransport``); tests and benchmarks may use
anything that honours the protocol. No Ray import here.
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
from typing import Any, Protocol

from .events import PublishAck
from .local_manager import LocalKVManager
from .preemption import PreemptionDecision, PreemptionRequest

logger = logging.getLogger(__name__)

WAIT_SLICE_S = 0.05   # flush_and_wait reads acks (and applies ack timeouts) at least this often


def next_tick(now: float, period_s: float, offset_s: float = 0.0) -> float:
    """The first wall time after ``now`` that is ``offset_s`` past a multiple of ``period_s``:
    the clock that workers' publishers, the relays (offset 0) and central's receiver share."""
    return (math.floor((now - offset_s) / period_s) + 1) * period_s + offset_s


class KVTransport(Protocol):
    """Calls to the central ``KVManagerService`` by method name, with msgpack bytes."""

    def send(self, method: str, packed: bytes, want_ack: bool = True) -> Any:
        """Start ``method(packed)`` without waiting; returns a token for ``poll``/``wait``.
        ``want_ack=False`` (a publish): the central manager need not reply unless something is
        wrong; the call then ends with reply None once a later call's reply has come."""

    def poll(self, tokens: list) -> list[tuple[Any, bytes | None, BaseException | None]]:
        """The tokens whose calls have ended, without waiting: (token, reply, error); reply
        None for a ``want_ack=False`` send acknowledged by a later reply."""

    def wait(self, tokens: list, timeout_s: float) -> None:
        """Block until every token's call has ended, or ``timeout_s``."""

    def call(self, method: str, packed: bytes, timeout_s: float) -> bytes:
        """``method(packed)``, waiting at most ``timeout_s``; raises on failure or timeout."""


class KVPublisher:
    """Publishes one worker's KV events to the central ``KVManagerService``."""

    def __init__(self, local: LocalKVManager, transport: KVTransport, max_batch_age_s: float = 0.05,
                 max_batch_events: int = 1024, heartbeat_s: float = 1.0, max_in_flight: int = 8,
                 ack_interval_s: float = 0.2, preemption_timeout_s: float = 1.0,
                 background: bool = False, tick_s: float | None = None, send_margin_s: float = 0.02) -> None:
        if local.event_log is None:
            raise ValueError("the local KV manager needs an event log")
        self.local = local
        self.transport = transport
        self.max_batch_age_s = max_batch_age_s
        self.tick_s = tick_s
        self.send_margin_s = send_margin_s
        self.max_batch_events = max_batch_events
        self.heartbeat_s = heartbeat_s
        self.max_in_flight = max_in_flight
        self.ack_interval_s = ack_interval_s
        self.preemption_timeout_s = preemption_timeout_s
        self.central_incarnation: str | None = None
        self.needs_snapshot = True     # first contact: the central manager learns everything
        self.num_snapshots_sent = 0    # the snapshot epoch: resync answers to older sends are moot
        self.background = background
        self.wakeup = threading.Event()   # set when the outbox has work for ``pump``
        # (method, packed, snapshot epoch, whether it asks for an ack of its own)
        self._outbox: collections.deque[tuple[str, bytes, int, bool]] = collections.deque()
        self._pump_lock = threading.Lock()
        self._in_flight: list[tuple[Any, int]] = []   # (token, epoch)
        self._last_sent = float("-inf")
        self._last_ack_asked = float("-inf")
        self._unconfirmed_quiet = False    # a send without an ack of its own came after the last that asked
        self._adapter_report: bytes | None = None   # the last ``AdapterReport``, sent again after a snapshot
        # Queueing (a drain or snapshot, packed, into the outbox) from either thread, one at a time.
        self._queue_lock = threading.Lock()
        self.num_batches = 0
        self.num_bytes_out = 0
        self.num_bytes_in = 0
        self.num_failed_calls = 0
        self.num_blocking_calls = 0
        self.blocking_seconds = 0.0

    @property
    def log(self):
        return self.local.event_log

    # ---- events out ---------------------------------------------------------------------
    def is_due(self, now: float | None = None) -> bool:
        """Whether ``maybe_flush`` would send now (cheap; safe to ask from another thread)."""
        now = time.monotonic() if now is None else now
        log = self.log
        if self.needs_snapshot or log.needs_snapshot or log.num_pending >= self.max_batch_events:
            return True
        if self.tick_s is not None:
            return False    # the rest waits for the tick: ``flush_on_tick``
        return (log.pending_age_s() >= self.max_batch_age_s or now - self._last_sent >= self.heartbeat_s
                or (self._unconfirmed_quiet and now - self._last_ack_asked >= self.ack_interval_s))

    def next_flush_at(self, now: float | None = None) -> float:
        """When ``flush_on_tick`` is due next: ``send_margin_s`` before the next tick, wall time."""
        now = time.time() if now is None else now
        return next_tick(now + self.send_margin_s, self.tick_s) - self.send_margin_s

    def flush_on_tick(self) -> bool:
        """A tick's batch (``tick_s``; the sender thread, just before the tick), drained and packed
        into the outbox: what changed since the last batch, or a heartbeat, or a batch that asks
        for an ack when quiet ones are unconfirmed; a snapshot is left to the engine's thread.
        In the background the caller pumps it out (several publishers' batches can be packed
        first, then sent: a send lets other threads take the GIL). True if something was queued."""
        now = time.monotonic()
        log = self.log
        with self._queue_lock:
            if (self.needs_snapshot or log.needs_snapshot
                    or len(self._in_flight) + len(self._outbox) >= self.max_in_flight
                    or not (log.num_pending or now - self._last_sent >= self.heartbeat_s
                            or (self._unconfirmed_quiet and now - self._last_ack_asked >= self.ack_interval_s))):
                return False
            self._queue_next()
        if not self.background:
            self.pump()
        return True

    def maybe_flush(self) -> bool:
        """Drain and pack what is due into the outbox, without waiting for anything (the
        engine's thread). True if something was queued."""
        if not self.background:
            self.pump()
        if not self.is_due() or len(self._in_flight) + len(self._outbox) >= self.max_in_flight:
            return False  # nothing due, or the central manager is behind or down: keep accumulating
        with self._queue_lock:
            self._queue_next()
        if self.background:
            self.wakeup.set()
        else:
            self.pump()
        return True

    def pump(self) -> None:
        """Send what the outbox holds and read the acks that came back, without waiting
        (the sender thread, or ``maybe_flush`` itself when not in the background). Every
        transport call is made under one lock: a transport is used by one thread at a time."""
        with self._pump_lock:
            self._pump()

    def _pump(self) -> None:
        while self._outbox:
            method, packed, epoch, want_ack = self._outbox.popleft()
            self._in_flight.append((self.transport.send(method, packed, want_ack), epoch))
        self._collect_acks()

    def flush_and_wait(self, timeout_s: float) -> bool:
        """Send everything now and wait for every outstanding ack (checks and tests, off the
        step path; the engine's thread). False when the central manager did not take it all
        in time.

        It waits in slices of ``WAIT_SLICE_S`` and reads acks between them, so a send that
        will never be answered (lost while the central manager or a relay restarted) ends at
        its ack timeout, and the snapshot that replaces it goes out then, not after the
        whole budget has been spent waiting for the lost reply."""
        deadline = time.monotonic() + timeout_s
        with self._queue_lock:
            self._queue_next(want_ack=True)
        while True:
            with self._pump_lock:
                self._pump()
                in_flight = [token for token, _ in self._in_flight]
            if not (in_flight or self._outbox or self.needs_snapshot or self.log.needs_snapshot):
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if not (in_flight or self._outbox):
                with self._queue_lock:     # a resync was asked for, or a send failed
                    self._queue_next(want_ack=True)
                continue
            with self._pump_lock:
                self.transport.wait(in_flight, min(left, WAIT_SLICE_S))

    def report_adapters(self, packed_report: bytes) -> None:
        """Send the LoRA adapters this worker holds (a packed ``AdapterReport``, whole), beside
        the batches (the engine's thread). The last report goes again after every snapshot, so
        a restarted central manager learns it with the blocks."""
        with self._queue_lock:
            self._adapter_report = packed_report
            self._queue("report_adapters", packed_report, True)
        if self.background:
            self.wakeup.set()
        else:
            self.pump()

    def _queue_next(self, want_ack: bool = False) -> None:
        if self.needs_snapshot or self.log.needs_snapshot:
            self.needs_snapshot = False
            self.num_snapshots_sent += 1
            self._queue("resync", self.local.snapshot().pack(), True)
            if self._adapter_report is not None:
                self._queue("report_adapters", self._adapter_report, True)
        else:
            self._queue("publish", self.local.drain_events().pack(), want_ack)
            self.num_batches += 1

    def _queue(self, method: str, packed: bytes, want_ack: bool) -> None:
        now = time.monotonic()
        want_ack = (want_ack or now - self._last_ack_asked >= self.ack_interval_s
                    or 2 * (len(self._in_flight) + len(self._outbox) + 1) >= self.max_in_flight)
        if want_ack:
            self._last_ack_asked = now
        self._unconfirmed_quiet = not want_ack
        self._outbox.append((method, packed, self.num_snapshots_sent, want_ack))
        self._last_sent = now
        self.num_bytes_out += len(packed)

    def _collect_acks(self) -> None:
        if not self._in_flight:
            return
        ended = self.transport.poll([token for token, _ in self._in_flight])
        if not ended:
            return
        epochs = dict((id(token), epoch) for token, epoch in self._in_flight)
        done = set()
        for token, reply, error in ended:
            done.add(id(token))
            is_current = epochs[id(token)] == self.num_snapshots_sent
            if error is not None:  # the central manager died (it is restarted) or refused
                self.num_failed_calls += 1
                if is_current:
                    logger.warning("worker %s: KV event publish failed (%r); will resync",
                                   self.log.worker_id, error)
                    self.needs_snapshot = True
                continue
            if reply is None:  # no ack of its own: a later reply acknowledged it
                continue
            self.num_bytes_in += len(reply)
            ack = PublishAck.unpack(reply)
            if self.central_incarnation != ack.incarnation:
                if self.central_incarnation is not None:
                    logger.warning("worker %s: the central KV manager restarted; resyncing",
                                   self.log.worker_id)
                    self.needs_snapshot = True
                self.central_incarnation = ack.incarnation
            if ack.needs_resync and is_current:
                self.needs_snapshot = True
        self._in_flight = [(t, e) for t, e in self._in_flight if id(t) not in done]

    # ---- the rare blocking call ---------------------------------------------------------------
    def decide_preemption(self, request: PreemptionRequest) -> PreemptionDecision:
        """One blocking central call for a step's victims; raises on failure or timeout
        (``RemotePreemptionPolicy`` then decides locally)."""
        start = time.perf_counter()
        self.num_blocking_calls += 1
        try:
            packed = self.transport.call("decide_preemption", request.pack(), self.preemption_timeout_s)
        finally:
            self.blocking_seconds += time.perf_counter() - start
        return PreemptionDecision.unpack(packed)

    def stats(self) -> dict:
        return {"num_event_batches": self.num_batches, "num_snapshots": self.num_snapshots_sent,
                "kv_publish_tick_s": self.tick_s,
                "num_in_flight": len(self._in_flight) + len(self._outbox),
                "num_pending_events": self.log.num_pending,
                "num_dropped_events": self.log.num_dropped, "kv_bytes_out": self.num_bytes_out,
                "kv_bytes_in": self.num_bytes_in, "num_failed_kv_calls": self.num_failed_calls,
                "num_blocking_kv_calls": self.num_blocking_calls,
                "mean_blocking_kv_call_ms": (1e3 * self.blocking_seconds / self.num_blocking_calls
                                             if self.num_blocking_calls else 0.0),
                "central_incarnation": self.central_incarnation}


class InProcessTransport:
    """A ``KVTransport`` that calls a ``KVManagerService`` object directly (tests, offline
    benchmarks): every send has ended by the time it returns."""

    def __init__(self, service) -> None:
        self.service = service
        self.is_down = False   # tests: every call fails while set
        self._ended: dict[int, tuple[bytes | None, BaseException | None]] = {}

    def send(self, method: str, packed: bytes, want_ack: bool = True):
        token = object()
        try:
            self._ended[id(token)] = (self.call(method, packed, 0.0), None)
        except Exception as exc:
            self._ended[id(token)] = (None, exc)
        return token

    def poll(self, tokens: list):
        return [(t, *self._ended.pop(id(t))) for t in tokens if id(t) in self._ended]

    def wait(self, tokens: list, timeout_s: float) -> None:
        return None

    def call(self, method: str, packed: bytes, timeout_s: float) -> bytes:
        if self.is_down:
            raise ConnectionError("the central KV manager is down")
        return getattr(self.service, method)(packed)
