"""Benchmarks' CPU pinning: a served run's engine core on a CPU of its own, the rest of the
server and the load client on the others.

On a 2-core VM a served run's engine core shares its CPU with the server's other processes,
and each switch to another process costs the core its private caches: the offline engine
pinned to one CPU took 1.16-1.24x its CPU per token beside a process that wakes every ~160 µs
on the same CPU, and 0.85-0.93x beside the same process on another CPU
(``benchmarks/bench_engine_time_sharing.py``). A GPU host has cores to spare; pinning gives
the engine core one here too, so a run measures what the server adds rather than what
time-sharing one CPU adds.
"""

from __future__ import annotations

import os

ENGINE_CORE_MODULE = "pagedserve.workers.engine.core_process"


def split_cpus() -> tuple[set[int], set[int]]:
    """The engine's CPU (the first this process may use) and everyone else's (the rest);
    ValueError with fewer than two."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise ValueError(f"pinning the engine core needs two CPUs or more; this process has {len(cpus)}")
    return {cpus[0]}, set(cpus[1:])


def pin_threads(pid: int, cpus: set[int]) -> int:
    """Pin every thread of process ``pid`` to ``cpus`` (threads it starts later inherit it from
    the thread that starts them); how many were pinned."""
    pinned = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
            pinned += 1
        except ProcessLookupError:   # a thread that ended meanwhile
            pass
    return pinned


def engine_core_pids(root_pid: int) -> list[int]:
    """The engine core processes under ``root_pid`` (a ``pagedserve serve``)."""
    import psutil

    pids = []
    for process in psutil.Process(root_pid).children(recursive=True):
        try:
            if ENGINE_CORE_MODULE in " ".join(process.cmdline()):
                pids.append(process.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return pids


def pin_engine_cores(root_pid: int, engine_cpus: set[int]) -> list[int]:
    """Pin the engine cores under ``root_pid`` to ``engine_cpus``; their pids. RuntimeError if
    there is none."""
    pids = engine_core_pids(root_pid)
    if not pids:
        raise RuntimeError(f"no engine core process under pid {root_pid}")
    for pid in pids:
        pin_threads(pid, engine_cpus)
    return pids


__all__ = ["engine_core_pids", "pin_engine_cores", "pin_threads", "split_cpus"]
