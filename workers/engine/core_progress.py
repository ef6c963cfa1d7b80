"""An engine core's progress, shared with its worker actor through a small mapped file.

The core writes four numbers after every step (when the last step ended, unfinished
requests, steps, generated tokens); the actor reads them for its heartbeat and stall check.

No message and no lock: a sequence lock over two slots. The writer packs step ``n``'s figures,
tagged with ``n``, into slot ``n % 2`` (the slot readers are not being sent to), then publishes
``n`` in the 8-byte header. A reader takes the header, the slot it names and the header again,
and keeps the slot only if all three say the same ``n``; otherwise the writer moved on during
the read and it reads again. Two copies in a row that agree are not enough: a writer paused in
the middle of its copy leaves the same half-written bytes for both. The writer never waits, and
a writer killed mid-copy leaves the last published slot whole.

Python has no memory fences: this relies on the other process seeing the two copies in the
order they were made, as x86 guarantees. Where stores may become visible out of order (Arm),
the slot's two tags still catch a copy seen half done at either end.
"""

from __future__ import annotations

import mmap
import os
import struct
import time

_HEADER = struct.Struct("<q")          # the sequence number of the last whole slot
_SLOT = struct.Struct("<qddddq")       # n, last progress (wall time), unfinished, steps, generated tokens, n
SIZE = _HEADER.size + 2 * _SLOT.size


def _slot_offset(seq: int) -> int:
    return _HEADER.size + (seq % 2) * _SLOT.size


class CoreProgress:
    """The mapped figures at ``path`` (created by ``create``; each side maps it with ``open``).

    One process writes (the engine core); any number read."""

    def __init__(self, path: str) -> None:
        self.path = path
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), SIZE)
        self._seq = _HEADER.unpack_from(self._map)[0]

    @classmethod
    def create(cls, path: str) -> "CoreProgress":
        with open(path, "wb") as f:
            f.write(bytes(SIZE))
        progress = cls(path)
        progress._write(time.time(), 0, 0, 0)
        return progress

    def note_step(self, num_steps: int, num_unfinished: int, num_generated_tokens: int) -> None:
        self._write(time.time(), num_unfinished, num_steps, num_generated_tokens)

    def note_admitted(self, num_unfinished: int, was_idle: bool) -> None:
        """A request was admitted: ``num_unfinished`` now; an idle engine's progress clock
        starts at it (an idle engine has not stalled)."""
        last, _, num_steps, num_generated_tokens = self.read()
        self._write(time.time() if was_idle else last, num_unfinished, num_steps, num_generated_tokens)

    def _write(self, last: float, num_unfinished: int, num_steps: int, num_generated_tokens: int) -> None:
        seq = self._seq + 1
        offset = _slot_offset(seq)
        self._map[offset:offset + _SLOT.size] = _SLOT.pack(
            seq, last, num_unfinished, num_steps, num_generated_tokens, seq)
        self._map[:_HEADER.size] = _HEADER.pack(seq)
        self._seq = seq

    def read(self) -> tuple[float, int, int, int]:
        """(last progress, unfinished requests, steps, generated tokens) of one whole step."""
        num_tries = 0
        while True:
            seq = _HEADER.unpack_from(self._map)[0]
            offset = _slot_offset(seq)
            first, last, num_unfinished, num_steps, num_generated_tokens, final = _SLOT.unpack(
                self._map[offset:offset + _SLOT.size])
            if first == final == seq == _HEADER.unpack_from(self._map)[0]:
                return last, int(num_unfinished), int(num_steps), int(num_generated_tokens)
            num_tries += 1
            if num_tries % 16 == 0:
                time.sleep(0)   # the writer is mid-publish on a busy machine: let it run

    def close(self) -> None:
        self._map.close()

    def unlink(self) -> None:
        self.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


__all__ = ["CoreProgress"]
