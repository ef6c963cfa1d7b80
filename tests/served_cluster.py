"""A pagedserve cluster on a fresh local Ray, for the end-to-end tests' module fixtures.

``running_cluster(cluster_config(...))`` starts Ray and the cluster, yields
them, and shuts Serve, the cluster and Ray down afterwards; the fixture
deploys its own Serve applications in between. ``ServeProcess`` runs
``pagedserve serve`` as a user would, in a subprocess.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

from pagedserve.cluster.serving.ingress import _PORTS_FROM as HAPROXY_PORTS_FROM


def _ephemeral_low(default: int = 32768) -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return default


# Ports handed to servers the tests start (Serve's HTTP and gRPC proxies, GCS ports): between
# the worker ports of ``ray start`` (10002-19999) and the range a server picks HAProxy's own
# ports from (``cluster.serving.ingress``, from ``HAPROXY_PORTS_FROM``), so that a test's server never takes the
# port another test's server picked for its HAProxy; below the kernel's ephemeral range, which
# ``bind(0)`` draws from and above which Ray picks its other ports at random.
# A port checked free here cannot be taken by another process's ``bind(0)`` before its server
# binds it, as a port drawn from the ephemeral range was under load.
ALL_TEST_PORTS = range(20000, max(min(_ephemeral_low(), HAPROXY_PORTS_FROM), 21000))


def _this_workers_ports(ports: range) -> range:
    """Under pytest-xdist, this test process's own slice of ``ports``: a port one process checked
    free can be bound by its server tens of seconds later, and another process's check in between
    would find it free too."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if not (worker.startswith("gw") and worker[2:].isdigit() and count.isdigit() and int(count) > 1):
        return ports
    size = len(ports) // int(count)
    start = ports.start + int(worker[2:]) % int(count) * size
    return range(start, start + size)


TEST_PORTS = _this_workers_ports(ALL_TEST_PORTS)
_handed_out: set[int] = set()


def free_port() -> int:
    """A port outside every range that Ray or the kernel assign on their own, free now, not
    handed out before by this process; the start is random so that concurrent runs differ."""
    start = random.randrange(len(TEST_PORTS))
    for i in range(len(TEST_PORTS)):
        port = TEST_PORTS[(start + i) % len(TEST_PORTS)]
        if port not in _handed_out and _is_free(port):
            _handed_out.add(port)
            return port
    raise RuntimeError(f"no free port in {TEST_PORTS}")


def _is_free(port: int) -> bool:
    for host in ("0.0.0.0", "127.0.0.1"):
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                return False
    return True


def cluster_config(model_path: str, name: str, engine: dict, num_workers: int, worker_cpus: float = 0.5,
                   step_timeout_s: float = 20.0, **server) -> dict:
    """A ``ClusterConfig`` dump: one group of ``num_workers`` CPU workers, the HTTP port free
    and one ingress replica unless ``server`` (more server options) says otherwise
    (``num_replicas=None``: the rule, one per CPU worker)."""
    return {"model": {"path": model_path, "name": name}, "engine": engine,
            "workers": [{"count": num_workers, "num_cpus": worker_cpus}],
            "server": {"port": free_port(), "num_replicas": 1, **server}, "step_timeout_s": step_timeout_s}


def assert_idle(handle, timeout_s: float = 60.0) -> None:
    """The cluster behind ``handle`` is idle within ``timeout_s``, with no block in use and its
    accounting consistent (what every served test checks after each test)."""
    handle.wait_idle(timeout=timeout_s)
    assert handle.num_used_blocks() == 0
    handle.check_integrity()


@dataclass
class RunningCluster:
    handle: Any           # ``bootstrap.ClusterHandle``
    config: Any           # the validated ``ClusterConfig``
    dashboard_url: str    # Ray's dashboard ("" without one)


def start_local_ray(num_attempts: int = 3, **init_options) -> Any:
    """A new local Ray instance (never one another test or engineer started); on a loaded
    machine the raylet can miss Ray's fixed 30 s start-up wait, so that is retried."""
    import ray

    for attempt in range(num_attempts):
        try:
            return ray.init(address="local", **init_options)
        except Exception as exc:
            ray.shutdown()
            if "timed out during startup" not in str(exc) or attempt == num_attempts - 1:
                raise
            time.sleep(5)


@contextmanager
def running_cluster(config: dict, num_cpus: int = 4, include_dashboard: bool | None = False,
                    runtime_env: dict | None = None) -> Iterator[RunningCluster]:
    """Ray with ``num_cpus`` in pagedserve's namespace, then the cluster of ``config`` (a
    ``ClusterConfig`` dump), ready; on exit Serve, the cluster and Ray are shut down."""
    import ray
    from ray import serve

    from pagedserve.cluster.bootstrap import NAMESPACE, start
    from pagedserve.cluster.config import ClusterConfig

    if ray.is_initialized():
        ray.shutdown()
    context = start_local_ray(num_cpus=num_cpus, namespace=NAMESPACE, include_dashboard=include_dashboard,
                              runtime_env=runtime_env)
    validated = ClusterConfig.model_validate(config)
    handle = start(validated, ready_timeout_s=180.0)
    try:
        yield RunningCluster(handle, validated, context.dashboard_url or "")
    finally:
        serve.shutdown()
        handle.shutdown()
        ray.shutdown()


class ServeProcess:
    """``pagedserve serve ...`` in a subprocess, its output collected and the process reaped
    as a shell would (``pagedserve stop`` waits for the pid to vanish, not a zombie).
    ``sigint_ignored``: started as a shell script's background job is, SIGINT ignored."""

    def __init__(self, args: list[str], env: dict, sigint_ignored: bool = False) -> None:
        command = [sys.executable, "-m", "pagedserve", "serve", *args]
        if sigint_ignored:   # exec keeps an ignored signal ignored
            command = ["sh", "-c", 'trap "" INT; exec "$@"', "sh", *command]
        self.process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True)
        self.output: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        self.output.extend(self.process.stdout)
        self.process.wait()

    def ended_output(self, timeout_s: float = 30) -> str:
        """All the server's output, once it has ended (and its output has been read)."""
        self._reader.join(timeout_s)
        return "".join(self.output)

    def wait_serving(self, timeout_s: float = 300) -> None:
        deadline = time.time() + timeout_s
        while not any("pagedserve is serving" in line for line in self.output):
            assert self.process.poll() is None, "".join(self.output)
            assert time.time() < deadline, "".join(self.output)
            time.sleep(0.5)

    def kill(self) -> None:
        """Kill the server and every process under it (its private Ray's)."""
        from pagedserve.workers.process.processes import descendants

        if self.process.poll() is None:
            tree = descendants(self.process.pid)
            self.process.kill()
            self.process.wait(timeout=30)
            for pid in tree:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
