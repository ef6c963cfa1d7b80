"""A pagedserve cluster on a fresh local Ray, for the end-to-end tests' module fixtures.

``running_cluster(cluster_config(...))`` starts Ray and the cluster, yields
them, and shuts Serve, the cluster and Ray down afterwards; the fixture
deploys its own Serve applications in between.
"""

from __future__ import annotations

import socket
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cluster_config(model_path: str, name: str, engine: dict, num_workers: int, worker_cpus: float = 0.5,
                   step_timeout_s: float = 20.0, **server) -> dict:
    """A ``ClusterConfig`` dump: one group of ``num_workers`` CPU workers, the HTTP port free
    unless ``server`` (more server options) names one."""
    return {"model": {"path": model_path, "name": name}, "engine": engine,
            "workers": [{"count": num_workers, "num_cpus": worker_cpus}],
            "server": {"port": free_port(), **server}, "step_timeout_s": step_timeout_s}


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
