"""A worker's output channel (``workers.actor.output_channel``), on a real engine without Ray: all of
a handle's requests come back as one message per wake-up, each request's deltas rebuild exactly
what the engine made, and a channel that closes, a refused request, a dead engine or a broken
output end only what they must and leave no block behind."""

from __future__ import annotations

import asyncio
import time

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.workers.outputs.accumulator import OutputAccumulator
from pagedserve.workers.offline.async_engine import AsyncLLMEngine, EngineDeadError
from pagedserve.workers.actor.output_channel import OutputChannel, _merged
from pagedserve.workers.actor.protocol import ChannelMessage, GenerateRequest, Migrated, OutputDelta, SampleDelta
from pagedserve.workers.engine.request import RequestMetrics

PROMPTS = [list(range(3, 3 + n)) for n in (5, 17, 30, 9)]


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture
def llm(tiny_model):
    return LLM(model=tiny_model("llama"), device="cpu", dtype="float32", block_size=8,
               num_device_blocks=96, swap_space_gb=0.001)


@pytest.fixture
def engine(llm):
    engine = AsyncLLMEngine(llm.engine)
    yield engine
    if engine.is_running:
        engine.check_integrity()
        deadline = time.monotonic() + 30
        while engine.num_used_blocks() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.num_used_blocks() == 0
    engine.shutdown()


def _channel(engine: AsyncLLMEngine, lease_s: float = 60.0) -> OutputChannel:
    return OutputChannel("test-channel", engine, hold_export=lambda request_id, kv: ("held", request_id),
                         lease_s=lease_s)


async def _read_all(channel: OutputChannel, request_ids: set[str]) -> tuple[dict[str, list], int]:
    """Every item of ``request_ids`` until each has its last one; and the messages taken."""
    items: dict[str, list] = {request_id: [] for request_id in request_ids}
    open_ids, num_messages = set(request_ids), 0
    while open_ids:
        message = await asyncio.wait_for(channel.take(), 60)
        assert type(message) is ChannelMessage   # pickled compactly (test_stream_protocol)
        num_messages += 1
        for request_id, item in message:
            items[request_id].append(item)
            if isinstance(item, BaseException) or isinstance(item, Migrated) or item.finished:
                open_ids.discard(request_id)
    return items, num_messages


@pytest.fixture
def expected(llm) -> list[list[int]]:
    """The prompts' greedy tokens, generated before ``engine`` starts its thread on the same
    engine (that thread steps whatever the engine holds: generating beside it raced it)."""
    return [out.outputs[0].token_ids for out in llm.generate(PROMPTS, _greedy(16))]


def test_a_channel_carries_every_request_in_one_message_per_wake_up(expected, engine):
    channel = _channel(engine)

    async def run():
        for i, prompt in enumerate(PROMPTS):
            channel.start(GenerateRequest(f"r{i}", prompt, _greedy(16)))
        return await _read_all(channel, {f"r{i}" for i in range(len(PROMPTS))})

    items, num_messages = asyncio.run(run())
    for i, prompt in enumerate(PROMPTS):
        accumulator = OutputAccumulator(f"r{i}", None, prompt)
        outputs = [accumulator.add(delta) for delta in items[f"r{i}"]]
        assert outputs[-1].finished and outputs[-1].outputs[0].token_ids == expected[i]
        assert all(not out.finished for out in outputs[:-1])
    num_deltas = sum(len(deltas) for deltas in items.values())
    # Four requests decoding together: a message per step, each with all of them.
    assert num_messages < num_deltas / 2, (num_messages, num_deltas)
    assert channel.num_requests == 0


def test_closing_a_channel_aborts_what_runs_on_it_and_nothing_else(engine):
    channel, other = _channel(engine), _channel(engine)

    async def run():
        for i, prompt in enumerate(PROMPTS[:2]):
            channel.start(GenerateRequest(f"c{i}", prompt, _greedy(400)))
        other.start(GenerateRequest("o", PROMPTS[2], _greedy(12)))
        await asyncio.wait_for(channel.take(), 60)  # both are running
        assert channel.close() == 2
        assert await channel.take() is None  # closed: the stream ends
        items, _ = await _read_all(other, {"o"})
        return items["o"]

    deltas = asyncio.run(run())
    assert deltas[-1].finished and deltas[-1].samples[0].finish_reason == "length"
    assert channel.num_requests == 0


def test_a_refused_request_raises_and_starts_nothing(engine):
    channel = _channel(engine)

    async def run():
        too_long = list(range(3, 603))  # the tiny model's context is 512 tokens
        with pytest.raises(ValueError, match="context|tokens"):
            channel.start(GenerateRequest("bad", too_long, _greedy(4)))
        channel.start(GenerateRequest("good", PROMPTS[0], _greedy(4)))
        with pytest.raises(ValueError, match="already in use"):
            channel.start(GenerateRequest("good", PROMPTS[1], _greedy(4)))
        return await _read_all(channel, {"good"})

    items, _ = asyncio.run(run())
    assert set(items) == {"good"} and items["good"][-1].finished
    assert channel.num_requests == 0


def test_a_dead_engine_ends_each_request_with_its_error(engine):
    channel = _channel(engine)

    async def run():
        for i, prompt in enumerate(PROMPTS[:3]):
            channel.start(GenerateRequest(f"d{i}", prompt, _greedy(400)))
        await asyncio.wait_for(channel.take(), 60)
        await asyncio.get_running_loop().run_in_executor(None, engine.shutdown)
        return await _read_all(channel, {f"d{i}" for i in range(3)})

    items, _ = asyncio.run(run())
    for deltas in items.values():
        assert isinstance(deltas[-1], EngineDeadError) and deltas[-1].engine_id == engine.engine_id
    assert channel.num_requests == 0


def test_an_output_that_cannot_be_sent_ends_its_request_alone(engine, monkeypatch):
    channel = _channel(engine)

    async def run():
        channel.start(GenerateRequest("broken", PROMPTS[0], _greedy(400)))
        channel.start(GenerateRequest("fine", PROMPTS[1], _greedy(10)))
        put = channel.put

        def put_failing_for_broken(request_id, item, is_last=False):
            if request_id == "broken" and isinstance(item, OutputDelta):
                raise RuntimeError("injected: sending failed")
            put(request_id, item, is_last)

        monkeypatch.setattr(channel, "put", put_failing_for_broken)
        return await _read_all(channel, {"broken", "fine"})

    items, _ = asyncio.run(run())
    assert isinstance(items["broken"][-1], RuntimeError) and "injected" in str(items["broken"][-1])
    assert items["fine"][-1].finished and len(items["fine"][-1].samples[0].token_ids) >= 1


def test_a_channel_its_handle_stopped_renewing_closes_and_aborts_its_requests(engine):
    """A handle's process that died never closes its channel (Ray does not end a streamed call
    whose caller is gone): the lease does, freeing the requests' blocks."""
    channel = _channel(engine, lease_s=0.5)

    async def run():
        channel.start(GenerateRequest("orphan", PROMPTS[1], _greedy(400)))
        num_messages = 0
        while await asyncio.wait_for(channel.take(), 30) is not None:
            num_messages += 1
        return num_messages

    assert asyncio.run(run()) >= 1  # it ran, then the lease ran out mid-request
    assert channel.is_closed and channel.num_requests == 0


def test_a_channel_nobody_reads_or_renews_closes_on_its_lease(engine):
    """A worker whose handle holds it back (``MESSAGES_AHEAD`` messages unread) is not in
    ``take``: the lease still closes the channel of a handle that stopped renewing it."""
    channel = _channel(engine, lease_s=0.5)

    async def run():
        channel.start(GenerateRequest("unread", PROMPTS[1], _greedy(400)))
        deadline = time.monotonic() + 30
        while not channel.is_closed and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    asyncio.run(run())
    assert channel.is_closed and channel.num_requests == 0


def test_a_renewed_channel_stays_open_while_idle(engine):
    channel = _channel(engine, lease_s=0.4)

    async def run():
        async def renew():
            while True:
                await asyncio.sleep(0.1)
                channel.renew()

        renewer = asyncio.create_task(renew())
        with pytest.raises(asyncio.TimeoutError):  # idle for 3 leases: nothing to take, still open
            await asyncio.wait_for(channel.take(), 1.2)
        assert not channel.is_closed
        channel.start(GenerateRequest("late", PROMPTS[0], _greedy(6)))
        items, _ = await _read_all(channel, {"late"})
        renewer.cancel()
        return items["late"]

    deltas = asyncio.run(run())
    assert deltas[-1].finished and not channel.is_closed


def _delta(request_id: str, tokens: list[int], finished: bool = False) -> OutputDelta:
    return OutputDelta(request_id, [SampleDelta(0, tokens, "".join(f"<{t}>" for t in tokens))], finished,
                       RequestMetrics(arrival_time=0.0))


def test_a_message_merges_each_requests_consecutive_deltas_and_keeps_their_order():
    migrated = Migrated("a", "worker-1", "kv")
    message = [("a", _delta("a", [1])), ("b", _delta("b", [7])), ("a", _delta("a", [2])),
               ("a", migrated), ("b", _delta("b", [8], finished=True))]
    merged = _merged(message)
    assert [request_id for request_id, _ in merged] == ["a", "b", "a"]
    a, b, moved = (item for _, item in merged)
    assert a.samples[0].token_ids == [1, 2] and a.samples[0].text == "<1><2>"
    assert b.samples[0].token_ids == [7, 8] and b.finished
    assert moved is migrated
    # A delta after a control item opens a new run rather than joining the one before it.
    again = _merged([("a", _delta("a", [1])), ("a", ValueError("x")), ("a", _delta("a", [2]))])
    assert [type(item).__name__ for _, item in again] == ["OutputDelta", "ValueError", "OutputDelta"]
