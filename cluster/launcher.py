"""What ``pagedserve serve``, ``status`` and ``stop`` do.

``serve`` claims its HTTP port's record (``server_records``): a port another server holds,
or that another program listens on, is refused before anything starts. It then starts a
private Ray (or joins ``--address``, else ``$RAY_ADDRESS``; token authentication as Ray uses
it for a cluster it finds), the KV manager and workers (Serve's controller and ingress start
meanwhile; an ingress the cluster cannot run is refused before), and the Serve application, records
its Ray address, endpoints, ingress, model and engine options, and blocks until SIGINT/SIGTERM. Then it tears everything
down in stages, each named on the console and in its record, and removes the record.

``status`` joins the Ray cluster (``--address``, else the one a server's record names, else
``auto``) and asks the running Serve application's replica for its stats: per-worker queues
and pools from the KV manager and the workers, prefix-cache hit rates, and the replica's
router. ``stop`` sends SIGTERM to the chosen servers (``--port``, ``--all``, or the only one
running), names each stage they go through, and after its bound kills what is left of them:
the ``serve`` process and every process under it (its private Ray's).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import itertools
import logging
import os
import signal
import socket
import sys
import threading
import time
from typing import IO, Callable, Iterator

from pagedserve.workers.process import processes

from . import ray_compat, server_records
from .config import ClusterConfig
from .router import kv_blocks_used_frac
from .server_records import ServerRecord

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)   # Ctrl-C, and what 'pagedserve stop' sends
CHECK_STAGE = "checking the model (importing Ray, torch and transformers first)"
RAY_AUTH_MODE_ENV = "RAY_AUTH_MODE"  # "token" when the cluster needs ~/.ray/auth_token
SERVE_LOGGER = "ray.serve"          # Ray Serve's logger in this process (its client's INFO lines)
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# Bounds of a stop. Serve's own shutdown drains replicas for at most 5 s (the deployment's
# graceful_shutdown_timeout_s), behind HAProxy for its 6 s draining period (serving/ingress.py);
# a clean stop of a private server took 7 s (10 s behind HAProxy) on a 2-core CPU machine.
# ``stop`` waits STOP_TIMEOUT_S, then kills what is left.
SERVE_SHUTDOWN_TIMEOUT_S = 30.0
SERVE_START_TIMEOUT_S = 120.0       # Serve's controller and ingress: about 3.5 s on a 2-core CPU machine
STOP_TIMEOUT_S = 60.0
KILL_WAIT_S = 10.0                   # after SIGKILL: how long ``stop`` waits for the processes to vanish


# What each of the router's reasons (``router.RoutingDecision.reason``) means, for ``status``.
ROUTING_REASONS = {
    "prefix": "to the worker with the longest cached prefix",
    "adapter": "to a worker holding the request's LoRA adapter",
    "load": "to the least loaded worker",
    "only": "to the only worker that could take them",
    "round_robin": "round robin",
    "fallback": "while every worker was full (its KV blocks or its queue)",
}


class PortInUse(RuntimeError):
    """A port ``serve`` needs is taken by another program."""


def _check_port_free(host: str, port: int, what: str) -> None:
    """Raise ``PortInUse`` if something listens on ``host:port`` (bound as Serve's servers bind:
    with SO_REUSEADDR, so connections of an earlier server in TIME_WAIT do not count)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise PortInUse(f"{what} {port} on {host} is in use by another program; choose another "
                                f"port") from None


def check_ports_free(config: ClusterConfig) -> None:
    """The HTTP and gRPC ports of ``config`` are free on its host (``PortInUse`` otherwise)."""
    server = config.server
    for port, what in ((server.port, "HTTP port"), (server.grpc_port, "gRPC port")):
        if port:
            _check_port_free(server.host, port, what)


class Progress:
    """Start-up stages on stderr; on a terminal, a spinner with the elapsed time."""

    def __init__(self, stream: IO[str] | None = None) -> None:
        self.stream = stream or sys.stderr
        self.is_tty = self.stream.isatty()
        self._line_start = "\r" if self.is_tty else ""   # over a spinner's or progress bar's line

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
        except BaseException as exc:
            stop.set()
            if ticker:
                ticker.join()
            # Ctrl-C and SIGTERM while starting come as KeyboardInterrupt: the stage did not fail.
            ended = "interrupted" if isinstance(exc, KeyboardInterrupt) else "failed"
            print(f"{self._line_start}[!!] {label}: {ended} after {time.time() - start:.1f} s", file=self.stream,
                  flush=True)
            raise
        stop.set()
        if ticker:
            ticker.join()
        print(f"{self._line_start}[ok] {label} ({time.time() - start:.1f} s)", file=self.stream, flush=True)


def _log_to_console() -> None:
    """pagedserve's warnings (a worker Ray cannot place, ...) on stderr, with time and level,
    unless logging is configured already."""
    package = logging.getLogger("pagedserve")
    if package.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    handler.setLevel(logging.WARNING)
    package.addHandler(handler)


def serve_forever(config: ClusterConfig, address: str | None = None, progress: Progress | None = None,
                  stdout: IO[str] | None = None) -> int:
    """Bring the cluster and the API up, block until SIGINT/SIGTERM, tear down; exit status
    (2 when a port is taken or the model or the ingress cannot be served, 1 when the workers
    cannot start, 130 when interrupted while starting, 143 when stopped by SIGTERM while starting)."""
    progress = progress or Progress()
    stdout = stdout or sys.stdout
    # Before anything starts, cheapest first: the port is this server's, and free (checked
    # before the imports below, which take seconds), and the workers can serve the model.
    try:
        record = server_records.claim(config.server.port, config.server.host)
    except server_records.PortTaken as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        check_ports_free(config)
    except PortInUse as exc:
        server_records.release(record)
        print(f"error: {exc}", file=sys.stderr)
        return 2
    # Ctrl-C and SIGTERM ('pagedserve stop') interrupt the start-up whatever this process
    # inherited: a shell starts a script's background job with SIGINT ignored, and a server that
    # has started stops on it regardless.
    start_signals = _StartSignals()
    previous: dict = start_signals.install()
    joining = (address or os.environ.get("RAY_ADDRESS")) not in (None, "", "local")
    # Seconds of imports (Ray, Serve, torch, transformers) come before the model's config is
    # read: a stage, so that the console says at once what the server is doing.
    try:
        with progress.stage(CHECK_STAGE):
            ray_compat.import_ray_for_a_signal_handling_driver()
            import ray
            import ray.serve  # noqa: F401 - importing it sets Serve's logger to INFO: before the level below

            from .bootstrap import WorkerStartError, check_model, init_ray, start
            from .placement_watch import PlacementError
            from .serving import ingress
            from .serving.deployment import ServeStart, deploy

            logging.getLogger(SERVE_LOGGER).setLevel(logging.WARNING)  # the driver's "app ready" chatter
            model_path = config.model.resolve_path()
            model_config = check_model(config, model_path, with_class=False)
            # A private Ray's workers load this very checkpoint: its weights and tokenizer are
            # looked for here. Joining a cluster, each worker's node looks in its own copy.
            local_workers = not joining and not ray.is_initialized() and config.model.path is not None
            if local_workers and not config.model.source().is_hub_id:
                config.model.resolve_path(weights=True)
            # The rest of the model's checks import its transformers class (and torch's compiler
            # with it) and load its tokenizer: seconds of CPU, run beside Ray's start, awaited
            # before anything else starts.
            class_check = _on_a_thread("pagedserve-model-class-check", _check_model_code, model_config,
                                       model_path if local_workers else None, config.model.trust_remote_code)
    except (ValueError, OSError, KeyboardInterrupt) as exc:   # nothing has started yet
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        server_records.release(record)
        if not isinstance(exc, KeyboardInterrupt):
            print(f"error: {exc}", file=sys.stderr)
            return 2
        return start_signals.say_stopped("while starting")
    _log_to_console()
    stopping = threading.Event()
    owns_ray = is_private_ray = not ray.is_initialized()
    handle = None
    serve_start: ServeStart | None = None
    is_deploying = False
    prepared_env: dict[str, str | None] = {}
    try:
        if owns_ray:
            # Serve's processes read it when they start.
            prepared_env = ingress.prepare(config.server.ingress, joining=joining)
            label = f"joining the Ray cluster at {address}" if address else "starting a private Ray"
            with start_signals.deferred(), progress.stage(label):
                is_private_ray = init_ray(address, logging_level="WARNING")
        try:
            class_check.result()
        except (ValueError, OSError) as exc:
            print(f"error: {exc}", file=sys.stderr, flush=True)
            return 2
        record.is_private_ray = is_private_ray
        record.ray_address = ray.get_runtime_context().gcs_address
        record.ray_auth_mode = os.environ.get(RAY_AUTH_MODE_ENV)
        record.save()
        if not config.model.path:
            model = config.model
            with progress.stage(f"building the {model.arch}-{model.size} model (first start only)"):
                config.model.resolve_path()
        # The ingress is known before any worker starts, and Serve (its controller and ingress)
        # starts while the workers load their model: the application needs only their handle.
        choice = ingress.choose(config.server.ingress)
        serve_start = ServeStart(config, quiet=True).begin()
        num_workers = sum(group.min_workers for group in config.workers)
        try:
            with progress.stage(f"starting the KV manager and {num_workers} worker(s): loading the model, "
                                "allocating KV pools (Ray Serve starts meanwhile)", spinner=False):
                handle = start(config, show_progress=progress.is_tty, is_private_ray=is_private_ray)
        except (PlacementError, WorkerStartError) as exc:
            print(f"error: {exc}", file=sys.stderr, flush=True)
            return 1
        apis = "HTTP and gRPC" if config.server.grpc_port is not None else "HTTP"
        is_deploying = True
        with progress.stage(f"deploying the {apis} API on Ray Serve"):
            serve_start.wait(SERVE_START_TIMEOUT_S)
            endpoints = deploy(handle, config, quiet=True, ingress_choice=choice, serve_started=True)
        record.state, record.endpoints, record.model, record.ingress = "serving", endpoints, handle.model_name, choice.name
        # What `bench serve --offline-baseline` runs offline: the first group's engine.
        record.model_path = handle.model_path
        record.engine = {**config.engine.model_dump(mode="json", exclude_defaults=True), **config.workers[0].engine}
        if config.model.trust_remote_code:
            record.engine["trust_remote_code"] = True
        record.save()
        http = endpoints["http"]
        print(f"pagedserve is serving '{handle.model_name}' (context {handle.max_model_len} tokens, "
              f"{num_workers} worker(s), {config.num_ingress_replicas} ingress replica(s))", file=stdout)
        print(f"  OpenAI API  {http}/v1   (e.g. curl {http}/v1/models)", file=stdout)
        if "grpc" in endpoints:
            print(f"  gRPC        {endpoints['grpc']}", file=stdout)
        print(f"  metrics     {http}/metrics      health {http}/health", file=stdout)
        print(f"  ingress     {choice.describe()}", file=stdout)
        if config.server.api_key or os.environ.get("PAGEDSERVE_API_KEY"):
            print("  an API key is required: send 'Authorization: Bearer <key>'", file=stdout)
        print(f"Press Ctrl-C (or run 'pagedserve stop --port {config.server.port}') to stop.", file=stdout,
              flush=True)
        for sig in STOP_SIGNALS:   # from here on a stop signal ends the wait below
            signal.signal(sig, lambda *_: stopping.set())
        while not stopping.wait(0.5):
            pass
        print("stopping...", file=sys.stderr, flush=True)
        return 0
    except ingress.IngressError as exc:   # before any worker starts
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:   # Ctrl-C or SIGTERM during start-up: what started is torn down below
        return start_signals.say_stopped("while starting; stopping...")
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if serve_start is not None:   # never shut Serve down while it still starts
            with contextlib.suppress(Exception):
                serve_start.wait(SERVE_START_TIMEOUT_S)
        started_serve = serve_start is not None and serve_start.found_running is False
        _tear_down(record, handle, serve_start is not None, started_serve, is_deploying, owns_ray, is_private_ray,
                   progress)
        ingress.restore(prepared_env)
        server_records.release(record)


def _on_a_thread(name: str, function: Callable[..., object], *args) -> concurrent.futures.Future:
    """``function(*args)`` on a daemon thread named ``name``; the future holds its result or
    what it raised."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        try:
            future.set_result(function(*args))
        except BaseException as exc:   # re-raised by ``future.result()``, in the caller's thread
            future.set_exception(exc)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


def _check_model_code(model_config, tokenizer_path: str | None, trust_remote_code: bool) -> None:
    """The model checks that import its code: its transformers class, and where
    ``tokenizer_path`` is given, its tokenizer."""
    from pagedserve.workers.model.model_support import check_causal_lm_class

    from .bootstrap import check_tokenizer_loads

    check_causal_lm_class(model_config)
    if tokenizer_path is not None:
        check_tokenizer_loads(tokenizer_path, trust_remote_code)


class _StartSignals:
    """SIGINT and SIGTERM while the server starts: each raises ``KeyboardInterrupt``, and
    ``received`` says which it was. Ray's blocking calls let only that through (any other
    exception from a signal handler inside one became a ``SystemError``), and no
    ``except Exception`` on the way swallows it."""

    def __init__(self) -> None:
        self.received: int | None = None

    def interrupt(self, signum: int, _frame) -> None:
        self.received = signum
        raise KeyboardInterrupt

    def say_stopped(self, when: str) -> int:
        """Say on stderr which signal stopped the start-up, ``when``; its exit status, 128 + it."""
        terminated = self.received == signal.SIGTERM
        print(f"{'stopped (SIGTERM)' if terminated else 'interrupted'} {when}", file=sys.stderr, flush=True)
        return 128 + (signal.SIGTERM if terminated else signal.SIGINT)

    def install(self) -> dict:
        """``interrupt`` for both; the handlers they had."""
        return {sig: signal.signal(sig, self.interrupt) for sig in STOP_SIGNALS}

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """Both held until the block has ended, then raised, and ``interrupt`` their handler
        again. A Ray interrupted inside ``ray.init`` is left half started (its process crashed as
        it exited, SIGSEGV, where it should end with 130). Ray's own handlers are kept out:
        ``ray.init``'s (``sys.exit`` wherever the main thread is; ``ray_compat.sigterm_handler_kept``),
        and the native one of its core worker, which printed a stack and aborted the process
        (134) on a SIGTERM that came before ours were installed again
        (``ray_compat.import_ray_for_a_signal_handling_driver``)."""
        held: list[int] = []
        for sig in STOP_SIGNALS:
            signal.signal(sig, lambda signum, _: held.append(signum))
        try:
            with ray_compat.sigterm_handler_kept():
                yield
        finally:
            self.install()
        if held:
            self.interrupt(held[0], None)


def _tear_down(record: ServerRecord, handle, has_serve: bool, started_serve: bool, has_app: bool, owns_ray: bool,
               is_private_ray: bool, progress: Progress) -> None:
    """Stop Serve on a private Ray (``has_serve``: this process started or joined it) or, on a
    shared one, the Serve application (``has_app``: it was deployed) and Serve itself where this
    process started it (``started_serve``) and no other application runs there; then the cluster
    and a Ray this process started. One named stage at a time (on the console and in ``record``,
    where ``stop`` reads it); a stage that fails is named as failed and the next one runs."""
    import ray

    record.state = "stopping"
    stages: list[tuple[str, Callable[[], object]]] = []
    if ray.is_initialized():
        if is_private_ray and has_serve:
            stages.append(("shutting down Ray Serve (its replicas drain, its proxies stop)",
                           lambda: ray_compat.shutdown_serve(SERVE_SHUTDOWN_TIMEOUT_S)))
        elif not is_private_ray:
            from ray import serve

            from .serving.deployment import APP_NAME

            if has_app:
                stages.append((f"deleting the Serve application '{APP_NAME}' (its replicas drain)",
                               lambda: serve.delete(APP_NAME)))
            if started_serve:
                stages.append(("shutting down the Ray Serve this server started, unless other applications "
                               "run on it", _shut_down_serve_unless_used))
    if handle is not None:
        stages.append(("stopping the workers and the KV manager", handle.shutdown))
    if owns_ray:
        stages.append(("stopping the private Ray" if is_private_ray else "leaving the Ray cluster", ray.shutdown))
    if is_private_ray:   # Serve's HAProxy, as it runs now: one it starts while Ray stops may outlive it
        from .serving import ingress

        configs = ingress.haproxy_configs(processes.descendants(os.getpid()))
        stages.append(("ending any HAProxy that Serve left", lambda: _end_stray_haproxy(configs)))
    for label, action in stages:
        record.stage = label
        with contextlib.suppress(Exception):
            record.save()
        with contextlib.suppress(Exception), progress.stage(label):
            action()


def _shut_down_serve_unless_used() -> None:
    """On a shared cluster: shut down the Ray Serve this server started, as ``serve`` found the
    cluster without it, unless applications other than pagedserve's now run on it."""
    from ray import serve

    from .serving.deployment import APP_NAME

    if ray_compat.serve_controller() is None:   # its start failed before the controller was up
        return
    others = sorted(name for name in serve.status().applications if name != APP_NAME)
    if others:
        print(f"Ray Serve stays up: it runs other applications ({', '.join(others)})", flush=True)
        return
    ray_compat.shutdown_serve(SERVE_SHUTDOWN_TIMEOUT_S)


def _choose(records: list[ServerRecord], port: int | None, command: str, hint: str = "") -> ServerRecord | None:
    """The record ``--port`` names, else the only one (None if none runs); ``ValueError``
    listing the running servers when there is no such one."""
    if port is not None:
        chosen = [record for record in records if record.port == port]
        if not chosen:
            raise ValueError(f"no pagedserve server runs on port {port} on this machine"
                             + (":" if records else "") + _running_list(records))
        return chosen[0]
    if len(records) > 1:
        raise ValueError(f"{len(records)} pagedserve servers run on this machine; name one with "
                         f"'pagedserve {command} --port PORT'{hint}:" + _running_list(records))
    return records[0] if records else None


def _running_list(records: list[ServerRecord]) -> str:
    return "".join(f"\n  {record.describe()}" for record in records) if records else ""


def stop_server(timeout_s: float = STOP_TIMEOUT_S, port: int | None = None, stop_all: bool = False,
                stdout: IO[str] | None = None, stderr: IO[str] | None = None) -> int:
    """Stop the server on ``port``, every server (``stop_all``), or the only one running on this
    machine: SIGTERM, then its stages as it goes through them, then, after ``timeout_s``,
    SIGKILL to it and to every process under it. Exit status 0 once they are gone."""
    stdout, stderr = stdout or sys.stdout, stderr or sys.stderr
    records = server_records.running()
    if not records:
        print("no pagedserve server is running on this machine (started by 'pagedserve serve')", file=stderr)
        return 1
    try:
        targets = records if stop_all else [_choose(records, port, "stop", hint=", or all of them with --all")]
    except ValueError as exc:
        print(f"error: {exc}", file=stderr)
        return 1
    for record in targets:
        print(f"stopping {record.describe()}: waiting up to {timeout_s:g} s for it to shut down, then "
              "killing what is left of it", file=stdout, flush=True)
        with contextlib.suppress(ProcessLookupError):
            os.kill(record.pid, signal.SIGTERM)
    return _wait_stopped(targets, time.monotonic(), timeout_s, stdout, stderr)


def _wait_stopped(targets: list[ServerRecord], started: float, timeout_s: float, stdout: IO[str],
                  stderr: IO[str]) -> int:
    """Follow ``targets`` until they exit or ``timeout_s`` passes; then kill the rest."""
    remaining = list(targets)
    stages: dict[int, str | None] = {record.port: None for record in targets}
    while remaining:
        for record in list(remaining):
            if not server_records.is_alive(record):
                remaining.remove(record)
                print(f"stopped pagedserve on port {record.port} (pid {record.pid}) in "
                      f"{time.monotonic() - started:.1f} s", file=stdout, flush=True)
                continue
            current = server_records.reread(record)
            stage = current.stage if current else None
            if stage and stage != stages[record.port]:
                stages[record.port] = stage
                where = f"port {record.port}: " if len(targets) > 1 else ""
                print(f"  {where}{stage}", file=stdout, flush=True)
        if not remaining or time.monotonic() - started >= timeout_s:
            break
        time.sleep(0.2)
    status = 0
    for record in remaining:
        if not _kill(record, stages[record.port], timeout_s, stdout, stderr):
            status = 1
    return status


def _end_stray_haproxy(configs: set[str]) -> None:
    from .serving import ingress

    ended = ingress.end_stray_haproxy(configs)
    if ended:
        print(f"ended {len(ended)} HAProxy processes that Serve's ingress left running as Ray stopped "
              f"(pids {ended})", file=sys.stderr, flush=True)


def _kill(record: ServerRecord, stage: str | None, timeout_s: float, stdout: IO[str], stderr: IO[str]) -> bool:
    """SIGKILL a server that outlived its stop's bound, and every process under it; its record
    goes too. True once they are all gone."""
    under = processes.descendants(record.pid)
    doing = f" (still {stage})" if stage else ""
    print(f"{record.describe()} did not exit within {timeout_s:g} s{doing}: killing it and the "
          f"{len(under)} processes under it", file=stderr, flush=True)
    for pid in [record.pid, *under]:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + KILL_WAIT_S
    left = [pid for pid in [record.pid, *under] if processes.is_running(pid)]
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = [pid for pid in left if processes.is_running(pid)]
    server_records.release(record)
    if left:
        print(f"could not kill pids {left} of pagedserve on port {record.port}", file=stderr)
        return False
    print(f"stopped pagedserve on port {record.port} (pid {record.pid}): killed", file=stdout, flush=True)
    if not record.is_private_ray:
        print(f"  its Serve application may remain on the Ray cluster at {record.ray_address} "
              "(Serve's controller and replicas are the cluster's)", file=stderr)
    return True


def fetch_status(address: str | None = None, timeout_s: float = 30.0, port: int | None = None) -> dict:
    """Stats from the running Serve application (``Frontend.stats``: ``cluster.stats.gather_stats``):
    the one at ``address``, else the server on ``port`` (or the only one running here), else ``auto``."""
    record = None
    if address is None:
        record = _choose(server_records.running(), port, "status")
        if record is not None and not record.ray_address:
            raise RuntimeError(f"{record.describe()} has not joined Ray yet")
        address = record.ray_address if record else "auto"
    if record and record.ray_auth_mode:
        # Ray reads this when it is imported: the recorded cluster wants its token.
        os.environ.setdefault(RAY_AUTH_MODE_ENV, record.ray_auth_mode)
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
        if worker.get("spec_decode_num_drafts"):
            lines.append(f"  {worker_id}: speculative decoding: mean acceptance length "
                         f"{worker['spec_decode_mean_acceptance_length']:.2f} ({worker['spec_decode_num_drafts']} drafts, "
                         f"{worker['spec_decode_num_accepted_tokens']} of {worker['spec_decode_num_draft_tokens']} "
                         "proposed tokens accepted)")
        if worker.get("spec_decode_draft_model"):
            lines.append(f"  {worker_id}: draft model {worker['spec_decode_draft_model']}: its KV takes "
                         f"{worker['spec_decode_draft_kv_bytes_per_block']} bytes of each block, and "
                         f"{worker['spec_decode_draft_scratch_blocks']} scratch blocks of its own")
        lora = worker.get("lora")
        if lora:
            in_slots = [name for name in lora["slot_adapters"] if name is not None]
            lines.append(f"  {worker_id}: LoRA adapters: {', '.join(in_slots) or 'none'} in "
                         f"{len(in_slots)} of {lora['max_loras']} slots, {lora['num_host_adapters']} of "
                         f"{lora['max_cpu_loras']} in host memory; running {', '.join(lora['running_adapters']) or '-'}, "
                         f"waiting {', '.join(lora['waiting_adapters']) or '-'}; {lora['num_adapter_reads']} reads, "
                         f"{lora['num_slot_loads']} slot loads ({lora['num_slot_evictions']} evicting)")
            if lora.get("lora_paging") == "unified":
                lines.append(f"  {worker_id}: LoRA pages in the KV pool: {', '.join(lora['paged_adapters']) or 'none'} "
                             f"hold {lora['adapter_pages']} device blocks ({lora['bytes_per_page'] / 2**10:.0f} KiB "
                             f"each); {lora['num_page_swap_ins']} swapped in, {lora['num_page_evictions']} evicted")
        lines.extend(_rank_lines(worker))
    reasons = stats.get("router", {}).get("reasons")
    if reasons:
        lines.append("routing decisions: " + ", ".join(
            f"{count} {ROUTING_REASONS.get(reason, reason)}" for reason, count in sorted(reasons.items())))
    return "\n".join(lines)
