"""A first run, as a new user makes it: ``pagedserve serve`` with nothing configured and an
empty model cache, a request, ``pagedserve bench serve --cpu-per-token --offline-baseline``,
``pagedserve status``, ``pagedserve stop``. The console stays clean: no ERROR-level line and
none of Ray's anti-pattern warnings, from our processes or forwarded from Ray's, and the
server's own console none of the noise pagedserve keeps off it (``KEPT_OFF``); ``status``
starts with its table, and the bench reports every process group of the server.

``serve`` starts its own local Ray (``RAY_ADDRESS`` unset); the model cache and the state file
that ``status`` and ``stop`` read are the test's own (``PAGEDSERVE_CACHE_DIR``), so a server
someone else runs on this machine is never touched.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import threading

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
# What pagedserve keeps off the console: Ray's notice that token authentication is on (a private
# Ray turns it on without it), transformers' per-tensor loading bar (from the engine core), and
# the core's warning of a channel whose reader left with nothing running (every replica's, as
# Serve stops).
KEPT_OFF = ("Token authentication is enabled", "Loading weights", "disconnected; abort")
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
    # A new user's shell: no Ray address, no auth mode (a Ray the test process started sets one).
    env = {key: value for key, value in os.environ.items() if key not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}
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
        bench = subprocess.run([sys.executable, "-m", "pagedserve", "bench", "serve", "--port", str(port),
                                "--num-requests", "8", "--random-input-len", "8", "--random-output-len", "64",
                                "--max-concurrency", "4", "--num-warmups", "2", "--cpu-per-token",
                                "--offline-baseline", "--offline-cpus", str(max(os.sched_getaffinity(0))),
                                "--no-progress", "--out", str(tmp_path / "cpu.json")],
                               env=env, capture_output=True, text=True, timeout=300)
        assert bench.returncode == 0, bench.stdout + bench.stderr
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
    console = "".join(output) + bench.stderr + status.stdout + status.stderr + stop.stdout + stop.stderr
    assert not _problems(console), "the first run printed:\n" + "\n".join(_problems(console))
    kept_off = [line for line in "".join(output).splitlines() if any(text in line for text in KEPT_OFF)]
    assert not kept_off, kept_off
    _check_cpu_per_token(json.loads((tmp_path / "cpu.json").read_text()), bench.stdout,
                         haproxy="ingress     HAProxy" in console)
    # Serve's client in `serve` itself keeps its INFO lines to itself ("Connecting to existing Serve
    # app ... New http_options/controller_options will not be applied"): pagedserve says what it does.
    driver_lines = [line for line in output if f" serve {serve.pid} -- " in line]
    assert not driver_lines, driver_lines


def _check_cpu_per_token(data: dict, printed: str, haproxy: bool) -> None:
    """``bench serve --cpu-per-token --offline-baseline`` of 8 requests x 64 tokens, 4 at a time:
    every group is reported and the server's total is their sum; the offline engine holds four
    at a time too, and the engine's steps served and offline are split into their causes."""
    cpu = data["cpu_per_token"]
    assert data["completed"] == 8 and cpu["num_output_tokens"] == 8 * 64
    groups = cpu["groups"]
    expected = {"serve replica", "serve proxy actor", "worker 0", "serve controller", "cluster controller",
                "kv manager and relays", "pagedserve serve (driver)", "everything else"}
    if haproxy:
        expected.add("haproxy")
    assert expected <= set(groups), groups.keys()
    for label, group in groups.items():
        assert group["cpu_s"] >= 0 and math.isfinite(group["us_per_token"]) and group["pids"], label
    assert groups["serve replica"]["cpu_s"] > 0 and groups["worker 0"]["cpu_s"] > 0
    assert cpu["server_total"]["cpu_s"] == pytest.approx(sum(g["cpu_s"] for g in groups.values()))
    assert cpu["server_total"]["us_per_token"] == pytest.approx(sum(g["us_per_token"] for g in groups.values()))
    assert cpu["client"]["cpu_s"] > 0
    offline = data["offline"]
    assert offline["num_output_tokens"] == 8 * 64 and offline["threads"] == 1 and offline["us_per_token"] > 0
    assert offline["cpus"] == [max(os.sched_getaffinity(0))]   # the process ran there only
    rounds = offline["rounds_us_per_token"]     # three timed rounds by default; the baseline is their median
    assert len(rounds) == 3 and rounds == sorted(rounds) and offline["us_per_token"] == rounds[1]
    assert offline["engine_steps"]["tokens"] == 8 * 64    # the median round's own steps, not the three's
    assert cpu["serving_adds_us_per_token"] == pytest.approx(
        cpu["server_total"]["us_per_token"] - offline["us_per_token"])
    assert "serving adds" in printed and "serve replica" in printed
    steps = data["engine_steps"]
    served_steps, offline_steps = steps["served"], steps["offline"]
    assert served_steps["tokens"] == offline_steps["tokens"] == 8 * 64   # the window's, warm-ups outside it
    for w in (served_steps, offline_steps):   # four requests at most at once, offline as served
        assert 1 <= w["tokens_per_step"] <= 4 and w["step_ms"] > 0 and w["cpu_us_per_step"] > 0
    for w in (served_steps, offline_steps):   # every request's wait at the engine, inside the window
        assert w["requests"] == 8 and w["first_token_ms"] > w["queue_ms"] >= 0
    assert "first tokens" in printed
    assert served_steps["cpu_s"] == pytest.approx(groups["engine core 0"]["cpu_s"])
    assert set(served_steps["phase_us_per_step"]) >= {"step", "outputs", "send"}
    split = steps["split"]
    assert split["fewer_tokens_per_step_us"] + split["costlier_steps_us"] == pytest.approx(
        split["excess_us_per_token"])
    assert "engine steps over the load" in printed
