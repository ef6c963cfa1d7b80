"""The engine's side of speculative decoding, one step at a time.

Before the plan, each decoding sequence that may speculate asks the proposer for up to k
tokens (``propose``); the KV manager gives them slots like any token. After the plan
(``take_plan``), proposals that will not be verified (the sequence was preempted, or the
token budget left them out) are dropped. ``prepare_step`` makes a verifying sequence's chunk
its last token plus its proposals, with the logits of each position. ``sample_step``
samples the step: plain rows through the ``SamplingPipeline``, verifying ones through
``verifier.verify``; their accepted proposals and the target's token are appended one by one
with the usual finish checks (EOS, stop token ids, max_tokens, the context), and the KV
manager hears how many proposals each kept (the rest lose their slots at the next plan).

A sequence proposes from its known tokens. Under overlapped scheduling the engine overlaps only
the steps of a batch at ``disable_by_batch_size`` (which proposes nothing); a smaller batch's
steps read their ids at once, and no proposal is made while a step's ids are on the device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from ..engine.request import Request, Sequence
from ..engine.scheduler import Scheduler, SchedulerOutput
from ..model.host_lists import int64_tensor, to_device
from ..model.input_batch import (BAD_WORDS, EXPORTS_KV, FORKS, GRAMMAR, LOGIT_BIAS, LOGPROBS, MIN_TOKENS,
                                 PENALTIES, SEEDED, TEXT, InputBatch)
from ..outputs.detokenizer import check_stop
from ..outputs.output_processor import EngineStep, SeqFinish, StepTokens
from ..sample.per_row_features import PerRowFeatures, bad_word_bans
from ..sample.sampler import PenaltyRow, Sampler, seeded_uniform
from ..sample.sampling_pipeline import SamplingPipeline
from .config import SpeculativeConfig
from .proposer import BatchProposer, Proposer
from .verifier import verify

# Per-row features the verifier cannot honour yet: such a sequence decodes one token a step.
# (Beam search is refused on an engine that speculates.)
NOT_VERIFIABLE = FORKS | EXPORTS_KV
# Per-row features whose values at each verified position are set here.
PER_POSITION = SEEDED | MIN_TOKENS | LOGIT_BIAS | LOGPROBS | PENALTIES | BAD_WORDS
# The back-off: after r drafts in a row that kept nothing, a sequence skips its next
# min(2^(r-1), MAX_BACKOFF_TOKENS) tokens' proposals (a draft that keeps one token ends it).
MAX_BACKOFF_TOKENS = 64


def reason_not_speculating(request: Request) -> str | None:
    """Why a request's sequences never propose (a feature the verifier cannot honour yet), or
    None when they may."""
    if request.export_kv:
        return "KV export"
    return None


@dataclass
class SpecDecodeStats:
    """vLLM's speculative decoding counters: drafts (a sequence's proposals verified in one
    step), their tokens, the tokens accepted, and the acceptances at each proposal position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    num_disabled_steps: int = 0     # steps whose batch reached disable_by_batch_size
    num_backoffs: int = 0           # drafts that kept nothing, each pausing its sequence's proposals

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verifying sequence gains per step: 1 + accepted per draft (vLLM's)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def as_dict(self) -> dict:
        return {"spec_decode_num_drafts": self.num_drafts,
                "spec_decode_num_draft_tokens": self.num_draft_tokens,
                "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
                "spec_decode_num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos),
                "spec_decode_mean_acceptance_length": self.mean_acceptance_length,
                "spec_decode_num_disabled_steps": self.num_disabled_steps,
                "spec_decode_num_backoffs": self.num_backoffs}


class Speculator:
    """Proposals, their verification and their bookkeeping for an engine (module docstring).

    ``proposer`` may be replaced (benchmarks, tests); ``end_sequence(seq)`` ends a sequence
    whose ``finish_reason`` is set, ``release_if_idle()`` hands blocks back when no request
    is left.
    """

    def __init__(self, config: SpeculativeConfig, proposer: Proposer | BatchProposer, *, batch: InputBatch,
                 scheduler: Scheduler, sampler: Sampler, per_row: PerRowFeatures, pipeline: SamplingPipeline,
                 eos_token_ids: list[int], max_model_len: int, end_sequence: Callable[[Sequence], None],
                 release_if_idle: Callable[[], None]) -> None:
        self.config = config
        self.proposer = proposer
        self.batch = batch
        self.scheduler = scheduler
        self.sampler = sampler
        self.per_row = per_row
        self.pipeline = pipeline
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self._end_sequence = end_sequence
        self._release_if_idle = release_if_idle
        self.stats = SpecDecodeStats()
        self._proposing: list[Sequence] = []

    # ---- before the plan ------------------------------------------------------------------
    def may_propose(self, running: list[Sequence]) -> bool:
        """Whether a batch of ``running`` is below ``disable_by_batch_size`` (under overlapped
        scheduling, a step's ids are then read at once, for the next step's proposals)."""
        limit = self.config.disable_by_batch_size
        return limit is None or len(running) < limit

    def propose(self, running: list[Sequence]) -> None:
        """Proposals for the decoding sequences of ``running`` that may speculate (none when
        the batch has reached ``disable_by_batch_size``), registered with the scheduler."""
        if not self.may_propose(running):
            self.stats.num_disabled_steps += 1
            return
        candidates = [seq for seq in running if seq.batch_row >= 0 and not seq.proposed_token_ids
                      and seq.num_computed == len(seq.token_ids) - 1
                      and len(seq.output_token_ids) >= seq.proposes_from_output]
        if not candidates:
            return
        batch = self.batch
        rows = int64_tensor([seq.batch_row for seq in candidates])
        flags = batch.flags.index_select(0, rows).tolist()
        rooms = (batch.max_outputs.index_select(0, rows) - batch.num_outputs.index_select(0, rows) - 1).tolist()
        proposer = self.proposer
        k = proposer.num_speculative_tokens
        proposing, limits, proposing_flags = [], [], []
        for seq, flag, room in zip(candidates, flags, rooms):
            if not flag & NOT_VERIFIABLE and room > 0:
                proposing.append(seq)
                limits.append(min(k, room))
                proposing_flags.append(flag)
        if not proposing:
            return
        if isinstance(proposer, BatchProposer):
            proposals = proposer.propose_batch(proposing, limits)
        else:
            proposals = [proposer.propose(seq.token_ids, seq.num_prompt_tokens, limit)
                         for seq, limit in zip(proposing, limits)]
        for seq, flag, proposal in zip(proposing, proposing_flags, proposals):
            if proposal and flag & GRAMMAR:   # only what the grammar allows, in a row
                proposal = proposal[:seq.grammar.num_valid(proposal)]
            if proposal:
                seq.proposed_token_ids = list(proposal)
                self.scheduler.propose(seq, seq.proposed_token_ids)
                self._proposing.append(seq)

    # ---- after the plan -------------------------------------------------------------------
    def take_plan(self, plan: SchedulerOutput) -> None:
        """Keep the proposals the plan computes (cut to those it computes); drop the others:
        a preempted sequence's are gone from the KV manager, an unscheduled one's are rolled
        back at the next plan."""
        if not self._proposing:
            return
        for seq in plan.preempted:
            seq.proposed_token_ids = []
        verified = set()
        for seq, sched in plan.scheduled:
            proposed = seq.proposed_token_ids
            if proposed:
                num_known = len(seq.token_ids)
                num_verified = sched.start + sched.num_tokens - num_known
                if sched.start == num_known - 1 and num_verified > 0:
                    del proposed[num_verified:]
                    verified.add(id(seq))
        for seq in self._proposing:
            if seq.proposed_token_ids and id(seq) not in verified:
                self.scheduler.accept(seq, 0)
                seq.proposed_token_ids = []
        self._proposing = []

    # ---- after the forward ----------------------------------------------------------------
    def sample_step(self, seqs: list[Sequence], rows: list[int], num_logits: list[int], logits: torch.Tensor,
                    first_samples: list[Sequence], result: EngineStep) -> None:
        """Sample a step in which some sequences verify proposals: ``seqs[i]`` (batch row
        ``rows[i]``) reads ``num_logits[i]`` consecutive rows of ``logits``. Plain rows go to
        the pipeline; verifying ones are verified, appended and finished here."""
        plain, verifying = [], []
        plain_rows, verifying_rows = [], []
        position = 0
        for i, count in enumerate(num_logits):
            if count == 1:
                plain.append(i)
                plain_rows.append(position)
            else:
                verifying.append(i)
                verifying_rows.extend(range(position, position + count))
            position += count
        if plain:
            index = to_device(int64_tensor(plain_rows), logits.device)
            self.pipeline.sample_step([seqs[i] for i in plain], [rows[i] for i in plain], logits[index],
                                      first_samples, result)
        if verifying:
            index = to_device(int64_tensor(verifying_rows), logits.device)
            self._verify([seqs[i] for i in verifying], [rows[i] for i in verifying], logits[index], result)

    def _verify(self, seqs: list[Sequence], rows: list[int], logits: torch.Tensor, result: EngineStep) -> None:
        proposals = [seq.proposed_token_ids for seq in seqs]
        counts = [len(proposed) + 1 for proposed in proposals]
        batch = self.batch
        sampling = batch.sampling_batch(int64_tensor([row for row, count in zip(rows, counts) for _ in range(count)]))
        flags = batch.flags.index_select(0, int64_tensor(rows)).tolist()
        position = 0
        masks = []
        for seq, flag, count in zip(seqs, flags, counts):
            if flag & PER_POSITION:
                self._add_per_position(sampling, position, seq, flag, count)
            if flag & GRAMMAR:
                masks.append(self.per_row.draft_bitmasks(seq, seq.proposed_token_ids))
                sampling.bitmask_rows.extend(range(position, position + count))
            position += count
        if masks:
            sampling.bitmask = torch.cat(masks)
        outputs, accepted, logprobs = verify(self.sampler, logits, sampling, proposals)
        self._finish(seqs, rows, flags, outputs, accepted, logprobs, result)

    def _back_off(self, seq: Sequence, num_accepted: int) -> None:
        """After a draft that kept nothing, the sequence stops proposing for a while, twice as
        long after each such draft in a row (``MAX_BACKOFF_TOKENS`` at most): proposals that
        keep failing cost a verification step of k + 1 tokens for one."""
        if num_accepted:
            seq.num_rejected_drafts = 0
            return
        seq.num_rejected_drafts += 1
        pause = min(1 << (seq.num_rejected_drafts - 1), MAX_BACKOFF_TOKENS)
        seq.proposes_from_output = len(seq.output_token_ids) + 1 + pause   # this step's token is not out yet
        self.stats.num_backoffs += 1

    def _add_per_position(self, sampling, first: int, seq: Sequence, flag: int, count: int) -> None:
        """A row's seeded draws, ``min_tokens`` and bad-word bans, penalties, logit biases and
        logprobs at each of its positions, as decoding one token a step would have them at each
        output number. Position i follows the proposals before it: it is sampled as if they were
        the outputs, and it counts only if they are (accepted)."""
        request = seq.request
        params = request.params
        num_outputs = len(seq.output_token_ids)
        min_tokens_bans = self.per_row.min_tokens_bans(params) if flag & MIN_TOKENS else []
        proposed = seq.proposed_token_ids
        for i in range(count):
            outputs = seq.output_token_ids + proposed[:i] if flag & (PENALTIES | BAD_WORDS) else None
            if flag & SEEDED:
                sampling.seeded_uniforms[first + i] = seeded_uniform(params.seed, seq.sample_index, num_outputs + i)
            bans = min_tokens_bans if num_outputs + i < params.min_tokens else []
            if flag & BAD_WORDS:
                bans = bans + bad_word_bans(outputs, request.bad_words_token_ids)
            if bans:
                sampling.banned.append((first + i, bans))
            if flag & PENALTIES:
                sampling.penalties.append(PenaltyRow(
                    first + i, request.prompt_token_ids if params.repetition_penalty != 1.0 else (), outputs,
                    params.repetition_penalty, params.frequency_penalty, params.presence_penalty))
            if flag & LOGIT_BIAS:
                sampling.add_logit_bias(first + i, params)
            if flag & LOGPROBS:
                sampling.num_logprobs.append((first + i, params.logprobs))

    def _finish(self, seqs: list[Sequence], rows: list[int], flags: list[int], outputs: list[list[int]],
                accepted: list[int], logprobs: list[list] | None, result: EngineStep) -> None:
        """Append each sequence's outputs one by one until one ends it (and their logprobs, where
        asked); tell the KV manager how many proposals it keeps; report the tokens as one
        ``StepTokens`` per output position."""
        stats = self.stats
        layers: list[StepTokens] = []
        ends: list[tuple[Sequence, str]] = []
        counts: list[int] = []
        eos, max_model_len = self.eos_token_ids, self.max_model_len
        for index, (seq, flag, output, num_accepted) in enumerate(zip(seqs, flags, outputs, accepted)):
            output_logprobs = logprobs[index] if logprobs is not None else None
            num_proposed = len(seq.proposed_token_ids)
            stats.num_drafts += 1
            stats.num_draft_tokens += num_proposed
            stats.num_accepted_tokens += num_accepted
            self._back_off(seq, num_accepted)
            per_pos = stats.num_accepted_tokens_per_pos
            if len(per_pos) < num_proposed:
                per_pos.extend([0] * (num_proposed - len(per_pos)))
            for i in range(num_accepted):
                per_pos[i] += 1
            params = seq.request.params
            num_known = len(seq.token_ids)
            reason = None
            for i, token_id in enumerate(output):
                seq.append_token(token_id)
                if len(layers) == i:
                    layers.append(StepTokens([], [], text_positions=[]))
                layer = layers[i]
                if flag & TEXT:
                    layer.text_positions.append(len(layer.seqs))
                if output_logprobs is not None and output_logprobs[i] is not None:
                    seq.logprobs.append(output_logprobs[i])
                    if layer.logprobs is None:
                        layer.logprobs = [None] * len(layer.seqs)
                if layer.logprobs is not None:
                    layer.logprobs.append(None if output_logprobs is None else output_logprobs[i])
                layer.seqs.append(seq)
                layer.token_ids.append(token_id)
                reason = check_stop(params, seq.output_token_ids, eos, seq.num_prompt_tokens, max_model_len)
                by_token = True
                if reason is None and flag & GRAMMAR:   # complete ("stop"), or broken ("abort")
                    reason, by_token = self.per_row.advance_grammar(seq, token_id), False
                if reason is not None:
                    layer.finished.append(SeqFinish(seq, reason, by_token))
                    ends.append((seq, reason))
                    break
            num_kept = len(seq.token_ids) - num_known
            counts.append(num_kept)
            kept_proposals = min(num_kept, num_accepted)
            self.scheduler.accept(seq, kept_proposals)
            if num_kept > num_accepted:
                self.scheduler.append_token(seq, output[-1])
            seq.num_computed = num_known + kept_proposals   # the KV kept: up to the last accepted proposal
            seq.proposed_token_ids = []
            if reason is None and flag & MIN_TOKENS:
                self.batch.refresh_flags(seq)
        self.batch.add_outputs(rows, counts)
        self.pipeline.num_generated_tokens += sum(counts)
        for layer in layers:
            if len(layer.text_positions) == len(layer.seqs):
                layer.text_positions = None
        result.tokens.extend(layers)
        for seq, reason in ends:
            seq.finish_reason = reason
            self._end_sequence(seq)
        self._release_if_idle()
