"""The seed's fragmentation simulation, run on our two device pools.

Random allocations (1..``max_alloc_blocks`` blocks) and frees (each
operation frees a random live allocation with ``free_probability``) hit a
first-fit contiguous allocator (``ContiguousBlockPool.allocate_run``) and the
block pool (``BlockPool``, an allocation being that many single blocks). Both
see the same random stream.

External fragmentation, measured after every operation::

    1 - (largest allocation that would succeed now) / (total free blocks)

For the contiguous allocator the largest allocation is the longest run of
free blocks; for the block pool it is every free block, so its value is 0 by
construction. This is the seed's metric (1 - largest free region / total
free). We also count failed allocations whose size was at most the total
free space: requests refused only because free space was scattered.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from pagedserve.kvmanager.block_pool import BlockPool, ContiguousBlockPool

SEED_FRAGMENTATION = {"contiguous": {100: 0.08, 500: 0.22, 1000: 0.34, 5000: 0.41}, "paged": 0.0}

DEFINITION = ("external fragmentation = 1 - largest allocation that would succeed / total free "
              "blocks, after each operation; 'peak' is its maximum so far (the seed's figure). "
              "failed_with_free_space: share of allocations refused although size <= total free")


def external_fragmentation(largest_allocatable: int, num_free: int) -> float:
    return 1.0 - largest_allocatable / num_free if num_free else 0.0


class _ContiguousHeap:
    name = "contiguous"

    def __init__(self, num_blocks: int) -> None:
        self.pool = ContiguousBlockPool(num_blocks, block_size=1)
        self.num_blocks = num_blocks

    def try_allocate(self, size: int) -> list[int] | None:
        return self.pool.allocate_run(size) if self.pool.can_allocate_run(size) else None

    def largest_allocatable(self, allocations: list[list[int]]) -> int:
        """The longest free run: the widest gap between the live runs."""
        largest, end = 0, 0
        for start, size in sorted((run[0], len(run)) for run in allocations):
            largest = max(largest, start - end)
            end = start + size
        return max(largest, self.num_blocks - end)


class _PagedHeap:
    name = "paged"

    def __init__(self, num_blocks: int) -> None:
        self.pool = BlockPool(num_blocks, block_size=1)

    def try_allocate(self, size: int) -> list[int] | None:
        if size > self.pool.num_free_blocks:
            return None
        return [self.pool.allocate() for _ in range(size)]

    def largest_allocatable(self, allocations: list[list[int]]) -> int:
        return self.pool.num_free_blocks


@dataclass
class FragmentationTrace:
    """One allocator's run: fragmentation after each operation and the failures."""

    fragmentation: list[float] = field(default_factory=list)
    num_alloc_attempts: int = 0
    num_failed: int = 0
    num_failed_with_free_space: int = 0

    def peak_at(self, num_ops: int) -> float:
        return max(self.fragmentation[:num_ops], default=0.0)

    def at(self, num_ops: int) -> float:
        return self.fragmentation[min(num_ops, len(self.fragmentation)) - 1] if self.fragmentation else 0.0


def simulate_fragmentation(num_blocks: int = 81920, num_operations: int = 1000,
                           max_alloc_blocks: int = 256, free_probability: float = 0.4,
                           seed: int = 0) -> dict[str, FragmentationTrace]:
    """Run the same random alloc/free stream on both allocators. Defaults are the seed's
    (an 80 GB GPU in 1 MB blocks, allocations up to 256 MB, 40% frees)."""
    if num_blocks < 1 or num_operations < 1 or not 1 <= max_alloc_blocks <= num_blocks:
        raise ValueError("need num_blocks >= 1, num_operations >= 1 and 1 <= max_alloc_blocks <= num_blocks")
    if not 0 <= free_probability <= 1:
        raise ValueError(f"free_probability must be in [0, 1], got {free_probability}")
    heaps = (_ContiguousHeap(num_blocks), _PagedHeap(num_blocks))
    live: dict[str, list[list[int]]] = {h.name: [] for h in heaps}
    traces = {h.name: FragmentationTrace() for h in heaps}
    rng = random.Random(seed)
    for _ in range(num_operations):
        is_free = rng.random() < free_probability
        size = rng.randint(1, max_alloc_blocks)
        pick = rng.random()
        for heap in heaps:
            allocations, trace = live[heap.name], traces[heap.name]
            if is_free and allocations:
                for block in allocations.pop(int(pick * len(allocations))):
                    heap.pool.free(block)
            else:
                trace.num_alloc_attempts += 1
                blocks = heap.try_allocate(size)
                if blocks is None:
                    trace.num_failed += 1
                    trace.num_failed_with_free_space += size <= heap.pool.num_free_blocks
                else:
                    allocations.append(blocks)
            trace.fragmentation.append(
                external_fragmentation(heap.largest_allocatable(allocations), heap.pool.num_free_blocks))
    return traces


def fragmentation_report(num_trials: int = 5, checkpoints: Sequence[int] = (100, 500, 1000),
                         progress=None, **options) -> tuple[dict, dict[str, list[float]]]:
    """Run ``num_trials`` seeds of ``simulate_fragmentation(**options)``.

    Returns the plain-data report (means over trials of fragmentation at each
    checkpoint, current and peak so far, and the failure shares) and, for
    plots, each allocator's fragmentation after every operation, averaged.
    """
    if num_trials < 1:
        raise ValueError(f"num_trials must be >= 1, got {num_trials}")
    num_operations = max(max(checkpoints), options.pop("num_operations", 0))
    runs = []
    for trial in range(num_trials):
        runs.append(simulate_fragmentation(num_operations=num_operations, seed=trial, **options))
        if progress is not None:
            progress.update(1)
    report: dict = {"num_trials": num_trials, "num_operations": num_operations, **options}
    traces: dict[str, list[float]] = {}
    for name in ("contiguous", "paged"):
        runs_of = [run[name] for run in runs]
        attempts = sum(t.num_alloc_attempts for t in runs_of)

        def mean(values) -> float:
            values = list(values)
            return sum(values) / len(values)

        report[name] = {
            "fragmentation": mean(t.at(num_operations) for t in runs_of),
            "peak_fragmentation": mean(t.peak_at(num_operations) for t in runs_of),
            "at_ops": {str(n): {"fragmentation": mean(t.at(n) for t in runs_of),
                                "peak_fragmentation": mean(t.peak_at(n) for t in runs_of)}
                       for n in checkpoints},
            "failed_allocations": sum(t.num_failed for t in runs_of) / attempts if attempts else 0.0,
            "failed_with_free_space": (sum(t.num_failed_with_free_space for t in runs_of) / attempts
                                       if attempts else 0.0),
        }
        traces[name] = [mean(t.fragmentation[i] for t in runs_of) for i in range(num_operations)]
    return report, traces
