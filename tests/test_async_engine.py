"""The streaming engine outlives its callers: a caller whose event loop closes mid-stream
loses its request (aborted, blocks freed), and the engine keeps serving everyone else."""

from __future__ import annotations

import asyncio
import time

from pagedserve import LLM, SamplingParams
from pagedserve.workers.async_engine import AsyncLLMEngine


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


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
    llm = LLM(model=tiny_model("llama"), device="cpu", dtype="float32", block_size=8,
              num_device_blocks=64, swap_space_gb=0.001)
    engine = AsyncLLMEngine(llm.engine)
    prompt = list(range(3, 40))
    try:
        expected = llm.generate([prompt], _greedy(12))[0].outputs[0].token_ids
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
