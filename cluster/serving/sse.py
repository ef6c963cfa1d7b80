"""Server-sent events: how the HTTP transport frames a ``ChunkStream``.

Every chunk is one ``data:`` event with the chunk as JSON, and the stream
ends with ``data: [DONE]``; a stream of named events (the Responses API's)
comes whole, failure included, and ends without it. The chunks of one output go out as one body (one
write per stream per step). A failure mid-stream becomes an error event in
OpenAI's error shape (the status line was already sent), then ``[DONE]``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from pydantic import BaseModel

from .errors import APIError
from .streaming import ChunkStream

DONE = "data: [DONE]\n\n"


def sse(payload: BaseModel | dict) -> str:
    """One event carrying ``payload`` as JSON."""
    text = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {text}\n\n"


class EventStream:
    """A ``ChunkStream`` as SSE bodies (``lines``: one per output); ``aclose`` releases the request."""

    def __init__(self, stream: ChunkStream) -> None:
        self.stream = stream
        self.lines: AsyncIterator[str] = self._lines()

    async def _lines(self) -> AsyncIterator[str]:
        stream = self.stream
        error_event = stream.error_event   # set: named events, whole
        try:
            async for batch in stream.batches(as_json=True):
                yield "".join(batch) if error_event else "data: " + "\n\ndata: ".join(batch) + "\n\n"
        except APIError as exc:
            yield error_event(exc) if error_event else sse(exc.body())
        finally:
            await stream.aclose()
        if error_event is None:
            yield DONE

    async def aclose(self) -> None:
        """Stop streaming and release the request, even if iteration never started."""
        try:
            await self.lines.aclose()
        except RuntimeError:  # still being iterated elsewhere: closing the stream suffices
            pass
        await self.stream.aclose()
