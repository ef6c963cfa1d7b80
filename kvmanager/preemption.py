"""Preemption decisions: when a worker cannot grow, who goes where.

A worker's KV manager picks its victims locally (lowest priority first, see
``KVManager._schedule_running``) but asks a policy *how* to preempt them:

- ``migrate``: hand the sequence, with its KV, to another worker with room;
- ``swap``: move its KV to this worker's host tier;
- ``recompute``: drop its KV and compute it again later.

``decide_preemption`` is the policy itself, a pure function of a
``PreemptionRequest`` and the other workers' room. The central KV manager
runs it with cluster-wide occupancy; the ``KVManager`` of one process runs
it with the workers it holds. A worker makes at most one such call per
step that needs it, listing every sequence that may become a victim, and
only when one of them could migrate; ``LocalPreemptionPolicy`` (swap while
the host tier has room, else recompute) answers whenever the central manager
need not or cannot.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

import msgpack

logger = logging.getLogger(__name__)

MODES = ("migrate", "swap", "recompute", "keep")  # "keep": leave it running (drain only)


@dataclass(slots=True)
class PreemptionCandidate:
    """A sequence that may be preempted this step, as the policy needs to see it."""

    seq_id: str
    num_blocks: int          # device blocks it holds
    num_computed: int        # tokens whose KV it has
    is_migratable: bool = False
    num_blocks_wanted: int = 0   # new blocks it would take this step


@dataclass(slots=True)
class PreemptionRequest:
    """A worker that cannot grow asks how to preempt ``candidates`` (in victim order).

    ``forced_mode`` is the worker's configured ``preemption_mode`` ("swap" or
    "recompute" forbid migration; None allows all three), or "migrate" for a
    draining worker: migrate where there is room, else "keep" it running. ``num_blocks_short``
    estimates how many blocks the step lacks: the victims likely preempted are
    the first candidates that free that many.
    """

    worker_id: str
    candidates: list[PreemptionCandidate]
    num_host_free_blocks: int
    block_size: int
    forced_mode: str | None = None
    num_blocks_short: int = 0

    @property
    def likely_victims(self) -> list[PreemptionCandidate]:
        victims, num_freed = [], 0
        for c in self.candidates:
            if num_freed >= self.num_blocks_short:
                break
            victims.append(c)
            num_freed += c.num_blocks + c.num_blocks_wanted
        return victims

    def pack(self) -> bytes:
        return msgpack.packb([self.worker_id, [[c.seq_id, c.num_blocks, c.num_computed, c.is_migratable,
                                                c.num_blocks_wanted]
                                               for c in self.candidates],
                              self.num_host_free_blocks, self.block_size, self.forced_mode,
                              self.num_blocks_short])

    @classmethod
    def unpack(cls, data: bytes) -> "PreemptionRequest":
        worker_id, candidates, host_free, block_size, forced, short = msgpack.unpackb(data)
        return cls(worker_id, [PreemptionCandidate(*c) for c in candidates], host_free, block_size, forced,
                   short)


@dataclass(slots=True)
class PreemptionChoice:
    seq_id: str
    mode: str
    target_worker: str | None = None


@dataclass(slots=True)
class PreemptionDecision:
    """One choice per candidate, in the request's order; ``decided_by`` says which policy."""

    choices: list[PreemptionChoice] = field(default_factory=list)
    decided_by: str = "local"

    def pack(self) -> bytes:
        return msgpack.packb([[[c.seq_id, c.mode, c.target_worker] for c in self.choices], self.decided_by])

    @classmethod
    def unpack(cls, data: bytes) -> "PreemptionDecision":
        choices, decided_by = msgpack.unpackb(data)
        return cls([PreemptionChoice(*c) for c in choices], decided_by)


@dataclass(slots=True)
class MigrationTarget:
    """Another worker that could take migrated sequences: its free device blocks
    (after its watermark) and block size."""

    worker_id: str
    num_free_blocks: int
    block_size: int


def decide_preemption(request: PreemptionRequest, targets: list[MigrationTarget],
                      decided_by: str = "central") -> PreemptionDecision:
    """The policy: migrate a migratable sequence with KV to the target with the most
    free blocks if it can hold it plus one block; else swap while the host tier has
    room; else recompute. Room taken by earlier choices counts against later ones.
    """
    free = {t.worker_id: t.num_free_blocks for t in targets
            if t.worker_id != request.worker_id and t.block_size == request.block_size}
    host_free = request.num_host_free_blocks
    decision = PreemptionDecision(decided_by=decided_by)
    for c in request.candidates:
        if request.forced_mode == "migrate" and not (c.is_migratable and c.num_computed and free):
            decision.choices.append(PreemptionChoice(c.seq_id, "keep"))
            continue
        if request.forced_mode == "recompute":
            decision.choices.append(PreemptionChoice(c.seq_id, "recompute"))
            continue
        if request.forced_mode in (None, "migrate") and c.is_migratable and c.num_computed and free:
            best = max(free, key=free.__getitem__)
            need = c.num_blocks + 1
            if free[best] >= need:
                free[best] -= need
                decision.choices.append(PreemptionChoice(c.seq_id, "migrate", best))
                continue
        if request.forced_mode == "migrate":
            decision.choices.append(PreemptionChoice(c.seq_id, "keep"))
            continue
        if c.num_blocks <= host_free:
            host_free -= c.num_blocks
            decision.choices.append(PreemptionChoice(c.seq_id, "swap"))
        else:
            decision.choices.append(PreemptionChoice(c.seq_id, "recompute"))
    return decision


class PreemptionPolicy(Protocol):
    def decide(self, request: PreemptionRequest) -> PreemptionDecision: ...


class LocalPreemptionPolicy:
    """No other workers known: swap while the host tier has room, else recompute."""

    def decide(self, request: PreemptionRequest) -> PreemptionDecision:
        return decide_preemption(request, [], decided_by="local")


class RemotePreemptionPolicy:
    """Ask the central KV manager (``call``: a blocking call with its own timeout that
    returns a decision or raises); fall back to the local policy when it fails.

    Only migration needs the cluster's view: a request without a migratable
    candidate (or with ``forced_mode`` "swap"/"recompute") is decided locally
    by the same policy, with no call. After a failure the central manager is
    not asked again for ``backoff_s`` (while it is down, migration pauses);
    after an answer that found no room anywhere, not for ``no_room_backoff_s``
    (under sustained pressure a worker does not ask at every step).
    """

    def __init__(self, call: Callable[[PreemptionRequest], PreemptionDecision],
                 fallback: PreemptionPolicy | None = None, backoff_s: float = 5.0,
                 no_room_backoff_s: float = 0.5) -> None:
        self.call = call
        self.fallback = fallback or LocalPreemptionPolicy()
        self.backoff_s = backoff_s
        self.no_room_backoff_s = no_room_backoff_s
        self.num_calls = 0
        self.num_failures = 0
        self.num_local = 0
        self.call_seconds = 0.0
        self._skip_until = 0.0

    def decide(self, request: PreemptionRequest) -> PreemptionDecision:
        wants_migration = request.forced_mode in (None, "migrate") and any(
            c.is_migratable and c.num_computed for c in request.candidates)
        if not wants_migration or time.monotonic() < self._skip_until:
            self.num_local += 1
            return self.fallback.decide(request)
        start = time.perf_counter()
        self.num_calls += 1
        try:
            decision = self.call(request)
        except Exception as exc:
            self.num_failures += 1
            self._skip_until = time.monotonic() + self.backoff_s
            logger.warning("worker %s: central preemption decision failed (%r); deciding locally "
                           "for %.0f s", request.worker_id, exc, self.backoff_s)
            return self.fallback.decide(request)
        finally:
            self.call_seconds += time.perf_counter() - start
        if [c.seq_id for c in decision.choices] != [c.seq_id for c in request.candidates]:
            logger.warning("worker %s: central preemption decision does not answer the %d candidates; "
                           "deciding locally", request.worker_id, len(request.candidates))
            return self.fallback.decide(request)
        if not any(c.mode == "migrate" for c in decision.choices):
            self._skip_until = time.monotonic() + self.no_room_backoff_s
        return decision
