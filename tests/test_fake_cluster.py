"""The fake autoscaling cluster (configs/fake-autoscaling/) itself.

One cluster for the module (``tests/fake_cluster.py``): Ray's fake multi-node provider adds
``{CPU: 1, GPU: 1}`` nodes when actors wait for a GPU and removes them once idle. The CLI
served on such a cluster, as a user runs it, is tests/test_cli_autoscaling.py.
"""

from __future__ import annotations

import subprocess
import time

import pytest

from fake_cluster import FakeAutoscalingCluster

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(900)]

NODE_TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def fake_cluster(tmp_path_factory):
    """The module's fake autoscaling cluster, this driver connected; only its processes are ended."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    for attempt in range(3):  # the head must register within Ray's fixed 30 s: a loaded machine can miss it
        # Idle nodes go after 3 s rather than the shipped file's 12, and the autoscaler looks every
        # second rather than every 5: the test waits for nodes to come and go.
        cluster = FakeAutoscalingCluster(tmp_path_factory.mktemp("fake-cluster"), idle_timeout_minutes=0.05,
                                         update_interval_s=1)
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

