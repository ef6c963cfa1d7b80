"""Prompt lookup (n-gram) proposals: the longest suffix of a request's tokens found earlier in
them, and what followed it there. No model, no KV."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    """Proposes what followed the longest suffix of the sequence (``prompt_lookup_max`` tokens
    down to ``prompt_lookup_min``) where it last occurred earlier in the sequence.

    Among matches of the longest length the most recent wins. Its continuation is read on past
    the sequence's end into the proposal itself, so a loop of period p shorter than k is
    proposed k tokens deep (as the loop would go on), not cut at p.
    """

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min ({prompt_lookup_min}) <= "
                             f"prompt_lookup_max ({prompt_lookup_max})")
        self.num_speculative_tokens = num_speculative_tokens
        self.prompt_lookup_min = prompt_lookup_min
        self.prompt_lookup_max = prompt_lookup_max

    def propose(self, token_ids: Sequence[int], num_prompt_tokens: int = 0, max_num_tokens: int | None = None
                ) -> list[int]:
        k = self.num_speculative_tokens if max_num_tokens is None else min(self.num_speculative_tokens,
                                                                             max_num_tokens)
        num_tokens = len(token_ids)
        shortest = self.prompt_lookup_min
        if k <= 0 or num_tokens <= shortest:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        # Ends of earlier occurrences of the shortest suffix (a match ends before the last token).
        windows = sliding_window_view(tokens[:num_tokens - 1], shortest)
        ends = np.flatnonzero((windows == tokens[num_tokens - shortest:]).all(axis=1)) + shortest
        if not ends.size:
            return []
        # Lengthen each match backwards, up to prompt_lookup_max.
        lengths = np.full(ends.shape, shortest)
        alive = np.ones(ends.shape, dtype=bool)
        for extra in range(1, min(self.prompt_lookup_max, num_tokens - 1) - shortest + 1):
            before = ends - shortest - extra
            alive &= (before >= 0) & (tokens[np.maximum(before, 0)] == tokens[num_tokens - shortest - extra])
            if not alive.any():
                break
            lengths += alive
        best = np.flatnonzero(lengths == lengths.max())[-1]
        start = int(ends[best])
        proposal = list(token_ids[start:start + k])
        for j in range(len(proposal), k):  # past the end: the proposal goes on repeating
            proposal.append(proposal[start + j - num_tokens])
        return proposal
