"""``kv_events.publish_on_tick`` in a real cluster: each worker's sender thread drains
and sends its KV events just before each relay tick (``KVPublisher.flush_on_tick``)
while its engine thread serves requests. Greedy output still equals the
single-process engine's, the central index learns a prompt's blocks within a
few ticks, and once idle it holds exactly what every worker caches.

One ``ray.cluster_utils.Cluster`` for the module: a head node plus two fake-GPU
worker nodes, one worker each, each node's events through its relay.
"""

from __future__ import annotations

import functools
import random

import pytest

ray = pytest.importorskip("ray")

from pagedserve.workers.sample.sampling_params import SamplingParams  # noqa: E402
from polling import wait_for  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

RAY_WORKER_NODES = 2
ENGINE = {"num_device_blocks": 128, "swap_space_gb": 0.001}
TICK_S = 0.06


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def handle(ray_cluster, tiny_model):
    from pagedserve.cluster.bootstrap import start

    config = {
        "model": {"path": tiny_model("llama")},
        "engine": ENGINE,
        "workers": [{"count": RAY_WORKER_NODES, "num_gpus": 1, "num_cpus": 1}],
        "kv_events": {"publish_on_tick": True, "relay_flush_s": TICK_S},
        "step_timeout_s": 20.0,
    }
    handle = start(config, ready_timeout_s=180.0)
    yield handle
    handle.shutdown()


# The index may be a tick behind the workers.
_wait_for = functools.partial(wait_for, tolerate=(Exception,), interval_s=0.05)


def test_tick_publishing_serves_exactly_and_keeps_the_central_index_exact(handle, tiny_model):
    from pagedserve.workers.offline.llm import LLM

    rng = random.Random(5)
    prefix = [rng.randrange(3, 1024) for _ in range(64)]   # four full blocks of 16
    prompts = [prefix + [rng.randrange(3, 1024) for _ in range(3 + i)] for i in range(6)]
    prompts += [[rng.randrange(3, 1024) for _ in range(n)] for n in (9, 40, 77)]
    expected = [list(o.outputs[0].token_ids) for o in LLM(tiny_model("llama"), **ENGINE).generate(
        prompts, _greedy(12))]

    outputs = handle.generate_sync(prompts, _greedy(12))
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected
    # The prefix's blocks reach the central index through the sender threads' tick batches.
    _wait_for(lambda: max(ray.get(handle.kv_manager.longest_prefix.remote(prefix + [1]), timeout=30).values(),
                          default=0) >= len(prefix), 5.0, "the prefix's blocks to reach the central index")
    stats = ray.get(handle.kv_manager.stats.remote(), timeout=60)
    assert stats["num_refused_batches"] == 0 and stats["num_zmq_bundles"] > 0
    for worker_stats in ray.get([w.stats.remote() for w in handle.workers.values()], timeout=60):
        assert worker_stats["kv_publish_tick_s"] == TICK_S
    # Idle: central holds exactly what every worker caches, and no block is in use.
    handle.wait_idle(timeout=120.0)
    _wait_for(lambda: handle.check_integrity() is None, 30.0, "the central index to match the workers")
    assert handle.num_used_blocks() == 0
