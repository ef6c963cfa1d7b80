"""Batched token sampling: one row of logits per sequence, each with its own params.

Order of operations (as vLLM): constraints (a grammar's token bitmask, tokens
banned by ``min_tokens``) -> penalties -> greedy argmax (greedy rows) ->
temperature -> top-k -> top-p -> min-p -> sample. Logprobs are computed from the
raw model logits (vLLM's default "raw_logprobs"), before constraints, penalties
or temperature.

Sampling is inverse-CDF with one uniform draw per row. For a seeded sequence the
draw is a hash of (seed, sample_index, number of output tokens so far), so it
depends only on the sequence itself: batch composition, preemption with recompute
and migration to another worker (even another device type) all reproduce the same
draws. Unseeded rows draw from the sampler's own generator, seeded with the
sampler's seed (a fresh random one unless given), never from torch's default RNG,
whose fixed start would give every process the same stream.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain

import torch

from .sampling_params import SamplingParams


@dataclass
class SamplingState:
    """What the sampler needs to know about one sequence at one step.

    ``prompt_token_ids`` and ``output_token_ids`` are read, never modified; the
    caller appends the sampled token. ``sample_index`` tells siblings of an n > 1
    request apart so that their seeded streams differ. ``token_bitmask`` (int32
    words, bit t of word t // 32 set: token t allowed) restricts the row to the
    tokens its grammar allows; ``banned_token_ids`` cannot be sampled (EOS and
    stop tokens before ``min_tokens``) unless the bitmask allows nothing else.
    """

    params: SamplingParams
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()
    sample_index: int = 0
    token_bitmask: torch.Tensor | None = None
    banned_token_ids: Sequence[int] = ()


@dataclass
class SampleLogprobs:
    """Logprob of the sampled token and the ``top`` most likely alternatives."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class SamplerOutput:
    """One sampled token per row; ``logprobs[i]`` is None unless row i asked for them."""

    token_ids: list[int]
    logprobs: list[SampleLogprobs | None]


class Sampler:
    """Samples the next token for a batch of sequences; works on any torch device.

    ``seed`` seeds the generator used for rows whose params carry no seed: an
    explicit seed reproduces the same stream, ``seed=None`` draws a fresh one
    from the OS (kept in ``self.seed``). The sampler keeps no per-sequence state.
    """

    def __init__(self, seed: int | None = None) -> None:
        self.seed = fresh_seed() if seed is None else seed
        self._generator = torch.Generator().manual_seed(self.seed)

    def sample(self, logits: torch.Tensor, states: Sequence[SamplingState]) -> SamplerOutput:
        """Return one token id per row of ``logits`` ([num_seqs, vocab_size])."""
        _check_inputs(logits, states)
        if logits.shape[0] == 0:
            return SamplerOutput([], [])
        params = [state.params for state in states]
        constrained = apply_constraints(logits, states)
        if all(p.is_greedy and not p.has_penalties for p in params):
            token_ids = constrained.argmax(dim=-1)
        else:
            token_ids = self._sample_general(constrained.float(), states)
        logprobs = compute_logprobs(logits, token_ids, [p.logprobs for p in params])
        return SamplerOutput(token_ids.tolist(), logprobs)

    def _sample_general(
        self, logits: torch.Tensor, states: Sequence[SamplingState]
    ) -> torch.Tensor:
        logits = apply_penalties_to_states(logits, states)
        greedy_rows = [i for i, state in enumerate(states) if state.params.is_greedy]
        if len(greedy_rows) == len(states):
            return logits.argmax(dim=-1)
        token_ids = torch.empty(len(states), dtype=torch.long, device=logits.device)
        if greedy_rows:
            token_ids[greedy_rows] = logits[greedy_rows].argmax(dim=-1)
        random_rows = [i for i, state in enumerate(states) if not state.params.is_greedy]
        random_states = [states[i] for i in random_rows]
        if greedy_rows:
            logits = logits[random_rows]
        processed = process_logits(logits, [s.params for s in random_states])
        probs = argmax_where_not_finite(processed.softmax(dim=-1), logits)
        sampled = sample_from_probs(probs, self._uniforms(random_states))
        if not greedy_rows:
            return sampled
        token_ids[random_rows] = sampled
        return token_ids

    def _uniforms(self, states: Sequence[SamplingState]) -> torch.Tensor:
        uniforms = torch.rand(len(states), dtype=torch.float64, generator=self._generator)
        for row, state in enumerate(states):
            if state.params.seed is not None:
                uniforms[row] = seeded_uniform(
                    state.params.seed, state.sample_index, len(state.output_token_ids)
                )
        return uniforms


def apply_constraints(logits: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
    """Logits with each row's disallowed tokens at -inf (``logits`` itself if no row is
    constrained; the input is never modified).

    A row's bitmask wins over its banned tokens: a ban that would leave the row
    nothing to sample is dropped for that row.
    """
    mask_rows = [i for i, state in enumerate(states) if state.token_bitmask is not None]
    ban_rows = [i for i, state in enumerate(states) if state.banned_token_ids]
    if not mask_rows and not ban_rows:
        return logits
    logits = logits.clone()
    if mask_rows:
        words = torch.stack([states[i].token_bitmask for i in mask_rows])
        logits[mask_rows] = apply_token_bitmask(logits[mask_rows], words)
    if ban_rows:
        banned = logits[ban_rows]
        columns = [list(states[i].banned_token_ids) for i in ban_rows]
        rows = [j for j, ids in enumerate(columns) for _ in ids]
        flat = [t for ids in columns for t in ids]
        banned[rows, flat] = float("-inf")
        keeps_some = torch.isfinite(banned).any(dim=-1)
        logits[ban_rows] = torch.where(keeps_some.unsqueeze(1), banned, logits[ban_rows])
    return logits


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """``logits`` ([rows, vocab]) with tokens whose bit is clear in ``bitmask``
    ([rows, ceil(vocab / 32)] int32, bit t % 32 of word t // 32) set to -inf.

    Works on any device; the bitmask moves to the logits' device.
    """
    num_rows, vocab_size = logits.shape
    if bitmask.shape[0] != num_rows or bitmask.shape[1] * 32 < vocab_size:
        raise ValueError(f"bitmask of shape {tuple(bitmask.shape)} for logits of shape "
                         f"{tuple(logits.shape)}")
    words = bitmask.to(device=logits.device, dtype=torch.int32, non_blocking=True)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    is_allowed = ((words.unsqueeze(-1) >> shifts) & 1).bool().view(num_rows, -1)[:, :vocab_size]
    return logits.masked_fill(~is_allowed, float("-inf"))


def fresh_seed() -> int:
    """A random seed from the OS, for a sampler whose user gave none."""
    return secrets.randbits(63)


def seeded_uniform(seed: int, sample_index: int, step: int) -> float:
    """A uniform draw in [0, 1) that depends only on (seed, sample_index, step)."""
    digest = hashlib.blake2b(f"{seed}/{sample_index}/{step}".encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> 11) / float(1 << 53)


def argmax_where_not_finite(probs: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Rows whose distribution is not finite (overflowing penalties or logits) become
    a one-hot at the argmax of ``logits``, so a bad row never yields an invalid token."""
    is_bad = ~torch.isfinite(probs).all(dim=-1)
    if not bool(is_bad.any()):
        return probs
    probs = probs.clone()
    bad_rows = is_bad.nonzero().squeeze(1)
    fallback = torch.nan_to_num(logits[bad_rows].float(), nan=float("-inf")).argmax(dim=-1)
    probs[bad_rows] = 0.0
    probs[bad_rows, fallback] = 1.0
    return probs


def sample_from_probs(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: row i takes the token where its CDF crosses ``uniforms[i]``.

    One uniform per row (so seeding is cheap and device independent); tokens with
    zero probability are never chosen.
    """
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)
    total = cdf[:, -1:]
    targets = uniforms.to(device=cdf.device, dtype=cdf.dtype).unsqueeze(1) * total
    # Rounding could put the target at the very top; keep it strictly below.
    targets = torch.minimum(targets, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, targets, right=True).squeeze(1)


def process_logits(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p masks (to -inf), one row per params.

    ``logits`` should already carry penalties. Greedy rows are left at
    temperature 1; their distribution is the argmax (see ``processed_probs``).
    """
    logits = logits.float()
    device = logits.device
    vocab_size = logits.shape[-1]
    temperatures = [1.0 if p.is_greedy else p.temperature for p in params]
    if any(t != 1.0 for t in temperatures):
        logits = logits / torch.tensor(temperatures, device=device).unsqueeze(1)
    top_ks = [p.top_k for p in params]
    top_ps = [p.top_p for p in params]
    if any(0 < k < vocab_size for k in top_ks) or any(p < 1.0 for p in top_ps):
        logits = apply_top_k_top_p(logits, top_ks, top_ps)
    min_ps = [p.min_p for p in params]
    if any(m > 0.0 for m in min_ps):
        logits = apply_min_p(logits, torch.tensor(min_ps, device=device))
    return logits


def processed_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The exact distribution each row samples from (greedy rows: one-hot at argmax)."""
    logits = process_logits(logits, params)
    probs = logits.softmax(dim=-1)
    is_greedy = torch.tensor([p.is_greedy for p in params], device=logits.device)
    if bool(is_greedy.any()):
        one_hot = torch.zeros_like(probs).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
        probs = torch.where(is_greedy.unsqueeze(1), one_hot, probs)
    return probs


# Candidates looked at first when searching a row's top-p cut-off.
NUM_TOP_P_CANDIDATES = 64


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: Sequence[int], top_p: Sequence[float]
) -> torch.Tensor:
    """Mask (to -inf) logits below each row's top-k and top-p cut-offs.

    Top-k keeps logits >= the k-th largest; then top-p keeps the most likely of
    those, in order, until their renormalised probability reaches p. Both cut-offs
    are values, so tokens tied with the last kept one are kept too (as vLLM), and
    the result does not depend on how a sort orders ties. ``top_k`` <= 0 or >=
    vocab size and ``top_p`` >= 1 disable the filters for that row. Uses
    ``topk`` on as few candidates as possible rather than a full sort.
    """
    num_rows, vocab_size = logits.shape
    device = logits.device
    ks = [k if 0 < k < vocab_size else vocab_size for k in top_k]
    if any(k < vocab_size for k in ks):
        values = logits.topk(max(k for k in ks if k < vocab_size), dim=-1).values
        kth_index = [min(k, values.shape[1]) - 1 for k in ks]
        kth = values.gather(1, torch.tensor(kth_index, device=device).unsqueeze(1))
        is_disabled = torch.tensor([k >= vocab_size for k in ks], device=device).unsqueeze(1)
        kth = kth.masked_fill(is_disabled, float("-inf"))
        logits = logits.masked_fill(logits < kth, float("-inf"))
    p_rows = [i for i, p in enumerate(top_p) if p < 1.0]
    if len(p_rows) == num_rows:
        thresholds = _top_p_thresholds(logits, torch.tensor(top_p, device=device))
        logits = logits.masked_fill(logits < thresholds, float("-inf"))
    elif p_rows:
        thresholds = torch.full((num_rows, 1), float("-inf"), device=device)
        thresholds[p_rows] = _top_p_thresholds(
            logits[p_rows], torch.tensor([top_p[i] for i in p_rows], device=device)
        )
        logits = logits.masked_fill(logits < thresholds, float("-inf"))
    return logits


def _top_p_thresholds(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Per row, the smallest logit of the top-p nucleus ([num_rows, 1])."""
    num_rows, vocab_size = logits.shape
    probs = logits.softmax(dim=-1)
    thresholds = torch.full((num_rows, 1), float("-inf"), device=logits.device)
    pending = torch.arange(num_rows, device=logits.device)
    num_candidates = min(NUM_TOP_P_CANDIDATES, vocab_size)
    while len(pending):
        candidates, candidate_ids = probs[pending].topk(num_candidates, dim=-1)
        values = logits[pending].gather(1, candidate_ids)
        mass = candidates.cumsum(dim=-1, dtype=torch.float64)
        is_reached = mass >= top_p[pending].unsqueeze(1)
        has_reached = is_reached.any(dim=-1)
        first = is_reached.int().argmax(dim=-1, keepdim=True)
        thresholds[pending[has_reached]] = values.gather(1, first)[has_reached]
        # Rows whose candidates already include every finite logit keep them all
        # (their mass fell short of p only by rounding).
        is_exhausted = values[:, -1] == float("-inf")
        if num_candidates == vocab_size:
            break
        pending = pending[~has_reached & ~is_exhausted]
        num_candidates = min(num_candidates * 8, vocab_size)
    return thresholds


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below ``min_p`` times the row's top probability.

    Done in logit space: p < min_p * p_max  <=>  logit < max_logit + log(min_p).
    """
    threshold = logits.amax(dim=-1, keepdim=True) + min_p.to(logits.dtype).log().unsqueeze(1)
    return logits.masked_fill(logits < threshold, float("-inf"))


def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
    repetition_penalties: torch.Tensor,
    frequency_penalties: torch.Tensor,
    presence_penalties: torch.Tensor,
) -> torch.Tensor:
    """Return penalised logits ([num_rows, vocab]); the input is not modified.

    Repetition penalty (HF/vLLM), applied first: tokens seen in prompt or output
    get positive logits divided and negative logits multiplied by it. Then
    frequency and presence penalties (OpenAI/vLLM) subtract
    ``count * frequency + presence`` from tokens seen in the output. Work is
    proportional to the number of token ids, not to the vocab size.
    """
    vocab_size = logits.shape[-1]
    device = logits.device
    logits = logits.clone()
    flat_logits = logits.view(-1)
    output_index = _flat_token_index(output_token_ids, vocab_size)
    if bool((repetition_penalties != 1.0).any()):
        prompt_index = _flat_token_index(prompt_token_ids, vocab_size)
        seen = torch.unique(torch.cat([prompt_index, output_index])).to(device)
        values = flat_logits[seen]
        penalty = repetition_penalties.to(device=device, dtype=logits.dtype)[seen // vocab_size]
        flat_logits[seen] = torch.where(values > 0, values / penalty, values * penalty)
    if len(output_index):
        seen, counts = torch.unique(output_index, return_counts=True)
        seen, counts = seen.to(device), counts.to(device=device, dtype=logits.dtype)
        rows = seen // vocab_size
        frequency = frequency_penalties.to(device=device, dtype=logits.dtype)[rows]
        presence = presence_penalties.to(device=device, dtype=logits.dtype)[rows]
        flat_logits[seen] = flat_logits[seen] - (frequency * counts + presence)
    return logits


def apply_penalties_to_states(
    logits: torch.Tensor, states: Sequence[SamplingState]
) -> torch.Tensor:
    """Penalise the rows whose params ask for it; other rows are returned untouched."""
    rows = [i for i, state in enumerate(states) if state.params.has_penalties]
    if not rows:
        return logits
    device = logits.device
    penalised = [states[i] for i in rows]
    needs_prompt = [s.params.repetition_penalty != 1.0 for s in penalised]
    logits = logits.clone()
    logits[rows] = apply_penalties(
        logits[rows],
        [s.prompt_token_ids if need else () for s, need in zip(penalised, needs_prompt)],
        [s.output_token_ids for s in penalised],
        torch.tensor([s.params.repetition_penalty for s in penalised], device=device),
        torch.tensor([s.params.frequency_penalty for s in penalised], device=device),
        torch.tensor([s.params.presence_penalty for s in penalised], device=device),
    )
    return logits


def compute_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_logprobs: Sequence[int | None]
) -> list[SampleLogprobs | None]:
    """Raw-logit logprobs of the sampled tokens plus each row's top alternatives."""
    result: list[SampleLogprobs | None] = [None] * len(num_logprobs)
    rows = [i for i, k in enumerate(num_logprobs) if k is not None]
    if not rows:
        return result
    logprobs = logits[rows].float().log_softmax(dim=-1)
    sampled = logprobs.gather(1, token_ids[rows].unsqueeze(1)).squeeze(1).tolist()
    max_k = max(num_logprobs[i] for i in rows)
    top_values: list[list[float]] = [[] for _ in rows]
    top_ids: list[list[int]] = [[] for _ in rows]
    if max_k > 0:
        values, ids = logprobs.topk(min(max_k, logprobs.shape[-1]), dim=-1)
        top_values, top_ids = values.tolist(), ids.tolist()
    sampled_ids = token_ids[rows].tolist()
    for j, row in enumerate(rows):
        k = num_logprobs[row]
        top = list(zip(top_ids[j][:k], top_values[j][:k]))
        result[row] = SampleLogprobs(sampled_ids[j], sampled[j], top)
    return result


def _flat_token_index(token_ids: Sequence[Sequence[int]], vocab_size: int) -> torch.Tensor:
    """Positions ``row * vocab_size + token_id`` of every listed token (CPU, int64)."""
    lengths = torch.tensor([len(ids) for ids in token_ids], dtype=torch.long)
    flat_ids = torch.tensor(list(chain.from_iterable(token_ids)), dtype=torch.long)
    if len(flat_ids) and (int(flat_ids.min()) < 0 or int(flat_ids.max()) >= vocab_size):
        raise ValueError(f"token id out of range for vocab size {vocab_size}")
    rows = torch.repeat_interleave(torch.arange(len(token_ids)), lengths)
    return rows * vocab_size + flat_ids


def _check_inputs(logits: torch.Tensor, states: Sequence[SamplingState]) -> None:
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        raise ValueError("logits must be a 2-D tensor [num_seqs, vocab_size]")
    if not logits.is_floating_point():
        raise ValueError(f"logits must be floating point, got {logits.dtype}")
    if logits.shape[0] != len(states):
        raise ValueError(f"got {logits.shape[0]} rows of logits for {len(states)} sampling states")
