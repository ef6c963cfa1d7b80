"""The "eagle" method: an EAGLE head (Li et al. 2024) proposes from the target's hidden states.

The head, in the layout vLLM loads (``EagleLlamaForCausalLM``): ``fc`` maps [embedding of
token i + 1, target's hidden state at position i] to one or more Llama decoder layers (the
first without its input norm), whose output estimates the target's hidden state at
position i + 1; the target's LM head turns it into a distribution over token i + 2. The
target's embeddings and LM head are shared (a checkpoint's own ``embed_tokens`` is not read,
as in vLLM).

Its KV lives in the target's blocks (``draft_kv``): the head's entry at position i is
computed from (token i + 1, hidden state i), so it trails the target by one token.

- ``after_forward`` keeps the target's hidden states of the step.
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

import json
import logging
import os
from pathlib import Path

import torch

from ..engine.request import Sequence
from ..model.attention import PagedAttentionMetadata, register_paged_attention
from ..model.host_lists import int64_tensor, to_device
from ..model.kv_cache import CacheShape, KVCache
from ..model.model_input import ExecuteOutput, ModelInput, flatten
from ..model.model_runner import ModelRunner
from .draft_kv import DraftKV

logger = logging.getLogger(__name__)

# Names a head checkpoint may hold besides fc.* and layers.*: the embeddings, shared with the
# target instead (vLLM's rule).
SHARED_WITH_TARGET = ("embed_tokens.weight",)


class EagleHead(torch.nn.Module):
    """``fc`` and the decoder layers of an EAGLE head, attending through the paged cache."""

    def __init__(self, config, has_fc_bias: bool) -> None:
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

        super().__init__()
        config._attn_implementation = register_paged_attention()
        hidden = config.hidden_size
        self.fc = torch.nn.Linear(2 * hidden, hidden, bias=has_fc_bias)
        self.layers = torch.nn.ModuleList([LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.layers[0].input_layernorm = torch.nn.Identity()
        self.rotary_emb = LlamaRotaryEmbedding(config)

    def forward(self, embeddings: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                meta: PagedAttentionMetadata) -> torch.Tensor:
        """[tokens, hidden] estimates of the target's next hidden states."""
        states = self.fc(torch.cat([embeddings, hidden], dim=-1)).unsqueeze(0)
        position_ids = positions.unsqueeze(0)
        rotary = self.rotary_emb(states, position_ids)
        for layer in self.layers:
            states = layer(states, position_ids=position_ids, position_embeddings=rotary, paged_metadata=meta)
        return states[0]


def load_eagle_head(model: str, target: ModelRunner) -> tuple[EagleHead, object]:
    """The head in ``model`` (a folder, or a hub id in the local cache), on the target's
    device and dtype, and its config. Refuses a head of another width or family."""
    from transformers import AutoConfig

    path = _resolve(model)
    config = AutoConfig.from_pretrained(path)
    if config.model_type != "llama":
        raise ValueError(f"speculative_config.model {model!r}: an EAGLE head of model_type {config.model_type!r}; "
                         "only Llama-layer heads (vLLM's EagleLlamaForCausalLM layout) are supported")
    target_hidden = target.config.get_text_config().hidden_size
    if config.hidden_size != target_hidden:
        raise ValueError(f"speculative_config.model {model!r}: an EAGLE head of width {config.hidden_size} for a "
                         f"target of width {target_hidden}")
    weights = _read_weights(path)
    names = {name.removeprefix("model."): tensor for name, tensor in weights.items()}
    for name in SHARED_WITH_TARGET:
        names.pop(name, None)
    head = EagleHead(config, has_fc_bias="fc.bias" in names)
    expected = set(head.state_dict()) - {"layers.0.input_layernorm.weight"}
    expected = {name for name in expected if not name.startswith("rotary_emb.")}
    unknown, missing = set(names) - expected, expected - set(names)
    if unknown or missing:
        raise ValueError(f"speculative_config.model {model!r} is not an EAGLE head in vLLM's layout: "
                         + "; ".join(part for part in (f"unexpected {sorted(unknown)[:5]}" if unknown else "",
                                                       f"missing {sorted(missing)[:5]}" if missing else "") if part))
    head.load_state_dict(names, strict=False)
    return head.to(device=target.device, dtype=target.dtype).eval(), config


def _resolve(model: str) -> str:
    if os.path.isdir(model):
        return model
    from huggingface_hub import snapshot_download

    return snapshot_download(model)


def _read_weights(path: str) -> dict[str, torch.Tensor]:
    folder = Path(path)
    tensors: dict[str, torch.Tensor] = {}
    files = sorted(folder.glob("*.safetensors"))
    if files:
        from safetensors.torch import load_file

        for file in files:
            tensors.update(load_file(str(file)))
        return tensors
    files = sorted(folder.glob("pytorch_model*.bin"))
    if not files:
        raise ValueError(f"speculative_config.model {path!r}: no *.safetensors or pytorch_model*.bin weights")
    for file in files:
        tensors.update(torch.load(file, map_location="cpu", weights_only=True))
    return tensors


class EagleProposer:
    """An EAGLE head beside the target's runner (module docstring). ``allocate_cache`` must
    run before the first step."""

    def __init__(self, model: str, target: ModelRunner, num_speculative_tokens: int, max_model_len: int) -> None:
        if not isinstance(target, ModelRunner):
            raise ValueError("speculative_config.method \"eagle\" runs on one device: "
                             "tensor_parallel_size > 1 is not supported with an EAGLE head yet")
        self.head, config = load_eagle_head(model, target)
        self.model = model
        self.target = target
        target.keep_hidden_states = True
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
        # Each sequence's estimate at its last computed position, after ``before_step``.
        self._estimates: dict[str, torch.Tensor] = {}
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
    def after_forward(self, seqs: list[Sequence], model_input: ModelInput, output: ExecuteOutput) -> None:
        """Keep the step's hidden states until its tokens are known (``before_step``)."""
        if output.hidden_states is None:
            raise RuntimeError("the target's forward returned no hidden states for the EAGLE head")
        self._step = (seqs, model_input, output.hidden_states)

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
                hidden_rows.append(torch.arange(offset, offset + kept))
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
        features = hidden.index_select(0, to_device(torch.cat(hidden_rows), device))
        estimates = self.head(target.model.get_input_embeddings()(ids), features, batch.positions.to(device), meta)
        self.num_kv_tokens += len(input_ids)
        last_rows = batch.cu_seqlens[1:].to(torch.int64) - 1
        for seq, last_row in zip(kept_seqs, last_rows.tolist()):
            if seq.num_computed == len(seq.token_ids) - 1:   # decoding: its estimate proposes
                self._estimates[seq.seq_id] = estimates[last_row]

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
        chosen = [seqs[i] for i in proposing]
        states = torch.stack([self._estimates[seq.seq_id] for seq in chosen])
        token_ids = target.compute_logits(states).argmax(dim=-1)
        proposed = [token_ids]
        num_steps = max(max_num_tokens[i] for i in proposing)
        if num_steps > 1:
            scratch = self.kv.scratch_batch([seq.batch_row for seq in chosen],
                                            [len(seq.token_ids) - 1 for seq in chosen])
            embed = target.model.get_input_embeddings()
            for step in range(num_steps - 1):
                meta, positions = scratch.metadata(step, target.kernel_backend, self.sliding_window)
                states = self.head(embed(token_ids), states, positions, meta)
                token_ids = target.compute_logits(states).argmax(dim=-1)
                proposed.append(token_ids)
        rows = torch.stack(proposed, dim=1).tolist()
        for i, row in zip(proposing, rows):
            proposals[i] = row[:max_num_tokens[i]]
        return proposals

    def stats(self) -> dict:
        return self.kv.stats(self.model, self.num_parameters, self.num_kv_tokens)
