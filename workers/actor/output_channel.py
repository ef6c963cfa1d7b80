"""One stream of outputs from a worker to a handle, for all of the handle's requests.

A handle that streamed each request through its own Ray call paid one message
per request per step: at 64 streams, 64 messages a step, each a few hundred
microseconds of the worker's event loop and of the handle's. Through a channel
the worker sends everything its requests made since the last message as one
``ChannelMessage``: one per engine step however many requests the handle has
in flight.

The worker keeps an ``OutputChannel`` per handle (``Worker.submit`` starts a
request on it, ``Worker.channel_outputs`` streams it); the handle splits the
messages by request id (``cluster.worker_channels``). The engine hands a step's
outputs to the channel in one call on the worker's event loop
(``AsyncLLMEngine.add_stream``): no task or generator per request, so the loop
holds the GIL that the engine thread needs for as short a time as it can.

A request's items are ``OutputDelta``s (several made between two messages are
merged into one: the handle lets a worker send only a few messages ahead of its
reading, ``cluster.worker_channels.MESSAGES_AHEAD``), then, if the KV manager moved
the request, ``Migrated``; or the exception that ended it (its engine loop died). A
channel that closes (the handle closed it, or stopped renewing it: its process died;
a timer watches the lease) aborts what still runs on it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import pickle
import time
from typing import TYPE_CHECKING, Callable

from .protocol import ChannelItem, ChannelMessage, DeltaEncoder, GenerateRequest, Migrated, OutputDelta, merge_deltas

if TYPE_CHECKING:
    from ..offline.async_engine import AsyncLLMEngine
    from ..engine.request import RequestOutput

logger = logging.getLogger(__name__)

# A channel its handle has not renewed for this long is closed, aborting what still runs on it:
# Ray does not end a streamed call whose caller's process died (a Serve replica that crashed).
CHANNEL_LEASE_S = 30.0


class OutputChannel:
    """The outputs a worker owes one handle, gathered between two messages.

    ``hold_export(request_id, kv_transfer) -> ref`` keeps a migrated request's KV
    alive in the object store until its target has fetched it (``Worker``'s). The
    handle renews the channel (``renew``) well within ``lease_s``; ``take`` closes a
    channel whose lease ran out."""

    def __init__(self, channel_id: str, engine: AsyncLLMEngine,
                 hold_export: Callable[[str, object], object], lease_s: float = CHANNEL_LEASE_S) -> None:
        self.channel_id = channel_id
        self.engine = engine
        self.hold_export = hold_export
        self.lease_s = lease_s
        self.renewed_at = time.monotonic()
        self.is_closed = False
        self._pending: list[tuple[str, ChannelItem]] = []
        self._ready = asyncio.Event()
        self._live: dict[str, _RequestStream] = {}   # requests whose last item is not out yet
        self._lease_timer: asyncio.TimerHandle | None = None

    @property
    def num_requests(self) -> int:
        return len(self._live)

    def start(self, request: GenerateRequest, transfer_s: tuple[float, float] | None = None,
              **engine_options) -> None:
        """Start ``request`` on the engine, its items into this channel. Raises (and starts
        nothing) for a request the engine refuses. ``transfer_s``: the (fetch, local copy)
        seconds of its imported KV, added to its first output's metrics."""
        request_id = request.request_id
        if request_id in self._live:
            raise ValueError(f"request id {request_id!r} is already in use on this channel")
        if self._lease_timer is None:
            self._watch_lease()
        stream = _RequestStream(self, request_id, transfer_s)
        self.engine.add_stream(stream, request.prompt, request.params, request_id, request.priority,
                               request.prompt_token_ids, delta_encoder=stream.encoder, **engine_options)
        self._live[request_id] = stream

    def put(self, request_id: str, item: ChannelItem, is_last: bool = False) -> None:
        if self.is_closed:
            return
        self._pending.append((request_id, item))
        if is_last:
            self._live.pop(request_id, None)
        self._ready.set()

    def renew(self) -> None:
        """The handle still reads this channel: its lease starts again."""
        self.renewed_at = time.monotonic()

    def _lease_left_s(self) -> float:
        return self.renewed_at + self.lease_s - time.monotonic()

    def _watch_lease(self) -> None:
        """Close the channel when its lease runs out, ``take`` waiting or not: a worker that its
        handle holds back (``cluster.worker_channels.MESSAGES_AHEAD``) is not in ``take``."""
        self._lease_timer = None
        if self.is_closed:
            return
        if (left_s := self._lease_left_s()) > 0:
            self._lease_timer = asyncio.get_running_loop().call_later(left_s, self._watch_lease)
            return
        self._expire()

    def _expire(self) -> None:
        logger.warning("output channel %s: not renewed for %.0f s (its handle is gone?); closing it, "
                       "%d requests aborted", self.channel_id, self.lease_s, self.close())

    async def take(self) -> ChannelMessage | None:
        """Everything made since the last call, once there is something; None once closed,
        or once its lease has run out (it is then closed)."""
        if self._lease_timer is None:
            self._watch_lease()
        while not self._pending:
            if self.is_closed:
                return None
            await self._ready.wait()   # set by put, and by close (the lease's timer too)
            self._ready.clear()
        if self._lease_left_s() < 0:
            if not self.is_closed:
                self._expire()
            return None
        message, self._pending = self._pending, []
        return _merged(message)

    def close(self) -> int:
        """Stop: abort the requests still running here, wake ``take``. Returns how many ran."""
        self.is_closed = True
        if self._lease_timer is not None:
            self._lease_timer.cancel()
            self._lease_timer = None
        live, self._live = self._live, {}
        for request_id in live:
            self.engine.abort(request_id)
        self._ready.set()
        return len(live)


class _RequestStream:
    """One request's sink (``OutputSink``): its engine outputs become the channel's items. The
    engine makes its deltas with ``encoder`` (``LLMEngine.add_request``'s ``delta_encoder``);
    a migration's last output and a beam search's come as ``RequestOutput``s, encoded here."""

    __slots__ = ("channel", "request_id", "encoder", "transfer_s")

    def __init__(self, channel: OutputChannel, request_id: str, transfer_s: tuple[float, float] | None) -> None:
        self.channel = channel
        self.request_id = request_id
        self.encoder = DeltaEncoder()
        self.transfer_s = transfer_s

    def put_nowait(self, item: OutputDelta | RequestOutput | BaseException) -> None:
        channel, request_id = self.channel, self.request_id
        if isinstance(item, BaseException):
            channel.put(request_id, _sendable(item), is_last=True)
            return
        try:
            self._put_output(item)
        except Exception as exc:  # a bug here ends this request, loudly, and no other
            logger.exception("request %s: its output could not be sent", request_id)
            channel.engine.abort(request_id)
            channel.put(request_id, RuntimeError(f"the worker could not send an output: {exc!r}"), is_last=True)

    def _put_output(self, output: OutputDelta | RequestOutput) -> None:
        channel, request_id = self.channel, self.request_id
        if self.transfer_s is not None:  # the first output of a request that imported its KV
            fetch_s, memcpy_s = self.transfer_s
            self.transfer_s = None
            channel.engine.note_transfer(request_id, fetch_s, memcpy_s)
            # The request's own metrics: a first delta always carries them.
            output.metrics.kv_transfer_s += fetch_s
            output.metrics.kv_memcpy_s += memcpy_s
        if type(output) is OutputDelta:
            channel.put(request_id, output, is_last=output.finished)
            return
        delta = self.encoder.encode(output)
        if output.migrate_to is None:
            channel.put(request_id, delta, is_last=output.finished)
            return
        # Not an end for the caller: its last tokens (if any), then where it goes on.
        delta.samples = [dataclasses.replace(s, finish_reason=None, stop_reason=None)
                         for s in delta.samples if s.token_ids or s.text]
        delta.finished = False
        if delta.samples:
            channel.put(request_id, delta)
        kv = channel.hold_export(request_id, output.kv_transfer)
        channel.put(request_id, Migrated(request_id, output.migrate_to, kv), is_last=True)


def _merged(message: list[tuple[str, ChannelItem]]) -> ChannelMessage:
    """``message`` with each request's consecutive deltas merged into one (a request has
    several when the engine stepped more than once since the last message)."""
    merged = ChannelMessage()
    last_delta_at: dict[str, int] = {}   # request id -> index in ``merged`` of its open run of deltas
    for request_id, item in message:
        at = last_delta_at.get(request_id)
        if isinstance(item, OutputDelta):
            if at is not None:
                merged[at] = (request_id, merge_deltas([merged[at][1], item]))
                continue
            last_delta_at[request_id] = len(merged)
        else:
            last_delta_at.pop(request_id, None)
        merged.append((request_id, item))
    return merged


def _sendable(error: BaseException) -> BaseException:
    """``error`` if it survives pickling (Ray sends it to the handle), else a ``RuntimeError`` naming it."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")


__all__ = ["CHANNEL_LEASE_S", "ChannelItem", "ChannelMessage", "OutputChannel"]
