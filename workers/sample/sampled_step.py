"""A step's samples between the device and the host.

With overlapped scheduling the engine plans and launches step n + 1 before it reads
step n's sampled ids: they stay on the device, where step n + 1's inputs take them,
and come to the host through a pinned buffer (one device-to-host copy, an event)
that the engine reads after the launch. ``SampledStep`` is what the engine keeps of
a step meanwhile; ``TokenReadback`` owns the pinned buffers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..engine.request import Sequence

from ..outputs.request_output import SampleLogprobs


@dataclass
class SampledStep:
    """One step's sampling rows, in order: each position's sequence, the batch row and
    flags it had then, and the sampled ids (on the device; on the host once read).

    ``positions`` (overlapped steps only): where each sequence's pending token sits in
    its ``token_ids`` (-1 for the positions in ``last``, whose sample is the last their
    sequence may have: they get no pending token). ``num_row_releases``: the batch's count of released rows at the
    launch (if it moved, some position's row may belong to another sequence now).
    """

    seqs: list[Sequence]
    rows: torch.Tensor
    flags: torch.Tensor
    token_tensor: torch.Tensor
    first_samples: list[Sequence]
    token_ids: list[int] | None = None
    logprobs: list[SampleLogprobs | None] | None = None
    per_row: list[int] = field(default_factory=list)
    flag_values: list[int] | None = None
    forked: list[tuple[Sequence, Sequence]] = field(default_factory=list)
    positions: list[int] | None = None
    last: list[int] = field(default_factory=list)   # positions whose sample is their last
    num_row_releases: int = 0
    num_ended: int = 0     # the engine's count of ended sequences when the step was planned
    readback: object = None
    host_tokens: torch.Tensor | None = None

    def keep(self, kept: list[int]) -> None:
        """Keep only the positions ``kept`` (ascending): the others' sequences ended since
        the step was planned, and their samples are dropped."""
        new_index = {p: i for i, p in enumerate(kept)}
        index = torch.tensor(kept, dtype=torch.int64)
        self.seqs = [self.seqs[p] for p in kept]
        self.rows, self.flags = self.rows[index], self.flags[index]
        if self.token_ids is not None:
            self.token_ids = [self.token_ids[p] for p in kept]
        if self.host_tokens is not None:
            self.host_tokens = self.host_tokens[index]
        if self.logprobs is not None:
            self.logprobs = [self.logprobs[p] for p in kept]
        if self.flag_values is not None:
            self.flag_values = [self.flag_values[p] for p in kept]
        if self.positions is not None:
            self.positions = [self.positions[p] for p in kept]
        self.per_row = [new_index[p] for p in self.per_row if p in new_index]
        self.last = [new_index[p] for p in self.last if p in new_index]
        alive = set(map(id, self.seqs))
        self.first_samples = [seq for seq in self.first_samples if id(seq) in alive]


class TokenReadback:
    """Sampled ids to the host without waiting at the launch: a copy into one of two
    pinned buffers (alternating, so a step's buffer is never written while the step
    before it may still be copying) and an event to wait on when they are read."""

    def __init__(self, device: torch.device, capacity: int) -> None:
        self.device = device
        self._is_cuda = device.type == "cuda"
        self._buffers = ([torch.empty(capacity, dtype=torch.int64, pin_memory=True) for _ in range(2)]
                         if self._is_cuda else [])
        self._next = 0

    def start(self, token_tensor: torch.Tensor):
        """Begin the copy of ``token_tensor``'s ids; returns the handle ``read`` takes."""
        if not self._is_cuda:
            return token_tensor
        index, self._next = self._next, self._next ^ 1
        num = token_tensor.shape[0]
        buffer = self._buffers[index]
        if num > buffer.shape[0]:
            buffer = self._buffers[index] = torch.empty(2 * num, dtype=torch.int64, pin_memory=True)
        buffer[:num].copy_(token_tensor, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return buffer[:num], event

    def read(self, handle) -> tuple[list[int], torch.Tensor]:
        """The ids (a list, and a CPU tensor) once the copy is done."""
        if not self._is_cuda:
            return handle.tolist(), handle
        host, event = handle
        event.synchronize()
        return host.tolist(), host
