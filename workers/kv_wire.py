"""KV events over ZeroMQ: a worker's ``KVPublisher`` to the central KV manager.

A Ray actor call costs the central process ~1 ms of CPU on a loaded node,
far more than applying a batch of events (tens of us), so the event stream
bypasses Ray (vLLM publishes its KV events over ZMQ for the same reason):

- central side, ``EventEndpoint``: a ROUTER socket bound to the node's IP on
  an ephemeral port, read by one receiver thread that, per wake-up (at most
  one per ``gather_s``), drains every message waiting (up to ``max_drain``),
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
publish, b"q" publish wanting no routine ack, b"r" resync) + payload`` (the
ROUTER adds the worker's identity frame), central -> worker ``request id +
status (b"o" ok, b"e" error) + ack or error text``. A b"q" publish is
answered only when refused or when its ack asks for a resync; the worker
counts it acknowledged once a later reply arrives (one connection, handled
and answered in order), so most batches cost the central side a receive
and no send. ``pyzmq`` is imported lazily; ``connect_transport``
falls back to Ray actor calls when it is missing or the endpoint cannot be
had.
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from typing import Callable

from .kv_link import RayTransport

logger = logging.getLogger(__name__)

_HEAD = struct.Struct("!QB")     # request id, kind or status
_KIND_CODES = {"publish": ord("p"), "resync": ord("r")}
_QUIET_PUBLISH = ord("q")    # a publish that wants a reply only when something is wrong
_KINDS = {**{code: kind for kind, code in _KIND_CODES.items()}, _QUIET_PUBLISH: "quiet_publish"}
_OK, _ERROR = ord("o"), ord("e")
ASK_AGAIN_S = 0.25   # after a failed ``event_endpoint`` ask (the manager is restarting)
_fallback_logged = False


class EventEndpoint:
    """The central manager's event socket and its receiver thread."""

    def __init__(self, handle: Callable[[list[tuple[str, memoryview]]], list[tuple[bool, bytes]]],
                 host: str | None = None, poll_ms: int = 100, max_drain: int = 256,
                 gather_s: float = 0.02) -> None:
        import zmq

        self._zmq = zmq
        self._handle = handle
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        host = host or _node_ip()
        port = self._socket.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self.num_messages = 0
        self.num_drains = 0
        self.num_errors = 0
        self.num_replies = 0
        self.receiver_cpu_s = 0.0
        self._poll_ms = poll_ms
        self._max_drain = max_drain
        self._gather_s = gather_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="pagedserve-kv-events", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        zmq = self._zmq
        socket = self._socket
        poller = zmq.Poller()
        poller.register(socket, zmq.POLLIN)
        recv, send, again = socket.recv_multipart, socket.send_multipart, zmq.Again
        while not self._stop.is_set():
            self.receiver_cpu_s = time.thread_time()   # this thread's CPU since it started
            if not poller.poll(self._poll_ms):
                continue
            received = []
            while len(received) < self._max_drain:
                try:
                    received.append(recv(zmq.NOBLOCK))
                except again:
                    break
            for reply in self._answer(received):
                if reply is not None:
                    send(reply)
            # Let the next messages gather (unless this drain was cut short): a wake-up (poll,
            # thread switch, cold caches) costs more than a message, and gather_s more of lag is
            # small against the workers' 50 ms flushes (measured in the README's kv-scale runs).
            if len(received) < self._max_drain:
                self._stop.wait(self._gather_s)
        socket.close(0)
        self._context.term()

    def _answer(self, received: list[list[bytes]]) -> list[list[bytes] | None]:
        """Per received message, in order, its reply (None: a quiet publish that went well);
        the well-formed ones handled together."""
        self.num_messages += len(received)
        self.num_drains += 1
        replies: list[list[bytes] | None] = []
        messages, answered_at = [], []
        for frames in received:
            body = frames[-1]
            kind = _KINDS.get(body[_HEAD.size - 1]) if len(frames) == 2 and len(body) >= _HEAD.size else None
            if kind is None:
                self.num_errors += 1
                replies.append([frames[0], body[:8].ljust(8, b"\0") + b"e" + b"malformed KV event message"])
                continue
            answered_at.append(len(replies))
            replies.append(None)
            messages.append((kind, memoryview(body)[_HEAD.size:]))
        if messages:
            for index, (ok, reply) in zip(answered_at, self._handle(messages)):
                identity, body = received[index]
                if not ok:
                    self.num_errors += 1
                elif reply is None:   # a quiet publish that went well
                    continue
                replies[index] = [identity, body[:8] + (b"o" if ok else b"e") + reply]
        self.num_replies += sum(reply is not None for reply in replies)
        return replies

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)


def _node_ip() -> str:
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
    """

    def __init__(self, actor, endpoint: str, ack_timeout_s: float = 2.0, max_queued: int = 64) -> None:
        import zmq

        self._zmq = zmq
        self.actor = actor
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
        self._endpoint_ref = None       # an outstanding ``event_endpoint`` ask
        self._ask_again_at = 0.0        # a failed ask (manager restarting) is repeated then
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
    def send(self, method: str, packed: bytes, want_ack: bool = True) -> _Send:
        wants_ack = want_ack or method != "publish"
        token = _Send(self._next_id, self.connection, time.monotonic(), wants_ack)
        self._next_id += 1
        if self._endpoint_ref is None:  # while rediscovering, the send just times out
            kind = _KIND_CODES[method] if wants_ack else _QUIET_PUBLISH
            try:
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
            if len(frames) != 1 or len(frames[0]) < _HEAD.size:
                logger.warning("malformed reply from the central KV manager (%d frames)", len(frames))
                continue
            body = frames[0]
            request_id, status = _HEAD.unpack_from(body)
            self._last_reply_id = max(self._last_reply_id, request_id)
            if status == _OK:
                self._replies[request_id] = (body[_HEAD.size:], None)
            else:
                self._replies[request_id] = (None, RuntimeError(body[_HEAD.size:].decode(errors="replace")))

    def _rediscover(self) -> None:
        if self._endpoint_ref is None:
            self._ask_again_at = 0.0
            self._endpoint_ref = self.actor.event_endpoint.remote()

    def _check_endpoint(self) -> None:
        if self._endpoint_ref is None:
            return
        import ray

        ready, _ = ray.wait([self._endpoint_ref], timeout=0)
        if not ready:
            return
        ref, self._endpoint_ref = self._endpoint_ref, None
        try:
            endpoint = ray.get(ref, timeout=0)
        except Exception as exc:  # restarting: asked again shortly, not only at the next ack timeout
            logger.info("the central KV manager's event endpoint is not known yet (%r)", exc)
            self._ask_again_at = time.monotonic() + ASK_AGAIN_S
            return
        if endpoint and endpoint != self.endpoint:
            logger.warning("the central KV manager's event endpoint moved %s -> %s; reconnecting",
                           self.endpoint, endpoint)
            self._connect(endpoint)
            self.num_reconnects += 1

    def stats(self) -> dict:
        return {"kv_transport": "zmq", "kv_endpoint": self.endpoint, "kv_reconnects": self.num_reconnects,
                "kv_ack_timeouts": self.num_timeouts}

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close(0)
            self._socket = None


def connect_transport(actor, kind: str = "zmq", timeout_s: float = 10.0, ack_timeout_s: float = 2.0):
    """The worker's transport to the central KV manager: ``ZmqTransport`` for ``kind="zmq"``
    when pyzmq is installed and the actor has an endpoint, else ``RayTransport`` (logged once)."""
    if kind == "ray":
        return RayTransport(actor)
    if kind != "zmq":
        raise ValueError(f"unknown KV event transport {kind!r}; known: zmq, ray")
    try:
        import ray

        endpoint = ray.get(actor.event_endpoint.remote(), timeout=timeout_s)
        if not endpoint:
            raise RuntimeError("the central KV manager has no event endpoint")
        return ZmqTransport(actor, endpoint, ack_timeout_s=ack_timeout_s)
    except Exception as exc:  # no pyzmq, an actor without the endpoint, a failed bind
        global _fallback_logged
        if not _fallback_logged:
            _fallback_logged = True
            logger.warning("KV events over Ray actor calls: the ZeroMQ transport is unavailable (%r)", exc)
        return RayTransport(actor)
