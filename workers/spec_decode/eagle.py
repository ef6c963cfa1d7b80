"""The "eagle" and "eagle3" methods: an EAGLE head (Li et al. 2024, 2025) proposes from the
target's hidden states (the heads and their layouts: ``eagle_heads``).

Its KV lives in the target's blocks (``draft_kv``): the head's entry at position i is
computed from (token i + 1, the target's hidden states at i), so it trails the target by one
token.

- ``after_forward`` keeps what the head takes from the target's step: its last hidden
  states (EAGLE), or those entering three of its layers, caught on their way in (EAGLE-3).
- ``before_step`` (the next step, once the step's tokens are known) runs the head over each
  sequence's kept positions of that step, each with the token after it: the head's KV of
  those positions, and at each sequence's last computed position (n - 2 of n known tokens)
  the estimate from which the first proposal comes.
- ``propose_batch``: the first proposal from that estimate, then k - 1 decode forwards of the
  head on its own estimates (positions n - 1 on), written into scratch blocks.

A sequence whose KV arrived by transfer has no target hidden states for those positions: the
head's KV of them is not written, which lowers that sequence's acceptance, never its output.
"""

from __future__ import annotations

import logging

import torch

from ..engine.request import Sequence
from ..model.attention import PagedAttentionMetadata
from ..model.host_lists import int64_tensor, to_device
from ..model.kv_cache import CacheShape, KVCache
from ..model.model_input import ExecuteOutput, ModelInput, flatten
from ..model.model_runner import ModelRunner
from .draft_kv import DraftKV
from .eagle_heads import load_eagle_head

logger = logging.getLogger(__name__)


class EagleProposer:
    """An EAGLE head beside the target's runner (module docstring). ``allocate_cache`` must
    run before the first step."""

    def __init__(self, model: str, target: ModelRunner, num_speculative_tokens: int, max_model_len: int,
                 method: str = "eagle") -> None:
        # On a tensor-parallel group the head runs on rank 0, whose runner computes whole hidden
        # states (the all-reduces) and holds whole embeddings and LM head.
        local = getattr(target, "local", target)
        self.head, config = load_eagle_head(model, target, method)
        self.model = model
        self.target = target
        self._aux: dict[int, torch.Tensor] = {}   # EAGLE-3: layer -> the hidden states entering it
        if self.head.aux_layer_ids is None:
            local.keep_hidden_states = True
        else:
            self._catch_aux_hidden_states(local, self.head.aux_layer_ids)
        self.block_tables = target.block_tables
        self.num_speculative_tokens = num_speculative_tokens
        self.num_parameters = sum(p.numel() for p in self.head.parameters())
        self.num_layers = config.num_hidden_layers
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.sliding_window = None
        self.kv: DraftKV | None = None
        # The step the head has not seen yet: its chunks' sequences, input and hidden states.
        self._step: tuple[list[Sequence], ModelInput, torch.Tensor] | None = None
        # Each sequence's estimate at its last computed position, and the state the next
        # proposal reads, after ``before_step``.
        self._estimates: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.num_kv_tokens = 0

    # ---- sizing ----------------------------------------------------------------------------
    def cache_shape(self, block_size: int) -> CacheShape:
        return CacheShape(self.num_layers, block_size, self.num_kv_heads, self.head_dim, self.target.dtype)

    def scratch_bytes(self, block_size: int, max_num_seqs: int) -> int:
        """Scratch for the k - 1 positions a sequence's later proposals write."""
        return DraftKV.scratch_bytes(self.cache_shape(block_size), max_num_seqs, self._num_scratch_positions)

    @property
    def _num_scratch_positions(self) -> int:
        return max(self.num_speculative_tokens - 1, 1)

    def allocate_cache(self, block_size: int, num_device_blocks: int, num_host_blocks: int,
                       max_num_seqs: int) -> None:
        shape = self.cache_shape(block_size)
        self.kv = DraftKV(shape, num_device_blocks, num_host_blocks, max_num_seqs, self._num_scratch_positions,
                          self.block_tables,
                          lambda num_device, num_host: KVCache(shape, num_device, num_host, self.target.device))

    @property
    def cache(self) -> KVCache:
        return self.kv.cache

    def warm_up(self, max_blocks_per_seq: int) -> None:
        """Nothing to compile ahead: the head's attention runs the target's kernels."""

    def execute_copies(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]],
                       copy_on_write: list[tuple[int, int]]) -> None:
        self.kv.execute_copies(swap_out, swap_in, copy_on_write)

    # ---- kept in step with the target ------------------------------------------------------
    def _catch_aux_hidden_states(self, target: ModelRunner, layer_ids: tuple[int, ...]) -> None:
        """EAGLE-3: keep the hidden states entering each of ``layer_ids`` in every forward of
        the target (a pre-hook on the layer)."""
        layers = target.decoder.layers
        for index in sorted(set(layer_ids)):
            layers[index].register_forward_pre_hook(
                lambda module, args, index=index: self._aux.__setitem__(index, args[0][0]))

    @torch.inference_mode()
    def after_forward(self, seqs: list[Sequence], model_input: ModelInput, output: ExecuteOutput) -> None:
        """Keep what the head takes from the step until the step's tokens are known
        (``before_step``)."""
        if self.head.aux_layer_ids is None:
            if output.hidden_states is None:
                raise RuntimeError("the target's forward returned no hidden states for the EAGLE head")
            hidden = output.hidden_states
        else:
            aux, self._aux = self._aux, {}
            missing = [index for index in self.head.aux_layer_ids if index not in aux]
            if missing:
                raise RuntimeError(f"the target's forward passed no hidden states into layers {missing}")
            hidden = torch.cat([aux[index] for index in self.head.aux_layer_ids], dim=-1)
        self._step = (seqs, model_input, self.head.features(hidden))

    @torch.inference_mode()
    def before_step(self) -> None:
        """The head's KV of the last step's kept positions, and each sequence's estimate at
        its last computed position (module docstring)."""
        self._estimates = {}
        if self._step is None:
            return
        seqs, model_input, hidden = self._step
        self._step = None
        rows, starts, input_ids, counts, hidden_rows, kept_seqs = [], [], [], [], [], []
        lengths = model_input.num_tokens or [1] * model_input.num_chunks
        offset = 0
        for seq, row, start, length in zip(seqs, model_input.rows, model_input.starts, lengths):
            # Still running in the same row (not finished or preempted since); positions whose
            # KV the step kept (rolled-back proposals are not), each with the token after it.
            kept = min(start + length, seq.num_computed, len(seq.token_ids) - 1) - start
            if seq.batch_row == row and kept > 0:
                rows.append(row)
                starts.append(start)
                counts.append(kept)
                input_ids.extend(seq.token_ids[start + 1:start + 1 + kept])
                hidden_rows.extend(range(offset, offset + kept))
                kept_seqs.append(seq)
            offset += length
        if not kept_seqs:
            return
        target = self.target
        device = target.device
        batch = flatten(ModelInput(rows, starts, input_ids, [], num_tokens=counts), self.block_tables,
                        self.kv.shape.block_size)
        meta = PagedAttentionMetadata(
            slot_mapping=batch.slot_mapping.to(device), block_tables=batch.block_tables,
            cu_seqlens_q=batch.cu_seqlens.to(device), seq_lens=batch.seq_lens.to(device), is_decode_only=False,
            kv_caches=self.kv.cache.device_caches, backend=target.kernel_backend, plan_window=self.sliding_window)
        ids = batch.input_ids.to(device)
        features = hidden.index_select(0, to_device(int64_tensor(hidden_rows), device))
        estimates, carried = self.head(self.head.embed(ids), features, batch.positions.to(device), meta)
        self.num_kv_tokens += len(input_ids)
        last_rows = batch.cu_seqlens[1:].to(torch.int64) - 1
        for seq, last_row in zip(kept_seqs, last_rows.tolist()):
            if seq.num_computed == len(seq.token_ids) - 1:   # decoding: its estimate proposes
                self._estimates[seq.seq_id] = (estimates[last_row], carried[last_row])

    # ---- proposals -------------------------------------------------------------------------
    @torch.inference_mode()
    def propose_batch(self, seqs: list[Sequence], max_num_tokens: list[int]) -> list[list[int]]:
        """Each sequence's proposals: the head's greedy chain from its estimate (none for a
        sequence the head has no estimate for, such as one resumed after a swap)."""
        proposing = [i for i, seq in enumerate(seqs) if seq.seq_id in self._estimates]
        proposals: list[list[int]] = [[] for _ in seqs]
        if not proposing:
            return proposals
        target = self.target
        head = self.head
        chosen = [seqs[i] for i in proposing]
        estimates = torch.stack([self._estimates[seq.seq_id][0] for seq in chosen])
        carried = torch.stack([self._estimates[seq.seq_id][1] for seq in chosen])
        token_ids = head.tokens(estimates)
        proposed = [token_ids]
        num_steps = max(max_num_tokens[i] for i in proposing)
        if num_steps > 1:
            scratch = self.kv.scratch_batch([seq.batch_row for seq in chosen],
                                            [len(seq.token_ids) - 1 for seq in chosen])
            for step in range(num_steps - 1):
                meta, positions = scratch.metadata(step, target.kernel_backend, self.sliding_window)
                estimates, carried = head(head.embed(token_ids), carried, positions, meta)
                token_ids = head.tokens(estimates)
                proposed.append(token_ids)
        rows = torch.stack(proposed, dim=1).tolist()
        for i, row in zip(proposing, rows):
            proposals[i] = row[:max_num_tokens[i]]
        return proposals

    def stats(self) -> dict:
        return self.kv.stats(self.model, self.num_parameters, self.num_kv_tokens)
