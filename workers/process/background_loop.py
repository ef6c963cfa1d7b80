"""A daemon thread that calls one function at an interval until it is stopped: the cluster's
controller, health monitor and worker pool, and a worker's KV event sender, each run one.

It lives with the workers (the lowest layer that runs such threads); ``cluster/`` imports it."""

from __future__ import annotations

import logging
import threading
from typing import Callable

logger = logging.getLogger("pagedserve.background")


class BackgroundLoop:
    """Calls ``tick()`` every ``interval_s`` seconds in a daemon thread named ``name``.

    ``start`` is idempotent (a running loop is left alone) and may follow ``stop``.
    ``stop`` returns once the thread has ended, or after ``join_timeout_s`` if a tick
    is still running (at once when a tick itself calls it). A tick that raises is
    logged and the loop goes on: the next tick tries again. With ``tick_at_start``
    the first tick runs at once, otherwise after one interval.

    ``interval_s`` may be a function, asked before each wait (a schedule that moves).
    With ``wakeup``, an event others set when there is work, the next tick comes as soon
    as it is set, and at the latest after the interval.
    """

    def __init__(self, name: str, tick: Callable[[], None], interval_s: float | Callable[[], float],
                 tick_at_start: bool = False, join_timeout_s: float = 5.0,
                 wakeup: threading.Event | None = None) -> None:
        self.name = name
        self.tick = tick
        self.interval_s = interval_s
        self.tick_at_start = tick_at_start
        self.join_timeout_s = join_timeout_s
        self.wakeup = wakeup
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def is_running(self) -> bool:
        thread = self._thread
        return thread is not None and thread.is_alive()

    def start(self) -> None:
        with self._lock:
            if self.is_running:
                return
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self.wakeup is not None:
            self.wakeup.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=self.join_timeout_s)

    def _run(self) -> None:
        if self.tick_at_start:
            self._tick()
        while not self._wait():
            self._tick()

    def _wait(self) -> bool:
        """Wait for the next tick; True once stopped."""
        interval_s = self.interval_s() if callable(self.interval_s) else self.interval_s
        if self.wakeup is None:
            return self._stop.wait(interval_s)
        self.wakeup.wait(interval_s)
        self.wakeup.clear()
        return self._stop.is_set()

    def _tick(self) -> None:
        try:
            self.tick()
        except Exception:  # never let the loop die
            logger.exception("%s: tick failed; the next one tries again", self.name)
