"""The streaming engine outlives its callers: a caller whose event loop closes mid-stream
loses its request (aborted, blocks freed), and the engine keeps serving everyone else."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.workers.offline.async_engine import AsyncLLMEngine, EngineDeadError


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _llm(tiny_model) -> LLM:
    return LLM(model=tiny_model("llama"), device="cpu", dtype="float32", block_size=8,
               num_device_blocks=64, swap_space_gb=0.001)


def _wait_for_no_blocks(engine: AsyncLLMEngine, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while engine.num_used_blocks() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.num_used_blocks() == 0


async def _collect(engine: AsyncLLMEngine, prompt: list[int], max_tokens: int) -> list[int]:
    last = None
    async for output in engine.generate(prompt, _greedy(max_tokens)):
        last = output
    return last.outputs[0].token_ids


def test_a_caller_whose_event_loop_closes_does_not_kill_the_engine(tiny_model):
    llm = _llm(tiny_model)
    prompt = list(range(3, 40))
    # Before the engine thread starts: it steps whatever the engine holds, so a synchronous
    # generate beside it would be two threads stepping one engine.
    expected = llm.generate([prompt], _greedy(12))[0].outputs[0].token_ids
    engine = AsyncLLMEngine(llm.engine)
    try:
        gone_loop = asyncio.new_event_loop()
        stream = engine.generate(prompt, _greedy(200), request_id="gone")
        gone_loop.run_until_complete(stream.__anext__())
        gone_loop.close()  # the caller vanishes without closing its stream

        _wait_for_no_blocks(engine)
        assert engine.is_running
        assert asyncio.run(asyncio.wait_for(_collect(engine, prompt, 12), 60)) == expected
        engine.check_integrity()
        _wait_for_no_blocks(engine)
    finally:
        engine.shutdown()


def test_only_the_loop_steps_its_engine_until_the_loop_ends(tiny_model):
    """Two threads stepping one engine corrupt it (a sequence scheduled by one is unknown to
    the other). While an AsyncLLMEngine drives an engine, stepping, adding or aborting from
    another thread, and a second AsyncLLMEngine, are refused with the reason; the loop's own
    requests are untouched; once it is shut down the engine is free again."""
    llm = _llm(tiny_model)
    prompt = list(range(3, 40))
    expected = llm.generate([prompt], _greedy(12))[0].outputs[0].token_ids
    engine = AsyncLLMEngine(llm.engine)
    try:
        async def main():
            stream = engine.generate(prompt, _greedy(12), request_id="served")
            first = await anext(stream)
            with pytest.raises(RuntimeError, match="driven by thread 'pagedserve-engine'"):
                await asyncio.to_thread(llm.generate, [prompt], _greedy(4))
            with pytest.raises(RuntimeError, match="aborting a request .* driven by"):
                llm.engine.abort_request("served")
            with pytest.raises(RuntimeError, match="a step .* driven by"):
                llm.engine.step()
            with pytest.raises(RuntimeError, match="already driven by thread 'pagedserve-engine'"):
                AsyncLLMEngine(llm.engine)
            tokens = list(first.outputs[0].token_ids)
            async for output in stream:
                tokens = list(output.outputs[0].token_ids)
            return tokens

        assert asyncio.run(asyncio.wait_for(main(), 60)) == expected
        _wait_for_no_blocks(engine)
        assert engine.stats()["num_running"] == 0   # the refused generate queued nothing
    finally:
        engine.shutdown()
    assert llm.generate([prompt], _greedy(12))[0].outputs[0].token_ids == expected
    llm.check_integrity()
    assert llm.engine.num_used_blocks() == 0


def test_the_callers_event_loop_never_waits_for_a_step(tiny_model):
    """While the engine thread is inside a step, a new request is accepted, an abort and a
    stats call are posted, and the event loop keeps running: none of them waits for the step.

    (A worker actor serves every stream from one event loop; when adding a request waited
    for the running step, a burst of requests delayed every stream's first token.)
    """
    llm = _llm(tiny_model)
    expected = llm.generate([list(range(3, 20))], _greedy(6))[0].outputs[0].token_ids  # before the thread
    engine = AsyncLLMEngine(llm.engine)
    in_step, release = threading.Event(), threading.Event()
    step = llm.engine.step_tokens

    def gated_step():
        if not release.is_set():
            in_step.set()
            release.wait(timeout=20)  # never forever, even if the caller's loop is blocked
        return step()

    llm.engine.step_tokens = gated_step

    async def main():
        first = asyncio.create_task(_collect(engine, list(range(3, 20)), 6))
        await asyncio.to_thread(in_step.wait, 20)
        stream = engine.generate(list(range(3, 20)), _greedy(6), request_id="second")
        second = asyncio.create_task(anext(stream))
        doomed = engine.generate(list(range(5, 30)), _greedy(50), request_id="doomed")
        doomed_first = asyncio.create_task(anext(doomed))
        await asyncio.sleep(0.05)  # both generators run up to waiting for their first output
        assert engine.abort("doomed") is True
        stats = asyncio.wrap_future(engine.submit(type(llm.engine).stats))
        await asyncio.sleep(0.05)
        was_step_running = not release.is_set()
        is_stats_pending = not stats.done()
        release.set()
        assert (await first) == expected
        second_tokens = (await second).outputs[0].token_ids
        async for output in stream:
            second_tokens = output.outputs[0].token_ids
        aborted = await doomed_first
        assert (await stats)["num_steps"] >= 0
        return was_step_running, is_stats_pending, second_tokens, aborted

    try:
        was_step_running, is_stats_pending, second_tokens, aborted = asyncio.run(asyncio.wait_for(main(), 60))
        assert was_step_running, "the event loop waited for the engine's step"
        assert is_stats_pending  # answered between steps, not during one
        assert second_tokens == expected
        assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
        _wait_for_no_blocks(engine)
        engine.check_integrity()
    finally:
        release.set()
        engine.shutdown()


def test_a_bad_request_raises_at_once_and_a_shut_down_engine_ends_every_stream(tiny_model):
    llm = _llm(tiny_model)
    engine = AsyncLLMEngine(llm.engine)

    async def main():
        with pytest.raises(ValueError, match="empty"):
            await anext(engine.generate([], _greedy(4)))
        with pytest.raises(ValueError, match="token ids"):
            await anext(engine.generate([10**9], _greedy(4)))
        stream = engine.generate(list(range(3, 20)), _greedy(500), request_id="long")
        await anext(stream)
        with pytest.raises(ValueError, match="already in use"):
            await anext(engine.generate(list(range(3, 9)), _greedy(4), request_id="long"))
        await asyncio.to_thread(engine.shutdown)
        with pytest.raises(EngineDeadError) as ended:
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError) as refused:
            await anext(engine.generate(list(range(3, 9)), _greedy(4)))
        # Both name this engine loop, so a handle counts them as one failed engine.
        assert ended.value.engine_id == refused.value.engine_id == engine.engine_id is not None

    asyncio.run(asyncio.wait_for(main(), 60))
    assert engine.stats()["num_running"] <= 1  # answered on the caller's thread once the loop has ended


def test_a_caller_that_falls_behind_gets_every_output_made_since_in_one_batch(tiny_model):
    """``generate_batches`` hands over everything queued for the request: a caller that
    pauses for many steps gets them as one list (the worker sends such a list as one
    message), and the outputs are the ones ``generate`` yields one by one."""
    llm = _llm(tiny_model)
    prompt = list(range(3, 20))
    expected = llm.generate([prompt], _greedy(40))[0].outputs[0].token_ids
    engine = AsyncLLMEngine(llm.engine)

    async def main():
        sizes, tokens = [], []
        async for batch in engine.generate_batches(prompt, _greedy(40)):
            sizes.append(len(batch))
            tokens.extend(t for output in batch for t in output.outputs[0].delta_token_ids)
            if len(sizes) == 2:
                await asyncio.sleep(0.5)  # the engine steps on meanwhile
        return sizes, tokens, batch[-1]

    try:
        sizes, tokens, last = asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        engine.shutdown()
    assert tokens == expected == last.outputs[0].token_ids and last.finished
    assert max(sizes) > 5 and sum(sizes) >= 40, sizes
