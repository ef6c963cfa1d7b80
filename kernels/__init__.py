"""Paged KV cache kernels: cache writes, paged attention, block copies and swaps.

Every public function checks its arguments' shapes, dtypes and devices (ValueError or
TypeError, no device synchronisation) and then runs on a backend:
  - ``backend=None`` picks one from the tensors' device (see ``select_backend``);
  - ``"torch"``: plain torch ops (CPU, or any device as a reference);
  - ``"triton"``: Triton kernels (CUDA; CPU only under ``TRITON_INTERPRET=1``).

Cache layout (per layer): ``k_cache``/``v_cache`` are contiguous
``[num_blocks, block_size, num_kv_heads, head_dim]``; slot = block_id * block_size + offset.
"""

if __name__ == "kernels":  # the source tree's root is on sys.path: see pagedserve.shadowing
    from pagedserve import shadowing

    __package__ = shadowing.step_aside(__name__)

import functools
import importlib.util

import torch

from . import layout, torch_ops

BACKENDS = ("torch", "triton")

__all__ = [
    "BACKENDS",
    "copy_blocks",
    "paged_attention",
    "paged_decode_attention",
    "plan_attention",
    "select_backend",
    "swap_blocks",
    "write_kv",
]


@functools.lru_cache(maxsize=None)
def _is_triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def select_backend(device) -> str:
    """Backend that ``backend=None`` uses for tensors on ``device``.

    "triton" on CUDA when triton is installed, otherwise "torch".
    """
    device = torch.device(device)
    if device.type == "cuda" and _is_triton_installed():
        return "triton"
    return "torch"


def _ops(backend, device):
    """The module implementing ``backend`` (None means ``select_backend(device)``)."""
    if backend is None:
        backend = select_backend(device)
    if backend == "torch":
        return torch_ops
    if backend == "triton":
        from . import triton_ops

        return triton_ops
    raise ValueError(f"unknown kernel backend {backend!r}; expected None or one of {BACKENDS}")


def write_kv(key, value, k_cache, v_cache, slot_mapping, backend=None) -> None:
    """Write ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` into the caches.

    Token ``i`` goes to slot ``slot_mapping[i]``; tokens with slot -1 are skipped.
    Values are cast to the cache dtype. In place; returns None.
    """
    layout.check_write_kv(key, value, k_cache, v_cache, slot_mapping)
    _ops(backend, k_cache.device).write_kv(key, value, k_cache, v_cache, slot_mapping)


def plan_attention(k_cache, block_tables, cu_seqlens_q, seq_lens, backend=None, *,
                   sliding_window=None):
    """What ``paged_attention`` derives from the step's metadata, computed once for all layers.

    Pass the result as ``plan=`` to every layer's ``paged_attention`` (or, with
    ``cu_seqlens_q=None``, ``paged_decode_attention``) over caches of ``k_cache``'s
    shape and the same metadata. It reads the lengths on the host and checks them.
    One plan serves layers of any sliding window: the part for ``sliding_window`` is
    built (and its block table entries checked) now, the part for another window on the
    first call with it. Returns None for backends that need no plan (Triton).
    """
    _check_plan_args(k_cache, block_tables, cu_seqlens_q, seq_lens)
    layout.check_sliding_window(sliding_window)
    if (backend or select_backend(k_cache.device)) != "torch":
        _ops(backend, k_cache.device)
        return None
    if cu_seqlens_q is None:
        return torch_ops.plan_decode_attention(k_cache, block_tables, seq_lens, sliding_window)
    return torch_ops.plan_attention(k_cache, block_tables, cu_seqlens_q, seq_lens, sliding_window)


def _check_plan_args(k_cache, block_tables, cu_seqlens_q, seq_lens) -> None:
    layout.check_cache_pair(k_cache, k_cache)
    layout.check_index("block_tables", block_tables, 2, k_cache.device)
    layout.check_index("seq_lens", seq_lens, 1, k_cache.device)
    if seq_lens.shape[0] != block_tables.shape[0]:
        raise ValueError(
            f"seq_lens has {seq_lens.shape[0]} entries, block_tables has {block_tables.shape[0]} rows"
        )
    if cu_seqlens_q is not None:
        layout.check_index("cu_seqlens_q", cu_seqlens_q, 1, k_cache.device)
        if cu_seqlens_q.shape[0] != block_tables.shape[0] + 1:
            raise ValueError(
                f"cu_seqlens_q must have num_seqs + 1 = {block_tables.shape[0] + 1} entries, "
                f"got {cu_seqlens_q.shape[0]}"
            )


def _plan_kwargs(plan, backend, device) -> dict:
    """``plan=`` for the torch backend; a plan for another backend is an error."""
    if plan is None:
        return {}
    if (backend or select_backend(device)) != plan.backend:
        raise ValueError(f"a {plan.backend!r} attention plan cannot run on backend {backend!r}")
    return {"plan": plan}


def paged_attention(
    q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale=None, out=None, backend=None,
    plan=None, *, sliding_window=None, logit_softcap=None, sinks=None,
):
    """Causal attention for a flattened batch mixing decode tokens and prefill chunks.

    ``q`` is ``[num_tokens, num_heads, head_dim]``; sequence ``i`` owns rows
    ``cu_seqlens_q[i]:cu_seqlens_q[i+1]``, which are the last tokens of its ``seq_lens[i]``
    context tokens (their K/V already written with ``write_kv``). Query head ``h`` reads
    kv head ``h // (num_heads // num_kv_heads)``. Accumulates in float32 (float64 for
    float64 inputs) and returns ``[num_tokens, num_heads, head_dim]`` in q's dtype,
    written into ``out`` when given. ``plan`` is this metadata's ``plan_attention``
    result, or None to derive it here.

    Per call (one layer), matching transformers' eager attention:
      - ``scale``: scores are ``q.k * scale``; None means ``1 / sqrt(head_dim)``.
      - ``sliding_window``: a query at position ``p`` sees keys at ``k`` with
        ``p - sliding_window < k <= p``; None: every ``k <= p``.
      - ``logit_softcap``: scores become ``softcap * tanh(scores / softcap)`` (before the
        mask); None: no soft-cap.
      - ``sinks``: ``[num_heads]`` learned logits (GPT-OSS), one per query head, each
        joining its head's softmax denominator and contributing no value; None: no sinks.

    Block table entries are used to address the cache only for blocks holding a position
    some query of the sequence sees: entries past ``ceil(seq_len / block_size)`` and, with
    a window, entries of blocks wholly before every query's window are never read (they
    may hold -1 or garbage).
    """
    layout.check_attention(
        q, k_cache, v_cache, block_tables, seq_lens, scale, out, cu_seqlens_q=cu_seqlens_q,
        sliding_window=sliding_window, logit_softcap=logit_softcap, sinks=sinks,
    )
    return _ops(backend, q.device).paged_attention(
        q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale, out=out,
        sliding_window=sliding_window, logit_softcap=logit_softcap, sinks=sinks,
        **_plan_kwargs(plan, backend, q.device),
    )


def paged_decode_attention(
    q, k_cache, v_cache, block_tables, seq_lens, scale=None, out=None, backend=None, plan=None, *,
    sliding_window=None, logit_softcap=None, sinks=None,
):
    """``paged_attention`` with exactly one query per sequence: ``q`` is
    ``[num_seqs, num_heads, head_dim]`` and query ``i`` is token ``seq_lens[i] - 1``, so
    with a window it sees the last ``min(seq_lens[i], sliding_window)`` positions and
    only their blocks' table entries are read. Same variants as ``paged_attention``."""
    layout.check_attention(
        q, k_cache, v_cache, block_tables, seq_lens, scale, out,
        sliding_window=sliding_window, logit_softcap=logit_softcap, sinks=sinks,
    )
    return _ops(backend, q.device).paged_decode_attention(
        q, k_cache, v_cache, block_tables, seq_lens, scale, out=out,
        sliding_window=sliding_window, logit_softcap=logit_softcap, sinks=sinks,
        **_plan_kwargs(plan, backend, q.device),
    )


def copy_blocks(k_caches, v_caches, block_pairs, backend=None) -> None:
    """Copy-on-write: for each ``(src, dst)`` row of ``block_pairs`` ``[n, 2]``, copy block
    ``src`` over block ``dst`` in every layer's k and v cache. In place; returns None."""
    layout.check_copy_blocks(k_caches, v_caches, block_pairs)
    ops = _ops(backend, k_caches[0].device if k_caches else torch.device("cpu"))
    if k_caches:
        ops.copy_blocks(k_caches, v_caches, block_pairs)


def swap_blocks(src_cache, dst_cache, block_pairs, backend=None) -> None:
    """For each ``(src, dst)`` row of ``block_pairs``, copy ``src_cache[src]`` into
    ``dst_cache[dst]``. The caches may live on different devices (device pool <-> host
    pool). Auto backend: "triton" only when both caches are on CUDA. A device -> host
    swap has completed on return; a host -> device swap is ordered on the current stream.
    """
    layout.check_swap_blocks(src_cache, dst_cache, block_pairs)
    device = src_cache.device if src_cache.device == dst_cache.device else torch.device("cpu")
    _ops(backend, device).swap_blocks(src_cache, dst_cache, block_pairs)
