"""A ``pagedserve serve`` in a process of its own, for the benchmarks that load one over HTTP:
started with the given arguments, waited for until ``/health`` answers and its record says it
serves, stopped."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request

LOG_TAIL_CHARS = 4000   # of a server's output, in the error when it does not start


def wait_ready(url: str, server: subprocess.Popen, timeout_s: float) -> None:
    """Return once ``url``'s ``/health`` answers 200 and the server's record says it serves;
    ``RuntimeError`` if the server exits first, ``TimeoutError`` after ``timeout_s``.

    The record is written just after the HTTP API answers: a probe that reads it at once (the
    ingress of ``--cpu-per-token``) could otherwise find it still starting."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with {server.returncode}")
        if _answers_health(url) and _record_state(server.pid) == "serving":
            return
        time.sleep(0.5)
    raise TimeoutError(f"the server did not answer /health and record itself serving within {timeout_s} s")


def _answers_health(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
            return response.status == 200
    except OSError:
        return False


def _record_state(pid: int) -> str | None:
    from pagedserve.cluster import server_records

    return next((record.state for record in server_records.running() if record.pid == pid), None)


def start_server(args: list[str], port: int, log_path: str, env: dict | None = None,
                 timeout_s: float = 900.0) -> subprocess.Popen:
    """``pagedserve serve --port PORT ARGS...``, its output to ``log_path``, once it serves."""
    log = open(log_path, "w")
    server = subprocess.Popen([sys.executable, "-m", "pagedserve", "serve", "--port", str(port), *args],
                              env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_ready(f"http://127.0.0.1:{port}", server, timeout_s)
    except BaseException as exc:
        server.kill()
        log.flush()
        with open(log_path, errors="replace") as f:
            tail = f.read()[-LOG_TAIL_CHARS:]
        raise RuntimeError(f"{exc}; the end of its output ({log_path}):\n{tail}") from exc
    return server


def stop_server(server: subprocess.Popen, timeout_s: float = 120.0) -> None:
    """SIGTERM (what ``pagedserve stop`` sends), then a kill after ``timeout_s``."""
    server.terminate()
    try:
        server.wait(timeout_s)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait(30)
