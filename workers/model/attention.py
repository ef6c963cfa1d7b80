"""Paged attention plugged into transformers' own model definitions.

``ATTN_IMPLEMENTATION`` is registered with transformers' attention interface,
so any decoder-only model loaded with ``attn_implementation=ATTN_IMPLEMENTATION``
routes every attention layer here. It has no mask function: transformers then
builds no mask and skips its mask preprocessing, whose packed-sequence check
reads a device value (a host sync in every eager forward on CUDA). Per-step metadata travels as the ``paged_metadata`` forward
kwarg, which transformers passes through to the attention function.

Each layer's call says how it attends (scaling, sliding window, soft-cap,
sinks); ``AttentionVariant.from_call`` reads that and refuses any argument
it does not know, so a model feature pagedserve cannot honour is an error,
never a silently different result.

Under ``torch.compile`` the metadata (a Python object holding the step's plan)
cannot be a graph input. A compiled forward passes ``FROM_CONTEXT`` instead and
runs inside ``attention_context(meta)``; each layer then calls the custom op
``pagedserve::paged_attention`` with tensors and constants only. The op is opaque
to the compiler, which fuses everything around it, and reads the metadata from
the context when it runs (or when a CUDA graph captures it).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedserve import kernels

ATTN_IMPLEMENTATION = "pagedserve_paged"


class UnsupportedAttentionError(ValueError):
    """A layer asked for attention that pagedserve cannot compute exactly."""


# Arguments transformers passes to attention functions that do not change what
# they compute here (positions are already applied to q/k by RoPE; there is no
# transformers cache). Any other argument with a value is refused.
_INERT_ARGUMENTS = frozenset({"position_ids", "use_cache", "cache_position", "output_attentions",
                              "output_router_logits",
                              "past_key_values", "position_embeddings"})


@dataclass(frozen=True)
class AttentionVariant:
    """How one layer attends, as its transformers attention module asks for it.

    ``scale`` multiplies q.k (None: 1/sqrt(head_dim)); ``sliding_window`` w lets a
    query at p see keys at p - w < k <= p; ``logit_softcap`` c turns scores into
    c * tanh(scores / c); ``has_sinks``: learned per-head logits join the softmax
    denominator (GPT-OSS).
    """

    scale: float | None = None
    sliding_window: int | None = None
    logit_softcap: float | None = None
    has_sinks: bool = False

    @classmethod
    def from_call(cls, module, scaling, dropout, kwargs: dict[str, Any]) -> "AttentionVariant":
        """Read a transformers attention call; ``UnsupportedAttentionError`` for anything else."""
        unknown = sorted(name for name, value in kwargs.items()
                         if value is not None and name not in _INERT_ARGUMENTS
                         and name not in ("sliding_window", "softcap", "s_aux", "is_causal"))
        if unknown:
            raise UnsupportedAttentionError(
                f"{type(module).__name__} passes attention argument(s) {', '.join(unknown)}, "
                "which pagedserve does not implement")
        if kwargs.get("is_causal") is False or not getattr(module, "is_causal", True):
            raise UnsupportedAttentionError(f"{type(module).__name__} asks for non-causal attention")
        if dropout:
            raise UnsupportedAttentionError(f"{type(module).__name__} asks for attention dropout "
                                            f"{dropout} (the model is in training mode)")
        window = kwargs.get("sliding_window")
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise UnsupportedAttentionError(
                f"{type(module).__name__} passes sliding_window={window!r}; expected a positive integer")
        softcap = kwargs.get("softcap")
        if softcap is not None and not softcap > 0:
            raise UnsupportedAttentionError(
                f"{type(module).__name__} passes softcap={softcap!r}; expected a positive number")
        return cls(None if scaling is None else float(scaling), window,
                   None if softcap is None else float(softcap), kwargs.get("s_aux") is not None)

    @property
    def features(self) -> list[str]:
        """Names of the non-default features, for messages."""
        names = []
        if self.sliding_window is not None:
            names.append(f"sliding window {self.sliding_window}")
        if self.logit_softcap is not None:
            names.append(f"attention logit soft-capping {self.logit_softcap}")
        if self.has_sinks:
            names.append("attention sinks")
        return names


@dataclass
class PagedAttentionMetadata:
    """Everything a layer needs to read and write the paged cache this step.

    Named after the kernels' arguments. Token rows are the flattened batch:
    sequence i owns rows ``cu_seqlens_q[i]:cu_seqlens_q[i+1]``. With
    ``plan_window`` set, block table entries wholly before that window may be -1
    (freed out-of-window blocks).
    """

    slot_mapping: torch.Tensor      # [num_tokens] int64
    block_tables: torch.Tensor      # [num_seqs, max_blocks] int32
    cu_seqlens_q: torch.Tensor      # [num_seqs + 1] int32
    seq_lens: torch.Tensor          # [num_seqs] int32, context length after this step
    is_decode_only: bool            # one query per sequence
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (k_cache, v_cache)
    backend: str | None = None
    plan_window: int | None = None
    plan: Any = None                # kernels.plan_attention's result, shared by every layer

    def __post_init__(self) -> None:
        if self.plan is None and self.kv_caches:
            self.plan = kernels.plan_attention(
                self.kv_caches[0][0], self.block_tables,
                None if self.is_decode_only else self.cu_seqlens_q, self.seq_lens,
                backend=self.backend, sliding_window=self.plan_window)


@dataclass
class LayerCall:
    """What one layer's attention call looked like during an ``AttentionProbe`` forward."""

    module_type: str
    variant: AttentionVariant
    num_heads: int
    num_kv_heads: int
    head_dim: int
    value_head_dim: int


@dataclass
class AttentionProbe:
    """Pass as ``paged_metadata`` to record each layer's call instead of attending.

    The attention function then touches no cache and returns zeros; ``calls``
    maps a layer index to the calls it made (normally exactly one).
    """

    calls: dict[int | None, list[LayerCall]] = field(default_factory=dict)

    def record(self, module, query, key, value, variant: AttentionVariant) -> torch.Tensor:
        call = LayerCall(type(module).__name__, variant, query.shape[1], key.shape[1],
                         key.shape[-1], value.shape[-1])
        self.calls.setdefault(getattr(module, "layer_idx", None), []).append(call)
        return query.new_zeros(query.shape[0], query.shape[2], query.shape[1], value.shape[-1])


class _FromContext:
    """The ``paged_metadata`` of a compiled forward: read ``attention_context``'s metadata."""

    def __repr__(self) -> str:
        return "FROM_CONTEXT"


FROM_CONTEXT = _FromContext()
_context = threading.local()


@contextmanager
def attention_context(meta: PagedAttentionMetadata) -> Iterator[None]:
    """Layers called with ``paged_metadata=FROM_CONTEXT`` in this thread attend with ``meta``."""
    previous = getattr(_context, "meta", None)
    _context.meta = meta
    try:
        yield
    finally:
        _context.meta = previous


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
    variant = AttentionVariant.from_call(module, scaling, dropout, kwargs)
    if isinstance(paged_metadata, AttentionProbe):
        return paged_metadata.record(module, query, key, value, variant), None
    q = query[0].transpose(0, 1)
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    sinks = kwargs["s_aux"] if variant.has_sinks else None
    if paged_metadata is FROM_CONTEXT:
        out = torch.ops.pagedserve.paged_attention(q, k, v, module.layer_idx, variant.scale,
                                                   variant.sliding_window, variant.logit_softcap, sinks)
    else:
        out = _attend(paged_metadata, module.layer_idx, q, k, v, variant.scale, variant.sliding_window,
                      variant.logit_softcap, sinks)
    return out.unsqueeze(0), None


def _attend(meta: PagedAttentionMetadata, layer_idx: int, q: torch.Tensor, k: torch.Tensor,
            v: torch.Tensor, scale: float | None, sliding_window: int | None,
            logit_softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """Write one layer's K/V rows ``[tokens, kv heads, dim]`` and attend: ``[tokens, heads, dim]``."""
    k_cache, v_cache = meta.kv_caches[layer_idx]
    kernels.write_kv(k, v, k_cache, v_cache, meta.slot_mapping, backend=meta.backend)
    # Contiguous, so that transformers' reshape of the output to [1, tokens, hidden] is a view.
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    variants = dict(sliding_window=sliding_window, logit_softcap=logit_softcap, sinks=sinks)
    if meta.is_decode_only:
        kernels.paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                       scale, out=out, backend=meta.backend, plan=meta.plan,
                                       **variants)
    else:
        kernels.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q,
                                meta.seq_lens, scale, out=out, backend=meta.backend,
                                plan=meta.plan, **variants)
    return out


# The KV caches it writes are not arguments: they come with the context's metadata, like
# the plan. The compiler cannot reorder it against another layer's call, whose input
# depends on its output.
@torch.library.custom_op("pagedserve::paged_attention", mutates_args=())
def paged_attention_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer_idx: int,
                       scale: float | None, sliding_window: int | None, logit_softcap: float | None,
                       sinks: torch.Tensor | None) -> torch.Tensor:
    """One layer's paged attention with ``attention_context``'s metadata (``_attend``)."""
    meta = getattr(_context, "meta", None)
    if meta is None:
        raise RuntimeError("pagedserve::paged_attention runs only inside attention_context(meta)")
    return _attend(meta, layer_idx, query, key, value, scale, sliding_window, logit_softcap, sinks)


@paged_attention_op.register_fake
def _(query, key, value, layer_idx, scale, sliding_window, logit_softcap, sinks):
    return torch.empty(query.shape, dtype=query.dtype, device=query.device)


_registered = False


def register_paged_attention() -> str:
    """Register the attention function once per process; returns the name. No mask function:
    paged attention applies causality and windows itself."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface
        AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
        _registered = True
    return ATTN_IMPLEMENTATION
