"""The folder that holds an engine core's IPC socket paths and progress file.

The worker actor makes it (``make``) and removes it once its core says ``STARTED``, and the
core removes it when it finds its parent already gone. A worker killed after the folder is
made and before either happens (its core killed with it by ``PR_SET_PDEATHSIG``, or never
started) leaves it behind, so each folder names its maker in an ``owner`` file (pid and the
process's start time, so a reused pid is not taken for it), and ``sweep`` removes the folders
whose maker is gone. Each new worker sweeps before it makes its own.
"""

from __future__ import annotations

import os
import shutil
import tempfile

from ..process import processes

PREFIX = "pagedserve-core-"
OWNER = "owner"


def make() -> str:
    """A new folder in the temporary directory, with this process named as its owner."""
    path = tempfile.mkdtemp(prefix=PREFIX)
    with open(os.path.join(path, OWNER), "w") as owner:
        started = processes.started_at(os.getpid())
        owner.write(f"{os.getpid()} {'' if started is None else started}")
    return path


def sweep(parent: str | None = None) -> list[str]:
    """Remove the folders (in ``parent``, default the temporary directory) whose owner process
    is gone; the ones removed. A folder without a readable owner is kept: it may be one whose
    owner has not written it yet."""
    parent = parent or tempfile.gettempdir()
    removed = []
    try:
        names = [name for name in os.listdir(parent) if name.startswith(PREFIX)]
    except OSError:
        return removed
    for name in names:
        path = os.path.join(parent, name)
        try:
            with open(os.path.join(path, OWNER)) as owner:
                pid_text, _, started_text = owner.read().partition(" ")
            pid, started = int(pid_text), float(started_text) if started_text else None
        except (OSError, ValueError):
            continue
        if not processes.is_same_process(pid, started):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


__all__ = ["make", "sweep"]
