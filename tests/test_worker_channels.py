"""A worker's output channel on the handle's side (``cluster/worker_channels.py``), over a
stand-in for the worker actor (Ray's streaming call and actor methods, mocked: the channel's
bookkeeping is under test, not Ray). With the socket transport the stand-in runs the
worker's real ends: the engine core's ``ChannelSocketSender`` over a real ZeroMQ socket, served
as the core's loop serves it, and the actor's direct ``OutputChannel`` that its Ray call waits on.

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
from pagedserve.workers.outputs.channel_socket import (CREDIT, HELLO, ChannelSocketReceiver, ChannelSocketSender,
                                                     decode, encode)
from pagedserve.workers.actor.output_channel import OutputChannel
from pagedserve.workers.actor.protocol import EngineDeadError, GenerateRequest, Migrated, OutputDelta
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
    """The worker's end of a socket channel, real where it runs (the core's sender, served every
    2 ms as the core's loop serves it; the actor's direct ``OutputChannel``), behind a stand-in
    for its Ray call: the test sends the core's output with ``put`` and ends the channel with
    ``close`` or ``die`` as the core would, and may end the call with ``lifeline_error``."""

    def __init__(self) -> None:
        self.channel: OutputChannel | None = None
        self.sender: ChannelSocketSender | None = None
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
        self.close_channel = _Method(lambda channel_id: self.close())

    async def _outputs(self, channel_id, transport, messages_ahead):
        assert transport == "zmq"
        self.channel = OutputChannel(channel_id, lambda _: None)
        self.sender = ChannelSocketSender(zmq.Context.instance(), channel_id, messages_ahead, host="127.0.0.1")
        self.channel.start(is_direct=True)
        serving = asyncio.ensure_future(self._serve())
        self.opened.set()
        try:
            yield _done(self.sender.address)
            ended = asyncio.ensure_future(self.channel.wait_ended())
            await asyncio.wait([ended, self.lifeline_error], return_when=asyncio.FIRST_COMPLETED)
            if self.lifeline_error.done():
                ended.cancel()
                raise self.lifeline_error.result()
            await ended
        finally:
            serving.cancel()
            self.sender.close()

    async def _serve(self) -> None:
        while self.sender.service():
            await asyncio.sleep(0.002)

    def put(self, entry) -> None:
        self.sender.put(entry)

    def close(self) -> None:
        """The channel closed on the worker: the core ends its socket."""
        self.sender.send_end()
        self.channel.close()

    def die(self, error: EngineDeadError) -> None:
        """The engine failed: the core ends its socket with the error; the actor hears of it later."""
        self.sender.send_end([error])
        asyncio.get_running_loop().call_later(0.05, self.channel.fail, error)


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
        worker.put(_batch((0, [5]), (1, [7])))
        await asyncio.sleep(0.01)
        worker.put(_batch((0, [6]), (1, [8]), ends=((0, 2),)))
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
        worker.close()   # the worker closed the channel: what still reads ends
        with pytest.raises(ChannelClosed):
            await _next(second)
        await first.aclose()
        channel.close()

    asyncio.run(run())


def test_a_socket_channel_ends_with_the_engines_death_after_what_came_before_it():
    async def run():
        worker, stream, reading = await _one_socket_stream()
        worker.put(_batch((0, [5])))
        await asyncio.sleep(0.01)
        worker.die(EngineDeadError("the engine loop failed", "engine-7"))
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
        worker.put(_batch((0, [5])))
        worker.put(Migrated("moved", "w1", None))
        worker.put(Migrated("lost", "w2", None))   # its export expired on the worker
        worker.put(Migrated("gone", "w1", None))   # its request stopped reading
        assert isinstance(await readings[0], OutputDelta)
        migrated = await _next(moved)
        assert (migrated.request_id, migrated.target, migrated.kv) == ("moved", "w1", ref)
        with pytest.raises(ChannelClosed, match="no longer held"):
            await readings[1]
        await asyncio.sleep(0.05)
        assert worker.released == ["gone"]
        channel.close()

    asyncio.run(run())


def _sender(channel_id: str, messages_ahead: int) -> ChannelSocketSender:
    return ChannelSocketSender(zmq.Context.instance(), channel_id, messages_ahead, host="127.0.0.1")


def _socket_pair(messages_ahead: int) -> tuple[ChannelSocketSender, ChannelSocketReceiver]:
    """A channel "c1"'s sender on the loopback and a reader connected to it."""
    sender = _sender("c1", messages_ahead)
    return sender, ChannelSocketReceiver(sender.address, "c1")


async def _serve_until(sender: ChannelSocketSender, done, timeout_s: float = 10) -> None:
    """Serve ``sender`` as the core's loop does until ``done()``."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not done():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        sender.service()
        await asyncio.sleep(0.005)


def test_a_socket_sender_stays_at_most_its_messages_ahead_of_the_reader():
    async def run():
        sender, receiver = _socket_pair(messages_ahead=2)
        for n in range(2):
            sender.put(_batch((0, [n])))
            await _serve_until(sender, lambda: not sender.has_pending)
        sender.put(_batch((0, [2])))
        sender.put(_batch((0, [3])))
        for _ in range(60):
            sender.service()
            await asyncio.sleep(0.005)
        assert sender.has_pending and sender.num_sent == 2   # two unread: it waits for a credit
        [(kind, packed)] = decode(await receiver.receive())
        assert StreamBatch.unpack(packed).token_ids == [0]
        receiver.read_one()
        await _serve_until(sender, lambda: not sender.has_pending)
        decode(await receiver.receive())
        receiver.read_one()
        # What waited for the credit went as one message.
        assert [StreamBatch.unpack(v).token_ids for _, v in decode(await receiver.receive())] == [[2], [3]]
        sender.close()
        receiver.close()

    asyncio.run(run())


def test_a_socket_sender_sends_only_to_the_peer_that_named_its_channel():
    async def run():
        sender = _sender("c1", messages_ahead=2)
        stranger = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        stranger.connect(sender.address)
        await stranger.send_multipart([HELLO, b"c2"])
        await stranger.send_multipart([CREDIT])
        sender.put(_batch((0, [1])))
        for _ in range(60):
            sender.service()
            await asyncio.sleep(0.005)
        assert sender.has_pending   # nobody who named the channel is there
        receiver = ChannelSocketReceiver(sender.address, "c1")
        await _serve_until(sender, lambda: not sender.has_pending)
        assert decode(await receiver.receive())[0][0] == b"B"
        assert not await stranger.poll(200)
        for socket in (stranger, receiver, sender):
            socket.close()

    asyncio.run(run())


_READER = """
import asyncio, sys
from pagedserve.workers.outputs.channel_socket import ChannelSocketReceiver

async def main():
    receiver = ChannelSocketReceiver(sys.argv[1], sys.argv[2])
    await receiver.receive()
    print("read", flush=True)   # and no credit: the sender waits for one
    await asyncio.sleep(600)

asyncio.run(main())
"""


@pytest.mark.parametrize("sending", [False, True], ids=["idle", "waiting-for-a-credit"])
def test_a_socket_channel_whose_reader_was_killed_ends_at_once_not_at_its_lease(sending):
    """A handle's process that dies closes its connection: the sender says so at once (the core
    then aborts the channel's requests), not after the channel's lease, whether or not it had
    more to send."""
    async def run():
        sender = _sender("c1", messages_ahead=1)
        reader = subprocess.Popen([sys.executable, "-c", _READER, sender.address, "c1"], stdout=subprocess.PIPE,
                                  text=True)
        try:
            sender.put(_batch((0, [1])))
            reading = asyncio.get_running_loop().run_in_executor(None, reader.stdout.readline)
            await _serve_until(sender, reading.done, 60)
            assert reading.result() == "read\n"
            if sending:
                sender.put(_batch((0, [2])))   # unread: the sender waits for a credit
            for _ in range(40):
                assert sender.service()
                await asyncio.sleep(0.005)
            reader.kill()
            await _serve_until(sender, lambda: sender.is_reader_gone)
            assert not sender.service()
        finally:
            reader.kill()
            reader.wait()
            sender.close()

    asyncio.run(run())


def test_a_strangers_connection_closing_leaves_the_channel_open():
    async def run():
        sender, receiver = _socket_pair(messages_ahead=1)
        sender.put(_batch((0, [1])))
        await _serve_until(sender, lambda: not sender.has_pending)
        stranger = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        stranger.setsockopt(zmq.LINGER, 0)
        stranger.connect(sender.address)
        await stranger.send_multipart([HELLO, b"c1"])   # the channel's name, too late: ignored
        await asyncio.sleep(0.1)
        stranger.close()
        sender.put(_batch((0, [2])))
        for _ in range(100):
            assert sender.service()   # the stranger's going is ignored
            await asyncio.sleep(0.005)
        assert sender.has_pending   # no credit yet
        decode(await receiver.receive())
        receiver.read_one()
        await _serve_until(sender, lambda: not sender.has_pending)
        receiver.close()   # the reader's own connection closing is what counts
        await _serve_until(sender, lambda: sender.is_reader_gone)
        sender.close()

    asyncio.run(run())


def test_a_socket_channels_end_carries_what_was_queued_then_the_engines_error():
    async def run():
        sender, receiver = _socket_pair(messages_ahead=1)
        sender.put(_batch((0, [1])))
        await _serve_until(sender, lambda: not sender.has_pending)
        sender.put(_batch((0, [2])))   # past the credits: it goes with the end
        sender.send_end([EngineDeadError("gone", "engine-1")])
        assert [kind for kind, _ in decode(await receiver.receive())] == [b"B"]
        assert [kind for kind, _ in decode(await receiver.receive())] == [b"B", b"E", b"X"]
        sender.close()
        receiver.close()

    asyncio.run(run())


_EXITING_SENDER = """
import sys, time
from pagedserve.workers.actor.protocol import EngineDeadError
from pagedserve.workers.engine.output_sockets import OutputSockets

sockets = OutputSockets(lambda socket: None, lambda socket: None)
print(sockets.open("c1", 1, "127.0.0.1"), flush=True)
while sockets.senders["c1"]._peer is None:   # the reader's hello
    sockets.service()
    time.sleep(0.005)
sockets.put("c1", b"x" * int(sys.argv[1]))
sockets.close_all(EngineDeadError("gone", "engine-1"))
sockets.terminate()
"""   # and the process exits at once, as the engine core's does after its loop fails


def test_a_socket_channels_last_message_reaches_its_reader_when_the_core_exits_right_after():
    """ZeroMQ sends from an I/O thread that an exiting process ends without waiting: the core's
    sockets are terminated first, so a last message too big to be sent at once (32 MB) still
    arrives whole, with the engine's error and the channel's end."""
    size = 32 << 20
    async def run():
        sender = subprocess.Popen([sys.executable, "-c", _EXITING_SENDER, str(size)], stdout=subprocess.PIPE,
                                  text=True)
        try:
            address = await asyncio.get_running_loop().run_in_executor(None, sender.stdout.readline)
            receiver = ChannelSocketReceiver(address.strip(), "c1")
            entries = decode(await asyncio.wait_for(receiver.receive(), 60))
            receiver.close()
            assert await asyncio.get_running_loop().run_in_executor(None, sender.wait) == 0
            return entries
        finally:
            sender.kill()
            sender.wait()

    entries = asyncio.run(run())
    assert [kind for kind, _ in entries] == [b"B", b"E", b"X"] and len(entries[0][1]) == size


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
