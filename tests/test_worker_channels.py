"""A worker's output channel on the handle's side (``cluster/worker_channels.py``), over a
stand-in for the worker actor (Ray's streaming call and actor methods, mocked: the channel's
bookkeeping is under test, not Ray). With the socket transport the stand-in runs the
worker's real end (``OutputChannel`` and ``ChannelSocketSender`` over a real ZeroMQ socket).

A migration's KV stays held on its source worker until someone releases it; a draining
worker cannot go before. When no attempt will follow a ``Migrated`` item (its request
stopped reading, or it never reached the reader), the channel releases the export itself.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest
import zmq
import zmq.asyncio
from ray.exceptions import RayActorError

from pagedserve import SamplingParams
from pagedserve.cluster.worker_channels import ChannelClosed, WorkerChannel
from pagedserve.workers.actor.channel_socket import (CREDIT, HELLO, ChannelSocketReceiver, ChannelSocketSender,
                                                     decode, encode)
from pagedserve.workers.actor.output_channel import OutputChannel
from pagedserve.workers.actor.protocol import EngineDeadError, GenerateRequest, Migrated, OutputDelta
from pagedserve.workers.actor.worker import _send_over_socket
from pagedserve.workers.outputs.stream_batch import StreamBatch


class _Method:
    def __init__(self, fn) -> None:
        self.fn = fn

    def options(self, **_) -> "_Method":
        return self

    def remote(self, *args):
        return self.fn(*args)


class FakeWorker:
    """Answers every submission, streams what the test puts in ``messages``, records releases."""

    def __init__(self) -> None:
        self.messages: asyncio.Queue = asyncio.Queue()
        self.released: list[str] = []
        self.channel_outputs = _Method(self._outputs)
        self.submit = _Method(self._submit)
        self.release_export = _Method(self.released.append)
        self.renew_channel = _Method(lambda channel_id: None)
        self.close_channel = _Method(lambda channel_id: None)

    async def _outputs(self, channel_id, transport="ray", messages_ahead=2):
        assert transport == "ray"
        while True:
            message = await self.messages.get()
            ref = asyncio.get_running_loop().create_future()
            ref.set_result(message)
            yield ref

    def _submit(self, channel_id, requests):
        answer = asyncio.get_running_loop().create_future()
        answer.set_result([True] * len(requests))
        return answer


def _request(request_id: str) -> GenerateRequest:
    return GenerateRequest(request_id, [1, 2, 3], SamplingParams(max_tokens=4), kv=["transfer"])


def test_a_migration_nobody_follows_releases_its_export():
    async def run() -> list[str]:
        worker = FakeWorker()
        channel = WorkerChannel("w0", worker, "ray")
        # A request that stopped reading before its Migrated came: the reader releases it.
        await worker.messages.put([Migrated("gone", "w1", object())])
        # A request that reads its Migrated: the handle follows it, nothing is released here.
        followed = channel.stream(_request("followed"), timeout_s=30)
        reading = asyncio.ensure_future(followed.__anext__())
        await asyncio.sleep(0.01)
        await worker.messages.put([Migrated("followed", "w1", object())])
        item = await reading
        assert isinstance(item, Migrated) and item.request_id == "followed"
        await followed.aclose()
        # A request that stops reading while its Migrated waits in its inbox: released on close.
        dropped = channel.stream(_request("dropped"), timeout_s=30)
        reading = asyncio.ensure_future(dropped.__anext__())
        await asyncio.sleep(0.01)
        channel.inboxes["dropped"].put(Migrated("dropped", "w1", object()))
        reading.cancel()
        await asyncio.sleep(0.01)
        await dropped.aclose()
        channel.close()
        await asyncio.sleep(0.01)
        return worker.released

    assert asyncio.run(run()) == ["gone", "dropped"]


def _done(value):
    future = asyncio.get_running_loop().create_future()
    future.set_result(value)
    return future


class SocketWorker:
    """The worker's end of a socket channel, real (``OutputChannel``, the sender, the loop that
    feeds it), behind a stand-in for its Ray call: the test puts the engine core's output in
    ``channel`` and may end the call with ``lifeline_error``."""

    def __init__(self) -> None:
        self.channel: OutputChannel | None = None
        self.opened = asyncio.Event()
        self.exports: dict[str, object] = {}
        self.released: list[str] = []
        self.lifeline_error: asyncio.Future = asyncio.get_running_loop().create_future()
        self.channel_outputs = _Method(self._outputs)
        self.submit = _Method(lambda channel_id, requests: _done([True] * len(requests)))
        self.release_export = _Method(self.released.append)
        self.export_ref = _Method(lambda request_id: _done([self.exports[request_id]] if request_id in self.exports
                                                           else None))
        self.renew_channel = _Method(lambda channel_id: None)
        self.close_channel = _Method(lambda channel_id: self.channel.close())

    async def _outputs(self, channel_id, transport, messages_ahead):
        assert transport == "zmq"
        self.channel = OutputChannel(channel_id, lambda _: None)
        sender = ChannelSocketSender(channel_id, messages_ahead, host="127.0.0.1")
        self.opened.set()
        try:
            yield _done(sender.address)
            pumping = asyncio.ensure_future(_send_over_socket(self.channel, sender))
            await asyncio.wait([pumping, self.lifeline_error], return_when=asyncio.FIRST_COMPLETED)
            if self.lifeline_error.done():
                pumping.cancel()
                raise self.lifeline_error.result()
        finally:
            sender.close()


def _batch(*rows: tuple[int, list[int]], ends: tuple = ()) -> bytes:
    batch = StreamBatch()
    for key, token_ids in rows:
        batch.add(key, 0, token_ids)
    for key, num in ends:
        batch.end(key, num)
    return batch.pack()


async def _next(stream, timeout_s: float = 10):
    return await asyncio.wait_for(stream.__anext__(), timeout_s)


async def _one_socket_stream():
    """A socket channel's worker, one request's stream on it, and its first read, once the
    worker's end is open."""
    worker = SocketWorker()
    stream = WorkerChannel("w0", worker, "zmq").stream(_request("a"), 30)
    reading = asyncio.ensure_future(_next(stream))
    await worker.opened.wait()
    return worker, stream, reading


def test_a_socket_channel_brings_each_request_its_tokens_in_order_and_its_end():
    async def run():
        worker = SocketWorker()
        channel = WorkerChannel("w0", worker, "zmq")
        first, second = channel.stream(_request("a"), 30), channel.stream(_request("b"), 30)
        reading = asyncio.ensure_future(_next(first))
        await worker.opened.wait()
        reading_b = asyncio.ensure_future(_next(second))
        await asyncio.sleep(0.05)
        worker.channel.put(_batch((0, [5]), (1, [7])))
        worker.channel.put(_batch((0, [6]), (1, [8]), ends=((0, 2),)))
        deltas = [await reading]
        while not deltas[-1].finished:
            deltas.append(await _next(first))
        b = await reading_b
        while len([t for s in b.samples for t in s.token_ids]) < 2:
            more = await _next(second)
            b = OutputDelta("b", b.samples + more.samples, more.finished, None)
        tokens = [t for d in deltas for s in d.samples for t in s.token_ids]
        assert tokens == [5, 6] and all(d.request_id == "a" for d in deltas)
        assert [t for s in b.samples for t in s.token_ids] == [7, 8] and not b.finished
        worker.channel.close()   # the worker closed the channel: what still reads ends
        with pytest.raises(ChannelClosed):
            await _next(second)
        await first.aclose()
        channel.close()

    asyncio.run(run())


def test_a_socket_channel_ends_with_the_engines_death_after_what_came_before_it():
    async def run():
        worker, stream, reading = await _one_socket_stream()
        worker.channel.put(_batch((0, [5])))
        worker.channel.fail(EngineDeadError("the engine core process ended", "engine-7"))
        assert isinstance(await reading, OutputDelta)
        with pytest.raises(EngineDeadError) as raised:
            await _next(stream)
        assert raised.value.engine_id == "engine-7"

    asyncio.run(run())


def test_a_socket_channel_whose_worker_died_ends_at_once_with_its_error():
    async def run():
        worker, stream, reading = await _one_socket_stream()
        worker.lifeline_error.set_result(RayActorError())   # the socket stays silent
        with pytest.raises(RayActorError):
            await reading

    asyncio.run(run())


def test_a_migration_over_a_socket_brings_its_kv_ref_or_sends_the_request_elsewhere():
    async def run():
        worker = SocketWorker()
        channel = WorkerChannel("w0", worker, "zmq")
        moved, lost, gone = (channel.stream(_request(r), 30) for r in ("moved", "lost", "gone"))
        readings = [asyncio.ensure_future(_next(s)) for s in (moved, lost, gone)]
        await worker.opened.wait()
        await asyncio.sleep(0.05)
        readings[2].cancel()
        await asyncio.sleep(0.01)
        await gone.aclose()
        worker.exports["moved"] = ref = object()
        worker.channel.put(_batch((0, [5])))
        worker.channel.put(Migrated("moved", "w1", None))
        worker.channel.put(Migrated("lost", "w2", None))   # its export expired on the worker
        worker.channel.put(Migrated("gone", "w1", None))   # its request stopped reading
        assert isinstance(await readings[0], OutputDelta)
        migrated = await _next(moved)
        assert (migrated.request_id, migrated.target, migrated.kv) == ("moved", "w1", ref)
        with pytest.raises(ChannelClosed, match="no longer held"):
            await readings[1]
        await asyncio.sleep(0.05)
        assert worker.released == ["gone"]
        channel.close()

    asyncio.run(run())


def _never_closed() -> bool:
    return False


def _socket_pair(messages_ahead: int) -> tuple[ChannelSocketSender, ChannelSocketReceiver]:
    """A channel "c1"'s sender on the loopback and a reader connected to it."""
    sender = ChannelSocketSender("c1", messages_ahead=messages_ahead, host="127.0.0.1")
    return sender, ChannelSocketReceiver(sender.address, "c1")


def test_a_socket_sender_stays_at_most_its_messages_ahead_of_the_reader():
    async def run():
        sender, receiver = _socket_pair(messages_ahead=2)
        for n in range(2):
            await asyncio.wait_for(sender.send([_batch((0, [n]))], _never_closed), 10)
        third = asyncio.ensure_future(sender.send([_batch((0, [2]))], _never_closed))
        await asyncio.sleep(0.3)
        assert not third.done()   # two unread: it waits for a credit
        frames = await receiver.receive()
        [(kind, packed)] = decode(frames)
        assert StreamBatch.unpack(packed).token_ids == [0]
        receiver.read_one()
        assert await asyncio.wait_for(third, 10)
        closed = asyncio.ensure_future(sender.send([_batch((0, [3]))], lambda: True))
        assert await asyncio.wait_for(closed, 10) is False   # the channel closed while it waited
        sender.close()
        receiver.close()

    asyncio.run(run())


def test_a_socket_sender_sends_only_to_the_peer_that_named_its_channel():
    async def run():
        sender = ChannelSocketSender("c1", messages_ahead=2, host="127.0.0.1")
        stranger = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        stranger.connect(sender.address)
        await stranger.send_multipart([HELLO, b"c2"])
        await stranger.send_multipart([CREDIT])
        sending = asyncio.ensure_future(sender.send([_batch((0, [1]))], lambda: False))
        await asyncio.sleep(0.3)
        assert not sending.done()   # nobody who named the channel is there
        receiver = ChannelSocketReceiver(sender.address, "c1")
        assert await asyncio.wait_for(sending, 10)
        assert decode(await receiver.receive())[0][0] == b"B"
        assert not await stranger.poll(200)
        for socket in (stranger, receiver, sender):
            socket.close()

    asyncio.run(run())


_READER = """
import asyncio, sys
from pagedserve.workers.actor.channel_socket import ChannelSocketReceiver

async def main():
    receiver = ChannelSocketReceiver(sys.argv[1], sys.argv[2])
    await receiver.receive()
    print("read", flush=True)   # and no credit: the worker waits for one
    await asyncio.sleep(600)

asyncio.run(main())
"""


@pytest.mark.parametrize("sending", [False, True], ids=["idle", "waiting-for-a-credit"])
def test_a_socket_channel_whose_reader_was_killed_closes_at_once_not_at_its_lease(sending):
    """A handle's process that dies closes its connection: the worker closes the channel then
    (the engine aborts its requests), not after its lease, whether or not it had more to send."""
    async def run():
        closed = []
        channel = OutputChannel("c1", closed.append, lease_s=300)
        sender = ChannelSocketSender("c1", messages_ahead=1, host="127.0.0.1")
        reader = subprocess.Popen([sys.executable, "-c", _READER, sender.address, "c1"], stdout=subprocess.PIPE,
                                  text=True)
        try:
            pumping = asyncio.ensure_future(_send_over_socket(channel, sender))
            channel.put(_batch((0, [1])))
            line = await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(None, reader.stdout.readline), 60)
            assert line == "read\n"
            if sending:
                channel.put(_batch((0, [2])))   # unread: the sender waits for a credit
            await asyncio.sleep(0.2)
            assert not pumping.done()
            reader.kill()
            await asyncio.wait_for(pumping, 10)
            assert sender.is_reader_gone and closed == ["c1"]
        finally:
            reader.kill()
            reader.wait()
            sender.close()

    asyncio.run(run())


def test_a_strangers_connection_closing_leaves_the_channel_open():
    async def run():
        sender, receiver = _socket_pair(messages_ahead=1)
        assert await asyncio.wait_for(sender.send([_batch((0, [1]))], _never_closed), 10)
        stranger = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        stranger.setsockopt(zmq.LINGER, 0)
        stranger.connect(sender.address)
        await stranger.send_multipart([HELLO, b"c1"])   # the channel's name, too late: ignored
        await asyncio.sleep(0.1)
        stranger.close()
        await asyncio.sleep(0.3)
        waiting = asyncio.ensure_future(sender.send([_batch((0, [2]))], _never_closed))
        watching = asyncio.ensure_future(sender.wait_reader_gone())
        await asyncio.sleep(0.5)
        assert not waiting.done() and not watching.done()   # the stranger's going was ignored
        decode(await receiver.receive())
        receiver.read_one()
        assert await asyncio.wait_for(waiting, 10)
        receiver.close()   # the reader's own connection closing is what counts
        await asyncio.wait_for(watching, 10)
        assert sender.is_reader_gone
        sender.close()

    asyncio.run(run())


def test_channel_socket_frames_carry_each_kind_of_entry():
    error = EngineDeadError("gone", "engine-1")
    frames = encode([b"packed", Migrated("r1", "w3", object()), error])
    kinds = [kind for kind, _ in decode(frames)]
    assert kinds == [b"B", b"M", b"E"]
    [(_, packed), (_, migrated), (_, dead)] = decode(frames)
    assert packed == b"packed" and migrated == ("r1", "w3")
    assert isinstance(dead, EngineDeadError) and (str(dead), dead.engine_id) == ("gone", "engine-1")
    with pytest.raises(TypeError, match="carries no"):
        encode([object()])
