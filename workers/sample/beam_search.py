"""Beam search for one prompt, step by step, as transformers' ``generate(num_beams=k, do_sample=False)``.

``BeamSearch`` sees only scores: each step, the next-token log-probabilities of its
live beams (and their token ids); it answers which continuations live on (a parent
beam and a token each) and keeps the finished hypotheses. Which sequences, blocks
and forks carry the beams is the engine's business (``beam_groups.py``).

The rule is transformers' (``GenerationMixin._beam_search``, the vectorized one of
its PR #35802, read in the installed 5.24), step for step and in float32, so that its
output is the oracle's:
  - the ``max(2, 1 + number of stop tokens) * k`` best continuations of all live
    beams, by summed log-probability, are candidates; the best ``k`` of those
    that do not end (on EOS or a stop token id, or at the length limit) are the
    next live beams;
  - a candidate among the first ``k`` that ends becomes a hypothesis scored
    ``summed log-probability / (output length, the stop token included) **
    length_penalty``; the best ``k`` hypotheses are kept;
  - the search ends at the length limit, or when no live beam can beat the worst
    of ``k`` kept hypotheses: transformers' ``early_stopping`` heuristic (False:
    the best live beam's score at its current length; "never": at the longest
    length when ``length_penalty`` > 0; True: also as soon as ``k`` hypotheses
    exist).
At the first step the prompt is the only beam; as transformers does, the other
``k - 1`` beams are copies of it that start at -1e9.

``BeamSearchSequence`` and ``BeamSearchOutput`` are vLLM's offline API (``LLM.beam_search``,
which takes a ``sampling_params.BeamSearchParams``, as vLLM's does).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..model.host_lists import to_device

# transformers' stand-in score for "not a candidate" (-1e9, added in float32).
EXCLUDED = -1.0e9


@dataclass
class BeamSearchSequence:
    """One returned beam (vLLM's shape): ``tokens`` holds the prompt and the output
    (a final EOS or stop token included), ``cum_logprob`` the output's summed
    log-probability, ``text`` the output's text (without that stop token). Beams
    are ranked by ``cum_logprob / len(output) ** length_penalty``."""

    tokens: list[int]
    cum_logprob: float
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """The ``beam_width`` best sequences of one prompt, the best first (vLLM's shape)."""

    sequences: list[BeamSearchSequence]


@dataclass(slots=True)
class Hypothesis:
    """A finished beam: its output tokens (the stop token included), summed
    log-probability, score, and why it ended ("stop" or "length")."""

    token_ids: list[int]
    cum_logprob: float
    score: float
    finish_reason: str
    stop_token_id: int | None = None


@dataclass(slots=True)
class BeamStep:
    """The live beams after a step, best first: ``parents[i]`` (an index into the
    previous live beams) continued with ``token_ids[i]``. Empty once the search is done."""

    parents: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)


class BeamSearch:
    """The state of one prompt's beam search (see the module docstring).

    ``width`` beams; ``max_tokens`` output tokens at most (the request's limit or
    what the context leaves, whichever is smaller); ``stop_token_ids`` end a
    hypothesis (EOS unless ignored, and the request's stop token ids).
    """

    def __init__(self, width: int, max_tokens: int, stop_token_ids: list[int], length_penalty: float = 1.0,
                 early_stopping: bool | str = False) -> None:
        if width < 1 or max_tokens < 1:
            raise ValueError(f"beam search needs width >= 1 and max_tokens >= 1, got {width}, {max_tokens}")
        self.width = width
        self.max_tokens = max_tokens
        self.stop_token_ids = frozenset(stop_token_ids)
        self.length_penalty = length_penalty
        self.early_stopping = early_stopping
        self.num_candidates = max(2, 1 + len(self.stop_token_ids)) * width
        self.num_generated = 0
        self.scores: torch.Tensor | None = None      # the live beams' summed log-probabilities (float32)
        # The k kept hypotheses, best first, as transformers keeps them: slots whose
        # score stays near -1e9 (and flag False) until real hypotheses fill them.
        self.hypothesis_scores: torch.Tensor | None = None
        self.hypothesis_flags: torch.Tensor | None = None
        self.hypotheses: list[Hypothesis | None] = [None] * width
        self.is_improvable = True
        self.is_done = False

    @property
    def num_live(self) -> int:
        """How many live beams the next step's log-probabilities must cover."""
        return 1 if self.num_generated == 0 else self.width

    def advance(self, logprobs: torch.Tensor, token_ids: list[list[int]], num_prompt_tokens: int) -> BeamStep:
        """One step: ``logprobs[i]`` ([num_live, vocab], float32) are the next-token
        log-probabilities of live beam ``i``, whose tokens (prompt and output) are
        ``token_ids[i]``. Returns the new live beams (none once ``is_done``)."""
        if self.is_done:
            raise RuntimeError("the beam search is done")
        if logprobs.shape[0] != self.num_live or len(token_ids) != self.num_live:
            raise ValueError(f"{logprobs.shape[0]} rows of log-probabilities for {self.num_live} live beams")
        width, vocab_size = self.width, logprobs.shape[1]
        device = logprobs.device
        if self.num_generated == 0:
            logprobs = logprobs.expand(width, vocab_size)
            scores = torch.full((width,), EXCLUDED, dtype=torch.float32, device=device)
            scores[0] = 0.0
            self.hypothesis_scores = torch.full((width,), EXCLUDED, dtype=torch.float32, device=device)
            self.hypothesis_flags = torch.zeros(width, dtype=torch.bool, device=device)
        else:
            scores = self.scores
        totals = (logprobs + scores.unsqueeze(1)).reshape(-1)
        top_scores, top_index = torch.topk(totals, min(self.num_candidates, totals.numel()))
        num_candidates = top_scores.shape[0]
        parents = (top_index // vocab_size).tolist()
        tokens = (top_index % vocab_size).tolist()
        if self.num_generated == 0:
            parents = [0] * num_candidates
        self.num_generated += 1
        is_last = self.num_generated >= self.max_tokens
        ends = [is_last or token in self.stop_token_ids for token in tokens]
        ends_tensor = to_device(torch.tensor(ends, dtype=torch.bool), device)

        # The next live beams: the best candidates that do not end.
        running = top_scores + ends_tensor.to(torch.float32) * EXCLUDED
        next_scores, next_positions = torch.topk(running, min(width, num_candidates))
        self._keep_hypotheses(top_scores, parents, tokens, ends_tensor, token_ids, num_prompt_tokens)
        self.scores = next_scores
        self._check_done(ends)
        if self.is_done:
            return BeamStep()
        positions = next_positions.tolist()
        return BeamStep([parents[p] for p in positions], [tokens[p] for p in positions])

    def _keep_hypotheses(self, top_scores: torch.Tensor, parents: list[int], tokens: list[int],
                         ends: torch.Tensor, token_ids: list[list[int]], num_prompt_tokens: int) -> None:
        """Merge this step's ending candidates among the first ``width`` into the kept hypotheses."""
        width = self.width
        is_eligible = ends.clone()
        is_eligible[width:] = False
        scores = top_scores / (self.num_generated ** self.length_penalty)
        is_full = bool(self.hypothesis_flags.all()) and self.early_stopping is True
        scores = scores + float(is_full) * EXCLUDED
        scores = scores + float(not self.is_improvable) * EXCLUDED
        scores = scores + (~is_eligible) * EXCLUDED
        merged_scores = torch.cat((self.hypothesis_scores, scores))
        merged_flags = torch.cat((self.hypothesis_flags, is_eligible))
        keep = torch.topk(merged_scores, width).indices
        self.hypothesis_scores = merged_scores[keep]
        self.hypothesis_flags = merged_flags[keep]
        kept: list[Hypothesis | None] = []
        flags = self.hypothesis_flags.tolist()
        cum_logprobs = top_scores.tolist()
        final_scores = self.hypothesis_scores.tolist()
        for slot, (index, is_hypothesis) in enumerate(zip(keep.tolist(), flags)):
            if not is_hypothesis:
                kept.append(None)
            elif index < width:
                kept.append(self.hypotheses[index])
            else:
                c = index - width
                token = tokens[c]
                output = token_ids[parents[c]][num_prompt_tokens:] + [token]
                is_stop = token in self.stop_token_ids
                kept.append(Hypothesis(output, cum_logprobs[c], final_scores[slot], "stop" if is_stop else "length",
                                       token if is_stop else None))
        self.hypotheses = kept

    def _check_done(self, ends: list[bool]) -> None:
        """transformers' stopping rule, after the step (see the module docstring)."""
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            best_length = self.max_tokens
        else:
            best_length = self.num_generated
        best_running = self.scores[:1] / (best_length ** self.length_penalty)
        worst_kept = torch.where(self.hypothesis_flags, self.hypothesis_scores.min(), EXCLUDED)
        self.is_improvable = self.is_improvable and bool((best_running > worst_kept).any())
        is_full = bool(self.hypothesis_flags.all()) and self.early_stopping is True
        self.is_done = not self.is_improvable or is_full or all(ends)

    def best(self) -> list[Hypothesis]:
        """The kept hypotheses, best first (``width`` of them once the search is done)."""
        return [h for h in self.hypotheses if h is not None]
