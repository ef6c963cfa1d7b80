"""Server-sent events: the framing and a streamed response's lifetime.

``stream_events`` turns a ``Generation`` into SSE lines through a per-API
``chunks(prompt_index, output)`` function; a failure mid-stream becomes an
error event (the status line was already sent), and the generation is closed
however the stream ends.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass

from pydantic import BaseModel

from .errors import APIError
from .frontend import Generation

DONE = "data: [DONE]\n\n"


def sse(payload: BaseModel | dict) -> str:
    """One event carrying ``payload`` as JSON."""
    text = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {text}\n\n"


@dataclass
class EventStream:
    """A streamed response: its SSE lines and the generation they come from."""

    lines: AsyncIterator[str]
    generation: Generation

    async def aclose(self) -> None:
        """Stop streaming and release the request, even if iteration never started."""
        try:
            await self.lines.aclose()
        except RuntimeError:  # still being iterated elsewhere: closing the generation suffices
            pass
        await self.generation.aclose()


async def stream_events(generation: Generation, first, chunks: Callable[..., Iterable[str]]
                        ) -> AsyncIterator[str]:
    """SSE lines for every output; a failure mid-stream becomes an error event."""
    try:
        if first is not None:
            for line in chunks(*first):
                yield line
            async for index, output in generation:
                for line in chunks(index, output):
                    yield line
    except APIError as exc:
        yield sse(exc.body())
    finally:
        await generation.aclose()
