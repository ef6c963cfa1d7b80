"""Waiting in tests for what a cluster does in its own time."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def wait_for(predicate: Callable[[], Any], timeout_s: float = 60.0, what: str = "the condition",
             describe: Callable[[], Any] | None = None, *, interval_s: float = 0.2,
             tolerate: tuple[type[BaseException], ...] = ()) -> Any:
    """Poll ``predicate`` every ``interval_s`` until it returns something truthy, and return that.
    An exception of a ``tolerate`` type counts as not yet (an actor still restarting). A timeout
    raises an AssertionError that names ``what``, the last such exception, and ``describe()``
    (the state waited on), so a failure says where the cluster stood."""
    deadline = time.monotonic() + timeout_s
    last_error: BaseException | None = None
    while True:
        try:
            value = predicate()
            if value:
                return value
        except tolerate as exc:
            last_error = exc
        if time.monotonic() >= deadline:
            error = f" (last error: {last_error!r})" if last_error is not None else ""
            state = f"; last state: {describe()!r}" if describe is not None else ""
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}{error}{state}")
        time.sleep(interval_s)
