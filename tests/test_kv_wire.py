"""KV events over ZeroMQ (workers/kv_events/wire.py, cluster/kv_central.py) against a real Ray actor.

One worker's ``LocalKVManager`` publishes through the real ``KVPublisher``
over ``ZmqTransport`` to ``CentralKVManager`` running as a restartable Ray
actor; the central index must equal the worker's snapshot after every phase.
"""

from __future__ import annotations

import time

import pytest

from pagedserve.cluster.kv_central import CentralKVManager
from pagedserve.kvmanager import KVPublisher, PublishAck
from pagedserve.kvmanager.service import KVManagerService
from pagedserve.workers.kv_events.link import RayTransport
from pagedserve.workers.kv_events.wire import ZmqTransport, connect_transport

from test_kv_events import Driver, make_local

pytest.importorskip("zmq")


@pytest.fixture(scope="module")
def ray_local():
    import ray

    if ray.is_initialized():
        ray.shutdown()
    ray.init(num_cpus=2, include_dashboard=False, namespace="pagedserve-kv-wire")
    yield ray
    ray.shutdown()


def _central(ray, **options):
    actor = ray.remote(CentralKVManager).options(num_cpus=0, **options).remote()
    ray.get(actor.get_incarnation.remote(), timeout=60)
    return actor


def _consistent(ray, actor, local) -> bool:
    return ray.get(actor.check_consistency.remote([local.snapshot().pack()]), timeout=30)


def _drive(publisher, driver, steps: int) -> None:
    for _ in range(steps):
        driver.step()
        publisher.maybe_flush()


def test_receiver_drains_a_burst_in_one_go_and_acks_every_message_in_order():
    """No Ray: the endpoint of an in-process ``CentralKVManager`` and a raw DEALER socket."""
    import zmq

    central = CentralKVManager()
    local, worker = make_local()
    driver = Driver(local, worker, seed=7)
    messages = [(b"r", local.snapshot().pack())]
    for _ in range(40):
        driver.step()
        messages.append((b"p", local.drain_events().pack()))
    messages.insert(3, (b"x", b"an unknown kind"))
    messages.insert(6, (b"p", b"\x02 a truncated batch"))
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(central.event_endpoint())
    try:
        for request_id, (kind, payload) in enumerate(messages):
            socket.send(request_id.to_bytes(8, "big") + kind + payload)
        socket.send_multipart([b"two", b"frames"])
        replies = []
        while len(replies) < len(messages) + 1 and socket.poll(10_000):
            replies.append(socket.recv())
        stats = central.stats()
    finally:
        socket.close()
        central.close()
    assert [int.from_bytes(r[:8], "big") for r in replies[:-1]] == list(range(len(messages)))
    statuses = [r[8:9] for r in replies]
    assert statuses == [b"o"] * 3 + [b"e"] + [b"o"] * 2 + [b"e"] + [b"o"] * 36 + [b"e"]
    assert b"malformed" in replies[3] and b"WireFormatError" in replies[6] and b"malformed" in replies[-1]
    assert all(PublishAck.unpack(r[9:]).status == "ok" for r in replies if r[8:9] == b"o")
    assert stats["num_zmq_messages"] == len(messages) + 1 and stats["num_publishes"] == 40
    assert stats["num_zmq_drains"] < stats["num_zmq_messages"] / 2   # a burst is drained, not polled per message
    central.index.check_consistency_with([local.snapshot()])


def test_quiet_publishes_are_answered_only_when_something_is_wrong():
    """No Ray: b"q" publishes that apply get no reply; one that leaves a gap (a lost batch)
    or is malformed does, in order with the asked-for acks."""
    import zmq

    central = CentralKVManager()
    local, worker = make_local()
    driver = Driver(local, worker, seed=8)
    messages = [(b"r", local.snapshot().pack())]
    for _ in range(12):
        driver.step()
        messages.append((b"q", local.drain_events().pack()))
    messages.append((b"p", local.drain_events().pack()))           # asks for its ack
    driver.step()
    lost = local.drain_events()                                       # never sent
    driver.step()
    messages.append((b"q", local.drain_events().pack()))             # after the lost one: a gap
    messages.append((b"q", b"\x02 a truncated batch"))
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(central.event_endpoint())
    try:
        for request_id, (kind, payload) in enumerate(messages):
            socket.send(request_id.to_bytes(8, "big") + kind + payload)
        replies = []
        while len(replies) < 4 and socket.poll(10_000):
            replies.append(socket.recv())
        assert not socket.poll(300)     # nothing more: the quiet publishes that applied got none
        stats = central.stats()
    finally:
        socket.close()
        central.close()
    assert lost.events
    assert [int.from_bytes(r[:8], "big") for r in replies] == [0, 13, 14, 15]
    assert [r[8:9] for r in replies] == [b"o", b"o", b"o", b"e"]
    assert PublishAck.unpack(replies[2][9:]).needs_resync and b"WireFormatError" in replies[3]
    assert stats["num_zmq_replies"] == 4 and stats["num_zmq_messages"] == len(messages)
    assert stats["bytes_out"] == sum(len(r) - 9 for r in replies[:3])   # only acks sent are counted


def test_a_quiet_send_is_acknowledged_by_a_later_reply_and_times_out_without_one(ray_local):
    ray = ray_local
    actor = _central(ray)
    transport = connect_transport(actor, "zmq", ack_timeout_s=1.0)
    local, worker = make_local()
    publisher = KVPublisher(local, transport, max_batch_age_s=0.0)
    driver = Driver(local, worker, seed=9)
    _drive(publisher, driver, 5)
    assert publisher.flush_and_wait(10.0)
    driver.step()
    quiet = transport.send("publish", local.drain_events().pack(), want_ack=False)
    time.sleep(0.3)
    assert transport.poll([quiet]) == []            # applied, but no reply of its own yet
    driver.step()
    loud = transport.send("publish", local.drain_events().pack())
    transport.wait([quiet, loud], 10.0)
    ended = dict((token, (reply, error)) for token, reply, error in transport.poll([quiet, loud]))
    assert ended[quiet] == (None, None) and ended[loud][1] is None
    assert PublishAck.unpack(ended[loud][0]).status == "ok"
    # With no later send, a quiet send ends by the ack timeout (the publisher then resyncs).
    driver.step()
    quiet = transport.send("publish", local.drain_events().pack(), want_ack=False)
    time.sleep(1.2)
    [(_, reply, error)] = transport.poll([quiet])
    assert reply is None and isinstance(error, TimeoutError)
    time.sleep(0.5)         # the timeout made the transport ask the actor for its endpoint again:
    transport.poll([])      # reads the answer (the same endpoint: no reconnect)
    local.event_log.needs_snapshot = True
    assert publisher.flush_and_wait(10.0) and _consistent(ray, actor, local)
    transport.close()
    ray.kill(actor)


def test_events_round_trip_in_order_with_acks_while_ray_methods_run(ray_local):
    ray = ray_local
    actor = _central(ray)
    transport = connect_transport(actor, "zmq")
    assert isinstance(transport, ZmqTransport)
    assert transport.endpoint == ray.get(actor.event_endpoint.remote()) and transport.endpoint.startswith("tcp://")
    local, worker = make_local()
    publisher = KVPublisher(local, transport, max_batch_age_s=0.0)
    driver = Driver(local, worker, seed=3)
    for _ in range(10):
        _drive(publisher, driver, 10)
        # Ray method calls interleave with the receiver thread's applies (one lock).
        ray.get([actor.longest_prefix.remote(Driver.PREFIXES[0]), actor.stats.remote()], timeout=30)
    assert publisher.flush_and_wait(10.0)
    assert _consistent(ray, actor, local)
    stats = ray.get(actor.stats.remote())
    assert publisher.num_batches >= 5 and publisher.num_failed_calls == 0   # (acks come <= gather_s late)
    assert stats["num_publishes"] == publisher.num_batches and stats["num_snapshots"] == 1
    assert stats["num_zmq_messages"] == publisher.num_batches + 1
    assert stats["num_zmq_replies"] < stats["num_zmq_messages"]   # quiet publishes (ack_interval_s)
    assert publisher.central_incarnation == ray.get(actor.get_incarnation.remote())
    assert stats["bytes_in"] == publisher.num_bytes_out and stats["bytes_out"] == publisher.num_bytes_in
    local.check_integrity()
    transport.close()
    ray.kill(actor)


def test_refused_input_is_an_error_reply_and_changes_nothing(ray_local):
    ray = ray_local
    actor = _central(ray)
    transport = connect_transport(actor, "zmq")
    local, worker = make_local()
    publisher = KVPublisher(local, transport, max_batch_age_s=0.0)
    _drive(publisher, Driver(local, worker, seed=4), 20)
    assert publisher.flush_and_wait(10.0)
    before = ray.get(actor.stats.remote())
    token = transport.send("publish", b"not msgpack")
    transport.wait([token], 10.0)
    [(_, reply, error)] = transport.poll([token])
    assert reply is None and isinstance(error, RuntimeError)
    # A well-formed batch from the future (a gap) is answered "resync".
    batch = local.drain_events()
    batch.first_seq += 5
    token = transport.send("publish", batch.pack())
    transport.wait([token], 10.0)
    [(_, reply, error)] = transport.poll([token])
    assert error is None and PublishAck.unpack(reply).needs_resync
    after = ray.get(actor.stats.remote())
    assert after["num_events"] == before["num_events"]
    local.event_log.needs_snapshot = True   # the batch above was taken out of the log
    assert publisher.flush_and_wait(10.0) and _consistent(ray, actor, local)
    transport.close()
    ray.kill(actor)


def test_central_restart_moves_the_endpoint_and_the_worker_reconnects_and_resyncs(ray_local):
    ray = ray_local
    actor = _central(ray, max_restarts=1, max_task_retries=0)
    transport = connect_transport(actor, "zmq", ack_timeout_s=0.5)
    local, worker = make_local()
    publisher = KVPublisher(local, transport, max_batch_age_s=0.0, heartbeat_s=0.2)
    driver = Driver(local, worker, seed=5)
    _drive(publisher, driver, 30)
    assert publisher.flush_and_wait(10.0)
    first = publisher.central_incarnation
    old_endpoint = transport.endpoint
    ray.kill(actor, no_restart=False)
    # The worker keeps planning and publishing into the void; it notices by the missing acks.
    deadline = time.monotonic() + 60
    while publisher.central_incarnation in (None, first) and time.monotonic() < deadline:
        _drive(publisher, driver, 1)
        time.sleep(0.05)
    assert publisher.central_incarnation not in (None, first), "never heard from the restarted manager"
    assert transport.endpoint != old_endpoint and transport.num_reconnects == 1
    assert transport.num_timeouts >= 1 and publisher.num_failed_calls >= 1
    _drive(publisher, driver, 20)
    assert publisher.flush_and_wait(10.0)
    assert _consistent(ray, actor, local)
    assert ray.get(actor.stats.remote())["num_snapshots"] >= 1
    local.check_integrity()
    transport.close()
    ray.kill(actor)


def test_falls_back_to_ray_calls_without_an_endpoint(ray_local):
    ray = ray_local
    plain = ray.remote(KVManagerService).options(num_cpus=0).remote()   # has no event_endpoint
    ray_only = _central(ray)
    configured_ray = ray.remote(CentralKVManager).options(num_cpus=0).remote("ray")
    assert ray.get(configured_ray.event_endpoint.remote(), timeout=60) is None
    for actor in (plain, configured_ray):
        transport = connect_transport(actor, "zmq", timeout_s=30)
        assert isinstance(transport, RayTransport)
        local, worker = make_local()
        publisher = KVPublisher(local, transport, max_batch_age_s=0.0)
        _drive(publisher, Driver(local, worker, seed=6), 20)
        assert publisher.flush_and_wait(10.0) and _consistent(ray, actor, local)
    assert isinstance(connect_transport(ray_only, "ray"), RayTransport)
    with pytest.raises(ValueError, match="unknown KV event transport"):
        connect_transport(ray_only, "carrier-pigeon")
    for actor in (plain, ray_only, configured_ray):
        ray.kill(actor)
