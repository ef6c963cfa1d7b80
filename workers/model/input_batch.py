"""The persistent batch: every running sequence owns a row from the step it is first
scheduled until it finishes, is preempted or migrates.

A row holds the sequence's block table (``BlockTableRows``) and, in host tensors,
what sampling and the finish checks need every step: temperature, top-k/p, min-p,
the outputs generated so far and the most it may generate, whether EOS ends it,
and flags for the features only some sequences use. They are written once, when
the row is taken; a step reads its rows with one gather per tensor, so work per
step that is proportional to the number of sequences happens in tensor ops, not
in Python. Only the rows whose flags say they need more (penalties, seeds,
grammars, logprobs, stop token ids, ``min_tokens``, a pending fork or KV export,
beam search) are looked at one by one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..engine.request import Sequence
from ..sample.sampler import PenaltyRow, SamplingBatch, seeded_uniform
from .block_tables import BlockTableRows
from .host_lists import int64_tensor

# Row flags: features a sequence uses that the step looks at in Python.
RANDOM = 1          # sampled, not greedy (no Python: dense parameters)
PENALTIES = 2
SEEDED = 4
MIN_TOKENS = 8      # EOS and stop tokens banned until min_tokens outputs exist
LOGPROBS = 16
GRAMMAR = 32
STOP_TOKEN_IDS = 64
FORKS = 128         # n > 1: the samples fork at the first token
EXPORTS_KV = 256    # disaggregated prefill: the prompt's KV is kept at the first token
TEXT = 512          # its text is followed token by token (streamed, or has stop strings)
BEAM = 1024         # a beam of a beam search: its logits go to its group, not to sampling
LOGIT_BIAS = 2048   # logit_bias or allowed_token_ids
BAD_WORDS = 4096
# Any of these sends the row through the per-row path of the step's sampling.
PER_ROW = (PENALTIES | SEEDED | MIN_TOKENS | LOGPROBS | GRAMMAR | STOP_TOKEN_IDS | FORKS | EXPORTS_KV | BEAM
           | LOGIT_BIAS | BAD_WORDS)


@dataclass
class StepRows:
    """A step's sampling rows, in the order of its logits rows: the sequences (one
    per logits row), their batch rows as an int64 CPU tensor, and their flags."""

    seqs: list[Sequence]
    rows: torch.Tensor
    flags: torch.Tensor

    @property
    def per_row_positions(self) -> list[int]:
        """Positions whose sequences need the per-row path."""
        return (self.flags & PER_ROW).nonzero().squeeze(1).tolist()


class InputBatch:
    """Rows of the running sequences; see the module docstring.

    ``add`` gives a sequence its row (and writes its parameters), ``remove``
    takes it back. ``eos_token_ids`` and ``max_model_len`` are the model's:
    they decide, with each request's params, when a row's sequence finishes.
    """

    def __init__(self, block_tables: BlockTableRows, eos_token_ids: list[int], max_model_len: int) -> None:
        self.block_tables = block_tables
        self.max_model_len = max_model_len
        self.eos_token_ids = torch.tensor(eos_token_ids or [-1], dtype=torch.int64)
        self.num_row_releases = 0
        self._allocate(block_tables.num_rows)

    def _allocate(self, num_rows: int) -> None:
        old = getattr(self, "flags", None)
        # temperature (1 when greedy), top_p, min_p
        sampling = torch.ones((num_rows, 3), dtype=torch.float32)
        sampling[:, 2] = 0.0
        top_k = torch.full((num_rows,), -1, dtype=torch.int64)
        flags = torch.zeros(num_rows, dtype=torch.int32)
        num_outputs = torch.zeros(num_rows, dtype=torch.int32)
        max_outputs = torch.zeros(num_rows, dtype=torch.int32)
        stops_on_eos = torch.zeros(num_rows, dtype=torch.bool)
        if old is not None:
            n = old.shape[0]
            sampling[:n], top_k[:n], flags[:n] = self.sampling, self.top_k, self.flags
            num_outputs[:n], max_outputs[:n] = self.num_outputs, self.max_outputs
            stops_on_eos[:n] = self.stops_on_eos
        self.sampling, self.top_k, self.flags = sampling, top_k, flags
        self.num_outputs, self.max_outputs, self.stops_on_eos = num_outputs, max_outputs, stops_on_eos

    # ---- rows ---------------------------------------------------------------------------
    def add(self, seq: Sequence) -> int:
        """Give ``seq`` a row and write its parameters; returns the row."""
        row = self.block_tables.take_row(seq.seq_id)
        if row >= self.flags.shape[0]:
            self._allocate(self.block_tables.num_rows)
        request = seq.request
        params = request.params
        is_greedy = params.is_greedy
        self.sampling[row, 0] = 1.0 if is_greedy else params.temperature
        self.sampling[row, 1] = params.top_p
        self.sampling[row, 2] = params.min_p
        self.top_k[row] = params.top_k
        self.num_outputs[row] = len(seq.output_token_ids)
        self.max_outputs[row] = min(params.max_tokens, self.max_model_len - len(request.prompt_token_ids))
        self.stops_on_eos[row] = not params.ignore_eos
        self.flags[row] = self._flags_of(seq)
        seq.batch_row = row
        return row

    def remove(self, seq: Sequence) -> None:
        """Take back ``seq``'s row (nothing if it holds none)."""
        if seq.batch_row >= 0:
            self.num_row_releases += 1
        self.block_tables.release(seq.seq_id)
        seq.batch_row = -1

    def refresh_flags(self, seq: Sequence) -> None:
        """Re-read a row's flags after its sequence changed (forked, exported, past min_tokens)."""
        if seq.batch_row >= 0:
            self.flags[seq.batch_row] = self._flags_of(seq)

    @staticmethod
    def _flags_of(seq: Sequence) -> int:
        request = seq.request
        params = request.params
        if params.use_beam_search:
            return BEAM
        flags = 0 if params.is_greedy else RANDOM
        if params.has_penalties:
            flags |= PENALTIES
        if params.seed is not None and not params.is_greedy:
            flags |= SEEDED
        if len(seq.output_token_ids) < params.min_tokens:
            flags |= MIN_TOKENS
        if params.logprobs is not None:
            flags |= LOGPROBS
        if seq.grammar is not None:
            flags |= GRAMMAR
        if params.stop_token_ids:
            flags |= STOP_TOKEN_IDS
        if params.biases_logits:
            flags |= LOGIT_BIAS
        if request.bad_words_token_ids:
            flags |= BAD_WORDS
        if params.n > 1 and len(request.seqs) < params.n:
            flags |= FORKS
        if request.export_kv:
            flags |= EXPORTS_KV
        if request.follows_text:
            flags |= TEXT
        return flags

    # ---- a step ---------------------------------------------------------------------------
    def step_rows(self, seqs: list[Sequence], rows: list[int]) -> StepRows:
        row_index = int64_tensor(rows)
        return StepRows(seqs, row_index, self.flags.index_select(0, row_index))

    def sampling_batch(self, rows: torch.Tensor) -> SamplingBatch:
        """The dense part of the sampling parameters of ``rows`` (the sparse lists empty)."""
        sampling = self.sampling.index_select(0, rows)
        flags = self.flags.index_select(0, rows)
        return SamplingBatch(temperature=sampling[:, 0], top_k=self.top_k.index_select(0, rows),
                             top_p=sampling[:, 1], min_p=sampling[:, 2], is_greedy=(flags & RANDOM) == 0)

    def add_per_row(self, batch: SamplingBatch, position: int, seq: Sequence, flags: int,
                    banned_token_ids: list[int]) -> None:
        """Fill ``batch``'s sparse entries for one sampling row (its sequence ``seq``)."""
        params = seq.request.params
        if flags & PENALTIES:
            batch.penalties.append(PenaltyRow(
                position, seq.request.prompt_token_ids if params.repetition_penalty != 1.0 else (),
                seq.output_token_ids, params.repetition_penalty, params.frequency_penalty,
                params.presence_penalty))
        if flags & SEEDED:
            batch.seeded_uniforms[position] = seeded_uniform(params.seed, seq.sample_index,
                                                             len(seq.output_token_ids))
        if banned_token_ids:   # min_tokens' and bad words'
            batch.banned.append((position, banned_token_ids))
        if flags & LOGPROBS:
            batch.num_logprobs.append((position, params.logprobs))
        if flags & LOGIT_BIAS:
            batch.add_logit_bias(position, params)

    def count_samples(self, rows: torch.Tensor) -> torch.Tensor:
        """Count one more sampled output on each of ``rows`` (int64, CPU) and return a bool
        per row: it was the last its sequence may have (its ``max_tokens``, or the model's
        context), so the sequence ends with it, whatever its value."""
        num_outputs = self.num_outputs.index_select(0, rows) + 1
        self.num_outputs.index_copy_(0, rows, num_outputs)
        return num_outputs >= self.max_outputs.index_select(0, rows)

    def add_outputs(self, rows: list[int], counts: list[int]) -> None:
        """Count ``counts[i]`` more outputs on ``rows[i]`` (a verification step's, several a row)."""
        index = int64_tensor(rows)
        self.num_outputs.index_add_(0, index, torch.tensor(counts, dtype=self.num_outputs.dtype))

    def ends_on_eos(self, rows: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """A bool per row: its sampled id (``token_ids``, CPU) is an EOS that ends it. Stop
        token ids are checked per row (``STOP_TOKEN_IDS``)."""
        return torch.isin(token_ids, self.eos_token_ids) & self.stops_on_eos.index_select(0, rows)

    def check(self, running: list[Sequence]) -> None:
        """Raise unless exactly the running sequences hold rows, each the one it says."""
        self.block_tables.check({seq.seq_id for seq in running})
        for seq in running:
            row = self.block_tables.row_of(seq.seq_id)
            if row is not None and row != seq.batch_row:
                raise RuntimeError(f"{seq.seq_id}: holds row {row} but records row {seq.batch_row}")
