"""The Ray Serve deployment: one replica class serving HTTP (FastAPI ingress) and
gRPC (``Generate``/``GenerateStream``, ``Chat``/``ChatStream``) over one ``Frontend``; ``start_serve``,
which starts Serve (its controller and ingress), also on a thread of its own while the workers load
their model (``ServeStart``); and ``deploy``, which runs the application.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import threading

from pagedserve.workers.process.gc_heap import prepare_serving_heap

from .. import ray_compat
from . import ingress
from ..config import ClusterConfig, ServerConfig
from .auth import API_KEY_ENV
from .frontend import Frontend
from .grpc_service import GrpcService
from .http_app import build_app

logger = logging.getLogger("pagedserve.server")

APP_NAME = "pagedserve"
GRPC_SERVICER_FUNCTION = "pagedserve.cluster.protos.servicer.add_servicer_to_server"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class PagedServeDeployment:
    """The Serve replica: HTTP through FastAPI, gRPC through ``Generate``/``GenerateStream``
    and ``Chat``/``ChatStream``.

    Decorated with ``serve.ingress`` by ``build_application``; holds the
    cluster handle it is constructed with.
    """

    def __init__(self, handle, server_config: dict) -> None:
        self.server = Frontend(handle, ServerConfig.model_validate(server_config))
        self.grpc = GrpcService(self.server)

    def __serve_build_asgi_app__(self):
        app = build_app(self.server)
        # Serve builds the app once, in the replica's process, before any request.
        self.server.gc_pauses = prepare_serving_heap("serve replica")
        return app

    async def Generate(self, request, grpc_context=None):  # noqa: N802 - the RPC's name
        return await self.grpc.generate(request, grpc_context)

    async def GenerateStream(self, request, grpc_context=None):  # noqa: N802 - the RPC's name
        async for response in self.grpc.generate_stream(request, grpc_context):
            yield response

    async def Chat(self, request, grpc_context=None):  # noqa: N802 - the RPC's name
        return await self.grpc.chat(request, grpc_context)

    async def ChatStream(self, request, grpc_context=None):  # noqa: N802 - the RPC's name
        async for response in self.grpc.chat_stream(request, grpc_context):
            yield response

    async def status(self) -> dict:
        """Cluster and replica stats (what ``pagedserve status`` prints)."""
        return await self.server.stats()


def build_application(handle, config: ClusterConfig, num_cpus: float = 0.0):
    """The bound Serve application for ``handle``, configured by ``config.server``."""
    from ray import serve

    limits = config.server.limits
    deployment = serve.deployment(
        serve.ingress()(PagedServeDeployment), name="PagedServe",
        # Serve must not queue in front of our limiter: room for every admitted
        # request plus health checks and scrapes.
        max_ongoing_requests=limits.max_queued_requests + 32,
        num_replicas=config.num_ingress_replicas,
        # On the head node, next to the driver that resolved the model path (the tokenizer's).
        ray_actor_options={"num_cpus": num_cpus, **ray_compat.head_node_placement(),
                           "runtime_env": {"env_vars": ray_compat.event_loop_env(config.server.event_loop)}},
        graceful_shutdown_timeout_s=5)
    return deployment.bind(handle, config.server.model_dump())


def start_serve(config: ClusterConfig, quiet: bool = False) -> None:
    """Start Serve: its controller and ingress, HTTP on ``server.host:port`` and gRPC on
    ``server.grpc_port`` if set. If Serve already runs in this Ray cluster, its HTTP/gRPC options
    stay as they are. ``quiet`` keeps Serve's logs (access logs included) to warnings."""
    from ray import serve

    server = config.server
    grpc_options = None
    if server.grpc_port is not None:
        # Reflection lists the services without a key: only offered when none is needed.
        grpc_options = {"port": server.grpc_port, "grpc_servicer_functions": [GRPC_SERVICER_FUNCTION],
                        "enable_reflection": not (server.api_key or os.environ.get(API_KEY_ENV))}
    serve.start(http_options={"host": server.host, "port": server.port}, grpc_options=grpc_options,
                logging_config=_logging_config(quiet))


class ServeStart:
    """``start_serve`` on a thread of its own: Serve's controller and ingress come up while the
    workers load their model (the application itself needs the workers' handle). ``wait``
    re-raises what the start raised. ``found_running``: Serve already ran in the cluster (its
    controller was there before this start), so the start only connected to it."""

    def __init__(self, config: ClusterConfig, quiet: bool = False) -> None:
        self._config = config
        self._quiet = quiet
        self._error: BaseException | None = None
        self.found_running: bool | None = None
        self._thread = threading.Thread(target=self._run, name="serve-start", daemon=True)

    def begin(self) -> ServeStart:
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            self.found_running = ray_compat.serve_controller() is not None
            start_serve(self._config, self._quiet)
        except BaseException as exc:   # re-raised by ``wait``, in the caller's thread
            self._error = exc

    def wait(self, timeout_s: float | None = None) -> None:
        """Until Serve has started (``TimeoutError`` after ``timeout_s``); raises what its start raised."""
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise TimeoutError(f"Ray Serve did not start within {timeout_s:g} s")
        if self._error is not None:
            raise self._error


def _logging_config(quiet: bool) -> dict | None:
    return {"log_level": "WARNING", "enable_access_log": False} if quiet else None


def deploy(handle, config: ClusterConfig, app_name: str = APP_NAME, route_prefix: str = "/",
           quiet: bool = False, ingress_choice: ingress.IngressChoice | None = None,
           serve_started: bool = False) -> dict[str, str]:
    """Start Serve (``start_serve``, unless ``serve_started``), run the app under ``route_prefix``
    (next to any others). ``quiet`` keeps Serve's logs (access logs included) to warnings.
    ``ingress_choice``: what ``ingress.choose`` answered for ``server.ingress`` (else it is asked
    here). Returns the endpoints, e.g. ``{"http": "http://127.0.0.1:8000", "grpc": "127.0.0.1:9000"}``.
    """
    from ray import serve

    server = config.server
    if not is_loopback(server.host) and not (server.api_key or os.environ.get(API_KEY_ENV)):
        logger.warning("serving on %s (not loopback) without an API key: anyone who can reach it may "
                       "use it; set server.api_key or $%s", server.host, API_KEY_ENV)
    if ingress_choice is None:
        ingress.choose(server.ingress)
    if not serve_started:
        start_serve(config, quiet)
    serve.run(build_application(handle, config), name=app_name, route_prefix=route_prefix,
              logging_config=_logging_config(quiet))
    prefix = "" if route_prefix == "/" else route_prefix
    endpoints = {"http": f"http://{server.host}:{server.port}{prefix}"}
    if server.grpc_port is not None:
        endpoints["grpc"] = f"{server.host}:{server.grpc_port}"
    return endpoints
