"""What ``pagedserve serve``, ``status`` and ``stop`` do.

``serve`` starts a private Ray (or joins ``--address``, else ``$RAY_ADDRESS``;
token authentication as Ray uses it for a cluster it finds), the KV manager and workers,
and the Serve application, then writes a small state file (pid, Ray
address, endpoints) to ``$PAGEDSERVE_CACHE_DIR/serve.json`` (default
``~/.cache/pagedserve/serve.json``) and blocks until SIGINT/SIGTERM, when it
tears everything down and removes the file.

``status`` joins the Ray cluster (``--address``, else the one in the state
file, else ``auto``) and asks the running Serve application's replica for
its stats: per-worker queues and pools from the KV manager and the
workers, prefix-cache hit rates, and the replica's router. ``stop`` sends
SIGTERM to the ``serve`` process named in the state file and waits for it.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import IO, Iterator

from . import ray_compat
from .config import ClusterConfig
from .router import kv_blocks_used_frac

STATE_FILE_NAME = "serve.json"
RAY_AUTH_MODE_ENV = "RAY_AUTH_MODE"  # "token" when the cluster needs ~/.ray/auth_token
SERVE_LOGGER = "ray.serve"          # Ray Serve's logger in this process (its client's INFO lines)
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
SERVE_SHUTDOWN_TIMEOUT_S = 30.0     # replicas drain for 5 s (graceful_shutdown_timeout_s), 6 s behind HAProxy


def state_file() -> Path:
    """Where a running ``pagedserve serve`` records itself."""
    from pagedserve.devtools.model_factory import default_cache_dir

    return default_cache_dir().parent / STATE_FILE_NAME


def read_state() -> dict | None:
    try:
        return json.loads(state_file().read_text())
    except (OSError, ValueError):
        return None


def _is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Progress:
    """Start-up stages on stderr; on a terminal, a spinner with the elapsed time."""

    def __init__(self, stream: IO[str] | None = None) -> None:
        self.stream = stream or sys.stderr
        self.is_tty = self.stream.isatty()

    @contextlib.contextmanager
    def stage(self, label: str, spinner: bool = True) -> Iterator[None]:
        """A stage; ``spinner=False`` when the stage draws its own progress bar."""
        start = time.time()
        stop = threading.Event()
        ticker = None
        if self.is_tty and spinner:
            def tick() -> None:
                for frame in itertools.cycle("|/-\\"):
                    if stop.wait(0.2):
                        return
                    self.stream.write(f"\r[{frame}] {label} ({time.time() - start:.0f} s)")
                    self.stream.flush()
            ticker = threading.Thread(target=tick, daemon=True)
            ticker.start()
        else:
            print(f"[..] {label}", file=self.stream, flush=True)
        try:
            yield
        except BaseException:
            stop.set()
            if ticker:
                ticker.join()
            print(f"\r[!!] {label}: failed after {time.time() - start:.1f} s", file=self.stream, flush=True)
            raise
        stop.set()
        if ticker:
            ticker.join()
        print(f"\r[ok] {label} ({time.time() - start:.1f} s)", file=self.stream, flush=True)


def _log_to_console() -> None:
    """pagedserve's warnings (a worker Ray cannot place, ...) on stderr, with time and level,
    unless logging is configured already."""
    package = logging.getLogger("pagedserve")
    if package.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    package.addHandler(handler)
    package.setLevel(logging.INFO)
    handler.setLevel(logging.WARNING)


def serve_forever(config: ClusterConfig, address: str | None = None, progress: Progress | None = None,
                  stdout: IO[str] | None = None) -> int:
    """Bring the cluster and the API up, block until SIGINT/SIGTERM, tear down; exit status
    (1 when the workers cannot start)."""
    import ray
    from ray import serve

    from .bootstrap import WorkerStartError, init_ray, start
    from .placement_watch import PlacementError
    from .serving import ingress
    from .serving.deployment import APP_NAME, deploy

    progress = progress or Progress()
    stdout = stdout or sys.stdout
    _log_to_console()
    logging.getLogger(SERVE_LOGGER).setLevel(logging.WARNING)  # the driver's "app ready" chatter
    stopping = threading.Event()
    previous: dict = {}
    owns_ray = is_private_ray = not ray.is_initialized()
    handle = None
    try:
        if owns_ray:
            ingress.prepare(config.server.ingress)  # Serve's processes read it when they start
            with progress.stage(f"joining the Ray cluster at {address}" if address else "starting a private Ray"):
                is_private_ray = init_ray(address, logging_level="WARNING")
        if not config.model.path:
            model = config.model
            with progress.stage(f"building the {model.arch}-{model.size} model (first start only)"):
                config.model.resolve_path()
        num_workers = sum(group.min_workers for group in config.workers)
        try:
            with progress.stage(f"starting the KV manager and {num_workers} worker(s): loading the model, "
                                "allocating KV pools", spinner=False):
                handle = start(config, show_progress=progress.is_tty, is_private_ray=is_private_ray)
        except (PlacementError, WorkerStartError) as exc:
            print(f"error: {exc}", file=sys.stderr, flush=True)
            return 1
        apis = "HTTP and gRPC" if config.server.grpc_port is not None else "HTTP"
        with progress.stage(f"deploying the {apis} API on Ray Serve"):
            endpoints = deploy(handle, config, quiet=True)
        state = {"pid": os.getpid(), "ray_address": ray.get_runtime_context().gcs_address,
                 "ray_auth_mode": os.environ.get(RAY_AUTH_MODE_ENV),
                 "endpoints": endpoints, "model": handle.model_name, "started_at": time.time()}
        path = state_file()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(state, indent=2) + "\n")
        http = endpoints["http"]
        print(f"pagedserve is serving '{handle.model_name}' (context {handle.max_model_len} tokens, "
              f"{num_workers} worker(s))", file=stdout)
        print(f"  OpenAI API  {http}/v1   (e.g. curl {http}/v1/models)", file=stdout)
        if "grpc" in endpoints:
            print(f"  gRPC        {endpoints['grpc']}", file=stdout)
        print(f"  metrics     {http}/metrics      health {http}/health", file=stdout)
        if config.server.api_key or os.environ.get("PAGEDSERVE_API_KEY"):
            print("  an API key is required: send 'Authorization: Bearer <key>'", file=stdout)
        print("Press Ctrl-C (or run 'pagedserve stop') to stop.", file=stdout, flush=True)
        # Installed only now (ray.init installs its own): during start-up, Ctrl-C interrupts.
        previous = {sig: signal.signal(sig, lambda *_: stopping.set())
                    for sig in (signal.SIGINT, signal.SIGTERM)}
        while not stopping.wait(0.5):
            pass
        print("stopping...", file=sys.stderr, flush=True)
        return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        state = read_state()
        if state and state.get("pid") == os.getpid():
            state_file().unlink(missing_ok=True)
        with contextlib.suppress(Exception):
            if is_private_ray:
                ray_compat.shutdown_serve(SERVE_SHUTDOWN_TIMEOUT_S)
            else:
                serve.delete(APP_NAME)
        if handle is not None:
            with contextlib.suppress(Exception):
                handle.shutdown()
        if owns_ray:
            ray.shutdown()


def stop_server(timeout_s: float = 60.0, stdout: IO[str] | None = None) -> int:
    """SIGTERM the recorded ``serve`` process and wait for it to exit; exit status."""
    stdout = stdout or sys.stdout
    state = read_state()
    if not state or not _is_alive(int(state.get("pid", 0)) or -1):
        if state:
            state_file().unlink(missing_ok=True)
        print("no pagedserve server is running (started by 'pagedserve serve' on this machine)",
              file=sys.stderr)
        return 1
    pid = int(state["pid"])
    os.kill(pid, signal.SIGTERM)
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if not _is_alive(pid):
            print(f"stopped pagedserve (pid {pid})", file=stdout)
            return 0
        time.sleep(0.2)
    print(f"pagedserve (pid {pid}) did not exit within {timeout_s:.0f} s", file=sys.stderr)
    return 1


def fetch_status(address: str | None = None, timeout_s: float = 30.0) -> dict:
    """Stats from the running Serve application (``Frontend.stats``: ``cluster.stats.gather_stats``)."""
    state = read_state()
    if address is None:
        address = state["ray_address"] if state else "auto"
    if state and state.get("ray_auth_mode") and state.get("ray_address") == address:
        # Ray reads this when it is imported: the recorded cluster wants its token.
        os.environ.setdefault(RAY_AUTH_MODE_ENV, state["ray_auth_mode"])
    import ray
    from ray import serve

    from .bootstrap import init_ray
    from .serving.deployment import APP_NAME

    if not ray.is_initialized():
        init_ray(address, logging_level="ERROR", log_to_driver=False)
    # Serve's client logs its routing set-up at INFO ("Started <...LongPollClient>"): not the
    # user's business before the status table.
    logging.getLogger(SERVE_LOGGER).setLevel(logging.WARNING)
    return serve.get_app_handle(APP_NAME).status.remote().result(timeout_s=timeout_s)


def _rank_lines(worker: dict) -> list[str]:
    """A worker of several ranks: its KV capacity, then one line per rank with its pool."""
    ranks = worker.get("ranks") or []
    if not ranks:
        return []
    lines = [f"  tensor parallel {worker.get('tensor_parallel_size')}: KV capacity "
             f"{worker.get('kv_capacity_tokens', '?')} tokens (each rank holds 1/{len(ranks)} of the KV heads, "
             "so capacity grows with the ranks)"]
    for rank in ranks:
        pool_mib = rank.get("device_pool_bytes", 0) / 2**20
        lines.append(f"  rank {rank['rank']}: {rank.get('device')} on {rank.get('host')} "
                     f"(node {str(rank.get('node_id'))[:12]}, pid {rank.get('pid')}): "
                     f"{rank.get('num_kv_heads', '?')} KV heads, {rank.get('num_device_blocks', '?')} device "
                     f"blocks ({pool_mib:.1f} MiB), {rank.get('num_host_blocks', '?')} host blocks")
    return lines


def format_status(stats: dict) -> str:
    """A human-readable table of ``fetch_status``'s result."""
    lines = [f"model {stats.get('model')}"]
    server = stats.get("server", {})
    if server:
        lines.append(f"server: {server.get('num_in_flight', 0)} requests in flight "
                     f"(limit {server.get('max_queued_requests')})")
    pools = stats.get("kv_manager", {}).get("workers", {})
    header = (f"{'worker':<10} {'role':<8} {'dtype':<9} {'healthy':<8} {'running':>7} {'waiting':>7} {'kv used':>8} "
              f"{'device used/cached/free':>24} {'host used':>9} {'prefix hit':>10} {'preempt s/r':>11}")
    lines.append(header)
    for worker_id, worker in sorted(stats.get("workers", {}).items()):
        pool = pools.get(worker_id, {})
        device = (f"{pool.get('device_blocks_used', '-')}/{pool.get('device_blocks_cached', '-')}/"
                  f"{pool.get('device_blocks_free', '-')}")
        lines.append(
            f"{worker_id:<10} {worker.get('role', '?'):<8} {worker.get('dtype', '-'):<9} "
            f"{'yes' if worker.get('is_healthy') else 'NO':<8} "
            f"{worker.get('num_running', '-'):>7} {worker.get('num_waiting', '-'):>7} "
            f"{kv_blocks_used_frac(pool):>8.1%} {device:>24} {pool.get('host_blocks_used', '-'):>9} "
            f"{pool.get('prefix_cache_hit_rate', 0.0):>10.1%} "
            f"{pool.get('num_preemptions_swap', 0)}/{pool.get('num_preemptions_recompute', 0):<9}")
        if worker.get("error"):
            lines.append(f"  {worker_id}: {worker['error']}")
        lines.extend(_rank_lines(worker))
    reasons = stats.get("router", {}).get("reasons")
    if reasons:
        lines.append("routing decisions: " + ", ".join(f"{k} {v}" for k, v in sorted(reasons.items())))
    return "\n".join(lines)
