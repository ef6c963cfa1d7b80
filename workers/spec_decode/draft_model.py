"""The "draft_model" method: a smaller model with the target's vocabulary proposes its greedy
continuation, k tokens a step, for every proposing sequence in one forward per token.

Its KV lives in the target's blocks: block b of the pool holds the target's K/V in the
target's cache and the draft's in the draft's cache (the pool's bytes per block count both).
So the draft reads a sequence's context through the target's block table; prefix hits,
copy-on-write and swaps carry its KV with the target's (``execute_copies``); and it needs no
allocator of its own.

- ``mirror``: every forward of the target runs the draft over the same chunks, without
  logits, so the draft's KV holds every position the target computed.
- ``propose_batch``: a proposing sequence has n known tokens, n - 1 of them computed. The
  draft decodes from the last one (position n - 1) for k steps. Those positions have no slots
  yet: the plan gives them slots after the proposals are known. So the draft writes them
  into scratch blocks of its own cache, past the pool's (``scratch_blocks_per_seq`` per
  sequence), after copying in the part of the last block that is filled; the verification
  step's mirror then writes the draft's KV into the real slots.
- ``fill``: KV that arrives by transfer (migration, disaggregated prefill) holds the
  target's layers only; the draft computes its own for those positions.

The draft's KV only shapes what is proposed: verification keeps the output exact whatever
the draft proposes (``verifier``: proposals are point masses, accepted with the target's
probability of them).
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from pagedserve import kernels

from ..engine.request import Sequence
from ..model.attention import PagedAttentionMetadata
from ..model.block_tables import BlockTableRows
from ..model.host_lists import int64_tensor, to_device
from ..model.kv_cache import CacheShape, KVCache
from ..model.model_input import ModelInput
from ..model.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class DraftModel:
    """A draft ``ModelRunner`` on the target's device and dtype, sharing the target's block
    table rows (module docstring). ``allocate_cache`` must run before the first step."""

    def __init__(self, model: str, target: ModelRunner, num_speculative_tokens: int, max_model_len: int,
                 trust_remote_code: bool = False, kernel_backend: str | None = None) -> None:
        if not isinstance(target, ModelRunner):
            raise ValueError("speculative_config.method \"draft_model\" runs on one device: "
                             "tensor_parallel_size > 1 is not supported with a draft model yet")
        self.runner = ModelRunner(model, target.dtype, target.device, trust_remote_code, kernel_backend,
                                  merge_projections=bool(target.merged_projections))
        runner = self.runner
        if runner.vocab_size != target.vocab_size:
            raise ValueError(f"speculative_config.model {model!r}: its vocabulary has {runner.vocab_size} "
                             f"tokens, the target's {target.vocab_size}; a draft model must share the "
                             "target's vocabulary")
        if runner.max_context_len < max_model_len:
            raise ValueError(f"speculative_config.model {model!r} computes at most {runner.max_context_len} "
                             f"tokens of context ({runner.context_limit_reason}), less than max_model_len "
                             f"{max_model_len}; lower max_model_len")
        # The target's rows: the draft reads the same tables, and the engine keeps them current.
        runner.block_tables = target.block_tables
        self.model = model
        self.num_speculative_tokens = num_speculative_tokens
        self.num_parameters = runner.num_parameters
        self.cache: KVCache | None = None
        self.num_pool_blocks = 0
        self.scratch_blocks_per_seq = 0
        self.num_scratch_blocks = 0
        self.num_mirrored_tokens = 0
        self.num_filled_tokens = 0

    # ---- sizing ----------------------------------------------------------------------------
    def cache_shape(self, block_size: int) -> CacheShape:
        return self.runner.cache_shape(block_size)

    def scratch_blocks_for(self, block_size: int) -> int:
        """Scratch blocks one proposing sequence needs: the filled part of its last block
        (up to ``block_size - 1`` tokens) and the k positions the draft decodes."""
        return -(-(block_size - 1 + self.num_speculative_tokens) // block_size)

    def scratch_bytes(self, block_size: int, max_num_seqs: int) -> int:
        return max_num_seqs * self.scratch_blocks_for(block_size) * self.cache_shape(block_size).bytes_per_block

    def allocate_cache(self, block_size: int, num_device_blocks: int, num_host_blocks: int,
                       max_num_seqs: int) -> None:
        """The draft's cache: the pool's blocks, then scratch for ``max_num_seqs`` proposing
        sequences (device only); as many host blocks as the target's swap pool."""
        self.scratch_blocks_per_seq = self.scratch_blocks_for(block_size)
        self.num_scratch_blocks = max_num_seqs * self.scratch_blocks_per_seq
        self.num_pool_blocks = num_device_blocks
        # The target's rows stay shared: allocate_cache must not give the draft rows of its own.
        self.cache = self.runner.allocate_cache(block_size, num_device_blocks + self.num_scratch_blocks,
                                                num_host_blocks)

    # ---- kept in step with the target ------------------------------------------------------
    def mirror(self, model_input: ModelInput) -> None:
        """Compute the draft's KV of every token of the target's step (its tables were
        brought up to date by the target's forward)."""
        if model_input.pending:
            raise RuntimeError("a draft model mirrors synchronous steps only (no pending tokens)")
        self.runner.execute(dataclasses.replace(model_input, table_updates=[], logits_indexes=[], scores=None,
                                                num_logits=None))
        self.num_mirrored_tokens += len(model_input.input_ids)

    def execute_copies(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]],
                       copy_on_write: list[tuple[int, int]]) -> None:
        self.cache.execute_copies(swap_out, swap_in, copy_on_write)

    @torch.inference_mode()
    def fill(self, block_table: list[int], token_ids: list[int], num_tokens: int) -> None:
        """Compute the draft's KV of a sequence's first ``num_tokens`` tokens, whose target KV
        arrived by transfer, into the blocks of ``block_table``."""
        if num_tokens <= 0:
            return
        runner = self.runner
        device = runner.device
        block_size = self.cache.shape.block_size
        positions = torch.arange(num_tokens, dtype=torch.int64)
        table = torch.tensor([block_table], dtype=torch.int32)
        slots = table[0].to(torch.int64)[positions // block_size] * block_size + positions % block_size
        meta = PagedAttentionMetadata(
            slot_mapping=to_device(slots, device), block_tables=to_device(table, device),
            cu_seqlens_q=to_device(torch.tensor([0, num_tokens], dtype=torch.int32), device),
            seq_lens=to_device(torch.tensor([num_tokens], dtype=torch.int32), device), is_decode_only=False,
            kv_caches=self.cache.device_caches, backend=runner.kernel_backend,
            plan_window=runner.attention.max_sliding_window)
        runner.run_decoder(to_device(int64_tensor(token_ids[:num_tokens]), device), to_device(positions, device),
                           meta)
        self.num_filled_tokens += num_tokens

    # ---- proposals -------------------------------------------------------------------------
    @torch.inference_mode()
    def propose_batch(self, seqs: list[Sequence], max_num_tokens: list[int]) -> list[list[int]]:
        """The draft's greedy continuation of each sequence, ``max_num_tokens[i]`` tokens
        (at most k): one decode forward over all of them per token."""
        if len(seqs) * self.scratch_blocks_per_seq > self.num_scratch_blocks:
            raise RuntimeError(f"{len(seqs)} proposing sequences, scratch for "
                               f"{self.num_scratch_blocks // self.scratch_blocks_per_seq}")
        runner = self.runner
        device = runner.device
        block_size = self.cache.shape.block_size
        per_seq = self.scratch_blocks_per_seq
        num = len(seqs)
        num_steps = max(max_num_tokens)
        # The last known token's position; the first entry of the table that scratch replaces.
        last = int64_tensor([len(seq.token_ids) - 1 for seq in seqs])
        first_scratch_column = last // block_size
        offsets = last % block_size                      # filled tokens of the last block
        scratch = self.num_pool_blocks + torch.arange(num, dtype=torch.int64) * per_seq
        width = int(first_scratch_column.max()) + per_seq
        rows = int64_tensor([seq.batch_row for seq in seqs])
        tables = self._tables(rows, first_scratch_column, scratch, width)
        partly_filled = (offsets > 0).nonzero().flatten()
        if len(partly_filled):   # the filled part of each last block, into its first scratch block
            last_blocks = self.runner.block_tables.host[rows[partly_filled], first_scratch_column[partly_filled]]
            pairs = torch.stack([last_blocks.to(torch.int64), scratch[partly_filled]], dim=1)
            kernels.copy_blocks([k for k, _ in self.cache.device_caches], [v for _, v in self.cache.device_caches],
                                to_device(pairs, device))
        tables_on_device = to_device(tables, device)
        cu_seqlens = to_device(torch.arange(num + 1, dtype=torch.int32), device)
        input_ids = to_device(int64_tensor([seq.token_ids[-1] for seq in seqs]), device)
        proposed = []
        for step in range(num_steps):
            positions = last + step
            in_scratch = offsets + step
            slots = (scratch + in_scratch // block_size) * block_size + in_scratch % block_size
            meta = PagedAttentionMetadata(
                slot_mapping=to_device(slots, device), block_tables=tables_on_device, cu_seqlens_q=cu_seqlens,
                seq_lens=to_device((positions + 1).to(torch.int32), device), is_decode_only=True,
                kv_caches=self.cache.device_caches, backend=runner.kernel_backend,
                plan_window=runner.attention.max_sliding_window)
            hidden = runner.run_decoder(input_ids, to_device(positions, device), meta)
            input_ids = runner.compute_logits(hidden).argmax(dim=-1)
            proposed.append(input_ids)
        rows = torch.stack(proposed, dim=1).tolist()
        return [row[:limit] for row, limit in zip(rows, max_num_tokens)]

    def _tables(self, rows: torch.Tensor, first_scratch_column: torch.Tensor, scratch: torch.Tensor,
                width: int) -> torch.Tensor:
        """Each sequence's block table for its proposals (host, int32): its own blocks before
        ``first_scratch_column``, its scratch blocks from there."""
        tables: BlockTableRows = self.runner.block_tables
        host = tables.host
        own = host.index_select(0, rows)[:, :min(width, host.shape[1])]
        if own.shape[1] < width:
            own = torch.cat([own, own.new_zeros((len(rows), width - own.shape[1]))], dim=1)
        columns = torch.arange(width, dtype=torch.int64)
        from_scratch = columns[None, :] - first_scratch_column[:, None]
        scratch_ids = (scratch[:, None] + from_scratch).clamp(max=self.cache.num_device_blocks - 1)
        return torch.where(from_scratch >= 0, scratch_ids, own.to(torch.int64)).to(torch.int32)

    def stats(self, block_size: int) -> dict:
        return {"spec_decode_draft_model": self.model,
                "spec_decode_draft_parameters": self.num_parameters,
                "spec_decode_draft_kv_bytes_per_block": self.cache_shape(block_size).bytes_per_block,
                "spec_decode_draft_scratch_blocks": self.num_scratch_blocks,
                "spec_decode_draft_mirrored_tokens": self.num_mirrored_tokens,
                "spec_decode_draft_filled_tokens": self.num_filled_tokens}
