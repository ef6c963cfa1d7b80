"""A tensor-parallel worker on a multi-node Ray cluster (one machine): one TP = 2 group and one
single-device worker.

The group is one worker to the cluster: one entry in the KV manager, the
router and the status, its two ranks two Ray actors in one placement group
(STRICT_PACK: one node), each with its own pool of the same block ids.
Through it, greedy outputs equal the single-process engine's; a rank killed
mid-stream takes the group down as one worker (its requests resume elsewhere,
none fails) and Ray restarts the whole group; draining it moves its running
sequences to the other worker by KV migration and frees its placement group.
"""

from __future__ import annotations

import functools
import asyncio
import os
import random
import signal
import time

import pytest

ray = pytest.importorskip("ray")

from pagedserve.workers.sample.sampling_params import SamplingParams  # noqa: E402
from polling import wait_for  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

RAY_WORKER_NODES = 2
TP_WORKER = "worker-0"
ENGINE = {"num_device_blocks": 128, "swap_space_gb": 0.001}
MAX_TOKENS = 12
MAX_TOKENS_FAULT = 40


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _prompts(seed: int, lengths=(5, 17, 33, 48, 64, 90)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 1024) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def tp_model():
    from pagedserve.devtools.model_factory import ensure_model

    return str(ensure_model("llama", "tiny-tp"))


@pytest.fixture(scope="module")
def cluster_handle(ray_cluster, tp_model):
    from pagedserve.cluster.bootstrap import start

    config = {
        "model": {"path": tp_model},
        "engine": ENGINE,
        "workers": [{"count": 1, "tensor_parallel_size": 2, "num_cpus": 1, "num_gpus": 0},
                    {"count": 1, "num_cpus": 1, "num_gpus": 1}],
        "step_timeout_s": 20.0,
    }
    handle = start(config, ready_timeout_s=300.0)
    yield handle
    handle.shutdown()


@pytest.fixture(scope="module")
def reference(tp_model):
    """``reference(prompts, max_tokens)``: the single-process ``LLM``'s tokens."""
    from pagedserve.workers.offline.llm import LLM

    llm = LLM(tp_model, device="cpu", **ENGINE)
    cache: dict[tuple, list[int]] = {}

    def run(prompts, max_tokens: int) -> list[list[int]]:
        missing = [p for p in prompts if (tuple(p), max_tokens) not in cache]
        if missing:
            for prompt, output in zip(missing, llm.generate(missing, _greedy(max_tokens))):
                cache[(tuple(prompt), max_tokens)] = list(output.outputs[0].token_ids)
        return [cache[(tuple(p), max_tokens)] for p in prompts]

    return run


@pytest.fixture
def handle(cluster_handle):
    """The shared cluster; after the test it must be idle, consistent and empty."""
    yield cluster_handle
    cluster_handle.wait_idle(timeout=120.0)
    cluster_handle.check_integrity()
    assert cluster_handle.num_used_blocks() == 0


def _token_ids(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


_wait_for = functools.partial(wait_for, tolerate=(Exception,))   # an actor may be restarting


async def _stream_all(handle, prompts, params, action, when):
    """Stream every prompt concurrently; ``action()`` once ``when(progress)`` holds."""
    progress = {i: 0 for i in range(len(prompts))}
    fired = asyncio.Event()

    async def one(index, prompt):
        last = None
        async for output in handle.generate(prompt, params, request_id=f"tp-{index}-{time.time_ns()}"):
            last = output
            progress[index] = len(output.outputs[0].token_ids)
            if not fired.is_set() and when(progress):
                fired.set()
                action()
        return last

    outputs = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)), return_exceptions=True)
    return outputs, fired.is_set()


def _info(handle, worker_id: str) -> dict:
    return ray.get(handle.workers[worker_id].info.remote(), timeout=60)


# ---- tests ------------------------------------------------------------------------------
def test_the_group_is_one_worker_with_its_ranks_packed_on_one_node(handle):
    from pagedserve.cluster.launcher import format_status

    assert sorted(handle.workers) == ["worker-0", "worker-1"]
    assert sorted(ray.get(handle.kv_manager.worker_ids.remote(), timeout=60)) == ["worker-0", "worker-1"]
    info = _info(handle, TP_WORKER)
    assert info["tensor_parallel_size"] == 2 and len(info["ranks"]) == 2
    assert len({rank["node_id"] for rank in info["ranks"]}) == 1            # STRICT_PACK
    assert len({rank["pid"] for rank in info["ranks"]}) == 2
    assert info["ranks"][0]["node_id"] == info["node_id"]                  # rank 0 is the worker actor
    for rank in info["ranks"]:   # the same block ids on every rank, each with half the KV heads
        assert rank["num_device_blocks"] == ENGINE["num_device_blocks"] and rank["num_kv_heads"] == 2
    assert _info(handle, "worker-1")["ranks"] == []
    status = format_status(handle.stats())
    assert "tensor parallel 2" in status and "rank 1: cpu" in status


def test_greedy_through_the_group_matches_the_single_process_engine(handle, reference):
    prompts = _prompts(seed=1)
    outputs = handle.generate_sync(prompts, _greedy(MAX_TOKENS))
    assert _token_ids(outputs) == reference(prompts, MAX_TOKENS)
    used = {d["worker_id"] for d in handle.stats()["recent_decisions"][-len(prompts):]}
    assert TP_WORKER in used


def test_a_rank_killed_mid_stream_loses_no_request_and_the_group_restarts(handle, reference):
    handle.wait_healthy(timeout=120)
    before = _info(handle, TP_WORKER)
    rank_pid = before["ranks"][1]["pid"]
    prompts = _prompts(seed=3)
    expected = reference(prompts, MAX_TOKENS_FAULT)
    num_resumed = handle.stats()["num_resumed"]

    outputs, fired = asyncio.run(_stream_all(
        handle, prompts, _greedy(MAX_TOKENS_FAULT), lambda: os.kill(rank_pid, signal.SIGKILL),
        lambda progress: all(n >= 2 for n in progress.values())))
    assert fired
    failed = [o for o in outputs if isinstance(o, BaseException)]
    assert not failed, failed[:3]
    assert _token_ids(outputs) == expected
    assert handle.stats()["num_resumed"] > num_resumed

    # Ray restarts the worker actor (rank 0); it starts new ranks in its placement group.
    _wait_for(lambda: _info(handle, TP_WORKER)["ranks"][0]["pid"] != before["ranks"][0]["pid"], 240,
              "the group to restart")
    after = _info(handle, TP_WORKER)
    assert rank_pid not in {rank["pid"] for rank in after["ranks"]}
    handle.wait_healthy(timeout=120)
    kv_workers = ray.get(handle.kv_manager.stats.remote(), timeout=30)["workers"]
    assert kv_workers[TP_WORKER]["device_blocks_used"] == 0
    prompts = _prompts(seed=4, lengths=(8, 24, 40, 56))
    assert _token_ids(handle.generate_sync(prompts, _greedy(MAX_TOKENS))) == reference(prompts, MAX_TOKENS)


def test_draining_the_group_migrates_its_sequences_and_frees_its_placement_group(handle, reference):
    from pagedserve.cluster.placement import placement_group_name
    from pagedserve.cluster.worker_pool import actor_name_of

    handle.wait_healthy(timeout=120)
    # The pool drains only a worker it sees ready (after the restart above, its next poll says so).
    _wait_for(lambda: handle.worker_states()["workers"][TP_WORKER]["state"] == "ready", 60,
              "the worker pool to see the group ready")
    prompts = _prompts(seed=5)
    expected = reference(prompts, MAX_TOKENS_FAULT)
    stats_before = handle.stats()

    def drain():
        assert ray.get(handle.controller.drain_worker.remote(TP_WORKER), timeout=30)

    def busy(progress) -> bool:
        return (all(n >= 2 for n in progress.values())
                and ray.get(handle.workers[TP_WORKER].num_unfinished.remote(), timeout=30) >= 1)

    outputs, fired = asyncio.run(_stream_all(handle, prompts, _greedy(MAX_TOKENS_FAULT), drain, busy))
    assert fired
    failed = [o for o in outputs if isinstance(o, BaseException)]
    assert not failed, failed[:3]
    assert _token_ids(outputs) == expected
    deadline = time.time() + 120
    while (record := handle.worker_states()["workers"][TP_WORKER])["state"] != "dead":
        assert time.time() < deadline, f"{TP_WORKER} still draining: {record}"
        time.sleep(0.2)
    assert record["reason"] == "drained" and record["num_drain_migrations"] >= 1, record
    assert handle.stats()["num_recomputed_tokens"] == stats_before["num_recomputed_tokens"]
    with pytest.raises(ValueError):
        ray.util.get_placement_group(placement_group_name(actor_name_of(TP_WORKER)))
