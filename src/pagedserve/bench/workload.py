"""Synthetic workloads: prompt token ids, output lengths and arrival times.

Prompts are random token ids, so no dataset or tokenizer is needed and the
lengths are exact. Ids start after the special tokens (0..4 in the models
``model_factory`` builds). Everything is seeded: the same arguments give the
same requests, so allocators and configurations compare on equal terms.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

FIRST_REGULAR_TOKEN_ID = 5
LENGTH_DISTRIBUTIONS = ("lognormal", "uniform", "fixed")


@dataclass(frozen=True)
class LengthDist:
    """Token lengths: ``lognormal`` with the given mean (clipped to [low, high]),
    ``uniform`` on [low, high], or ``fixed`` at ``mean``."""

    mean: float
    low: int = 1
    high: int = 1 << 30
    kind: str = "lognormal"
    sigma: float = 0.6

    def __post_init__(self) -> None:
        if self.kind not in LENGTH_DISTRIBUTIONS:
            raise ValueError(f"length distribution must be one of {LENGTH_DISTRIBUTIONS}, got {self.kind!r}")
        if not 1 <= self.low <= self.high:
            raise ValueError(f"need 1 <= low <= high, got low={self.low}, high={self.high}")
        if self.mean <= 0 or self.sigma < 0:
            raise ValueError(f"need mean > 0 and sigma >= 0, got mean={self.mean}, sigma={self.sigma}")

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            value = round(self.mean)
        elif self.kind == "uniform":
            value = rng.randint(self.low, self.high)
        else:
            # E[lognormal(mu, sigma)] = exp(mu + sigma^2 / 2) = mean.
            mu = math.log(self.mean) - self.sigma ** 2 / 2
            value = round(rng.lognormvariate(mu, self.sigma))
        return min(max(value, self.low), self.high)


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload; ``arrival_s`` is its offset from the start of the run."""

    prompt_token_ids: list[int]
    max_tokens: int
    arrival_s: float = 0.0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


def random_token_ids(rng: random.Random, num_tokens: int, vocab_size: int) -> list[int]:
    if vocab_size <= FIRST_REGULAR_TOKEN_ID:
        raise ValueError(f"vocab_size must exceed {FIRST_REGULAR_TOKEN_ID}, got {vocab_size}")
    return [rng.randrange(FIRST_REGULAR_TOKEN_ID, vocab_size) for _ in range(num_tokens)]


def poisson_arrivals(num_requests: int, request_rate: float, seed: int = 0) -> list[float]:
    """Arrival offsets (seconds) of a Poisson process at ``request_rate`` requests/s;
    all zero (one burst) for an infinite rate."""
    if request_rate <= 0:
        raise ValueError(f"request_rate must be > 0, got {request_rate}")
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = random.Random(seed)
    offsets, now = [], 0.0
    for _ in range(num_requests):
        now += rng.expovariate(request_rate)
        offsets.append(now)
    return offsets


def make_mixed_workload(num_requests: int, vocab_size: int, max_model_len: int, *,
                        prompt_len: LengthDist, output_len: LengthDist,
                        num_prefixes: int = 4, prefix_len: int = 128, shared_fraction: float = 0.75,
                        request_rate: float = math.inf, seed: int = 0) -> list[BenchRequest]:
    """Requests of mixed lengths; ``shared_fraction`` of them start with one of
    ``num_prefixes`` shared prefixes (system prompts) of ``prefix_len`` tokens.

    ``prompt_len`` is the length of the unique part. Prompt plus output never
    exceeds ``max_model_len`` (the prompt is cut first).
    """
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    if not 0 <= shared_fraction <= 1:
        raise ValueError(f"shared_fraction must be in [0, 1], got {shared_fraction}")
    if num_prefixes < 1 or prefix_len < 0:
        raise ValueError("need num_prefixes >= 1 and prefix_len >= 0")
    rng = random.Random(seed)
    prefixes = [random_token_ids(rng, prefix_len, vocab_size) for _ in range(num_prefixes)]
    arrivals = poisson_arrivals(num_requests, request_rate, seed)
    requests = []
    for arrival in arrivals:
        prefix = prefixes[rng.randrange(num_prefixes)] if rng.random() < shared_fraction else []
        num_output = min(output_len.sample(rng), max_model_len - 1)
        num_unique = max(1, min(prompt_len.sample(rng), max_model_len - num_output - len(prefix)))
        prompt = (prefix + random_token_ids(rng, num_unique, vocab_size))[:max_model_len - num_output]
        requests.append(BenchRequest(prompt, num_output, arrival))
    return requests


def make_shared_prefix_workload(num_requests: int, vocab_size: int, *, prefix_len: int = 1024,
                                suffix_len: int = 64, max_tokens: int = 8,
                                seed: int = 0) -> list[BenchRequest]:
    """One shared system prompt of ``prefix_len`` tokens, each request adding a unique
    ``suffix_len``-token suffix."""
    rng = random.Random(seed)
    prefix = random_token_ids(rng, prefix_len, vocab_size)
    return [BenchRequest(prefix + random_token_ids(rng, suffix_len, vocab_size), max_tokens)
            for _ in range(num_requests)]


def max_prefix_hit_rate(prompts: list[list[int]], block_size: int) -> float:
    """The prefix-cache hit rate an unbounded cache would reach serving ``prompts`` in order.

    Counted as the engine counts: hit tokens / prompt tokens, where a hit is a
    whole block whose chain of tokens appeared in an earlier prompt, and the
    last prompt token is always computed (it produces the first output's logits).
    """
    # A block's identity is (its parent's id, its tokens): the chain without re-hashing it.
    block_ids: dict[tuple[int, tuple[int, ...]], int] = {}
    num_hit = num_query = 0
    for prompt in prompts:
        num_query += len(prompt)
        num_hittable = (len(prompt) - 1) // block_size if prompt else 0
        parent, is_matching = -1, True
        for i in range(len(prompt) // block_size):
            key = (parent, tuple(prompt[i * block_size:(i + 1) * block_size]))
            if key in block_ids:
                if is_matching and i < num_hittable:
                    num_hit += block_size
            else:
                is_matching = False
                block_ids[key] = len(block_ids)
            parent = block_ids[key]
    return num_hit / num_query if num_query else 0.0
