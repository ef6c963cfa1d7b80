"""``TurnBatch``: what is asked in one turn of an event loop, or while a call is out, goes out as
one call; each asker gets its own answer or error, a cancelled asker is left out, and a failed
call fails its batch alone.
The remote side is a coroutine here; ``test_distributed.py`` runs it against Ray actors."""

from __future__ import annotations

import asyncio

import pytest

from pagedserve.cluster.turn_batch import TurnBatch


class _Remote:
    """Answers each item with its square, a ``ValueError`` for negative ones; records each call."""

    def __init__(self, fail_with: Exception | None = None) -> None:
        self.calls: list[list[int]] = []
        self.fail_with = fail_with

    def send(self, items: list[int]):
        self.calls.append(list(items))
        return self._answer(items)

    async def _answer(self, items: list[int]):
        await asyncio.sleep(0)
        if self.fail_with is not None:
            raise self.fail_with
        return [ValueError(f"negative {i}") if i < 0 else i * i for i in items]


def test_items_asked_in_one_turn_go_in_one_call_and_each_gets_its_answer():
    async def main():
        remote = _Remote()
        batch = TurnBatch(asyncio.get_running_loop(), remote.send)
        first = [batch.ask(i) for i in (1, 2, -3, 4)]
        assert remote.calls == []   # nothing goes before the turn ends
        results = await asyncio.gather(*first, return_exceptions=True)
        later = await batch.ask(5)
        return remote.calls, results, later, batch.num_calls

    calls, results, later, num_calls = asyncio.run(main())
    assert calls == [[1, 2, -3, 4], [5]] and num_calls == 2
    assert results[:2] == [1, 4] and results[3] == 16
    assert isinstance(results[2], ValueError) and "negative -3" in str(results[2])
    assert later == 25


def test_tasks_that_ask_in_the_same_turn_share_a_call():
    async def main():
        remote = _Remote()
        batch = TurnBatch(asyncio.get_running_loop(), remote.send)

        async def asker(i):
            return await batch.ask(i)

        answers = await asyncio.gather(*(asker(i) for i in range(20)))
        return remote.calls, answers

    calls, answers = asyncio.run(main())
    assert answers == [i * i for i in range(20)]
    assert calls == [list(range(20))]


def test_an_asker_cancelled_before_the_call_is_left_out():
    async def main():
        remote = _Remote()
        batch = TurnBatch(asyncio.get_running_loop(), remote.send)
        kept, dropped = batch.ask(2), batch.ask(3)
        dropped.cancel()
        return await kept, remote.calls

    answer, calls = asyncio.run(main())
    assert answer == 4 and calls == [[2]]


def test_a_call_that_fails_fails_its_batch_alone():
    async def main():
        remote = _Remote(fail_with=ConnectionError("the actor died"))
        batch = TurnBatch(asyncio.get_running_loop(), remote.send)
        failed = await asyncio.gather(batch.ask(1), batch.ask(2), return_exceptions=True)
        remote.fail_with = None
        return failed, await batch.ask(3)

    failed, after = asyncio.run(main())
    assert all(isinstance(e, ConnectionError) for e in failed)
    assert after == 9


def test_a_call_that_cannot_be_made_fails_its_askers():
    def send(items):
        raise RuntimeError("no such actor")

    async def main():
        batch = TurnBatch(asyncio.get_running_loop(), send)
        return await asyncio.gather(batch.ask(1), batch.ask(2), return_exceptions=True), batch.num_calls

    errors, num_calls = asyncio.run(main())
    assert [type(e) for e in errors] == [RuntimeError, RuntimeError] and num_calls == 0


def test_the_call_is_made_outside_the_askers_context():
    """Ray cancels the calls made from a cancelled task's context: the shared call must belong to none."""
    import contextvars

    marker = contextvars.ContextVar("marker", default=None)
    seen = []

    async def main():
        def send(items):
            seen.append(marker.get())
            return asyncio.sleep(0, result=list(items))

        batch = TurnBatch(asyncio.get_running_loop(), send)

        async def asker():
            marker.set("asker")
            return await batch.ask(7)

        return await asyncio.create_task(asker())

    assert asyncio.run(main()) == 7
    assert seen == [None]


def test_a_timed_out_asker_does_not_disturb_the_others():
    async def main():
        remote = _Remote()
        batch = TurnBatch(asyncio.get_running_loop(), remote.send)
        waiting = batch.ask(6)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(batch.ask(5), timeout=0)
        return await waiting, remote.calls

    answer, calls = asyncio.run(main())
    assert answer == 36 and calls == [[6]]


def test_what_is_asked_while_a_call_is_out_goes_in_the_next_one_when_it_is_answered():
    """Requests that start in turns of their own (HTTP) still share calls: one call at a time."""
    async def main():
        calls, release = [], asyncio.Event()

        def send(items):
            calls.append(list(items))

            async def answer():
                if len(calls) == 1:
                    await release.wait()
                return [i * 10 for i in items]
            return answer()

        batch = TurnBatch(asyncio.get_running_loop(), send)
        first = batch.ask(1)
        await asyncio.sleep(0)
        await asyncio.sleep(0)          # the first call is out, unanswered
        waiting = []
        for i in (2, 3, 4):              # each in a turn of its own
            waiting.append(batch.ask(i))
            await asyncio.sleep(0)
        assert calls == [[1]]
        release.set()
        answers = [await first] + [await f for f in waiting]
        alone = await batch.ask(5)       # nothing out: it goes at once
        return calls, answers, alone

    calls, answers, alone = asyncio.run(main())
    assert calls == [[1], [2, 3, 4], [5]]
    assert answers == [10, 20, 30, 40] and alone == 50
