"""KV events: what a worker's pools tell the central KV manager, changes only.

Modelled on vLLM's KV events (``BlockStored``, ``BlockRemoved``,
``AllBlocksCleared``, each with a ``medium``): a worker's ``EventLog`` is fed
by its pools (``BlockPool.listener``) whenever a block hash is registered on a
tier or forgotten there, and ``drain()`` hands everything since the last
drain to the wire as one ordered ``KVEventBatch``, numbered per worker so the
receiver can detect a lost batch and ask for a resync (a ``KVSnapshot``).

A batch also carries a constant-size occupancy summary per tier, so the cost
of a batch grows with what changed, never with context length or pool size.

Hashes travel as 8-byte keys (``hashing.block_hash_key``: a prefix of the
16-byte blake2b digest) packed into one bytes object per event. The central
index uses them only as routing hints; a colliding key costs a cache miss
(the worker's own pool checks full hashes and tokens), never a wrong token.
No torch, no Ray: plain data and msgpack.
"""

from __future__ import annotations

import sys
import time
import uuid
from array import array
from dataclasses import dataclass, field
from typing import Union

import msgpack

from .hashing import BlockHash, block_hash_key

TIERS = ("device", "host")
_TIER_CODES = {tier: code for code, tier in enumerate(TIERS)}
_STORED, _REMOVED, _CLEARED = 0, 1, 2
_WIRE_VERSION = 1
# A worker that cannot publish (the central manager is down) keeps at most this
# many pending events; past it they are dropped and the next publish is a snapshot.
DEFAULT_MAX_PENDING_EVENTS = 100_000


def _pack_keys(keys: list[int]) -> bytes:
    packed = array("Q", keys)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def _unpack_keys(data: bytes) -> list[int]:
    packed = array("Q")
    packed.frombytes(data)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tolist()


@dataclass(slots=True)
class BlockStored:
    """Blocks whose hashes became cached on ``medium`` ("device" or "host").

    Unlike vLLM's event it carries no token ids and no parent hash: the index
    needs neither (each hash already covers its whole prefix), and leaving
    them out keeps a decode step's events to a few bytes per new full block.
    """

    block_hashes: list[int]
    medium: str = "device"


@dataclass(slots=True)
class BlockRemoved:
    """Blocks whose hashes are no longer cached on ``medium`` (evicted, reset)."""

    block_hashes: list[int]
    medium: str = "device"


@dataclass(slots=True)
class AllBlocksCleared:
    """Every cached hash on ``medium`` is gone (None: on every tier)."""

    medium: str | None = None


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


@dataclass(slots=True, frozen=True)
class TierOccupancy:
    """One tier's pool, in blocks: ``num_used + num_cached_free + num_free == num_total``.

    Cached-free blocks hold a reusable prefix but can be taken by any
    allocation, so capacity decisions count them as free.
    """

    num_used: int = 0
    num_cached_free: int = 0
    num_free: int = 0
    num_total: int = 0

    @property
    def num_available(self) -> int:
        return self.num_free + self.num_cached_free

    @property
    def used_fraction(self) -> float:
        return self.num_used / self.num_total if self.num_total else 0.0


Occupancy = dict  # tier name -> TierOccupancy


def occupancy_to_wire(occupancy: dict[str, TierOccupancy]) -> list[int]:
    flat: list[int] = []
    for tier in TIERS:
        o = occupancy.get(tier) or TierOccupancy()
        flat += (o.num_used, o.num_cached_free, o.num_free, o.num_total)
    return flat


def occupancy_from_wire(flat: list[int]) -> dict[str, TierOccupancy]:
    return {tier: TierOccupancy(*flat[4 * i:4 * i + 4]) for i, tier in enumerate(TIERS)}


def _event_to_wire(event: KVEvent) -> list:
    if isinstance(event, BlockStored):
        return [_STORED, _TIER_CODES[event.medium], _pack_keys(event.block_hashes)]
    if isinstance(event, BlockRemoved):
        return [_REMOVED, _TIER_CODES[event.medium], _pack_keys(event.block_hashes)]
    if isinstance(event, AllBlocksCleared):
        return [_CLEARED, -1 if event.medium is None else _TIER_CODES[event.medium], b""]
    raise TypeError(f"not a KV event: {event!r}")


def _event_from_wire(data: list) -> KVEvent:
    kind, tier, keys = data
    if kind == _STORED:
        return BlockStored(_unpack_keys(keys), TIERS[tier])
    if kind == _REMOVED:
        return BlockRemoved(_unpack_keys(keys), TIERS[tier])
    if kind == _CLEARED:
        return AllBlocksCleared(None if tier < 0 else TIERS[tier])
    raise ValueError(f"unknown KV event kind {kind!r}")


@dataclass(slots=True)
class KVEventBatch:
    """Events ``first_seq .. first_seq + len(events) - 1`` of one worker incarnation.

    ``oldest_event_at`` is when the first of them happened on the worker
    (``created_at`` for an empty batch): the receiver measures event lag from it.
    ``is_draining``: the worker is leaving and takes no migrated sequences.
    """

    worker_id: str
    worker_incarnation: str
    first_seq: int
    events: list[KVEvent] = field(default_factory=list)
    occupancy: dict[str, TierOccupancy] = field(default_factory=dict)
    created_at: float = 0.0
    oldest_event_at: float = 0.0
    is_draining: bool = False

    @property
    def next_seq(self) -> int:
        return self.first_seq + len(self.events)

    def pack(self) -> bytes:
        return msgpack.packb([_WIRE_VERSION, self.worker_id, self.worker_incarnation, self.first_seq,
                              self.created_at, self.oldest_event_at, occupancy_to_wire(self.occupancy),
                              [_event_to_wire(e) for e in self.events], self.is_draining])

    @classmethod
    def unpack(cls, data: bytes) -> "KVEventBatch":
        version, worker_id, incarnation, first_seq, created_at, oldest, occupancy, events, draining = \
            msgpack.unpackb(data)
        if version != _WIRE_VERSION:
            raise ValueError(f"KV event batch wire version {version}, expected {_WIRE_VERSION}")
        return cls(worker_id, incarnation, first_seq, [_event_from_wire(e) for e in events],
                   occupancy_from_wire(occupancy), created_at, oldest, draining)


@dataclass(slots=True)
class KVSnapshot:
    """Everything the central index holds about one worker, from the worker itself.

    Sent on registration, when the receiver found a gap, and to a restarted
    central manager. ``next_seq`` is the seq of the worker's next event: the
    snapshot already includes every earlier event's effect. ``pool_config``
    is the worker's ``PoolConfig`` as a dict (block size, pool sizes, role...).
    """

    worker_id: str
    worker_incarnation: str
    next_seq: int
    pool_config: dict
    block_hashes: dict[str, list[int]] = field(default_factory=dict)  # tier -> keys
    occupancy: dict[str, TierOccupancy] = field(default_factory=dict)
    taken_at: float = 0.0

    def pack(self) -> bytes:
        return msgpack.packb([_WIRE_VERSION, self.worker_id, self.worker_incarnation, self.next_seq,
                              self.pool_config,
                              [_pack_keys(self.block_hashes.get(tier, [])) for tier in TIERS],
                              occupancy_to_wire(self.occupancy), self.taken_at])

    @classmethod
    def unpack(cls, data: bytes) -> "KVSnapshot":
        version, worker_id, incarnation, next_seq, pool_config, keys, occupancy, taken_at = \
            msgpack.unpackb(data)
        if version != _WIRE_VERSION:
            raise ValueError(f"KV snapshot wire version {version}, expected {_WIRE_VERSION}")
        return cls(worker_id, incarnation, next_seq, pool_config,
                   {tier: _unpack_keys(k) for tier, k in zip(TIERS, keys)},
                   occupancy_from_wire(occupancy), taken_at)


@dataclass(slots=True)
class PublishAck:
    """The central manager's answer to a batch or snapshot.

    ``status``: "ok" (applied), "duplicate" (already applied, ignored) or
    "resync" (a gap, an unknown worker or incarnation: send a snapshot).
    ``incarnation`` is the central manager's; a new one means it restarted.
    """

    status: str
    incarnation: str
    expected_seq: int = 0

    @property
    def needs_resync(self) -> bool:
        return self.status == "resync"

    def pack(self) -> bytes:
        return msgpack.packb([self.status, self.incarnation, self.expected_seq])

    @classmethod
    def unpack(cls, data: bytes) -> "PublishAck":
        status, incarnation, expected_seq = msgpack.unpackb(data)
        return cls(status, incarnation, expected_seq)


class EventLog:
    """The worker side: collects pool changes between drains, numbers them.

    Pools call ``stored``/``removed``/``cleared`` (the ``BlockPool.listener``
    protocol) on the engine's thread; the same thread calls ``drain``. Changes
    are coalesced by net effect as they come (one dictionary store each), so
    ``drain`` costs what is left of them. If nobody drains for
    ``max_pending`` changes (the central manager is unreachable), the log
    drops them and sets ``needs_snapshot``: the worker must send a
    ``KVSnapshot`` next.
    """

    def __init__(self, worker_id: str, incarnation: str | None = None,
                 max_pending: int = DEFAULT_MAX_PENDING_EVENTS) -> None:
        self.worker_id = worker_id
        self.incarnation = incarnation or uuid.uuid4().hex[:16]
        self.max_pending = max_pending
        self.next_seq = 0
        self.needs_snapshot = False
        self.num_events = 0      # raw pool changes recorded
        self.num_dropped = 0
        self._num_pending = 0    # raw changes since the last drain
        self._oldest_at = 0.0
        # Per tier code, each key's last change (its kind) since the last drain or clear,
        # and the segments an ``AllBlocksCleared`` ended: (their last changes, its tier code).
        self._last: list[dict[int, int]] = [{} for _ in TIERS]
        self._cleared: list[tuple[list[dict[int, int]], int]] = []

    # ---- the pool listener protocol -----------------------------------------------
    def stored(self, tier: str, block_hash: BlockHash) -> None:
        self._last[_TIER_CODES[tier]][block_hash_key(block_hash)] = _STORED
        self._count()

    def removed(self, tier: str, block_hash: BlockHash) -> None:
        self._last[_TIER_CODES[tier]][block_hash_key(block_hash)] = _REMOVED
        self._count()

    def cleared(self, tier: str | None) -> None:
        self._cleared.append((self._last, -1 if tier is None else _TIER_CODES[tier]))
        self._last = [{} for _ in TIERS]
        self._count()

    def _count(self) -> None:
        if not self._num_pending:
            self._oldest_at = time.time()
        self._num_pending += 1
        self.num_events += 1
        if self._num_pending > self.max_pending:
            self.num_dropped += self._num_pending
            self._forget_pending()
            self.needs_snapshot = True

    def _forget_pending(self) -> None:
        self._num_pending = 0
        self._last = [{} for _ in TIERS]
        self._cleared = []

    # ---- draining ---------------------------------------------------------------
    @property
    def num_pending(self) -> int:
        return self._num_pending

    def pending_age_s(self, now: float | None = None) -> float:
        """Seconds since the oldest undrained change (0 when there is none)."""
        if not self._num_pending:
            return 0.0
        return (now if now is not None else time.time()) - self._oldest_at

    def drain(self, occupancy: dict[str, TierOccupancy] | None = None) -> KVEventBatch:
        """Everything since the last drain as one batch (possibly empty), numbered next.

        Changes are coalesced by net effect: for each (tier, hash) only the last
        change counts (the receiver applies a batch as a whole), so a batch holds
        at most one ``BlockRemoved`` and one ``BlockStored`` per tier between
        ``AllBlocksCleared`` events.
        """
        now = time.time()
        events: list[KVEvent] = []
        for last, tier in self._cleared:
            self._emit(last, events)
            events.append(AllBlocksCleared(None if tier < 0 else TIERS[tier]))
        self._emit(self._last, events)
        batch = KVEventBatch(self.worker_id, self.incarnation, self.next_seq, events,
                             occupancy or {}, now, self._oldest_at if self._num_pending else now)
        self.next_seq += len(events)
        self._forget_pending()
        return batch

    @staticmethod
    def _emit(last: list[dict[int, int]], events: list[KVEvent]) -> None:
        for code, tier in enumerate(TIERS):
            changes = last[code]
            if not changes:
                continue
            removed = [key for key, kind in changes.items() if kind == _REMOVED]
            stored = [key for key, kind in changes.items() if kind == _STORED]
            if removed:
                events.append(BlockRemoved(removed, tier))
            if stored:
                events.append(BlockStored(stored, tier))

    def discard_pending(self) -> None:
        """Forget undrained changes: a snapshot taken now already includes them."""
        self._forget_pending()
        self.needs_snapshot = False
