"""A stale prefix hint costs a cache miss, never a wrong token.

Two real engines (tiny model, float32 CPU), each with its own
``LocalKVManager`` and event log, feed one central ``KVManagerService``. A
prompt runs on worker "a" and its blocks reach the central index. Then "a"
evicts some or all of them for another request, and the index is not told
yet. The router, reading the stale index, sends the prompt back to "a"
("prefix"); "a" hits only what its own pool still holds (checked against
full hashes and tokens) and recomputes the rest. The output must still be
token-identical to transformers' greedy ``generate``.
"""

from __future__ import annotations

import random
from dataclasses import asdict

import pytest

from pagedserve.cluster.config import RouterConfig
from pagedserve.cluster.router import Router
from pagedserve.kvmanager.events import EventLog, PublishAck
from pagedserve.kvmanager.local_manager import LocalKVManager
from pagedserve.kvmanager.service import KVManagerService
from pagedserve.workers.engine.engine import EngineConfig, LLMEngine
from pagedserve.workers.sample.sampling_params import SamplingParams

BLOCK_SIZE = 16
NUM_DEVICE_BLOCKS = 12
MAX_TOKENS = 8
PROMPT_LEN = 70          # 4 full blocks are cached (the block of the last prompt token never is)
NUM_PROMPT_BLOCKS = (PROMPT_LEN - 1) // BLOCK_SIZE


@pytest.fixture(scope="module")
def cluster(tiny_model):
    central = KVManagerService()
    engines = {}
    for worker_id in ("a", "b"):
        config = EngineConfig.from_kwargs(model=tiny_model("llama"), device="cpu", dtype="float32",
                                          block_size=BLOCK_SIZE, num_device_blocks=NUM_DEVICE_BLOCKS,
                                          swap_space_gb=0, max_model_len=256)
        kv = LocalKVManager(event_log=EventLog(worker_id))
        engine = LLMEngine(config, worker_id, kv_manager=kv)
        central.register_worker(worker_id, asdict(engine.pool_config))
        assert PublishAck.unpack(central.resync(kv.snapshot().pack())).status == "ok"
        engines[worker_id] = engine
    yield central, engines
    for engine in engines.values():
        engine.check_integrity()
        assert engine.num_used_blocks() == 0


def _run(engine: LLMEngine, request_id: str, prompt: list[int], max_tokens: int) -> list[int]:
    engine.add_request(request_id, None, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                       prompt_token_ids=prompt)
    while True:
        for output in engine.step():
            if output.request_id == request_id and output.finished:
                return list(output.outputs[0].token_ids)


def _publish(central: KVManagerService, engine: LLMEngine) -> None:
    ack = PublishAck.unpack(central.publish(engine.kv_manager.drain_events().pack()))
    assert ack.status == "ok", ack


def _hit_tokens(engine: LLMEngine) -> int:
    return engine.kv_manager.stats(engine.worker_id)["num_prefix_hit_tokens"]


@pytest.mark.parametrize("num_evicted", [NUM_PROMPT_BLOCKS, 2])
def test_routing_on_a_stale_hint_is_a_cache_miss_with_identical_tokens(cluster, hf_greedy, num_evicted):
    central, engines = cluster
    a = engines["a"]
    assert a.reset_prefix_cache()  # start from an empty cache, whatever ran before
    rng = random.Random(num_evicted)
    prompt = [rng.randrange(5, 1024) for _ in range(PROMPT_LEN)]
    reference = hf_greedy("llama", prompt, MAX_TOKENS)
    assert _run(a, f"first-{num_evicted}", prompt, MAX_TOKENS) == reference
    for engine in engines.values():
        _publish(central, engine)
    fresh = central.longest_prefix(prompt)
    assert fresh == {"a": NUM_PROMPT_BLOCKS * BLOCK_SIZE, "b": 0}

    # Another request takes every uncached free block and ``num_evicted`` of the prompt's
    # cached ones (evicted tail first). Worker "a" does not publish: the index is now stale.
    occupancy = a.kv_manager.occupancy()["device"]
    assert occupancy.num_used == 0 and occupancy.num_cached_free >= NUM_PROMPT_BLOCKS
    num_blocks = occupancy.num_free + num_evicted
    other = [rng.randrange(5, 1024) for _ in range(num_blocks * BLOCK_SIZE - 1)]
    _run(a, f"other-{num_evicted}", other, 1)
    still_cached = a.kv_manager.longest_prefix(prompt)["a"]
    assert still_cached == (NUM_PROMPT_BLOCKS - num_evicted) * BLOCK_SIZE
    stale = central.longest_prefix(prompt)
    assert stale == fresh, "the index must not have heard of the eviction yet"

    router = Router(RouterConfig(), ["a", "b"])
    decision = router.choose(f"again-{num_evicted}", len(prompt), MAX_TOKENS, stale)
    assert (decision.worker_id, decision.reason) == ("a", "prefix")
    hits_before = _hit_tokens(a)
    assert _run(a, f"again-{num_evicted}", prompt, MAX_TOKENS) == reference
    router.release(decision, MAX_TOKENS)
    assert _hit_tokens(a) - hits_before == still_cached  # the hint promised more: a (partial) miss

    # Once "a" publishes, the index agrees with its pool again.
    _publish(central, a)
    central.index.check_consistency_with([e.kv_manager.snapshot() for e in engines.values()])
    a.check_integrity()
