"""Tasks and callbacks that belong to no request.

Ray cancels the actor calls that a cancelled actor call made from its context (the task id
Ray's async actors keep in a contextvar), and Serve cancels a request whose client went away.
``asyncio`` copies the caller's context into every task and callback it starts, so work that
outlives the request that happened to start it (a channel's reader, one call for several
requests, a background response) starts from an empty context here, and its calls stay out of
that request's cancellation. Calls made after a cancellation are not affected.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable, Coroutine
from typing import Any


def start_detached(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, Any],
                   name: str | None = None) -> asyncio.Task:
    """``coro`` as a task of ``loop`` that no request's cancellation reaches."""
    return loop.create_task(coro, name=name, context=contextvars.Context())


def call_soon_detached(loop: asyncio.AbstractEventLoop, callback: Callable[..., object],
                       *args: object) -> asyncio.Handle:
    """``callback(*args)`` soon on ``loop``, outside any request's context."""
    return loop.call_soon(callback, *args, context=contextvars.Context())
