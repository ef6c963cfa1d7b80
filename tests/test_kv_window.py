"""Blocks freed out of the sliding window (kvmanager/window.py), on the KV manager alone.

A simulated worker keeps a token id in every cache slot, runs each step's copies and
writes like a real one, and checks that every position a query still sees (its window)
holds the right token; -1 entries may appear only before the window. The engine-level
checks (token-identical to transformers, prefix hits past the window) are in
tests/test_models.py.
"""

from __future__ import annotations

import pytest

from pagedserve.kvmanager import (IntegrityError, KVManager, KVManagerError, NewSequence, PoolConfig,
                                  StepInput, StepOutput)
from pagedserve.kvmanager.events import EventLog
from pagedserve.kvmanager.local_manager import LocalKVManager
from pagedserve.kvmanager.window import FREED, WindowFreeing

from kv_simulator import SimulatedWorker

WINDOW = 6
BS = 4


class WindowedWorker(SimulatedWorker):
    """The simulated worker (checking the positions its window reads), and the manager's
    integrity after every step."""

    def __init__(self, manager: KVManager, worker_id: str = "w", window: int | None = WINDOW) -> None:
        super().__init__(manager, worker_id, sliding_window=window)

    def step(self, step_input: StepInput) -> StepOutput:
        output = super().step(step_input)
        self.manager.check_integrity()
        return output


def make(num_device=32, num_host=0, window=WINDOW, manager=None, **kwargs):
    manager = manager or KVManager()
    manager.add_worker("w", PoolConfig(num_device_blocks=num_device, num_host_blocks=num_host, block_size=BS,
                                       max_model_len=256, watermark=0.0, sliding_window=window, **kwargs))
    return manager, WindowedWorker(manager, window=window)


def decode(worker, seq_ids, num_steps, token=7, **step_kwargs):
    for _ in range(num_steps):
        worker.step(StepInput("w", running=list(seq_ids), appended=[(s, [token]) for s in seq_ids],
                              **step_kwargs))


def test_num_out_of_window_is_the_blocks_before_the_first_querys_window():
    freeing = WindowFreeing(sliding_window=6, block_size=4)
    # Next query at 9 sees 4..9: block 0 (0-3) is out; at 8 it sees 3..8: nothing is.
    assert [freeing.num_out_of_window(n) for n in (0, 5, 8, 9, 12, 13, 100)] == [0, 0, 0, 1, 1, 2, 23]
    with pytest.raises(ValueError):
        WindowFreeing(0, 4)


def test_blocks_leave_as_the_window_moves_and_the_footprint_stays_bounded():
    manager, worker = make()
    bm = manager.block_manager("w")
    worker.step(StepInput("w", waiting=["a"], new_sequences=[NewSequence("a", list(range(30)))],
                          token_budget=8))
    # The admission step frees nothing (its first query is at 0 anyway).
    for _ in range(3):  # chunked prefill: 8 tokens a step
        worker.step(StepInput("w", running=["a"], token_budget=8))
    seq = bm.seqs["a"]
    assert seq.num_computed == 30 and seq.num_freed_blocks == WindowFreeing(WINDOW, BS).num_out_of_window(24)
    peak = 0
    for _ in range(40):
        decode(worker, ["a"], 1)
        peak = max(peak, bm.device.num_used_blocks)
    assert seq.num_freed_blocks == WindowFreeing(WINDOW, BS).num_out_of_window(seq.num_computed - 1)
    assert seq.block_table[:seq.num_freed_blocks] == [FREED] * seq.num_freed_blocks
    # Window 6 over blocks of 4: at most 3 blocks back, plus the one being written.
    assert peak <= 3
    assert bm.counters.num_window_freed_blocks == seq.num_freed_blocks
    worker.step(StepInput("w", finished=["a"]))
    assert manager.num_used_blocks() == 0


def test_no_window_or_contiguous_allocation_keeps_every_block():
    for kwargs in ({"window": None}, {"allocation": "contiguous", "enable_prefix_caching": False}):
        manager = KVManager()
        manager.add_worker("w", PoolConfig(num_device_blocks=80, block_size=BS, max_model_len=64, watermark=0.0,
                                           sliding_window=kwargs.pop("window", WINDOW), **kwargs))
        manager.step(StepInput("w", waiting=["a"], new_sequences=[NewSequence("a", list(range(40)))]))
        for _ in range(5):
            manager.step(StepInput("w", running=["a"], appended=[("a", [1])]))
        assert FREED not in manager.block_manager("w").seqs["a"].block_table
        manager.check_integrity()


def test_freed_blocks_stay_cached_and_a_hit_never_skips_a_block_the_window_needs():
    manager, worker = make(num_device=8)
    bm = manager.block_manager("w")
    prompt = list(range(100, 124))  # 6 blocks, longer than the window
    worker.step(StepInput("w", waiting=["a"], new_sequences=[NewSequence("a", prompt)]))
    decode(worker, ["a"], 2)
    assert bm.seqs["a"].num_freed_blocks >= 4
    worker.step(StepInput("w", finished=["a"]))
    assert manager.num_used_blocks() == 0 and bm.device.num_cached_free_blocks == 6

    # The whole chain is cached: a hit of every full block but the last token's.
    out = worker.step(StepInput("w", waiting=["b"], new_sequences=[NewSequence("b", prompt + [1, 2])]))
    (b,) = out.scheduled
    assert b.num_cached_tokens == 24 and FREED not in b.block_table  # nothing freed in its admission step
    decode(worker, ["b"], 1)
    assert bm.seqs["b"].num_freed_blocks == WindowFreeing(WINDOW, BS).num_out_of_window(26)
    worker.step(StepInput("w", finished=["b"]))

    # Evict some of the chain's blocks (those freed out of b's window went first): the next
    # sequence hits only the chain's unbroken head, and every position its window reads
    # holds its own token (the worker checks).
    worker.step(StepInput("w", waiting=["x"], new_sequences=[NewSequence("x", list(range(900, 916)))]))
    assert bm.device.num_cached_free_blocks < 6
    worker.step(StepInput("w", finished=["x"]))
    still_cached = 0
    while still_cached < 6 and bm.device.lookup(_chain(prompt)[still_cached],
                                                prompt[still_cached * BS:(still_cached + 1) * BS]) is not None:
        still_cached += 1
    out = worker.step(StepInput("w", waiting=["c"], new_sequences=[NewSequence("c", prompt + [3])]))
    (c,) = out.scheduled
    assert c.num_cached_tokens == still_cached * BS < 24
    decode(worker, ["c"], 3)
    worker.step(StepInput("w", finished=["c"]))
    assert manager.num_used_blocks() == 0


def _chain(tokens):
    from pagedserve.kvmanager import hash_block

    hashes, parent = [], None
    for i in range(len(tokens) // BS):
        parent = hash_block(parent, tokens[i * BS:(i + 1) * BS], None)
        hashes.append(parent)
    return hashes


def test_events_see_a_freed_block_only_when_the_cache_changes():
    log = EventLog("w")
    manager, worker = make(num_device=7, manager=LocalKVManager(event_log=log))
    prompt = list(range(20))
    worker.step(StepInput("w", waiting=["a"], new_sequences=[NewSequence("a", prompt)]))
    stored = log.drain({}).events
    assert stored and all(type(e).__name__ == "BlockStored" for e in stored)
    decode(worker, ["a"], 3)
    assert manager.block_manager("w").seqs["a"].num_freed_blocks > 0
    # Freed out of the window but still cached: no BlockRemoved.
    assert not any(type(e).__name__ == "BlockRemoved" for e in log.drain({}).events)
    worker.step(StepInput("w", finished=["a"]))
    worker.step(StepInput("w", waiting=["x"], new_sequences=[NewSequence("x", list(range(500, 526)))]))
    removed = [e for e in log.drain({}).events if type(e).__name__ == "BlockRemoved"]
    assert removed, "evicting the freed blocks must reach the event log"


def test_swap_keeps_freed_entries_and_moves_only_held_blocks():
    manager, worker = make(num_device=9, num_host=16, preemption_mode="swap")
    bm = manager.block_manager("w")
    worker.step(StepInput("w", waiting=["b"], new_sequences=[NewSequence("b", list(range(20)))]))
    decode(worker, ["b"], 3)
    num_freed = bm.seqs["b"].num_freed_blocks
    held = len(bm.seqs["b"].block_table) - num_freed
    assert num_freed > 0
    # a's prompt takes every free block; its next token needs one more: b (listed last) is swapped.
    worker.step(StepInput("w", running=["b"], appended=[("b", [7])], waiting=["a"],
                          new_sequences=[NewSequence("a", list(range(300, 300 + 4 * bm.device.num_free_blocks)))]))
    assert bm.device.num_free_blocks == 0
    out = worker.step(StepInput("w", running=["a", "b"], appended=[("a", [7]), ("b", [7])]))
    assert [p.mode for p in out.preempted] == ["swap"]
    b = bm.seqs["b"]
    assert b.host_table[:num_freed] == [FREED] * num_freed and len(out.swap_out) == held
    assert bm.host.num_used_blocks == held
    worker.step(StepInput("w", finished=["a"]))
    out = worker.step(StepInput("w", waiting=["b"]))
    # Held blocks come back by copy, or from the device cache when still there.
    assert 0 < len(out.swap_in) <= held and b.block_table[:num_freed] == [FREED] * num_freed
    decode(worker, ["b"], 4)
    assert b.num_freed_blocks > num_freed
    worker.step(StepInput("w", finished=["b"]))
    assert manager.num_used_blocks() == 0


def test_fork_shares_held_blocks_and_recompute_forgets_freed_ones():
    manager, worker = make(num_device=16, preemption_mode="recompute")
    bm = manager.block_manager("w")
    worker.step(StepInput("w", waiting=["p"], new_sequences=[NewSequence("p", list(range(18)))]))
    decode(worker, ["p"], 2)
    worker.step(StepInput("w", running=["p", "c"], forks=[("p", "c")], appended=[("p", [5])]))
    child = bm.seqs["c"]
    assert child.num_freed_blocks == bm.seqs["p"].num_freed_blocks > 0
    decode(worker, ["p", "c"], 6)
    bm.preempt_recompute(child)
    assert child.num_freed_blocks == 0 and child.block_table == []
    manager.check_integrity()
    out = worker.step(StepInput("w", running=["p"], waiting=["c"], appended=[("p", [5])]))
    assert any(s.seq_id == "c" for s in out.scheduled)  # from its cached head, or from 0
    decode(worker, ["p", "c"], 3)
    worker.step(StepInput("w", finished=["p", "c"]))
    assert manager.num_used_blocks() == 0


@pytest.mark.parametrize("window", [WINDOW, None])
def test_a_sequence_with_freed_blocks_is_never_migrated_and_prefill_workers_keep_blocks(window):
    """Its out-of-window KV is gone, so it cannot be exported whole: swapped or recomputed
    instead. Without a window (the control) the same steps migrate it."""
    manager = KVManager()
    for worker_id, role in (("w", "mixed"), ("v", "mixed"), ("pf", "prefill")):
        manager.add_worker(worker_id, PoolConfig(num_device_blocks=9, block_size=BS, max_model_len=256,
                                                 watermark=0.0, sliding_window=window, role=role))
    assert manager.block_manager("pf").window is None
    assert (manager.block_manager("w").window is None) == (window is None)
    worker = WindowedWorker(manager, window=window)
    bm = manager.block_manager("w")
    worker.step(StepInput("w", waiting=["a"], new_sequences=[NewSequence("a", list(range(20)))]))
    decode(worker, ["a"], 3, migratable=["a"])
    assert (bm.seqs["a"].num_freed_blocks > 0) == (window is not None)
    worker.step(StepInput("w", running=["a"], appended=[("a", [7])], waiting=["b"], migratable=["a"],
                          new_sequences=[NewSequence("b", list(range(300, 300 + 4 * bm.device.num_free_blocks)))]))
    out = worker.step(StepInput("w", running=["b", "a"], appended=[("a", [7]), ("b", [7])], migratable=["a"]))
    assert [p.mode == "migrate" for p in out.preempted] == [window is None]
    worker.step(StepInput("w", finished=["b"] + (["a"] if window else [])))

    # Draining moves only what it can export whole.
    worker.step(StepInput("w", waiting=["d"], new_sequences=[NewSequence("d", list(range(70, 90)))]))
    decode(worker, ["d"], 3)
    out = worker.step(StepInput("w", running=["d"], appended=[("d", [1])], migratable=["d"], is_draining=True))
    assert [p.mode for p in out.preempted] == ([] if window else ["migrate"])
    if window:
        worker.step(StepInput("w", finished=["d"]))
    manager.check_integrity()
    assert bm.device.num_used_blocks == 0


def test_restore_takes_tables_with_freed_entries_and_integrity_catches_bad_ones():
    manager, worker = make()
    worker.step(StepInput("w", waiting=["a"], new_sequences=[NewSequence("a", list(range(20)))]))
    decode(worker, ["a"], 3)
    bm = manager.block_manager("w")
    seq = bm.seqs["a"]
    entry = {"seq_id": "a", "token_ids": list(seq.token_ids[:-1]) + [seq.token_ids[-1]],
             "num_computed": seq.num_computed, "block_table": list(seq.block_table)}
    config = manager.configs["w"]
    restored = KVManager()
    restored.restore_worker("w", config, [entry])
    again = restored.block_manager("w").seqs["a"]
    assert again.num_freed_blocks == seq.num_freed_blocks
    restored.check_integrity()
    with pytest.raises(KVManagerError, match="freed"):
        KVManager().restore_worker("w", config, [{**entry, "block_table": [5, FREED, 6, 7, 8, 9, 10]}])
    # A freed entry inside the window is an integrity error, not a silent read of block -1.
    while seq.num_freed_blocks <= bm.window.num_out_of_window(seq.num_computed):
        bm.device.free(seq.block_table[seq.num_freed_blocks])  # the pool stays consistent
        seq.block_table[seq.num_freed_blocks] = FREED
        seq.num_freed_blocks += 1
    with pytest.raises(IntegrityError, match="inside the window"):
        bm.check_integrity()
