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
16-byte blake2b digest), little-endian, one array per event, decoded at C
speed. The central index uses them only as routing hints; a colliding key
costs a cache miss (the worker's own pool checks full hashes and tokens),
never a wrong token.

A batch, the message sent every ~50 ms by every worker, is fixed-layout
binary (``struct``): a header, the two ids, then per event its kind, tier,
key count and keys. Snapshots (rare) and acks are small. Every decoder
checks lengths and codes and raises ``WireFormatError`` (the receiver then
asks for a resync) before anything is applied. No torch, no Ray.
"""

from __future__ import annotations

import struct
import sys
import threading
import time
import uuid
from array import array
from dataclasses import dataclass, field
from typing import Union

import msgpack

from .errors import WireFormatError
from .hashing import BlockHash, block_hash_key

TIERS = ("device", "host")
_TIER_CODES = {tier: code for code, tier in enumerate(TIERS)}
STORED, REMOVED, CLEARED = 0, 1, 2   # event kinds on the wire (``WireBatch.events``)
ALL_TIERS = 255          # the tier code of an ``AllBlocksCleared`` for every tier
_BATCH_WIRE_VERSION = 2
_SNAPSHOT_WIRE_VERSION = 1
_ADAPTER_REPORT_WIRE_VERSION = 1
# version, is_draining, len(worker_id), len(incarnation), number of events, first_seq,
# created_at, oldest_event_at, occupancy (4 counts per tier)
_BATCH_HEADER = struct.Struct(f"<BBBBHQdd{4 * len(TIERS)}I")
_EVENT_HEADER = struct.Struct("<BBI")    # kind, tier code, number of keys
_KEY_SIZE = 8
_ACK = struct.Struct("<BQ")              # status code, expected seq; the incarnation follows
_ACK_STATUSES = ("ok", "duplicate", "resync")
_ACK_CODES = {status: code for code, status in enumerate(_ACK_STATUSES)}
# A worker that cannot publish (the central manager is down) keeps at most this
# many pending events; past it they are dropped and the next publish is a snapshot.
DEFAULT_MAX_PENDING_EVENTS = 100_000


def _pack_keys(keys) -> bytes:
    if isinstance(keys, PackedKeys):
        return bytes(keys.data)
    packed = array("Q", keys)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def unpack_keys(data) -> list[int]:
    """8-byte little-endian keys from a bytes-like object (a whole number of keys;
    ``WireFormatError`` otherwise)."""
    if len(data) % _KEY_SIZE:
        raise WireFormatError(f"{len(data)} bytes of hash keys is not a whole number of 8-byte keys")
    packed = array("Q")
    packed.frombytes(data)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tolist()


class PackedKeys:
    """Hash keys as they came off the wire (8-byte little-endian), not decoded to ints.

    What ``KVEventBatch.unpack(..., packed_keys=True)``'s events and
    ``KVSnapshot.unpack(..., packed_keys=True)`` hold: the cluster index applies
    such bytes straight (``keyset.KeySet.add_packed``). Iterating decodes them; equal to a
    list of the same keys in the same order.
    """

    __slots__ = ("data",)

    def __init__(self, data) -> None:
        if len(data) % _KEY_SIZE:
            raise WireFormatError(f"{len(data)} bytes of hash keys is not a whole number of 8-byte keys")
        self.data = data

    def __len__(self) -> int:
        return len(self.data) // _KEY_SIZE

    def __iter__(self):
        return iter(unpack_keys(self.data))

    def tolist(self) -> list[int]:
        return unpack_keys(self.data)

    def __eq__(self, other) -> bool:
        if isinstance(other, PackedKeys):
            return bytes(self.data) == bytes(other.data)
        return isinstance(other, list) and unpack_keys(self.data) == other

    __hash__ = None

    def __repr__(self) -> str:
        return f"PackedKeys({self.tolist()!r})"


@dataclass(slots=True)
class BlockStored:
    """Blocks whose hashes became cached on ``medium`` ("device" or "host").

    Unlike vLLM's event it carries no token ids and no parent hash: the index
    needs neither (each hash already covers its whole prefix), and leaving
    them out keeps a decode step's events to a few bytes per new full block.
    """

    block_hashes: list[int] | PackedKeys
    medium: str = "device"


@dataclass(slots=True)
class BlockRemoved:
    """Blocks whose hashes are no longer cached on ``medium`` (evicted, reset)."""

    block_hashes: list[int] | PackedKeys
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


def _event_to_wire(event: KVEvent) -> bytes:
    if isinstance(event, BlockStored):
        kind, tier, keys = STORED, _TIER_CODES[event.medium], event.block_hashes
    elif isinstance(event, BlockRemoved):
        kind, tier, keys = REMOVED, _TIER_CODES[event.medium], event.block_hashes
    elif isinstance(event, AllBlocksCleared):
        kind, tier, keys = CLEARED, ALL_TIERS if event.medium is None else _TIER_CODES[event.medium], []
    else:
        raise TypeError(f"not a KV event: {event!r}")
    return _EVENT_HEADER.pack(kind, tier, len(keys)) + _pack_keys(keys)


@dataclass(slots=True)
class WireBatch:
    """A ``KVEventBatch`` as decoded for the central index (``decode_batch``): no object per
    event beyond a tuple, occupancy left as the wire's counts.

    ``events``: per event ``(kind, tier code, keys)``, kind ``STORED``, ``REMOVED`` or
    ``CLEARED``, tier code an index into ``TIERS`` (``ALL_TIERS`` for a clear of every tier),
    keys the event's 8-byte little-endian keys as a slice of the decoded data (bytes from
    bytes, else a memoryview; None for a clear). ``occupancy``: ``occupancy_to_wire``'s
    flat counts.
    """

    worker_id: str
    worker_incarnation: str
    first_seq: int
    events: list[tuple[int, int, bytes | memoryview | None]]
    occupancy: tuple[int, ...]
    created_at: float
    oldest_event_at: float
    is_draining: bool

    @property
    def next_seq(self) -> int:
        return self.first_seq + len(self.events)

    def to_batch(self, packed_keys: bool = False) -> "KVEventBatch":
        """The same batch as event dataclasses: keys as ``PackedKeys`` or lists of ints."""
        events: list[KVEvent] = []
        for kind, tier, keys in self.events:
            if kind == CLEARED:
                events.append(AllBlocksCleared(None if tier == ALL_TIERS else TIERS[tier]))
            else:
                keys = PackedKeys(keys) if packed_keys else unpack_keys(keys)
                events.append((BlockStored if kind == STORED else BlockRemoved)(keys, TIERS[tier]))
        return KVEventBatch(self.worker_id, self.worker_incarnation, self.first_seq, events,
                            occupancy_from_wire(self.occupancy), self.created_at, self.oldest_event_at,
                            self.is_draining)


_NUM_TIERS = len(TIERS)
try:   # built by setup.py where a C compiler is available; same result, same checks
    from ._eventwire import decode_batch_fields as _native_decode
except ImportError:
    _native_decode = None
_HEADER_SIZE, _EVENT_HEADER_SIZE = _BATCH_HEADER.size, _EVENT_HEADER.size
_unpack_header, _unpack_event_header = _BATCH_HEADER.unpack_from, _EVENT_HEADER.unpack_from


def decode_batch(data) -> WireBatch:
    """Decode a packed ``KVEventBatch`` (bytes-like) without building event objects;
    ``WireFormatError`` if it is not exactly one batch (every length and code is checked
    before this returns). Natively (``_eventwire``, ~4x faster: the central manager decodes
    every worker's every batch) where built, each event's keys a bytes copy; in Python
    otherwise, and for a batch the native decoder refuses, to say why."""
    if _native_decode is not None:
        fields = _native_decode(data)
        if fields is not None:
            return WireBatch(*fields)
    return _decode_batch_py(data)


def _decode_batch_py(data) -> WireBatch:
    """``decode_batch`` in Python. Unless ``data`` is bytes, its keys are views into it, which
    must not change while the batch is used."""
    view = data if type(data) is bytes else memoryview(data)   # slicing bytes: cheaper than views
    size = len(view)
    if size < _HEADER_SIZE or view[0] != _BATCH_WIRE_VERSION:
        raise WireFormatError(f"not a KV event batch of wire version {_BATCH_WIRE_VERSION} "
                              f"({size} bytes, first byte {view[0] if size else None})")
    header = _unpack_header(view)
    id_end = _HEADER_SIZE + header[2]
    offset = id_end + header[3]
    if offset > size:
        raise WireFormatError(f"KV event batch truncated in its ids ({size} bytes)")
    try:
        worker_id = str(view[_HEADER_SIZE:id_end], "utf-8")
        incarnation = str(view[id_end:offset], "utf-8")
    except UnicodeDecodeError as exc:
        raise WireFormatError(f"KV event batch ids are not UTF-8: {exc}") from None
    num_events = header[4]
    events: list[tuple[int, int, bytes | memoryview | None]] = []
    for _ in range(num_events):
        try:
            kind, tier, num_keys = _unpack_event_header(view, offset)
        except struct.error:
            raise WireFormatError(f"KV event batch truncated: event {len(events)} of {num_events} "
                                  f"starts at byte {offset} of {size}") from None
        start = offset + _EVENT_HEADER_SIZE
        offset = start + 8 * num_keys   # _KEY_SIZE
        if offset > size:
            raise WireFormatError(f"KV event batch truncated: event {len(events)} has {num_keys} keys, "
                                  f"{size - start} bytes left")
        if kind < CLEARED and tier < _NUM_TIERS:
            events.append((kind, tier, view[start:offset]))
        elif kind == CLEARED and not num_keys and (tier < _NUM_TIERS or tier == ALL_TIERS):
            events.append((kind, tier, None))
        elif kind == CLEARED:
            raise WireFormatError(f"malformed AllBlocksCleared event (tier code {tier}, {num_keys} keys)")
        else:
            raise WireFormatError(f"unknown KV event kind {kind} or tier code {tier}")
    if offset != size:
        raise WireFormatError(f"KV event batch has {size - offset} bytes after its {num_events} events")
    return WireBatch(worker_id, incarnation, header[5], events, header[8:], header[6], header[7],
                     bool(header[1]))


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
        worker_id, incarnation = self.worker_id.encode(), self.worker_incarnation.encode()
        if len(self.events) > 0xFFFF or len(worker_id) > 0xFF or len(incarnation) > 0xFF:
            raise ValueError(f"KV event batch too large to pack: {len(self.events)} events, ids of "
                             f"{len(worker_id)} and {len(incarnation)} bytes")
        header = _BATCH_HEADER.pack(_BATCH_WIRE_VERSION, self.is_draining, len(worker_id), len(incarnation),
                                    len(self.events), self.first_seq, self.created_at, self.oldest_event_at,
                                    *occupancy_to_wire(self.occupancy))
        return b"".join([header, worker_id, incarnation, *map(_event_to_wire, self.events)])

    @classmethod
    def unpack(cls, data, packed_keys: bool = False) -> "KVEventBatch":
        """Decode a packed batch (bytes-like); ``WireFormatError`` if it is not exactly one.

        ``packed_keys``: the events' keys are ``PackedKeys`` slices of ``data``
        (no int per key; views unless ``data`` is bytes: it must not change while the
        batch is used), else lists of ints. Both check the whole batch alike before returning
        (``decode_batch``, which the central index applies directly).
        """
        return decode_batch(data).to_batch(packed_keys)


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
    block_hashes: dict[str, list[int] | PackedKeys] = field(default_factory=dict)  # tier -> keys
    occupancy: dict[str, TierOccupancy] = field(default_factory=dict)
    taken_at: float = 0.0

    def pack(self) -> bytes:
        return msgpack.packb([_SNAPSHOT_WIRE_VERSION, self.worker_id, self.worker_incarnation, self.next_seq,
                              self.pool_config,
                              [_pack_keys(self.block_hashes.get(tier, [])) for tier in TIERS],
                              occupancy_to_wire(self.occupancy), self.taken_at])

    @classmethod
    def unpack(cls, data, packed_keys: bool = False) -> "KVSnapshot":
        """Decode a packed snapshot; ``WireFormatError`` if it is not one.

        ``packed_keys``: each tier's keys are ``PackedKeys`` (the wire's bytes, no int
        per key: the central index builds its key sets straight from them), else lists
        of ints."""
        try:
            version, worker_id, incarnation, next_seq, pool_config, keys, occupancy, taken_at = \
                msgpack.unpackb(data)
        except (ValueError, TypeError, msgpack.UnpackException) as exc:
            raise WireFormatError(f"not a KV snapshot: {exc!r}") from None
        if version != _SNAPSHOT_WIRE_VERSION:
            raise WireFormatError(f"KV snapshot wire version {version}, expected {_SNAPSHOT_WIRE_VERSION}")
        if (not isinstance(worker_id, str) or not isinstance(incarnation, str) or not isinstance(next_seq, int)
                or not isinstance(pool_config, dict) or not isinstance(keys, list) or len(keys) != len(TIERS)
                or not all(isinstance(k, bytes) for k in keys)
                or not isinstance(occupancy, list) or len(occupancy) != 4 * len(TIERS)):
            raise WireFormatError("malformed KV snapshot")
        return cls(worker_id, incarnation, next_seq, pool_config,
                   {tier: (PackedKeys if packed_keys else unpack_keys)(k) for tier, k in zip(TIERS, keys)},
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
        return pack_ack(self.status, self.expected_seq, self.incarnation.encode())

    @classmethod
    def unpack(cls, data) -> "PublishAck":
        if len(data) < _ACK.size:
            raise WireFormatError(f"KV publish ack truncated ({len(data)} bytes)")
        code, expected_seq = _ACK.unpack_from(data)
        if code >= len(_ACK_STATUSES):
            raise WireFormatError(f"unknown KV publish ack status code {code}")
        return cls(_ACK_STATUSES[code], bytes(data[_ACK.size:]).decode(), expected_seq)


@dataclass(slots=True)
class AdapterReport:
    """The LoRA adapters one worker holds (in its slots or in host memory), whole, by their
    ``LoRARequest.cache_key``. It travels the event link beside the batches; a report replaces
    the last one of the same worker incarnation with a lower ``version``."""

    worker_id: str
    worker_incarnation: str
    version: int
    adapter_keys: list[str] = field(default_factory=list)

    def pack(self) -> bytes:
        return msgpack.packb([_ADAPTER_REPORT_WIRE_VERSION, self.worker_id, self.worker_incarnation, self.version,
                              list(self.adapter_keys)])

    @classmethod
    def unpack(cls, data) -> "AdapterReport":
        """Decode a packed report; ``WireFormatError`` if it is not one."""
        try:
            version, worker_id, incarnation, number, keys = msgpack.unpackb(data)
        except (ValueError, TypeError, msgpack.UnpackException) as exc:
            raise WireFormatError(f"not an adapter report: {exc!r}") from None
        if version != _ADAPTER_REPORT_WIRE_VERSION:
            raise WireFormatError(f"adapter report wire version {version}, expected {_ADAPTER_REPORT_WIRE_VERSION}")
        if (not isinstance(worker_id, str) or not isinstance(incarnation, str) or not isinstance(number, int)
                or not isinstance(keys, list) or not all(isinstance(key, str) for key in keys)):
            raise WireFormatError("malformed adapter report")
        return cls(worker_id, incarnation, number, keys)


def pack_ack(status: str, expected_seq: int, incarnation: bytes) -> bytes:
    """``PublishAck(status, incarnation.decode(), expected_seq).pack()``, with no object
    built: the central service's reply to each batch that wants one."""
    return _ACK.pack(_ACK_CODES[status], expected_seq) + incarnation


class EventLog:
    """The worker side: collects pool changes between drains, numbers them.

    Pools call ``stored``/``removed``/``cleared`` (the ``BlockPool.listener``
    protocol) on the engine's thread; the same thread calls ``drain``. Changes
    are coalesced by net effect as they come (one dictionary store each), so
    ``drain`` costs what is left of them. If nobody drains for
    ``max_pending`` changes (the central manager is unreachable), the log
    drops them and sets ``needs_snapshot``: the worker must send a
    ``KVSnapshot`` next. A publisher on a tick drains from its sender thread
    (``KVPublisher.flush_on_tick``): recording and draining take a lock.
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
        self._lock = threading.Lock()

    # ---- the pool listener protocol -----------------------------------------------
    def stored(self, tier: str, block_hash: BlockHash) -> None:
        key = block_hash_key(block_hash)
        with self._lock:
            self._last[_TIER_CODES[tier]][key] = STORED
            self._count()

    def removed(self, tier: str, block_hash: BlockHash) -> None:
        key = block_hash_key(block_hash)
        with self._lock:
            self._last[_TIER_CODES[tier]][key] = REMOVED
            self._count()

    def cleared(self, tier: str | None) -> None:
        with self._lock:
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
        with self._lock:
            now = time.time()
            oldest_at = self._oldest_at if self._num_pending else now
            segments, last = self._cleared, self._last
            self._forget_pending()
            events: list[KVEvent] = []
            for cleared_last, tier in segments:
                self._emit(cleared_last, events)
                events.append(AllBlocksCleared(None if tier < 0 else TIERS[tier]))
            self._emit(last, events)
            batch = KVEventBatch(self.worker_id, self.incarnation, self.next_seq, events,
                                 occupancy or {}, now, oldest_at)
            self.next_seq += len(events)
        return batch

    @staticmethod
    def _emit(last: list[dict[int, int]], events: list[KVEvent]) -> None:
        for code, tier in enumerate(TIERS):
            changes = last[code]
            if not changes:
                continue
            removed = [key for key, kind in changes.items() if kind == REMOVED]
            stored = [key for key, kind in changes.items() if kind == STORED]
            if removed:
                events.append(BlockRemoved(removed, tier))
            if stored:
                events.append(BlockStored(stored, tier))

    def discard_pending(self) -> None:
        """Forget undrained changes: a snapshot taken now already includes them."""
        with self._lock:
            self._forget_pending()
            self.needs_snapshot = False
