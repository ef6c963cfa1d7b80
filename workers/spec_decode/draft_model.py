"""The "draft_model" method: a smaller model with the target's vocabulary proposes its greedy
continuation, k tokens a step, for every proposing sequence in one forward per token.

Its KV lives in the target's blocks (``draft_kv``), so copy-on-write and swaps carry it with
the target's. It is computed lazily, when a sequence proposes:

- ``Sequence.num_draft_computed`` counts the positions whose draft KV is in the sequence's
  blocks. A proposing sequence has n known tokens, n - 1 of them computed by the target;
  ``propose_batch`` first runs the draft over the positions it lacks (the tokens accepted
  since its last proposal, or a whole prompt), into their slots;
- then it decodes from the last token (position n - 1) for k steps, into scratch blocks
  (their slots are given by the plan, after the proposals);
- a sequence that does not propose (switched off by ``disable_by_batch_size``, paused by
  the back-off, or with sampling features the verifier cannot honour) costs the draft
  nothing until it does;
- a chunk the target computes from before the draft's count (recompute after preemption, a
  prefix hit) resets the count to 0: those blocks may hold no draft KV, or another
  sequence's. KV that arrives by transfer (migration, disaggregated prefill) starts at 0 too.

The draft's KV only shapes what is proposed: verification keeps the output exact whatever
the draft proposes (``verifier``: proposals are point masses, accepted with the target's
probability of them).
"""

from __future__ import annotations

import logging

import torch

from ..engine.request import Sequence
from ..model.host_lists import int64_tensor, to_device
from ..model.kv_cache import CacheShape, KVCache
from ..model.model_input import ExecuteOutput, ModelInput
from ..model.model_runner import ModelRunner
from .config import check_draft_fits
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
                 max_num_batched_tokens: int, trust_remote_code: bool = False,
                 kernel_backend: str | None = None) -> None:
        self.runner = ModelRunner(model, target.dtype, target.device, trust_remote_code, kernel_backend,
                                  merge_projections=bool(target.merged_projections))
        runner = self.runner
        check_draft_fits(model, runner.vocab_size, target.vocab_size, runner.max_context_len,
                         runner.context_limit_reason, max_model_len)
        # The target's rows: the draft reads the same tables, and the engine keeps them current.
        runner.block_tables = self.block_tables = target.block_tables
        self.model = model
        self.num_speculative_tokens = num_speculative_tokens
        self.num_parameters = runner.num_parameters
        self.max_num_batched_tokens = max_num_batched_tokens
        # The target's sliding window when its blocks out of it are freed (set by the engine).
        self.freeing_window: int | None = None
        self.kv: DraftKV | None = None
        self.num_kv_tokens = 0

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

    # ---- kept up with the target, lazily -------------------------------------------------
    def before_step(self) -> None:
        """Nothing: the draft catches up when it proposes (``propose_batch``)."""

    def after_forward(self, seqs: list[Sequence], model_input: ModelInput, output: ExecuteOutput) -> None:
        """A chunk that the target computes from before a sequence's draft KV ends (recompute
        after preemption, a prefix hit) leaves none of it trusted: the blocks may be new."""
        for seq, start in zip(seqs, model_input.starts):
            if start < seq.num_draft_computed:
                seq.num_draft_computed = 0

    def execute_copies(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]],
                       copy_on_write: list[tuple[int, int]]) -> None:
        self.kv.execute_copies(swap_out, swap_in, copy_on_write)

    def _catch_up(self, seqs: list[Sequence]) -> None:
        """The draft's KV of each sequence's computed positions it lacks (from
        ``num_draft_computed`` on), in forwards of at most ``max_num_batched_tokens`` tokens."""
        ranges = []
        for seq in seqs:
            end = len(seq.token_ids) - 1                   # the target has computed every earlier one
            start = seq.num_draft_computed
            if self.freeing_window is not None:            # older blocks are freed; the draft's window is narrower
                start = max(start, end - self.freeing_window)
            if start < end:
                ranges.append([seq, start, end])
            seq.num_draft_computed = end
        while ranges:
            rows, starts, input_ids, counts = [], [], [], []
            budget = self.max_num_batched_tokens
            for piece in ranges:
                seq, start, end = piece
                count = min(end - start, budget)
                if count <= 0:
                    break
                rows.append(seq.batch_row)
                starts.append(start)
                input_ids.extend(seq.token_ids[start:start + count])
                counts.append(count)
                piece[1] += count
                budget -= count
            self.runner.execute(ModelInput(rows, starts, input_ids, [], num_tokens=counts, logits_indexes=[]))
            self.num_kv_tokens += len(input_ids)
            ranges = [piece for piece in ranges if piece[1] < piece[2]]

    # ---- proposals -------------------------------------------------------------------------
    @torch.inference_mode()
    def propose_batch(self, seqs: list[Sequence], max_num_tokens: list[int]) -> list[list[int]]:
        """The draft's greedy continuation of each sequence, ``max_num_tokens[i]`` tokens
        (at most k): one decode forward over all of them per token."""
        runner = self.runner
        self._catch_up(seqs)
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
        return self.kv.stats(self.model, self.num_parameters, self.num_kv_tokens)
