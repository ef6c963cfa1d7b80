"""Verification of proposed tokens against the target model's distributions.

A sequence with proposals d_1..d_j gets the target's logits at j + 1 positions (its last known
token's and each proposal's). Each position is sampled as decoding without speculation would
sample it, from its own distribution p_i (temperature, top-k/p, min-p, bans, its seeded draw
for output number m + i), giving t_0..t_j. The outputs are d_1..d_a, t_a, where a is the
length of the longest prefix with t_{i-1} = d_i.

This is the rejection sampler of the speculative-sampling papers (Leviathan et al. 2023; Chen
et al. 2023) for a point-mass proposal q = δ(d): accept d with probability min(1, p(d)/q(d)) =
p(d), else sample from normalise(max(0, p - q)), which is p without d. Sampling t ~ p and
accepting d iff t = d accepts with probability p(d), and on rejection t is distributed as p
conditioned on t != d: the same law. Greedy rows (t = argmax p) accept while the proposal is
the target's argmax, so greedy output is token-identical to decoding without speculation; a
seeded row draws the same uniform for output m + i either way, so it gives the same tokens too.
A row that asks for logprobs gets each output's from its own position's logits, as decoding
one token a step computes them (``compute_logprobs``: the raw logits' log-softmax).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..sample.sampler import Sampler, SampleLogprobs, SamplingBatch, compute_logprobs


def num_accepted(target_token_ids: Sequence[int], proposed: Sequence[int]) -> int:
    """How many proposals the target's tokens (one per position, ``len(proposed) + 1``) accept:
    the longest prefix of ``proposed`` equal to the target's tokens at the positions before."""
    for i, token_id in enumerate(proposed):
        if target_token_ids[i] != token_id:
            return i
    return len(proposed)


def verify(sampler: Sampler, logits: torch.Tensor, batch: SamplingBatch, proposals: Sequence[Sequence[int]]
           ) -> tuple[list[list[int]], list[int], list[list[SampleLogprobs | None]] | None]:
    """Sample every position and accept: ``logits`` and ``batch`` hold ``len(p) + 1``
    consecutive rows for each proposal ``p`` in ``proposals`` (its sequence's positions, in
    order). Returns each sequence's outputs (its accepted proposals, then the target's token),
    its number of accepted proposals, and each output's logprobs (None for a row that asked
    for none; None throughout when no row asked, ``batch.num_logprobs``)."""
    token_tensor = sampler.sample_tokens(logits, batch)
    token_ids = token_tensor.tolist()
    logprobs = (compute_logprobs(logits, token_tensor, batch.num_logprobs, len(token_ids))
                if batch.num_logprobs else None)
    outputs, accepted, output_logprobs = [], [], []
    position = 0
    for proposed in proposals:
        sampled = token_ids[position:position + len(proposed) + 1]
        num = num_accepted(sampled, proposed)
        outputs.append(sampled[:num + 1])
        accepted.append(num)
        if logprobs is not None:
            output_logprobs.append(logprobs[position:position + num + 1])
        position += len(proposed) + 1
    return outputs, accepted, output_logprobs if logprobs is not None else None
