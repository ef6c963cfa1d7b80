"""A process's CPU time per thread role, for telling apart where an actor's CPU goes.

``process_cpu_s`` says how much CPU the central KV manager (or a relay) took,
not whether it went to our code or to Ray's and ZeroMQ's threads. On Linux
each thread's CPU time is in ``/proc/self/task/<tid>/stat``; ``cpu_by_role``
sums it per role: the threads named in ``roles`` (native thread id -> role,
e.g. the event receiver), the main thread (``"main"``: Ray's task loop and
the actor's methods), ZeroMQ's background threads (``"zeromq"``) and every
other thread (``"other"``: Ray's gRPC, I/O and event threads). Elsewhere it
answers an empty dict.
"""

from __future__ import annotations

import os

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_by_role(roles: dict[int, str] | None = None) -> dict[str, float]:
    """CPU seconds since each thread started, summed per role (threads that ended are not
    counted: take differences over a window in which the threads live)."""
    roles = roles or {}
    pid = os.getpid()
    totals: dict[str, float] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return {}
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:   # the thread ended
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        seconds = (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS   # utime + stime
        role = roles.get(int(tid)) or ("main" if int(tid) == pid else
                                       "zeromq" if name.startswith("ZMQbg") else "other")
        totals[role] = totals.get(role, 0.0) + seconds
    return totals
