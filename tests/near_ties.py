"""Where two correct float32 runs may part: at near-ties, and only there.

The same model under two batch shapes, two kernels or two CPUs gives logits that differ in
the last bits, so two correct runs agree token for token until a step where the choice sits
within that noise of flipping. Tests that compare runs find the first parting
(``common_prefix``) and demand a near-tie there: for greedy steps, a log-probability margin
(``greedy_margin``); for sampled steps, the draw's distance from the chosen token's interval
of the CDF (``draw_distance``).
"""

from __future__ import annotations

import torch

# A draw's CDF is a sum of float32 probabilities: two batch shapes of the tiny models move
# a token's log-probability by under 6e-6 (pagedserve's against transformers'), so a CDF
# edge moves by about that divided by the temperature. 1e-4 covers temperatures down to 0.1;
# a parting for any other reason lands this close to the draw about once in 10^4.
DRAW_NOISE = 1e-4


def common_prefix(a: list[int], b: list[int]) -> int:
    """The number of leading tokens ``a`` and ``b`` share."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def greedy_margin(logprobs: torch.Tensor, chosen: int, other: int) -> float:
    """How much more likely ``chosen`` is than ``other`` in one step's ``logprobs`` [vocab]:
    a greedy step parts from ``chosen`` for ``other`` only where this is within noise."""
    return (logprobs[chosen] - logprobs[other]).item()


def draw_distance(probs: torch.Tensor, uniform: float, token: int) -> float:
    """How far, in probability mass, the inverse-CDF draw at ``uniform`` lies from ``token``'s
    interval of the CDF of ``probs`` [vocab] (0 where the draw picks ``token``), as
    ``workers.sampler.sample_from_probs`` draws: token t where cdf[t-1] <= u * total < cdf[t]."""
    cdf = probs.to(torch.float64).cumsum(dim=-1)
    target = uniform * cdf[-1].item()
    low = cdf[token - 1].item() if token else 0.0
    return max(low - target, target - cdf[token].item(), 0.0)
