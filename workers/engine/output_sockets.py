"""The output channels whose handles read them over a socket, sent to by the engine core itself.

A channel with the socket transport (``output_transport: zmq``) is opened here when its Ray
call starts (``Worker.channel_outputs`` asks the core's ``open_output_socket``): from then on
each step's packed ``StreamBatch`` for that channel, and each migration of one of its
requests, go from the core's loop straight to the handle's socket
(``workers.outputs.channel_socket``), and the worker actor relays nothing on a token's path.
The actor keeps the channel's Ray call (its lifeline and lease), the migrations' KV exports
(an ObjectRef is Ray's to carry) and the channels of the Ray transport and of prefills.

A reader whose connection closes (its process died) ends its channel at once: the core
aborts the channel's requests and tells the actor (``FromCore.CHANNEL_GONE``), which ends the
channel's Ray call.
"""

from __future__ import annotations

from typing import Callable

import zmq

from ..actor.protocol import EngineDeadError, Migrated
from ..outputs.channel_socket import ChannelSocketSender


class OutputSockets:
    """The core's socket channels by id. ``watch(socket)`` and ``unwatch(socket)`` add and
    remove the sockets the core's idle wait polls along with its inbox (``ActorLink``)."""

    def __init__(self, watch: Callable[[zmq.Socket], None], unwatch: Callable[[zmq.Socket], None]) -> None:
        self._context = zmq.Context()   # its own, so that ``terminate`` waits for these sockets alone
        self._watch = watch
        self._unwatch = unwatch
        self.senders: dict[str, ChannelSocketSender] = {}

    def open(self, channel_id: str, messages_ahead: int, host: str) -> str:
        """Bind channel ``channel_id``'s socket on ``host``; its address (the same one if it is open)."""
        sender = self.senders.get(channel_id)
        if sender is None:
            sender = self.senders[channel_id] = ChannelSocketSender(self._context, channel_id, messages_ahead, host)
            for socket in sender.sockets:
                self._watch(socket)
        return sender.address

    def put(self, channel_id: str, entry: bytes | Migrated) -> bool:
        """Queue ``entry`` on the channel's next message; False if it has no socket here."""
        sender = self.senders.get(channel_id)
        if sender is None:
            return False
        sender.put(entry)
        return True

    def service(self) -> list[str]:
        """Send what each channel may send now (``ChannelSocketSender.service``); the channels
        whose reader's connection closed, which the caller ends."""
        return [channel_id for channel_id, sender in self.senders.items() if not sender.service()]

    def close(self, channel_id: str, last: list = ()) -> None:
        """End the channel's socket: what is queued, ``last`` and the end go out first."""
        sender = self.senders.pop(channel_id, None)
        if sender is None:
            return
        sender.send_end(last)
        for socket in sender.sockets:
            self._unwatch(socket)
        sender.close()

    def close_all(self, error: EngineDeadError | None = None) -> None:
        """End every channel, with ``error`` (the engine failed) or without (the core stops)."""
        for channel_id in list(self.senders):
            self.close(channel_id, [] if error is None else [error])

    def terminate(self) -> None:
        """End every channel left and wait until the last messages are sent, each socket's linger
        at most: ZeroMQ sends from its own I/O thread, which an exiting process ends without
        waiting (pyzmq leaves its contexts alone at exit), so a channel's end, or the engine's
        error, could otherwise be lost when the core exits right after it."""
        self.close_all()
        self._context.term()


__all__ = ["OutputSockets"]
