"""Calls to one actor method, batched: what is asked in one turn of an event loop, or while
the previous call is being answered, goes in one Ray call.

A Ray actor call costs the caller and the callee each about a millisecond of CPU. A
replica that starts dozens of requests at once (a burst) would make as many calls to a
worker to submit them, and as many to the central KV manager to route them; ``TurnBatch``
sends them together and gives each asker its own answer. Calls go one at a time: the first
ask goes out at the end of its turn; what is asked while a call is out waits for its answer
(about a round trip) and goes in the next. Over HTTP, where each request starts in a turn of
its own, that wait is what gathers a burst into a few calls.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable

from .detached import call_soon_detached


class TurnBatch:
    """``ask(item)``: a future of ``item``'s answer. The items asked together (see the module)
    go to ``send(items)``, which makes the remote call and returns its ObjectRef (or any
    awaitable): a list with an answer per item, in order; an answer that is an exception is
    raised to its asker. If the call fails, every asker of the batch gets its error."""

    def __init__(self, loop: asyncio.AbstractEventLoop, send: Callable[[list], Any]) -> None:
        self.loop = loop
        self._send = send
        self._asked: list[tuple[Any, asyncio.Future]] = []
        self._is_flush_due = False   # a flush is scheduled, or a call is out
        self._answering: asyncio.Task | None = None
        self.num_calls = 0

    def ask(self, item) -> asyncio.Future:
        """The answer to ``item``, once the batch it goes with is answered. Cancelling the future
        before the batch goes out leaves ``item`` out of it."""
        future = self.loop.create_future()
        self._asked.append((item, future))
        if not self._is_flush_due:
            self._is_flush_due = True
            self._flush_soon()
        return future

    def _flush_soon(self) -> None:
        # Detached: one asker's cancellation must not cancel the others' call.
        call_soon_detached(self.loop, self._flush)

    def _flush(self) -> None:
        asked = [(item, future) for item, future in self._asked if not future.done()]
        self._asked = []
        if not asked:
            self._is_flush_due = False
            return
        futures = [future for _, future in asked]
        try:
            answers = self._send([item for item, _ in asked])
        except Exception as exc:  # the call could not be made (its actor is gone, say)
            _settle(futures, exc)
            self._next()
            return
        self.num_calls += 1
        # Kept: the loop holds its tasks weakly.
        self._answering = self.loop.create_task(self._settle_when_answered(answers, futures))

    async def _settle_when_answered(self, answers, futures: list[asyncio.Future]) -> None:
        try:
            result = await answers
        except Exception as exc:  # the actor died, or raised for the whole batch
            _settle(futures, exc)
        else:
            for future, answer in zip(futures, result):
                _settle([future], answer)
        finally:
            self._next()

    def _next(self) -> None:
        """The call is answered: what was asked meanwhile goes now."""
        if self._asked:
            self._flush_soon()
        else:
            self._is_flush_due = False


def _settle(futures: list[asyncio.Future], answer) -> None:
    """Give each future still waiting ``answer``: its result, or its error when it is one."""
    for future in futures:
        if future.done():  # its asker was cancelled or timed out meanwhile
            continue
        if isinstance(answer, BaseException):
            future.set_exception(answer)
        else:
            future.set_result(answer)
