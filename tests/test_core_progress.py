"""The engine core's progress file: a reader in another process never sees a half-written
step (a torn read once gave a last-progress time of 0, and so a stall verdict)."""

from __future__ import annotations

import multiprocessing as mp
import time

from pagedserve.workers.engine import core_progress
from pagedserve.workers.engine.core_progress import CoreProgress


def _write_steps(path: str, seconds: float) -> None:
    progress = CoreProgress(path)
    end, step = time.time() + seconds, 0
    while time.time() < end:
        step += 1
        progress.note_step(step, step, step)   # every figure of a step is the same number
        progress.note_admitted(step, was_idle=False)
    progress.close()


def test_a_reader_sees_whole_steps_while_the_core_writes(tmp_path):
    progress = CoreProgress.create(str(tmp_path / "progress"))
    created_at = progress.read()[0]
    writer = mp.get_context("spawn").Process(target=_write_steps, args=(progress.path, 1.5))
    writer.start()
    torn, num_reads, last_step = [], 0, 0
    try:
        while writer.is_alive() or num_reads == 0:
            last, num_unfinished, num_steps, num_generated_tokens = figures = progress.read()
            num_reads += 1
            if last < created_at or not num_unfinished == num_steps == num_generated_tokens:
                torn.append(figures)
            last_step = max(last_step, num_steps)
    finally:
        writer.join(timeout=30)
    assert writer.exitcode == 0
    assert not torn, f"{len(torn)} of {num_reads} reads saw a half-written step: {torn[:5]}"
    assert last_step > 0
    progress.unlink()


def test_a_writer_stopped_mid_copy_leaves_the_last_whole_step(tmp_path):
    """What a reader sees while the core is paused (or was killed) halfway through its copy:
    two reads in a row agree on the half-written bytes, so agreement alone is no proof."""
    progress = CoreProgress.create(str(tmp_path / "progress"))
    progress.note_step(7, 3, 40)
    whole = progress.read()
    next_seq = progress._seq + 1
    offset = core_progress._slot_offset(next_seq)
    half = core_progress._SLOT.pack(next_seq, time.time(), 4, 8, 41, next_seq)[:core_progress._SLOT.size // 2]
    progress._map[offset:offset + len(half)] = half
    assert progress.read() == progress.read() == whole
    progress.unlink()


def test_an_idle_core_starts_its_progress_clock_at_admission(tmp_path):
    progress = CoreProgress.create(str(tmp_path / "progress"))
    progress.note_step(3, 0, 17)
    stepped_at = progress.read()[0]
    progress.note_admitted(1, was_idle=False)
    assert progress.read() == (stepped_at, 1, 3, 17)
    time.sleep(0.01)
    progress.note_admitted(2, was_idle=True)
    last, num_unfinished, num_steps, num_generated_tokens = progress.read()
    assert last > stepped_at and (num_unfinished, num_steps, num_generated_tokens) == (2, 3, 17)
    progress.unlink()
