"""The handle's end of the worker channels: one output stream per worker, split by request.

A handle sends its requests to a worker with ``Worker.submit``, one call for all that its
event loop started for that worker in one turn or while the last call was out
(``turn_batch``: a burst of requests costs a few Ray calls, not one each; a request that
brings KV, migrated or prefilled elsewhere, goes alone, since the worker answers it once
it has read the transfer), and reads every
request's outputs from one channel per worker (``workers.actor.output_channel``): one
message per engine step for all the requests in flight there, rather than one per
request. The channel is a streamed call, ``Worker.channel_outputs``, that yields the
address of a ZeroMQ socket the messages then come over (``output_transport: zmq``,
``workers.outputs.channel_socket``), the call staying open as the channel's lifeline; or,
with ``output_transport: ray``, whose streamed items are the messages. Each request has a key on its
channel (``GenerateRequest.key``); a message carries the engine core's packed
batches, whose rows name requests by key, and control items. A reader task per
channel unpacks each batch once and hands each request its delta
(``deltas_from_batch``) in its inbox; ``WorkerChannels.stream`` is what a request
iterates, and it sees what a call of its own would have: its items in order
(the deltas of several steps that came together merged into one), then the
end, or the error that ended it.

A channel that fails ends every request on it as a failed worker would (its
``RayActorError``, the ``EngineDeadError`` of a worker whose engine died, or
``ChannelClosed`` when the stream broke otherwise), so each
goes on elsewhere, and the next request to that worker opens a new channel. A
channel belongs to no request: cancelling the one that opened it (a client that
went away) ends that request alone. The handle renews each channel every
``RENEW_EVERY_S``; a worker closes a channel that has not been renewed for its
lease (the handle's process died), aborting what still ran on it. Channels
belong to an event loop: a handle used from several loops (``generate_sync``
runs one per call) opens channels in each, and a channel whose loop has gone is
closed on the worker, which aborts what still ran on it.

A worker sends at most ``MESSAGES_AHEAD`` messages more than the handle has read
(the credits the handle returns on the socket, or Ray's streaming-generator backpressure). A handle that falls behind (its
process busy, as a replica at full load is) makes the worker wait to send, and
what the worker's requests make meanwhile goes out in the next message, read as
fewer, larger deltas, each a request's several tokens, instead of one message
per engine step queued without bound, each costing the handle its per-token
work when it gets to it, further and further behind the engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
import uuid
from typing import AsyncIterator

from pagedserve.workers.outputs.channel_socket import BATCH, DEAD, MIGRATED, ChannelSocketReceiver, decode
from pagedserve.workers.actor.protocol import (ChannelItem, EngineDeadError, GenerateRequest, Migrated, OutputDelta,
                                               deltas_from_batch, merge_deltas)
from pagedserve.workers.outputs.stream_batch import StreamBatch

from .detached import start_detached
from .turn_batch import TurnBatch

logger = logging.getLogger(__name__)

# How often a handle renews each open channel: well within the worker's lease
# (``workers.actor.output_channel.CHANNEL_LEASE_S``), after which a channel closes as abandoned.
RENEW_EVERY_S = 5.0
# How often a channel looks for requests that waited past their timeout for an output: one
# check for all of them, rather than a timer armed and cancelled for every output.
WATCH_EVERY_S = 0.5
# How many messages a worker may send ahead of the handle's reading (see the module docstring).
MESSAGES_AHEAD = 2
# How long a socket channel's reader may still wait for the socket's end once the channel's Ray
# call has ended (the end comes first unless the worker could not send it).
LIFELINE_GRACE_S = 2.0


class ChannelClosed(ConnectionError):
    """A worker channel ended while requests still read from it."""


class _Inbox:
    """A request's items since its reader last took them, the wake-up of that reader, and how
    long it may wait for the next (``timeout_s`` since ``last_at``)."""

    __slots__ = ("loop", "request_id", "timeout_s", "last_at", "items", "_waiter")

    def __init__(self, loop: asyncio.AbstractEventLoop, request_id: str, timeout_s: float) -> None:
        self.loop = loop   # kept: asyncio.get_running_loop() costs a getpid system call on Python 3.11
        self.request_id = request_id
        self.timeout_s = timeout_s
        self.last_at = time.monotonic()
        self.items: list[ChannelItem] = []
        self._waiter: asyncio.Future | None = None

    def put(self, item: ChannelItem) -> None:
        self.items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def take(self) -> list[ChannelItem]:
        """Everything that came since the last call, once something has."""
        while not self.items:
            self._waiter = self.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        items, self.items = self.items, []
        return items


def _merged(items: list[ChannelItem]) -> list[ChannelItem]:
    """``items`` with each run of consecutive deltas merged into one (a reader behind the
    engine gets one output for several steps' tokens)."""
    merged: list[ChannelItem] = []
    run: list[OutputDelta] = []
    for item in items:
        if type(item) is OutputDelta:
            run.append(item)
            continue
        if run:
            merged.append(merge_deltas(run))
            run = []
        merged.append(item)
    if run:
        merged.append(merge_deltas(run))
    return merged


class WorkerChannel:
    """One worker's channel on this event loop, and the inboxes of the requests on it."""

    def __init__(self, worker_id: str, worker, transport: str = "zmq") -> None:
        self.worker_id = worker_id
        self.worker = worker
        self.transport = transport
        self.channel_id = f"{worker_id}/{uuid.uuid4().hex[:16]}"
        self.loop = asyncio.get_running_loop()
        self.error: BaseException | None = None
        self.inboxes: dict[str, _Inbox] = {}   # by request id
        self.by_key: dict[int, _Inbox] = {}    # by the request's key in this channel's batches
        self._keys = itertools.count()
        self.num_messages = 0
        self._lifeline_ended: BaseException | None = None   # the socket transport's Ray call ended
        self._deliveries: set[asyncio.Task] = set()          # migrations whose KV ref is being fetched
        self._submissions = TurnBatch(self.loop, lambda requests: worker.submit.remote(self.channel_id, requests))
        # Detached: the channel must not belong to the request that happened to open it, whose
        # cancellation would otherwise end every request on the channel.
        self._reader = start_detached(self.loop, self._read(), name=f"pagedserve-channel-{self.channel_id}")
        self._tender = start_detached(self.loop, self._tend(), name=f"pagedserve-tend-{self.channel_id}")

    @property
    def is_open(self) -> bool:
        return self.error is None and not self.loop.is_closed()

    async def _read(self) -> None:
        error: BaseException
        try:
            stream = self.worker.channel_outputs.options(
                num_returns="streaming", _generator_backpressure_num_objects=MESSAGES_AHEAD).remote(
                    self.channel_id, self.transport, MESSAGES_AHEAD)
            if self.transport == "zmq":
                await self._read_socket(stream)
            else:
                async for ref in stream:
                    self._take_message(await ref)
            error = ChannelClosed(f"the output channel of worker {self.worker_id} ended")
        except asyncio.CancelledError:
            if self._lifeline_ended is None:  # this event loop is closing
                error = ChannelClosed(f"the output channel of worker {self.worker_id} was closed")
                self._close_remote()
                raise
            error = self._lifeline_ended       # the socket transport's Ray call ended (``_watch``)
        except Exception as exc:  # the worker or its engine died: its requests go on elsewhere
            error = _ended_by(self.worker_id, exc)
        finally:
            self.error = self.error or error
            self._tender.cancel()
            for inbox in self.inboxes.values():
                inbox.put(error)

    def _take_message(self, message: list) -> None:
        """A Ray-carried message: its batches to their requests' inboxes, then its control items."""
        self.num_messages += 1
        now = time.monotonic()
        for entry in message:
            if isinstance(entry, bytes):
                self._take_batch(entry, now)
            else:   # a control item (Migrated)
                inbox = self.inboxes.get(entry.request_id)
                if inbox is not None:
                    inbox.put(entry)
                    inbox.last_at = now
                else:   # the request stopped reading: nobody fetches its KV export
                    self._release_export(entry)

    def _take_batch(self, packed: bytes, now: float) -> None:
        by_key = self.by_key
        for key, item in deltas_from_batch(StreamBatch.unpack(packed)):
            inbox = by_key.get(key)
            if inbox is not None:  # else the request stopped reading (aborted)
                if type(item) is OutputDelta:
                    item.request_id = inbox.request_id
                inbox.put(item)
                inbox.last_at = now

    async def _read_socket(self, stream) -> None:
        """Read the channel's socket (``workers.outputs.channel_socket``) until its end; the Ray
        call, whose one item is the socket's address, is watched meanwhile (``_watch``)."""
        try:
            address = await (await stream.__anext__())
        except StopAsyncIteration:
            return   # the channel had closed on the worker
        receiver = ChannelSocketReceiver(address, self.channel_id)
        lifeline = self.loop.create_task(self._watch(stream), name=f"pagedserve-lifeline-{self.channel_id}")
        try:
            while True:
                entries = decode(await receiver.receive())
                self.num_messages += 1
                now = time.monotonic()
                for kind, value in entries:
                    if kind == BATCH:
                        self._take_batch(value, now)
                    elif kind == MIGRATED:
                        self._migrated(*value, now)
                    elif kind == DEAD:
                        raise value
                    else:   # END
                        return
                receiver.read_one()
        finally:
            receiver.close()
            lifeline.cancel()

    async def _watch(self, stream) -> None:
        """End the socket's reader when the channel's Ray call ends: at once when it failed (the
        worker died), else after ``LIFELINE_GRACE_S`` (the socket's end normally comes first)."""
        try:
            async for ref in stream:
                await ref   # nothing comes past the address
            await asyncio.sleep(LIFELINE_GRACE_S)
            ended: BaseException = ChannelClosed(f"the output channel of worker {self.worker_id} ended")
        except Exception as exc:
            ended = _ended_by(self.worker_id, exc)
        self._lifeline_ended = ended
        self._reader.cancel()

    def _migrated(self, request_id: str, target: str, now: float) -> None:
        """A migration read from the socket: its KV's ObjectRef is fetched from the worker, then
        it reaches the request (nothing else of that request comes after it)."""
        inbox = self.inboxes.get(request_id)
        if inbox is None:   # the request stopped reading: nobody fetches its KV export
            release_export(self.worker, request_id)
            return
        inbox.last_at = now
        task = start_detached(self.loop, self._deliver_migrated(inbox, request_id, target))
        self._deliveries.add(task)
        task.add_done_callback(self._deliveries.discard)

    async def _deliver_migrated(self, inbox: _Inbox, request_id: str, target: str) -> None:
        item: ChannelItem
        try:
            held = await asyncio.wait_for(self.worker.export_ref.remote(request_id), timeout=inbox.timeout_s)
            item = (Migrated(request_id, target, held[0]) if held else
                    ChannelClosed(f"worker {self.worker_id} no longer held the KV of migrated request {request_id}"))
        except Exception as exc:  # the worker died: the request goes on elsewhere
            item = exc
        if self.inboxes.get(request_id) is inbox:
            inbox.put(item)
        elif isinstance(item, Migrated):
            self._release_export(item)

    async def _tend(self) -> None:
        """Every ``WATCH_EVERY_S``, end the requests that waited past their timeout for an
        output (``TimeoutError``); every ``RENEW_EVERY_S``, tell the worker this channel is
        still read."""
        renewed_at = time.monotonic()
        while self.error is None:
            await asyncio.sleep(WATCH_EVERY_S)
            now = time.monotonic()
            for inbox in list(self.inboxes.values()):
                if now - inbox.last_at > inbox.timeout_s:
                    inbox.last_at = float("inf")   # once
                    inbox.put(TimeoutError(f"no output of request {inbox.request_id} from worker "
                                           f"{self.worker_id} for {inbox.timeout_s:g} s"))
            if now - renewed_at >= RENEW_EVERY_S:
                renewed_at = now
                try:
                    self.worker.renew_channel.remote(self.channel_id)
                except Exception:  # the worker is gone: the reader finds out
                    pass

    def _release_export(self, migrated: Migrated) -> None:
        """Let the worker drop a migration's KV export no attempt will fetch (else it holds it,
        and a draining worker cannot go, until the hold expires)."""
        release_export(self.worker, migrated.request_id)

    def _close_remote(self) -> None:
        try:
            self.worker.close_channel.remote(self.channel_id)
        except Exception:  # the worker is gone: nothing runs there
            pass

    async def stream(self, request: GenerateRequest, timeout_s: float) -> AsyncIterator[OutputDelta | Migrated]:
        """Submit ``request`` here and yield its items; ``asyncio.TimeoutError`` when none comes
        for ``timeout_s``. Raises ``ChannelClosed`` if the worker refused it (this channel had
        closed there)."""
        request_id = request.request_id
        if request_id in self.inboxes:
            raise ValueError(f"request id {request_id!r} is already streaming from worker {self.worker_id}")
        key = next(self._keys)
        inbox = self.inboxes[request_id] = self.by_key[key] = _Inbox(self.loop, request_id, timeout_s)
        request = dataclasses.replace(request, key=key)
        items, num_read = [], 0
        try:
            if self.error is not None:
                raise self.error
            if request.kv:  # alone: the worker answers once it has read the transfer
                submitted = _only(self.worker.submit.remote(self.channel_id, [request]))
            else:           # with the others started together on this worker (``TurnBatch``)
                submitted = self._submissions.ask(request)
            if not await asyncio.wait_for(submitted, timeout=timeout_s):
                raise ChannelClosed(f"the output channel of worker {self.worker_id} had closed")
            while True:
                items, num_read = _merged(await inbox.take()), 0  # a timeout comes as an item too (``_tend``)
                for item in items:
                    num_read += 1
                    if isinstance(item, BaseException):
                        raise item
                    yield item
        finally:
            del self.inboxes[request_id]
            del self.by_key[key]
            for item in items[num_read:] + inbox.items:   # never read: a migration nobody follows
                if isinstance(item, Migrated):
                    self._release_export(item)

    def close(self) -> None:
        """Stop reading; the worker aborts what still runs on this channel."""
        if self.error is None:
            self.error = ChannelClosed(f"the output channel of worker {self.worker_id} was closed")
        if self._reader.done():
            return
        try:
            if _running_loop() is self.loop:
                self._reader.cancel()
            else:  # from another thread (shutting the handle down): on the channel's own loop
                self.loop.call_soon_threadsafe(self._reader.cancel)
        except RuntimeError:  # that loop has closed: its tasks ended with it
            pass


class WorkerChannels:
    """The open channels of a handle, one per (event loop, worker), over ``transport``: "zmq"
    (a socket per channel, ``workers.outputs.channel_socket``) or "ray" (Ray streamed items)."""

    def __init__(self, transport: str = "zmq") -> None:
        self.transport = transport
        self._channels: dict[tuple[int, str], WorkerChannel] = {}

    def get(self, worker_id: str, worker) -> WorkerChannel:
        """This event loop's open channel to ``worker`` (``worker_id``), opened if needed."""
        loop = asyncio.get_running_loop()
        key = (id(loop), worker_id)
        channel = self._channels.get(key)
        # Keyed by id: the handle's actor handles are new objects whenever the worker set changes.
        if channel is None or not channel.is_open or channel.loop is not loop:
            self._prune()
            channel = self._channels[key] = WorkerChannel(worker_id, worker, self.transport)
        return channel

    async def stream(self, worker_id: str, worker, request: GenerateRequest,
                     timeout_s: float) -> AsyncIterator[OutputDelta | Migrated]:
        """``request``'s items from ``worker``: ``OutputDelta``s until the finished one, or
        ``Migrated``; the error that ended it raises. A channel found closed on the worker before
        the request started is replaced once."""
        for attempt in range(2):
            channel = self.get(worker_id, worker)
            started = False
            try:
                async for item in channel.stream(request, timeout_s):
                    started = True
                    yield item
                return
            except ChannelClosed:
                if started or attempt == 1:
                    raise
                channel.close()  # closed on the worker: a new one takes the request

    def _prune(self) -> None:
        for key, channel in list(self._channels.items()):
            if not channel.is_open:
                del self._channels[key]

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()
        self._channels.clear()

    def num_messages(self) -> int:
        """Messages read from workers on the channels still open."""
        return sum(channel.num_messages for channel in self._channels.values())

    def num_submit_calls(self) -> int:
        """``Worker.submit`` calls made on the channels still open (each starts one or more requests)."""
        return sum(channel._submissions.num_calls for channel in self._channels.values())


def release_export(worker, request_id: str) -> None:
    """Tell ``worker``, a migration's source, that the KV it exports for ``request_id`` is no
    longer needed (a worker that is gone held nothing)."""
    try:
        worker.release_export.remote(request_id)
    except Exception:  # the worker is gone, and its exports with it
        pass


async def _only(answers):
    """The one answer of a ``Worker.submit`` call of one request (raised when it is an error)."""
    [answer] = await answers
    if isinstance(answer, BaseException):
        raise answer
    return answer


def _ended_by(worker_id: str, exc: Exception) -> BaseException:
    """What ends a channel's requests when ``exc`` ended its reading: the worker's death or its
    engine's as it came, anything else as a broken channel (``_broken``)."""
    from ray.exceptions import RayActorError

    return exc if isinstance(exc, (RayActorError, EngineDeadError)) else _broken(worker_id, exc)


def _broken(worker_id: str, cause: Exception) -> ChannelClosed:
    """A channel that failed for another reason than its worker's death (cancelled, say): its
    requests go on elsewhere like after a dead worker, since none of them caused it."""
    error = ChannelClosed(f"the output channel of worker {worker_id} broke: {cause!r}")
    error.__cause__ = cause
    return error


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


__all__ = ["ChannelClosed", "WorkerChannel", "WorkerChannels", "release_export"]
