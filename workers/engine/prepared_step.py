"""A step's forward input, built from the scheduler's plan and the persistent batch.

On a decode step this is O(1) Python per sequence (no per-sequence objects): a
token id, a row and a start. A sequence new to the batch, a prefill chunk,
prompt logprobs or imported KV take the longer path.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

from pagedserve.kvmanager import PENDING_TOKEN, ScheduledSeq

from ..model.input_batch import InputBatch
from ..model.model_input import ModelInput, ScoreRequest
from .request import Sequence
from .scheduler import SchedulerOutput


class PreparedStep(NamedTuple):
    """A step ready to run: the forward's input, then what the engine needs after it.

    ``sampling_seqs[i]`` samples from logits row i, its batch row ``sampling_rows[i]``;
    ``scored`` maps a chunk index to the sequence whose prompt logprobs it computes and
    the first position scored; ``first_samples`` are the sequences that may sample
    their first token this step. With ``num_logits`` (a step verifying proposals),
    ``sampling_seqs[i]`` reads ``num_logits[i]`` consecutive rows of logits instead: its
    last token's and its proposals' (``Sequence.proposed_token_ids``).
    """

    model_input: ModelInput
    sampling_seqs: list[Sequence]
    sampling_rows: list[int]
    scored: dict[int, tuple[Sequence, int]]
    first_samples: list[Sequence]
    num_logits: list[int] | None = None


def prepare_step(plan: SchedulerOutput, batch: InputBatch,
                 on_admitted: Callable[[Sequence, ScheduledSeq], None]) -> PreparedStep:
    """The step of ``plan``: sequences without a batch row get one (``batch.add``), and
    ``on_admitted(seq, sched)`` runs for each before its input is built. A token still
    being sampled by the running step (``PENDING_TOKEN``) is listed in the input's
    ``pending``, to be taken from that step's ids on the device. A sequence holding
    proposed tokens (all of them scheduled) computes its last token and them in one
    chunk, and gets the logits of every one of its positions."""
    rows: list[int] = []
    starts: list[int] = []
    input_ids: list[int] = []
    updates: list[tuple[int, list[int], int]] = []
    num_tokens: list[int] | None = None
    logits_indexes: list[int] | None = None
    scores: list[ScoreRequest] = []
    scored: dict[int, tuple[Sequence, int]] = {}
    sampling_seqs: list[Sequence] = []
    sampling_rows: list[int] = []
    first_samples: list[Sequence] = []   # sequences that may sample their first token
    pending: list[tuple[int, int]] = []  # (input position, sampling row of the running step)
    num_logits: list[int] | None = None  # per sampling chunk, when one verifies proposals
    for index, (seq, sched) in enumerate(plan.scheduled):
        row = seq.batch_row
        table = sched.block_table
        if row < 0:
            row = batch.add(seq)
            updates.append((row, table, 0))
            first_samples.append(seq)
            on_admitted(seq, sched)
        elif sched.first_changed_block < len(table):
            updates.append((row, table, sched.first_changed_block))
        rows.append(row)
        start = sched.start
        starts.append(start)
        tokens = seq.token_ids
        if sched.num_tokens == 1 and start + 1 == len(tokens):
            token = tokens[start]
            if token == PENDING_TOKEN:  # sampled by the step still running: its id is on the device
                pending.append((len(input_ids), seq.pending_source))
            input_ids.append(token)
            sampling_seqs.append(seq)
            sampling_rows.append(row)
            if num_tokens is not None:
                num_tokens.append(1)
            if logits_indexes is not None:
                logits_indexes.append(index)
            if num_logits is not None:
                num_logits.append(1)
            continue
        proposed = seq.proposed_token_ids
        if proposed:  # verification: the last known token and the proposals after it
            num_verified = len(proposed) + 1
            if num_tokens is None:
                num_tokens = [1] * index
            num_tokens.append(num_verified)
            if num_logits is None:
                num_logits = [1] * len(sampling_seqs)
            num_logits.append(num_verified)
            input_ids.append(tokens[start])
            input_ids.extend(proposed)
            sampling_seqs.append(seq)
            sampling_rows.append(row)
            if logits_indexes is not None:
                logits_indexes.append(index)
            continue
        # A prefill chunk (or a single token that does not sample).
        end = start + sched.num_tokens
        if sched.num_tokens != 1 and num_tokens is None:
            num_tokens = [1] * index
        if num_tokens is not None:
            num_tokens.append(sched.num_tokens)
        samples = end == len(tokens)
        if not samples and logits_indexes is None:
            logits_indexes = list(range(index))
        if samples:
            sampling_seqs.append(seq)
            sampling_rows.append(row)
            first_samples.append(seq)
            if logits_indexes is not None:
                logits_indexes.append(index)
            if num_logits is not None:
                num_logits.append(1)
        input_ids.extend(tokens[start:end])
        request = seq.request
        if request.needs_prompt_logprobs and seq.sample_index == 0:
            # Position p scores token p + 1, up to the prompt's last token.
            scores.append(ScoreRequest(index, tokens[start + 1:min(end + 1, seq.num_prompt_tokens)],
                                       request.params.prompt_logprobs))
            scored[index] = (seq, start + 1)
    model_input = ModelInput(rows, starts, input_ids, updates, num_tokens, logits_indexes, scores or None,
                             pending or None, num_logits)
    return PreparedStep(model_input, sampling_seqs, sampling_rows, scored, first_samples, num_logits)
