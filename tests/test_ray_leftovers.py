"""The suite's leftover check finds what stopping a Ray cluster by its PIDs misses."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from ray_leftovers import SESSION_MARK, SuiteScope, kill, wait_for_exit

# What Ray's agents do: take a new name (so neither the command line nor /proc's view of the
# environment says where they came from) and ignore SIGTERM.
AGENT = """
import signal, sys, time
import ray._raylet
signal.signal(signal.SIGTERM, signal.SIG_IGN)
if sys.argv[1] == "rename":
    ray._raylet.setproctitle("ray::DashboardAgent")
print("ready", flush=True)
time.sleep(300)
"""


def start(mark: str, how: str) -> subprocess.Popen:
    child = subprocess.Popen([sys.executable, "-c", AGENT, how, "ray-like"], env={**os.environ, SESSION_MARK: mark},
                             stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"
    return child


def test_a_renamed_agent_that_ignores_sigterm_is_found_and_killed_and_nothing_else():
    before = start("suite", "rename")  # existed before the suite: not the suite's
    children = [before]
    try:
        scope = SuiteScope.begin(mark="suite")
        renamed = start("suite", "rename")
        children.append(renamed)
        other_suite = start("another suite", "keep-name")  # its environment names another suite
        children.append(other_suite)

        found = scope.leftovers()
        assert [p.pid for p in found] == [renamed.pid]
        assert found[0].name.startswith("ray::") and found[0].mark is None, \
            "setproctitle no longer hides the environment: the test no longer models Ray's agents"
        os.kill(renamed.pid, signal.SIGTERM)
        with pytest.raises(subprocess.TimeoutExpired):
            renamed.wait(timeout=1)  # assumes SIG_IGN holds for 1 s: SIGTERM alone leaves it
        kill(found)
        assert renamed.wait(timeout=30) == -signal.SIGKILL
        assert wait_for_exit(scope.leftovers, timeout_s=10) == []
        assert before.poll() is None and other_suite.poll() is None, "a process not the suite's was killed"
    finally:
        for child in children:
            child.kill()
            child.wait()
