"""A daemon thread that calls one function at a fixed interval until it is stopped."""

from __future__ import annotations

import logging
import threading
from typing import Callable

logger = logging.getLogger("pagedserve.cluster")


class BackgroundLoop:
    """Calls ``tick()`` every ``interval_s`` seconds in a daemon thread named ``name``.

    ``start`` is idempotent (a running loop is left alone) and may follow ``stop``.
    ``stop`` returns once the thread has ended, or after ``join_timeout_s`` if a tick
    is still running. A tick that raises is logged and the loop goes on: the next
    tick tries again. With ``tick_at_start`` the first tick runs at once, otherwise
    after one interval.
    """

    def __init__(self, name: str, tick: Callable[[], None], interval_s: float, tick_at_start: bool = False,
                 join_timeout_s: float = 5.0) -> None:
        self.name = name
        self.tick = tick
        self.interval_s = interval_s
        self.tick_at_start = tick_at_start
        self.join_timeout_s = join_timeout_s
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
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=self.join_timeout_s)

    def _run(self) -> None:
        if self.tick_at_start:
            self._tick()
        while not self._stop.wait(self.interval_s):
            self._tick()

    def _tick(self) -> None:
        try:
            self.tick()
        except Exception:  # never let the loop die
            logger.exception("%s: tick failed; the next one tries again", self.name)
