"""Unit tests of the block pool, block manager and KV manager."""

from __future__ import annotations

import copy
import subprocess
import sys

import msgpack
import pytest

from pagedserve.kvmanager import (BlockManager, BlockPool, ContiguousBlockPool, DoubleFreeError, IntegrityError,
                                  KVManager, KVManagerError, NewSequence, NoFreeBlocksError,
                                  PoolConfig, StepInput, StepOutput, UnknownSequenceError,
                                  UnknownWorkerError, from_wire, hash_block, to_wire)
from pagedserve.kvmanager import hashing

from kv_simulator import SimulatedWorker


def make_manager(num_device=16, num_host=0, block_size=4, **kwargs):
    manager = KVManager()
    manager.add_worker("w", PoolConfig(num_device_blocks=num_device, num_host_blocks=num_host,
                                       block_size=block_size, max_model_len=64, watermark=0.0,
                                       **kwargs))
    return manager, SimulatedWorker(manager, "w")


def snapshot(manager: KVManager):
    bm = manager.block_manager("w")
    return copy.deepcopy((bm.device.ref_counts, bm.device._free, list(bm.device._evictable),
                          bm.host.ref_counts, {k: (v.block_table, v.token_ids, v.num_computed)
                                               for k, v in bm.seqs.items()}))


# ---- block pool ----------------------------------------------------------------

def test_pool_reuses_free_blocks_lifo():
    pool = BlockPool(8, 4)
    a, b, c = pool.allocate(), pool.allocate(), pool.allocate()
    assert (a, b, c) == (0, 1, 2)
    pool.free(b)
    pool.free(c)
    assert pool.allocate() == c  # last freed, first reused
    assert pool.allocate() == b
    pool.check_integrity({a: 1, b: 1, c: 1})


def test_pool_double_free_and_exhaustion_are_refused():
    pool = BlockPool(2, 4)
    block = pool.allocate()
    pool.free(block)
    with pytest.raises(DoubleFreeError):
        pool.free(block)
    pool.allocate(), pool.allocate()
    with pytest.raises(NoFreeBlocksError):
        pool.allocate()
    with pytest.raises(NoFreeBlocksError):
        BlockPool(3, 4).allocate_many(4)
    assert pool.num_free_blocks == 0


def test_pool_evicts_least_recently_freed_cached_block_first():
    pool = BlockPool(3, 2)
    blocks = [pool.allocate() for _ in range(3)]
    hashes = []
    for i, block in enumerate(blocks):
        h = hash_block(None, [i, i])
        pool.register(block, h, [i, i], None, None)
        hashes.append(h)
    for block in blocks:
        pool.free(block)
    assert pool.num_cached_free_blocks == 3 and pool.num_free_blocks == 3
    # A cache hit takes block 1 back from the middle of the LRU list.
    assert pool.lookup(hashes[1], [1, 1]) == blocks[1]
    pool.take_cached(blocks[1])
    evicted = []
    pool.on_evict = lambda block, h, tokens: evicted.append(block)
    pool.allocate()
    assert evicted == [blocks[0]]
    assert pool.lookup(hashes[0], [0, 0]) is None
    assert pool.lookup(hashes[2], [2, 2]) == blocks[2]


def test_hash_guard_refuses_colliding_tokens(monkeypatch):
    pool = BlockPool(4, 2)
    block = pool.allocate()
    fake = b"\x00" * 16
    pool.register(block, fake, [1, 2], None, None)
    assert pool.lookup(fake, [1, 2]) == block
    assert pool.lookup(fake, [3, 4]) is None  # same hash, different tokens: no sharing


def test_hash_is_stable_across_processes():
    tokens = list(range(16))
    here = hash_block(hash_block(None, tokens, "salt"), tokens).hex()
    code = ("from pagedserve.kvmanager import hash_block; t=list(range(16)); "
            "print(hash_block(hash_block(None, t, 'salt'), t).hex())")
    there = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True, env={"PYTHONHASHSEED": "12345", "PATH": ""}).stdout.strip()
    assert here == there
    assert hash_block(None, tokens, "salt") != hash_block(None, tokens, "other")
    assert hashing.chain_is_valid(hashing.hash_prefix_blocks(tokens, 4), [tokens[i:i + 4] for i in range(0, 16, 4)])


def test_contiguous_pool_first_fit_and_fragmentation():
    pool = ContiguousBlockPool(10, 4)
    a = pool.allocate_run(4)
    b = pool.allocate_run(2)
    c = pool.allocate_run(4)
    assert (a, b, c) == ([0, 1, 2, 3], [4, 5], [6, 7, 8, 9])
    for block in b:
        pool.free(block)
    for block in [8, 9]:
        pool.free(block)
    # Four blocks are free, but not four in a row: external fragmentation.
    assert pool.num_free_blocks == 4
    assert not pool.can_allocate_run(3)
    with pytest.raises(NoFreeBlocksError, match="fragmentation"):
        pool.allocate_run(3)
    assert pool.allocate_run(2) == [4, 5]  # lowest start that fits


# ---- KV manager ------------------------------------------------------------------

def test_prefix_cache_hit_reuses_blocks_and_recomputes_last_token():
    manager, worker = make_manager()
    prompt = list(range(12))  # exactly three blocks of 4
    worker.step(StepInput("w", waiting=["a"], new_sequences=[NewSequence("a", prompt)]))
    out = worker.step(StepInput("w", waiting=["b"], running=["a"], appended=[("a", [7])],
                                new_sequences=[NewSequence("b", prompt)]))
    b = next(s for s in out.scheduled if s.seq_id == "b")
    # Two full blocks hit; the third holds the last prompt token, recomputed.
    assert b.num_cached_tokens == 8 and b.start == 8 and b.num_tokens == 4
    a_table = manager.block_manager("w").seqs["a"].block_table
    assert b.block_table[:2] == a_table[:2] and b.block_table[2] != a_table[2]
    stats = manager.stats("w")
    assert stats["prefix_cache_hit_rate"] == pytest.approx(8 / 24)
    manager.check_integrity()
    worker.step(StepInput("w", finished=["a", "b"]))
    assert manager.num_used_blocks() == 0
    # a's three full blocks stay reusable; b's copy of block 2 was a duplicate.
    assert manager.stats("w")["device_blocks_cached"] == 3
    manager.check_integrity()


def test_pages_lent_to_adapters_are_counted_apart_and_never_given_to_sequences():
    """Unified paging's side of the pool: lent blocks count as used, in the stats, the block map
    and the integrity check, but not as sequences' KV; a loan takes cached blocks (dropped, not
    offloaded: no step's copies carry it) and one the pool cannot make changes nothing."""
    from pagedserve.kvmanager.local_manager import pool_occupancy

    manager, worker = make_manager(num_device=8, num_host=4)
    prompt = list(range(12))
    worker.step(StepInput("w", waiting=["a"], new_sequences=[NewSequence("a", prompt)]))
    worker.step(StepInput("w", finished=["a"]))
    blocks = manager.block_manager("w")
    assert blocks.device.num_cached_free_blocks == 3 and blocks.num_lendable_pages == 8
    before = snapshot(manager)
    with pytest.raises(NoFreeBlocksError, match="8 blocks to lend, 9 requested"):
        blocks.reserve_pages("lora:1", 9)
    assert snapshot(manager) == before and not blocks.pages
    pages = blocks.reserve_pages("lora:1", 7)     # every free block, then cached ones
    assert blocks.device.num_cached_free_blocks == 1 and blocks.host.num_used_blocks == 0
    manager.check_integrity()
    stats = manager.stats("w")
    assert stats["device_blocks_used"] == 7 and stats["device_blocks_adapter_pages"] == 7
    assert manager.num_used_blocks() == 0 and stats["kv_utilization"] == 0.0
    occupancy = pool_occupancy(blocks)["device"]   # what the central manager (and the router) reads:
    assert (occupancy.num_used, occupancy.num_cached_free) == (0, 8)   # pages are reclaimable, as cached blocks
    drawn = manager.block_map("w")["tiers"]["device"]
    assert drawn["counts"]["a"] == 7 and {drawn["states"][b] for b in pages} == {"a"}
    assert drawn["owners"][pages[0]] == ["lora:1"]
    # A sequence gets only what is left; taking the pages back frees them for it.
    out = worker.step(StepInput("w", waiting=["b"], new_sequences=[NewSequence("b", list(range(50, 62)))]))
    assert not out.scheduled
    assert blocks.release_pages("lora:1") == 7
    out = worker.step(StepInput("w", waiting=["b"]))
    assert [s.seq_id for s in out.scheduled] == ["b"] and not set(pages) - set(range(8))
    manager.check_integrity()
    worker.step(StepInput("w", finished=["b"]))
    assert manager.num_used_blocks() == 0 and blocks.device.num_used_blocks == 0


def test_extra_key_separates_caches():
    manager, worker = make_manager()
    prompt = list(range(12))
    worker.step(StepInput("w", waiting=["a"], new_sequences=[NewSequence("a", prompt, "tenant1")]))
    out = worker.step(StepInput("w", waiting=["b"], running=["a"], appended=[("a", [1])],
                                new_sequences=[NewSequence("b", prompt, "tenant2")]))
    assert next(s for s in out.scheduled if s.seq_id == "b").num_cached_tokens == 0


def test_fork_shares_blocks_and_copy_on_write_on_partial_block():
    manager, worker = make_manager()
    worker.step(StepInput("w", waiting=["p"], new_sequences=[NewSequence("p", list(range(6)))]))
    bm = manager.block_manager("w")
    table = list(bm.seqs["p"].block_table)
    out = worker.step(StepInput("w", forks=[("p", "c")], running=["p", "c"],
                                appended=[("p", [100]), ("c", [200])]))
    # Block 0 is full and stays shared; block 1 is partial: the first writer copies.
    assert len(out.copy_on_write) == 1
    src, dst = out.copy_on_write[0]
    assert src == table[1]
    tables = {s.seq_id: s.block_table for s in out.scheduled}
    assert tables["p"][0] == tables["c"][0] == table[0]
    assert tables["p"][1] != tables["c"][1]
    assert bm.device.ref_counts[table[0]] == 2
    manager.check_integrity()
    worker.step(StepInput("w", finished=["p", "c"]))
    assert manager.num_used_blocks() == 0


def test_admission_control_keeps_watermark():
    manager = KVManager()
    manager.add_worker("w", PoolConfig(num_device_blocks=10, block_size=4, max_model_len=64,
                                       watermark=0.2))
    out = manager.step(StepInput("w", waiting=["a", "b"], new_sequences=[
        NewSequence("a", list(range(24))), NewSequence("b", list(range(100, 109)))]))
    # "a" needs 6 blocks + 2 watermark <= 10; "b" needs 3 more, which would eat the watermark.
    assert [s.seq_id for s in out.scheduled] == ["a"]
    manager.check_integrity()


def test_preemption_swaps_then_recomputes_when_host_is_full():
    manager, worker = make_manager(num_device=6, num_host=3)
    worker.step(StepInput("w", waiting=["a", "b"], new_sequences=[
        NewSequence("a", list(range(11))), NewSequence("b", list(range(100, 111)))]))
    out = worker.step(StepInput("w", running=["a", "b"], appended=[("a", [1]), ("b", [2])]))
    assert [p.mode for p in out.preempted] == []
    out = worker.step(StepInput("w", running=["a", "b"], appended=[("a", [1]), ("b", [2])]))
    # Both need a 4th block; the lowest priority (last) is swapped out.
    assert [(p.seq_id, p.mode) for p in out.preempted] == [("b", "swap")]
    assert len(out.swap_out) == 3
    manager.check_integrity()
    # A third sequence cannot swap: the host is full, so it is recomputed.
    worker.step(StepInput("w", finished=["b"]))
    worker.step(StepInput("w", waiting=["c"], running=["a"], appended=[("a", [1])],
                          new_sequences=[NewSequence("c", list(range(200, 207)))]))
    manager.check_integrity()


def test_recompute_mode_and_resumed_sequence_is_not_preempted_again():
    manager, worker = make_manager(num_device=6, num_host=8, preemption_mode="recompute")
    worker.step(StepInput("w", waiting=["a", "b"], new_sequences=[
        NewSequence("a", list(range(11))), NewSequence("b", list(range(100, 111)))]))
    worker.step(StepInput("w", running=["a", "b"], appended=[("a", [1]), ("b", [2])]))
    out = worker.step(StepInput("w", running=["a", "b"], appended=[("a", [1]), ("b", [2])]))
    assert [(p.seq_id, p.mode) for p in out.preempted] == [("b", "recompute")]
    assert manager.stats("w")["num_preemptions_swap"] == 0
    worker.step(StepInput("w", finished=["a"]))
    out = worker.step(StepInput("w", waiting=["b"]))
    (resumed,) = out.scheduled
    assert resumed.start == resumed.num_cached_tokens  # its full blocks were still cached
    seq = manager.block_manager("w").seqs["b"]
    assert seq.is_protected
    manager.check_integrity()


def test_misuse_is_refused_and_leaves_state_untouched():
    manager, worker = make_manager(num_device=4)
    worker.step(StepInput("w", waiting=["a"], new_sequences=[NewSequence("a", list(range(5)))]))
    before = snapshot(manager)
    bad_steps = [
        StepInput("w", finished=["nope"]),
        StepInput("w", running=["ghost"]),
        StepInput("w", new_sequences=[NewSequence("a", [1])]),
        StepInput("w", new_sequences=[NewSequence("x", [])]),
        StepInput("w", new_sequences=[NewSequence("x", list(range(65)))]),
        StepInput("w", forks=[("ghost", "c")]),
        StepInput("w", appended=[("ghost", [1])]),
        StepInput("w", running=["a", "a"]),
        StepInput("w", waiting=["a"]),
        StepInput("w", finished=["a", "a"]),
        StepInput("w", finished=["a"], running=["a"]),
        StepInput("w", token_budget=-1),
    ]
    for step_input in bad_steps:
        with pytest.raises(KVManagerError):
            manager.step(step_input)
        assert snapshot(manager) == before, step_input
    with pytest.raises(UnknownWorkerError):
        manager.step(StepInput("nope"))
    with pytest.raises(UnknownSequenceError):
        manager.block_manager("w").free_sequence("ghost")
    manager.check_integrity()


def test_allocating_beyond_the_pool_schedules_nothing():
    manager, worker = make_manager(num_device=2)
    out = worker.step(StepInput("w", waiting=["big"], new_sequences=[NewSequence("big", list(range(20)))]))
    assert out.scheduled == []
    manager.check_integrity()
    assert manager.num_used_blocks() == 0


def test_integrity_check_catches_corruption():
    manager, worker = make_manager()
    worker.step(StepInput("w", waiting=["a"], new_sequences=[NewSequence("a", list(range(9)))]))
    bm = manager.block_manager("w")
    bm.device.ref_counts[bm.seqs["a"].block_table[0]] += 1
    with pytest.raises(IntegrityError, match="ref count"):
        manager.check_integrity()


def test_chunked_prefill_respects_budget():
    manager, worker = make_manager()
    worker.step(StepInput("w", new_sequences=[NewSequence("a", list(range(30)))]))
    starts = []
    for _ in range(4):
        out = worker.step(StepInput("w", waiting=["a"] if not starts else [],
                                    running=["a"] if starts else [], token_budget=8))
        (sched,) = out.scheduled
        starts.append((sched.start, sched.num_tokens))
    assert starts == [(0, 8), (8, 8), (16, 8), (24, 6)]
    manager.check_integrity()


def test_contiguous_allocation_reserves_max_len():
    manager, worker = make_manager(num_device=40, allocation="contiguous")
    out = worker.step(StepInput("w", waiting=["a", "b", "c"], new_sequences=[
        NewSequence(s, list(range(5))) for s in "abc"]))
    # 64 tokens / 4 per block = 16 blocks reserved each: only two fit in 40.
    assert [s.seq_id for s in out.scheduled] == ["a", "b"]
    assert out.scheduled[1].block_table == [16, 17]
    stats = manager.stats("w")
    assert stats["device_blocks_used"] == 32
    assert stats["kv_utilization"] == pytest.approx(10 / 128)
    manager.check_integrity()


def _utilization(bm) -> tuple[int, int]:
    """(tokens stored, token slots in use), after checking kv_utilization against the walk
    over every table entry (check_integrity compares the two stored-token counts)."""
    bm.check_integrity()
    num_slots = bm.device.num_used_blocks * bm.block_size
    assert bm.kv_utilization() == (bm.num_stored_tokens() / num_slots if num_slots else 0.0)
    return bm.num_stored_tokens(), num_slots


def _admit(bm, seq_id, tokens, **kwargs):
    seq = bm.add_sequence(seq_id, tokens, **kwargs)
    bm.admit(seq, bm.match_prefix(seq))
    bm.grow(seq, len(tokens) - seq.num_computed)
    return seq


def test_kv_utilization_counts_each_shared_block_once_at_its_fill():
    bm = BlockManager(32, num_host_blocks=16, block_size=4, max_model_len=64, watermark=0.0)
    a = _admit(bm, "a", list(range(10)))                     # 4 + 4 + 2
    assert _utilization(bm) == (10, 12)
    bm.fork("a", "b")                                        # shares all three, the partial one too
    assert _utilization(bm) == (10, 12)
    bm.append_tokens("b", [50])
    bm.grow(bm.seqs["b"], 1)                                 # copy-on-write: b's own 3-token block
    assert _utilization(bm) == (13, 16)
    c = _admit(bm, "c", list(range(8)) + [60, 61])           # two prefix-cache hits + 2 tokens
    assert bm.counters.num_prefix_hit_tokens == 8
    assert _utilization(bm) == (15, 20)
    bm.swap_out(c)                                           # its shared blocks stay with a and b
    assert _utilization(bm) == (13, 16)
    bm.swap_in(c)
    bm.end_step()
    assert _utilization(bm) == (15, 20)
    imported = bm.add_sequence("i", list(range(100, 107)), num_imported_tokens=6)
    bm.admit_imported(imported)                              # 6 transferred tokens: 4 + 2
    assert _utilization(bm) == (21, 28)
    bm.migrate_out(imported)
    bm.preempt_recompute(a)
    assert _utilization(bm) == (13, 16)                      # only a's 2-token block goes: b, c hold the rest
    for seq_id in ("b", "c", "a"):
        bm.free_sequence(seq_id)
    assert _utilization(bm) == (0, 0) and bm.kv_utilization() == 0.0


def test_kv_utilization_skips_blocks_freed_out_of_the_window():
    bm = BlockManager(16, block_size=4, max_model_len=64, watermark=0.0, sliding_window=4)
    seq = _admit(bm, "a", list(range(12)))
    bm.append_tokens("a", [1])
    bm.grow(seq, 1)                                          # the first query at 12: blocks 0, 1 go
    assert seq.num_freed_blocks == 2
    assert _utilization(bm) == (5, 8)
    bm.fork("a", "b")                                        # the child shares the -1 entries' state
    assert _utilization(bm) == (5, 8)


def test_kv_utilization_counts_a_contiguous_reservation_as_empty_slots():
    bm = BlockManager(12, block_size=4, max_model_len=16, allocation="contiguous", watermark=0.0)
    _admit(bm, "a", list(range(5)))                          # 2 of 4 reserved blocks in the table
    _admit(bm, "b", list(range(9)))
    assert _utilization(bm) == (14, 32)


def test_kv_utilization_of_restored_tables_takes_each_blocks_fullest_holder():
    bm = BlockManager(16, block_size=4, max_model_len=64, watermark=0.0, enable_prefix_caching=False)
    bm.restore_sequences([
        # Block 1 is full in p, empty in q (q's table is longer than its 4 tokens); 2 is only q's.
        {"seq_id": "p", "token_ids": list(range(9)), "num_computed": 8, "block_table": [0, 1]},
        {"seq_id": "q", "token_ids": list(range(9)), "num_computed": 4, "block_table": [0, 1, 2]},
        # Block 5 is partial in both, 2 and 3 tokens: it stores 3.
        {"seq_id": "r", "token_ids": list(range(9)), "num_computed": 6, "block_table": [4, 5]},
        {"seq_id": "s", "token_ids": list(range(9)), "num_computed": 7, "block_table": [4, 5]},
    ])
    assert _utilization(bm) == (8 + 7, 20)


def test_integrity_check_compares_the_stored_token_count_with_the_walk(monkeypatch):
    bm = BlockManager(8, block_size=4, max_model_len=64, watermark=0.0)
    _admit(bm, "a", list(range(6)))
    bm.check_integrity()
    monkeypatch.setattr(BlockManager, "num_stored_tokens", lambda self: 5)
    with pytest.raises(IntegrityError, match="store 6 tokens"):
        bm.check_integrity()


def test_host_tier_is_a_second_level_prefix_cache():
    manager, worker = make_manager(num_device=4, num_host=8)
    prompt = list(range(13))
    worker.step(StepInput("w", waiting=["a"], new_sequences=[NewSequence("a", prompt)]))
    worker.step(StepInput("w", finished=["a"]))
    # Another prompt needs all four device blocks: a's cached blocks are evicted to the host.
    out = worker.step(StepInput("w", waiting=["b"], new_sequences=[NewSequence("b", list(range(50, 63)))]))
    assert len(out.swap_out) == 3
    worker.step(StepInput("w", finished=["b"]))
    out = worker.step(StepInput("w", waiting=["c"], new_sequences=[NewSequence("c", prompt)]))
    (sched,) = out.scheduled
    assert sched.num_cached_tokens == 12
    assert len(out.swap_in) >= 1
    manager.check_integrity()


def test_step_round_trips_through_msgpack():
    manager, worker = make_manager()
    step_input = StepInput("w", waiting=["a"], new_sequences=[NewSequence("a", list(range(9)))],
                           forks=[], appended=[], token_budget=100)
    wire = msgpack.unpackb(msgpack.packb(to_wire(step_input)))
    assert from_wire(StepInput, wire) == step_input
    out = manager.step(from_wire(StepInput, wire))
    wire_out = msgpack.unpackb(msgpack.packb(to_wire(out)))
    assert from_wire(StepOutput, wire_out) == out


def test_longest_prefix_per_worker():
    manager = KVManager()
    for name in ("w0", "w1"):
        manager.add_worker(name, PoolConfig(num_device_blocks=16, block_size=4, max_model_len=64))
    prompt = list(range(17))
    manager.step(StepInput("w1", waiting=["a"], new_sequences=[NewSequence("a", prompt)]))
    assert manager.longest_prefix(prompt) == {"w0": 0, "w1": 16}
    assert manager.longest_prefix(prompt[:9]) == {"w0": 0, "w1": 8}
    manager.remove_worker("w1")
    assert manager.longest_prefix(prompt) == {"w0": 0}


def test_pool_config_validation():
    with pytest.raises(ValueError, match="preemption_mode"):
        PoolConfig(num_device_blocks=4, preemption_mode="drop")
    with pytest.raises(ValueError):
        PoolConfig(num_device_blocks=0)
    with pytest.raises(ValueError, match="allocation"):
        KVManager().add_worker("w", PoolConfig(num_device_blocks=4, allocation="buddy"))


def test_kvmanager_does_not_import_torch():
    code = "import sys, pagedserve.kvmanager; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_restore_worker_rebuilds_accounting_from_reported_tables():
    manager, worker = make_manager(num_device=16)
    worker.step(StepInput("w", waiting=["a", "b"], new_sequences=[
        NewSequence("a", list(range(10))), NewSequence("b", list(range(10)) + [50, 51])]))
    worker.step(StepInput("w", forks=[("a", "c")], running=["a", "c", "b"],
                          appended=[("a", [1]), ("c", [2]), ("b", [3])]))
    bm = manager.block_manager("w")
    report = [{"seq_id": s.seq_id, "token_ids": s.token_ids, "num_computed": s.num_computed,
               "block_table": s.block_table} for s in bm.seqs.values()]
    report.append({"seq_id": "waiting-one", "token_ids": [1, 2, 3]})
    refs_before = list(bm.device.ref_counts)
    fresh = KVManager()
    fresh.restore_worker("w", manager.configs["w"], report)
    fresh.check_integrity()
    assert fresh.block_manager("w").device.ref_counts == refs_before
    # It keeps serving from the restored state.
    worker.manager = fresh
    worker.tokens["waiting-one"] = [1, 2, 3]
    worker.step(StepInput("w", running=["a", "c", "b"], waiting=["waiting-one"],
                          appended=[("a", [4]), ("c", [5]), ("b", [6])]))
    fresh.check_integrity()
    with pytest.raises(KVManagerError):
        KVManager().restore_worker("w", manager.configs["w"], [
            {"seq_id": "x", "token_ids": [1] * 9, "num_computed": 9, "block_table": [99, 100, 101]}])


def test_imported_sequence_gets_blocks_for_transferred_kv():
    manager, worker = make_manager(num_device=16)
    tokens = list(range(13)) + [77]  # 13 prompt tokens computed elsewhere, 1 sampled token
    worker.tokens["t"] = tokens
    # The simulated cache must hold the imported KV before the forward pass reads it.
    out = manager.step(StepInput("w", waiting=["t"], new_sequences=[
        NewSequence("t", tokens, num_imported_tokens=13)]))
    (sched,) = out.scheduled
    assert (sched.start, sched.num_tokens, sched.num_imported_tokens) == (13, 1, 13)
    assert len(sched.block_table) == 4
    for pos in range(13):
        worker.device[sched.block_table[pos // 4]][pos % 4] = tokens[pos]
    worker.execute(out)
    manager.check_integrity()
    # Its full blocks are in the prefix cache like any computed block.
    assert manager.longest_prefix(list(range(13)))["w"] == 12
    with pytest.raises(KVManagerError):
        manager.step(StepInput("w", new_sequences=[NewSequence("u", [1, 2], num_imported_tokens=2)]))


def test_preemption_migrates_to_a_worker_with_room():
    manager = KVManager()
    manager.add_worker("a", PoolConfig(num_device_blocks=6, num_host_blocks=8, block_size=4,
                                       max_model_len=64, watermark=0.0))
    manager.add_worker("b", PoolConfig(num_device_blocks=16, block_size=4, max_model_len=64,
                                       watermark=0.0))
    manager.add_worker("p", PoolConfig(num_device_blocks=64, block_size=4, max_model_len=64,
                                       watermark=0.0, role="prefill"))
    manager.step(StepInput("a", waiting=["x", "y"], new_sequences=[
        NewSequence("x", list(range(11))), NewSequence("y", list(range(100, 111)))]))
    manager.step(StepInput("a", running=["x", "y"], appended=[("x", [1]), ("y", [2])]))
    out = manager.step(StepInput("a", running=["x", "y"], appended=[("x", [1]), ("y", [2])],
                                 migratable=["x", "y"]))
    # "b" has the most room among non-prefill workers: the victim moves there.
    assert [(p.seq_id, p.mode, p.target_worker) for p in out.preempted] == [("y", "migrate", "b")]
    assert "y" not in manager.block_manager("a").seqs
    assert manager.stats("a")["num_preemptions_migrate"] == 1
    manager.check_integrity()
    # Without permission (n > 1 requests, say) it swaps instead.
    manager.step(StepInput("a", running=["x"], appended=[("x", [3])]))
    manager.check_integrity()


def test_block_map_shows_each_blocks_state():
    manager, worker = make_manager(num_device=8, num_host=4)
    worker.step(StepInput("w", waiting=["p"], new_sequences=[NewSequence("p", list(range(9)))]))
    worker.step(StepInput("w", forks=[("p", "c")], running=["p", "c"], appended=[("p", [1]), ("c", [2])]))
    block_map = manager.block_map("w")
    device = block_map["tiers"]["device"]
    assert len(device["states"]) == 8
    # Blocks 0-1 are full and shared by p and c; each has its own last block.
    assert device["states"][:2] == "ss" and device["counts"]["s"] == 2
    assert device["counts"]["u"] == 2 and device["counts"]["f"] == 4
    assert sorted(device["owners"][0]) == ["c", "p"] and 0 in device["hashes"]
    worker.step(StepInput("w", finished=["p", "c"]))
    device = manager.block_map("w")["tiers"]["device"]
    assert device["counts"]["c"] == 2 and device["counts"]["u"] == 0
    dense = manager.block_map("w", max_cells=3)["tiers"]["device"]
    assert dense["blocks_per_cell"] == 3 and len(dense["density"]) == 3 and "states" not in dense


def test_pending_tokens_are_computed_but_indexed_only_once_resolved():
    """Overlapped scheduling: a token sampled by a running step is appended as pending;
    its block is planned (computed from the device's copy) but enters the prefix index
    only when its value is resolved."""
    from pagedserve.kvmanager import PENDING_TOKEN, KVManagerError, StepInput

    manager = KVManager()
    manager.add_worker("w", PoolConfig(num_device_blocks=8, block_size=4, max_model_len=64))
    prompt = list(range(10, 17))  # 7 tokens: the 8th fills the second block

    def step(**changes):
        running = [] if changes.get("finished") else ["s"]
        return manager.step(StepInput("w", running=running, **changes))

    first = manager.step(StepInput("w", waiting=["s"], new_sequences=[NewSequence("s", prompt)]))
    assert first.scheduled[0].num_tokens == 7
    plan = step(appended=[("s", [PENDING_TOKEN])])
    assert (plan.scheduled[0].start, plan.scheduled[0].num_tokens) == (7, 1)
    seq = manager.block_manager("w").seqs["s"]
    assert seq.num_pending == 1 and seq.num_indexed_blocks == 1  # the full second block waits
    manager.check_integrity()
    plan = step(appended=[("s", [PENDING_TOKEN])])  # the next one launched before the first is read
    assert seq.num_pending == 2
    with pytest.raises(KVManagerError, match="after a pending one"):
        step(appended=[("s", [5])])
    with pytest.raises(KVManagerError, match="pending tokens"):
        step(resolved=[("s", [1, 2, 3])])
    plan = step(resolved=[("s", [99])], appended=[("s", [PENDING_TOKEN])])
    assert seq.token_ids[7:] == [99, PENDING_TOKEN, PENDING_TOKEN] and seq.num_indexed_blocks == 2
    manager.check_integrity()
    step(resolved=[("s", [98, 97])], finished=["s"])
    # The resolved block is in the prefix index: a new sequence with those tokens hits it.
    hit = manager.step(StepInput("w", waiting=["t"], new_sequences=[NewSequence("t", prompt + [99, 98, 97])]))
    assert hit.scheduled[0].num_cached_tokens == 8
    manager.check_integrity()
