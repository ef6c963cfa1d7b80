"""A streamed response, transport-neutral: its chunks and the generation they come from.

``serving_chat`` and ``serving_completion`` return a ``ChunkStream`` when a
request asks to stream: an async iterator of the API's chunk models
(``ChatCompletionChunk``, ``CompletionResponse``) that raises ``APIError``
if the generation fails mid-way. Each transport frames the chunks its own
way (HTTP as server-sent events, gRPC as messages) and closes the stream
however it ends, which aborts what still runs and frees the request's slot.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass

from pydantic import BaseModel

from .frontend import Generation


@dataclass
class ChunkStream:
    """A streamed response: ``chunks`` (API models, in order) over ``generation``."""

    chunks: AsyncIterator[BaseModel]
    generation: Generation

    async def aclose(self) -> None:
        """Stop streaming and release the request, even if iteration never started."""
        try:
            await self.chunks.aclose()
        except RuntimeError:  # still being iterated elsewhere: closing the generation suffices
            pass
        await self.generation.aclose()


async def generation_chunks(generation: Generation, first, chunks: Callable[..., Iterable[BaseModel]]
                            ) -> AsyncIterator[BaseModel]:
    """The chunks ``chunks(prompt_index, output)`` makes of every output, ``first`` (what
    ``Frontend.start_generation`` returned) first; the generation is closed however it ends."""
    try:
        if first is not None:
            for chunk in chunks(*first):
                yield chunk
            async for index, output in generation:
                for chunk in chunks(index, output):
                    yield chunk
    finally:
        await generation.aclose()
