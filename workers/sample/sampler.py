"""Batched token sampling: one row of logits per sequence, each with its own params.

Order of operations (as vLLM): ``allowed_token_ids`` and ``logit_bias`` ->
constraints (a grammar's token bitmask, tokens banned by ``min_tokens`` or bad words) ->
penalties -> greedy argmax (greedy rows) ->
temperature -> top-k -> top-p -> min-p -> sample. Logprobs are computed from the
raw model logits (vLLM's default "raw_logprobs"), before constraints, penalties
or temperature. Rows without per-row features (penalties, seeds, constraints,
logprobs) sample without the host ever waiting for the device
(``Sampler.sample_tokens``), so an overlapped engine keeps the device busy.

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

from ..model.host_lists import int64_tensor, to_device
from ..outputs.request_output import SampleLogprobs
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
class SamplerOutput:
    """One sampled token per row; ``logprobs[i]`` is None unless row i asked for them.

    ``token_tensor`` holds the same ids on the logits' device (int64), for a
    caller that keeps them there (the next step's inputs).
    """

    token_ids: list[int]
    logprobs: list[SampleLogprobs | None]
    token_tensor: torch.Tensor | None = None


@dataclass
class PenaltyRow:
    """A row whose logits are penalised: its params' penalties and the token ids they count."""

    row: int
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float


@dataclass
class SamplingBatch:
    """A step's sampling parameters, one row per row of logits.

    The common parameters are host tensors, gathered from a persistent batch
    with one index per step (``temperature`` is 1 on greedy rows, ``top_k``
    -1 where off). What only some rows use is listed sparsely, so a row that
    uses none of it costs no Python: penalties, seeded draws (the row's uniform,
    already drawn), tokens banned by ``min_tokens``, grammar bitmasks
    (``bitmask[j]`` for row ``bitmask_rows[j]``), logprobs (row, k), allowed token
    ids (row, ids) and logit biases (row, ids, values).
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    is_greedy: torch.Tensor
    penalties: list[PenaltyRow] = field(default_factory=list)
    seeded_uniforms: dict[int, float] = field(default_factory=dict)
    banned: list[tuple[int, Sequence[int]]] = field(default_factory=list)
    bitmask_rows: list[int] = field(default_factory=list)
    bitmask: torch.Tensor | None = None
    num_logprobs: list[tuple[int, int]] = field(default_factory=list)
    allowed: list[tuple[int, Sequence[int]]] = field(default_factory=list)
    biases: list[tuple[int, Sequence[int], Sequence[float]]] = field(default_factory=list)

    def add_logit_bias(self, row: int, params: SamplingParams) -> None:
        """Row ``row``'s ``allowed_token_ids`` and ``logit_bias``, those it has."""
        if params.allowed_token_ids is not None:
            self.allowed.append((row, params.allowed_token_ids))
        if params.logit_bias is not None:
            self.biases.append((row, list(params.logit_bias), list(params.logit_bias.values())))

    @property
    def num_rows(self) -> int:
        return self.temperature.shape[0]

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams]) -> "SamplingBatch":
        """The dense part for ``params`` (one per row); the sparse lists start empty."""
        greedy = [p.is_greedy for p in params]
        return cls(
            temperature=torch.tensor([1.0 if g else p.temperature for p, g in zip(params, greedy)],
                                     dtype=torch.float32),
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.int64),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32),
            min_p=torch.tensor([p.min_p for p in params], dtype=torch.float32),
            is_greedy=torch.tensor(greedy, dtype=torch.bool),
        )

    @classmethod
    def from_states(cls, states: Sequence[SamplingState]) -> "SamplingBatch":
        """The batch of a list of per-row ``SamplingState`` (tests, small callers)."""
        batch = cls.from_params([state.params for state in states])
        masks = []
        for row, state in enumerate(states):
            params = state.params
            if params.has_penalties:
                batch.penalties.append(PenaltyRow(
                    row, state.prompt_token_ids if params.repetition_penalty != 1.0 else (),
                    state.output_token_ids, params.repetition_penalty, params.frequency_penalty,
                    params.presence_penalty))
            if params.seed is not None and not params.is_greedy:
                batch.seeded_uniforms[row] = seeded_uniform(params.seed, state.sample_index,
                                                            len(state.output_token_ids))
            if state.banned_token_ids:
                batch.banned.append((row, state.banned_token_ids))
            if state.token_bitmask is not None:
                batch.bitmask_rows.append(row)
                masks.append(state.token_bitmask)
            if params.logprobs is not None:
                batch.num_logprobs.append((row, params.logprobs))
            if params.biases_logits:
                batch.add_logit_bias(row, params)
        if masks:
            batch.bitmask = torch.stack(masks)
        return batch


class Sampler:
    """Samples the next token for a batch of sequences; works on any torch device.

    ``seed`` seeds the generator used for rows whose params carry no seed: an
    explicit seed reproduces the same stream, ``seed=None`` draws a fresh one
    from the OS (kept in ``self.seed``). The sampler keeps no per-sequence state.
    """

    def __init__(self, seed: int | None = None) -> None:
        self.seed = fresh_seed() if seed is None else seed
        self._generator = torch.Generator().manual_seed(self.seed)

    @staticmethod
    def greedy(logits: torch.Tensor) -> torch.Tensor:
        """The argmax of every row: a batch with neither random rows nor constraints."""
        return logits.argmax(dim=-1)

    def sample(self, logits: torch.Tensor, states: Sequence[SamplingState]) -> SamplerOutput:
        """Return one token id per row of ``logits`` ([num_seqs, vocab_size])."""
        _check_inputs(logits, len(states))
        return self.sample_batch(logits, SamplingBatch.from_states(states))

    def sample_batch(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """``sample`` for a ``SamplingBatch``: one host sync (the ids' copy to the host)."""
        _check_inputs(logits, batch.num_rows)
        num_rows = logits.shape[0]
        if num_rows == 0:
            return SamplerOutput([], [])
        token_ids = self.sample_tokens(logits, batch)
        logprobs = compute_logprobs(logits, token_ids, batch.num_logprobs, num_rows)
        return SamplerOutput(token_ids.tolist(), logprobs, token_ids)

    def sample_tokens(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """The sampled ids on the logits' device, without waiting for the device (logprobs,
        which are read on the host, are ``sample_batch``'s): every decision is taken on the
        host from the batch's host tensors, shapes never depend on the logits' values, and
        what the device needs is copied to it without blocking."""
        biased = apply_logit_bias(logits, batch.allowed, batch.biases)
        constrained = apply_constraints(biased, batch.bitmask_rows, batch.bitmask, batch.banned)
        if not batch.penalties and bool(batch.is_greedy.all()):
            return constrained.argmax(dim=-1)
        return self._sample_general(constrained.float(), batch)

    def _sample_general(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        logits = apply_penalty_rows(logits, batch.penalties)
        is_greedy = batch.is_greedy
        num_greedy = int(is_greedy.sum())
        if num_greedy == batch.num_rows:
            return logits.argmax(dim=-1)
        device = logits.device
        random_rows = (~is_greedy).nonzero().squeeze(1)
        token_ids = torch.empty(batch.num_rows, dtype=torch.long, device=device)
        raw = logits
        if num_greedy:
            greedy_rows = to_device(is_greedy.nonzero().squeeze(1), device)
            token_ids[greedy_rows] = logits[greedy_rows].argmax(dim=-1)
            raw = logits[to_device(random_rows, device)]
        processed = process_logits(raw, batch.temperature[random_rows], batch.top_k[random_rows],
                                   batch.top_p[random_rows], batch.min_p[random_rows])
        probs = argmax_where_not_finite(processed.softmax(dim=-1), raw)
        sampled = sample_from_probs(probs, self._uniforms(random_rows.tolist(), batch.seeded_uniforms))
        if not num_greedy:
            return sampled
        token_ids[to_device(random_rows, device)] = sampled
        return token_ids

    def _uniforms(self, rows: list[int], seeded: dict[int, float]) -> torch.Tensor:
        """One draw per sampled row: the generator's, or the row's own seeded draw."""
        uniforms = torch.rand(len(rows), dtype=torch.float64, generator=self._generator)
        if seeded:
            for position, row in enumerate(rows):
                draw = seeded.get(row)
                if draw is not None:
                    uniforms[position] = draw
        return uniforms


def apply_logit_bias(logits: torch.Tensor, allowed: Sequence[tuple[int, Sequence[int]]],
                     biases: Sequence[tuple[int, Sequence[int], Sequence[float]]]) -> torch.Tensor:
    """Logits, in float32, with each ``allowed`` row's other tokens at -inf and each
    ``biases`` row's values added to its tokens (``logits`` itself if no row has either;
    the input is never modified)."""
    if not allowed and not biases:
        return logits
    device = logits.device
    logits = logits.to(torch.float32, copy=True)
    if allowed:
        rows = to_device(int64_tensor([row for row, _ in allowed]), device)
        keep = torch.zeros((len(allowed), logits.shape[1]), dtype=torch.bool, device=device)
        keep[to_device(int64_tensor([j for j, (_, ids) in enumerate(allowed) for _ in ids]), device),
             to_device(int64_tensor([t for _, ids in allowed for t in ids]), device)] = True
        logits[rows] = logits[rows].masked_fill(~keep, float("-inf"))
    if biases:
        rows = to_device(int64_tensor([row for row, ids, _ in biases for _ in ids]), device)
        ids = to_device(int64_tensor([t for _, ids, _ in biases for t in ids]), device)
        values = torch.tensor([v for _, _, values in biases for v in values], dtype=torch.float32)
        logits.index_put_((rows, ids), to_device(values, device), accumulate=True)
    return logits


def apply_constraints(logits: torch.Tensor, bitmask_rows: Sequence[int], bitmask: torch.Tensor | None,
                      banned: Sequence[tuple[int, Sequence[int]]]) -> torch.Tensor:
    """Logits with each row's disallowed tokens at -inf (``logits`` itself if no row is
    constrained; the input is never modified).

    ``bitmask[j]`` constrains row ``bitmask_rows[j]``; ``banned`` lists (row, token
    ids) that cannot be sampled. A row's bitmask wins over its banned tokens: a ban
    that would leave the row nothing to sample is dropped for that row.
    """
    if not bitmask_rows and not banned:
        return logits
    device = logits.device
    logits = logits.clone()
    if bitmask_rows:
        rows = to_device(int64_tensor(list(bitmask_rows)), device)
        logits[rows] = apply_token_bitmask(logits[rows], bitmask)
    if banned:
        ban_rows = to_device(int64_tensor([row for row, _ in banned]), device)
        selected = logits[ban_rows]
        rows = to_device(int64_tensor([j for j, (_, ids) in enumerate(banned) for _ in ids]), device)
        flat = to_device(int64_tensor([t for _, ids in banned for t in ids]), device)
        selected[rows, flat] = float("-inf")
        keeps_some = torch.isfinite(selected).any(dim=-1)
        logits[ban_rows] = torch.where(keeps_some.unsqueeze(1), selected, logits[ban_rows])
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
    is_bad = ~torch.isfinite(probs).all(dim=-1, keepdim=True)
    if probs.device.type == "cpu" and not bool(is_bad.any()):
        return probs  # on the host the check is free; on a device it would wait for it
    fallback = torch.nan_to_num(logits.float(), nan=float("-inf")).argmax(dim=-1, keepdim=True)
    return torch.where(is_bad, torch.zeros_like(probs).scatter_(1, fallback, 1.0), probs)


def sample_from_probs(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: row i takes the token where its CDF crosses ``uniforms[i]``.

    One uniform per row (so seeding is cheap and device independent); tokens with
    zero probability are never chosen.
    """
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)
    total = cdf[:, -1:]
    targets = to_device(uniforms.to(cdf.dtype), cdf.device).unsqueeze(1) * total
    # Rounding could put the target at the very top; keep it strictly below.
    targets = torch.minimum(targets, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, targets, right=True).squeeze(1)


def process_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                   top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p masks (to -inf), one row per entry of
    the (host) parameter tensors.

    ``logits`` should already carry penalties. Greedy rows are expected at
    temperature 1; their distribution is the argmax (see ``processed_probs``).
    """
    logits = logits.float()
    device = logits.device
    vocab_size = logits.shape[-1]
    if bool((temperature != 1.0).any()):
        logits = logits / to_device(temperature, device).unsqueeze(1)
    if bool(((top_k > 0) & (top_k < vocab_size)).any()) or bool((top_p < 1.0).any()):
        logits = apply_top_k_top_p(logits, top_k, top_p)
    if bool((min_p > 0.0).any()):
        logits = apply_min_p(logits, to_device(min_p, device))
    return logits


def processed_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The exact distribution each row samples from (greedy rows: one-hot at argmax)."""
    batch = SamplingBatch.from_params(params)
    logits = process_logits(logits, batch.temperature, batch.top_k, batch.top_p, batch.min_p)
    probs = logits.softmax(dim=-1)
    is_greedy = batch.is_greedy.to(logits.device)
    if bool(batch.is_greedy.any()):
        one_hot = torch.zeros_like(probs).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
        probs = torch.where(is_greedy.unsqueeze(1), one_hot, probs)
    return probs


# Candidates a host device looks at first when searching the rows' top-p cut-offs.
NUM_TOP_P_CANDIDATES = 64


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                      is_widening: bool | None = None) -> torch.Tensor:
    """Mask (to -inf) logits below each row's top-k and top-p cut-offs.

    Top-k keeps logits >= the k-th largest; then top-p keeps the most likely of
    those, in order, until their renormalised probability reaches p. Both cut-offs
    are values, so tokens tied with the last kept one are kept too (as vLLM), and
    the result does not depend on how a sort orders ties. ``top_k`` <= 0 or >=
    vocab size and ``top_p`` >= 1 disable the filters for that row (both host
    tensors, one entry per row).

    Never waits for the device: which rows and how many candidates are decided on
    the host from the parameters. The top-p search looks at each row's most likely
    tokens, as many as its top-k leaves when every top-p row has one, else the whole
    vocabulary, in one pass (``top_p_thresholds``). Where the host reads the logits
    for free (``is_widening``, by default on the CPU), it starts with
    ``NUM_TOP_P_CANDIDATES`` and widens only the rows whose nucleus is larger: the
    same cut-offs, without a full sort when nuclei are small.
    """
    num_rows, vocab_size = logits.shape
    device = logits.device
    is_k_on = (top_k > 0) & (top_k < vocab_size)
    if bool(is_k_on.any()):
        values = logits.topk(int(top_k[is_k_on].max()), dim=-1).values
        kth_index = top_k.clamp(1, values.shape[1]) - 1
        kth = values.gather(1, to_device(kth_index, device).unsqueeze(1))
        kth = kth.masked_fill(to_device(~is_k_on, device).unsqueeze(1), float("-inf"))
        logits = logits.masked_fill(logits < kth, float("-inf"))
    is_p_on = top_p < 1.0
    if not bool(is_p_on.any()):
        return logits
    # Past a row's top-k only ties of its k-th logit are left, which the k-th's cut-off keeps.
    max_candidates = int(top_k[is_p_on].max()) if bool(is_k_on[is_p_on].all()) else vocab_size
    if is_widening is None:
        is_widening = device.type == "cpu"
    search = _widening_top_p_thresholds if is_widening else top_p_thresholds
    if bool(is_p_on.all()):
        thresholds = search(logits, to_device(top_p, device), max_candidates)
    else:
        p_rows = to_device(is_p_on.nonzero().squeeze(1), device)
        thresholds = torch.full((num_rows, 1), float("-inf"), dtype=logits.dtype, device=device)
        thresholds.index_copy_(0, p_rows, search(logits.index_select(0, p_rows), to_device(top_p[is_p_on], device),
                                                 max_candidates))
    return logits.masked_fill(logits < thresholds, float("-inf"))


def top_p_thresholds(logits: torch.Tensor, top_p: torch.Tensor, max_candidates: int) -> torch.Tensor:
    """Per row, the smallest logit of the top-p nucleus ([num_rows, 1]), from the row's
    ``max_candidates`` most likely tokens; -inf where their mass falls short of p
    (by rounding, or because they are all the row has): the row keeps every token.

    ``top_p`` ([num_rows], on the logits' device) is compared with the candidates'
    cumulative probability in float64. Never reads the device.
    """
    return _nucleus_cut(logits, top_p, max_candidates)[0]


def _nucleus_cut(logits: torch.Tensor, top_p: torch.Tensor, num_candidates: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``top_p_thresholds`` and, per row, the logit of its least likely candidate."""
    probs = logits.softmax(dim=-1)
    if num_candidates < logits.shape[-1]:
        candidates, candidate_ids = probs.topk(num_candidates, dim=-1)
    else:
        candidates, candidate_ids = probs.sort(dim=-1, descending=True)
    is_reached = candidates.cumsum(dim=-1, dtype=torch.float64) >= top_p.unsqueeze(1)
    first = is_reached.to(torch.uint8).argmax(dim=-1, keepdim=True)   # the first True (0 if none)
    thresholds = logits.gather(1, candidate_ids.gather(1, first))
    thresholds = thresholds.masked_fill(~is_reached.any(dim=-1, keepdim=True), float("-inf"))
    return thresholds, logits.gather(1, candidate_ids[:, -1:]).squeeze(1)


def _widening_top_p_thresholds(logits: torch.Tensor, top_p: torch.Tensor, max_candidates: int) -> torch.Tensor:
    """``top_p_thresholds`` over ``NUM_TOP_P_CANDIDATES`` candidates first, then 8x as
    many for the rows whose nucleus is larger, up to ``max_candidates``: the same
    cut-offs, but reading the logits (for a device the host reads for free)."""
    num_rows = logits.shape[0]
    thresholds = torch.full((num_rows, 1), float("-inf"), dtype=logits.dtype, device=logits.device)
    pending = torch.arange(num_rows, device=logits.device)
    num_candidates = min(NUM_TOP_P_CANDIDATES, max_candidates)
    while True:
        found, last = _nucleus_cut(logits[pending], top_p[pending], num_candidates)
        thresholds[pending] = found
        if num_candidates >= max_candidates:
            return thresholds
        # Not found: the nucleus is larger, or the candidates already hold every finite
        # logit (the mass fell short of p only by rounding: the row keeps them all).
        pending = pending[(found.squeeze(1) == float("-inf")) & (last != float("-inf"))]
        if not len(pending):
            return thresholds
        num_candidates = min(num_candidates * 8, max_candidates)


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
        seen = torch.unique(torch.cat([prompt_index, output_index]))
        penalty = repetition_penalties.to(logits.dtype)[seen // vocab_size]
        seen = to_device(seen, device)
        values = flat_logits[seen]
        penalty = to_device(penalty, device)
        flat_logits[seen] = torch.where(values > 0, values / penalty, values * penalty)
    if len(output_index):
        seen, counts = torch.unique(output_index, return_counts=True)
        rows = seen // vocab_size
        subtracted = counts.to(logits.dtype) * frequency_penalties.to(logits.dtype)[rows] \
            + presence_penalties.to(logits.dtype)[rows]
        seen = to_device(seen, device)
        flat_logits[seen] = flat_logits[seen] - to_device(subtracted, device)
    return logits


def apply_penalty_rows(logits: torch.Tensor, rows: Sequence[PenaltyRow]) -> torch.Tensor:
    """Penalise the listed rows; other rows are returned untouched (``logits`` itself
    when none is listed)."""
    if not rows:
        return logits
    index = to_device(int64_tensor([r.row for r in rows]), logits.device)
    logits = logits.clone()
    logits[index] = apply_penalties(
        logits[index],
        [r.prompt_token_ids for r in rows],
        [r.output_token_ids for r in rows],
        torch.tensor([r.repetition_penalty for r in rows]),
        torch.tensor([r.frequency_penalty for r in rows]),
        torch.tensor([r.presence_penalty for r in rows]),
    )
    return logits


def apply_penalties_to_states(
    logits: torch.Tensor, states: Sequence[SamplingState]
) -> torch.Tensor:
    """Penalise the rows whose params ask for it; other rows are returned untouched."""
    return apply_penalty_rows(logits, SamplingBatch.from_states(states).penalties)


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_logprobs: Sequence[tuple[int, int]],
                     num_rows: int) -> list[SampleLogprobs | None]:
    """Raw-logit logprobs of the sampled tokens plus each listed row's top k alternatives
    (``num_logprobs``: (row, k)); None for the other rows."""
    result: list[SampleLogprobs | None] = [None] * num_rows
    if not num_logprobs:
        return result
    rows = [row for row, _ in num_logprobs]
    logprobs = logits[rows].float().log_softmax(dim=-1)
    row_ids = token_ids[rows]
    sampled = logprobs.gather(1, row_ids.unsqueeze(1)).squeeze(1).tolist()
    max_k = max(k for _, k in num_logprobs)
    top_values: list[list[float]] = [[] for _ in rows]
    top_ids: list[list[int]] = [[] for _ in rows]
    if max_k > 0:
        values, ids = logprobs.topk(min(max_k, logprobs.shape[-1]), dim=-1)
        top_values, top_ids = values.tolist(), ids.tolist()
    sampled_ids = row_ids.tolist()
    for j, (row, k) in enumerate(num_logprobs):
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


def _check_inputs(logits: torch.Tensor, num_rows: int) -> None:
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        raise ValueError("logits must be a 2-D tensor [num_seqs, vocab_size]")
    if not logits.is_floating_point():
        raise ValueError(f"logits must be floating point, got {logits.dtype}")
    if logits.shape[0] != num_rows:
        raise ValueError(f"got {logits.shape[0]} rows of logits for {num_rows} sampling rows")
