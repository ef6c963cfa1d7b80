"""How rank 0 hands each step's packed command to the other ranks of its group.

Never a Ray actor call per rank per step (a round trip costs about 1 ms). Two
channels, one interface (``send`` on rank 0, ``receive`` on the others):

* ``PipeChannel``, when every rank runs on rank 0's node: one named pipe
  (FIFO) per rank, written by rank 0 and read by that rank. A send is one
  ``write`` per rank into the kernel's pipe buffer; a rank waiting for the next
  step sleeps in ``read``, using no CPU. A rank that dies closes its end and
  rank 0's next write fails (``BrokenPipeError``); rank 0 dying ends every
  rank's read.
* ``BroadcastChannel``, across nodes: a gloo broadcast of a fixed-size frame
  over the group's control process group (a second broadcast for the rest of a
  command longer than one frame).

Frames are ``[length: 8 bytes little-endian][payload]``.
"""

from __future__ import annotations

import os
import struct
import tempfile
from typing import Protocol

import numpy as np
import torch

from .group import TensorParallelGroup

FRAME_BYTES = 4096
_LENGTH = struct.Struct("<q")


class GroupBrokenError(RuntimeError):
    """A rank of the group is gone: the group cannot run another step."""


class CommandChannel(Protocol):
    def send(self, data: bytes) -> None:
        """Rank 0: hand ``data`` to every other rank."""

    def receive(self) -> bytes:
        """Any other rank: the next ``data`` rank 0 sent (blocks until there is one)."""

    def close(self) -> None:
        ...


class BroadcastChannel:
    """Commands as gloo broadcasts over the group's control process group."""

    name = "broadcast"

    def __init__(self, group: TensorParallelGroup) -> None:
        self.group = group
        self.frame = torch.zeros(FRAME_BYTES, dtype=torch.uint8)
        self._frame_array = self.frame.numpy()

    def send(self, data: bytes) -> None:
        length = len(data)
        head = min(length, FRAME_BYTES - _LENGTH.size)
        _LENGTH.pack_into(self._frame_array, 0, length)
        self._frame_array[_LENGTH.size:_LENGTH.size + head] = np.frombuffer(data, dtype=np.uint8, count=head)
        try:
            self.group.broadcast_control(self.frame)
            if length > head:
                self.group.broadcast_control(torch.frombuffer(bytearray(data[head:]), dtype=torch.uint8))
        except RuntimeError as exc:
            raise GroupBrokenError(f"tensor-parallel broadcast failed: {exc}") from exc

    def receive(self) -> bytes:
        self.group.broadcast_control(self.frame)
        (length,) = _LENGTH.unpack_from(self._frame_array, 0)
        head = min(length, FRAME_BYTES - _LENGTH.size)
        data = self._frame_array[_LENGTH.size:_LENGTH.size + head].tobytes()
        if length > head:
            rest = torch.empty(length - head, dtype=torch.uint8)
            self.group.broadcast_control(rest)
            data += rest.numpy().tobytes()
        return data

    def close(self) -> None:
        pass


class PipeChannel:
    """Commands through one named pipe per rank, on one node.

    Set up in two halves over the group's store: every other rank makes and
    opens its pipe (``PipeChannel.reader``) and publishes the path; rank 0
    opens them all for writing (``PipeChannel.writer``).
    """

    name = "pipe"

    def __init__(self, fds: list[int], directory: str | None = None) -> None:
        self.fds = fds
        self.directory = directory
        self._pending = b""

    @classmethod
    def reader(cls, group: TensorParallelGroup) -> "PipeChannel":
        directory = tempfile.mkdtemp(prefix="pagedserve-tp-")
        path = os.path.join(directory, f"rank{group.rank}")
        os.mkfifo(path, 0o600)
        # Non-blocking so that opening does not wait for the writer; reads then block.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        os.set_blocking(fd, True)
        group.store.set(f"pipe/{group.rank}", path)
        return cls([fd], directory)

    def forget_path(self) -> None:
        """Remove the pipe's name once rank 0 has opened it (the open ends stay valid)."""
        if self.directory is not None:
            for name in os.listdir(self.directory):
                os.unlink(os.path.join(self.directory, name))
            os.rmdir(self.directory)
            self.directory = None

    @classmethod
    def writer(cls, group: TensorParallelGroup) -> "PipeChannel":
        fds = []
        for rank in range(1, group.size):
            path = group.store.get(f"pipe/{rank}").decode()
            fds.append(os.open(path, os.O_WRONLY))
        return cls(fds)

    def send(self, data: bytes) -> None:
        frame = _LENGTH.pack(len(data)) + data
        try:
            for fd in self.fds:
                view = memoryview(frame)
                while view:
                    view = view[os.write(fd, view):]
        except OSError as exc:
            raise GroupBrokenError(f"a tensor-parallel rank is gone ({exc})") from exc

    def receive(self) -> bytes:
        header = self._read_exactly(_LENGTH.size)
        (length,) = _LENGTH.unpack(header)
        return self._read_exactly(length)

    def _read_exactly(self, num_bytes: int) -> bytes:
        chunks = []
        while num_bytes:
            chunk = os.read(self.fds[0], num_bytes)
            if not chunk:
                raise GroupBrokenError("rank 0 of the tensor-parallel group is gone (its pipe closed)")
            chunks.append(chunk)
            num_bytes -= len(chunk)
        return b"".join(chunks)

    def close(self) -> None:
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds = []
        self.forget_path()


def open_channel(group: TensorParallelGroup, node_key: str) -> CommandChannel:
    """The group's channel: pipes when every rank shares rank 0's node (``node_key`` names
    the node: a Ray node id or a host name), else broadcasts. Every rank must call it."""
    group.store.set(f"node/{group.rank}", node_key)
    nodes = [group.store.get(f"node/{rank}").decode() for rank in range(group.size)]
    if len(set(nodes)) > 1:
        return BroadcastChannel(group)
    if group.rank == 0:
        channel = PipeChannel.writer(group)
        group.barrier()
        return channel
    channel = PipeChannel.reader(group)
    group.barrier()   # rank 0 has opened every pipe
    channel.forget_path()
    return channel
