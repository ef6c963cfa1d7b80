"""Other cluster layouts on a multi-node Ray cluster: disaggregated prefill/decode,
cluster-wide preemption that migrates a sequence's KV to a worker with room, and KV events
published on the relay's tick (``kv_events.publish_on_tick``).

Both must produce exactly the single-process engine's greedy output and leave
every pool empty and consistent. One ``ray.cluster_utils.Cluster`` per module;
each layout brings its own pagedserve cluster up and down on it.
"""

from __future__ import annotations

import functools
import random

import pytest

ray = pytest.importorskip("ray")

from pagedserve.workers.sample.sampling_params import SamplingParams  # noqa: E402
from polling import wait_for  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

ENGINE = {"num_device_blocks": 128, "swap_space_gb": 0.001, "block_size": 8, "max_model_len": 160}


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def reference(tiny_model):
    from pagedserve.workers.offline.llm import LLM

    llm = LLM(tiny_model("llama"), **ENGINE)

    def run(prompts, max_tokens):
        outputs = llm.generate(prompts, _greedy(max_tokens))
        llm.check_integrity()
        return [list(o.outputs[0].token_ids) for o in outputs]

    return run


def _start(tiny_model, workers, **extra):
    from pagedserve.cluster.bootstrap import start

    config = {"model": {"path": tiny_model("llama")}, "engine": ENGINE, "workers": workers,
              "step_timeout_s": 20.0, **extra}
    return start(config, ready_timeout_s=180.0)


def _finish(handle):
    handle.wait_idle(timeout=120.0)
    handle.check_integrity()
    assert handle.num_used_blocks() == 0


def test_disaggregated_prefill_decode_matches_colocated(ray_cluster, tiny_model, reference, tmp_path):
    import asyncio

    from peft_adapters import make_peft_adapter

    from pagedserve import LLM, LoRARequest

    lora_engine = {**ENGINE, "enable_lora": True, "max_lora_rank": 8}
    handle = _start(tiny_model, [
        {"role": "prefill", "count": 1, "num_gpus": 1, "num_cpus": 1},
        {"role": "decode", "count": 1, "num_gpus": 1, "num_cpus": 1}], engine=lora_engine)
    try:
        prompts = _prompts(11, [4, 19, 40, 77, 100])
        outputs = handle.generate_sync(prompts, _greedy(12))
        assert [list(o.outputs[0].token_ids) for o in outputs] == reference(prompts, 12)
        assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outputs)
        # Every prompt's KV crossed from the prefill worker to the decode worker.
        for output, prompt in zip(outputs, prompts):
            assert output.metrics.kv_transfer_bytes > 0
            assert output.metrics.kv_memcpy_s > 0
        stats = handle.stats()
        by_role = {handle.roles[w]: s for w, s in stats["workers"].items()}
        assert by_role["decode"]["num_generated_tokens"] == len(prompts) * 11
        assert by_role["prefill"]["num_generated_tokens"] == len(prompts)
        # A one-token request finishes on the prefill worker alone.
        (single,) = handle.generate_sync([prompts[0]], _greedy(1))
        assert list(single.outputs[0].token_ids) == reference([prompts[0]], 1)[0]
        # n > 1 runs colocated on a decode worker.
        (multi,) = handle.generate_sync([prompts[1]], SamplingParams(
            temperature=0.0, max_tokens=6, ignore_eos=True, n=2))
        assert [list(c.token_ids) for c in multi.outputs] == [reference([prompts[1]], 6)[0]] * 2
        # A LoRA adapter's request is prefilled with it on one worker and decoded with it on the other.
        adapter = LoRARequest("attn", 1, make_peft_adapter(tiny_model("llama"), tmp_path / "attn", 8, 16,
                                                           ["q_proj", "v_proj"], seed=3))
        offline = LLM(tiny_model("llama"), **lora_engine).generate(prompts[2:4], _greedy(12), lora_request=adapter)

        async def with_adapter(prompt):
            return [output async for output in handle.generate(prompt, _greedy(12), lora_request=adapter)][-1]
        served = [asyncio.run(with_adapter(prompt)) for prompt in prompts[2:4]]
        assert [list(o.outputs[0].token_ids) for o in served] == [list(o.outputs[0].token_ids) for o in offline]
        assert [list(o.outputs[0].token_ids) for o in served] != reference(prompts[2:4], 12)   # the adapter matters
        assert all(o.metrics.kv_transfer_bytes > 0 for o in served)
        _finish(handle)
    finally:
        handle.shutdown()


def test_preemption_migrates_to_a_worker_with_room(ray_cluster, tiny_model, reference):
    # worker-0's pool holds about two of these sequences; worker-1's holds many.
    handle = _start(tiny_model, [
        {"count": 1, "num_gpus": 1, "num_cpus": 1, "engine": {"num_device_blocks": 14}},
        {"count": 1, "num_gpus": 1, "num_cpus": 1, "engine": {"num_device_blocks": 256}}],
        router={"policy": "round_robin"})
    try:
        prompts = _prompts(5, [30, 31, 32, 33, 34, 35])
        outputs = handle.generate_sync(prompts, _greedy(40))
        assert [list(o.outputs[0].token_ids) for o in outputs] == reference(prompts, 40)
        stats = handle.stats()
        migrated = stats["workers"]["worker-0"]["num_preemptions_by_mode"]["migrate"]
        assert migrated >= 1 and stats["num_migrated"] == migrated
        assert stats["kv_manager"]["workers"]["worker-0"]["num_preemptions_migrate"] == migrated
        assert stats["workers"]["worker-0"]["num_held_exports"] == 0, "every export released once fetched"
        _finish(handle)
    finally:
        handle.shutdown()


TICK_S = 0.06


def test_tick_publishing_serves_exactly_and_keeps_the_central_index_exact(ray_cluster, tiny_model, reference):
    """Each worker's sender thread drains and sends its KV events just before each relay tick
    (``KVPublisher.flush_on_tick``) while its engine thread serves: greedy output still equals
    the single-process engine's, the central index learns a prompt's blocks within a few
    ticks, and once idle it holds exactly what every worker caches."""
    handle = _start(tiny_model, [{"count": 2, "num_gpus": 1, "num_cpus": 1}],
                    kv_events={"publish_on_tick": True, "relay_flush_s": TICK_S})
    # The index may be a tick behind the workers.
    wait = functools.partial(wait_for, tolerate=(Exception,), interval_s=0.05)
    try:
        rng = random.Random(5)
        prefix = [rng.randrange(3, 1000) for _ in range(64)]   # eight full blocks of 8
        prompts = [prefix + [rng.randrange(3, 1000) for _ in range(3 + i)] for i in range(6)]
        prompts += _prompts(6, [9, 40, 77])
        outputs = handle.generate_sync(prompts, _greedy(12))
        assert [list(o.outputs[0].token_ids) for o in outputs] == reference(prompts, 12)
        # The prefix's blocks reach the central index through the sender threads' tick batches.
        wait(lambda: max(ray.get(handle.kv_manager.longest_prefix.remote(prefix + [1]), timeout=30).values(),
                         default=0) >= len(prefix), 5.0, "the prefix's blocks to reach the central index")
        stats = ray.get(handle.kv_manager.stats.remote(), timeout=60)
        assert stats["num_refused_batches"] == 0 and stats["num_zmq_bundles"] > 0
        for worker_stats in ray.get([w.stats.remote() for w in handle.workers.values()], timeout=60):
            assert worker_stats["kv_publish_tick_s"] == TICK_S
        # Idle: central holds exactly what every worker caches, and no block is in use.
        handle.wait_idle(timeout=120.0)
        wait(lambda: handle.check_integrity() is None, 30.0, "the central index to match the workers")
        assert handle.num_used_blocks() == 0
    finally:
        handle.shutdown()


def _beams(width: int, max_tokens: int) -> SamplingParams:
    return SamplingParams(n=width, temperature=0.0, max_tokens=max_tokens, use_beam_search=True)


@pytest.fixture(scope="module")
def beam_reference(tiny_model):
    from pagedserve.workers.offline.llm import LLM

    llm = LLM(tiny_model("llama"), **ENGINE)

    def run(prompt, width, max_tokens):
        [output] = llm.generate([prompt], _beams(width, max_tokens))
        llm.check_integrity()
        return [list(c.token_ids) for c in output.outputs]

    return run


def test_beam_searches_stay_on_their_worker_under_migration_and_disaggregation(ray_cluster, tiny_model,
                                                                               beam_reference):
    """Beam searches (width 1 too) next to sampled requests on the migrating layout, and on
    the disaggregated one: a beam group is never migrated nor split into prefill and
    decode, and each search equals the single-process engine's."""
    prompts = _prompts(17, [30, 26, 33, 28])
    widths = [1, 3, 2, 3]
    for workers in ([{"count": 1, "num_gpus": 1, "num_cpus": 1, "engine": {"num_device_blocks": 18}},
                     {"count": 1, "num_gpus": 1, "num_cpus": 1, "engine": {"num_device_blocks": 256}}],
                    [{"role": "prefill", "count": 1, "num_gpus": 1, "num_cpus": 1},
                     {"role": "decode", "count": 1, "num_gpus": 1, "num_cpus": 1}]):
        handle = _start(tiny_model, workers, router={"policy": "round_robin"})
        try:
            # Two 100-token greedy requests per worker need the whole of worker-0's 18 blocks:
            # running together (they are sent together) they preempt, whatever the timing.
            outputs = handle.generate_sync(prompts + prompts, [_beams(w, 20) for w in widths]
                                           + [_greedy(100)] * 4)
            for prompt, width, output in zip(prompts, widths, outputs):
                assert [list(c.token_ids) for c in output.outputs] == beam_reference(prompt, width, 20)
            if "role" not in workers[0]:
                preemptions = handle.stats()["workers"]["worker-0"]["num_preemptions_by_mode"]
                assert sum(preemptions.values()) > 0, (
                    f"assumed: worker-0's two long greedy requests run together and preempt; {preemptions}")
            _finish(handle)
        finally:
            handle.shutdown()
