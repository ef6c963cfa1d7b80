"""Processes on this machine, as ``/proc`` shows them: whether one runs, when it started, what
it runs, and what runs under it (a private Ray's processes are its ``serve`` process's
descendants). Its users: the server records and the launcher (``cluster``), the engine cores'
socket folders, Serve's HAProxy left behind (``cluster.serving.ingress``).

Without ``/proc`` (not Linux), ``is_running`` falls back to a signal 0, and the others know
nothing.
"""

from __future__ import annotations

import os
from pathlib import Path

PROC = Path("/proc")


def _stat_fields(pid: int) -> list[str] | None:
    """``/proc/PID/stat`` after the command name: state, parent pid, ... (``man 5 proc``)."""
    try:
        return (PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def is_running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie (a process that ended and awaits its parent)."""
    fields = _stat_fields(pid)
    if fields is not None:
        return fields[0] != "Z"
    if PROC.is_dir():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def started_at(pid: int) -> float | None:
    """When ``pid`` started, in clock ticks since boot: with the pid, it names one process
    (a pid is reused once its process is gone). None if unknown."""
    fields = _stat_fields(pid)
    try:
        return float(fields[19]) if fields else None
    except (IndexError, ValueError):
        return None


def is_same_process(pid: int, started: float | None) -> bool:
    """Whether ``pid`` runs and is the process that started at ``started`` (``started_at``), not
    a later one given the same pid; any process of that pid where a start time is unknown."""
    if not is_running(pid):
        return False
    now = started_at(pid)
    return started is None or now is None or now == started


def command_line(pid: int) -> list[str] | None:
    """``pid``'s program and arguments (None if unknown, or it has none: a kernel thread)."""
    try:
        raw = (PROC / str(pid) / "cmdline").read_bytes()
    except OSError:
        return None
    return raw.decode(errors="replace").split("\0")[:-1] or None


def running_pids() -> list[int]:
    """Every process this machine runs (none known without ``/proc``)."""
    return [int(entry.name) for entry in (PROC.iterdir() if PROC.is_dir() else ()) if entry.name.isdigit()]


def descendants(pid: int) -> list[int]:
    """Every live process under ``pid``: its children, theirs, and so on."""
    children: dict[int, list[int]] = {}
    for child in running_pids():
        fields = _stat_fields(child)
        if fields and len(fields) > 1 and fields[1].isdigit():
            children.setdefault(int(fields[1]), []).append(child)
    found, todo = [], list(children.get(pid, []))
    while todo:
        child = todo.pop()
        found.append(child)
        todo.extend(children.get(child, []))
    return found
