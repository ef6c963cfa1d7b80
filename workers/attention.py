"""Paged attention plugged into transformers' own model definitions.

``ATTN_IMPLEMENTATION`` is registered with transformers' attention interface
(and a mask function that builds no mask), so any decoder-only model loaded
with ``attn_implementation=ATTN_IMPLEMENTATION`` routes every attention
layer here. Per-step metadata travels as the ``paged_metadata`` forward
kwarg, which transformers passes through to the attention function.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pagedserve import kernels

ATTN_IMPLEMENTATION = "pagedserve_paged"


@dataclass
class PagedAttentionMetadata:
    """Everything a layer needs to read and write the paged cache this step.

    Named after the kernels' arguments. Token rows are the flattened batch:
    sequence i owns rows ``cu_seqlens_q[i]:cu_seqlens_q[i+1]``.
    """

    slot_mapping: torch.Tensor      # [num_tokens] int64
    block_tables: torch.Tensor      # [num_seqs, max_blocks] int32
    cu_seqlens_q: torch.Tensor      # [num_seqs + 1] int32
    seq_lens: torch.Tensor          # [num_seqs] int32, context length after this step
    is_decode_only: bool            # one query per sequence
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (k_cache, v_cache)
    backend: str | None = None
    plan: Any = None                # kernels.plan_attention's result, shared by every layer

    def __post_init__(self) -> None:
        if self.plan is None and self.kv_caches:
            self.plan = kernels.plan_attention(
                self.kv_caches[0][0], self.block_tables,
                None if self.is_decode_only else self.cu_seqlens_q, self.seq_lens,
                backend=self.backend)


def paged_attention_forward(module, query, key, value, attention_mask, scaling=None,
                            dropout=0.0, paged_metadata: PagedAttentionMetadata | None = None,
                            **kwargs):
    """transformers attention function: write this step's K/V, attend over the pages.

    ``query`` is ``[1, num_heads, num_tokens, head_dim]`` after RoPE, ``key`` and
    ``value`` ``[1, num_kv_heads, num_tokens, head_dim]``. Returns
    ``([1, num_tokens, num_heads, head_dim], None)``.
    """
    if paged_metadata is None:
        raise RuntimeError(
            f"attn_implementation={ATTN_IMPLEMENTATION!r} needs the paged_metadata forward kwarg; "
            "run the model through pagedserve's ModelRunner")
    meta = paged_metadata
    k_cache, v_cache = meta.kv_caches[module.layer_idx]
    q = query[0].transpose(0, 1)
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    kernels.write_kv(k, v, k_cache, v_cache, meta.slot_mapping, backend=meta.backend)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    # Contiguous, so that transformers' reshape of the output to [1, tokens, hidden] is a view.
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if meta.is_decode_only:
        kernels.paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale,
                                       out=out, backend=meta.backend, plan=meta.plan)
    else:
        kernels.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q,
                                meta.seq_lens, scale, out=out, backend=meta.backend, plan=meta.plan)
    return out.unsqueeze(0), None


def _no_mask(*args, **kwargs):
    """Paged attention applies causality itself: transformers must build no mask."""
    return None


_registered = False


def register_paged_attention() -> str:
    """Register the attention and mask functions once per process; returns the name."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface

        AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
        AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _no_mask)
        _registered = True
    return ATTN_IMPLEMENTATION
