"""One stream of outputs from a worker to a handle, for all of the handle's requests.

A handle that streamed each request through its own Ray call paid one message
per request per step: at 64 streams, 64 messages a step, each a few hundred
microseconds of the worker's event loop and of the handle's. Through a channel
the worker sends everything its requests made since the last message as one
``ChannelMessage``: one per engine step however many requests the handle has
in flight.

The worker keeps an ``OutputChannel`` per handle (``Worker.submit`` starts a
request on it, ``Worker.channel_outputs`` streams it). The engine core makes the
channel's rows of each step as one packed ``StreamBatch``; the channel queues the
bytes as they came, unopened, and a message carries every batch made since the
last one (several when the handle fell behind: it lets a worker send only a few
messages ahead of its reading, ``cluster.worker_channels.MESSAGES_AHEAD``), then
control items: ``Migrated`` when the KV manager moved a request. The handle reads
the batches by request key (``cluster.worker_channels``).

With the socket transport the engine core sends the channel's batches and migrations to
the handle itself (``workers.engine.output_sockets``): the channel here is then ``direct``,
holds nothing, and only keeps the lease and the channel's Ray call (``wait_ended``).

A channel's requests start once its stream has (``start``): the core must know where a
request's first rows go before it makes them.

A channel that closes (the handle closed it, or stopped renewing it: its process
died; a timer watches the lease) has its requests aborted in the engine core. A
channel whose engine died ends with that error (``fail``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

from .protocol import ChannelMessage, Migrated

logger = logging.getLogger(__name__)

# A channel its handle has not renewed for this long is closed, aborting what still runs on it:
# Ray does not end a streamed call whose caller's process died (a Serve replica that crashed).
CHANNEL_LEASE_S = 30.0


class OutputChannel:
    """The outputs a worker owes one handle, gathered between two messages.

    ``on_close(channel_id)`` aborts the channel's requests in the engine core (the worker's).
    The handle renews the channel (``renew``) well within ``lease_s``; a timer closes a
    channel whose lease ran out."""

    def __init__(self, channel_id: str, on_close: Callable[[str], None], lease_s: float = CHANNEL_LEASE_S) -> None:
        self.channel_id = channel_id
        self.on_close = on_close
        self.lease_s = lease_s
        self.renewed_at = time.monotonic()
        self.is_closed = False
        self.is_direct = False   # the core sends its outputs to the handle's socket
        self.error: BaseException | None = None
        self.is_started = False
        self._pending: ChannelMessage = []
        self._ready = asyncio.Event()
        self._lease_timer: asyncio.TimerHandle | None = None

    def start(self, is_direct: bool = False) -> None:
        """The channel's stream has started (``is_direct``: over the core's own socket); its
        requests may start."""
        self.is_direct = is_direct
        self.is_started = True
        self._ready.set()

    async def wait_started(self) -> bool:
        """Return once the stream has started (True), or the channel closed first (False)."""
        self._start_lease_watch()
        while not (self.is_started or self.is_closed):
            await self._ready.wait()   # set by start and close (the lease's timer too)
            self._ready.clear()
        return not self.is_closed

    def put(self, item: bytes | Migrated | object) -> None:
        """A packed batch, or a control item, in the order the engine core made them."""
        if self.is_closed:
            return
        self._pending.append(item)
        self._ready.set()

    def fail(self, error: BaseException) -> None:
        """The engine died: ``take`` raises ``error`` once what came before it is taken."""
        self.error = self.error or error
        self._ready.set()

    def renew(self) -> None:
        """The handle still reads this channel: its lease starts again."""
        self.renewed_at = time.monotonic()

    def _lease_left_s(self) -> float:
        return self.renewed_at + self.lease_s - time.monotonic()

    def watch_lease(self) -> None:
        """Close the channel when its lease runs out, ``take`` waiting or not: a worker that its
        handle holds back (``cluster.worker_channels.MESSAGES_AHEAD``) is not in ``take``."""
        self._lease_timer = None
        if self.is_closed:
            return
        if (left_s := self._lease_left_s()) > 0:
            self._lease_timer = asyncio.get_running_loop().call_later(left_s, self.watch_lease)
            return
        self._expire()

    def _start_lease_watch(self) -> None:
        """Watch the lease from the first wait on, once (``watch_lease`` sets itself again)."""
        if self._lease_timer is None and not self.is_closed:
            self.watch_lease()

    def _expire(self) -> None:
        logger.warning("output channel %s: not renewed for %.0f s (its handle is gone?); closing it and "
                       "aborting its requests", self.channel_id, self.lease_s)
        self.close()

    async def take(self) -> ChannelMessage | None:
        """Everything made since the last call, once there is something; None once closed, or
        once its lease has run out (it is then closed). Raises the engine's error (``fail``)
        once nothing made before it is left."""
        self._start_lease_watch()
        while not self._pending:
            if self.is_closed:
                return None
            if self.error is not None:
                raise self.error
            await self._ready.wait()   # set by put, fail and close (the lease's timer too)
            self._ready.clear()
        if self._lease_left_s() < 0:
            if not self.is_closed:
                self._expire()
            return None
        message, self._pending = self._pending, []
        return message

    async def wait_ended(self) -> None:
        """Return once the channel has closed (its lease too may run out); raises the engine's
        error (``fail``). A direct channel's Ray call waits here."""
        self._start_lease_watch()
        while not self.is_closed:
            if self.error is not None:
                raise self.error
            await self._ready.wait()
            self._ready.clear()

    def close(self) -> None:
        """Stop: the engine core aborts the requests still running here; ``take`` wakes."""
        if self.is_closed:
            return
        self.is_closed = True
        if self._lease_timer is not None:
            self._lease_timer.cancel()
            self._lease_timer = None
        self._pending = []
        self._ready.set()
        self.on_close(self.channel_id)


__all__ = ["CHANNEL_LEASE_S", "OutputChannel"]
