"""The "draft_model" method: a smaller model with the target's vocabulary proposes its greedy
continuation, k tokens a step, for every proposing sequence in one forward per token.

Its KV lives in the target's blocks (``draft_kv``), so prefix hits, copy-on-write and swaps
carry it with the target's.

- ``after_forward``: every forward of the target runs the draft over the same chunks, without
  logits, so the draft's KV holds every position the target computed.
- ``propose_batch``: a proposing sequence has n known tokens, n - 1 of them computed. The
  draft decodes from the last one (position n - 1) for k steps, into scratch blocks; the
  verification step's mirror then writes the draft's KV of those positions into their slots.
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

from ..engine.request import Sequence
from ..model.attention import PagedAttentionMetadata
from ..model.host_lists import int64_tensor, to_device
from ..model.kv_cache import CacheShape, KVCache
from ..model.model_input import ExecuteOutput, ModelInput
from ..model.model_runner import ModelRunner
from .draft_kv import DraftKV

logger = logging.getLogger(__name__)


class DraftModel:
    """A draft ``ModelRunner`` on the target's device and dtype, sharing the target's block
    table rows (module docstring). ``allocate_cache`` must run before the first step.

    On a tensor-parallel group the draft runs whole on rank 0, beside rank 0's shard of the
    target (``target`` is then the group's runner, which answers for rank 0's): the other
    ranks never see it, and each block's draft KV is on rank 0 only.
    """

    def __init__(self, model: str, target: ModelRunner, num_speculative_tokens: int, max_model_len: int,
                 trust_remote_code: bool = False, kernel_backend: str | None = None) -> None:
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
        runner.block_tables = self.block_tables = target.block_tables
        self.model = model
        self.num_speculative_tokens = num_speculative_tokens
        self.num_parameters = runner.num_parameters
        self.kv: DraftKV | None = None
        self.num_mirrored_tokens = 0
        self.num_filled_tokens = 0

    # ---- sizing ----------------------------------------------------------------------------
    def cache_shape(self, block_size: int) -> CacheShape:
        return self.runner.cache_shape(block_size)

    def scratch_bytes(self, block_size: int, max_num_seqs: int) -> int:
        """Scratch for the k positions a sequence's proposals write."""
        return DraftKV.scratch_bytes(self.cache_shape(block_size), max_num_seqs, self.num_speculative_tokens)

    def allocate_cache(self, block_size: int, num_device_blocks: int, num_host_blocks: int,
                       max_num_seqs: int) -> None:
        """The draft's cache: the pool's blocks, then scratch for ``max_num_seqs`` proposing
        sequences (device only); as many host blocks as the target's swap pool."""
        self.kv = DraftKV(self.cache_shape(block_size), num_device_blocks, num_host_blocks, max_num_seqs,
                          self.num_speculative_tokens, self.block_tables,
                          lambda num_device, num_host: self.runner.allocate_cache(block_size, num_device, num_host))

    @property
    def cache(self) -> KVCache:
        return self.kv.cache

    def warm_up(self, max_blocks_per_seq: int) -> None:
        self.runner.warm_up_kernels(max_blocks_per_seq)

    # ---- kept in step with the target ------------------------------------------------------
    def before_step(self) -> None:
        """Nothing: the draft's KV is complete after each forward (``after_forward``)."""

    def after_forward(self, seqs: list[Sequence], model_input: ModelInput, output: ExecuteOutput) -> None:
        """Compute the draft's KV of every token of the target's step (its tables were
        brought up to date by the target's forward)."""
        if model_input.pending:
            raise RuntimeError("a draft model mirrors synchronous steps only (no pending tokens)")
        self.runner.execute(dataclasses.replace(model_input, table_updates=[], logits_indexes=[], scores=None,
                                                num_logits=None))
        self.num_mirrored_tokens += len(model_input.input_ids)

    def execute_copies(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]],
                       copy_on_write: list[tuple[int, int]]) -> None:
        self.kv.execute_copies(swap_out, swap_in, copy_on_write)

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
        runner = self.runner
        scratch = self.kv.scratch_batch([seq.batch_row for seq in seqs], [len(seq.token_ids) - 1 for seq in seqs])
        input_ids = to_device(int64_tensor([seq.token_ids[-1] for seq in seqs]), runner.device)
        proposed = []
        for step in range(max(max_num_tokens)):
            meta, positions = scratch.metadata(step, runner.kernel_backend, runner.attention.max_sliding_window)
            hidden = runner.run_decoder(input_ids, positions, meta)
            input_ids = runner.compute_logits(hidden).argmax(dim=-1)
            proposed.append(input_ids)
        rows = torch.stack(proposed, dim=1).tolist()
        return [row[:limit] for row, limit in zip(rows, max_num_tokens)]

    def stats(self) -> dict:
        return self.kv.stats(self.model, self.num_parameters, self.num_mirrored_tokens, self.num_filled_tokens)
