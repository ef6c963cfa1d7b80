"""Draining a worker: the KV manager moves its sequences away through migration."""

from __future__ import annotations

from pagedserve.kvmanager import KVManager, NewSequence, PoolConfig, StepInput


def two_workers(**b_overrides) -> KVManager:
    manager = KVManager()
    manager.add_worker("a", PoolConfig(num_device_blocks=16, block_size=4, max_model_len=64, watermark=0.0))
    manager.add_worker("b", PoolConfig(**{"num_device_blocks": 16, "block_size": 4, "max_model_len": 64,
                                          "watermark": 0.0, **b_overrides}))
    return manager


def start_two_sequences(manager: KVManager) -> None:
    manager.step(StepInput("a", waiting=["x", "y"], new_sequences=[
        NewSequence("x", list(range(9))), NewSequence("y", list(range(100, 105)))]))
    manager.step(StepInput("a", running=["x", "y"], appended=[("x", [1]), ("y", [2])]))


def test_a_draining_step_migrates_every_migratable_sequence_with_kv():
    manager = two_workers()
    start_two_sequences(manager)
    out = manager.step(StepInput("a", running=["x", "y"], appended=[("x", [3]), ("y", [4])],
                                 migratable=["x", "y"], is_draining=True))
    assert sorted((p.seq_id, p.mode, p.target_worker) for p in out.preempted) == [
        ("x", "migrate", "b"), ("y", "migrate", "b")]
    assert not out.scheduled
    assert manager.block_manager("a").seqs == {}
    assert manager.stats("a")["device_blocks_used"] == 0 and manager.stats("a")["is_draining"]
    manager.check_integrity()
    # Empty now: it may leave the accounting.
    manager.remove_worker("a")
    assert "a" not in manager.draining
    manager.check_integrity()


def test_sequences_that_cannot_migrate_keep_running_on_the_draining_worker():
    manager = two_workers()
    start_two_sequences(manager)
    # "y" is not migratable (say n > 1): it is scheduled here as usual.
    out = manager.step(StepInput("a", running=["x", "y"], appended=[("x", [3]), ("y", [4])],
                                 migratable=["x"], is_draining=True))
    assert [(p.seq_id, p.target_worker) for p in out.preempted] == [("x", "b")]
    assert [s.seq_id for s in out.scheduled] == ["y"]
    manager.check_integrity()


def test_no_room_anywhere_keeps_the_sequence_here_until_there_is():
    manager = two_workers(num_device_blocks=2)
    start_two_sequences(manager)
    # "x" needs 3 + 1 blocks, "b" has 2: it stays; "y" needs 2 + 1: it stays too.
    out = manager.step(StepInput("a", running=["x", "y"], appended=[("x", [3]), ("y", [4])],
                                 migratable=["x", "y"], is_draining=True))
    assert out.preempted == [] and {s.seq_id for s in out.scheduled} == {"x", "y"}
    manager.check_integrity()


def test_a_draining_worker_is_never_a_migration_target():
    manager = two_workers()
    manager.add_worker("c", PoolConfig(num_device_blocks=6, block_size=4, max_model_len=64, watermark=0.0))
    # "b" (the roomiest) drains: its step says so.
    manager.step(StepInput("b", is_draining=True))
    manager.step(StepInput("c", waiting=["x"], new_sequences=[NewSequence("x", list(range(9)))]))
    manager.step(StepInput("c", running=["x"], appended=[("x", [1])]))
    out = manager.step(StepInput("c", running=["x"], appended=[("x", [2])], migratable=["x"],
                                 is_draining=True))
    assert [(p.seq_id, p.target_worker) for p in out.preempted] == [("x", "a")]
    # A step without the flag: it takes migrations again.
    manager.step(StepInput("b"))
    assert "b" not in manager.draining
    manager.check_integrity()
