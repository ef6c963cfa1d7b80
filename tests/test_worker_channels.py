"""A worker's output channel on the handle's side (``cluster/worker_channels.py``), over a
stand-in for the worker actor (Ray's streaming call and actor methods, mocked: the channel's
bookkeeping is under test, not Ray).

A migration's KV stays held on its source worker until someone releases it; a draining
worker cannot go before. When no attempt will follow a ``Migrated`` item (its request
stopped reading, or it never reached the reader), the channel releases the export itself.
"""

from __future__ import annotations

import asyncio

from pagedserve import SamplingParams
from pagedserve.cluster.worker_channels import WorkerChannel
from pagedserve.workers.actor.protocol import GenerateRequest, Migrated


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

    async def _outputs(self, channel_id):
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
        channel = WorkerChannel("w0", worker)
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
