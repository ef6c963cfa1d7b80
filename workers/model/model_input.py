"""One step's forward pass as the runner takes and returns it: the chunks to compute
(``ModelInput``), their flattened tensors (``FlatBatch``, ``flatten``), and the logits and
scores that come back (``ExecuteOutput``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .block_tables import BlockTableRows
from .host_lists import int64_tensor


@dataclass
class ScoreRequest:
    """Prompt logprobs from a chunk's forward: position ``start + i`` of chunk ``index``
    scores ``token_ids[i]``, with ``num_top_logprobs`` alternatives each."""

    index: int
    token_ids: list[int]
    num_top_logprobs: int


@dataclass
class ModelInput:
    """One step's forward pass, as parallel lists over its chunks (host data).

    Chunk i computes ``num_tokens[i]`` tokens from position ``starts[i]`` of the
    sequence whose block table is row ``rows[i]`` of the runner's
    ``BlockTableRows``; ``input_ids`` are the chunks' tokens, flattened. A
    decode-only step (one token per chunk, every chunk sampling) leaves
    ``num_tokens`` and ``logits_indexes`` None. An ``input_ids`` entry listed in
    ``pending`` is ``PENDING_TOKEN``, to be taken from the running step's sampled ids
    on the device. ``table_updates`` (row, whole
    table, first changed entry) bring rows up to date before the forward:
    entries before the first changed one are those the row already holds.
    """

    rows: list[int]
    starts: list[int]
    input_ids: list[int]
    table_updates: list[tuple[int, list[int], int]]
    num_tokens: list[int] | None = None
    logits_indexes: list[int] | None = None    # chunks that sample; None: all
    scores: list[ScoreRequest] | None = None
    # Tokens sampled by the step still running: (position in input_ids, its row in that
    # step's sampled ids), taken on the device (overlapped scheduling).
    pending: list[tuple[int, int]] | None = None
    # Per sampling chunk, in logits order: the positions at its end whose logits come back (a
    # verification chunk's last token and proposals). None: one each.
    num_logits: list[int] | None = None

    @property
    def num_chunks(self) -> int:
        return len(self.rows)

    @property
    def is_decode_only(self) -> bool:
        return self.num_tokens is None


@dataclass
class TokenScores:
    """Logprobs of scored tokens ([n]) and the top alternatives ([n, k]), on the CPU."""

    logprobs: torch.Tensor
    top_ids: torch.Tensor
    top_logprobs: torch.Tensor


@dataclass
class ExecuteOutput:
    """One forward pass: logits of the sampling chunks ([num_sampling, vocab], float32; a
    chunk's ``num_logits`` rows, in position order, where it asks for several), the scores
    asked for, by chunk index, and the last hidden states of every token where the runner
    keeps them (``keep_hidden_states``: an EAGLE head reads them)."""

    logits: torch.Tensor
    scores: dict[int, TokenScores]
    hidden_states: torch.Tensor | None = None


@dataclass
class FlatBatch:
    """A step's chunks flattened into one varlen batch (host tensors, except
    ``block_tables``, which is on the model's device)."""

    input_ids: torch.Tensor      # [num_tokens] int64
    positions: torch.Tensor      # [num_tokens] int64
    cu_seqlens: torch.Tensor     # [num_seqs + 1] int32
    seq_lens: torch.Tensor       # [num_seqs] int32
    slot_mapping: torch.Tensor   # [num_tokens] int64
    block_tables: torch.Tensor   # [num_seqs, max_blocks] int32

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


def flatten(model_input: ModelInput, block_tables: BlockTableRows, block_size: int) -> FlatBatch:
    """The forward pass's inputs in tensor ops: O(1) Python per chunk (the lists' copies)
    plus O(changed table entries)."""
    block_tables.write(model_input.table_updates)
    rows = int64_tensor(model_input.rows)
    starts = int64_tensor(model_input.starts)
    num_chunks = len(model_input.rows)
    if model_input.num_tokens is None:
        positions = starts
        token_rows = rows
        seq_lens = starts + 1
        cu_seqlens = torch.arange(num_chunks + 1, dtype=torch.int32)
    else:
        num_tokens = int64_tensor(model_input.num_tokens)
        ends = torch.cumsum(num_tokens, 0)
        cu_seqlens = torch.zeros(num_chunks + 1, dtype=torch.int32)
        cu_seqlens[1:] = ends
        total = int(ends[-1])
        token_rows = torch.repeat_interleave(rows, num_tokens, output_size=total)
        # Each token's offset in its chunk, added to its chunk's start.
        offsets = torch.arange(total, dtype=torch.int64) - torch.repeat_interleave(
            ends - num_tokens, num_tokens, output_size=total)
        positions = torch.repeat_interleave(starts, num_tokens, output_size=total) + offsets
        seq_lens = starts + num_tokens
    max_blocks = -(-int(seq_lens.max()) // block_size) if num_chunks else 1
    tables = block_tables.gather(rows, max(max_blocks, 1))
    host = block_tables.host
    slot_mapping = host[token_rows, positions // block_size].to(torch.int64) * block_size + positions % block_size
    return FlatBatch(int64_tensor(model_input.input_ids), positions, cu_seqlens,
                     seq_lens.to(torch.int32), slot_mapping, tables)
