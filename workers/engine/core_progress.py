"""An engine core's progress, shared with its worker actor through a small mapped file.

The core writes four numbers after every step (when the last step ended, unfinished
requests, steps, generated tokens); the actor reads them for its heartbeat and stall check.
No message and no lock: the writer copies the packed figures in one slice assignment (never
``struct.pack_into``, which zeroes the bytes before it writes them), and the reader takes a
copy only once two copies in a row agree, so it never sees a half-written step.
"""

from __future__ import annotations

import mmap
import os
import struct
import time

_LAYOUT = struct.Struct("<dddd")   # last progress (wall time), unfinished, steps, generated tokens
SIZE = _LAYOUT.size


class CoreProgress:
    """The mapped figures at ``path`` (created by ``create``; each side maps it with ``open``)."""

    def __init__(self, path: str) -> None:
        self.path = path
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), SIZE)

    @classmethod
    def create(cls, path: str) -> "CoreProgress":
        with open(path, "wb") as f:
            f.write(_LAYOUT.pack(time.time(), 0, 0, 0))
        return cls(path)

    def note_step(self, num_steps: int, num_unfinished: int, num_generated_tokens: int) -> None:
        self._write(time.time(), num_unfinished, num_steps, num_generated_tokens)

    def note_admitted(self, num_unfinished: int, was_idle: bool) -> None:
        """A request was admitted: ``num_unfinished`` now; an idle engine's progress clock
        starts at it (an idle engine has not stalled)."""
        last, _, num_steps, num_generated_tokens = _LAYOUT.unpack_from(self._map)
        self._write(time.time() if was_idle else last, num_unfinished, num_steps, num_generated_tokens)

    def _write(self, last: float, num_unfinished: int, num_steps: int, num_generated_tokens: int) -> None:
        self._map[:SIZE] = _LAYOUT.pack(last, num_unfinished, num_steps, num_generated_tokens)

    def read(self) -> tuple[float, int, int, int]:
        """(last progress, unfinished requests, steps, generated tokens)."""
        data = self._map[:SIZE]
        while (again := self._map[:SIZE]) != data:   # a step was being written: read it whole
            data = again
        last, num_unfinished, num_steps, num_generated_tokens = _LAYOUT.unpack(data)
        return last, int(num_unfinished), int(num_steps), int(num_generated_tokens)

    def close(self) -> None:
        self._map.close()

    def unlink(self) -> None:
        self.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


__all__ = ["CoreProgress"]
