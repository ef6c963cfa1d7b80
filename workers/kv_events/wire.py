"""KV events over ZeroMQ: a worker's ``KVPublisher`` to the central KV manager.

A Ray actor call costs the central process ~1 ms of CPU on a loaded node,
far more than applying a batch of events (tens of us), so the event stream
bypasses Ray (vLLM publishes its KV events over ZMQ for the same reason):

- central side, ``EventEndpoint``: a ROUTER socket bound to the node's IP on
  an ephemeral port, read by one receiver thread that, per wake-up (at most
  one per ``gather_s``, on a clock shared with the relays: below), drains
  every message waiting (up to ``max_drain``),
  hands them to one ``handle([(kind, payload), ...]) -> [(ok, reply), ...]``
  call (the service's ``handle_events``: one lock acquisition and one CPU
  clock read per drain) and sends every reply (the acks workers use to detect
  a lost batch or a restarted central manager; None: no reply);
- worker side, ``ZmqTransport`` (a ``KVTransport``): one DEALER socket, so a
  worker's batches arrive in order. ``send`` never blocks, ``poll`` reads
  acks without waiting, ``call`` (the rare preemption decision) stays a Ray
  actor call. A send not acked within ``ack_timeout_s`` fails (the publisher
  then resyncs) and the transport asks the actor for its endpoint again,
  without waiting: a restarted central manager binds a new port.

One frame each way: worker -> central ``request id (8 bytes) + kind (b"p"
publish, b"q" publish wanting no routine ack, b"r" resync, b"a" a LoRA adapter
report) + payload`` (the
ROUTER adds the worker's identity frame), central -> worker ``request id +
status (b"o" ok, b"e" error) + ack or error text``. A b"q" publish is
answered only when refused or when its ack asks for a resync; the worker
counts it acknowledged once a later reply arrives (one connection, handled
and answered in order), so most batches cost the central side a receive
and no send.

Bundles (a node's ``workers.kv_events.relay.EventRelay`` forwarding its workers'
messages as one): relay -> central two frames, ``[head: bundle id (8 bytes)
+ b"B" (wants a reply) or b"b" (a reply only when it holds something),
records]``, the records (``pack_bundle``) each ``route length (1 byte) +
route + message length (4 bytes) + message``: the message exactly the one
frame a worker sent (its request id, kind and payload; the relay does not
open it), the route the relay's short id of that worker's connection (at
most ``MAX_ROUTE_BYTES``). One frame for all of them, not a frame each:
ZeroMQ and pyzmq cost a few us per frame at both ends, more than slicing a
buffer. Central handles the sub-messages in order, in the same ``handle``
call as the rest of the drain, exactly as if each had come on its own
connection, and answers ``[bundle id + b"o", records]`` with only the
sub-replies that exist (each the reply that worker would have had directly,
a malformed sub-message's error included), in order; a malformed bundle as
a whole gets one frame, ``bundle id + b"e" + text``. A relay's upstream is a
``ZmqTransport`` too (method "bundle"); a worker's transport behind a relay
asks the relay actor (``endpoint_source``) for its endpoint, and the central
actor instead once the relay is gone (an ask fails with ``ActorDiedError``,
the relay has been restarting for ``RELAY_RESTART_S``, or
``MAX_FAILED_RELAY_ASKS`` asks in a row fail otherwise): central takes a
worker's own messages as well as bundles.

The receiver's clock: it drains at ``tick_offset_s`` past every multiple of
``gather_s`` of wall time (``next_tick``), and relays forward at every
multiple of their ``flush_s``, the same period (``kv_events.relay_flush_s``):
one wake-up per period takes every node's bundle of that period, however
many nodes there are, and adds only ``tick_offset_s`` to their lag. A
relay that sent a bundle at the last tick and has not at this one (a busy
node) is waited for up to ``late_s`` more (a quarter of the period), its
bundle taken as it comes, rather than one period more. Workers on a tick
(``KVPublisher.flush_on_tick``) send just before it. Node clocks are kept
within a few ms of each other in a cluster (NTP); with clocks further apart
nothing is lost, bundles only wait longer. A message that comes between
ticks (a worker with no relay, a late bundle) wakes the receiver, which
then sleeps until the next tick.

``pyzmq`` is imported lazily; ``connect_transport`` falls back to Ray actor
calls when it is missing or the endpoint cannot be had.
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from typing import Callable

from pagedserve.kvmanager.errors import WireFormatError
from pagedserve.kvmanager.publisher import next_tick

from .link import RayCall, RayTransport, call_result

logger = logging.getLogger(__name__)

_HEAD = struct.Struct("!QB")     # request id, kind or status
_KIND_CODES = {"publish": ord("p"), "resync": ord("r"), "report_adapters": ord("a")}
_QUIET_PUBLISH = ord("q")    # a publish that wants a reply only when something is wrong
_KINDS = {**{code: kind for kind, code in _KIND_CODES.items()}, _QUIET_PUBLISH: "quiet_publish"}
_OK, _ERROR = ord("o"), ord("e")
_BUNDLE, _QUIET_BUNDLE = ord("B"), ord("b")   # a relay's bundle: always answered / only when needed
MAX_ROUTE_BYTES = 16
DEFAULT_TICK_S = 0.06   # the relays' and central's shared tick (the cluster's kv_events.relay_flush_s)
_BODY_LENGTH = struct.Struct("!I")
ASK_AGAIN_S = 0.25   # after a failed ``event_endpoint`` ask (the manager is restarting)
MAX_FAILED_RELAY_ASKS = 3   # asks failing in a row before a worker gives up on its relay (ZmqTransport)
RELAY_RESTART_S = 30.0      # how long its relay may be restarting before that
_fallback_logged = False


class EventEndpoint:
    """The central manager's event socket and its receiver thread."""

    def __init__(self, handle: Callable[[list[tuple[str, memoryview]]], list[tuple[bool, bytes]]],
                 host: str | None = None, poll_ms: int = 100, max_drain: int = 256,
                 gather_s: float = DEFAULT_TICK_S, tick_offset_s: float | None = None) -> None:
        import zmq

        self._zmq = zmq
        self._handle = handle
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        host = host or node_ip()
        port = self._socket.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self.num_messages = 0
        self.num_drains = 0
        self.num_errors = 0
        self.num_replies = 0
        self.num_bundles = 0     # of the messages, relays' bundles
        self.num_bundled = 0     # the worker messages those bundles carried
        self.receiver_cpu_s = 0.0
        self._poll_ms = poll_ms
        self._max_drain = max_drain
        self.gather_s = gather_s
        # Past the relays' tick: their forwarding and the network (a few ms on a busy node); then
        # up to ``late_s`` more for the bundles of relays that sent at the last tick and not yet.
        self.tick_offset_s = min(0.005, gather_s / 4) if tick_offset_s is None else tick_offset_s
        self.late_s = gather_s / 4
        self.num_late_wakeups = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="pagedserve-kv-events", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        zmq = self._zmq
        socket = self._socket
        poller = zmq.Poller()
        poller.register(socket, zmq.POLLIN)
        recv, send, again = socket.recv_multipart, socket.send_multipart, zmq.Again

        def drain_and_answer() -> int:
            received = []
            while len(received) < self._max_drain:
                try:
                    received.append(recv(zmq.NOBLOCK))
                except again:
                    break
            if received:
                for reply in self._answer(received):
                    if reply is not None:
                        send(reply)
            return len(received)

        expected_bundles = 0   # the relays' bundles the last tick brought
        while not self._stop.is_set():
            self.receiver_cpu_s = time.thread_time()   # this thread's CPU since it started
            bundles_before = self.num_bundles
            num_received = drain_and_answer()
            if not num_received:
                # Nothing at this tick: sleep until a message comes, then until the next tick
                # (a wake-up, with its thread switch and cold caches, costs more than a message).
                if poller.poll(self._poll_ms):
                    sleep_to_tick(self.gather_s, self.tick_offset_s, self._stop)
                continue
            if num_received >= self._max_drain:
                continue   # more wait: drain on at once
            # A relay late for this tick (a busy node) is waited for a little, not a whole tick.
            late_until = time.time() + self.late_s
            while self.num_bundles - bundles_before < expected_bundles:
                left = late_until - time.time()
                if left <= 0 or not poller.poll(max(1, int(1e3 * left))):
                    break
                self.num_late_wakeups += 1
                drain_and_answer()
            expected_bundles = self.num_bundles - bundles_before
            sleep_to_tick(self.gather_s, self.tick_offset_s, self._stop)
        socket.close(0)
        self._context.term()

    def _answer(self, received: list[list[bytes]]) -> list[list[bytes] | None]:
        """Per received message, in order, its reply (None: nothing to say: a quiet publish,
        or a quiet bundle, that went well); every well-formed message, bundled or not,
        handled in one ``handle`` call, in order of arrival."""
        self.num_messages += len(received)
        self.num_drains += 1
        # Per received message: [identity, bundle head or None, [route, reply body or None], ...]
        answers: list[list] = []
        messages, slots = [], []   # what ``handle`` gets, and where each reply goes
        for frames in received:
            identity, rest = frames[0], frames[1:]
            if len(rest) == 1:                 # a worker's own message
                answer = [identity, None, [None, None]]
                self._take(rest[0], answer[2], messages, slots)
            elif _is_bundle_head(rest):
                try:
                    records = unpack_bundle(rest[1])
                except WireFormatError as exc:
                    self.num_errors += 1
                    answer = [identity, None, [None, error_body(rest[0], str(exc))]]
                    answers.append(answer)
                    continue
                answer = [identity, rest[0]]
                self.num_bundles += 1
                self.num_bundled += len(records)
                for route, body in records:
                    entry = [route, None]
                    answer.append(entry)
                    self._take(body, entry, messages, slots)
            else:
                self.num_errors += 1
                head = rest[0] if rest else b""
                answer = [identity, None, [None, error_body(head, "malformed KV event message")]]
            answers.append(answer)
        if messages:
            for (entry, body), (ok, reply) in zip(slots, self._handle(messages)):
                if not ok:
                    self.num_errors += 1
                elif reply is None:   # a quiet publish that went well
                    continue
                entry[1] = b"".join((body[:8], b"o" if ok else b"e", reply))
        replies: list[list[bytes] | None] = []
        for identity, head, *entries in answers:
            if head is None:       # a single message: its reply, if any
                body = entries[0][1]
                replies.append(None if body is None else [identity, body])
                continue
            records = [(route, body) for route, body in entries if body is not None]
            wants_reply = head[_HEAD.size - 1] == _BUNDLE
            replies.append([identity, head[:8] + b"o", pack_bundle(records)] if records or wants_reply else None)
        self.num_replies += sum(reply is not None for reply in replies)
        return replies

    def _take(self, body, entry: list, messages: list, slots: list) -> None:
        """Queue one worker message (bytes, or a slice of a bundle) for ``handle`` (its reply
        goes to ``entry[1]``), or answer a malformed one right away."""
        kind = _KINDS.get(body[_HEAD.size - 1]) if len(body) >= _HEAD.size else None
        if kind is None:
            self.num_errors += 1
            entry[1] = error_body(body, "malformed KV event message")
            return
        messages.append((kind, memoryview(body)[_HEAD.size:]))
        slots.append((entry, body))

    @property
    def native_thread_id(self) -> int | None:
        """The receiver thread's OS thread id (``cluster.thread_cpu`` tells its CPU apart)."""
        return self._thread.native_id

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)


def _is_bundle_head(rest: list[bytes]) -> bool:
    """Whether a message's frames (after the identity) are a bundle: a head, then records."""
    return len(rest) == 2 and len(rest[0]) == _HEAD.size and rest[0][_HEAD.size - 1] in (_BUNDLE, _QUIET_BUNDLE)


def pack_bundle(records) -> bytes:
    """``(route, message)`` pairs as one bundle frame (see the module docstring)."""
    parts = []
    for route, body in records:
        parts += (bytes((len(route),)), route, _BODY_LENGTH.pack(len(body)), body)
    return b"".join(parts)


def unpack_bundle(frame) -> list[tuple[bytes, memoryview]]:
    """A bundle frame's ``(route, message)`` pairs, each message a slice of ``frame``;
    raises ``WireFormatError`` when the records do not fill the frame exactly."""
    view = memoryview(frame)
    size = len(view)
    records, position = [], 0
    while position < size:
        route_end = position + 1 + view[position]
        if route_end - position - 1 > MAX_ROUTE_BYTES or route_end + _BODY_LENGTH.size > size:
            raise WireFormatError("malformed KV event bundle: a record overruns it or its route is too long")
        (length,) = _BODY_LENGTH.unpack_from(view, route_end)
        end = route_end + _BODY_LENGTH.size + length
        if end > size:
            raise WireFormatError("malformed KV event bundle: a record overruns it")
        records.append((view[position + 1:route_end].tobytes(), view[route_end + _BODY_LENGTH.size:end]))
        position = end
    return records


def error_body(body, text: str) -> bytes:
    """An error reply to ``body``'s request id (zero-padded when it is too short to hold one):
    what central, or a node's relay, answers a malformed worker message with."""
    return bytes(body[:8]).ljust(8, b"\0") + b"e" + text.encode()


def sleep_to_tick(period_s: float, offset_s: float, stop: threading.Event) -> None:
    """Sleep until the next tick (``next_tick``) unless ``stop`` is set. ``time.sleep``, not
    ``stop.wait``: half the CPU per wake-up; whoever sets ``stop`` waits one tick at most."""
    delay = next_tick(time.time(), period_s, offset_s) - time.time()
    if delay > 0 and not stop.is_set():
        time.sleep(delay)


def node_ip() -> str:
    """The address this process's sockets bind to: the Ray node's IP when Ray is running here
    (other nodes' workers and relays must reach it), else 127.0.0.1 (tests, one process)."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    return "127.0.0.1"


class _Send:
    """A send's token: the request id on one connection, and when it left."""

    __slots__ = ("request_id", "connection", "sent_at", "wants_ack")

    def __init__(self, request_id: int, connection: int, sent_at: float, wants_ack: bool) -> None:
        self.request_id = request_id
        self.connection = connection
        self.sent_at = sent_at
        self.wants_ack = wants_ack


class ZmqTransport:
    """A ``KVTransport``: events over a DEALER socket, the blocking call over Ray.

    Used by one thread at a time (``KVPublisher`` makes every transport call under one
    lock, from the worker's sender thread); zmq sockets are not thread-safe.

    Behind a relay, the endpoint is asked of the relay actor until it is gone: then of the
    central actor, for good (logged, ``kv_relay_fallbacks``). Gone means an ask failed with
    ``ActorDiedError`` (Ray's word for an actor that will not come back), or the asks have
    failed with ``ActorUnavailableError`` (restarting: on Ray 2.60 every ask made during a
    restart can fail so, one per ``ASK_AGAIN_S``, seen on a loaded node) for
    ``RELAY_RESTART_S``, ample for a restart, or ``MAX_FAILED_RELAY_ASKS`` asks in a row
    failed with any other error (a relay that cannot answer: about ``2 * ASK_AGAIN_S``).
    Either way a worker is kept from central for a bounded time, never forever.
    """

    def __init__(self, actor, endpoint: str, ack_timeout_s: float = 2.0, max_queued: int = 64,
                 endpoint_source=None) -> None:
        import zmq

        self._zmq = zmq
        self.actor = actor
        # Asked for the endpoint again after an ack timeout: the central actor, or the node's
        # relay actor when the events go through one (``workers.kv_events.relay``).
        self.endpoint_source = endpoint_source if endpoint_source is not None else actor
        self.ray = RayTransport(actor)
        self.ack_timeout_s = ack_timeout_s
        self.max_queued = max_queued
        self._context = zmq.Context.instance()   # one I/O thread for every transport in the process
        self._socket = None
        self.endpoint = ""
        self.connection = 0
        self._next_id = 0
        self._replies: dict[int, tuple[bytes | None, BaseException | None]] = {}
        self._last_reply_id = -1        # on this connection: every quiet send before it is acknowledged
        self._endpoint_ask: RayCall | None = None   # an outstanding ``event_endpoint`` ask
        self._ask_again_at = 0.0        # a failed ask (manager restarting) is repeated then
        self._failed_asks = 0           # of the relay's endpoint, in a row, other than "restarting"
        self._failing_since = None      # when the relay's asks began to fail
        self.num_relay_fallbacks = 0
        self.num_reconnects = 0
        self.num_timeouts = 0
        self._connect(endpoint)

    def _connect(self, endpoint: str) -> None:
        zmq = self._zmq
        if self._socket is not None:
            self._socket.close(0)
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SNDHWM, self.max_queued)
        socket.connect(endpoint)
        self._socket = socket
        self.endpoint = endpoint
        self.connection += 1
        self._replies.clear()           # replies of an old connection never come
        self._last_reply_id = -1

    # ---- KVTransport -------------------------------------------------------------------
    def send(self, method: str, packed: bytes | list[bytes], want_ack: bool = True) -> _Send:
        """``method`` "publish", "resync", or "bundle" (a relay: ``packed`` is the records
        frame, ``pack_bundle``; its reply is the list of ``(route, reply)`` pairs)."""
        wants_ack = want_ack or method not in ("publish", "bundle")
        token = _Send(self._next_id, self.connection, time.monotonic(), wants_ack)
        self._next_id += 1
        # Sent on the current connection even while its endpoint is being asked for again: most
        # asks find it unchanged, and a send dropped in that window would time out and start
        # another ask (with sends every few ms, e.g. a relay's, an endless cycle of resyncs); if
        # the endpoint did move, the reconnect ends this connection's sends.
        try:
            if method == "bundle":
                head = _HEAD.pack(token.request_id, _BUNDLE if wants_ack else _QUIET_BUNDLE)
                self._socket.send_multipart([head, packed], self._zmq.NOBLOCK)
            else:
                kind = _KIND_CODES[method] if wants_ack else _QUIET_PUBLISH
                self._socket.send(_HEAD.pack(token.request_id, kind) + packed, self._zmq.NOBLOCK)
        except self._zmq.Again:     # the queue to an unreachable manager is full
            pass
        return token

    def poll(self, tokens: list) -> list:
        self._read_replies()
        self._check_endpoint()
        now = time.monotonic()
        if self._ask_again_at and now >= self._ask_again_at:
            self._rediscover()
        if len(self._replies) > len(tokens) + 64:  # late acks of timed-out sends
            wanted = {t.request_id for t in tokens}
            self._replies = {i: r for i, r in self._replies.items() if i in wanted}
        ended = []
        for token in tokens:
            if token.connection != self.connection:
                ended.append((token, None, ConnectionError("reconnected to the central KV manager")))
            elif token.request_id in self._replies:
                ended.append((token, *self._replies.pop(token.request_id)))
            elif self._acknowledged_later(token):
                ended.append((token, None, None))
            elif now - token.sent_at > self.ack_timeout_s:
                self.num_timeouts += 1
                self._rediscover()
                self._replies.pop(token.request_id, None)
                ended.append((token, None, TimeoutError(
                    f"no ack from the central KV manager at {self.endpoint} in {self.ack_timeout_s} s")))
        return ended

    def wait(self, tokens: list, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            self._read_replies()
            self._check_endpoint()      # a reconnect ends the old connection's waits
            missing = [t for t in tokens if t.connection == self.connection and t.request_id not in self._replies
                       and not self._acknowledged_later(t)]
            left = deadline - time.monotonic()
            if not missing or left <= 0:
                return
            self._socket.poll(max(1, int(1e3 * min(left, 0.05))), self._zmq.POLLIN)

    def call(self, method: str, packed: bytes, timeout_s: float) -> bytes:
        return self.ray.call(method, packed, timeout_s)

    def ready(self, tokens: list) -> list:
        """The tokens whose acks have arrived, without taking them (benchmarks time acks)."""
        self._read_replies()
        return [t for t in tokens if t.connection == self.connection
                and (t.request_id in self._replies or self._acknowledged_later(t))]

    def _acknowledged_later(self, token: _Send) -> bool:
        """A quiet publish is acknowledged by any reply to a later send on its connection."""
        return not token.wants_ack and token.connection == self.connection and token.request_id < self._last_reply_id

    # ---- connection ---------------------------------------------------------------------
    def _read_replies(self) -> None:
        zmq = self._zmq
        while True:
            try:
                frames = self._socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) > 2 or len(frames[0]) < _HEAD.size:
                logger.warning("malformed reply from the central KV manager (%d frames)", len(frames))
                continue
            body = frames[0]
            request_id, status = _HEAD.unpack_from(body)
            if len(frames) == 2:   # a bundle's sub-replies
                try:
                    records = unpack_bundle(frames[1])
                except WireFormatError:
                    logger.warning("malformed bundle reply from the central KV manager")
                    continue
                self._last_reply_id = max(self._last_reply_id, request_id)
                self._replies[request_id] = (records, None)
                continue
            self._last_reply_id = max(self._last_reply_id, request_id)
            if status == _OK:
                self._replies[request_id] = (body[_HEAD.size:], None)
            else:
                self._replies[request_id] = (None, RuntimeError(body[_HEAD.size:].decode(errors="replace")))

    def _rediscover(self) -> None:
        if self._endpoint_ask is None:
            self._ask_again_at = 0.0
            self._endpoint_ask = RayCall(self.endpoint_source.event_endpoint.remote())

    def _check_endpoint(self) -> None:
        if self._endpoint_ask is None or not self._endpoint_ask.future.done():
            return
        ask, self._endpoint_ask = self._endpoint_ask, None
        try:
            endpoint = ask.future.result()
        except Exception as exc:  # restarting: asked again shortly, not only at the next ack timeout
            if self._relay_gone(exc):
                self._fall_back_to_central(exc)
                return
            logger.info("the central KV manager's event endpoint is not known yet (%r)", exc)
            self._ask_again_at = time.monotonic() + ASK_AGAIN_S
            return
        self._failed_asks, self._failing_since = 0, None
        if endpoint and endpoint != self.endpoint:
            logger.warning("the central KV manager's event endpoint moved %s -> %s; reconnecting",
                           self.endpoint, endpoint)
            self._connect(endpoint)
            self.num_reconnects += 1

    def _relay_gone(self, exc: BaseException) -> bool:
        """Whether this failed ask shows the relay gone for good (see the class docstring)."""
        if self.endpoint_source is self.actor or self.actor is None:
            return False
        from ray.exceptions import ActorDiedError, ActorUnavailableError

        now = time.monotonic()
        if self._failing_since is None:
            self._failing_since = now
        if isinstance(exc, ActorDiedError):
            return True
        if isinstance(exc, ActorUnavailableError):
            return now - self._failing_since >= RELAY_RESTART_S
        self._failed_asks += 1
        return self._failed_asks >= MAX_FAILED_RELAY_ASKS

    def _fall_back_to_central(self, exc: BaseException) -> None:
        logger.warning("KV events straight to the central KV manager: the node's relay is gone (its "
                       "endpoint asks failing for %.1f s, the last %r)", time.monotonic() - self._failing_since, exc)
        self.endpoint_source = self.actor
        self._failed_asks, self._failing_since = 0, None
        self.num_relay_fallbacks += 1
        self._rediscover()      # now: the sends to the relay's endpoint go nowhere

    @property
    def socket(self):
        """The current DEALER socket (a relay polls it; replaced on a reconnect)."""
        return self._socket

    @property
    def has_read_replies(self) -> bool:
        """Whether replies were read from the socket and not yet taken by ``poll``."""
        return bool(self._replies)

    def stats(self) -> dict:
        return {"kv_transport": "zmq", "kv_endpoint": self.endpoint, "kv_reconnects": self.num_reconnects,
                "kv_ack_timeouts": self.num_timeouts, "kv_relay_fallbacks": self.num_relay_fallbacks}

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close(0)
            self._socket = None


def connect_transport(actor, kind: str = "zmq", timeout_s: float = 10.0, ack_timeout_s: float = 2.0,
                      relay=None):
    """The worker's transport to the central KV manager: ``ZmqTransport`` for ``kind="zmq"``
    when pyzmq is installed and the actor has an endpoint, else ``RayTransport`` (logged once).
    With ``relay`` (its node's relay actor, ``workers.kv_events.relay``) the events go to the relay's
    endpoint and the transport asks the relay for it again after an ack timeout (the central
    actor once the relay is gone: ``ZmqTransport``); without a relay endpoint they go to the
    central actor's."""
    if kind == "ray":
        return RayTransport(actor)
    if kind != "zmq":
        raise ValueError(f"unknown KV event transport {kind!r}; known: zmq, ray")
    try:
        if relay is not None:
            try:
                endpoint = call_result(relay.event_endpoint.remote(), timeout_s)
                if endpoint:
                    return ZmqTransport(actor, endpoint, ack_timeout_s=ack_timeout_s, endpoint_source=relay)
            except Exception as exc:  # the relay could not start: straight to the central actor
                logger.warning("KV events straight to the central KV manager: no node relay (%r)", exc)
        endpoint = call_result(actor.event_endpoint.remote(), timeout_s)
        if not endpoint:
            raise RuntimeError("the central KV manager has no event endpoint")
        return ZmqTransport(actor, endpoint, ack_timeout_s=ack_timeout_s)
    except Exception as exc:  # no pyzmq, an actor without the endpoint, a failed bind
        global _fallback_logged
        if not _fallback_logged:
            _fallback_logged = True
            logger.warning("KV events over Ray actor calls: the ZeroMQ transport is unavailable (%r)", exc)
        return RayTransport(actor)
