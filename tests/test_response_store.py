"""The store of the Responses API's stored responses: least-recently-used room (by count and by
size), deletion, and conversations followed through ``previous_response_id``, against a plain
model of each.

Random sequences of operations (hypothesis's state machine) check it against a list kept in
use order, each response's size summed beside it; the conversation is checked against the chain
walked by hand. Ids are reused, as a
client's ``request_id`` may reuse one, so chains may loop: the store must still answer.
"""

from __future__ import annotations

import json
import time

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from pagedserve.cluster.response_store import (Conversation, EventLog, ResponseStore, StoredEvents, StoredResponse,
                                               stored_size)

IDS = [f"resp_{n}" for n in range(8)]
MAX_BYTES = 1200   # a response below is 230-260 characters, and up to 500 more of text


def stored(response_id: str, previous: str | None = None, text: str = "") -> StoredResponse:
    """A response with an input item and an output item of its own, and an input item that every
    response holds (``shared``, as an item sent back with its id), telling which holds it."""
    return StoredResponse({"id": response_id, "output": [{"type": "message", "id": f"out_{response_id}",
                                                          "text": text}]},
                          [{"type": "message", "id": f"in_{response_id}"},
                           {"type": "message", "id": "shared", "in": response_id}], previous)


def test_a_response_counts_the_characters_of_its_json_and_its_events():
    record = stored("a", text="é" * 10)
    size = len(json.dumps(record.response)) + len(json.dumps(record.input_items))
    assert stored_size(record) == size and stored_size(record, ["ab", "cde"]) == size + 5
    assert stored_size(stored("a", text="x" * 100)) == stored_size(stored("a")) + 100


class StoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.store = ResponseStore(max_responses=4, max_bytes=MAX_BYTES)
        self.order: list[str] = []                 # least recently used first
        self.records: dict[str, StoredResponse] = {}
        self.sizes: dict[str, int] = {}
        self.stored_order: list[str] = []         # the order they were last stored in

    def _use(self, response_id: str) -> None:
        self.order.remove(response_id)
        self.order.append(response_id)

    @rule(response_id=st.sampled_from(IDS), previous=st.none() | st.sampled_from(IDS),
          length=st.sampled_from([0, 0, 100, 300, 500, 1500]))
    def put(self, response_id, previous, length):
        record = stored(response_id, previous, "x" * length)
        self.store.put(record)
        if response_id in self.order:
            self.order.remove(response_id)
        self.order.append(response_id)
        self.records[response_id] = record
        self.sizes[response_id] = stored_size(record)
        if response_id in self.stored_order:
            self.stored_order.remove(response_id)
        self.stored_order.append(response_id)
        # Forget the least recently used beyond 4 or MAX_BYTES; the one just stored stays.
        while len(self.order) > 1 and (len(self.order) > 4 or sum(self.sizes.values()) > MAX_BYTES):
            forgotten = self.order.pop(0)
            del self.records[forgotten], self.sizes[forgotten]

    @rule(response_id=st.sampled_from(IDS))
    def get(self, response_id):
        assert self.store.get(response_id) is self.records.get(response_id)
        if response_id in self.order:
            self._use(response_id)

    @rule(response_id=st.sampled_from(IDS))
    def delete(self, response_id):
        assert self.store.delete(response_id) == (response_id in self.records)
        if response_id in self.records:
            self.order.remove(response_id)
            del self.records[response_id], self.sizes[response_id]

    @rule(response_id=st.sampled_from(IDS))
    def conversation(self, response_id):
        got = self.store.conversation(response_id)
        if response_id not in self.records:
            assert got is None
            return
        chain, next_id, seen = [], response_id, set()
        while next_id is not None and next_id in self.records and next_id not in seen:
            seen.add(next_id)
            chain.append(self.records[next_id])
            next_id = self.records[next_id].previous_response_id
        for record in chain:   # every response walked counts as used
            self._use(record.id)
        if next_id is not None:   # gone, or met again (a replaced response made a loop)
            assert got == Conversation(missing=next_id)
        else:
            expected = [item for record in reversed(chain) for item in record.input_items + record.response["output"]]
            assert got == Conversation(expected)

    @rule(item_ids=st.lists(st.sampled_from([f"{side}_{i}" for side in ("in", "out") for i in IDS] + ["shared"]),
                            max_size=4))
    def items(self, item_ids):
        got = self.store.items(item_ids)
        expected = {}
        for item_id in item_ids:
            if item_id in expected:
                continue
            if item_id == "shared":   # the one stored last of those still stored
                holder = next((r for r in reversed(self.stored_order) if r in self.records), None)
            else:
                holder = item_id.partition("_")[2]
            if holder in self.records:
                expected[item_id] = next(item for item in self.records[holder].items() if item["id"] == item_id)
                self._use(holder)
        assert got == expected

    @invariant()
    def holds_what_the_model_holds(self):
        figures = self.store.stats()
        assert figures["num_stored"] == len(self.order) <= 4
        assert list(self.store._responses) == self.order
        assert figures["num_bytes"] == sum(self.sizes.values())
        assert figures["num_bytes"] <= MAX_BYTES or len(self.order) == 1


TestStoreMachine = StoreMachine.TestCase
TestStoreMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_a_chain_of_three_is_its_items_in_order_and_a_gap_names_the_missing():
    store = ResponseStore(max_responses=10)
    store.put(stored("a"))
    store.put(stored("b", "a"))
    store.put(stored("c", "b"))
    assert [item["id"] for item in store.conversation("c").items] == [
        "in_a", "shared", "out_a", "in_b", "shared", "out_b", "in_c", "shared", "out_c"]
    store.delete("a")
    assert store.conversation("c") == Conversation(missing="a")
    assert store.conversation("a") is None
    store.put(stored("a", "c"))   # a reused id: a -> c -> b -> a
    assert store.conversation("a") == Conversation(missing="a")


def test_room_must_hold_one():
    with pytest.raises(ValueError, match="max_responses must be at least 1"):
        ResponseStore(0)
    with pytest.raises(ValueError, match="max_bytes must be at least 1"):
        ResponseStore(1, max_bytes=0)


# ---- background responses: leases, cancels --------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def running(response_id: str) -> StoredResponse:
    return StoredResponse({"id": response_id, "status": "in_progress", "background": True, "output": []}, [])


def finished_as(response_id: str, status: str = "completed") -> StoredResponse:
    return StoredResponse({"id": response_id, "status": status, "background": True, "output": []}, [])


def test_a_background_response_whose_lease_lapses_fails_and_one_renewed_runs_on():
    clock = Clock()
    store = ResponseStore(10, clock=clock)
    store.start_background(running("a"), "replica-1", lease_s=5)
    store.start_background(running("b"), "replica-2", lease_s=5)
    clock.now += 4
    assert store.renew("replica-1", ["a", "b"], lease_s=5) == []   # b is not replica-1's to renew
    clock.now += 2
    assert store.get("b").response["status"] == "failed" and "stopped" in store.get("b").response["error"]["message"]
    assert store.get("a").response["status"] == "in_progress"
    store.put(finished_as("a"))
    clock.now += 60
    assert store.get("a").response["status"] == "completed" and store.stats()["num_running"] == 0


def test_a_cancel_is_at_once_in_the_store_and_told_to_the_runner_once():
    store = ResponseStore(10, clock=Clock())
    store.start_background(running("a"), "replica-1", lease_s=5)
    assert store.cancel("a").response["status"] == "cancelled"
    assert store.cancel("a").response["status"] == "cancelled"   # idempotent
    assert store.renew("replica-1", ["a"], lease_s=5) == ["a"]
    assert store.renew("replica-1", ["a"], lease_s=5) == []
    store.put(finished_as("a"))                                    # the runner's last word comes too late
    assert store.get("a").response["status"] == "cancelled"
    store.put(finished_as("done"))
    assert store.cancel("done").response["status"] == "completed"  # finished: unchanged
    assert store.cancel("unknown") is None


def test_a_running_response_deleted_is_aborted_and_not_brought_back():
    store = ResponseStore(10, clock=Clock())
    store.start_background(running("a"), "replica-1", lease_s=5)
    assert store.delete("a") is True
    assert store.renew("replica-1", ["a"], lease_s=5) == ["a"]
    store.put(finished_as("a"))
    assert store.get("a") is None


def test_a_streamed_background_response_keeps_its_events_as_its_runner_sends_them():
    store = ResponseStore(2, clock=Clock())
    store.start_background(running("a"), "replica-1", lease_s=5, is_streamed=True)
    store.start_background(running("b"), "replica-1", lease_s=5)
    assert store.events("a", -1) == StoredEvents([], "in_progress") and store.events("b", -1).events is None
    store.renew("replica-1", ["a"], lease_s=5, events={"a": (0, ["e0", "e1"])})
    store.renew("replica-1", ["a"], lease_s=5, events={"a": (1, ["e1", "e2"])})   # sent again, from e1
    store.renew("replica-2", ["a"], lease_s=5, events={"a": (3, ["x"])})          # not the runner
    store.renew("replica-1", ["a"], lease_s=5, events={"a": (9, ["gap"])})        # not next: dropped
    assert store.events("a", 0) == StoredEvents(["e1", "e2"], "in_progress")
    store.put(finished_as("a"), ["e0", "e1", "e2", "e3"])
    page = store.events("a", 1)
    assert page == StoredEvents(["e2", "e3"], "completed") and page.is_finished
    store.renew("replica-1", ["a"], lease_s=5, events={"a": (4, ["late"])})       # its lease ended
    assert store.events("a", -1).events == ["e0", "e1", "e2", "e3"]
    store.put(stored("c"))   # room for two: a goes with its events (b still runs, so it stays), then c
    store.put(stored("d"))
    assert store.events("a", -1) is None and store._events == {}
    assert [response_id for response_id in store._responses] == ["b", "d"]


def test_a_running_response_stays_while_its_events_outgrow_the_room_and_goes_once_finished():
    size = stored_size(running("a"))
    store = ResponseStore(10, max_bytes=size * 3, clock=Clock())
    store.put(finished_as("old"))
    store.start_background(running("a"), "replica-1", lease_s=5, is_streamed=True)
    assert store.stats()["num_bytes"] == stored_size(finished_as("old")) + size
    store.renew("replica-1", ["a"], lease_s=5, events={"a": (0, ["e" * size])})
    assert store.stats()["num_bytes"] == stored_size(finished_as("old")) + 2 * size
    store.renew("replica-1", ["a"], lease_s=5, events={"a": (0, ["e" * size, "f" * size])})   # sent again, and more
    assert store.get("old") is None and store.stats()["num_bytes"] == 3 * size   # over the room: old goes
    store.start_background(running("b"), "replica-1", lease_s=5)   # b is the one used last, a still runs
    assert store.stats()["num_stored"] == 2 and store.stats()["num_bytes"] == 4 * size > store.max_bytes
    store.put(finished_as("a"), ["e" * size, "f" * size])   # a finished is used last now, so b (running) stays
    assert list(store._responses) == ["b", "a"]
    store.put(finished_as("b"))   # b finished: a, the least recently used, goes
    assert list(store._responses) == ["b"] and store.stats()["num_bytes"] == stored_size(finished_as("b"))


async def _follow(log: EventLog, after: int, into: list) -> None:
    async for batch in log.follow(after):
        into.append(batch)


def test_an_event_log_is_followed_from_any_event_until_it_finishes():
    import asyncio

    async def run():
        log = EventLog()
        log.extend(["e0", "e1"])
        early, late = [], []
        readers = [asyncio.create_task(_follow(log, -1, early)), asyncio.create_task(_follow(log, 0, late))]
        await asyncio.sleep(0)
        log.extend(["e2"])
        await asyncio.sleep(0)
        log.extend(["e3", "e4"])
        log.finish()
        await asyncio.wait_for(asyncio.gather(*readers), 5)
        return early, late, [batch async for batch in log.follow(3)]
    early, late, after_the_end = asyncio.run(run())
    assert early == [["e0", "e1"], ["e2"], ["e3", "e4"]] and late == [["e1"], ["e2"], ["e3", "e4"]]
    assert after_the_end == [["e4"]]


def test_replicas_share_one_store_actor_and_the_cluster_ends_it(local_ray):
    """Two replicas' clients reach one actor (the second finds the first's by name), and what one
    stores the other reads, a streamed background response's events and items too;
    ``kill_response_store`` (the handle's shutdown) ends it."""
    import asyncio

    from pagedserve.cluster.response_store import ActorResponseStore, kill_response_store

    async def run():
        first, second = ActorResponseStore("pagedserve-test", 10), ActorResponseStore("pagedserve-test", 99)
        await first.put(stored("a"))
        await first.start_background(running("b"), "replica-1", 30, is_streamed=True)
        await first.renew("replica-1", ["b"], 30, {"b": (0, ["e0", "e1"])})
        return (await second.get("a"), await second.stats(), await second.events("b", 0),
                await second.items(["in_a", "nothing"]))
    got, figures, events, items = asyncio.run(run())
    assert got == stored("a") and figures["max_responses"] == 10   # the first one's room
    assert events == StoredEvents(["e1"], "in_progress") and items == {"in_a": stored("a").input_items[0]}
    assert kill_response_store("pagedserve-test") is True
    deadline = time.monotonic() + 30
    while _store_is_named() and time.monotonic() < deadline:   # the name goes once the actor has ended
        time.sleep(0.1)
    assert kill_response_store("pagedserve-test") is False


def _store_is_named() -> bool:
    import ray

    from pagedserve.cluster.response_store import STORE_NAME

    try:
        ray.get_actor(STORE_NAME, namespace="pagedserve-test")
    except ValueError:
        return False
    return True


def test_a_background_run_outlives_the_cancelled_call_that_started_it(local_ray):
    """Serve cancels a request whose client left, and Ray then cancels the calls made from that
    request's context: a background run the request started makes its calls (its last word to
    the store) from a context of its own, so they are answered."""
    import ray

    @ray.remote
    class Slow:
        async def answer(self) -> str:
            import asyncio

            await asyncio.sleep(1.0)
            return "answered"

    @ray.remote
    class Replica:
        def __init__(self, slow) -> None:
            from pagedserve.cluster.response_store import BackgroundRuns, LocalResponseStore, StoredResponse

            self.slow = slow
            self.runs = BackgroundRuns(LocalResponseStore(10))
            self.outcome = None

        async def request(self) -> None:
            import asyncio

            async def run() -> None:
                self.outcome = "asked"
                try:
                    self.outcome = await self.slow.answer.remote()
                except Exception as exc:
                    self.outcome = repr(exc)
            await self.runs.start(StoredResponse({"id": "bg", "status": "in_progress", "background": True,
                                                  "output": []}, []), run)
            await asyncio.sleep(60)   # a stream the client follows, until it leaves

        def outcome_of_run(self):
            return self.outcome

    replica = Replica.remote(Slow.remote())
    request = replica.request.remote()
    deadline = time.monotonic() + 60
    while ray.get(replica.outcome_of_run.remote()) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    ray.cancel(request)   # while the run's call is out: Slow answers after a second
    with pytest.raises(ray.exceptions.TaskCancelledError):
        ray.get(request, timeout=30)
    while ray.get(replica.outcome_of_run.remote()) == "asked" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ray.get(replica.outcome_of_run.remote()) == "answered"
