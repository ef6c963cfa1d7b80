"""Triton backend of the paged KV-cache ops (CUDA; CPU only through Triton's interpreter).

Layout (shared with the torch backend):
- Per layer ``k_cache``/``v_cache``: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
- ``block_tables``: int32 ``[num_seqs, max_blocks_per_seq]``; slot = block * block_size + offset.
- Attention returns ``[num_tokens, num_heads, head_dim]`` in q's dtype; accumulation is fp32.

CPU tensors work only under Triton's interpreter, which triton selects when it is imported
(``TRITON_INTERPRET=1`` must already be in the environment); otherwise they raise ``RuntimeError``.
Host code never reads device values (no ``.item()``), so these ops don't synchronise.

Host <-> device block swaps use torch index copies: a Triton program on the GPU cannot address
host memory, and the copy engine is what moves pinned host pages anyway.
"""

import math

import torch
import triton
import triton.language as tl

from . import layout
from . import triton_attention_kernels as attention_kernels
from . import triton_cache_kernels as cache_kernels

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Context tokens one decode split should cover at least, and the resident decode programs per SM
# the heuristic aims for. Chosen on two H200 sweeps (fp16, 32/4 heads, head_dim 128, batches 4-256
# at 1k/4k/16k; `bench_kernels_gpu.py --sweep`), which disagreed on what a split costs the host:
# against the best split count per shape, these values come out 1.07x and 1.05x slower (geometric
# mean; 1.36x and 1.57x at worst), where 256 tokens gave 1.27x and 1.05x (3.06x at worst: three
# splits of a 64 x 1k batch) and 4,096 tokens at 2 per SM (fitted to the first sweep) 1.01x and 1.35x.
_MIN_SPLIT_TOKENS = 1024
_PROGRAMS_PER_SM = 4
_MAX_SPLITS = 64


def _interpreting() -> bool:
    """Whether the kernels were built for Triton's interpreter (TRITON_INTERPRET=1 at import)."""
    is_kernel_interpreted = not isinstance(attention_kernels.paged_decode_kernel, triton.JITFunction)
    is_language_interpreted = not isinstance(tl.zeros, triton.JITFunction)
    if is_kernel_interpreted != is_language_interpreted:
        raise RuntimeError(
            "TRITON_INTERPRET changed between importing triton and importing pagedserve.kernels.triton_ops; "
            "set it in the environment before either is imported"
        )
    return is_kernel_interpreted


def _require_runnable(op_name: str, *tensors: torch.Tensor) -> None:
    device = tensors[0].device
    for tensor in tensors[1:]:
        if tensor.device != device:
            raise ValueError(f"{op_name}: all tensors must be on one device, got {device} and {tensor.device}")
    if device.type != "cuda" and not _interpreting():
        raise RuntimeError(
            f"{op_name}: the Triton backend needs CUDA tensors, got tensors on {device}. "
            "Use backend='torch' on CPU, or set TRITON_INTERPRET=1 in the environment before triton is "
            "first imported (transformers imports it too) to run Triton's slow, test-only interpreter."
        )


def _require_dtype(op_name: str, tensor: torch.Tensor, name: str) -> None:
    if tensor.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"{op_name}: {name} must be float16, bfloat16 or float32, got {tensor.dtype}")


def _check_caches(op_name: str, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"{op_name}: k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if k_cache.dtype != v_cache.dtype:
        raise TypeError(f"{op_name}: k_cache and v_cache dtypes differ ({k_cache.dtype} vs {v_cache.dtype})")
    _require_dtype(op_name, k_cache, "k_cache")


def _check_attention_inputs(op_name, q, k_cache, v_cache, block_tables, out):
    _check_caches(op_name, k_cache, v_cache)
    _require_dtype(op_name, q, "q")
    if q.dim() != 3:
        raise ValueError(f"{op_name}: q must be [tokens, num_heads, head_dim], got {tuple(q.shape)}")
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    if head_dim != k_cache.shape[3]:
        raise ValueError(f"{op_name}: q head_dim {head_dim} != cache head_dim {k_cache.shape[3]}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"{op_name}: num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if block_tables.dim() != 2 or block_tables.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{op_name}: block_tables must be an int32 [num_seqs, max_blocks_per_seq] tensor")
    if out is not None and out.shape != q.shape:
        raise ValueError(f"{op_name}: out shape {tuple(out.shape)} != q shape {tuple(q.shape)}")


def _resolve_scale(scale: float | None, head_dim: int) -> float:
    return head_dim ** -0.5 if scale is None else float(scale)


def _variant_args(q: torch.Tensor, sliding_window, logit_softcap, sinks) -> tuple[list, dict]:
    """The kernels' (sinks_ptr, window, softcap_log2) runtime arguments and variant flags.

    Absent variants pass placeholders the kernel never reads (their flag is off). Sinks are
    read in their own dtype, so no per-call conversion runs."""
    args = [q if sinks is None else sinks.contiguous(),
            0 if sliding_window is None else int(sliding_window),
            1.0 if logit_softcap is None else float(logit_softcap) * math.log2(math.e)]
    flags = dict(HAS_WINDOW=sliding_window is not None, HAS_SOFTCAP=logit_softcap is not None,
                 HAS_SINKS=sinks is not None)
    return args, flags


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs would silently get TF32 tensor-core dots otherwise.
    return "ieee" if dtype == torch.float32 else "tf32"


def _block_g(num_q_per_kv: int) -> int:
    # tl.dot needs M >= 16 on GPUs; padded query-head rows are masked.
    return max(16, triton.next_power_of_2(num_q_per_kv))


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` into their cache slots.

    Token t goes to block ``slot_mapping[t] // block_size``, offset ``slot_mapping[t] % block_size``;
    tokens with slot -1 are skipped. Values are cast to the cache dtype.
    """
    op = "write_kv"
    _require_runnable(op, key, value, k_cache, v_cache, slot_mapping)
    _check_caches(op, k_cache, v_cache)
    if key.shape != value.shape or key.dim() != 3 or tuple(key.shape[1:]) != tuple(k_cache.shape[2:]):
        raise ValueError(
            f"{op}: key/value must be [num_tokens, {k_cache.shape[2]}, {k_cache.shape[3]}], "
            f"got {tuple(key.shape)} and {tuple(value.shape)}"
        )
    if slot_mapping.shape != (key.shape[0],):
        raise ValueError(f"{op}: slot_mapping must be [num_tokens={key.shape[0]}], got {tuple(slot_mapping.shape)}")
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    block_d = triton.next_power_of_2(head_dim)
    block_h = min(triton.next_power_of_2(num_kv_heads), max(1, 2048 // block_d))
    grid = (num_tokens, triton.cdiv(num_kv_heads, block_h))
    cache_kernels.write_kv_kernel[grid](
        key, value, k_cache, v_cache, slot_mapping,
        *key.stride(), *value.stride(), *k_cache.stride(), *v_cache.stride(),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=block_h, BLOCK_D=block_d, num_warps=4,
    )


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, scale: float | None = None,
                    out: torch.Tensor | None = None, *, sliding_window: int | None = None,
                    logit_softcap: float | None = None, sinks: torch.Tensor | None = None,
                    tiles: attention_kernels.Tiles | None = None) -> torch.Tensor:
    """Causal attention over the paged cache for a flattened batch of prefill chunks and decodes.

    ``q`` is ``[num_tokens, num_heads, head_dim]``; sequence i owns rows
    ``cu_seqlens_q[i]:cu_seqlens_q[i+1]``, which are the last ``q_len_i`` of its ``seq_lens[i]``
    tokens (their K/V already written). Query j of sequence i sits at position
    ``p = seq_lens[i] - q_len_i + j`` and sees cache positions ``0..p`` (``p - sliding_window + 1..p``
    with a window; table entries of blocks wholly before the first query's window are never read).
    ``logit_softcap`` and ``sinks`` as in ``pagedserve.kernels.paged_attention``. Returns ``out``
    (allocated in q's dtype when None); rows of every listed sequence are written, others are untouched.
    ``tiles`` overrides the launch (``prefill_tiles``' default; benchmarks compare others).
    """
    op = "paged_attention"
    _require_runnable(op, q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens)
    _check_attention_inputs(op, q, k_cache, v_cache, block_tables, out)
    num_seqs = seq_lens.shape[0]
    if cu_seqlens_q.shape != (num_seqs + 1,):
        raise ValueError(f"{op}: cu_seqlens_q must be [num_seqs + 1={num_seqs + 1}], got {tuple(cu_seqlens_q.shape)}")
    if block_tables.shape[0] < num_seqs:
        raise ValueError(f"{op}: block_tables has {block_tables.shape[0]} rows for {num_seqs} sequences")
    if out is None:
        out = torch.empty_like(q)
    else:
        _require_runnable(op, q, out)
    num_tokens, num_heads, head_dim = q.shape
    if num_tokens == 0 or num_seqs == 0:
        return out
    num_kv_heads = k_cache.shape[2]
    num_q_per_kv = num_heads // num_kv_heads

    block_g = triton.next_power_of_2(num_q_per_kv)
    block_d = triton.next_power_of_2(head_dim)
    if tiles is None:
        tiles = attention_kernels.prefill_tiles(block_d, k_cache.dtype == torch.float32)
    block_q = max(1, tiles.block_m // block_g)  # BLOCK_Q * BLOCK_G rows per tile, >= 16 for tl.dot
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    (sinks_arg, window, softcap_log2), flags = _variant_args(q, sliding_window, logit_softcap, sinks)
    attention_kernels.paged_prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, out, sinks_arg,
        _resolve_scale(scale, head_dim) * math.log2(math.e), num_seqs, window, softcap_log2,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), block_tables.stride(0), *out.stride(),
        NUM_Q_PER_KV=num_q_per_kv, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_G=block_g, BLOCK_Q=block_q, BLOCK_D=block_d, BLOCK_N=tiles.block_n,
        DOT_PRECISION=_dot_precision(k_cache.dtype), **flags, **tiles.launch_options(),
    )
    return out


def _choose_num_splits(device: torch.device, num_programs: int, max_context: int) -> int:
    if device.type == "cuda":
        num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    else:
        num_sms = 1  # interpreter: programs run one after another, splitting only adds work
    # A few resident programs per SM keep enough loads in flight to saturate HBM.
    wanted = triton.cdiv(_PROGRAMS_PER_SM * num_sms, max(1, num_programs))
    return max(1, min(wanted, triton.cdiv(max_context, _MIN_SPLIT_TOKENS), _MAX_SPLITS))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float | None = None,
                           out: torch.Tensor | None = None, *, num_splits: int | None = None,
                           sliding_window: int | None = None, logit_softcap: float | None = None,
                           sinks: torch.Tensor | None = None,
                           tiles: attention_kernels.Tiles | None = None) -> torch.Tensor:
    """Attention of one new token per sequence over its whole cached context (``seq_lens[i]`` tokens).

    ``q`` is ``[num_seqs, num_heads, head_dim]``. Long contexts are split across programs
    (flash-decoding) and merged by log-sum-exp; ``num_splits`` overrides the heuristic (it is an
    upper bound: splits never go below one block tile). All query heads sharing a KV head are
    handled by one program, so each K/V tile is read once per KV head. A sequence with
    ``seq_lens[i] == 0`` gets zeros. With ``sliding_window`` only the last ``sliding_window``
    positions are read (and split), so earlier table entries may be -1. ``tiles`` overrides
    the launch (``decode_tiles``' default).
    """
    op = "paged_decode_attention"
    _require_runnable(op, q, k_cache, v_cache, block_tables, seq_lens)
    _check_attention_inputs(op, q, k_cache, v_cache, block_tables, out)
    num_seqs, num_heads, head_dim = q.shape
    if seq_lens.shape != (num_seqs,) or block_tables.shape[0] < num_seqs:
        raise ValueError(
            f"{op}: need seq_lens [{num_seqs}] and >= {num_seqs} block table rows, "
            f"got {tuple(seq_lens.shape)} and {tuple(block_tables.shape)}"
        )
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"{op}: num_splits must be >= 1, got {num_splits}")
    if out is None:
        out = torch.empty_like(q)
    else:
        _require_runnable(op, q, out)
    if num_seqs == 0:
        return out
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    num_q_per_kv = num_heads // num_kv_heads
    block_d = triton.next_power_of_2(head_dim)
    if tiles is None:
        tiles = attention_kernels.decode_tiles(block_d)
    block_n = tiles.block_n

    # Upper bound on any context from the table's width (and the window): no device->host sync.
    max_context = max(1, block_tables.shape[1] * block_size)
    if sliding_window is not None:
        max_context = min(max_context, sliding_window)
    if num_splits is None:
        num_splits = _choose_num_splits(q.device, num_seqs * num_kv_heads, max_context)
    # As many splits as parts of whole K/V tiles the widest context takes; the kernel then
    # cuts each sequence's own context into that many.
    num_splits = triton.cdiv(max_context, triton.cdiv(triton.cdiv(max_context, num_splits), block_n) * block_n)

    if num_splits > 1:
        part_acc = torch.empty((num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
        part_max = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=q.device)
        part_sum = torch.empty_like(part_max)
    else:
        part_acc = part_max = part_sum = out  # unused by the kernel
    (sinks_arg, window, softcap_log2), flags = _variant_args(q, sliding_window, logit_softcap, sinks)
    attention_kernels.paged_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, part_acc, part_max, part_sum, sinks_arg,
        _resolve_scale(scale, head_dim) * math.log2(math.e), num_splits, window, softcap_log2,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), block_tables.stride(0), *out.stride(),
        NUM_HEADS=num_heads, NUM_Q_PER_KV=num_q_per_kv, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_G=_block_g(num_q_per_kv), BLOCK_D=block_d, BLOCK_N=block_n, IS_SPLIT=num_splits > 1,
        DOT_PRECISION=_dot_precision(k_cache.dtype), **flags, **tiles.launch_options(),
    )
    if num_splits > 1:
        attention_kernels.paged_decode_reduce_kernel[(num_seqs, num_heads)](
            out, part_acc, part_max, part_sum, num_splits, *out.stride(),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim,
            BLOCK_SPLITS=attention_kernels.REDUCE_BLOCK_SPLITS, BLOCK_D=block_d, num_warps=4,
        )
    return out


def _block_pairs_on(block_pairs: torch.Tensor, device: torch.device, op_name: str) -> torch.Tensor:
    if block_pairs.dim() != 2 or block_pairs.shape[1] != 2:
        raise ValueError(f"{op_name}: block_pairs must be [num_pairs, 2], got {tuple(block_pairs.shape)}")
    return layout.index_on(block_pairs, device, torch.int64).contiguous()


def _launch_block_copy(src_caches, dst_caches, pairs: torch.Tensor, op_name: str) -> None:
    reference = src_caches[0]
    for cache in (*src_caches, *dst_caches):
        if not cache.is_contiguous():
            raise ValueError(f"{op_name}: caches must be contiguous")
        if cache.dtype != reference.dtype or cache.shape[1:] != reference.shape[1:]:
            raise ValueError(f"{op_name}: all caches must share dtype and block shape")
    device = reference.device
    src_addrs = layout.index_on(torch.tensor([c.data_ptr() for c in src_caches], dtype=torch.int64), device)
    dst_addrs = layout.index_on(torch.tensor([c.data_ptr() for c in dst_caches], dtype=torch.int64), device)
    block_numel = reference[0].numel()
    cache_kernels.copy_blocks_kernel[(len(src_caches), pairs.shape[0])](
        src_addrs, dst_addrs, reference, pairs, block_numel, BLOCK=1024, num_warps=4,
    )


def copy_blocks(k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], block_pairs: torch.Tensor) -> None:
    """For every layer, copy block ``block_pairs[p, 0]`` onto block ``block_pairs[p, 1]`` in K and V.

    One launch covers all layers. Destinations must be distinct and never also a source in the
    same call (programs run in no fixed order). Caches must be contiguous and alike.
    """
    op = "copy_blocks"
    if len(k_caches) != len(v_caches) or not k_caches:
        raise ValueError(f"{op}: need the same non-zero number of K and V caches")
    caches = [*k_caches, *v_caches]
    _require_runnable(op, *caches)
    if block_pairs.numel() == 0:
        return
    pairs = _block_pairs_on(block_pairs, caches[0].device, op)
    _launch_block_copy(caches, caches, pairs, op)


def swap_blocks(src_cache: torch.Tensor, dst_cache: torch.Tensor, block_pairs: torch.Tensor) -> None:
    """Copy block ``block_pairs[p, 0]`` of ``src_cache`` onto block ``block_pairs[p, 1]`` of ``dst_cache``.

    Meant for device <-> host swapping of one cache tensor. When the two sides are on different
    devices this uses torch index copies (Triton cannot address host memory from the GPU); the
    host side should be pinned for the transfer to be asynchronous. Same-device copies use the
    Triton block-copy kernel.
    """
    op = "swap_blocks"
    if src_cache.dtype != dst_cache.dtype or src_cache.shape[1:] != dst_cache.shape[1:]:
        raise ValueError(
            f"{op}: caches must share dtype and block shape, got {src_cache.dtype}{tuple(src_cache.shape)} "
            f"and {dst_cache.dtype}{tuple(dst_cache.shape)}"
        )
    if block_pairs.numel() == 0:
        return
    if src_cache.device != dst_cache.device:
        _swap_blocks_across_devices(src_cache, dst_cache, _block_pairs_on(block_pairs, torch.device("cpu"), op))
        return
    _require_runnable(op, src_cache, dst_cache)
    pairs = _block_pairs_on(block_pairs, src_cache.device, op)
    _launch_block_copy([src_cache], [dst_cache], pairs, op)


def _swap_blocks_across_devices(src_cache: torch.Tensor, dst_cache: torch.Tensor, pairs: torch.Tensor) -> None:
    src_index = layout.index_on(pairs[:, 0], src_cache.device)
    dst_index = layout.index_on(pairs[:, 1], dst_cache.device)
    gathered = src_cache.index_select(0, src_index)
    is_to_device = dst_cache.device.type != "cpu"
    moved = gathered.to(dst_cache.device, non_blocking=is_to_device)
    dst_cache.index_copy_(0, dst_index, moved)
