"""A node's KV event relay: its workers' messages reach the central KV manager as one.

The central manager's CPU goes mostly to per-message costs (a wake-up, a
socket read, a reply: tens of us each, whatever the payload), so one
``EventRelay`` per node gathers its workers' event messages and forwards
them as one bundle per flush:

- workers' side: a ROUTER socket bound to the node's IP on an ephemeral port.
  A worker's ``ZmqTransport`` connects to it exactly as it would to the
  central ``EventEndpoint`` (same frames: ``workers.kv_events.wire``); the ROUTER's
  identity of its connection (5 bytes) is the route id of its messages;
- central side: one ``ZmqTransport`` (the workers' own transport class, so
  its ack timeout, and asking the central actor for its endpoint again after
  one, are the workers'). Each bundle is two frames: a head and the records
  of its messages, ``(route, message)``, in one frame (``kv_wire``'s bundle
  wire format), the messages untouched and in arrival order;
- the receiver thread sleeps until a worker message arrives, then lets the
  node's other workers' messages gather until the next multiple of
  ``flush_s`` of wall time (the tick that central's receiver drains just
  after: ``kv_wire.next_tick``), and sends everything waiting as one bundle
  (several when more than ``max_bundle_messages`` messages or
  ``max_bundle_bytes`` bytes wait: a large bundle, a snapshot say, goes at
  once instead of growing); the central manager's bundled reply holds only
  the sub-replies that exist, and each goes back to its worker's
  connection, in order;
- a malformed worker message (not the one frame a worker sends) is never
  forwarded: the relay answers it with the error central would give
  (``kv_wire.error_body``), after the replies to the bundles sent before it,
  and counts it (``num_malformed``).

Order: a worker's messages arrive on one connection, stay in order in the
bundle, central handles a bundle's messages in order, and the sub-replies
come back in order, so "a quiet publish is acknowledged by any later reply
on its connection" holds through the relay. Nothing is retried here: a
bundle lost (central down, its queue full, the relay restarted) loses its
messages, which central's per-worker sequence numbers (a gap: resync) and
the workers' ack timeouts (resync, then ask the relay actor for its
endpoint again; the central actor's once the relay actor is gone for good)
find. Bundles ask central for a reply of their own every
``ack_interval_s`` (the others only when they carry a sub-reply), so a
silent central manager is noticed within the upstream ack timeout.

Pure sockets and one thread; ``cluster.kv_relay`` runs it as a Ray actor.
"""

from __future__ import annotations

import logging
import threading
import time

from .wire import DEFAULT_TICK_S, ZmqTransport, error_body, node_ip, pack_bundle, sleep_to_tick

logger = logging.getLogger(__name__)

ERROR_PAUSE_S = 0.1   # after an unexpected error in the relay thread, before going on


class EventRelay:
    """The relay's two sockets and its thread (see the module docstring)."""

    def __init__(self, upstream: ZmqTransport, host: str | None = None, flush_s: float = DEFAULT_TICK_S,
                 max_bundle_messages: int = 256, max_bundle_bytes: int = 4 << 20,
                 ack_interval_s: float = 0.2, poll_ms: int = 100) -> None:
        import zmq

        self._zmq = zmq
        self.upstream = upstream
        self.flush_s = flush_s
        self.max_bundle_messages = max_bundle_messages
        self.max_bundle_bytes = max_bundle_bytes
        self.ack_interval_s = ack_interval_s
        self._poll_ms = poll_ms
        self._context = zmq.Context.instance()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        host = host or node_ip()
        port = self._socket.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self._in_flight: list = []          # upstream tokens of bundles sent
        self._held: dict[int, list] = {}    # id(token): error replies to send once that bundle ends
        self._last_ack_asked = float("-inf")
        self.num_messages = 0       # worker messages received
        self.num_bundles = 0        # bundles sent upstream
        self.num_replies = 0        # sub-replies routed back to workers
        self.num_failed_bundles = 0  # bundles not acknowledged (their workers resync)
        self.num_errors = 0          # unexpected errors in the relay thread (logged; it goes on)
        self.num_malformed = 0      # worker messages answered here with an error, never forwarded
        self.thread_cpu_s = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="pagedserve-kv-relay", daemon=True)
        self._thread.start()

    # ---- the thread ----------------------------------------------------------------------
    def _serve(self) -> None:
        zmq = self._zmq
        poller, polled = zmq.Poller(), None
        poller.register(self._socket, zmq.POLLIN)
        busy = False     # the last tick forwarded something: expect more by the next
        while not self._stop.is_set():
            self.thread_cpu_s = time.thread_time()
            upstream_socket = self.upstream.socket
            if upstream_socket is not polled:      # (re)connected upstream
                if polled is not None:
                    poller.unregister(polled)
                poller.register(upstream_socket, zmq.POLLIN)
                polled = upstream_socket
            # While the workers keep sending, one wake-up per tick (a wake-up, with its thread
            # switch and cold caches, costs more than a message); when they stop, sleep until
            # one sends (or central replies), then until the tick.
            ready = {self._socket: True} if busy else dict(poller.poll(self._poll_ms))
            busy = False
            try:
                self._route_replies()              # also times out bundles and rediscovers central
                self._confirm_quiet_tail()
                if ready.get(self._socket):
                    # Let the node's other workers' messages join this bundle, until the tick
                    # (central drains just after it: ``kv_wire.next_tick``).
                    sleep_to_tick(self.flush_s, 0.0, self._stop)
                    busy = self._forward()
                    self._route_replies()
            except Exception:  # never let the thread die (its workers would time out forever)
                self.num_errors += 1
                logger.exception("KV relay: relaying failed; going on")
                time.sleep(ERROR_PAUSE_S)
        self._socket.close(0)
        self.upstream.close()

    def _forward(self) -> bool:
        """Everything waiting from the workers, as bundles (capped in messages and bytes);
        whether there was anything."""
        recv, again = self._socket.recv_multipart, self._zmq.Again
        records: list[list[bytes]] = []
        size = 0
        forwarded = False
        while True:
            try:
                message = recv(self._zmq.NOBLOCK)
            except again:
                break
            forwarded = True
            if len(message) != 2:   # a worker sends one frame: the ROUTER adds its identity
                self._answer_malformed(message, records)
                records, size = [], 0
                continue
            records.append(message)  # route (the connection's identity), message
            size += len(message[1])
            if len(records) >= self.max_bundle_messages or size >= self.max_bundle_bytes:
                self._send(records)
                records, size = [], 0
        if records:
            self._send(records)
        return forwarded

    def _answer_malformed(self, message: list[bytes], records: list[list[bytes]]) -> None:
        """Answer a malformed worker message as central would (``error_body``), on its route.
        The reply waits for the bundles before it (``records``, gathered so far, go now): sent
        earlier, it would make that worker count its earlier quiet publishes acknowledged (any
        later reply does) before central has handled them. The bundle it waits for asks for a
        reply (an empty one if need be), so the wait is a round trip, not an ack timeout."""
        self.num_malformed += 1
        logger.warning("KV relay: answered a malformed worker message (%d frames) with an error", len(message))
        reply = (message[0], error_body(message[1] if len(message) > 1 else b"", "malformed KV event message"))
        if records or (self._in_flight and not self._in_flight[-1].wants_ack):
            self._send(records, want_ack=True)
        if self._in_flight:
            self._held.setdefault(id(self._in_flight[-1]), []).append(reply)
        else:
            self._to_workers([reply])

    def _send(self, records: list[list[bytes]], want_ack: bool = False) -> None:
        now = time.monotonic()
        want_ack = want_ack or now - self._last_ack_asked >= self.ack_interval_s
        if want_ack:
            self._last_ack_asked = now
        self._in_flight.append(self.upstream.send("bundle", pack_bundle(records), want_ack))
        self.num_bundles += 1
        self.num_messages += len(records)

    def _confirm_quiet_tail(self) -> None:
        """When the workers stop sending, the last bundles may be quiet ones that no later reply
        acknowledges: ask central with an empty bundle, so they do not time out as if lost."""
        last = self._in_flight[-1] if self._in_flight else None
        if last is not None and not last.wants_ack and time.monotonic() - last.sent_at >= self.ack_interval_s:
            self._send([], want_ack=True)

    def _route_replies(self) -> None:
        if not self._in_flight:
            self.upstream.poll([])         # a pending endpoint ask still completes
            return
        ended = self.upstream.poll(self._in_flight)
        if not ended:
            return
        done = set()
        for token, reply, error in ended:
            done.add(id(token))
            if error is not None:
                self.num_failed_bundles += 1
                logger.warning("KV relay: a bundle to the central KV manager failed (%r); its workers "
                               "will resync", error)
            elif isinstance(reply, list):    # (route, reply) pairs
                self.num_replies += self._to_workers(reply)
            self._to_workers(self._held.pop(id(token), ()))
        # Replies come in the order the bundles were sent.
        self._in_flight = [t for t in self._in_flight if id(t) not in done]

    def _to_workers(self, replies) -> int:
        """Send each (route, body) to its worker's connection; how many went."""
        sent = 0
        for route, body in replies:
            try:
                self._socket.send_multipart([route, body], self._zmq.NOBLOCK)
            except self._zmq.Again:  # that worker's queue is full: it times out and resyncs
                continue
            sent += 1
        return sent

    # ---- outside -------------------------------------------------------------------------
    def stats(self) -> dict:
        return {"relay_endpoint": self.address, "upstream_endpoint": self.upstream.endpoint,
                "num_messages": self.num_messages, "num_bundles": self.num_bundles,
                "num_replies": self.num_replies, "num_failed_bundles": self.num_failed_bundles,
                "num_errors": self.num_errors, "num_malformed": self.num_malformed,
                "num_in_flight": len(self._in_flight), "thread_cpu_s": self.thread_cpu_s,
                "upstream_reconnects": self.upstream.num_reconnects,
                "upstream_ack_timeouts": self.upstream.num_timeouts}

    @property
    def native_thread_id(self) -> int | None:
        """The relay thread's OS thread id (``cluster.thread_cpu`` tells its CPU apart)."""
        return self._thread.native_id

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)
