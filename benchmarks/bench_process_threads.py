"""One served process's CPU by thread, per engine step and per streamed token, under load.

``bench_serving_cpu.py`` tells which process a streamed token's CPU goes to; this tells which
thread of one of them: a fresh ``pagedserve serve`` (the tiny model, one worker, HAProxy, the
socket transport, a private Ray), a sustained load from ``pagedserve bench serve`` (``--waves``
times ``--streams`` requests, at most ``--streams`` at once, lengths within ±50%), and over
``--rounds`` windows of ``--window-s`` seconds each, the process's threads' CPU (``/proc``,
through psutil) over the engine's steps and tokens in the window (the workers' ``/stats``).

Threads are named as Python knows them where ``py-spy dump`` can read the process (its
threads' native ids), else by their kernel names. ``--process`` picks the process by its
role, as ``bench serve --cpu-per-token`` groups the server's processes
(``pagedserve.bench.process_cpu``): "worker 0" (the worker actor, the default), "engine core
0", "serve replica". ``--pin-engine-core`` gives the engine core a CPU of its own, the rest
of the server and the load the others.

    python benchmarks/bench_process_threads.py [--process "worker 0"] [--streams 64]
                                               [--rounds 2] [--window-s 6] [--pin-engine-core]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

from pagedserve.bench.cpu_pinning import pin_engine_cores, split_cpus
from pagedserve.bench.engine_steps import served_counters, window
from pagedserve.bench.process_cpu import ServerCpuProbe, cpu_by_group, find_server_root
from pagedserve.bench.served_process import start_server, stop_server

WARM_UP_S = 5.0   # from the load's start to the first window: the batch fills


def find_process(url: str, server_pid: int, role: str) -> int:
    """The pid of the one process of the server's group ``role`` (``process_cpu.group_of``)."""
    snapshot = ServerCpuProbe(find_server_root(url, server_pid)).snapshot()
    groups = cpu_by_group(snapshot, snapshot, server_pid).groups
    if role not in groups or len(groups[role].pids) != 1:
        raise RuntimeError(f"no one process is {role!r}; the server's groups: "
                           + ", ".join(f"{label} ({len(group.pids)})" for label, group in groups.items()))
    return groups[role].pids[0]


def python_thread_names(pid: int) -> dict[int, str]:
    """Native thread id -> Python thread name, from ``py-spy dump`` (empty without py-spy)."""
    if shutil.which("py-spy") is None:
        return {}
    dump = subprocess.run(["py-spy", "dump", "-p", str(pid), "--nonblocking"], capture_output=True, text=True,
                          timeout=60).stdout
    return {int(m.group(1), 0): m.group(2) for m in re.finditer(r'Thread (\S+) \([^)]*\): "([^"]*)"', dump)}


def thread_cpu(pid: int) -> dict[int, float]:
    import psutil

    return {t.id: t.user_time + t.system_time for t in psutil.Process(pid).threads()}


def kernel_name(pid: int, tid: int) -> str:
    try:
        with open(f"/proc/{pid}/task/{tid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--process", default="worker 0", help="a group of the server's processes")
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--waves", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--window-s", type=float, default=6.0)
    parser.add_argument("--port", type=int, default=8813)
    parser.add_argument("--pin-engine-core", action="store_true")
    args = parser.parse_args()

    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    url = f"http://127.0.0.1:{args.port}"
    workdir = tempfile.mkdtemp(prefix="bench-threads-")
    server = start_server(["--set", "server.ingress=haproxy", "--set", "output_transport=zmq"], args.port,
                          os.path.join(workdir, "serve.log"), env)
    load = None
    load_log = open(os.path.join(workdir, "load.log"), "w")
    try:
        if args.pin_engine_core:
            engine_cpus, other_cpus = split_cpus()
            pin_engine_cores(server.pid, engine_cpus)
            os.sched_setaffinity(0, other_cpus)   # the load client inherits them
        pid = find_process(url, server.pid, args.process)
        names = python_thread_names(pid)
        load = subprocess.Popen(
            [sys.executable, "-m", "pagedserve", "bench", "serve", "--port", str(args.port), "--request-rate", "inf",
             "--num-requests", str(args.streams * args.waves), "--max-concurrency", str(args.streams),
             "--random-input-len", "16", "--random-output-len", str(args.tokens), "--random-range-ratio", "0.5",
             "--seed", "0", "--no-progress"], env=env, stdout=subprocess.DEVNULL, stderr=load_log)
        time.sleep(WARM_UP_S)
        for round_number in range(1, args.rounds + 1):
            steps_before, cpu_before = served_counters(url), thread_cpu(pid)
            time.sleep(args.window_s)
            steps_after, cpu_after = served_counters(url), thread_cpu(pid)
            if load.poll() is not None:
                with open(load_log.name) as f:
                    raise RuntimeError(f"the load ended within the window (raise --waves): {f.read()[-2000:]}")
            steps = window(steps_before, steps_after)
            num_steps, num_tokens = steps["steps"], steps["tokens"]
            used = sorted(((cpu_after[tid] - cpu_before.get(tid, 0.0), tid) for tid in cpu_after), reverse=True)
            total = sum(seconds for seconds, _ in used)
            print(f"round {round_number}: {num_steps} steps, {num_tokens} tokens ({steps['tokens_per_step']:.1f} a "
                  f"step, {num_tokens / args.window_s:,.0f} tok/s); {args.process} (pid {pid}): "
                  f"{1e6 * total / num_steps:,.0f} us a step, {1e6 * total / num_tokens:.2f} us a token")
            for seconds, tid in used:
                if seconds > 0:
                    name = names.get(tid) or kernel_name(pid, tid)
                    print(f"  {name[:44]:44s} {1e6 * seconds / num_steps:8.1f} us a step "
                          f"{1e6 * seconds / num_tokens:7.2f} us a token")
    finally:
        if load is not None and load.poll() is None:
            load.kill()
        stop_server(server)
        load_log.close()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
