"""The engine's beam-search requests: each one's beams as sequences on shared blocks.

A beam-search request (``SamplingParams.use_beam_search``) is a group of live beams.
A beam runs as an ordinary engine sequence whose batch row carries the ``BEAM``
flag: the engine hands such rows' logits here instead of sampling them
(``advance``). Once every live beam of a group has its next-token scores, the
group takes a ``BeamSearch`` step, and the new beams are made from the old ones:

  - a beam that one new beam continues keeps its sequence and appends the token;
  - each further continuation of it is a fork (``Scheduler.fork``): the child
    shares all of its parent's blocks, and the KV manager copies only the last,
    partly written block when either writes to it (copy-on-write);
  - a beam that nothing continues ends, and its blocks go back to the pool.

So the beams of a group share every block of their common prefix, and each one
holds at most one block of its own beyond it.

Preemption can split a group: some beams computed this step, others were pushed
off the device (swapped out or dropped for recompute) or wait in the queue. The
group cannot step until all of them have scores, and a computed beam has nothing
left to compute, so it would hold its blocks while it waits, possibly the very
blocks its siblings need. Instead it is parked: its scores and tokens are kept
here, its sequence ends and its blocks return to the pool (full blocks stay in
the prefix cache). When the group steps, a parked beam's continuations are new
sequences, admitted like any prompt (their prefix mostly a cache hit). So a live
beam is always either running with exactly one token to compute, waiting to be
(re)computed, or parked, and every step a group makes is the one transformers
would make: nothing is lost, and every block comes back.

A group's state lives on its request (``Request.beam_group``): an aborted request
drops it with the request, and the engine's abort ends the beams' sequences,
which are the request's ``seqs`` while they run.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..model.input_batch import InputBatch
from ..outputs.detokenizer import StreamingDetokenizer
from ..outputs.request_output import CompletionOutput, RequestOutput
from ..sample.beam_search import BeamSearch, Hypothesis
from .request import Request, Sequence
from .scheduler import Scheduler

# ``new_sequence(request, sample_index, token_ids)``: a sequence of ``request``
# (with its output stream), appended to ``request.seqs``.
NewSequence = Callable[[Request, int, list[int]], Sequence]


@dataclass(eq=False, slots=True)
class Beam:
    """A live beam: its tokens (prompt and output; its sequence's own list while it
    runs), its sequence (None while parked) and its next-token log-probabilities
    (None until computed)."""

    token_ids: list[int]
    seq: Sequence | None
    logprobs: torch.Tensor | None = None


@dataclass(eq=False)
class BeamGroup:
    """One request's beam search: the search, and its live beams in the search's order."""

    search: BeamSearch
    beams: list[Beam]
    by_seq: dict[str, Beam] = field(default_factory=dict)
    next_sample_index: int = 1
    num_parked: int = 0          # beams parked so far (preemption split the group)

    @property
    def is_ready(self) -> bool:
        return all(beam.logprobs is not None for beam in self.beams)


class BeamGroups:
    """Drives the engine's beam-search requests (see the module docstring).

    The engine calls ``start`` when it builds such a request and ``advance`` with
    the logits of the rows flagged ``BEAM`` each step; ``advance`` returns the
    final outputs of the groups that finished. Sequences are made with the
    engine's ``new_sequence``, queued, forked and ended through its scheduler and
    batch; ``on_finished(request)`` forgets a finished request.
    """

    def __init__(self, scheduler: Scheduler, batch: InputBatch, new_sequence: NewSequence,
                 on_finished: Callable[[Request], None], tokenizer, eos_token_ids: list[int],
                 max_model_len: int) -> None:
        self.scheduler = scheduler
        self.batch = batch
        self.new_sequence = new_sequence
        self.on_finished = on_finished
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.num_forks = 0
        self.num_parked = 0

    def start(self, request: Request) -> None:
        """Make ``request`` (one sequence, its prompt) a beam-search group."""
        params = request.params
        stop_token_ids = list(dict.fromkeys(([] if params.ignore_eos else self.eos_token_ids)
                                            + params.stop_token_ids))
        max_tokens = min(params.max_tokens, self.max_model_len - len(request.prompt_token_ids))
        search = BeamSearch(params.n, max_tokens, stop_token_ids, params.length_penalty, params.early_stopping)
        [seq] = request.seqs
        beam = Beam(seq.token_ids, seq)
        request.beam_group = BeamGroup(search, [beam], {seq.seq_id: beam})

    # ---- a step ----------------------------------------------------------------------------
    def advance(self, seqs: list[Sequence], logits: torch.Tensor) -> list[tuple[Request, RequestOutput]]:
        """Take the next-token logits of beams (``logits[i]`` is ``seqs[i]``'s); step each
        group whose live beams all have theirs, park the computed beams of the others.
        Returns the requests that finished, each with its output."""
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        groups: dict[int, tuple[Request, BeamGroup]] = {}
        for i, seq in enumerate(seqs):
            request = seq.request
            group = request.beam_group
            group.by_seq[seq.seq_id].logprobs = logprobs[i]
            groups[id(group)] = (request, group)
        outputs = []
        for request, group in groups.values():
            if not group.is_ready:
                self._park_computed(request, group)
            elif self._step(request, group):
                outputs.append((request, self._finish(request, group)))
        return outputs

    def _step(self, request: Request, group: BeamGroup) -> bool:
        """One search step and the beams it makes; True if the search is done."""
        beams = group.beams
        step = group.search.advance(torch.stack([beam.logprobs for beam in beams]),
                                    [beam.token_ids for beam in beams], len(request.prompt_token_ids))
        if group.search.is_done:
            return True
        # Forks and new sequences copy their parent's tokens before it appends its own.
        new_beams: list[Beam] = []
        continuing: list[tuple[Beam, int]] = []
        is_continued = [False] * len(beams)
        for parent_index, token_id in zip(step.parents, step.token_ids):
            parent = beams[parent_index]
            if parent.seq is not None and not is_continued[parent_index]:
                is_continued[parent_index] = True
                continuing.append((parent, token_id))
                new_beams.append(parent)
                continue
            new_beams.append(self._branch(request, group, parent, token_id))
        for parent, token_id in continuing:
            parent.seq.append_token(token_id)
            self.scheduler.append_token(parent.seq, token_id)
            parent.logprobs = None
        for beam, is_kept in zip(beams, is_continued):
            if not is_kept and beam.seq is not None:
                self._end(request, group, beam.seq)
        group.beams = new_beams
        return False

    def _branch(self, request: Request, group: BeamGroup, parent: Beam, token_id: int) -> Beam:
        """A new beam: ``parent`` plus ``token_id``, forked from its sequence (sharing its
        blocks), or, if it is parked, a new sequence queued to be computed."""
        index = group.next_sample_index
        group.next_sample_index += 1
        seq = self.new_sequence(request, index, list(parent.token_ids))
        if parent.seq is not None:
            self.scheduler.fork(parent.seq, seq)
            seq.append_token(token_id)
            self.scheduler.append_token(seq, token_id)
            self.num_forks += 1
        else:
            seq.append_token(token_id)
            self.scheduler.add(seq)
        beam = Beam(seq.token_ids, seq)
        group.by_seq[seq.seq_id] = beam
        return beam

    def _park_computed(self, request: Request, group: BeamGroup) -> None:
        """End the sequences of the beams that have their scores while a sibling has not:
        they keep their tokens and scores here, and their blocks go back to the pool."""
        for beam in group.beams:
            if beam.logprobs is not None and beam.seq is not None:
                beam.logprobs = beam.logprobs.clone()   # not a view of the whole step's rows
                self._end(request, group, beam.seq)
                beam.seq = None
                group.num_parked += 1
                self.num_parked += 1

    def _end(self, request: Request, group: BeamGroup, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        self.batch.remove(seq)
        request.seqs.remove(seq)
        del group.by_seq[seq.seq_id]

    # ---- the end -------------------------------------------------------------------------
    def _finish(self, request: Request, group: BeamGroup) -> RequestOutput:
        """End the group's sequences and build the request's output: the best beams, best first."""
        for beam in group.beams:
            if beam.seq is not None:
                self._end(request, group, beam.seq)
        self.on_finished(request)
        hypotheses = group.search.best()
        completions = [self._completion(request, index, hypothesis) for index, hypothesis in enumerate(hypotheses)]
        metrics = request.metrics
        metrics.num_generated_tokens = sum(len(h.token_ids) for h in hypotheses)
        metrics.finished_time = time.time()
        if metrics.first_token_time is None:
            metrics.first_token_time = metrics.finished_time
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, completions, True,
                             metrics)

    def _completion(self, request: Request, index: int, hypothesis: Hypothesis) -> CompletionOutput:
        text = StreamingDetokenizer(self.tokenizer, request.prompt_token_ids, request.params, self.eos_token_ids,
                                    self.max_model_len)
        token_ids = hypothesis.token_ids
        for token_id in token_ids[:-1]:
            text.append(token_id, None)
        text.append(token_ids[-1], hypothesis.finish_reason)
        return CompletionOutput(index=index, text=text.output_text, token_ids=token_ids,
                                cumulative_logprob=hypothesis.cum_logprob, logprobs=None,
                                finish_reason=hypothesis.finish_reason, stop_reason=text.stop_reason,
                                delta_text=text.output_text, delta_token_ids=token_ids,
                                is_newly_finished=True)
