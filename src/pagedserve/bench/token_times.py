"""When the engine's output processor saw each sequence's new tokens: the inter-token latency
the engine itself gives a workload, before any serving (the floor a served run's ITL is
compared with). A timestamp per sequence per step, taken as the step's tokens are processed."""

from __future__ import annotations

import time
from collections import defaultdict

from .report import summarize


class TokenTimes:
    """Each sequence's token times (``perf_counter`` seconds), by sequence id."""

    def __init__(self) -> None:
        self.times: defaultdict[str, list[float]] = defaultdict(list)

    def gaps_ms(self) -> list[float]:
        """Every gap between two consecutive token times of one sequence, pooled (ms)."""
        return [1e3 * (later - earlier) for times in self.times.values()
                for earlier, later in zip(times, times[1:])]

    def summary(self) -> dict[str, float]:
        """``summarize`` of ``gaps_ms``: mean, std, p50, p90, p99."""
        return summarize(self.gaps_ms())


def record_token_times(engine) -> TokenTimes:
    """Record, from now on, when ``engine``'s output processor takes each step's tokens."""
    recorded = TokenTimes()
    times = recorded.times
    processor = engine.output_processor
    process = processor.process

    def recording(step, *args, **kwargs):
        now = time.perf_counter()
        for tokens in step.tokens:
            for seq in tokens.seqs:
                times[seq.seq_id].append(now)
        return process(step, *args, **kwargs)

    processor.process = recording
    return recorded


__all__ = ["TokenTimes", "record_token_times"]
