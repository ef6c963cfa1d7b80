"""A proposer with a set acceptance, for benchmarks and tests of speculative decoding.

Acceptance is a property of trained models, and random-weight ones accept little. This proposer
knows each request's output from a run without speculation and proposes its next tokens with
the first ``num_right`` right and the rest wrong, so a greedy target accepts exactly
``num_right`` a step (fewer where the output ends): it draws the speedup curve against the mean
acceptance length.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence


class ScriptedProposer:
    """Proposes, for a prompt in ``outputs`` (prompt token ids -> its output without
    speculation), the output's next ``num_speculative_tokens`` tokens, the first ``num_right``
    of them right (all of them past the known output are wrong). ``num_right`` None: a number
    drawn uniformly from 0..k for each proposal (``seed``). Unknown prompts get no proposal."""

    def __init__(self, outputs: Mapping[tuple[int, ...], Sequence[int]], num_speculative_tokens: int,
                 num_right: int | None = None, vocab_size: int = 1 << 31, seed: int = 0) -> None:
        self.outputs = {tuple(prompt): list(output) for prompt, output in outputs.items()}
        self.num_speculative_tokens = num_speculative_tokens
        self.num_right = num_right
        self.vocab_size = vocab_size
        self._rng = random.Random(seed)

    def propose(self, token_ids: Sequence[int], num_prompt_tokens: int, max_num_tokens: int) -> list[int]:
        output = self.outputs.get(tuple(token_ids[:num_prompt_tokens]))
        if output is None:
            return []
        k = min(self.num_speculative_tokens, max_num_tokens)
        num_right = self._rng.randint(0, k) if self.num_right is None else min(self.num_right, k)
        done = len(token_ids) - num_prompt_tokens
        right = output[done:done + num_right]
        return right + [self._wrong(output, done + i) for i in range(len(right), k)]

    def _wrong(self, output: list[int], index: int) -> int:
        """A token other than the output's at ``index`` (any token past its end)."""
        token = output[index] if index < len(output) else 0
        return (token + 1) % self.vocab_size
