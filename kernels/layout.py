"""Shape, dtype and device checks for the paged KV cache layout.

Layout shared by every backend:
  - per layer ``k_cache`` and ``v_cache``: ``[num_blocks, block_size, num_kv_heads, head_dim]``,
    contiguous, same shape, dtype and device;
  - slot ``s`` lives at ``(s // block_size, s % block_size)``; slot ``-1`` means padding;
  - block tables: integer ``[num_seqs, max_blocks_per_seq]``; only the first
    ``ceil(seq_len / block_size)`` entries of a row are meaningful, and with a sliding
    window only those of blocks holding a position some query sees.

These checks look only at metadata (never at tensor contents), so they cost a few
microseconds and never synchronise with a device. They raise ValueError or TypeError.
"""

import math

import torch

INDEX_DTYPES = (torch.int32, torch.int64)
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_cache_pair(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Check that ``k_cache``/``v_cache`` are a matching pair in the paged layout."""
    if not isinstance(k_cache, torch.Tensor) or not isinstance(v_cache, torch.Tensor):
        raise TypeError("k_cache and v_cache must be torch.Tensor")
    if k_cache.dim() != 4:
        raise ValueError(
            "k_cache must be [num_blocks, block_size, num_kv_heads, head_dim], "
            f"got shape {tuple(k_cache.shape)}"
        )
    if v_cache.shape != k_cache.shape:
        raise ValueError(
            f"v_cache shape {tuple(v_cache.shape)} != k_cache shape {tuple(k_cache.shape)}"
        )
    if v_cache.dtype != k_cache.dtype or v_cache.device != k_cache.device:
        raise ValueError(
            f"k_cache ({k_cache.dtype}, {k_cache.device}) and v_cache "
            f"({v_cache.dtype}, {v_cache.device}) must share dtype and device"
        )
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")


def check_index(name: str, tensor: torch.Tensor, dim: int, device: torch.device) -> None:
    """Check that ``tensor`` is an int32/int64 tensor of rank ``dim`` on ``device``."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in INDEX_DTYPES:
        raise ValueError(f"{name} must be int32 or int64, got {tensor.dtype}")
    if tensor.dim() != dim:
        raise ValueError(f"{name} must have {dim} dimension(s), got shape {tuple(tensor.shape)}")
    if tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device}, expected {device}")


def check_write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Check the arguments of ``write_kv``."""
    check_cache_pair(k_cache, v_cache)
    if not isinstance(key, torch.Tensor) or not isinstance(value, torch.Tensor):
        raise TypeError("key and value must be torch.Tensor")
    if key.dim() != 3 or key.shape != value.shape:
        raise ValueError(
            "key and value must both be [num_tokens, num_kv_heads, head_dim], "
            f"got {tuple(key.shape)} and {tuple(value.shape)}"
        )
    if key.shape[1:] != k_cache.shape[2:]:
        raise ValueError(
            f"key heads/head_dim {tuple(key.shape[1:])} do not match cache "
            f"{tuple(k_cache.shape[2:])}"
        )
    if key.device != k_cache.device or value.device != k_cache.device:
        raise ValueError(f"key/value must be on the cache device {k_cache.device}")
    if key.dtype not in FLOAT_DTYPES or value.dtype not in FLOAT_DTYPES:
        raise ValueError(f"key/value must be floating point, got {key.dtype}/{value.dtype}")
    check_index("slot_mapping", slot_mapping, 1, k_cache.device)
    if slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(
            f"slot_mapping has {slot_mapping.shape[0]} entries for {key.shape[0]} tokens"
        )


def check_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None,
    out: torch.Tensor | None,
    cu_seqlens_q: torch.Tensor | None = None,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> None:
    """Check the arguments of ``paged_attention`` (or ``paged_decode_attention``
    when ``cu_seqlens_q`` is None)."""
    check_cache_pair(k_cache, v_cache)
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
    if q.dim() != 3:
        raise ValueError(f"q must be [num_tokens, num_heads, head_dim], got {tuple(q.shape)}")
    if q.dtype not in FLOAT_DTYPES:
        raise ValueError(f"q must be floating point, got {q.dtype}")
    if q.dtype != k_cache.dtype:
        raise ValueError(f"q dtype {q.dtype} != cache dtype {k_cache.dtype}")
    if q.device != k_cache.device:
        raise ValueError(f"q is on {q.device}, cache on {k_cache.device}")
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    if head_dim != k_cache.shape[3]:
        raise ValueError(f"q head_dim {head_dim} != cache head_dim {k_cache.shape[3]}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(
            f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )
    check_variants(q, scale, sliding_window, logit_softcap, sinks)
    check_index("block_tables", block_tables, 2, q.device)
    check_index("seq_lens", seq_lens, 1, q.device)
    num_seqs = block_tables.shape[0]
    if seq_lens.shape[0] != num_seqs:
        raise ValueError(
            f"seq_lens has {seq_lens.shape[0]} entries, block_tables has {num_seqs} rows"
        )
    if cu_seqlens_q is None:
        if q.shape[0] != num_seqs:
            raise ValueError(
                f"decode attention takes one query per sequence: q has {q.shape[0]} rows, "
                f"{num_seqs} sequences"
            )
    else:
        check_index("cu_seqlens_q", cu_seqlens_q, 1, q.device)
        if cu_seqlens_q.shape[0] != num_seqs + 1:
            raise ValueError(
                f"cu_seqlens_q must have num_seqs + 1 = {num_seqs + 1} entries, "
                f"got {cu_seqlens_q.shape[0]}"
            )
    if out is not None:
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
        if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
            raise ValueError(
                f"out must match q ({tuple(q.shape)}, {q.dtype}, {q.device}), got "
                f"({tuple(out.shape)}, {out.dtype}, {out.device})"
            )


def _is_number(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float))


def check_sliding_window(sliding_window) -> None:
    """``sliding_window`` is None or an int >= 1."""
    if sliding_window is None:
        return
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int):
        raise TypeError(f"sliding_window must be an int or None, got {type(sliding_window).__name__}")
    if sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 (keys a query sees, itself included), got {sliding_window}")


def check_variants(q: torch.Tensor, scale, sliding_window, logit_softcap, sinks) -> None:
    """Check the per-layer attention variants: ``scale`` and ``logit_softcap`` are None or
    finite positive Python numbers, ``sliding_window`` None or an int >= 1, ``sinks`` None or
    a floating ``[num_heads]`` tensor on q's device."""
    for name, value in (("scale", scale), ("logit_softcap", logit_softcap)):
        if value is None:
            continue
        if not _is_number(value):
            raise TypeError(f"{name} must be a Python float or None, got {type(value).__name__}")
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"{name} must be finite and > 0, got {value}")
    check_sliding_window(sliding_window)
    if sinks is None:
        return
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"sinks must be a torch.Tensor or None, got {type(sinks).__name__}")
    if sinks.shape != (q.shape[1],):
        raise ValueError(f"sinks must be [num_heads={q.shape[1]}] (one logit per query head), "
                         f"got {tuple(sinks.shape)}")
    if sinks.dtype not in FLOAT_DTYPES:
        raise ValueError(f"sinks must be floating point, got {sinks.dtype}")
    if sinks.device != q.device:
        raise ValueError(f"sinks is on {sinks.device}, q on {q.device}")


def resolve_scale(scale: float | None, head_dim: int) -> float:
    """``scale`` as a float; None means ``1 / sqrt(head_dim)``."""
    return head_dim ** -0.5 if scale is None else float(scale)


def index_on(index: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``index`` (block pairs, rows, addresses) on ``device``, as ``dtype``: a copy from the host
    is queued without making the host wait for the stream; a copy from a device to the host
    waits, because the host reads it next (an asynchronous one would land in pinned memory after
    the read)."""
    device = torch.device(device)
    to_host = device.type == "cpu" and index.device.type != "cpu"
    return index.to(device=device, dtype=dtype or index.dtype, non_blocking=not to_host)


def check_block_pairs(block_pairs: torch.Tensor) -> None:
    """Check that ``block_pairs`` is an integer ``[n, 2]`` (src, dst) tensor."""
    if not isinstance(block_pairs, torch.Tensor):
        raise TypeError(f"block_pairs must be a torch.Tensor, got {type(block_pairs).__name__}")
    if block_pairs.dtype not in INDEX_DTYPES:
        raise ValueError(f"block_pairs must be int32 or int64, got {block_pairs.dtype}")
    if block_pairs.dim() != 2 or block_pairs.shape[1] != 2:
        raise ValueError(f"block_pairs must be [n, 2] (src, dst), got {tuple(block_pairs.shape)}")


def check_copy_blocks(k_caches, v_caches, block_pairs: torch.Tensor) -> None:
    """Check the arguments of ``copy_blocks``."""
    if not isinstance(k_caches, (list, tuple)) or not isinstance(v_caches, (list, tuple)):
        raise TypeError("k_caches and v_caches must be lists of per-layer cache tensors")
    if len(k_caches) != len(v_caches):
        raise ValueError(f"{len(k_caches)} k_caches but {len(v_caches)} v_caches")
    for k_cache, v_cache in zip(k_caches, v_caches):
        check_cache_pair(k_cache, v_cache)
    check_block_pairs(block_pairs)


def check_swap_blocks(src_cache: torch.Tensor, dst_cache: torch.Tensor, block_pairs) -> None:
    """Check the arguments of ``swap_blocks``."""
    if not isinstance(src_cache, torch.Tensor) or not isinstance(dst_cache, torch.Tensor):
        raise TypeError("src_cache and dst_cache must be torch.Tensor")
    if src_cache.dim() < 1 or dst_cache.dim() < 1 or src_cache.shape[1:] != dst_cache.shape[1:]:
        raise ValueError(
            f"src_cache {tuple(src_cache.shape)} and dst_cache {tuple(dst_cache.shape)} "
            "must have the same per-block shape"
        )
    if src_cache.dtype != dst_cache.dtype:
        raise ValueError(f"src_cache dtype {src_cache.dtype} != dst_cache dtype {dst_cache.dtype}")
    check_block_pairs(block_pairs)
