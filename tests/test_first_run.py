"""A first run, as a new user makes it: ``pagedserve serve`` with nothing configured and an
empty model cache, a request, ``pagedserve status``, ``pagedserve stop``. The console stays
clean: no ERROR-level line and none of Ray's anti-pattern warnings, from our processes or
forwarded from Ray's, and ``status`` starts with its table.

``serve`` starts its own local Ray (``RAY_ADDRESS`` unset); the model cache and the state file
that ``status`` and ``stop`` read are the test's own (``PAGEDSERVE_CACHE_DIR``), so a server
someone else runs on this machine is never touched.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")

from served_cluster import free_port  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

# Ray's C++ log lines carry their level after the time ("[2026-11-26 12:58:31,838 E 24529 24529]"),
# Python's logging its level name; a traceback is an error whatever printed it, and so is a
# task that failed (Ray's core worker reports those as "Task X.y failed ...", level or not).
ERROR_LINE = re.compile(r"\[\d{4}-\d\d-\d\d [\d:,]+ [EF] \d+ \d+\]|\bERROR\b|\bCRITICAL\b|^Traceback|\bTraceback \("
                        r"|\bTask \S+ failed\b")
ANTI_PATTERNS = (
    "Using blocking ray.get inside async actor",          # blocks an async actor's event loop
    "has constructor arguments in the object store",     # an actor restart that would fail
    "is very large",                                     # a large function or argument pickled per call
    "anti-pattern",
)
SERVE_READY_S = 300   # first start on a loaded 2-core machine: Ray, the model build, a worker, Serve


def _problems(output: str) -> list[str]:
    return [line for line in output.splitlines()
            if ERROR_LINE.search(line) or any(pattern in line for pattern in ANTI_PATTERNS)]


def test_the_problem_lines_are_recognised():
    """The lines a first run printed before their causes were fixed (the last on every stop),
    and a clean one."""
    relay = ("[2026-11-26 12:58:45,159 E 24991 25200] core_worker.cc:2465: Actor pagedserve-kv-relay-a53b "
             "with class name: 'KVRelay' and ID: '03a9' has constructor arguments in the object store and "
             "max_restarts > 0.")
    blocking = ("(Worker pid=24991) Using blocking ray.get inside async actor. This blocks the event loop.")
    shutdown = ("\x1b[33m(raylet)\x1b[0m Task ServeController.graceful_shutdown failed. There are infinite retries "
                "remaining, so the task will be retried. Error: The actor is dead because it was killed by `ray.kill`.")
    clean = "[ok] starting the KV manager and 1 worker(s): loading the model, allocating KV pools (29.9 s)"
    assert _problems("\n".join([relay, blocking, shutdown, clean])) == [relay, blocking, shutdown]


def test_first_serve_request_status_stop_print_no_error_and_no_anti_pattern(tmp_path):
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    env["PAGEDSERVE_CACHE_DIR"] = str(tmp_path / "cache" / "models")   # empty: a first run
    port = free_port()
    serve = subprocess.Popen([sys.executable, "-m", "pagedserve", "serve", "--port", str(port)], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output: list[str] = []
    ready = threading.Event()

    def read() -> None:
        for line in serve.stdout:
            output.append(line)
            if "pagedserve is serving" in line:
                ready.set()
        serve.wait()   # as a shell would: `pagedserve stop` waits for the pid to vanish, not a zombie

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert ready.wait(SERVE_READY_S), "serve did not come up:\n" + "".join(output)
        completion = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120, json={
            "model": "pagedserve-llama-tiny", "prompt": "Once upon a time", "max_tokens": 8})
        assert completion.status_code == 200, completion.text
        status = subprocess.run([sys.executable, "-m", "pagedserve", "status"], env=env, capture_output=True,
                                text=True, timeout=180)
        assert status.returncode == 0, status.stderr
        assert status.stdout.startswith("model pagedserve-llama-tiny\n"), status.stdout
        stop = subprocess.run([sys.executable, "-m", "pagedserve", "stop"], env=env, capture_output=True,
                              text=True, timeout=180)
        assert stop.returncode == 0, stop.stderr
        assert serve.wait(timeout=120) == 0
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait(timeout=30)
        reader.join(timeout=30)
    console = "".join(output) + status.stdout + status.stderr + stop.stdout + stop.stderr
    assert not _problems(console), "the first run printed:\n" + "\n".join(_problems(console))
    # Serve's client in `serve` itself keeps its INFO lines to itself ("Connecting to existing Serve
    # app ... New http_options/controller_options will not be applied"): pagedserve says what it does.
    driver_lines = [line for line in output if f" serve {serve.pid} -- " in line]
    assert not driver_lines, driver_lines
