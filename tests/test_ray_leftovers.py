"""The suite's leftover check finds what stopping a Ray cluster by its PIDs misses, and
nothing that is not the suite's."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys

import pytest
from ray_leftovers import SESSION_MARK, SuiteScope, kill, processes, wait_for_exit

# What Ray's agents do: keep a log file open in their Ray session's directory, take a new name
# (so the command line no longer says where they came from, and /proc's view of the
# environment may be blank), and ignore SIGTERM.
AGENT = """
import signal, sys, time
from pagedserve.cluster.ray_compat import set_process_title
log = open(sys.argv[2], "w")
signal.signal(signal.SIGTERM, signal.SIG_IGN)
if sys.argv[1] == "rename":
    set_process_title("ray::DashboardAgent")
print("ready", flush=True)
time.sleep(300)
"""


def start(how: str, log_file, mark: str | None) -> subprocess.Popen:
    env = {key: value for key, value in os.environ.items() if key != SESSION_MARK}
    if mark is not None:
        env[SESSION_MARK] = mark
    child = subprocess.Popen([sys.executable, "-c", AGENT, how, str(log_file)], env=env,
                             stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"
    return child


def test_a_renamed_agent_that_ignores_sigterm_is_found_and_killed_and_nothing_else(tmp_path):
    ray_root, elsewhere = tmp_path / "suite-ray", tmp_path / "other-ray"
    ray_root.mkdir()
    elsewhere.mkdir()
    children = [start("rename", ray_root / "before.log", "suite")]   # existed before the suite
    try:
        scope = SuiteScope.of("suite", str(ray_root))
        ours = start("rename", ray_root / "dashboard_agent.log", "suite")
        children.append(ours)
        children += [start("rename", elsewhere / "agent.log", "another suite"),  # renamed, another session
                     start("keep-name", ray_root / "x.log", "another suite"),    # its environment says whose
                     start("keep-name", elsewhere / "y.log", None)]               # no mark: someone else's

        found = scope.leftovers()
        assert [p.pid for p in found] == [ours.pid] and found[0].name.startswith("ray::")
        # Renaming may or may not blank /proc's view of the environment (both were seen, in
        # different runs): with it blank, the files a process holds decide, whoever renamed it.
        by_pid = {p.pid: p for p in processes()}
        assert scope.owns(dataclasses.replace(by_pid[ours.pid], mark=None, is_environ_blank=True))
        assert not scope.owns(dataclasses.replace(by_pid[children[2].pid], mark=None, is_environ_blank=True))
        os.kill(ours.pid, signal.SIGTERM)
        with pytest.raises(subprocess.TimeoutExpired):
            ours.wait(timeout=1)  # assumes SIG_IGN holds for 1 s: SIGTERM alone leaves it
        kill(found)
        assert ours.wait(timeout=30) == -signal.SIGKILL
        assert wait_for_exit(scope.leftovers, timeout_s=10) == []
        assert all(child.poll() is None for child in children if child is not ours), \
            "a process not the suite's was killed"
    finally:
        for child in children:
            child.kill()
            child.wait()
