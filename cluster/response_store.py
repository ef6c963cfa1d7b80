"""Stored responses of the Responses API, one store for the whole cluster.

With ``server.store_responses`` on, a finished response (``store`` left out or true) is kept
here: ``GET``/``DELETE /v1/responses/{id}`` and ``.../input_items`` read it, a later
request's ``previous_response_id`` continues its conversation, and its ``item_reference``
input items name any stored response's input or output items by id. Every ingress replica must see
every stored response (a client's next request may reach another replica), so the store is
one named actor (``response_store``), created by the first replica that needs it and ended
with the cluster (``kill_response_store``). Its calls happen once per response, never per
token: the replica awaits the store's copy before the response (or its last event) goes out,
so a follow-up naming it finds it, whichever replica takes it.

The store keeps at most ``max_responses`` responses and ``max_bytes`` of their JSON (the
response, its input items and, for a streamed background one, its events), and forgets the
least recently used finished ones beyond either; a background response that still runs, and
the one used last, stay. A conversation whose earlier response was forgotten or deleted
cannot be continued, and says which response is missing. What is stored lives in the actor's
memory: it does not survive the actor's restart.

A background response is stored as it starts, under a lease held by the replica that runs it
(``owner``). The replica renews its leases about once a second in one call, which also tells it
which of its responses were cancelled meanwhile (a cancel may reach any replica): cancelling
marks the response ``cancelled`` at once, and its runner aborts it at its next renewal. A
response whose lease lapses (its replica stopped or died) is marked ``failed``, so that every
background response ends.

A background response created with ``stream`` also keeps its server-sent events (event i has
``sequence_number`` i), so that a client may read them again or go on reading after it left
(``GET /v1/responses/{id}?stream=true&starting_after=n``). Its replica writes each event to an
``EventLog`` as it is made, which that replica's readers follow at once, and sends the store what
is new with each lease renewal (every ``BackgroundRuns.flush_s`` while such a response runs):
readers on other replicas poll the store. The store's copy is whole once the response ends.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from .detached import start_detached

logger = logging.getLogger("pagedserve.server")

STORE_NAME = "pagedserve-response-store"
UNFINISHED = ("queued", "in_progress")
LAPSED = {"code": "server_error",
          "message": "the server stopped running this background response (its ingress replica stopped)"}


@dataclass
class StoredResponse:
    """A finished response as the API returned it, and the input items of its own request
    (each with its ``id``), and the response it continued, if any."""

    response: dict[str, Any]
    input_items: list[dict[str, Any]]
    previous_response_id: str | None = None

    @property
    def id(self) -> str:
        return self.response["id"]

    def items(self) -> list[dict[str, Any]]:
        """Its input items, then its output items."""
        return [*self.input_items, *self.response.get("output", ())]


@dataclass
class StoredEvents:
    """A stored response's events after a sequence number (None: it keeps no events, as it was
    not a streamed background response), and its status."""

    events: list[str] | None
    status: str

    @property
    def is_finished(self) -> bool:
        return self.status not in UNFINISHED


@dataclass
class Conversation:
    """The items a response's conversation holds up to its output (``items``), oldest first;
    or, when an earlier response of it is no longer stored, that response's id (``missing``)."""

    items: list[dict[str, Any]] = field(default_factory=list)
    missing: str | None = None


DEFAULT_MAX_BYTES = 1 << 30


def stored_size(stored: StoredResponse, events: list[str] | None = None) -> int:
    """What ``stored`` (and ``events``, its events) count against the store's ``max_bytes``:
    the characters of its response's and input items' JSON, and of its events."""
    return (len(json.dumps(stored.response)) + len(json.dumps(stored.input_items))
            + sum(len(event) for event in events or ()))


class ResponseStore:
    """Stored responses by id, the least recently used finished ones forgotten beyond
    ``max_responses`` responses or ``max_bytes`` (``stored_size``)."""

    def __init__(self, max_responses: int, max_bytes: int = DEFAULT_MAX_BYTES,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_responses < 1:
            raise ValueError(f"max_responses must be at least 1, not {max_responses}")
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be at least 1, not {max_bytes}")
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()
        self._sizes: dict[str, int] = {}   # what each stored response counts, as counted when stored
        self.num_bytes = 0
        self.num_evicted = 0
        self._clock = clock
        self._leases: dict[str, tuple[str, float]] = {}   # a running background response -> (owner, until)
        self._cancelled: dict[str, set[str]] = {}         # owner -> its responses cancelled, not yet told
        self._deleted_running: set[str] = set()           # deleted while running: their last word is dropped
        # An item's id -> the stored responses that hold it, in the order they were stored (a
        # client may send an item back with its id, so that two responses hold it).
        self._item_holders: dict[str, dict[str, None]] = {}
        self._events: dict[str, list[str]] = {}   # a streamed background response's events, in order

    def put(self, stored: StoredResponse, events: list[str] | None = None) -> None:
        """Store ``stored``; a background response's last word (finished, or failed) ends its lease,
        unless it was cancelled meanwhile, which it stays. ``events``: a streamed background
        response's every event."""
        self._lapse()
        if stored.id in self._deleted_running:
            self._deleted_running.discard(stored.id)
            return
        self._leases.pop(stored.id, None)
        current = self._responses.get(stored.id)
        if (current is not None and current.response.get("status") == "cancelled"
                and stored.response.get("status") != "cancelled"):
            return   # its runner's last word came after the cancel
        if current is not None:
            self._forget(current)
        self._responses[stored.id] = stored
        self._responses.move_to_end(stored.id)
        self._index(stored)
        if events is not None:
            self._events[stored.id] = list(events)
        self._count(stored.id, stored_size(stored, events))
        self._evict()

    def _count(self, response_id: str, size: int) -> None:
        self.num_bytes += size - self._sizes.get(response_id, 0)
        self._sizes[response_id] = size

    def _evict(self) -> None:
        """Forget the least recently used finished responses while more than ``max_responses``
        or ``max_bytes`` are kept; running ones (under a lease) and the one used last stay."""
        while len(self._responses) > self.max_responses or self.num_bytes > self.max_bytes:
            last = next(reversed(self._responses))
            victim = next((response_id for response_id in self._responses if response_id not in self._leases), last)
            if victim == last:
                return
            self._forget(self._responses.pop(victim))
            self.num_evicted += 1

    def _forget(self, stored: StoredResponse) -> None:
        """Drop what is kept beside ``stored`` (no longer, or no longer so, stored)."""
        self._unindex(stored)
        self._events.pop(stored.id, None)
        self.num_bytes -= self._sizes.pop(stored.id, 0)

    def _index(self, stored: StoredResponse) -> None:
        for item in stored.items():
            if "id" in item:
                holders = self._item_holders.setdefault(item["id"], {})
                holders.pop(stored.id, None)
                holders[stored.id] = None

    def _unindex(self, stored: StoredResponse) -> None:
        for item in stored.items():
            holders = self._item_holders.get(item.get("id"))
            if holders is not None:
                holders.pop(stored.id, None)
                if not holders:
                    del self._item_holders[item["id"]]

    def start_background(self, stored: StoredResponse, owner: str, lease_s: float, is_streamed: bool = False) -> None:
        """Store the background response ``stored`` as it starts, run by ``owner`` for ``lease_s``
        unless renewed; ``is_streamed``: it keeps its events."""
        self.put(stored, [] if is_streamed else None)
        self._leases[stored.id] = (owner, self._clock() + lease_s)

    def renew(self, owner: str, response_ids: list[str], lease_s: float,
              events: dict[str, tuple[int, list[str]]] | None = None) -> list[str]:
        """``owner`` still runs ``response_ids``: their leases run ``lease_s`` more, and ``events``
        (a response's id -> the sequence number of the first, and its events from there) are
        added to their logs. Returns those of them cancelled since the last renewal (the owner
        aborts them)."""
        self._lapse()
        until = self._clock() + lease_s
        for response_id in response_ids:
            if self._leases.get(response_id, (None,))[0] == owner:
                self._leases[response_id] = (owner, until)
        for response_id, (first, new) in (events or {}).items():
            log = self._events.get(response_id)
            if log is not None and self._leases.get(response_id, (None,))[0] == owner and first <= len(log):
                replaced = sum(len(event) for event in log[first:])
                log[first:] = new   # from a renewal sent again, the same events again
                self._count(response_id, self._sizes[response_id] + sum(len(event) for event in new) - replaced)
        self._evict()
        cancelled = self._cancelled.pop(owner, set())
        return [response_id for response_id in response_ids if response_id in cancelled]

    def cancel(self, response_id: str) -> StoredResponse | None:
        """Cancel the background response ``response_id`` if it still runs; returns it as it now
        stands (a finished or synchronous response unchanged), or None if it is not stored."""
        stored = self.get(response_id)
        if stored is None:
            return None
        lease = self._leases.pop(response_id, None)
        if lease is not None and stored.response.get("status") in UNFINISHED:
            stored.response = {**stored.response, "status": "cancelled"}
            self._cancelled.setdefault(lease[0], set()).add(response_id)
        return stored

    def _lapse(self) -> None:
        """Mark ``failed`` every background response whose runner stopped renewing its lease."""
        now = self._clock()
        for response_id in [r for r, (_, until) in self._leases.items() if until < now]:
            del self._leases[response_id]
            stored = self._responses.get(response_id)
            if stored is not None and stored.response.get("status") in UNFINISHED:
                stored.response = {**stored.response, "status": "failed", "error": LAPSED}

    def get(self, response_id: str) -> StoredResponse | None:
        self._lapse()
        stored = self._responses.get(response_id)
        if stored is not None:
            self._responses.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> bool:
        lease = self._leases.pop(response_id, None)
        if lease is not None:   # still running: its runner aborts it, and its last word is dropped
            self._cancelled.setdefault(lease[0], set()).add(response_id)
            self._deleted_running.add(response_id)
        stored = self._responses.pop(response_id, None)
        if stored is None:
            return False
        self._forget(stored)
        return True

    def events(self, response_id: str, after: int) -> StoredEvents | None:
        """The stored response's events after sequence number ``after``, and its status; None if
        it is not stored."""
        stored = self.get(response_id)
        if stored is None:
            return None
        log = self._events.get(response_id)
        return StoredEvents(None if log is None else log[after + 1:], stored.response.get("status", "completed"))

    def items(self, item_ids: list[str]) -> dict[str, dict[str, Any]]:
        """The items named in ``item_ids`` that a stored response holds (as input or output), by
        id: each as the response stored last of those that hold it has it. A response read so
        counts as used."""
        found: dict[str, dict[str, Any]] = {}
        for item_id in item_ids:
            holders = self._item_holders.get(item_id)
            if item_id in found or not holders:
                continue
            stored = self.get(next(reversed(holders)))
            found[item_id] = next(item for item in stored.items() if item.get("id") == item_id)
        return found

    def conversation(self, response_id: str) -> Conversation | None:
        """The conversation that ``response_id`` ends: every earlier response's input and
        output items in order, then its own. None if ``response_id`` itself is not stored; an
        earlier one missing (or replaced, so that the chain loops) is named."""
        chain: list[StoredResponse] = []
        walked: set[str] = set()
        next_id: str | None = response_id
        while next_id is not None:
            if next_id in walked:   # a loop: a client's request_id replaced an earlier response
                return Conversation(missing=next_id)
            walked.add(next_id)
            stored = self.get(next_id)
            if stored is None:
                return None if not chain else Conversation(missing=next_id)
            chain.append(stored)
            next_id = stored.previous_response_id
        items: list[dict[str, Any]] = []
        for stored in reversed(chain):
            items += stored.items()
        return Conversation(items)

    def stats(self) -> dict[str, int]:
        return {"num_stored": len(self._responses), "max_responses": self.max_responses,
                "num_bytes": self.num_bytes, "max_bytes": self.max_bytes,
                "num_evicted": self.num_evicted, "num_running": len(self._leases)}


class LocalResponseStore:
    """A ``ResponseStore`` in this process, behind the awaitable calls the frontend makes."""

    def __init__(self, max_responses: int, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.store = ResponseStore(max_responses, max_bytes)

    async def put(self, stored: StoredResponse, events: list[str] | None = None) -> None:
        self.store.put(stored, events)

    async def get(self, response_id: str) -> StoredResponse | None:
        return self.store.get(response_id)

    async def delete(self, response_id: str) -> bool:
        return self.store.delete(response_id)

    async def start_background(self, stored: StoredResponse, owner: str, lease_s: float,
                               is_streamed: bool = False) -> None:
        self.store.start_background(stored, owner, lease_s, is_streamed)

    async def renew(self, owner: str, response_ids: list[str], lease_s: float,
                    events: dict[str, tuple[int, list[str]]] | None = None) -> list[str]:
        return self.store.renew(owner, response_ids, lease_s, events)

    async def events(self, response_id: str, after: int) -> StoredEvents | None:
        return self.store.events(response_id, after)

    async def cancel(self, response_id: str) -> StoredResponse | None:
        return self.store.cancel(response_id)

    async def stats(self) -> dict[str, int]:
        return self.store.stats()

    async def conversation(self, response_id: str) -> Conversation | None:
        return self.store.conversation(response_id)

    async def items(self, item_ids: list[str]) -> dict[str, dict[str, Any]]:
        return self.store.items(item_ids)


class ActorResponseStore:
    """The cluster's store actor (named ``STORE_NAME`` in ``namespace``; created with room for
    ``max_responses`` and ``max_bytes`` if none runs yet), behind the same awaitable calls."""

    def __init__(self, namespace: str | None, max_responses: int, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        import ray

        from . import ray_compat

        self._actor = ray.remote(ResponseStore).options(
            name=STORE_NAME, namespace=namespace, get_if_exists=True, lifetime="detached", num_cpus=0,
            max_restarts=-1, max_task_retries=-1, **ray_compat.head_node_placement()).remote(max_responses, max_bytes)

    async def put(self, stored: StoredResponse, events: list[str] | None = None) -> None:
        await self._actor.put.remote(stored, events)

    async def get(self, response_id: str) -> StoredResponse | None:
        return await self._actor.get.remote(response_id)

    async def delete(self, response_id: str) -> bool:
        return await self._actor.delete.remote(response_id)

    async def start_background(self, stored: StoredResponse, owner: str, lease_s: float,
                               is_streamed: bool = False) -> None:
        await self._actor.start_background.remote(stored, owner, lease_s, is_streamed)

    async def renew(self, owner: str, response_ids: list[str], lease_s: float,
                    events: dict[str, tuple[int, list[str]]] | None = None) -> list[str]:
        return await self._actor.renew.remote(owner, response_ids, lease_s, events)

    async def events(self, response_id: str, after: int) -> StoredEvents | None:
        return await self._actor.events.remote(response_id, after)

    async def cancel(self, response_id: str) -> StoredResponse | None:
        return await self._actor.cancel.remote(response_id)

    async def stats(self) -> dict[str, int]:
        return await self._actor.stats.remote()

    async def conversation(self, response_id: str) -> Conversation | None:
        return await self._actor.conversation.remote(response_id)

    async def items(self, item_ids: list[str]) -> dict[str, dict[str, Any]]:
        return await self._actor.items.remote(item_ids)


class EventLog:
    """A streamed background response's events as its runner makes them (event i has
    ``sequence_number`` i), for readers in this process to follow; ``num_flushed`` of them are
    in the store."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.is_finished = False
        self.num_flushed = 0
        self._changed = asyncio.Event()

    def extend(self, events: list[str]) -> None:
        self.events += events
        self._wake()

    def finish(self) -> None:
        self.is_finished = True
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def follow(self, after: int) -> AsyncIterator[list[str]]:
        """The events after sequence number ``after``: those made, then each batch as it is made,
        until the log finishes."""
        next_index = after + 1
        while True:
            changed = self._changed
            if next_index < len(self.events):
                batch, next_index = self.events[next_index:], len(self.events)
                yield batch
            elif self.is_finished:
                return
            else:
                await changed.wait()


class BackgroundRuns:
    """The background responses this process runs (its ingress replica's), and the task that
    renews their leases in ``store`` every ``renew_s`` for ``lease_s`` more, cancelling those
    the store says were cancelled. While a streamed one runs it renews every ``flush_s``,
    sending the store its new events (``logs``) each time."""

    def __init__(self, store, lease_s: float = 5.0, renew_s: float = 1.0, flush_s: float = 0.1) -> None:
        self.store = store
        self.owner = f"replica-{uuid.uuid4().hex}"
        self.lease_s = lease_s
        self.renew_s = renew_s
        self.flush_s = flush_s
        self.tasks: dict[str, asyncio.Task] = {}
        self.logs: dict[str, EventLog] = {}
        self._renewer: asyncio.Task | None = None

    async def start(self, stored: StoredResponse, run: Callable[[], Coroutine], log: EventLog | None = None) -> None:
        """Store ``stored`` as a started background response, then run ``run()`` in a task of
        this event loop (not if storing failed: the caller says so); ``log``: a streamed one's
        events, which ``run`` writes and finishes."""
        await self.store.start_background(stored, self.owner, self.lease_s, log is not None)
        # Detached: Serve cancels the request that started the run when its client leaves, which
        # would cancel the run's own calls (its generation's, storing its last word).
        task = start_detached(asyncio.get_running_loop(), run())
        self.tasks[stored.id] = task
        if log is not None:
            self.logs[stored.id] = log
        task.add_done_callback(lambda _, response_id=stored.id: self._ended(response_id))
        if self._renewer is None or self._renewer.done():
            self._renewer = start_detached(asyncio.get_running_loop(), self._renew())

    def _ended(self, response_id: str) -> None:
        """Its run ended: its last word (every event, for a streamed one) is the store's."""
        self.tasks.pop(response_id, None)
        log = self.logs.pop(response_id, None)
        if log is not None:
            log.finish()   # a cancelled run's readers end too

    def cancel_here(self, response_id: str) -> bool:
        """Cancel ``response_id``'s task if it runs in this process."""
        task = self.tasks.get(response_id)
        if task is None:
            return False
        task.cancel()
        return True

    async def _renew(self) -> None:
        while self.tasks:
            await asyncio.sleep(self.flush_s if self.logs else self.renew_s)
            response_ids = list(self.tasks)
            if not response_ids:
                return
            flushed = {response_id: (log, len(log.events)) for response_id, log in self.logs.items()
                       if len(log.events) > log.num_flushed}
            events = {response_id: (log.num_flushed, log.events[log.num_flushed:end])
                      for response_id, (log, end) in flushed.items()}
            try:
                cancelled = await self.store.renew(self.owner, response_ids, self.lease_s, events)
            except Exception as exc:   # the store restarts: renew again; a lapsed lease is the store's verdict
                logger.warning("could not renew the leases of %d background responses: %r", len(response_ids), exc)
                continue
            for log, end in flushed.values():
                log.num_flushed = max(log.num_flushed, end)
            for response_id in cancelled:
                self.cancel_here(response_id)


def kill_response_store(namespace: str | None) -> bool:
    """End the cluster's store actor, if one runs; returns whether one did."""
    import ray

    try:
        ray.kill(ray.get_actor(STORE_NAME, namespace=namespace), no_restart=True)
    except ValueError:   # none was created
        return False
    return True


__all__ = ["ActorResponseStore", "BackgroundRuns", "Conversation", "EventLog", "LocalResponseStore", "ResponseStore",
           "StoredEvents", "StoredResponse", "kill_response_store", "STORE_NAME"]
