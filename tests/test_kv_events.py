"""The two-level KV design, in-process: events, the cluster index, preemption, the service.

Workers are ``LocalKVManager``s driven by a ``SimulatedWorker`` (which checks
every block table against the tokens it must hold); the central side is the
real ``KVManagerService``, called through its wire methods (packed bytes).
"""

from __future__ import annotations

import random
import time
from dataclasses import asdict

import pytest

from pagedserve.kvmanager import (AllBlocksCleared, BlockRemoved, BlockStored, ClusterIndex, EventLog,
                                  InProcessTransport, IntegrityError, KVEventBatch, KVManager, KVPublisher,
                                  KVSnapshot, LocalKVManager,
                                  NewSequence, PoolConfig, PreemptionDecision, PreemptionRequest,
                                  PublishAck, RemotePreemptionPolicy, StepInput, TierOccupancy,
                                  block_hash_key, hash_prefix_blocks)
from pagedserve.kvmanager.errors import WireFormatError
import msgpack

from pagedserve.kvmanager import events as events_module
from pagedserve.kvmanager.events import ALL_TIERS, CLEARED, REMOVED, STORED, PackedKeys, decode_batch
from pagedserve.kvmanager.service import KVManagerService

from kv_simulator import SimulatedWorker

BS = 4


def make_local(worker_id="w0", num_device=24, num_host=8, preemption=None, max_model_len=64, **config):
    local = LocalKVManager(preemption, EventLog(worker_id))
    local.add_worker(worker_id, PoolConfig(num_device_blocks=num_device, num_host_blocks=num_host,
                                           block_size=BS, max_model_len=max_model_len, watermark=0.0,
                                           **config))
    return local, SimulatedWorker(local, worker_id)


def connect(service: KVManagerService, local: LocalKVManager) -> None:
    service.register_worker(local.worker_id, asdict(local.configs[local.worker_id]))
    assert PublishAck.unpack(service.resync(local.snapshot().pack())).status == "ok"


def publish(service: KVManagerService, local: LocalKVManager) -> PublishAck:
    return PublishAck.unpack(service.publish(local.drain_events().pack()))


class Driver:
    """Random admits (shared prefixes), growth, forks and finishes on one local manager."""

    PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 50, 51, 52, 53], [70, 71, 72, 73, 74, 75]]

    def __init__(self, local: LocalKVManager, worker: SimulatedWorker, seed: int) -> None:
        self.local, self.worker, self.rng = local, worker, random.Random(seed)
        self.running: list[str] = []
        self.waiting: list[str] = []
        self.num_created = 0

    def step(self) -> None:
        rng = self.rng
        step = StepInput(self.local.worker_id, token_budget=rng.choice([4, 16, 64]))
        if rng.random() < 0.5:
            seq_id = f"s{self.num_created}"
            self.num_created += 1
            tokens = rng.choice(self.PREFIXES) + [rng.randrange(100, 200) for _ in range(rng.randrange(1, 9))]
            step.new_sequences.append(NewSequence(seq_id, tokens))
            self.waiting.append(seq_id)
        if self.running and rng.random() < 0.3:
            done = rng.choice(self.running)
            self.running.remove(done)
            step.finished.append(done)
        for seq_id in self.running:
            if len(self.worker.tokens[seq_id]) < 40:
                step.appended.append((seq_id, [rng.randrange(100, 200)]))
            elif seq_id not in step.finished:
                step.finished.append(seq_id)
        self.running = [s for s in self.running if s not in step.finished]
        step.running = list(self.running)
        step.waiting = list(self.waiting)
        out = self.worker.step(step)
        for p in out.preempted:
            self.running.remove(p.seq_id)
            self.waiting.append(p.seq_id)
        for sched in out.scheduled:
            if sched.seq_id in self.waiting:
                self.waiting.remove(sched.seq_id)
                self.running.append(sched.seq_id)


# ---- events ---------------------------------------------------------------------------

def test_event_log_numbers_and_coalesces_by_net_effect_and_round_trips():
    log = EventLog("w", incarnation="inc")
    h = hash_prefix_blocks(list(range(12)), BS)
    log.stored("device", h[0])
    log.stored("device", h[1])
    log.removed("device", h[0])
    log.stored("host", h[0])
    log.cleared("host")
    log.stored("device", h[2])
    occupancy = {"device": TierOccupancy(2, 1, 5, 8), "host": TierOccupancy(0, 0, 4, 4)}
    batch = log.drain(occupancy)
    keys = [block_hash_key(x) for x in h]
    assert batch.events == [BlockRemoved([keys[0]], "device"), BlockStored([keys[1]], "device"),
                            BlockStored([keys[0]], "host"), AllBlocksCleared("host"),
                            BlockStored([keys[2]], "device")]
    assert batch.first_seq == 0 and log.next_seq == 5
    assert batch.oldest_event_at <= batch.created_at
    wire = batch.pack()
    assert KVEventBatch.unpack(wire) == batch
    empty = log.drain(occupancy)
    assert empty.first_seq == 5 and empty.events == [] and len(empty.pack()) < 100


def test_decode_step_events_are_small_and_independent_of_context():
    """A decode step's wire bytes grow with new full blocks, never with context length."""
    sizes = {}
    for context in (256, 2048):
        local, worker = make_local(num_device=(context // BS + 8) * 4, num_host=0, max_model_len=context + 64)
        step = StepInput("w0", new_sequences=[NewSequence(f"s{i}", [i] * 3 + list(range(context)))
                                              for i in range(4)],
                         waiting=[f"s{i}" for i in range(4)], token_budget=100_000)
        worker.step(step)
        local.drain_events()
        batch_bytes = []
        for t in range(BS * 4):
            worker.step(StepInput("w0", running=[f"s{i}" for i in range(4)],
                                  appended=[(f"s{i}", [7]) for i in range(4)]))
            batch_bytes.append(len(local.drain_events().pack()))
        sizes[context] = sum(batch_bytes)
    assert sizes[256] == sizes[2048]
    assert sizes[256] / (BS * 4) < 200  # bytes per step for 4 sequences, one block each per BS steps


def test_event_log_overflow_asks_for_a_snapshot():
    log = EventLog("w", max_pending=3)
    for h in hash_prefix_blocks(list(range(20)), BS):
        log.stored("device", h)
    assert log.needs_snapshot and log.num_dropped == 4 and log.num_pending == 1


# ---- the wire format ------------------------------------------------------------------------

def _wire_batch() -> KVEventBatch:
    keys = [block_hash_key(h) for h in hash_prefix_blocks(list(range(40)), BS)]
    return KVEventBatch("w0", "inc", 7, [BlockRemoved(keys[:2], "device"), BlockStored(keys[2:9], "device"),
                                         BlockStored([0, 2 ** 64 - 1], "host"), AllBlocksCleared("host"),
                                         AllBlocksCleared(None)],
                        {"device": TierOccupancy(2, 1, 5, 8), "host": TierOccupancy(0, 0, 4, 4)},
                        123.5, 120.25, is_draining=True)


def test_wire_round_trips_batches_snapshots_and_acks():
    batch = _wire_batch()
    wire = batch.pack()
    assert KVEventBatch.unpack(wire) == batch == KVEventBatch.unpack(memoryview(b"xx" + wire)[2:])
    # The central service's decode: the same events, keys left packed (views into the wire bytes).
    lean = KVEventBatch.unpack(wire, packed_keys=True)
    assert lean == batch and lean.pack() == wire
    assert [type(e.block_hashes) for e in lean.events[:3]] == [PackedKeys] * 3
    assert [list(e.block_hashes) for e in lean.events[:3]] == [e.block_hashes for e in batch.events[:3]]
    # What the central index applies: (kind, tier code, packed keys) per event, occupancy as counts.
    for data in (wire, bytearray(wire)):
        decoded = decode_batch(data)
        assert [(kind, tier) for kind, tier, _ in decoded.events] == [
            (REMOVED, 0), (STORED, 0), (STORED, 1), (CLEARED, 1), (CLEARED, ALL_TIERS)]
        assert [bytes(keys) for _, _, keys in decoded.events[:3]] == [bytes(e.block_hashes.data) for e in lean.events[:3]]
        assert decoded.occupancy == (2, 1, 5, 8, 0, 0, 4, 4) and decoded.next_seq == batch.next_seq == 12
        assert decoded.to_batch() == batch
    # Keys are raw 8-byte little-endian arrays: the keys' bytes are most of the batch.
    assert len(wire) < 100 + 8 * 11 + 6 * 5
    snapshot = KVSnapshot("w0", "inc", 3, asdict(PoolConfig(8, block_size=BS)), {"device": [1, 2], "host": [3]},
                          batch.occupancy, 9.0)
    assert KVSnapshot.unpack(snapshot.pack()) == snapshot
    lean_snapshot = KVSnapshot.unpack(snapshot.pack(), packed_keys=True)
    assert lean_snapshot == snapshot and type(lean_snapshot.block_hashes["device"]) is PackedKeys
    for status in ("ok", "duplicate", "resync"):
        ack = PublishAck(status, "0123456789abcdef", 2 ** 40)
        assert PublishAck.unpack(ack.pack()) == ack


@pytest.mark.skipif(events_module._native_decode is None, reason="the native decoder (_eventwire) is not built")
def test_the_native_batch_decoder_accepts_and_refuses_exactly_what_the_python_one_does():
    """Random batches, then every cut and many random byte changes of them: the same WireBatch
    (keys compared as bytes), or both refuse."""
    rng = random.Random(7)

    def decoded(decode, data):
        try:
            batch = decode(data)
        except WireFormatError:
            return None
        return (batch.worker_id, batch.worker_incarnation, batch.first_seq, batch.occupancy, batch.created_at,
                batch.oldest_event_at, batch.is_draining,
                [(kind, tier, None if keys is None else bytes(keys)) for kind, tier, keys in batch.events])

    def python_decode(data):
        return events_module._decode_batch_py(data)

    def native_decode(data):
        fields = events_module._native_decode(data)
        if fields is None:
            raise WireFormatError("refused")
        return events_module.WireBatch(*fields)

    num_accepted = num_refused = 0
    for _ in range(40):
        kinds = [BlockStored, BlockRemoved, AllBlocksCleared]
        batch_events = []
        for _ in range(rng.randrange(6)):
            kind = rng.choice(kinds)
            tier = rng.choice(["device", "host"])
            if kind is AllBlocksCleared:
                batch_events.append(AllBlocksCleared(rng.choice([tier, None])))
            else:
                batch_events.append(kind([rng.getrandbits(64) for _ in range(rng.randrange(5))], tier))
        batch = KVEventBatch(rng.choice(["w0", "wörker-1", ""]), "inc" * rng.randrange(3), rng.getrandbits(40),
                             batch_events, {"device": TierOccupancy(1, 2, 3, 6), "host": TierOccupancy(0, 0, 4, 4)},
                             rng.random() * 1e9, rng.random() * 1e9, is_draining=rng.random() < 0.5)
        wire = batch.pack()
        variants = [wire, bytearray(wire), memoryview(b"x" + wire)[1:]] + [wire[:n] for n in range(len(wire))]
        for _ in range(30):
            changed = bytearray(wire)
            changed[rng.randrange(len(wire))] = rng.randrange(256)
            variants.append(bytes(changed))
        for data in variants:
            expected = decoded(python_decode, data)
            assert decoded(native_decode, data) == expected
            num_accepted += expected is not None
            num_refused += expected is None
        assert decoded(decode_batch, wire) == decoded(python_decode, wire) is not None
    assert num_accepted > 100 and num_refused > 1000


@pytest.mark.parametrize("corrupt", ["truncated", "trailing", "version", "kind", "tier", "num_events",
                                     "num_keys", "ids", "empty"])
def test_bad_batches_are_refused_with_a_clear_error_and_change_nothing(corrupt, keyset_impl):
    wire = bytearray(_wire_batch().pack())
    header = 62  # the fixed part of a batch
    first_event = header + len(b"w0inc")
    if corrupt == "truncated":
        bad = [bytes(wire[:n]) for n in range(len(wire))]   # cut at every byte
    elif corrupt == "trailing":
        bad = [bytes(wire) + b"\0"]
    elif corrupt == "version":
        bad = [b"\x01" + bytes(wire[1:]), b"\x93\xa1a\x01\x02"]   # the old msgpack format is refused too
    elif corrupt == "kind":
        bad = [bytes(wire[:first_event]) + b"\x07" + bytes(wire[first_event + 1:])]
    elif corrupt == "tier":
        bad = [bytes(wire[:first_event + 1]) + b"\x05" + bytes(wire[first_event + 2:])]
    elif corrupt == "num_events":
        bad = [bytes(wire[:4]) + (6).to_bytes(2, "little") + bytes(wire[6:]),
               bytes(wire[:4]) + (4).to_bytes(2, "little") + bytes(wire[6:])]
    elif corrupt == "num_keys":
        bad = [bytes(wire[:first_event + 2]) + (3).to_bytes(4, "little") + bytes(wire[first_event + 6:])]
    elif corrupt == "ids":
        bad = [bytes(wire[:header]) + b"\xff\xfe" + bytes(wire[header + 2:])]
    else:
        bad = [b""]
    service = KVManagerService()
    local, worker = make_local()
    worker.step(StepInput("w0", new_sequences=[NewSequence("a", list(range(13)))], waiting=["a"]))
    connect(service, local)
    before = service.stats()
    for payload in bad:
        with pytest.raises(WireFormatError):
            KVEventBatch.unpack(payload)
        with pytest.raises(WireFormatError):
            KVEventBatch.unpack(payload, packed_keys=True)
        with pytest.raises(WireFormatError):
            decode_batch(payload)
        with pytest.raises(WireFormatError):
            service.publish(payload)
        [(ok, error)] = service.handle_events([("publish", payload)])
        assert not ok and b"WireFormatError" in error
    after = service.stats()
    assert (after["num_events"], after["num_publishes"], after["num_refused_batches"]) == (
        before["num_events"], before["num_publishes"], before["num_refused_batches"])
    service.index.check_consistency_with([local.snapshot()])


def test_bad_snapshots_and_messages_are_refused_and_the_publisher_resyncs():
    service = KVManagerService()
    good = KVSnapshot("w0", "inc", 0, asdict(PoolConfig(8, block_size=BS)), {"device": [1]}).pack()
    ragged_keys = msgpack.packb([1, "w0", "inc", 0, asdict(PoolConfig(8, block_size=BS)), [b"\0" * 7, b""],
                                 [0] * 8, 0.0])   # 7 bytes: not a whole key
    for payload in (b"", good[:-3], b"\x95\x01\x02\x03\x04\x05", good.replace(b"\xa3inc", b"\x01\x02\x03\x04"),
                    ragged_keys):
        with pytest.raises(WireFormatError):
            service.resync(payload)
    [(ok, error)] = service.handle_events([("bogus", good)])
    assert not ok and b"unknown KV event message kind" in error and service.worker_ids() == []

    # The publisher's batches are cut short on the way: each is refused, the worker resyncs,
    # and the index always ends up exactly as the pool.
    class Truncating(InProcessTransport):
        def send(self, method, packed, want_ack=True):
            return super().send(method, packed[:-5] if method == "publish" else packed, want_ack)

    local, worker = make_local()
    publisher = KVPublisher(local, Truncating(service), max_batch_age_s=0.0)
    driver = Driver(local, worker, seed=11)
    for _ in range(30):
        driver.step()
        publisher.maybe_flush()
    publisher.maybe_flush()
    assert publisher.num_failed_calls > 0 and publisher.num_snapshots_sent > 1
    assert service.stats()["num_publishes"] == 0   # not one truncated batch was applied
    service.index.check_consistency_with([local.snapshot()])


def test_handle_events_applies_a_drained_run_in_order(keyset_impl):
    service = KVManagerService()
    local, worker = make_local()
    messages = [("resync", local.snapshot().pack())]
    driver = Driver(local, worker, seed=12)
    for _ in range(20):
        driver.step()
        messages.append(("publish", local.drain_events().pack()))
    messages.insert(5, ("publish", b"garbage"))
    replies = service.handle_events(messages)
    assert [ok for ok, _ in replies] == [True] * 5 + [False] + [True] * 16
    assert all(PublishAck.unpack(reply).status == "ok" for ok, reply in replies if ok)
    assert service.stats()["num_publishes"] == 20 and service.handler_cpu_s > 0
    service.index.check_consistency_with([local.snapshot()])


# ---- the index --------------------------------------------------------------------------

def test_index_follows_random_local_operations_exactly(keyset_impl):
    service = KVManagerService()
    locals_ = [make_local(f"w{i}", num_device=12, num_host=6) for i in range(3)]
    for local, _ in locals_:
        connect(service, local)
    drivers = [Driver(local, worker, seed) for seed, (local, worker) in enumerate(locals_)]
    # Same answers as the pools themselves (KVManager.longest_prefix checks tokens too), also
    # while batches change keys the index has memoised answers for.
    probe = KVManager()
    for local, _ in locals_:
        probe.workers[local.worker_id] = local.workers[local.worker_id]
        probe.configs[local.worker_id] = local.configs[local.worker_id]
    for round_ in range(150):
        for driver in drivers:
            driver.step()
            if random.Random(round_).random() < 0.5:
                assert publish(service, driver.local).status == "ok"
        if round_ % 10 == 0:
            for local, _ in locals_:
                publish(service, local)
            for prefix in Driver.PREFIXES:
                tokens = prefix + [150, 151, 152, 153, 154]
                assert service.index.longest_prefix(tokens) == probe.longest_prefix(tokens)
            service.index.check_integrity()
    for local, _ in locals_:
        publish(service, local)
        local.check_integrity()
    service.index.check_consistency_with([local.snapshot() for local, _ in locals_])
    assert service.stats()["num_events"] > 0
    assert all(type(k) is keyset_impl for view in service.index.workers.values() for k in view.keys.values())
    for prefix in Driver.PREFIXES:
        tokens = prefix + [150, 151, 152, 153, 154]
        assert service.index.longest_prefix(tokens) == probe.longest_prefix(tokens)


def test_gap_unknown_incarnation_and_duplicates(keyset_impl):
    service = KVManagerService()
    local, worker = make_local()
    connect(service, local)
    worker.step(StepInput("w0", new_sequences=[NewSequence("a", list(range(13)))], waiting=["a"]))
    lost = local.drain_events()
    assert lost.events
    worker.step(StepInput("w0", new_sequences=[NewSequence("b", list(range(50, 63)))], waiting=["b"]))
    ack = publish(service, local)
    assert ack.needs_resync  # the gap is noticed
    assert publish(service, local).needs_resync  # and batches wait for the snapshot
    with pytest.raises(IntegrityError):
        service.index.check_consistency_with([local.snapshot()])
    snapshot = local.snapshot()
    assert PublishAck.unpack(service.resync(snapshot.pack())).status == "ok"
    service.index.check_consistency_with([local.snapshot()])
    # A batch sent before the snapshot arrives after it: ignored.
    assert PublishAck.unpack(service.publish(lost.pack())).status == "duplicate"
    # Another incarnation of the worker (it restarted): resync.
    stranger = KVEventBatch("w0", "other", snapshot.next_seq)
    assert PublishAck.unpack(service.publish(stranger.pack())).needs_resync
    assert PublishAck.unpack(service.publish(KVEventBatch("nobody", "x", 0).pack())).needs_resync


def test_central_restart_is_rebuilt_from_snapshots(keyset_impl):
    service = KVManagerService()
    local, worker = make_local()
    connect(service, local)
    worker.step(StepInput("w0", new_sequences=[NewSequence("a", list(range(13)))], waiting=["a"]))
    publish(service, local)
    restarted = KVManagerService()
    assert restarted.incarnation != service.incarnation
    ack = publish(restarted, local)
    assert ack.needs_resync and ack.incarnation == restarted.incarnation
    restarted.resync(local.snapshot().pack())
    restarted.index.check_consistency_with([local.snapshot()])
    assert restarted.longest_prefix(list(range(13))) == {"w0": 12}
    restarted.remove_worker("w0")
    assert restarted.index.workers == {} and restarted.index.num_entries() == 0
    assert restarted.longest_prefix(list(range(13))) == {}
    # A snapshot the removed worker sent before it went, applied late, does not bring it back;
    # a new incarnation under the same id (a replacement worker) is taken.
    assert PublishAck.unpack(restarted.resync(local.snapshot().pack())).needs_resync
    assert restarted.index.workers == {}
    replacement, _ = make_local("w0")
    assert not PublishAck.unpack(restarted.resync(replacement.snapshot().pack())).needs_resync
    assert list(restarted.index.workers) == ["w0"]


def test_index_integrity_check_catches_corruption(keyset_impl):
    index = ClusterIndex()
    index.resync(KVSnapshot("w", "i", 0, asdict(PoolConfig(8, block_size=BS)), {"device": [1, 2]},
                            {"device": TierOccupancy(num_used=2, num_total=2)}))
    index.check_integrity()
    index.workers["w"].keys["device"].add(3)   # more cached keys than the tier has blocks
    with pytest.raises(IntegrityError, match="3 keys on device, which has 2 blocks"):
        index.check_integrity()
    index.workers["w"].keys["device"].discard(3)
    assert index.longest_prefix(list(range(9))) == {"w": 0}   # memoises the first block's holders
    index.check_integrity()
    index._holders[7] = 1                                     # a wrong memoised answer
    with pytest.raises(IntegrityError, match="memoised"):
        index.check_integrity()
    index._holders.clear()
    index.workers["w"].keys["host"] = [4]
    with pytest.raises(IntegrityError, match="key sets"):
        index.check_integrity()


def test_reset_prefix_cache_publishes_all_blocks_cleared(keyset_impl):
    service = KVManagerService()
    local, worker = make_local()
    connect(service, local)
    worker.step(StepInput("w0", new_sequences=[NewSequence("a", list(range(13)))], waiting=["a"]))
    worker.step(StepInput("w0", finished=["a"]))
    publish(service, local)
    assert service.longest_prefix(list(range(13))) == {"w0": 12}
    assert local.reset_prefix_cache("w0")
    batch = local.drain_events()
    assert AllBlocksCleared("device") in batch.events
    assert PublishAck.unpack(service.publish(batch.pack())).status == "ok"
    assert service.longest_prefix(list(range(13))) == {"w0": 0}
    service.index.check_consistency_with([local.snapshot()])


# ---- preemption -------------------------------------------------------------------------

def _fill(worker: SimulatedWorker, seq_ids: list[str], length: int) -> None:
    worker.step(StepInput(worker.worker_id, new_sequences=[NewSequence(s, [ord(s[-1])] * length) for s in seq_ids],
                          waiting=list(seq_ids), token_budget=1000))


def test_one_central_call_per_step_decides_every_victim():
    service = KVManagerService()
    calls = []

    def call(request: PreemptionRequest) -> PreemptionDecision:
        calls.append(request)
        return PreemptionDecision.unpack(service.decide_preemption(request.pack()))

    source, worker = make_local("src", num_device=6, num_host=0, preemption=RemotePreemptionPolicy(call))
    target, _ = make_local("dst", num_device=32, num_host=0)
    for local in (source, target):
        connect(service, local)
    _fill(worker, list("abcdef"), BS)  # a block each: the pool is full
    # Every sequence grows into a new block: three victims, decided by one call.
    out = worker.step(StepInput("src", running=list("abcdef"), appended=[(s, [1]) for s in "abcdef"],
                                migratable=list("abcdef")))
    assert len(calls) == 1 and len(calls[0].candidates) == 6
    assert [(p.seq_id, p.mode, p.target_worker) for p in out.preempted] == [
        ("f", "migrate", "dst"), ("e", "migrate", "dst"), ("d", "migrate", "dst")]
    # The room promised to those migrations (a block each plus one) is held back.
    assert service._migration_targets(0.0)[1].num_free_blocks == 32 - 6
    source.check_integrity()
    assert sorted(worker.tokens) == list("abcdef")
    # Steady state: no call at all.
    worker.step(StepInput("src", running=["a"], appended=[("a", [2])]))
    assert len(calls) == 1


def test_central_failure_falls_back_to_local_swap_then_recompute_and_pauses():
    attempts = []

    def broken(request):
        attempts.append(request)
        raise TimeoutError("central KV manager did not answer")

    policy = RemotePreemptionPolicy(broken, backoff_s=60.0)
    local, worker = make_local(num_device=6, num_host=2, preemption=policy)
    _fill(worker, list("abcdef"), BS)
    out = worker.step(StepInput("w0", running=list("abcdef"), appended=[(s, [1]) for s in "abcdef"],
                                migratable=list("abcdef")))
    assert [(p.seq_id, p.mode) for p in out.preempted] == [("f", "swap"), ("e", "swap"), ("d", "recompute")]
    assert policy.num_failures == 1
    for t in range(BS):
        out = worker.step(StepInput("w0", running=list("abc"), appended=[(s, [2]) for s in "abc"]))
    assert [p.mode for p in out.preempted] == ["recompute"]
    assert len(attempts) == 1  # paused: not asked again within the back-off
    local.check_integrity()


def test_forced_modes_never_migrate():
    service = KVManagerService()
    request = PreemptionRequest("src", [], 0, BS, "swap")
    assert PreemptionDecision.unpack(service.decide_preemption(request.pack())).choices == []
    local, worker = make_local("src", num_device=6, num_host=8, preemption_mode="swap")
    _fill(worker, ["a", "b", "c"], 8)
    out = worker.step(StepInput("src", running=["a", "b", "c"], appended=[(s, [1]) for s in "abc"],
                                migratable=["a", "b", "c"]))
    assert {p.mode for p in out.preempted} == {"swap"}


def test_wire_sizes_of_rare_and_frequent_messages():
    local, worker = make_local()
    worker.step(StepInput("w0", new_sequences=[NewSequence("a", list(range(13)))], waiting=["a"]))
    snapshot = local.snapshot()
    assert KVSnapshot.unpack(snapshot.pack()) == snapshot
    request = PreemptionRequest("w0", [], 3, BS)
    assert PreemptionRequest.unpack(request.pack()) == request
    assert len(PublishAck("ok", "0123456789abcdef", 12).pack()) < 32


def test_draining_worker_migrates_through_one_central_call_and_is_no_target():
    service = KVManagerService()

    def call(request):
        return PreemptionDecision.unpack(service.decide_preemption(request.pack()))

    leaving, worker = make_local("leaving", num_device=16, num_host=0, preemption=RemotePreemptionPolicy(call))
    staying, _ = make_local("staying", num_device=5, num_host=0)
    for local in (leaving, staying):
        connect(service, local)
    _fill(worker, list("abc"), BS)  # a block each; "staying" has room for two (one block + one)
    out = worker.step(StepInput("leaving", running=list("abc"), migratable=list("abc"), is_draining=True,
                                appended=[(s, [1]) for s in "abc"]))
    assert [(p.seq_id, p.mode, p.target_worker) for p in out.preempted] == [
        ("a", "migrate", "staying"), ("b", "migrate", "staying")]
    assert sorted(s.seq_id for s in out.scheduled) == ["c"]  # kept running here
    assert publish(service, leaving).status == "ok"
    assert service.index.workers["leaving"].is_draining
    assert [t.worker_id for t in service._migration_targets(0.0)] == ["staying"]
    leaving.check_integrity()


# ---- the worker's publisher -----------------------------------------------------------------

def test_publisher_sends_when_due_and_heals_restarts_outages_and_overflow():
    service = KVManagerService()
    transport = InProcessTransport(service)
    local, worker = make_local()
    local.event_log.max_pending = 40
    publisher = KVPublisher(local, transport, max_batch_age_s=0.05, heartbeat_s=60.0)
    assert publisher.maybe_flush() and service.worker_ids() == ["w0"]  # first contact: a snapshot
    worker.step(StepInput("w0", new_sequences=[NewSequence("a", list(range(13)))], waiting=["a"]))
    assert not publisher.maybe_flush()  # not due yet: younger than the age bound
    time.sleep(0.06)
    assert publisher.maybe_flush() and service.longest_prefix(list(range(13))) == {"w0": 12}
    # The central manager restarts: the next ack says resync, the flush after it is a snapshot.
    transport.service = service = KVManagerService()
    worker.step(StepInput("w0", new_sequences=[NewSequence("b", list(range(50, 63)))], waiting=["b"]))
    assert publisher.flush_and_wait(1.0)
    service.index.check_consistency_with([local.snapshot()])
    assert service.longest_prefix(list(range(13))) == {"w0": 12}
    # Down: nothing arrives, the worker keeps planning; the log overflows and asks for a snapshot.
    transport.is_down = True
    for i in range(12):
        seq_id = f"c{i}"
        worker.step(StepInput("w0", new_sequences=[NewSequence(seq_id, [i] * 9 + [100 + i])],
                              waiting=[seq_id]))
        worker.step(StepInput("w0", finished=[seq_id]))
        publisher.maybe_flush()
    publisher.maybe_flush()
    assert local.event_log.num_dropped > 0 and publisher.num_failed_calls >= 1
    transport.is_down = False
    assert publisher.flush_and_wait(1.0)
    service.index.check_consistency_with([local.snapshot()])
    local.check_integrity()


class LossyTransport(InProcessTransport):
    """Replies arrive ``delay_s`` after the send, as over a relay; the next ``lose`` sends vanish
    (a bundle lost while central restarts). Like ``ZmqTransport``: a send with no reply ends
    with a ``TimeoutError`` in ``poll`` once ``ack_timeout_s`` passes, and ``wait`` waits for
    replies only, whatever their age."""

    def __init__(self, service, delay_s: float, ack_timeout_s: float) -> None:
        super().__init__(service)
        self.delay_s, self.ack_timeout_s, self.lose = delay_s, ack_timeout_s, 0
        self.sent_at: dict[int, float] = {}

    def send(self, method: str, packed: bytes, want_ack: bool = True):
        if self.lose:
            self.lose -= 1
            token = object()
        else:
            token = super().send(method, packed, want_ack)
        self.sent_at[id(token)] = time.monotonic()
        return token

    def _arrived(self, token) -> bool:
        return id(token) in self._ended and time.monotonic() - self.sent_at[id(token)] >= self.delay_s

    def poll(self, tokens: list):
        now = time.monotonic()
        ended = [(t, *self._ended.pop(id(t))) for t in tokens if self._arrived(t)]
        return ended + [(t, None, TimeoutError("no ack")) for t in tokens if id(t) not in self._ended
                        and not any(t is e[0] for e in ended) and now - self.sent_at[id(t)] > self.ack_timeout_s]

    def wait(self, tokens: list, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not all(self._arrived(t) for t in tokens) and time.monotonic() < deadline:
            time.sleep(0.005)


def test_flush_and_wait_resyncs_past_a_lost_batch_within_its_budget():
    """A batch lost on the way (central restarting) ends at its ack timeout, and the snapshot
    that follows is acknowledged: flushing succeeds within the budget, not at its end."""
    service = KVManagerService()
    transport = LossyTransport(service, delay_s=0.06, ack_timeout_s=0.3)
    local, worker = make_local()
    publisher = KVPublisher(local, transport, heartbeat_s=60.0)
    assert publisher.flush_and_wait(2.0)
    worker.step(StepInput("w0", new_sequences=[NewSequence("a", list(range(13)))], waiting=["a"]))
    transport.lose = 1
    start = time.monotonic()
    assert publisher.flush_and_wait(5.0), "the lost batch should have been replaced by a snapshot"
    elapsed = time.monotonic() - start
    assert elapsed < 2.0, f"took {elapsed:.2f} s: waited past the 0.3 s ack timeout for a reply that never comes"
    service.index.check_consistency_with([local.snapshot()])


def test_publisher_on_a_tick_sends_once_per_tick_from_its_sender_thread():
    """On a tick, steps send nothing but snapshots; ``flush_on_tick`` sends what changed, once."""
    service = KVManagerService()
    transport = InProcessTransport(service)
    local, worker = make_local(num_device=256, max_model_len=2048)
    publisher = KVPublisher(local, transport, heartbeat_s=60.0, tick_s=0.05, send_margin_s=0.005)
    assert publisher.maybe_flush()   # first contact: the snapshot goes from the engine's thread
    assert not publisher.flush_on_tick()   # nothing changed since
    worker.step(StepInput("w0", new_sequences=[NewSequence("a", list(range(40)))], waiting=["a"]))
    assert local.event_log.num_pending and not publisher.maybe_flush()   # waits for the tick
    assert publisher.flush_on_tick() and not local.event_log.num_pending
    service.index.check_consistency_with([local.snapshot()])
    # The next flush is the margin before the next tick of wall time.
    assert publisher.next_flush_at(1000.031) == pytest.approx(1000.045, abs=1e-9)
    assert publisher.next_flush_at(1000.046) == pytest.approx(1000.095, abs=1e-9)
    # A resync is the engine's: the tick leaves it alone.
    publisher.needs_snapshot = True
    worker.step(StepInput("w0", finished=["a"]))
    assert not publisher.flush_on_tick() and publisher.maybe_flush()
    service.index.check_consistency_with([local.snapshot()])
    local.check_integrity()


def test_publisher_tick_drains_race_the_engine_thread_and_lose_nothing():
    """A sender thread drains on ticks while the engine's thread keeps changing the pool: every
    change reaches the central index, in order (no gap, no resync)."""
    import threading

    service = KVManagerService()
    transport = InProcessTransport(service)
    local, worker = make_local(num_device=64, num_host=32, max_model_len=512)
    publisher = KVPublisher(local, transport, heartbeat_s=60.0, tick_s=0.001, send_margin_s=0.0)
    assert publisher.maybe_flush()
    stop = threading.Event()

    def sender():
        while not stop.is_set():
            publisher.flush_on_tick()

    thread = threading.Thread(target=sender)
    thread.start()
    rng = random.Random(3)
    # At least 400 rounds, and on until the sender has drained 20 times mid-way: how many drains
    # fit in 400 rounds depends on the machine's load (the GIL switches threads every 5 ms).
    num_rounds = 0
    try:
        while num_rounds < 400 or publisher.num_batches < 20:
            assert num_rounds < 200_000, f"the sender thread drained {publisher.num_batches} times"
            seq_id = f"s{num_rounds}"
            prompt = [rng.randrange(4)] * 16 + [rng.randrange(1000) for _ in range(rng.randrange(1, 40))]
            worker.step(StepInput("w0", new_sequences=[NewSequence(seq_id, prompt)], waiting=[seq_id]))
            worker.step(StepInput("w0", finished=[seq_id]))
            publisher.maybe_flush()
            num_rounds += 1
    finally:
        stop.set()
        thread.join()
    assert publisher.flush_and_wait(1.0)
    assert service.stats()["num_refused_batches"] == 0
    service.index.check_consistency_with([local.snapshot()])
    local.check_integrity()


def test_central_preemption_is_asked_only_when_migration_could_help():
    service = KVManagerService()
    transport = InProcessTransport(service)
    holder = {}
    policy = RemotePreemptionPolicy(lambda request: holder["publisher"].decide_preemption(request),
                                    no_room_backoff_s=60.0)
    source, worker = make_local("src", num_device=12, num_host=8, preemption=policy)
    holder["publisher"] = KVPublisher(source, transport)
    holder["publisher"].flush_and_wait(1.0)
    running = list("abcdef")
    _fill(worker, running, BS * 2)  # two blocks each: the pool is full

    def decode_until_preempted(migratable: bool) -> list:
        for t in range(BS):
            out = worker.step(StepInput("src", running=list(running), appended=[(s, [t]) for s in running],
                                        migratable=list(running) if migratable else []))
            for p in out.preempted:
                running.remove(p.seq_id)
            if out.preempted:
                return [p.mode for p in out.preempted]
        raise AssertionError("no preemption")

    # Nothing migratable: swap/recompute is decided locally, without a call.
    assert decode_until_preempted(migratable=False) == ["swap", "swap"] and policy.num_calls == 0
    # Migratable, but no other worker: one call, and it finds no room anywhere ...
    modes = decode_until_preempted(migratable=True)
    assert holder["publisher"].num_blocking_calls == policy.num_calls == 1
    assert sum(service.stats()["preemptions_by_mode"].values()) == len(modes) and "migrate" not in modes
    # ... so the next pressured steps decide locally for a while.
    assert "migrate" not in decode_until_preempted(migratable=True) and policy.num_calls == 1
    source.check_integrity()


def test_background_publisher_never_touches_the_transport_from_maybe_flush():
    service = KVManagerService()

    class CountingTransport(InProcessTransport):
        num_sends = 0

        def send(self, method, packed, want_ack=True):
            CountingTransport.num_sends += 1
            return super().send(method, packed, want_ack)

        def poll(self, tokens):
            CountingTransport.num_sends += 1000  # the step path must not poll either
            return super().poll(tokens)

    local, worker = make_local()
    publisher = KVPublisher(local, CountingTransport(service), background=True)
    assert publisher.maybe_flush() and publisher.wakeup.is_set() and CountingTransport.num_sends == 0
    publisher.pump()  # the sender thread's part
    assert service.worker_ids() == ["w0"] and not publisher.stats()["num_in_flight"]
    worker.step(StepInput("w0", new_sequences=[NewSequence("a", list(range(13)))], waiting=["a"]))
    time.sleep(0.06)
    sends = CountingTransport.num_sends
    assert publisher.maybe_flush() and CountingTransport.num_sends == sends
    publisher.pump()
    assert service.longest_prefix(list(range(13))) == {"w0": 12}
    assert publisher.flush_and_wait(1.0)
    service.index.check_consistency_with([local.snapshot()])


def test_adapter_reports_reach_route_hints_whole_newest_first_and_after_a_central_restart():
    """A worker's ``AdapterReport`` (the LoRA adapters it holds) travels the event link: the
    newest report of an incarnation wins, a new incarnation replaces the old one's, a removed
    worker's are forgotten, a malformed one is refused, and the publisher sends the last one
    again after the snapshot a restarted central manager asks for."""
    from pagedserve.kvmanager import AdapterReport

    service = KVManagerService()
    transport = InProcessTransport(service)
    local, worker = make_local()
    incarnation = local.event_log.incarnation
    publisher = KVPublisher(local, transport, max_batch_age_s=0.0, heartbeat_s=60.0)
    assert publisher.maybe_flush()                                   # first contact: the snapshot
    publisher.report_adapters(AdapterReport("w0", incarnation, 2, ["7:sql", "9:chat"]).pack())
    assert service.route_hints([1, 2, 3], None, "7:sql") == ({"w0": 0}, ["w0"])
    assert service.stats()["workers"]["w0"]["adapters"] == ["7:sql", "9:chat"]
    service.report_adapters(AdapterReport("w0", incarnation, 1, ["3:old"]).pack())   # older: ignored
    assert service.route_hints([1], None, "3:old")[1] == [] and service.route_hints([1], None, "9:chat")[1] == ["w0"]
    publisher.report_adapters(AdapterReport("w0", incarnation, 3, ["9:chat"]).pack())
    assert service.route_hints([1], None, "7:sql")[1] == []
    [(ok, error)] = service.handle_events([("report_adapters", b"\x93\x01\x02\x03")])
    assert not ok and b"adapter report" in error
    # The central manager restarts: the publisher resyncs, and its last report goes with the snapshot.
    transport.service = service = KVManagerService()
    worker.step(StepInput("w0", new_sequences=[NewSequence("a", list(range(13)))], waiting=["a"]))
    assert publisher.flush_and_wait(1.0)
    assert service.route_hints(list(range(13)), None, "9:chat") == ({"w0": 12}, ["w0"])
    # A handle's requests routed together ask in one call, each answered as alone.
    assert service.route_hints_many([(list(range(13)), None, "9:chat"), (list(range(9)), None, None),
                                     ([1], "salt", None)]) == [({"w0": 12}, ["w0"]), ({"w0": 8}, None), ({"w0": 0}, None)]
    # Restarted, the worker is a new incarnation: its first report replaces the old one's.
    service.report_adapters(AdapterReport("w0", "restarted", 0, ["4:new"]).pack())
    assert service.route_hints([1], None, "9:chat")[1] == [] and service.route_hints([1], None, "4:new")[1] == ["w0"]
    service.remove_worker("w0")
    assert service.route_hints([1], None, "4:new")[1] == []
