"""The plain-data inputs and outputs of one batched KV manager call per step.

Everything here is ints, strings, lists and tuples, so a step crosses a Ray
actor boundary cheaply and ``to_wire``/``from_wire`` round-trip it through
msgpack.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

# A token sampled by a step that is still running (overlapped scheduling): its KV is
# computed by the next step on the device's copy of it; its value comes later.
PENDING_TOKEN = -1


@dataclass(slots=True)
class NewSequence:
    """A sequence entering the manager, with every token known so far."""

    seq_id: str
    token_ids: list[int]
    extra_key: str | None = None
    # Leading tokens whose KV arrives with the sequence (disaggregated
    # prefill): the manager allocates their blocks on admission and the
    # worker writes the transferred KV into them before the forward pass.
    num_imported_tokens: int = 0
    # Never reuse cached blocks for it (it needs every position's logits); its own
    # full blocks are still offered to the cache.
    skip_prefix_cache: bool = False


@dataclass(slots=True)
class StepInput:
    """What one worker's engine asks of the KV manager for its next step.

    Applied in this order: ``new_sequences``, ``forks`` (parent, child),
    ``resolved`` (the values of pending tokens, by sequence, oldest first),
    ``accepted`` (speculative decoding: how many of a sequence's proposed tokens
    its last step verified and accepted; those are kept with their KV, the rest
    are dropped and their slots given back), ``appended`` (tokens sampled last
    step, by sequence; ``PENDING_TOKEN`` for one sampled by a step still running,
    whose value comes later in ``resolved``), ``finished`` (finished or aborted:
    their blocks return to the pool), ``proposed`` (speculative decoding: tokens
    proposed to follow a running sequence's known ones, computed by this step
    for verification and never indexed for the prefix cache; dropped if the
    sequence is preempted), then scheduling:
    ``running`` in priority order (highest first; victims for preemption are
    taken from its tail), then ``waiting`` in priority order (new, preempted
    and swapped-out sequences), until ``token_budget`` tokens are granted.
    """

    worker_id: str
    running: list[str] = field(default_factory=list)
    waiting: list[str] = field(default_factory=list)
    new_sequences: list[NewSequence] = field(default_factory=list)
    forks: list[tuple[str, str]] = field(default_factory=list)
    resolved: list[tuple[str, list[int]]] = field(default_factory=list)
    appended: list[tuple[str, list[int]]] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    token_budget: int = 8192
    # Running sequences that may be migrated to another worker if preempted.
    migratable: list[str] = field(default_factory=list)
    # The worker is leaving: move every migratable running sequence to a worker with
    # room, and send it no migrated sequences.
    is_draining: bool = False
    accepted: list[tuple[str, int]] = field(default_factory=list)
    proposed: list[tuple[str, list[int]]] = field(default_factory=list)


@dataclass(slots=True)
class ScheduledSeq:
    """A sequence granted ``num_tokens`` tokens this step.

    Its tokens ``[start, start + num_tokens)`` are computed into the slots
    ``block_table`` gives. ``num_cached_tokens`` counts the prefix-cache hit
    taken when this sequence was admitted in this step (0 otherwise);
    ``num_imported_tokens`` the leading tokens whose transferred KV the
    worker must write into the table's blocks before this step's forward.

    In-process, ``block_table`` is the manager's own live list, not a copy:
    read-only for the worker, and valid until the next plan (whoever keeps
    it longer copies it). ``first_changed_block`` is the index of the first
    entry that may differ from what this sequence's table held the last time
    it was scheduled (0 when it is new, resumed, swapped in, migrated in or
    its table was rebuilt; 0 is always safe), so a worker keeping a
    persistent copy of each table rewrites only the entries from there on.
    """

    seq_id: str
    start: int
    num_tokens: int
    block_table: list[int]
    num_cached_tokens: int = 0
    num_imported_tokens: int = 0
    first_changed_block: int = 0


@dataclass(slots=True)
class Preemption:
    """A sequence pushed off the device this step.

    ``swap``: its KV moved to the host pool. ``recompute``: its KV is
    dropped. ``migrate``: the manager forgot it here; the worker must export
    its KV (before this step's copies and forward) and hand the request to
    ``target_worker``, which has room.
    """

    seq_id: str
    mode: str
    target_worker: str | None = None


@dataclass(slots=True)
class StepOutput:
    """The plan for one step. The worker must execute it in this order:

    1. ``swap_out`` (device block, host block) copies, which include hashed
       device blocks offloaded to the host cache as they are evicted;
    2. ``swap_in`` (host block, device block) copies;
    3. ``copy_on_write`` (src, dst) device block copies;
    4. the forward pass for ``scheduled``.
    """

    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Preemption] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    copy_on_write: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


_NESTED = {
    "new_sequences": NewSequence,
    "scheduled": ScheduledSeq,
    "preempted": Preemption,
}


def to_wire(obj: Any) -> dict:
    """A msgpack-ready dict of a step dataclass (nested ones as dicts)."""
    out = {}
    for f in fields(obj):
        value = getattr(obj, f.name)
        if f.name in _NESTED:
            value = [to_wire(v) for v in value]
        out[f.name] = value
    return out


def from_wire(cls: type, data: dict) -> Any:
    """Rebuild a step dataclass from ``to_wire`` output (after msgpack)."""
    kwargs = {}
    for f in fields(cls):
        if f.name not in data:
            continue
        value = data[f.name]
        if f.name in _NESTED:
            value = [from_wire(_NESTED[f.name], v) for v in value]
        elif f.name in ("forks", "swap_out", "swap_in", "copy_on_write"):
            value = [tuple(v) for v in value]
        elif f.name == "accepted":
            value = [(seq_id, num) for seq_id, num in value]
        elif f.name in ("appended", "resolved", "proposed"):
            value = [(seq_id, list(tokens)) for seq_id, tokens in value]
        kwargs[f.name] = value
    return cls(**kwargs)
