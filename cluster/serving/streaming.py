"""A streamed response, transport-neutral: its chunks and the generation they come from.

``serving_chat`` and ``serving_completion`` return a ``ChunkStream`` when a
request asks to stream. Its ``batches`` yield, for each output of the
generation, the chunks that output makes as one list (so that a transport can
write them at once): the API's chunk models (``CompletionResponse``,
``ChatCompletionChunk``), or their JSON text (``chunks``); they raise
``APIError`` if the generation fails mid-way. Each transport frames the chunks
its own way (HTTP as server-sent events, gRPC as messages) and closes the
stream however it ends, which aborts what still runs and frees the request's
slot.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable

from pagedserve.workers.outputs.request_output import RequestOutput

from .errors import APIError
from .frontend import Generation


class ChunkStream:
    """A streamed response over ``generation``; ``make_batches(as_json)`` starts its chunks.
    Without a generation, it reads what another task generates (a background response's
    events): closing it stops the reading alone."""

    def __init__(self, make_batches: Callable[[bool], AsyncIterator[list]], generation: Generation | None,
                 error_event: Callable[[APIError], str] | None = None) -> None:
        self._make_batches = make_batches
        self._batches: AsyncIterator[list] | None = None
        self.generation = generation
        # Set for a stream of named events (the Responses API's, HTTP only): its chunks are whole
        # server-sent events, this makes the event of a failure, and no [DONE] follows them.
        self.error_event = error_event

    def batches(self, as_json: bool = False) -> AsyncIterator[list]:
        """The chunks, one list per output (in order): the API's models, or with ``as_json``
        their JSON text. Read once."""
        if self._batches is not None:
            raise RuntimeError("a stream's chunks are read once")
        self._batches = self._make_batches(as_json)
        return self._batches

    async def aclose(self) -> None:
        """Stop streaming and release the request, even if iteration never started."""
        if self._batches is not None:
            try:
                await self._batches.aclose()
            except RuntimeError:  # still being iterated elsewhere: closing the generation suffices
                pass
        if self.generation is not None:
            await self.generation.aclose()


async def generation_batches(generation: Generation, first, chunks: Callable[[int, RequestOutput], list],
                             last: Callable[[], list | Awaitable[list]]) -> AsyncIterator[list]:
    """The chunks ``chunks(prompt_index, output)`` makes of every output, one list per output
    that makes any, ``first`` (what ``Frontend.start_generation`` returned) first, then
    ``last()``'s (awaited, if it is a coroutine) if any; the generation is closed however it ends."""
    try:
        if first is not None:
            batch = chunks(*first)
            if batch:
                yield batch
            async for index, output in generation:
                batch = chunks(index, output)
                if batch:
                    yield batch
    finally:
        await generation.aclose()
    batch = last()
    if inspect.isawaitable(batch):
        batch = await batch
    if batch:
        yield batch
