"""Drive an ``LLMEngine`` step by step through a workload, sampling it after every step.

The driver owns the clock: a request is added when its arrival offset has
passed (or, with ``max_concurrency``, when a slot frees up), and after each
``step()`` the engine's KV statistics are sampled. Per-request latencies
come from the engine's own request metrics.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pagedserve.workers.engine.engine import EngineConfig, LLMEngine
from pagedserve.workers.sample.sampling_params import SamplingParams

from .workload import BenchRequest, random_token_ids


@dataclass
class RequestRecord:
    """One finished request; times in seconds, ``arrival_s`` from the start of the run."""

    request_id: str
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    num_preemptions: int
    arrival_s: float
    ttft_s: float
    e2e_s: float
    is_error: bool = False


@dataclass
class StepSample:
    """The engine's state right after one step that ran a forward pass."""

    t_s: float                  # end of the step, from the start of the run
    duration_s: float
    kv_utilization: float       # tokens stored / token slots allocated
    block_usage: float          # device blocks in use / device blocks
    num_running: int
    num_waiting: int


@dataclass
class ReplayResult:
    records: list[RequestRecord]
    samples: list[StepSample]
    duration_s: float
    num_preemptions: int
    prefix_hit_rate: float      # over this run only
    stats: dict = field(default_factory=dict)

    @property
    def num_output_tokens(self) -> int:
        return sum(r.num_output_tokens for r in self.records if not r.is_error)

    @property
    def num_errors(self) -> int:
        return sum(r.is_error for r in self.records)

    @property
    def throughput_tok_s(self) -> float:
        """Output tokens per second of wall time, first arrival to last finish."""
        return self.num_output_tokens / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def mean_kv_utilization(self) -> float:
        """Time-averaged utilisation, each step weighted by its duration."""
        total = sum(s.duration_s for s in self.samples)
        if total <= 0:
            return math.nan
        return sum(s.kv_utilization * s.duration_s for s in self.samples) / total

    @property
    def max_concurrent(self) -> int:
        return max((s.num_running for s in self.samples), default=0)


def resolve_model(model: str | None, arch: str = "llama", size: str = "tiny") -> str:
    """``model`` if given, else the path of the built random-weight ``arch``/``size`` model."""
    if model:
        return model
    from pagedserve.devtools.model_factory import ensure_model

    return str(ensure_model(arch, size))


def model_vocab_size(model: str) -> int:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model).vocab_size


def build_engine(model: str, *, allocation: str = "paged", enable_prefix_caching: bool = False,
                 num_device_blocks: int, block_size: int = 16, max_model_len: int,
                 swap_space_gb: float = 0.1, **engine_options) -> LLMEngine:
    """An engine with an explicit KV budget, on CPU unless ``device`` says otherwise."""
    config = EngineConfig(model=model, allocation=allocation, enable_prefix_caching=enable_prefix_caching,
                          num_device_blocks=num_device_blocks, block_size=block_size,
                          max_model_len=max_model_len, swap_space_gb=swap_space_gb, **engine_options)
    return LLMEngine(config)


def warm_up(engine: LLMEngine, num_prompt_tokens: int = 32, max_tokens: int = 4) -> None:
    """Run one short request so first-call costs stay out of the measurement."""
    import random

    prompt = random_token_ids(random.Random(12345), num_prompt_tokens, engine.runner.vocab_size)
    engine.add_request("bench-warmup", None, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                            ignore_eos=True),
                       prompt_token_ids=prompt)
    while engine.has_unfinished_requests() or engine.has_pending_outputs():
        engine.step()


def _num_preemptions(stats: dict) -> int:
    return sum(stats.get("num_preemptions_by_mode", {}).values())


def replay(engine: LLMEngine, requests: Sequence[BenchRequest], *,
           max_concurrency: int | None = None,
           on_finish: Callable[[RequestRecord], None] | None = None,
           id_prefix: str = "bench") -> ReplayResult:
    """Serve ``requests`` (greedy, ``ignore_eos``, exactly ``max_tokens`` each) and measure.

    Without ``max_concurrency`` each request arrives at its ``arrival_s``
    (open loop) and its latency counts from then, queueing included. With it,
    at most that many are in the engine at once (closed loop) and latency
    counts from admission to the engine, as a client would see it.
    """
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
    before = engine.stats()
    pending = deque(sorted(enumerate(requests), key=lambda item: item[1].arrival_s))
    records: list[RequestRecord] = []
    samples: list[StepSample] = []
    start = time.time()
    in_flight = 0
    def is_busy() -> bool:
        return engine.has_unfinished_requests() or engine.has_pending_outputs()

    while pending or is_busy():
        now = time.time()
        while pending and (max_concurrency is None or in_flight < max_concurrency):
            index, request = pending[0]
            arrival = start + request.arrival_s if max_concurrency is None else now
            if arrival > now:
                break
            pending.popleft()
            params = SamplingParams(max_tokens=request.max_tokens, temperature=0.0, ignore_eos=True)
            engine.add_request(f"{id_prefix}-{index}", None, params,
                               prompt_token_ids=list(request.prompt_token_ids), arrival_time=arrival)
            in_flight += 1
        if not is_busy():
            # Idle until the next arrival.
            time.sleep(max(0.0, start + pending[0][1].arrival_s - time.time()))
            continue
        step_start = time.time()
        outputs = engine.step()
        step_end = time.time()
        stats = engine.stats()
        if stats.get("device_blocks_used", 0):
            samples.append(StepSample(
                t_s=step_end - start, duration_s=step_end - step_start,
                kv_utilization=stats["kv_utilization"],
                block_usage=stats["device_blocks_used"] / stats["num_device_blocks"],
                num_running=stats["num_running"], num_waiting=stats["num_waiting"]))
        for output in outputs:
            if not output.finished:
                continue
            in_flight -= 1
            m = output.metrics
            is_error = any(c.finish_reason not in ("length", "stop") for c in output.outputs)
            record = RequestRecord(
                request_id=output.request_id, num_prompt_tokens=m.num_prompt_tokens,
                num_output_tokens=m.num_generated_tokens, num_cached_tokens=m.num_cached_tokens,
                num_preemptions=m.num_preemptions, arrival_s=m.arrival_time - start,
                ttft_s=m.time_to_first_token if m.time_to_first_token is not None else math.nan,
                e2e_s=m.e2e_latency, is_error=is_error)
            records.append(record)
            if on_finish is not None:
                on_finish(record)
    after = engine.stats()
    end = max((start + r.arrival_s + r.e2e_s for r in records), default=start)
    first_arrival = min((r.arrival_s for r in records), default=0.0)
    queries = after["num_prefix_query_tokens"] - before["num_prefix_query_tokens"]
    hits = after["num_prefix_hit_tokens"] - before["num_prefix_hit_tokens"]
    return ReplayResult(records=records, samples=samples,
                        duration_s=end - start - first_arrival,
                        num_preemptions=_num_preemptions(after) - _num_preemptions(before),
                        prefix_hit_rate=hits / queries if queries else 0.0, stats=after)
