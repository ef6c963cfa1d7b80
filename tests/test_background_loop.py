"""``BackgroundLoop``: ticks at its interval, starts once, stops and restarts, survives a failing tick."""

from __future__ import annotations

import threading

from pagedserve.workers.process.background_loop import BackgroundLoop


def _wait_for(event: threading.Event) -> None:
    assert event.wait(10), "the loop did not tick"


def test_ticks_until_stopped_and_starts_only_once():
    ticks = []
    third = threading.Event()

    def tick():
        ticks.append(threading.current_thread().name)
        if len(ticks) == 3:
            third.set()

    loop = BackgroundLoop("test-loop", tick, 0.01)
    loop.start()
    loop.start()
    _wait_for(third)
    loop.stop()
    assert not loop.is_running
    num_ticks = len(ticks)
    assert set(ticks) == {"test-loop"}
    loop.start()  # a stopped loop starts again
    assert loop.is_running
    loop.stop()
    assert len(ticks) >= num_ticks


def test_a_failing_tick_is_logged_and_the_loop_goes_on(caplog):
    calls = []
    second = threading.Event()

    def tick():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("first tick fails")
        second.set()

    loop = BackgroundLoop("test-failing-loop", tick, 0.01)
    loop.start()
    _wait_for(second)
    loop.stop()
    assert "test-failing-loop: tick failed" in caplog.text


def test_tick_at_start_runs_before_the_first_interval():
    ticked = threading.Event()
    loop = BackgroundLoop("test-eager-loop", ticked.set, 3600.0, tick_at_start=True)
    loop.start()
    _wait_for(ticked)
    loop.stop()  # wakes the hour-long wait at once
    assert not loop.is_running


def test_a_wakeup_brings_the_next_tick_at_once_and_the_interval_may_move():
    wakeup = threading.Event()
    ticked = threading.Event()
    waits = []

    def interval_s() -> float:
        waits.append(1)
        return 3600.0   # only the wakeup can bring a tick within the test

    loop = BackgroundLoop("test-woken-loop", ticked.set, interval_s, wakeup=wakeup)
    loop.start()
    wakeup.set()
    _wait_for(ticked)
    assert len(waits) >= 1, "the interval is asked before each wait"
    loop.stop()  # sets the wakeup too: the hour-long wait ends at once
    assert not loop.is_running


def test_a_tick_may_stop_its_own_loop():
    stopped = threading.Event()
    holder = {}

    def tick():
        holder["loop"].stop()
        stopped.set()

    holder["loop"] = loop = BackgroundLoop("test-self-stopping-loop", tick, 0.01)
    loop.start()
    _wait_for(stopped)
    loop._thread.join(timeout=10)
    assert not loop.is_running
