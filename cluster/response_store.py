"""Stored responses of the Responses API, one store for the whole cluster.

With ``server.store_responses`` on, a finished response (``store`` left out or true) is kept
here: ``GET``/``DELETE /v1/responses/{id}`` and ``.../input_items`` read it, and a later
request's ``previous_response_id`` continues its conversation. Every ingress replica must see
every stored response (a client's next request may reach another replica), so the store is
one named actor (``response_store``), created by the first replica that needs it and ended
with the cluster (``kill_response_store``). Its calls happen once per response, never per
token: the replica awaits the store's copy before the response (or its last event) goes out,
so a follow-up naming it finds it, whichever replica takes it.

The store keeps ``max_responses`` and forgets the least recently used beyond them; a
conversation whose earlier response was forgotten or deleted cannot be continued, and says
which response is missing. What is stored lives in the actor's memory: it does not survive
the actor's restart.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

STORE_NAME = "pagedserve-response-store"


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


@dataclass
class Conversation:
    """The items a response's conversation holds up to its output (``items``), oldest first;
    or, when an earlier response of it is no longer stored, that response's id (``missing``)."""

    items: list[dict[str, Any]] = field(default_factory=list)
    missing: str | None = None


class ResponseStore:
    """Stored responses by id, the least recently used forgotten beyond ``max_responses``."""

    def __init__(self, max_responses: int) -> None:
        if max_responses < 1:
            raise ValueError(f"max_responses must be at least 1, not {max_responses}")
        self.max_responses = max_responses
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()
        self.num_evicted = 0

    def put(self, stored: StoredResponse) -> None:
        self._responses[stored.id] = stored
        self._responses.move_to_end(stored.id)
        while len(self._responses) > self.max_responses:
            self._responses.popitem(last=False)
            self.num_evicted += 1

    def get(self, response_id: str) -> StoredResponse | None:
        stored = self._responses.get(response_id)
        if stored is not None:
            self._responses.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> bool:
        return self._responses.pop(response_id, None) is not None

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
            items += stored.input_items
            items += stored.response.get("output", [])
        return Conversation(items)

    def stats(self) -> dict[str, int]:
        return {"num_stored": len(self._responses), "max_responses": self.max_responses,
                "num_evicted": self.num_evicted}


class LocalResponseStore:
    """A ``ResponseStore`` in this process, behind the awaitable calls the frontend makes."""

    def __init__(self, max_responses: int) -> None:
        self.store = ResponseStore(max_responses)

    async def put(self, stored: StoredResponse) -> None:
        self.store.put(stored)

    async def get(self, response_id: str) -> StoredResponse | None:
        return self.store.get(response_id)

    async def delete(self, response_id: str) -> bool:
        return self.store.delete(response_id)

    async def conversation(self, response_id: str) -> Conversation | None:
        return self.store.conversation(response_id)


class ActorResponseStore:
    """The cluster's store actor (named ``STORE_NAME`` in ``namespace``; created with room for
    ``max_responses`` if none runs yet), behind the same awaitable calls."""

    def __init__(self, namespace: str | None, max_responses: int) -> None:
        import ray

        from . import ray_compat

        self._actor = ray.remote(ResponseStore).options(
            name=STORE_NAME, namespace=namespace, get_if_exists=True, lifetime="detached", num_cpus=0,
            max_restarts=-1, max_task_retries=-1, **ray_compat.head_node_placement()).remote(max_responses)

    async def put(self, stored: StoredResponse) -> None:
        await self._actor.put.remote(stored)

    async def get(self, response_id: str) -> StoredResponse | None:
        return await self._actor.get.remote(response_id)

    async def delete(self, response_id: str) -> bool:
        return await self._actor.delete.remote(response_id)

    async def conversation(self, response_id: str) -> Conversation | None:
        return await self._actor.conversation.remote(response_id)


def kill_response_store(namespace: str | None) -> bool:
    """End the cluster's store actor, if one runs; returns whether one did."""
    import ray

    try:
        ray.kill(ray.get_actor(STORE_NAME, namespace=namespace), no_restart=True)
    except ValueError:   # none was created
        return False
    return True


__all__ = ["ActorResponseStore", "Conversation", "LocalResponseStore", "ResponseStore", "StoredResponse",
           "kill_response_store", "STORE_NAME"]
