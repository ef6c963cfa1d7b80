"""An output channel's messages over a ZeroMQ socket, from the worker actor to its handle.

A Ray streamed item costs the worker's process and the handle's about 1.7-1.9 ms of CPU
together on a 2-core VM, whatever it holds; the same bytes over a socket cost a fifth of that
(``benchmarks/bench_channel_transport.py``). A channel sends one message per engine step, so
per streamed token that is the message's cost over the streams in a step. With the socket
transport (``output_transport: zmq``) the channel's Ray call (``Worker.channel_outputs``)
yields the socket's address and then nothing until the channel ends: it stays the channel's
lifeline (a dead worker ends it with ``RayActorError``), while every message goes over
the socket, in order:

- the worker binds a ROUTER socket on its node's address (``ChannelSocketSender``) and
  sends only to the peer that said hello with the channel's id;
- the handle's DEALER (``ChannelSocketReceiver``) says hello, then returns a credit for
  every message it has read; the worker sends at most ``messages_ahead`` messages past the
  credits, as Ray's streaming backpressure did, and what its requests make meanwhile goes
  out in the next message;
- a message is frames: the kinds of its entries (one byte each), then an entry per frame:
  ``B`` a packed ``StreamBatch``, ``M`` a migration (msgpack ``[request_id, target]``: the
  handle asks the worker for the KV's ObjectRef, ``Worker.export_ref``, since an ObjectRef
  is Ray's to carry), ``E`` the engine's death (msgpack ``[message, engine_id]``, last), ``X``
  the channel's end (last);
- the worker watches its socket's connections (a ZeroMQ monitor): when the connection its
  reader said hello on closes (the handle's process died, or its loop closed the channel),
  the channel ends at once and the engine aborts its requests, rather than at the channel's
  lease; another peer's connection coming or going changes nothing.
"""

from __future__ import annotations

from typing import Callable

import msgpack
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from ..kv_events.wire import node_ip
from .protocol import EngineDeadError, Migrated

BATCH, MIGRATED, DEAD, END = b"B", b"M", b"E", b"X"
HELLO, CREDIT = b"H", b"C"
# How often a sender that waits for its reader looks whether its channel has closed meanwhile.
WAIT_POLL_MS = 500
# How long a closing sender's socket may take to deliver its last message.
CLOSE_LINGER_MS = 2000


def encode(message: list) -> list[bytes]:
    """A channel message's frames: packed batches (bytes), ``Migrated`` items and an
    ``EngineDeadError`` (last), in order."""
    kinds = bytearray()
    frames: list[bytes] = [b""]
    for entry in message:
        if isinstance(entry, bytes):
            kinds += BATCH
            frames.append(entry)
        elif isinstance(entry, Migrated):
            kinds += MIGRATED
            frames.append(msgpack.packb([entry.request_id, entry.target]))
        elif isinstance(entry, EngineDeadError):
            kinds += DEAD
            frames.append(msgpack.packb([str(entry), entry.engine_id]))
        else:
            raise TypeError(f"an output channel carries no {type(entry).__name__}")
    frames[0] = bytes(kinds)
    return frames


def decode(frames: list[bytes]) -> list[tuple[bytes, object]]:
    """A message's entries as ``(kind, value)``: a batch's packed bytes, ``(request_id,
    target)`` of a migration, an ``EngineDeadError``, or None at the channel's end."""
    entries = []
    for kind, frame in zip(frames[0], frames[1:]):
        kind = bytes((kind,))
        if kind == BATCH:
            entries.append((BATCH, frame))
        elif kind == MIGRATED:
            entries.append((MIGRATED, tuple(msgpack.unpackb(frame))))
        elif kind == DEAD:
            message, engine_id = msgpack.unpackb(frame)
            entries.append((DEAD, EngineDeadError(message, engine_id)))
        elif kind == END:
            entries.append((END, None))
        else:
            raise ValueError(f"unknown output channel entry kind {kind!r}")
    return entries


class ChannelSocketSender:
    """The worker's end of one channel's socket: bound at ``address`` until ``close``."""

    def __init__(self, channel_id: str, messages_ahead: int, host: str | None = None) -> None:
        self.channel_id = channel_id.encode()
        self.messages_ahead = messages_ahead
        self._socket = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, CLOSE_LINGER_MS)
        host = host or node_ip()
        self.address = f"tcp://{host}:{self._socket.bind_to_random_port(f'tcp://{host}')}"
        # Non-blocking reads and sends, never while an asyncio wait on the socket is pending: each
        # asyncio wait starts by reading the socket's events, so none is missed (its descriptor
        # signals edges).
        self._sync = zmq.Socket.shadow(self._socket.underlying)
        self._monitor_socket = self._socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._monitor = zmq.Socket.shadow(self._monitor_socket.underlying)   # between waits, as above
        self._peer: bytes | None = None
        self._peer_fd: int | None = None   # the descriptor of the reader's connection
        self.is_reader_gone = False
        self.num_sent = 0
        self.num_read = 0   # the reader's credits

    def _take_incoming(self) -> None:
        """The hello and credits that came, without waiting."""
        sync = self._sync
        while sync.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            frames = sync.recv_multipart(zmq.NOBLOCK, copy=False)
            if len(frames) < 2:
                continue
            peer, kind = frames[0].bytes, frames[1].bytes
            if kind == CREDIT and peer == self._peer:
                self.num_read += 1
            elif kind == HELLO and self._peer is None and [f.bytes for f in frames[2:]] == [self.channel_id]:
                self._peer = peer
                try:
                    self._peer_fd = frames[1].get(zmq.SRCFD)
                except zmq.ZMQError:   # a libzmq without it: the channel's lease still ends it
                    self._peer_fd = None

    async def wait_reader_gone(self) -> None:
        """Return once the connection the reader said hello on has closed (``is_reader_gone``);
        other connections coming and going are ignored."""
        monitor, events = self._monitor_socket, self._monitor
        while True:
            await monitor.poll()
            while events.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                gone_fd = parse_monitor_message(events.recv_multipart(zmq.NOBLOCK))["value"]
                if self._peer_fd is None:   # the hello may be unread yet (nothing was sent)
                    self._take_incoming()
                if gone_fd == self._peer_fd:
                    self.is_reader_gone = True
                    return

    async def send(self, message: list, is_closed: Callable[[], bool]) -> bool:
        """Send ``message`` (see ``encode``) once its reader has said hello and is at most
        ``messages_ahead`` messages behind; False if ``is_closed()`` turned true meanwhile."""
        self._take_incoming()
        while self._peer is None or self.num_sent - self.num_read >= self.messages_ahead:
            if is_closed():
                return False
            await self._socket.poll(WAIT_POLL_MS, zmq.POLLIN)
            self._take_incoming()
        self._sync.send_multipart([self._peer, *encode(message)])
        self.num_sent += 1
        return True

    def send_end(self, last: list) -> None:
        """The channel's last message: ``last`` (an ``EngineDeadError``, or nothing) and its end,
        past any credit (nothing more follows). Dropped when no reader ever said hello."""
        self._take_incoming()
        if self._peer is not None:
            frames = encode(last)
            frames[0] += END
            self._sync.send_multipart([self._peer, *frames, b""])

    def close(self) -> None:
        self._socket.disable_monitor()
        self._monitor_socket.close(linger=0)
        self._socket.close()   # lingers up to CLOSE_LINGER_MS for the last message


class ChannelSocketReceiver:
    """The handle's end of one channel's socket, on the running event loop."""

    def __init__(self, address: str, channel_id: str) -> None:
        self._socket = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(address)
        self._sync = zmq.Socket.shadow(self._socket.underlying)   # between receives only (as above)
        self._sync.send_multipart([HELLO, channel_id.encode()])

    async def receive(self) -> list[bytes]:
        """The next message's frames (``decode`` reads them)."""
        return await self._socket.recv_multipart()

    def read_one(self) -> None:
        """A message was read: the worker may send one more."""
        try:
            self._sync.send(CREDIT, zmq.NOBLOCK)
        except zmq.Again:  # the worker is not reading its socket (it is gone): nothing to pace
            pass

    def close(self) -> None:
        self._socket.close()


__all__ = ["ChannelSocketReceiver", "ChannelSocketSender", "decode", "encode"]
