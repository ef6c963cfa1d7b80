"""Find the Ray processes a test session started and did not end.

Ray's agents (``ray::DashboardAgent``, ``ray::RuntimeEnvAgent``) and Serve's actors
(``ray::ServeController``, ``ray::ProxyActor``) rename themselves, so their command
lines no longer say which cluster they belong to, and renaming (``setproctitle``)
overwrites what ``/proc/PID/environ`` shows. They can outlive their raylet, be
re-parented to init and ignore SIGTERM.

So the suite marks what it starts in two ways before any Ray starts (``SuiteScope.begin``),
both inherited by every process it starts, however deep:

- ``SESSION_MARK`` in the environment: a process whose environment can be read is the
  suite's exactly when it carries the suite's mark;
- ``RAY_TMPDIR``, a directory of the suite's own: every Ray cluster the suite starts keeps
  its session (sockets, logs) there, and a renamed process, whose environment reads as
  blank, still holds its log files open there.

Other people's processes on the machine, and a second suite's, carry no mark or another,
and keep their Ray sessions elsewhere: they are never counted, nor touched.
"""

from __future__ import annotations

import os
import signal
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

SESSION_MARK = "PAGEDSERVE_TEST_SESSION"
RAY_TMPDIR = "RAY_TMPDIR"   # Ray's root for its session directories (ray._common.utils)


@dataclass(frozen=True)
class Process:
    pid: int
    start_ticks: int  # since boot: with the pid, names one process even after pid reuse
    name: str         # /proc/PID/comm: what the process calls itself
    cmdline: str
    mark: str | None  # SESSION_MARK's value in its environment, if any
    is_environ_blank: bool   # renamed by setproctitle (or unreadable): the mark cannot be seen

    def __str__(self) -> str:
        return f"{self.pid} {self.cmdline[:160] or self.name}"

    @property
    def is_ray_or_pagedserve(self) -> bool:
        text = f"{self.name} {self.cmdline}".lower()
        return "ray" in text or "pagedserve" in text or "gcs_server" in text

    def holds_files_under(self, root: str) -> bool:
        """Whether its command line, working directory or an open file is under ``root``."""
        prefix = root.rstrip("/") + "/"
        if prefix in self.cmdline:
            return True
        entry = Path("/proc") / str(self.pid)
        try:
            links = [os.readlink(entry / "cwd")] + [os.readlink(fd) for fd in (entry / "fd").iterdir()]
        except OSError:   # gone, or not ours to read
            return False
        return any(link.startswith(prefix) for link in links)


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
    environ = _read(entry / "environ")
    mark = None
    for item in environ.split(b"\0"):
        if item.startswith(SESSION_MARK.encode() + b"="):
            mark = item.split(b"=", 1)[1].decode(errors="replace")
    return Process(pid=int(entry.name), start_ticks=int(fields[19]),
                   name=_read(entry / "comm").decode(errors="replace").strip(),
                   cmdline=_read(entry / "cmdline").replace(b"\0", b" ").decode(errors="replace").strip(),
                   mark=mark, is_environ_blank=b"=" not in environ)


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
    """What the suite may have started: its mark, its Ray root, and what existed before it."""

    mark: str
    ray_root: str
    preexisting: frozenset[tuple[int, int]]

    @classmethod
    def begin(cls) -> "SuiteScope":
        """Call before any Ray starts: puts a new mark and a new ``RAY_TMPDIR`` in this process's
        environment, which everything it starts inherits."""
        mark = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        # Short: Ray's socket paths live under it (108 bytes at most).
        ray_root = tempfile.mkdtemp(prefix="ps-", dir=os.environ.get(RAY_TMPDIR, "/tmp"))
        os.environ[SESSION_MARK] = mark
        os.environ[RAY_TMPDIR] = ray_root
        return cls.of(mark, ray_root)

    @classmethod
    def of(cls, mark: str, ray_root: str) -> "SuiteScope":
        """The scope of ``mark`` and ``ray_root``, from now on (what exists now is not its)."""
        return cls(mark, ray_root, frozenset((p.pid, p.start_ticks) for p in processes()))

    def owns(self, process: Process) -> bool:
        if (process.pid, process.start_ticks) in self.preexisting or not process.is_ray_or_pagedserve:
            return False
        if process.mark is not None or not process.is_environ_blank:
            return process.mark == self.mark
        return process.holds_files_under(self.ray_root)

    def leftovers(self) -> list[Process]:
        """Ray and pagedserve processes the suite started that are still alive."""
        return [p for p in processes() if self.owns(p)]


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
