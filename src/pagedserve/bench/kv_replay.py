"""Recorded simulated workers for ``bench kv-scale --replay``: the pace of 50 steps/s without its CPU.

A ``SimulatedKVWorker`` runs the real worker-side KV code (scheduler, pool,
event log), which costs 1-3 ms of CPU per step at a batch of 256 here. 32 of
them at 50 steps/s need ~5 cores, so on a small machine kv-scale's workers
fall behind the pace, and the central manager's fixed CPU (Ray's timers, its
receiver's wake-ups) is spread over fewer worker-steps than at pace.

``ReplayedKVWorker`` takes that cost out of the measured window. Before it,
it runs its own ``SimulatedKVWorker`` (same workload, same seed, unpaced)
through the warm-up and then ``num_steps`` steps, and records what each step
did to the pools: the changes its event log saw, the occupancy after it,
the preemption requests its policy got, and the workload counters. In the
window it replays one recorded step per step: the changes go, block by
block, through a real ``EventLog`` (the listener calls a pool makes), so
the worker's ``KVPublisher`` drains, coalesces, packs and sends exactly what
the live worker would have sent, over the same transport and relays, to the
same central manager; each recorded preemption request goes through a
``RemotePreemptionPolicy``, so a request that may migrate is one blocking
call to the central manager, as live. ``ReplayedKV`` is the part of a
``LocalKVManager`` that a publisher reads (event log, drain, snapshot,
occupancy), its state the recording's start plus the replayed changes.

What differs from live workers: the recording decides preemptions locally
(swap, else recompute: no worker is known while recording), so nothing
migrates and the central manager's answers are not used; and the pool
integrity checks run on the recording worker (after recording, and after it
finishes every sequence), while in the window the central index is checked
against the replayed state.
"""

from __future__ import annotations

import time
from array import array
from dataclasses import asdict, dataclass

from pagedserve.kvmanager.events import (CLEARED, REMOVED, STORED, TIERS, AllBlocksCleared, BlockStored, EventLog,
                                         KVEventBatch, KVSnapshot, TierOccupancy)
from pagedserve.kvmanager.preemption import LocalPreemptionPolicy, PreemptionPolicy, PreemptionRequest

from .kv_sim import SimCounters, SimulatedKVWorker

# SimCounters' scalar fields, then its preemptions by mode, as recorded after every step.
_COUNTER_FIELDS = ("num_scheduled_tokens", "num_finished", "num_admitted", "num_pressure_requests",
                   "num_migrated_in")
_MODES = ("migrate", "swap", "recompute")


class _RecordingPolicy:
    """The local policy (no other worker is known while recording), noting every request."""

    def __init__(self) -> None:
        self.inner = LocalPreemptionPolicy()
        self.requests: list[PreemptionRequest] = []

    def decide(self, request: PreemptionRequest):
        self.requests.append(request)
        return self.inner.decide(request)


@dataclass(frozen=True)
class RecordedStep:
    """One step: its pool changes in order (kind, tier or None for every tier, keys),
    the occupancy after it, the preemption requests it made, and the counters after it."""

    changes: tuple[tuple[int, str | None, array], ...]
    occupancy: dict[str, TierOccupancy]
    requests: tuple[PreemptionRequest, ...]
    counters: tuple[int, ...]


class ReplayedKV:
    """What a ``KVPublisher`` reads of a ``LocalKVManager``: the event log, ``drain_events``,
    ``snapshot`` and ``occupancy``, over a replayed worker's cached keys per tier."""

    def __init__(self, worker_id: str, pool_config: dict) -> None:
        self.worker_id = worker_id
        self.pool_config = pool_config
        self.event_log = EventLog(worker_id)
        self.keys: dict[str, set[int]] = {tier: set() for tier in TIERS}
        self._occupancy: dict[str, TierOccupancy] = {tier: TierOccupancy() for tier in TIERS}

    def load(self, block_hashes: dict[str, list[int]], occupancy: dict[str, TierOccupancy]) -> None:
        """Start from a recorded snapshot's state (the next publish must be a snapshot)."""
        self.keys = {tier: set(block_hashes.get(tier, ())) for tier in TIERS}
        self._occupancy = dict(occupancy)
        self.event_log.discard_pending()

    def apply(self, step: RecordedStep) -> None:
        """The step's changes, block by block, as a pool reports them to its listener."""
        log = self.event_log
        for kind, tier, keys in step.changes:
            if kind == CLEARED:
                for name in (TIERS if tier is None else (tier,)):
                    self.keys[name].clear()
                log.cleared(tier)
            elif kind == STORED:
                self.keys[tier].update(keys)
                for key in keys:
                    log.stored(tier, key.to_bytes(8, "little"))
            else:
                self.keys[tier].difference_update(keys)
                for key in keys:
                    log.removed(tier, key.to_bytes(8, "little"))
        self._occupancy = step.occupancy

    # ---- as LocalKVManager ---------------------------------------------------------
    def occupancy(self) -> dict[str, TierOccupancy]:
        return dict(self._occupancy)

    def drain_events(self) -> KVEventBatch:
        return self.event_log.drain(self.occupancy())

    def snapshot(self) -> KVSnapshot:
        self.event_log.discard_pending()
        return KVSnapshot(self.worker_id, self.event_log.incarnation, self.event_log.next_seq, self.pool_config,
                          {tier: sorted(keys) for tier, keys in self.keys.items()}, self.occupancy(), time.time())


class _ReplayCounters:
    """``SimCounters.as_dict`` of the recording at the replay's position (steps: those replayed)."""

    def __init__(self, worker: "ReplayedKVWorker") -> None:
        self.worker = worker

    def as_dict(self) -> dict:
        worker = self.worker
        now = worker.steps[worker.position - 1].counters if worker.position else worker.start_counters
        values = [a - b for a, b in zip(now, worker.start_counters)]
        out: dict = dict(zip(_COUNTER_FIELDS, values))
        out["num_steps"] = worker.position
        out["preemptions_by_mode"] = dict(zip(_MODES, values[len(_COUNTER_FIELDS):]))
        return out


def _counter_values(counters: SimCounters) -> tuple[int, ...]:
    return (tuple(getattr(counters, name) for name in _COUNTER_FIELDS)
            + tuple(counters.preemptions_by_mode[mode] for mode in _MODES))


class ReplayedKVWorker:
    """A simulated worker that records its real KV code first and replays it at the pace.

    ``policy``: where replayed preemption requests go (a ``RemotePreemptionPolicy`` to the
    central manager, as a live worker's); its answers are not used. See the module docstring.
    """

    def __init__(self, recorder: SimulatedKVWorker, policy: PreemptionPolicy) -> None:
        if not isinstance(recorder.kv.preemption, _RecordingPolicy):
            raise ValueError("the recording worker needs recording_policy() as its preemption policy")
        self.recorder: SimulatedKVWorker | None = recorder
        self.worker_id = recorder.worker_id
        self.batch = recorder.workload.batch
        self.policy = policy
        self.kv = ReplayedKV(recorder.worker_id, asdict(recorder.kv.configs[recorder.worker_id]))
        self.steps: list[RecordedStep] = []
        self.position = 0
        self.start_counters: tuple[int, ...] = _counter_values(recorder.counters)
        self.blocks_in_use_after_finish: int | None = None
        self.end_keys: dict[str, set[int]] | None = None
        self.outbox: list = []      # nothing migrates (see the module docstring)
        self.is_recorded = False
        self.counters = _ReplayCounters(self)

    @staticmethod
    def recording_policy() -> PreemptionPolicy:
        return _RecordingPolicy()

    # ---- recording ---------------------------------------------------------------------
    def record(self, num_steps: int, warm_fraction: float = 0.9) -> None:
        """Warm up the recording worker (fill its batch), then record ``num_steps`` steps;
        then check its pool, finish every sequence and check that no block stays in use."""
        recorder = self.recorder
        kv, policy = recorder.kv, recorder.kv.preemption
        while recorder.num_prefilled < warm_fraction * recorder.workload.batch:
            recorder.step()
            kv.drain_events()   # the warm-up's changes are in the starting snapshot
        recorder.set_warm()
        start = kv.snapshot()
        self.start_counters = _counter_values(recorder.counters)
        policy.requests.clear()
        for _ in range(num_steps):
            recorder.step()
            batch = kv.drain_events()
            self.steps.append(RecordedStep(_changes(batch), batch.occupancy, tuple(policy.requests),
                                           _counter_values(recorder.counters)))
            policy.requests.clear()
        recorder.check_integrity()
        end = kv.snapshot()
        recorder.finish_all()
        recorder.check_integrity()
        occupancy = kv.occupancy()
        self.blocks_in_use_after_finish = occupancy["device"].num_used + occupancy["host"].num_used
        self.end_keys = {tier: set(end.block_hashes.get(tier, ())) for tier in TIERS}
        self.kv.load(start.block_hashes, start.occupancy)
        self.is_recorded = True
        self.recorder = None   # its pools and token lists: not needed again, and large at long contexts

    # ---- as SimulatedKVWorker ------------------------------------------------------------
    @property
    def num_prefilled(self) -> int:
        """The batch once recorded (the recording is warm), else 0."""
        return self.batch if self.is_recorded else 0

    @property
    def is_exhausted(self) -> bool:
        return self.position >= len(self.steps)

    def set_warm(self) -> None:
        pass   # the recording is warm

    def step(self) -> int:
        """Replay the next recorded step (nothing once the recording is exhausted)."""
        if self.position >= len(self.steps):
            return 0
        step = self.steps[self.position]
        self.kv.apply(step)
        for request in step.requests:
            self.policy.decide(request)
        self.position += 1
        return 0

    def check_integrity(self) -> None:
        """The replayed state is the recording's at this position (checked in full at its end)."""
        if self.is_exhausted and self.kv.keys != self.end_keys:
            raise AssertionError(f"{self.worker_id}: the replayed cached keys differ from the recording's")

    def finish_all(self) -> None:
        pass   # finished at recording (``blocks_in_use_after_finish``)


def _changes(batch: KVEventBatch) -> tuple[tuple[int, str | None, array], ...]:
    changes = []
    for event in batch.events:
        if isinstance(event, AllBlocksCleared):
            changes.append((CLEARED, event.medium, array("Q")))
        else:
            kind = STORED if isinstance(event, BlockStored) else REMOVED
            changes.append((kind, event.medium, array("Q", event.block_hashes)))
    return tuple(changes)
