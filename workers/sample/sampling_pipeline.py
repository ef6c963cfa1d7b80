"""From a step's logits to tokens on its sequences, and the finishes they cause.

Each step's sampling rows become a ``SampledStep``. Its ids are either read at
once and finished, or, with overlapped scheduling, left on the device
(launched): every sequence gets a pending token, which the next step computes
from the device's copy, and the ids are read and filled in (resolved) once that
next step is launched. Finishing appends the tokens, finds the sequences that
end (tensor ops on the persistent batch; ``check_stop`` only for candidates)
and records both in the step's ``EngineStep``.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from pagedserve.kvmanager import PENDING_TOKEN

from ..engine.beam_groups import BeamGroups, NewSequence
from ..engine.request import Sequence
from ..engine.scheduler import Scheduler
from ..model.host_lists import int64_tensor, to_device
from ..model.input_batch import BEAM, FORKS, PER_ROW, RANDOM, TEXT, InputBatch
from ..outputs.detokenizer import check_stop
from ..outputs.output_processor import EngineStep, SeqFinish, StepTokens
from .per_row_features import Ends, PerRowFeatures
from .sampled_step import SampledStep, TokenReadback
from .sampler import Sampler


class SamplingPipeline:
    """Samples a step's rows and finishes them, now or (overlapped) one step later.

    The engine calls ``sample_step`` once per step that samples, ``resolve_in_flight``
    when a step's ids are needed before the next launch, and ``drop_pending`` for
    every sequence it ends. ``end_sequence(seq)`` ends a sequence whose
    ``finish_reason`` is set; ``release_if_idle()`` hands blocks back when no request
    is left. ``num_generated_tokens`` counts every token sampled (beams included).
    """

    def __init__(self, *, batch: InputBatch, scheduler: Scheduler, sampler: Sampler, beam_groups: BeamGroups,
                 per_row: PerRowFeatures, readback: TokenReadback, eos_token_ids: list[int], max_model_len: int,
                 async_scheduling: bool, new_sequence: NewSequence, end_sequence: Callable[[Sequence], None],
                 release_if_idle: Callable[[], None]) -> None:
        self.batch = batch
        self.scheduler = scheduler
        self.sampler = sampler
        self.beam_groups = beam_groups
        self.per_row = per_row
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.async_scheduling = async_scheduling
        self._readback = readback
        self._new_sequence = new_sequence
        self._end_sequence = end_sequence
        self._release_if_idle = release_if_idle
        self._in_flight: SampledStep | None = None
        self.num_launched_steps = 0   # steps whose ids stayed on the device (overlapped scheduling)
        self.num_ended = 0   # sequences ended (finished, aborted, stopped): a step's samples of them are dropped
        self.num_generated_tokens = 0
        # Requests whose first token was sampled, and the seconds from their arrival to it, summed.
        self.num_first_tokens = 0
        self.first_token_seconds = 0.0

    # ---- the engine's calls -------------------------------------------------------------------
    @property
    def in_flight(self) -> SampledStep | None:
        """The launched step whose ids are not read yet (overlapped scheduling), if any."""
        return self._in_flight

    @property
    def in_flight_tokens(self) -> torch.Tensor | None:
        """The running step's sampled ids on the device, for the next step's pending inputs."""
        return self._in_flight.token_tensor if self._in_flight is not None else None

    def sample_step(self, seqs: list[Sequence], rows: list[int], logits: torch.Tensor,
                    first_samples: list[Sequence], result: EngineStep) -> None:
        """Sample this step's rows (``logits`` row i for ``seqs[i]`` on batch row ``rows[i]``),
        then launch them or finish them at once, and resolve the step launched before."""
        sampled = self._sample(seqs, rows, logits, first_samples, result)
        previous = self._in_flight
        if not sampled.seqs:
            self._release_if_idle()  # every row was a beam, taken by its group
        elif sampled.token_ids is None:
            self._launch(sampled)
        else:
            self._finish(sampled, result)
        if previous is not None:
            # Its ids are ready (this step is queued behind it). Sequences it ends drop the
            # pending token the launch just gave them.
            if self._in_flight is previous:   # this step's ids were read at once: nothing is in flight
                self._in_flight = None
            self._resolve(result, previous)

    def resolve_in_flight(self, result: EngineStep) -> None:
        """Read and finish the running step, if one is in flight."""
        if self._in_flight is not None:
            self._resolve(result)

    def drop_pending(self, seq: Sequence) -> None:
        """``seq`` ends now: it forgets the tokens a still-running step was computing for
        it, and that step's sample of it will be dropped."""
        self.num_ended += 1
        while seq.output_token_ids and seq.output_token_ids[-1] == PENDING_TOKEN:
            seq.output_token_ids.pop()
            seq.token_ids.pop()

    # ---- sampling ----------------------------------------------------------------------------
    def _sample(self, seqs: list[Sequence], rows: list[int], logits: torch.Tensor,
                first_samples: list[Sequence], result: EngineStep) -> SampledStep:
        """Sample one token per sequence (n per sequence whose samples fork now). The
        parameters are gathered from the persistent batch; only rows flagged as needing
        more are visited one by one, and those need the running step's ids first. With
        overlapped scheduling and no such row, the ids stay on the device (``token_ids``
        None) for ``_launch``; otherwise they are read here."""
        num_ended = self.num_ended
        step_rows = self.batch.step_rows(seqs, rows)
        row_index, flags = step_rows.rows, step_rows.flags
        per_row = step_rows.per_row_positions
        if per_row and self._in_flight is not None:
            self._resolve(result)  # penalties, grammars and forks read the sequences' last tokens
        forked: list[tuple[Sequence, Sequence]] = []
        flag_values = None
        if per_row:
            flag_values = flags.tolist()
            if bool((flags & BEAM).any()):
                seqs, logits, row_index, flags = self._take_beam_rows(seqs, logits, row_index, flags,
                                                                      flag_values, result)
                flag_values = flags.tolist()
                per_row = [p for p, value in enumerate(flag_values) if value & PER_ROW]
            if any(flag_values[p] & FORKS for p in per_row):
                seqs, index = self._fork(seqs, flag_values, forked)
                index_tensor = int64_tensor(index)
                logits = logits[to_device(index_tensor, logits.device)]
                row_index, flags = row_index[index_tensor], flags[index_tensor]
                flag_values = flags.tolist()
                per_row = [p for p, value in enumerate(flag_values) if value & PER_ROW]
        sampled = SampledStep(seqs, row_index, flags, logits, first_samples, per_row=per_row,
                              flag_values=flag_values, forked=forked, num_ended=num_ended)
        if not per_row and not bool((flags & RANDOM).any()):
            sampled.token_tensor = self.sampler.greedy(logits)   # greedy, unconstrained: the common case
        elif not per_row:
            sampled.token_tensor = self.sampler.sample_tokens(logits, self.batch.sampling_batch(row_index))
        else:
            batch = self.batch.sampling_batch(row_index)
            self.per_row.add_to_batch(batch, seqs, per_row, flag_values)
            output = self.sampler.sample_batch(logits, batch)
            sampled.token_tensor, sampled.token_ids = output.token_tensor, output.token_ids
            sampled.logprobs = output.logprobs if batch.num_logprobs else None
        if sampled.token_ids is None and not self.async_scheduling:
            sampled.token_ids = sampled.token_tensor.tolist()
        return sampled

    def _take_beam_rows(self, seqs: list[Sequence], logits: torch.Tensor, row_index: torch.Tensor,
                        flags: torch.Tensor, flag_values: list[int], result: EngineStep):
        """Hand the beam-search rows to their groups (``BeamGroups``); the other rows'
        sequences, logits, batch rows and flags go on to sampling."""
        beam = [p for p, value in enumerate(flag_values) if value & BEAM]
        rest = [p for p, value in enumerate(flag_values) if not value & BEAM]
        index = int64_tensor(beam)
        result.final_outputs.extend(self.beam_groups.advance([seqs[p] for p in beam],
                                                             logits[to_device(index, logits.device)]))
        self.num_generated_tokens += len(beam)
        index = int64_tensor(rest)
        return [seqs[p] for p in rest], logits[to_device(index, logits.device)], row_index[index], flags[index]

    def _fork(self, seqs: list[Sequence], flag_values: list[int],
              forked: list[tuple[Sequence, Sequence]]) -> tuple[list[Sequence], list[int]]:
        """The first token of an n > 1 request: its n samples share the prompt's blocks
        and sample from the same logits row. Returns the sampling rows' sequences and,
        per row, the logits row it reads."""
        owners: list[Sequence] = []
        index: list[int] = []
        for p, seq in enumerate(seqs):
            owners.append(seq)
            index.append(p)
            request = seq.request
            if flag_values[p] & FORKS and len(request.seqs) == 1 and not seq.output_token_ids:
                for sample_index in range(1, request.params.n):
                    child = self._new_sequence(request, sample_index, list(seq.token_ids))
                    forked.append((seq, child))
                    owners.append(child)
                    index.append(p)
        return owners, index

    # ---- overlapped steps ---------------------------------------------------------------------
    def _launch(self, sampled: SampledStep) -> None:
        """Leave a step's ids on the device and go on: each sequence gets a pending token,
        which the next step computes from the device's copy and ``_resolve`` fills in. A
        sequence whose sample is the last it may have gets none: it ends with it."""
        seqs = sampled.seqs
        sampled.last = self.batch.count_samples(sampled.rows).nonzero().squeeze(1).tolist()
        positions = []
        for index, seq in enumerate(seqs):
            positions.append(len(seq.token_ids))
            seq.pending_source = index
            seq.token_ids.append(PENDING_TOKEN)
            seq.output_token_ids.append(PENDING_TOKEN)
        pending = seqs
        if sampled.last:
            for p in sampled.last:
                seqs[p].token_ids.pop()
                seqs[p].output_token_ids.pop()
                positions[p] = -1
            pending = [seq for seq, position in zip(seqs, positions) if position >= 0]
        self.scheduler.append_tokens(pending, [PENDING_TOKEN] * len(pending))
        sampled.positions = positions
        sampled.num_row_releases = self.batch.num_row_releases
        sampled.readback = self._readback.start(sampled.token_tensor)
        self._in_flight = sampled
        self.num_launched_steps += 1

    def _resolve(self, result: EngineStep, sampled: SampledStep | None = None) -> None:
        """Read a launched step's ids (the running one by default) and finish it: the
        pending tokens get their values (a sequence's last token is appended). Sequences
        that ended since the launch (a finish found meanwhile, an abort, a stop string)
        drop their sample."""
        if sampled is None:
            sampled, self._in_flight = self._in_flight, None
        sampled.token_ids, sampled.host_tokens = self._readback.read(sampled.readback)
        self._drop_ended(sampled)
        seqs, positions, last, token_ids = sampled.seqs, sampled.positions, sampled.last, sampled.token_ids
        resolved_seqs, resolved_ids = seqs, token_ids
        if last:
            resolved_seqs = [seq for seq, position in zip(seqs, positions) if position >= 0]
            resolved_ids = [t for t, position in zip(token_ids, positions) if position >= 0]
        for seq, position, token_id in zip(seqs, positions, token_ids):
            if position < 0:
                seq.token_ids.append(token_id)
                seq.output_token_ids.append(token_id)
            else:
                seq.token_ids[position] = token_id
                seq.output_token_ids[position - seq.num_prompt_tokens] = token_id
        self.scheduler.resolve_tokens(resolved_seqs, resolved_ids)
        self._finish(sampled, result, is_resolved=True)

    def _drop_ended(self, sampled: SampledStep) -> None:
        """Drop the samples of sequences that ended since the step was planned."""
        if self.num_ended != sampled.num_ended:
            kept = [p for p, seq in enumerate(sampled.seqs) if not seq.is_finished]
            if len(kept) < len(sampled.seqs):
                sampled.keep(kept)

    # ---- finishing ---------------------------------------------------------------------------
    def _finish(self, sampled: SampledStep, result: EngineStep, is_resolved: bool = False) -> None:
        """Account for a step's samples: append them (unless resolved from pending tokens),
        find the sequences that end, and record both in ``result``. Per sequence this is
        two list appends; the finish checks are tensor ops on the persistent batch."""
        if not is_resolved:
            token_tensor = sampled.token_tensor
            sampled.host_tokens = (token_tensor if token_tensor.device.type == "cpu"
                                   else int64_tensor(sampled.token_ids))
            self._drop_ended(sampled)  # ended while the step's previous one was read
        seqs, token_ids, host_tokens = sampled.seqs, sampled.token_ids, sampled.host_tokens
        for parent, child in sampled.forked:
            self.scheduler.fork(parent, child)
        if not is_resolved:
            for seq, token_id in zip(seqs, token_ids):
                seq.token_ids.append(token_id)
                seq.output_token_ids.append(token_id)
            self.scheduler.append_tokens(seqs, token_ids)
        self.num_generated_tokens += len(seqs)
        rows, per_row = sampled.rows, sampled.per_row
        if is_resolved:
            candidates = set(sampled.last)   # counted at the launch
            if sampled.num_row_releases != self.batch.num_row_releases:
                # Rows were released since the launch: read only rows still held by the same
                # sequence; the others (preempted meanwhile) are checked one by one.
                held = [p for p, seq in enumerate(seqs) if seq.batch_row == int(rows[p])]
                candidates.update(p for p in range(len(seqs)) if seq_row_lost(seqs[p], int(rows[p])))
                index = torch.tensor(held, dtype=torch.int64)
                eos = self.batch.ends_on_eos(rows[index], host_tokens[index]).nonzero().squeeze(1).tolist()
                candidates.update(held[i] for i in eos)
            else:
                candidates.update(self.batch.ends_on_eos(rows, host_tokens).nonzero().squeeze(1).tolist())
        else:
            ends_now = self.batch.count_samples(rows) | self.batch.ends_on_eos(rows, host_tokens)
            candidates = ends_now.nonzero().squeeze(1).tolist()
        ends: Ends = {}
        if candidates:
            self._check_ends(seqs, sorted(candidates), ends)
        if per_row:
            self.per_row.after_sampling(seqs, token_ids, sampled.logprobs, per_row, sampled.flag_values, ends)
        now = time.time()
        for seq in sampled.first_samples:
            metrics = seq.request.metrics
            if metrics.first_token_time is None and seq.output_token_ids:
                metrics.first_token_time = now
                self.num_first_tokens += 1
                self.first_token_seconds += now - metrics.arrival_time
        for parent, _ in sampled.forked:
            self.batch.refresh_flags(parent)
        tokens = StepTokens(seqs, token_ids, sampled.logprobs)
        for p, (reason, by_token) in ends.items():
            seq = seqs[p]
            seq.finish_reason = reason
            self._end_sequence(seq)
            tokens.finished.append(SeqFinish(seq, reason, by_token))
        text = sampled.flags & TEXT
        if not bool(text.any()):
            tokens.text_positions = []
        elif not bool(text.all()):
            tokens.text_positions = text.nonzero().squeeze(1).tolist()
        result.tokens.append(tokens)
        self._release_if_idle()

    def _check_ends(self, seqs: list[Sequence], positions: list[int], ends: Ends) -> None:
        """``check_stop`` decides, for the candidates the batch's counters found (or
        sequences without a row), whether and why each ends."""
        eos, max_model_len = self.eos_token_ids, self.max_model_len
        for p in positions:
            seq = seqs[p]
            reason = check_stop(seq.request.params, seq.output_token_ids, eos, seq.num_prompt_tokens, max_model_len)
            if reason is not None:
                ends[p] = (reason, True)


def seq_row_lost(seq: Sequence, row: int) -> bool:
    """The sequence no longer holds ``row``, the row it sampled from (preempted since)."""
    return seq.batch_row != row
