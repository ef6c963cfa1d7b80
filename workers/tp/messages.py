"""What rank 0 of a tensor-parallel group sends the other ranks: typed commands, msgpack-packed.

Every command carries the batches of KV copies (swap out, swap in,
copy-on-write) that rank 0 made since its last command, so each rank applies
them to its own shard first, batch by batch, as rank 0 did. A step's plan (``RunStep``)
is ``ModelInput`` less what only rank 0 uses (which rows sample, prompt
logprobs): the other ranks compute hidden states, never logits. With LoRA it
also carries what rank 0's adapter manager decided for the step
(``lora.follower.LoRAUpdate``), which the other ranks apply before the forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import ClassVar

import msgpack

Pairs = list[tuple[int, int]]


@dataclass
class KVCopies:
    """Block copies in the order the KV manager requires: swap out, swap in, copy-on-write."""

    swap_out: Pairs = field(default_factory=list)
    swap_in: Pairs = field(default_factory=list)
    copy_on_write: Pairs = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.swap_out or self.swap_in or self.copy_on_write)


@dataclass
class RunStep:
    """One forward pass: the fields of ``ModelInput`` the other ranks need. With ``pending``
    (overlapped scheduling), rank 0 broadcasts the running step's ``num_pending_sources``
    sampled ids (of ``pending_dtype``) over the model group right after this command, device
    to device, so that no rank waits for them on the host. The ``lora_*`` fields (None without
    adapters) are a ``LoRAUpdate``: the adapter ids whose host copies rank 0 dropped, the slots
    it wrote as (slot, lora_int_id, lora_name, lora_path), each chunk's slot (-1: the base
    model; None: no chunk has an adapter), and with unified paging the adapters that came into
    pages as (lora_int_id, lora_name, lora_path, page ids) or left them (no page ids), in order."""

    TAG: ClassVar[int] = 1
    rows: list[int]
    starts: list[int]
    input_ids: list[int]
    table_updates: list[tuple[int, list[int], int]]
    num_tokens: list[int] | None = None
    pending: list[tuple[int, int]] | None = None
    num_pending_sources: int = 0
    pending_dtype: str | None = None
    lora_dropped: list[int] | None = None
    lora_loads: list[tuple[int, int, str, str]] | None = None
    lora_slots: list[int] | None = None
    lora_pages: list[tuple[int, str, str, list[int]]] | None = None


@dataclass
class EnableLoRA:
    """Give every linear layer of the rank's decoder ``max_loras`` adapter slots of rank
    ``max_lora_rank`` (the engine's ``enable_lora``); steps' ``lora_*`` fields fill them."""

    TAG: ClassVar[int] = 8
    max_loras: int
    max_lora_rank: int


@dataclass
class EnableLoRAPages:
    """Unified paging: the rank's adapter slots read pages of its KV cache, block
    ``zero_page`` kept zero, pieces cut for rows of at least ``min_features`` (rank 0's
    figures); steps' ``lora_pages`` say which adapter is in which blocks."""

    TAG: ClassVar[int] = 9
    zero_page: int
    min_features: int


@dataclass
class AllocateCache:
    """Allocate the rank's KV pools (same block counts on every rank)."""

    TAG: ClassVar[int] = 2
    block_size: int
    num_device_blocks: int
    num_host_blocks: int


@dataclass
class ProfilePeak:
    """Run ``ModelRunner.profile_peak_memory`` (CUDA) in step with rank 0."""

    TAG: ClassVar[int] = 3
    num_tokens: int
    block_size: int


@dataclass
class ReadBlocks:
    """Send rank 0 the rank's heads of these device blocks (a gather over the control group)."""

    TAG: ClassVar[int] = 4
    block_ids: list[int]


@dataclass
class WriteBlocks:
    """Write the rank's heads of a payload rank 0 broadcasts next (``layout``: its full shape)."""

    TAG: ClassVar[int] = 5
    block_ids: list[int]
    layout: list[int]
    dtype: str


@dataclass
class WarmUpKernels:
    """Compile the kernels the steps launch now (``ModelRunner.warm_up_kernels``)."""

    TAG: ClassVar[int] = 7
    max_blocks_per_seq: int


@dataclass
class Stop:
    """Leave the command loop; the group is shutting down."""

    TAG: ClassVar[int] = 6


Command = (RunStep | EnableLoRA | EnableLoRAPages | AllocateCache | ProfilePeak | ReadBlocks | WriteBlocks
           | WarmUpKernels | Stop)
COMMANDS: dict[int, type] = {cls.TAG: cls for cls in (RunStep, EnableLoRA, EnableLoRAPages, AllocateCache, ProfilePeak,
                                                        ReadBlocks, WriteBlocks, WarmUpKernels, Stop)}
_FIELDS: dict[type, tuple[str, ...]] = {cls: tuple(f.name for f in fields(cls)) for cls in COMMANDS.values()}


def pack(command: Command, copies: list[KVCopies] = ()) -> bytes:
    """``[tag, [[swap_out, swap_in, copy_on_write], ...], *fields]`` as msgpack."""
    batches = [[c.swap_out, c.swap_in, c.copy_on_write] for c in copies]
    return msgpack.packb([command.TAG, batches, *(getattr(command, name) for name in _FIELDS[type(command)])])


def unpack(data: bytes) -> tuple[Command, list[KVCopies]]:
    """The command and the batches of copies to apply before it, in order."""
    tag, batches, *values = msgpack.unpackb(data)
    cls = COMMANDS.get(tag)
    if cls is None:
        raise ValueError(f"unknown tensor-parallel command tag {tag!r}")
    return cls(*values), [KVCopies(*batch) for batch in batches]
