"""Two ingress replicas over one cluster of two workers (``server.num_replicas`` unset: one
per worker): both serve, worker health is watched by the one controller actor only, and a
hung worker is restarted once while the requests it held finish elsewhere with the output
they would have had.

One Ray instance, cluster and Serve application for the module.
"""

from __future__ import annotations

import concurrent.futures
import time
from dataclasses import dataclass

import pytest

ray = pytest.importorskip("ray")
httpx = pytest.importorskip("httpx")

from pagedserve.workers.sample.sampling_params import SamplingParams  # noqa: E402
from pagedserve.workers.actor.worker import FAULT_INJECTION_ENV, stall_timeout_s  # noqa: E402
from served_cluster import cluster_config, running_cluster  # noqa: E402
from polling import wait_for  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

MODEL = "tiny-replicated"
ENGINE = {"num_device_blocks": 256, "swap_space_gb": 0.001}
STEP_TIMEOUT_S = 3.0
HEALTH_CHECK_PERIOD_S = 0.5  # the cluster's (default 0.25): at most one probe per worker this often
PROMPTS = [f"Request {i}: the paged KV cache splits every sequence into blocks" for i in range(8)]
MAX_TOKENS = 16


@dataclass
class Served:
    handle: object
    base_url: str


@pytest.fixture(scope="module")
def served(tiny_model):
    from pagedserve.cluster.serving.deployment import deploy

    config = cluster_config(tiny_model("llama"), MODEL, ENGINE, num_workers=2, step_timeout_s=STEP_TIMEOUT_S,
                            num_replicas=None)
    config["health_check_period_s"] = HEALTH_CHECK_PERIOD_S
    with running_cluster(config, runtime_env={"env_vars": {FAULT_INJECTION_ENV: "1"}}) as cluster:
        endpoints = deploy(cluster.handle, cluster.config, quiet=True)
        yield Served(cluster.handle, endpoints["http"])


def _report(handle):
    return ray.get(handle.controller.report.remote(), timeout=10)


def _complete(base_url: str, prompt: str) -> str:
    response = httpx.post(f"{base_url}/v1/completions", timeout=300, json={
        "model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True})
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "length"
    return choice["text"]


def test_two_replicas_and_one_health_monitor(served):
    from ray import serve

    from pagedserve.cluster.controller import CONTROLLER_NAME

    status = serve.status().applications["pagedserve"].deployments["PagedServe"]
    assert status.replica_states.get("RUNNING") == 2, status
    named = [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"] == CONTROLLER_NAME]
    assert len(named) == 1, named
    # Both replicas hold a handle and serve; the workers still see one monitor's probes.
    for prompt in PROMPTS[:4]:
        _complete(served.base_url, prompt)
    worker = served.handle.workers["worker-1"]
    start = time.time()
    before = ray.get(worker.heartbeat.remote(), timeout=10)
    time.sleep(4.0)
    after = ray.get(worker.heartbeat.remote(), timeout=10)
    elapsed = time.time() - start
    probes = after["num_heartbeats"] - before["num_heartbeats"] - 1  # less the test's own
    assert after["pid"] == before["pid"]
    # One monitor at the configured period: the default's, or a second monitor's, would exceed it.
    assert 1 <= probes <= elapsed / HEALTH_CHECK_PERIOD_S + 2, \
        f"{probes} probes in {elapsed} s: more than one monitor, or not at health_check_period_s"


def test_a_hung_worker_is_restarted_once_while_both_replicas_serve(served, tiny_model):
    from pagedserve.workers.offline.llm import LLM

    handle = served.handle
    expected = [o.outputs[0].text for o in LLM(tiny_model("llama"), **ENGINE).generate(
        PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))]
    hung = handle.workers["worker-0"]
    pids = {ray.get(hung.heartbeat.remote(), timeout=10)["pid"]}
    ray.get(hung.inject_stall.remote(120.0))  # its engine loop sleeps at its next step
    fault_time = time.time()
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        texts = list(pool.map(lambda prompt: _complete(served.base_url, prompt), PROMPTS))
    assert texts == expected  # the hung worker's requests resumed elsewhere, token for token

    def restarted() -> bool:
        try:
            pids.add(ray.get(hung.heartbeat.remote(), timeout=2)["pid"])
        except Exception:
            return False  # restarting
        report = _report(handle)
        return len(pids) > 1 and "worker-0" in report.alive_workers
    wait_for(restarted, 180, "the hung worker's restart")
    # Stay a while past another stall timeout: no second restart, from anyone.
    settle_until = time.time() + stall_timeout_s(STEP_TIMEOUT_S) + 2
    while time.time() < settle_until:
        pids.add(ray.get(hung.heartbeat.remote(), timeout=10)["pid"])
        time.sleep(0.5)
    report = _report(handle)
    assert len(pids) == 2, f"worker-0 ran as {sorted(pids)} since the fault at {fault_time:.0f}"
    assert report.liveness["worker-0"]["num_restarts_requested"] == 1
    assert report.liveness["worker-1"]["num_restarts_requested"] == 0
    assert report.alive_workers == {"worker-0", "worker-1"}
    # Both replicas admitted requests.
    admitted: dict[int, int] = {}
    for _ in range(40):
        server = httpx.get(f"{served.base_url}/stats", timeout=30).json()["server"]
        admitted[server["pid"]] = server["num_admitted"]
    assert len(admitted) == 2 and all(admitted.values()), admitted
    handle.wait_idle(timeout=60)
    assert handle.num_used_blocks() == 0
    handle.check_integrity()
