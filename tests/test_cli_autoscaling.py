"""Smoke test through the CLI, as a user would: the shipped fake-provider files, then
``pagedserve serve --address auto``, a request, ``pagedserve status --json``, ``pagedserve stop``.

The test starts its own fake autoscaling cluster (``RAY_FAKE_CLUSTER=1 ray start --head
--autoscaling-config=configs/fake-autoscaling/cluster.yaml``, with its own port and temp
dir) and stops exactly that cluster's processes at the end. It never runs ``ray stop``:
on a shared machine that ends every Ray cluster, not only this one. ``RAY_ADDRESS``
points ``--address auto`` at this cluster.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from fake_cluster import SERVE_FILE, FakeAutoscalingCluster  # noqa: E402
from served_cluster import free_port  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(900)]

STATES = {"starting", "ready", "draining", "dead"}


def _cli(*args: str, env: dict, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pagedserve", *args], env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_serve_request_status_stop_on_the_fake_autoscaling_cluster(tmp_path):
    cluster = FakeAutoscalingCluster(tmp_path / "ray").start()
    env = {**os.environ, "RAY_ADDRESS": cluster.address, "RAY_AUTH_MODE": cluster.env["RAY_AUTH_MODE"],
           "PAGEDSERVE_CACHE_DIR": str(tmp_path / "cache" / "models")}
    port = free_port()
    serve = subprocess.Popen([sys.executable, "-m", "pagedserve", "serve", "--address", "auto",
                              "--config", str(SERVE_FILE), "--port", str(port)],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output: list[str] = []
    def read_and_reap() -> None:
        output.extend(serve.stdout)
        serve.wait()  # as a shell would: `pagedserve stop` waits for the pid to vanish, not a zombie

    reader = threading.Thread(target=read_and_reap, daemon=True)
    reader.start()
    base_url = f"http://127.0.0.1:{port}"
    try:
        # `serve` announces itself once min_replicas workers are ready (a fake GPU node had to come up).
        deadline = time.time() + 300
        while not any("pagedserve is serving" in line for line in output):
            assert serve.poll() is None, "".join(output)
            assert time.time() < deadline, "".join(output)
            time.sleep(0.5)
        # Until that node came, `serve` said what it waited for (the group, what it asks, what is free).
        waits = [line for line in output if "waiting for Ray's autoscaler to add a node" in line]
        assert waits and "worker group 0 (mixed): each worker asks for CPU 1, GPU 1" in waits[0], "".join(output)
        health = httpx.get(base_url + "/health", timeout=30).json()
        assert health["status"] == "ok" and health["workers"]["ready"] >= 1, health

        client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        completion = client.completions.create(model=model, prompt="The fake cluster says", max_tokens=8,
                                               temperature=0.0, extra_body={"ignore_eos": True})
        assert completion.usage.completion_tokens == 8

        status = _cli("status", "--json", env=env)
        assert status.returncode == 0, status.stderr
        stats = json.loads(status.stdout)
        workers = stats["workers"]
        assert workers and all(w["state"] in STATES for w in workers.values()), workers
        assert sum(1 for w in workers.values() if w["state"] == "ready") >= 1
        assert sum(w.get("num_generated_tokens", 0) for w in workers.values()) >= 8
        assert stats["scaling"]["counts"]["ready"] >= 1

        stop_start = time.time()
        stop = _cli("stop", "--timeout", "300", env=env, timeout=360)
        assert stop.returncode == 0, stop.stderr + "".join(output[-40:])
        assert serve.wait(timeout=120) == 0, "".join(output)
        print(f"\nCLI smoke: serve answered, status listed {len(workers)} worker(s), "
              f"stop took {time.time() - stop_start:.0f} s")
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait(timeout=30)
        cluster.stop()
    assert cluster.pids() == []
