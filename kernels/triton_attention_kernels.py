"""Triton kernels for paged attention: prefill/mixed batches and split-K decode.

Conventions shared by all kernels:
- Caches are ``[num_blocks, block_size, num_kv_heads, head_dim]``; every tensor is addressed
  through explicit strides, so views (e.g. q sliced out of a fused qkv projection) work.
- A KV tile is ``BLOCK_N`` consecutive context positions, gathered token by token through the
  block table, so tiles need not line up with cache blocks (block sizes 8..64 all work).
- Scores are kept in the log2 domain (``scale_log2 = scale * log2(e)``) so ``exp2`` is used.
- The query heads that share one KV head are packed into the M dimension of one tile, so each
  K/V tile is loaded once per KV head rather than once per query head.
- ``BLOCK_D`` is ``head_dim`` padded to a power of two; the tail is masked.

Variants, each a constexpr flag so the plain kernel compiles exactly as without them:
- ``HAS_WINDOW``: a query at position p sees keys k with ``p - window < k <= p``. The KV loop
  starts at the first position the tile's first query sees, so block table entries of blocks
  wholly before it are never loaded (they may be -1).
- ``HAS_SOFTCAP``: scores become ``softcap * tanh(scores / softcap)`` before the mask. In the
  log2 domain that is ``softcap_log2 * tanh(scores_log2 / softcap_log2)`` with
  ``softcap_log2 = softcap * log2(e)``; tanh is built from ``exp2`` (no libdevice needed).
- ``HAS_SINKS``: one logit per query head (``sinks_ptr``, natural units, unscaled) joins the
  softmax denominator. It starts the online softmax as a key with weight 1 and value 0
  (m = sink, l = 1); in split decode only split 0 carries it.
"""

from dataclasses import dataclass

import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class Tiles:
    """How an attention kernel is launched: context positions per K/V tile (``block_n``),
    query rows per program (``block_m``, the prefill kernel's: query tokens x the query heads
    of one KV head), warps, and software-pipelining stages (None: Triton's default)."""

    block_n: int
    num_warps: int
    block_m: int = 0
    num_stages: int | None = None

    def launch_options(self) -> dict:
        return {"num_warps": self.num_warps,
                **({} if self.num_stages is None else {"num_stages": self.num_stages})}


def prefill_tiles(block_d: int, is_float32: bool) -> Tiles:
    """The prefill kernel's default: 64 x 64 tiles; fp32 (IEEE dots) and head dim 256 take
    32 x 32 to fit shared memory."""
    tile = 64 if block_d <= 128 and not is_float32 else 32
    return Tiles(block_n=tile, block_m=tile, num_warps=4 if block_d <= 128 else 8)


def decode_tiles(block_d: int) -> Tiles:
    """The decode kernel's default: K/V tiles of 64 positions (32 for head dim 256), 4 warps."""
    return Tiles(block_n=64 if block_d <= 128 else 32, num_warps=4)


@triton.jit
def _tanh(x):
    """tanh from exp2, symmetric so large |x| saturates to +-1 without overflow."""
    e = tl.exp2(-2.0 * 1.4426950408889634 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0.0, -t, t)


@triton.jit
def _init_softmax_state(sinks_ptr, head, row_mask, carries_sink, BLOCK_M: tl.constexpr,
                        HAS_SINKS: tl.constexpr):
    """(m_i, l_i) before any key: empty, or the sink as a key of weight 1 and value 0."""
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head, mask=row_mask, other=float("-inf")).to(tl.float32) * 1.4426950408889634
        sink = tl.where(carries_sink, sink, float("-inf"))
        m_i = sink
        l_i = tl.where(sink == float("-inf"), 0.0, 1.0)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
    return m_i, l_i


@triton.jit
def _attend_kv_tile(
    q, q_pos, m_i, l_i, acc,
    k_cache_ptr, v_cache_ptr, block_table_row, kv_start, kv_end, kv_head, offs_d, d_mask, scale_log2,
    window, softcap_log2,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_vb, stride_vt, stride_vh, stride_vd,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
):
    """Online-softmax update of (m_i, l_i, acc) with context positions [kv_start, kv_start + BLOCK_N).

    Positions at or past ``kv_end`` are masked; with IS_CAUSAL, so are positions after a row's
    ``q_pos`` (and with HAS_WINDOW those at or before ``q_pos - window``). Rows that see
    nothing yet keep m_i = -inf and contribute no NaN. Only table entries of positions in
    [kv_start, kv_end) are loaded.
    """
    offs_n = kv_start + tl.arange(0, BLOCK_N)
    n_mask = offs_n < kv_end
    physical = tl.load(block_table_row + offs_n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
    in_block = offs_n % BLOCK_SIZE
    kv_mask = n_mask[:, None] & d_mask[None, :]

    k_offsets = (physical[:, None] * stride_kb + in_block[:, None] * stride_kt
                 + kv_head * stride_kh + offs_d[None, :] * stride_kd)
    k = tl.load(k_cache_ptr + k_offsets, mask=kv_mask, other=0.0)
    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
    if HAS_SOFTCAP:
        scores = softcap_log2 * _tanh(scores / softcap_log2)
    if IS_CAUSAL:
        visible = (offs_n[None, :] <= q_pos[:, None]) & n_mask[None, :]
        if HAS_WINDOW:
            visible = visible & (offs_n[None, :] > q_pos[:, None] - window)
    else:
        visible = n_mask[None, :]
    scores = tl.where(visible, scores, float("-inf"))

    m_new = tl.maximum(m_i, tl.max(scores, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(scores - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)

    v_offsets = (physical[:, None] * stride_vb + in_block[:, None] * stride_vt
                 + kv_head * stride_vh + offs_d[None, :] * stride_vd)
    v = tl.load(v_cache_ptr + v_offsets, mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


# Triton compiles a kernel once per specialisation of its integer arguments (value 1, or a
# multiple of 16). Those that follow a step's shape are left unspecialised, so that each
# kernel has one variant per model, compiled at load (``ModelRunner.warm_up_kernels``).
@triton.jit(do_not_specialize=["num_seqs", "stride_bts"])
def paged_prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, cu_seqlens_q_ptr, seq_lens_ptr, out_ptr, sinks_ptr,
    scale_log2, num_seqs, window, softcap_log2,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_vb, stride_vt, stride_vh, stride_vd,
    stride_bts,
    stride_ot, stride_oh, stride_od,
    NUM_Q_PER_KV: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    """One program = BLOCK_Q query tokens of one sequence x all query heads of one KV head.

    Grid: (num_tokens // BLOCK_Q + num_seqs, num_kv_heads). Sequence i owns tiles starting at
    cu_seqlens_q[i] // BLOCK_Q + i, which leaves at least ceil(q_len / BLOCK_Q) tiles for it;
    surplus programs exit at once. The owning sequence is found by binary search, so the
    host never needs the per-sequence lengths (no device sync).
    """
    tile_id = tl.program_id(0)
    kv_head = tl.program_id(1)

    # Largest i with cu_seqlens_q[i] // BLOCK_Q + i <= tile_id.
    lo = tile_id * 0
    hi = lo + num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        mid_start = tl.load(cu_seqlens_q_ptr + mid) // BLOCK_Q + mid
        if mid_start <= tile_id:
            lo = mid + 1
        else:
            hi = mid
    seq = lo - 1

    q_first = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_first
    q_begin = (tile_id - (q_first // BLOCK_Q + seq)) * BLOCK_Q
    if q_begin >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len  # tokens cached before this step's queries

    BLOCK_M: tl.constexpr = BLOCK_Q * BLOCK_G
    offs_m = tl.arange(0, BLOCK_M)
    q_idx = q_begin + offs_m // BLOCK_G
    group_idx = offs_m % BLOCK_G
    head = kv_head * NUM_Q_PER_KV + group_idx
    row_mask = (q_idx < q_len) & (group_idx < NUM_Q_PER_KV)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    token = (q_first + q_idx).to(tl.int64)

    q_offsets = token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :] * stride_qd
    q = tl.load(q_ptr + q_offsets, mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    q = q.to(k_cache_ptr.dtype.element_ty)
    q_pos = context_len + q_idx

    m_i, l_i = _init_softmax_state(sinks_ptr, head, group_idx < NUM_Q_PER_KV, True, BLOCK_M, HAS_SINKS)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # Causal: the last query of this tile sits at context_len + q_begin + BLOCK_Q - 1; with a
    # window, its first query (at context_len + q_begin) sees nothing before kv_begin.
    kv_end = tl.minimum(seq_len, context_len + q_begin + BLOCK_Q)
    kv_begin = q_begin * 0
    if HAS_WINDOW:
        kv_begin = tl.maximum(kv_begin, context_len + q_begin - window + 1)
    block_table_row = block_tables_ptr + seq.to(tl.int64) * stride_bts
    for kv_start in range(kv_begin, kv_end, BLOCK_N):
        m_i, l_i, acc = _attend_kv_tile(
            q, q_pos, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, block_table_row, kv_start, kv_end, kv_head,
            offs_d, d_mask, scale_log2, window, softcap_log2,
            stride_kb, stride_kt, stride_kh, stride_kd, stride_vb, stride_vt, stride_vh, stride_vd,
            BLOCK_SIZE, BLOCK_N, True, DOT_PRECISION, HAS_WINDOW, HAS_SOFTCAP,
        )

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    result = acc / l_safe[:, None]
    o_offsets = token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :] * stride_od
    tl.store(out_ptr + o_offsets, result.to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & d_mask[None, :])


@triton.jit(do_not_specialize=["num_splits", "stride_bts"])
def paged_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, sinks_ptr,
    scale_log2, num_splits, window, softcap_log2,
    stride_qs, stride_qh, stride_qd,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_vb, stride_vt, stride_vh, stride_vd,
    stride_bts,
    stride_os, stride_oh, stride_od,
    NUM_HEADS: tl.constexpr, NUM_Q_PER_KV: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    """One program = one sequence x one KV head (all its query heads) x one context split.

    Grid: (num_seqs, num_kv_heads, num_splits). Each sequence's own context (from ``first``,
    the first position the query sees: 0, or ``seq_len - window`` with a window) is cut into
    num_splits parts of whole K/V tiles, so that a context shorter than the block table's
    width (as in a CUDA graph, whose grid is fixed for the widest table) still spreads over
    every split. Split s covers [first + s * split_len, first + (s + 1) * split_len), where
    split_len = ceil(context / num_splits) rounded up to BLOCK_N; the last ones may be
    empty (their partials merge as nothing). Without IS_SPLIT (one
    split) the normalised result goes straight to ``out``; otherwise the unnormalised
    accumulator, running max (log2 domain) and running sum go to the partial buffers
    ``[num_seqs, num_heads, num_splits(, head_dim)]`` and ``paged_decode_reduce_kernel``
    merges them. num_splits is a runtime value
    so a changing batch size never triggers a recompile.
    """
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + seq)
    kv_first = seq_len * 0
    if HAS_WINDOW:
        kv_first = tl.maximum(kv_first, seq_len - window)
    split_len = tl.cdiv(tl.cdiv(seq_len - kv_first, num_splits), BLOCK_N) * BLOCK_N
    kv_begin = kv_first + split * split_len
    kv_end = tl.minimum(kv_begin + split_len, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    head = kv_head * NUM_Q_PER_KV + offs_g
    g_mask = offs_g < NUM_Q_PER_KV
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    seq64 = seq.to(tl.int64)

    q_offsets = seq64 * stride_qs + head[:, None] * stride_qh + offs_d[None, :] * stride_qd
    q = tl.load(q_ptr + q_offsets, mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    q = q.to(k_cache_ptr.dtype.element_ty)

    m_i, l_i = _init_softmax_state(sinks_ptr, head, g_mask, split == 0, BLOCK_G, HAS_SINKS)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)

    block_table_row = block_tables_ptr + seq64 * stride_bts
    for kv_start in range(kv_begin, kv_end, BLOCK_N):
        m_i, l_i, acc = _attend_kv_tile(
            q, kv_end, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, block_table_row, kv_start, kv_end, kv_head,
            offs_d, d_mask, scale_log2, window, softcap_log2,
            stride_kb, stride_kt, stride_kh, stride_kd, stride_vb, stride_vt, stride_vh, stride_vd,
            BLOCK_SIZE, BLOCK_N, False, DOT_PRECISION, False, HAS_SOFTCAP,
        )

    out_mask = g_mask[:, None] & d_mask[None, :]
    if not IS_SPLIT:
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)  # seq_len == 0 gives zeros, not NaN
        result = acc / l_safe[:, None]
        o_offsets = seq64 * stride_os + head[:, None] * stride_oh + offs_d[None, :] * stride_od
        tl.store(out_ptr + o_offsets, result.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        row = (seq64 * NUM_HEADS + head) * num_splits + split
        tl.store(part_max_ptr + row, m_i, mask=g_mask)
        tl.store(part_sum_ptr + row, l_i, mask=g_mask)
        tl.store(part_acc_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=out_mask)


# The reduce kernel reads the partials this many splits at a time, whatever their count, so
# that it compiles once per model.
REDUCE_BLOCK_SPLITS = 16


@triton.jit(do_not_specialize=["num_splits"])
def paged_decode_reduce_kernel(
    out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, num_splits,
    stride_os, stride_oh, stride_od,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SPLITS: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Merge split-K partials by log-sum-exp, BLOCK_SPLITS splits at a time. Grid: (num_seqs, num_heads)."""
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_SPLITS)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    first_row = (seq * NUM_HEADS + head) * num_splits

    maxima = tl.full([BLOCK_SPLITS], float("-inf"), tl.float32)
    for start in range(0, num_splits, BLOCK_SPLITS):
        split = start + offs_s
        maxima = tl.maximum(maxima, tl.load(part_max_ptr + first_row + split, mask=split < num_splits,
                                            other=float("-inf")))
    global_max = tl.max(maxima, 0)
    global_max = tl.where(global_max == float("-inf"), 0.0, global_max)  # empty sequence

    sums = tl.zeros([BLOCK_SPLITS], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for start in range(0, num_splits, BLOCK_SPLITS):
        split = start + offs_s
        s_mask = split < num_splits
        row = first_row + split
        weight = tl.exp2(tl.load(part_max_ptr + row, mask=s_mask, other=float("-inf")) - global_max)  # empty: 0
        sums += tl.load(part_sum_ptr + row, mask=s_mask, other=0.0) * weight
        part_acc = tl.load(part_acc_ptr + row[:, None] * HEAD_DIM + offs_d[None, :],
                           mask=s_mask[:, None] & d_mask[None, :], other=0.0)
        acc += tl.sum(part_acc * weight[:, None], 0)
    total = tl.sum(sums, 0)
    total = tl.where(total > 0.0, total, 1.0)
    result = acc / total
    o_offsets = seq * stride_os + head * stride_oh + offs_d * stride_od
    tl.store(out_ptr + o_offsets, result.to(out_ptr.dtype.element_ty), mask=d_mask)
