"""An output channel's messages over a ZeroMQ socket, from the engine core to its handle.

A Ray streamed item costs the worker's process and the handle's about 1.7-1.9 ms of CPU
together on a 2-core VM, whatever it holds; the same bytes over a socket cost a fifth of that
(``benchmarks/bench_channel_transport.py``). A channel sends one message per engine step, so
per streamed token that is the message's cost over the streams in a step. With the socket
transport (``output_transport: zmq``) the engine core sends each step's rows to the handle
itself: no other process relays them. The channel's Ray call (``Worker.channel_outputs``)
yields the socket's address and then nothing until the channel ends: it stays the channel's
lifeline (a dead worker or engine core ends it with its error), while every message goes
over the socket, in order:

- the engine core binds a ROUTER socket on its node's address (``ChannelSocketSender``) and
  sends only to the peer that said hello with the channel's id;
- the handle's DEALER (``ChannelSocketReceiver``) says hello, then returns a credit for
  every message it has read; the sender sends at most ``messages_ahead`` messages past the
  credits, as Ray's streaming backpressure did, and what its requests make meanwhile goes
  out in the next message;
- a message is frames: the kinds of its entries (one byte each), then an entry per frame:
  ``B`` a packed ``StreamBatch``, ``M`` a migration (msgpack ``[request_id, target]``: the
  handle asks the worker actor for the KV's ObjectRef, ``Worker.export_ref``, since an
  ObjectRef is Ray's to carry), ``E`` the engine's death (msgpack ``[message, engine_id]``,
  last), ``X`` the channel's end (last);
- the sender watches its socket's connections (a ZeroMQ monitor): when the connection its
  reader said hello on closes (the handle's process died, or its loop closed the channel),
  the channel ends at once and the engine aborts its requests, rather than at the channel's
  lease; another peer's connection coming or going changes nothing.
"""

from __future__ import annotations

import msgpack
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from ..actor.protocol import EngineDeadError, Migrated
from ..kv_events.wire import node_ip

BATCH, MIGRATED, DEAD, END = b"B", b"M", b"E", b"X"
HELLO, CREDIT = b"H", b"C"
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
    """The sending end of one channel's socket, bound at ``address`` until ``close``.

    Owned by one thread (the engine core's loop) and never blocks: ``put`` queues an entry,
    ``service`` reads the hello, the credits and the connections' closing that came and sends
    what is queued as one message when the reader may take it. The owner polls ``sockets``
    with its own while it has nothing else to do."""

    def __init__(self, context: zmq.Context, channel_id: str, messages_ahead: int, host: str | None = None) -> None:
        self.channel_id = channel_id
        self._hello = channel_id.encode()
        self.messages_ahead = messages_ahead
        self._socket = context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, CLOSE_LINGER_MS)
        host = host or node_ip()
        self.address = f"tcp://{host}:{self._socket.bind_to_random_port(f'tcp://{host}')}"
        self._monitor = self._socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._peer: bytes | None = None
        self._peer_fd: int | None = None   # the descriptor of the reader's connection
        self._pending: list = []
        self.is_reader_gone = False
        self.num_sent = 0
        self.num_read = 0   # the reader's credits

    @property
    def sockets(self) -> tuple[zmq.Socket, zmq.Socket]:
        """What to poll for input while waiting: the channel's socket and its monitor."""
        return self._socket, self._monitor

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    def put(self, entry: bytes | Migrated | EngineDeadError) -> None:
        """An entry of the next message (see ``encode``), in order."""
        self._pending.append(entry)

    def service(self) -> bool:
        """Take what came; send what is queued if the reader has said hello and is at most
        ``messages_ahead`` messages behind. False once the reader's connection has closed."""
        self._take_incoming()
        self._take_disconnections()
        if self.is_reader_gone:
            return False
        if self._pending and self._peer is not None and self.num_sent - self.num_read < self.messages_ahead:
            message, self._pending = self._pending, []
            self._socket.send_multipart([self._peer, *encode(message)])
            self.num_sent += 1
        return True

    def _take_incoming(self) -> None:
        socket = self._socket
        while socket.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            frames = socket.recv_multipart(zmq.NOBLOCK, copy=False)
            if len(frames) < 2:
                continue
            peer, kind = frames[0].bytes, frames[1].bytes
            if kind == CREDIT and peer == self._peer:
                self.num_read += 1
            elif kind == HELLO and self._peer is None and [f.bytes for f in frames[2:]] == [self._hello]:
                self._peer = peer
                try:
                    self._peer_fd = frames[1].get(zmq.SRCFD)
                except zmq.ZMQError:   # a libzmq without it: the channel's lease still ends it
                    self._peer_fd = None

    def _take_disconnections(self) -> None:
        """Whether the connection the reader said hello on has closed (``is_reader_gone``);
        other connections coming and going are ignored."""
        monitor = self._monitor
        while monitor.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            gone_fd = parse_monitor_message(monitor.recv_multipart(zmq.NOBLOCK))["value"]
            if self._peer_fd is None:   # the hello may be unread yet
                self._take_incoming()
            if self._peer_fd is not None and gone_fd == self._peer_fd:
                self.is_reader_gone = True

    def send_end(self, last: list = ()) -> None:
        """The channel's last message: what is queued, ``last`` (an ``EngineDeadError``, or
        nothing) and its end, past any credit (nothing more follows). Dropped when no reader
        ever said hello, or once the reader is gone."""
        self._take_incoming()
        if self._peer is not None and not self.is_reader_gone:
            frames = encode([*self._pending, *last])
            frames[0] += END
            self._socket.send_multipart([self._peer, *frames, b""])
        self._pending = []

    def close(self) -> None:
        self._socket.disable_monitor()
        self._monitor.close(linger=0)
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
