"""Persistent block-table rows: only changed entries are written, rows are reused
without showing stale entries, none leak, and kernels never read past a table.

The end-to-end tests poison every table entry past each sequence's table in
the tensor the attention kernel receives, under preemption, forks, chunked
prefill and prefix hits: outputs stay token-identical to transformers.
"""

from __future__ import annotations

import random

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.workers.model.block_tables import BlockTableRows


def _check_gathered(step, tables) -> None:
    for i, table in enumerate(tables):
        assert step.block_tables[i, :len(table)].tolist() == list(table)


def test_rows_write_only_the_changed_entries_and_gather_in_step_order():
    rows = BlockTableRows(torch.device("cpu"), num_rows=2, num_columns=2)
    a, b = [3, 4, 5], [7]
    step = rows.prepare(["a", "b"], [a, b], [0, 0])
    _check_gathered(step, [a, b])
    assert step.block_tables.shape == (2, 3) and step.block_tables.dtype == torch.int32
    assert rows.num_entries_written == 4
    # Decode without a new block: nothing is written.
    step = rows.prepare(["b", "a"], [b, a], [1, 3])
    _check_gathered(step, [b, a])
    assert rows.num_entries_written == 4
    # One new block for a, copy-on-write of b's last block.
    a.append(9)
    b[0] = 8
    step = rows.prepare(["a", "b"], [a, b], [3, 0])
    _check_gathered(step, [a, b])
    assert rows.num_entries_written == 6


def test_a_new_row_is_written_whole_whatever_the_hint_says():
    rows = BlockTableRows(torch.device("cpu"), num_rows=1, num_columns=4)
    rows.prepare(["old"], [[1, 2, 3, 4]], [0])
    rows.release("old")
    step = rows.prepare(["new"], [[5, 6]], [2])  # a wrong hint for a sequence new to the rows
    _check_gathered(step, [[5, 6]])
    rows.check({"new"})


def test_rows_grow_and_a_release_makes_a_row_reusable():
    rows = BlockTableRows(torch.device("cpu"), num_rows=1, num_columns=1)
    tables = {f"s{i}": list(range(i, i + 3 * i + 1)) for i in range(5)}
    step = rows.prepare(list(tables), list(tables.values()), [0] * 5)
    _check_gathered(step, list(tables.values()))
    assert rows.num_rows_in_use == 5 and rows.host.shape[0] >= 5 and rows.host.shape[1] >= 13
    num_rows = rows.host.shape[0]
    rows.release("s2")
    rows.release("s2")  # twice is harmless
    rows.prepare(["s9"], [[1]], [0])
    assert rows.host.shape[0] == num_rows  # s2's row was reused
    rows.check(set(tables) - {"s2"} | {"s9"})


def test_check_finds_leaked_rows():
    rows = BlockTableRows(torch.device("cpu"))
    rows.prepare(["a", "b"], [[1], [2]], [0, 0])
    rows.check({"a", "b", "c"})
    with pytest.raises(RuntimeError, match="leaked.*'b'"):
        rows.check({"a"})


class MirroredRows(BlockTableRows):
    """The CUDA layout on the CPU: a separate device copy, updated with the changes only."""

    def _to_device(self, host):
        return host.clone()


@pytest.mark.parametrize("rows_class", [BlockTableRows, MirroredRows])
def test_random_tables_with_exact_hints_stay_exact(rows_class):
    """Tables grow, get rebuilt, copy-on-write, leave and come back, with the hint a KV
    manager gives; the gathered tables always equal the true ones (and a device copy
    equals the host rows)."""
    rng = random.Random(0)
    rows = rows_class(torch.device("cpu"), num_rows=2, num_columns=2)
    true: dict[str, list[int]] = {}
    seen: dict[str, list[int]] = {}  # what each table was when last prepared
    for _ in range(300):
        seq_id = f"s{rng.randrange(12)}"
        action = rng.random()
        if action < 0.1:
            true.pop(seq_id, None)
            seen.pop(seq_id, None)
            rows.release(seq_id)
            continue
        table = true.setdefault(seq_id, [])
        if action < 0.6:
            table.extend(rng.randrange(1000) for _ in range(rng.randrange(3)))
        elif action < 0.8 and table:
            table[-1] = rng.randrange(1000)
        elif action < 0.9:
            table[:] = [rng.randrange(1000) for _ in range(rng.randrange(6))]
        batch = rng.sample(sorted(true), rng.randrange(1, len(true) + 1))
        hints = []
        for s in batch:
            before, now = seen.get(s, []), true[s]
            first = next((i for i, (x, y) in enumerate(zip(before, now)) if x != y), min(len(before), len(now)))
            hints.append(first)
        step = rows.prepare(batch, [true[s] for s in batch], hints)
        _check_gathered(step, [true[s] for s in batch])
        for s in batch:
            seen[s] = list(true[s])
        rows.check(set(true))
        if rows.mirror is not None:
            assert rows.mirror is not rows.host and torch.equal(rows.mirror, rows.host)


# ---- end to end: kernels never read past a table -------------------------------------

POISONS = {
    "out_of_range": lambda num_blocks: num_blocks + 1000,   # a read fails loudly
    "another_block": lambda num_blocks: num_blocks - 1,     # a read gives wrong tokens
}


def _poison_past_tables(engine, value: int, monkeypatch) -> list[int]:
    """After every gather: each sequence's entries past its table become ``value`` and
    the entries within it must equal the table (a reused row shows no stale entry).
    Returns [steps, table entries the steps' tables held]."""
    counts = [0, 0]
    rows, scheduler = engine.runner.block_tables, engine.scheduler
    gather, schedule = rows.gather, scheduler.schedule
    plans = []

    def planned():
        plans.append(schedule())
        return plans[-1]

    def poisoned(row_index, num_blocks):
        gathered = gather(row_index, num_blocks)
        # The forward gathers its rows in the plan's order.
        tables = [sched.block_table for _, sched in plans[-1].scheduled]
        assert row_index.tolist() == [seq.batch_row for seq, _ in plans[-1].scheduled]
        for i, table in enumerate(tables):
            assert gathered[i, :len(table)].tolist() == list(table)
            gathered[i, len(table):] = value
        counts[0] += 1
        counts[1] += sum(len(table) for table in tables)
        return gathered

    monkeypatch.setattr(scheduler, "schedule", planned)
    monkeypatch.setattr(rows, "gather", poisoned)
    return counts


@pytest.mark.parametrize("kernel", ["native", "torch"])
@pytest.mark.parametrize("poison", sorted(POISONS))
def test_poisoned_entries_past_each_table_change_no_token(poison, kernel, tiny_model, hf_greedy,
                                                          monkeypatch):
    from pagedserve.kernels import cpu_decode

    if kernel == "torch":
        monkeypatch.setattr(cpu_decode, "supports_cache", lambda k_cache: False)
    num_blocks = 28
    llm = LLM(tiny_model("llama"), device="cpu", dtype="float32", swap_space_gb=0.001, block_size=8,
              num_device_blocks=num_blocks, max_num_batched_tokens=32)
    rows = llm.engine.runner.block_tables
    counts = _poison_past_tables(llm.engine, POISONS[poison](num_blocks), monkeypatch)
    rng = random.Random(3)
    base = [rng.randrange(5, 1024) for _ in range(48)]
    prompts = [base[:24 + 3 * i] + [rng.randrange(5, 1024) for _ in range(j)]
               for i, j in enumerate((2, 9, 17, 0, 30, 5, 12, 1))]
    params = [SamplingParams(temperature=0.0, max_tokens=20, n=2 if i % 3 == 0 else 1)
              for i in range(len(prompts))]
    outputs = llm.generate(prompts, params)
    for output in outputs:
        reference = hf_greedy("llama", output.prompt_token_ids, 20)
        assert [c.token_ids for c in output.outputs] == [reference] * len(output.outputs)
    stats = llm.stats()
    assert sum(stats["num_preemptions_by_mode"].values()) > 0 and stats["prefix_cache_hit_rate"] > 0
    assert counts[0] == stats["num_steps"]
    # The KV manager's hints keep the writes to what changed.
    assert rows.num_entries_written < counts[1] / 2, (rows.num_entries_written, counts[1])
    llm.check_integrity()
    assert rows.num_rows_in_use == 0


def test_rows_are_released_by_finish_abort_and_preemption(tiny_model):
    llm = LLM(tiny_model("llama"), device="cpu", dtype="float32", swap_space_gb=0.001, block_size=8,
              num_device_blocks=20, preemption_mode="recompute")
    engine, rows = llm.engine, llm.engine.runner.block_tables
    for i, length in enumerate((10, 35, 60, 22, 47)):
        engine.add_request(f"r{i}", list(range(5, 5 + length)),
                           SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    for _ in range(6):
        engine.step()
        engine.check_integrity()
    assert 0 < rows.num_rows_in_use <= len(engine.scheduler.running)
    engine.abort_request("r0")
    while engine.has_unfinished_requests():
        engine.step()
        engine.check_integrity()
    assert engine.stats()["num_preemptions_by_mode"]["recompute"] > 0
    assert rows.num_rows_in_use == 0
