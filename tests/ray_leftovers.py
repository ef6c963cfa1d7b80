"""Find the Ray processes a test session started and did not end.

Ray's agents (``ray::DashboardAgent``, ``ray::RuntimeEnvAgent``) and Serve's actors
(``ray::ServeController``, ``ray::ProxyActor``) rename themselves, so their command
lines no longer say which cluster they belong to, and renaming (``setproctitle``)
overwrites what ``/proc/PID/environ`` shows. They can outlive their raylet, be
re-parented to init and ignore SIGTERM. What they keep is their Unix session: Ray
gives its workers process groups of their own but never a new session, so everything
the suite starts, however deep, shares the pytest process's session id.

So a leftover is a live process with a Ray or pagedserve command line, in the suite's
session, that did not exist when the suite started (pid and start time), and whose
environment, where it can still be read, carries this suite's mark (``SESSION_MARK``):
a second suite started from the same terminal carries another mark.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

SESSION_MARK = "PAGEDSERVE_TEST_SESSION"


@dataclass(frozen=True)
class Process:
    pid: int
    start_ticks: int  # since boot: with the pid, names one process even after pid reuse
    session_id: int
    name: str         # /proc/PID/comm: what the process calls itself
    cmdline: str
    mark: str | None  # SESSION_MARK's value in its readable environment, if any

    def __str__(self) -> str:
        return f"{self.pid} {self.cmdline[:160] or self.name}"

    @property
    def is_ray_or_pagedserve(self) -> bool:
        text = f"{self.name} {self.cmdline}".lower()
        return "ray" in text or "pagedserve" in text or "gcs_server" in text


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:  # gone, or not ours to read
        return b""


def _process(entry: Path) -> Process | None:
    stat = _read(entry / "stat")
    if not stat:
        return None
    fields = stat.rsplit(b")", 1)[-1].split()  # after "pid (comm)": state, ppid, pgrp, session, ...
    if fields[0] in (b"Z", b"X"):
        return None  # exited; only its exit status is left
    mark = None
    for item in _read(entry / "environ").split(b"\0"):
        if item.startswith(SESSION_MARK.encode() + b"="):
            mark = item.split(b"=", 1)[1].decode(errors="replace")
    return Process(pid=int(entry.name), start_ticks=int(fields[19]), session_id=int(fields[3]),
                   name=_read(entry / "comm").decode(errors="replace").strip(),
                   cmdline=_read(entry / "cmdline").replace(b"\0", b" ").decode(errors="replace").strip(),
                   mark=mark)


def processes() -> list[Process]:
    """Every live process on the machine but this one."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            process = _process(entry)
            if process is not None:
                found.append(process)
    return found


@dataclass(frozen=True)
class SuiteScope:
    """What the suite may have started: its session, its mark, and what existed before it."""

    session_id: int
    mark: str
    preexisting: frozenset[tuple[int, int]]

    @classmethod
    def begin(cls, mark: str | None = None) -> "SuiteScope":
        """Call before any Ray starts. Without ``mark``, puts a new one in this process's
        environment, which everything it starts inherits."""
        if mark is None:
            mark = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
            os.environ[SESSION_MARK] = mark
        return cls(os.getsid(0), mark, frozenset((p.pid, p.start_ticks) for p in processes()))

    def leftovers(self) -> list[Process]:
        """Ray and pagedserve processes the suite started that are still alive."""
        return [p for p in processes()
                if p.session_id == self.session_id and (p.pid, p.start_ticks) not in self.preexisting
                and p.mark in (None, self.mark) and p.is_ray_or_pagedserve]


def wait_for_exit(find, timeout_s: float, poll_s: float = 0.2) -> list[Process]:
    """Call ``find()`` until it returns nothing or ``timeout_s`` passes; return its last answer."""
    deadline = time.monotonic() + timeout_s
    found = find()
    while found and time.monotonic() < deadline:
        time.sleep(poll_s)
        found = find()
    return found


def kill(found: list[Process]) -> None:
    """SIGKILL: leftovers of this kind ignore SIGTERM."""
    for process in found:
        try:
            os.kill(process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
