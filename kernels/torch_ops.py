"""Paged KV cache operations in plain torch: the CPU path and the reference for the GPU kernels.

Arguments are assumed to have passed the metadata checks in ``layout``; the checks that
need tensor contents (lengths against block table capacity, cu_seqlens_q bounds) are
done here, where the lengths are read on the host anyway.

Attention gathers each sequence's context from the cache through its block table and runs
``scaled_dot_product_attention`` in float32 (float64 for float64 inputs). Decode tokens are
batched: sorted by context length and run in chunks of similar length, each gathered as
whole blocks, padded to its longest context and masked, and small enough that the gathered
context is still in cache when the attention reads it. Each prefill chunk runs on its own
(a row gather of its context slots) with a causal mask offset by its cached prefix.

Variants, per call (one layer): a sliding window (a query at position p sees keys k with
p - window < k <= p; only the blocks a window covers are read, and table entries of blocks
outside every query's window are never read, so they may be -1), soft-capped logits and
learned sinks. Without soft-cap and sinks the attention is SDPA's; with them it is plain
torch math (``_softmax_attention``).

Everything derived from the metadata alone (lengths read to the host, sort order, chunks,
block ids, masks) is an ``AttentionPlan``: ``plan_attention`` builds it once per step and
every layer's ``paged_attention(..., plan=plan)`` reuses it; the window-dependent parts are
built once per distinct window.
"""

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from . import cpu_decode, layout

# Decode runs in chunks of sequences whose gathered K (or V) holds at most this many
# elements, so the gathered copy is still in cache when the attention reads it.
_MAX_GATHER_ELEMENTS = 1 << 18


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def write_kv(key, value, k_cache, v_cache, slot_mapping) -> None:
    """Scatter ``key``/``value`` rows into the caches at ``slot_mapping``; slot -1 is skipped."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    slots = slot_mapping.long()
    is_real = slots >= 0
    if not bool(is_real.all()):
        keep = is_real.nonzero().squeeze(1)
        slots = slots.index_select(0, keep)
        key = key.index_select(0, keep)
        value = value.index_select(0, keep)
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, key.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, value.to(v_cache.dtype))


def _first_visible(query_pos: int, sliding_window: int | None) -> int:
    """First key position a query at ``query_pos`` sees (transformers' window convention:
    keys ``k`` with ``query_pos - sliding_window < k <= query_pos``)."""
    return 0 if sliding_window is None else max(0, query_pos - sliding_window + 1)


def _context_slots(block_table, first: int, end: int, block_size: int) -> torch.Tensor:
    """Slots of positions ``first..end-1`` of one sequence, whose table row is
    ``block_table`` ``[1, width]``: ``[1, end - first]``. Only the entries of blocks
    holding those positions are read."""
    first_block = first // block_size
    num_blocks = -(-end // block_size) - first_block
    blocks = block_table[:, first_block:first_block + num_blocks].long()
    offsets = torch.arange(block_size, device=blocks.device)
    slots = (blocks.unsqueeze(2) * block_size + offsets).view(1, num_blocks * block_size)
    lead = first - first_block * block_size
    return slots[:, lead:lead + end - first]


@dataclass
class DecodeChunk:
    """Rows ``start:end`` of the sorted decode batch, gathered ``num_positions`` wide.

    ``block_ids`` holds, for each row, the blocks its window covers (all of them without a
    window) followed by repeats of the first of them up to ``num_positions // block_size``
    blocks; ``padding_rows`` are the gathered positions outside a row's window or past its
    length, zeroed after the gather so that stale cache contents never reach the
    attention, and ``mask`` hides them from it.
    """

    start: int
    end: int
    num_positions: int
    block_ids: torch.Tensor
    padding_rows: torch.Tensor | None
    mask: torch.Tensor | None


@dataclass
class DecodePlan:
    """Decode sequences sorted by positions to read, most first (``order``: None when
    already sorted).

    With ``is_native`` the C kernel runs them (``chunks`` is empty): it reads the int32
    ``block_tables`` and ``seq_lens`` directly, takes sequences in ``order`` and reads
    only the last ``sliding_window`` positions of each.
    """

    order: torch.Tensor | None
    chunks: list[DecodeChunk]
    is_native: bool = False
    block_tables: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None
    sliding_window: int | None = None
    empty_rows: torch.Tensor | None = None   # padded rows (length 0), left out of ``order``


@dataclass
class PrefillSeq:
    """One sequence with several queries: q rows ``start:end``, the slots of its context
    positions ``first..seq_len-1`` (those its queries' windows cover), and the mask of
    ``[queries, slots]`` (None: plain causal over the whole sequence)."""

    start: int
    end: int
    first: int
    slots: torch.Tensor
    mask: torch.Tensor | None


@dataclass
class WindowPlan:
    """What one sliding window needs: ``decode_rows`` are the q rows of the one-query
    sequences (None when every sequence has one query, in order), ``decode`` their plan,
    ``prefills`` the sequences with more queries."""

    decode_rows: torch.Tensor | None
    decode: DecodePlan | None
    prefills: list[PrefillSeq] = field(default_factory=list)


@dataclass
class AttentionPlan:
    """What ``paged_attention`` derives from the step's metadata, shared by every layer.

    The lengths are read and checked once; the parts that depend on a layer's sliding
    window are built on the first call with that window (``for_window``) and kept, so
    layers alternating between windows share one plan.
    """

    num_tokens: int
    num_seqs: int
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    lens: list[int]
    starts: list[int] | None  # cu_seqlens_q on the host; None: one query per sequence
    cache_shape: tuple[int, int, int, int]
    is_native: bool
    windows: dict = field(default_factory=dict)
    backend: str = "torch"

    def for_window(self, sliding_window: int | None) -> WindowPlan:
        """The plan of the layers with this window (built on first use)."""
        plan = self.windows.get(sliding_window)
        if plan is None:
            plan = _plan_window(self, sliding_window)
            self.windows[sliding_window] = plan
        return plan


def _gather_context(cache_flat, slots, num_kv_heads, compute_dtype):
    """``[rows, max_len]`` slots -> ``[rows, num_kv_heads, max_len, head_dim]`` in compute dtype.

    ``cache_flat`` is the cache viewed as ``[num_slots, num_kv_heads * head_dim]``: row
    gathers are several times faster than gathers over a 3-d view.
    """
    rows, max_len = slots.shape
    gathered = cache_flat.index_select(0, slots.reshape(-1))
    gathered = gathered.view(rows, max_len, num_kv_heads, cache_flat.shape[1] // num_kv_heads)
    return gathered.to(compute_dtype).transpose(1, 2)


def _plan_decode_chunks(sorted_spans: list[int], elements_per_position: int) -> list[tuple[int, int]]:
    """Split sequences sorted by positions to gather (most first) into ``(start, end)``
    chunks whose gathered K (or V), padded to the chunk's widest row, holds at most
    ``_MAX_GATHER_ELEMENTS`` elements (one sequence at least)."""
    chunks = []
    start, num_seqs = 0, len(sorted_spans)
    while start < num_seqs:
        per_seq = sorted_spans[start] * elements_per_position
        end = min(num_seqs, start + max(1, _MAX_GATHER_ELEMENTS // per_seq))
        chunks.append((start, end))
        start = end
    return chunks


def _decode_first_blocks(lens: torch.Tensor, block_size: int, sliding_window: int | None):
    """Per sequence (lengths ``lens``, int64): the first position its decode query sees and
    the block holding it."""
    if sliding_window is None:
        first = torch.zeros_like(lens)
    else:
        first = (lens - sliding_window).clamp(min=0)
    return first, first // block_size


def _plan_decode_chunk(tables, lens_tensor, sorted_spans, start, end, block_size,
                       sliding_window) -> DecodeChunk:
    num_blocks = -(-sorted_spans[start] // block_size)
    num_positions = num_blocks * block_size
    device = tables.device
    chunk_lens = lens_tensor[start:end].long()
    first, first_block = _decode_first_blocks(chunk_lens, block_size, sliding_window)
    num_own_blocks = (chunk_lens + block_size - 1) // block_size - first_block
    columns = torch.arange(num_blocks, device=device)
    is_own_block = columns < num_own_blocks.unsqueeze(1)
    columns = torch.where(is_own_block, first_block.unsqueeze(1) + columns, first_block.unsqueeze(1))
    blocks = tables[start:end].long().gather(1, columns)
    positions = torch.arange(num_positions, device=device)
    offset = first_block * block_size
    is_padding = ((positions < (first - offset).unsqueeze(1))
                  | (positions >= (chunk_lens - offset).unsqueeze(1)))
    padding_rows = mask = None
    if bool(is_padding.any()):
        padding_rows = is_padding.reshape(-1).nonzero().squeeze(1)
        mask = ~is_padding[:, None, None, :]
    return DecodeChunk(start, end, num_positions, blocks.reshape(-1), padding_rows, mask)


def _check_used_blocks(block_tables, seq_lens, block_size: int, num_blocks: int,
                       sliding_window: int | None) -> None:
    """The table entries a decode query reads (the blocks its window covers) must address
    blocks of the cache."""
    lens = seq_lens.long()
    _, first_block = _decode_first_blocks(lens, block_size, sliding_window)
    end_block = (lens + block_size - 1) // block_size
    columns = torch.arange(block_tables.shape[1], device=block_tables.device)
    is_used = (columns >= first_block.unsqueeze(1)) & (columns < end_block.unsqueeze(1))
    used = block_tables[is_used]
    if used.numel() and (int(used.min()) < 0 or int(used.max()) >= num_blocks):
        raise ValueError(
            f"block_tables address blocks outside the cache's {num_blocks} blocks in a window "
            f"the attention reads (sliding_window={sliding_window})")


def plan_decode(block_tables, seq_lens, lens: list[int], cache_shape, is_native: bool,
                sliding_window: int | None = None) -> DecodePlan:
    """Sort one-query sequences by the positions they read (most first); for the torch
    path, cut them into chunks of similar width."""
    num_blocks, block_size, num_kv_heads, head_dim = cache_shape
    num_seqs = len(lens)
    # Positions gathered per sequence: from the start of the block its window starts in.
    spans = [n - _first_visible(n - 1, sliding_window) // block_size * block_size if n else 0 for n in lens]
    order = sorted(range(num_seqs), key=spans.__getitem__, reverse=True)
    if is_native:
        tables = block_tables.to(torch.int32).contiguous()
        lens_tensor = seq_lens.to(torch.int32).contiguous()
        _check_used_blocks(tables, lens_tensor, block_size, num_blocks, sliding_window)
        order_tensor = torch.tensor(order, dtype=torch.int64)
        return DecodePlan(order_tensor, [], True, tables, lens_tensor, sliding_window)
    elements_per_position = num_kv_heads * head_dim
    # Padded rows (length 0) read nothing: they are left out of the order and get zeros.
    num_empty = sum(1 for n in lens if n == 0)
    empty_rows = None
    if num_empty:
        empty_rows = torch.tensor(order[num_seqs - num_empty:], device=block_tables.device)
        order = order[:num_seqs - num_empty]
    sorted_spans = [spans[seq] for seq in order]
    if order == list(range(num_seqs)):
        order_tensor, tables, lens_tensor = None, block_tables, seq_lens
    else:
        order_tensor = torch.tensor(order, dtype=torch.int64, device=block_tables.device)
        tables = block_tables.index_select(0, order_tensor)
        lens_tensor = seq_lens.index_select(0, order_tensor)
    chunks = [
        _plan_decode_chunk(tables, lens_tensor, sorted_spans, start, end, block_size, sliding_window)
        for start, end in _plan_decode_chunks(sorted_spans, elements_per_position)
    ]
    return DecodePlan(order_tensor, chunks, sliding_window=sliding_window, empty_rows=empty_rows)


def _gather_blocks(cache, chunk: DecodeChunk, compute_dtype):
    """A chunk's context: ``[rows, num_kv_heads, num_positions, head_dim]`` in compute dtype."""
    _, _, num_kv_heads, head_dim = cache.shape
    num_rows = chunk.end - chunk.start
    gathered = cache.index_select(0, chunk.block_ids)
    gathered = gathered.view(num_rows * chunk.num_positions, num_kv_heads, head_dim)
    if chunk.padding_rows is not None:
        gathered.index_fill_(0, chunk.padding_rows, 0)
    gathered = gathered.view(num_rows, chunk.num_positions, num_kv_heads, head_dim)
    return gathered.to(compute_dtype).transpose(1, 2)


def _softmax_attention(q, k, v, mask, scale, logit_softcap, sinks):
    """Attention with soft-capped logits and sinks, in plain torch ops.

    ``q`` ``[..., queries, d]``, ``k``/``v`` ``[..., keys, d]`` (leading dims broadcast),
    ``mask`` bool broadcastable to ``[..., queries, keys]`` (True: visible) or None,
    ``sinks`` broadcastable to ``[..., queries, 1]`` or None. Scores are
    ``softcap * tanh(q.k * scale / softcap)``, then masked; a sink joins each row's
    softmax denominator and adds no value.
    """
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if logit_softcap is not None:
        scores = torch.tanh(scores / logit_softcap) * logit_softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.matmul(torch.softmax(scores, dim=-1), v)
    row_max = torch.maximum(scores.amax(dim=-1, keepdim=True), sinks)
    probs = torch.exp(scores - row_max)
    denominator = probs.sum(dim=-1, keepdim=True) + torch.exp(sinks - row_max)
    return torch.matmul(probs, v) / denominator


def _decode_attention(q, k_cache, v_cache, plan: DecodePlan, scale, out, logit_softcap, sinks):
    """One query per sequence; writes ``[n, num_heads, head_dim]`` into ``out``.

    Sequences run most positions first in chunks of similar width, so padding is small
    and each chunk's gathered K/V stays in cache between the gather and the attention.
    Each chunk gathers whole blocks (those the window covers), which copies far fewer,
    larger pieces than a gather of single positions.
    """
    if plan.is_native:
        if q.stride(-1) != 1:
            q = q.contiguous()
        cpu_decode.decode_attention(q, k_cache, v_cache, plan.block_tables, plan.seq_lens, scale,
                                    out, plan.order, sliding_window=plan.sliding_window,
                                    logit_softcap=logit_softcap, sinks=sinks)
        return
    _, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    compute_dtype = _compute_dtype(q.dtype)
    queries = q if plan.order is None else q.index_select(0, plan.order)
    num_seqs = queries.shape[0]
    # The query heads sharing a kv head become that head's query rows: [n, kv_heads, group, d].
    queries = queries.to(compute_dtype).reshape(num_seqs, num_kv_heads, group, head_dim)
    is_plain = logit_softcap is None and sinks is None
    sink_logits = None if sinks is None else sinks.to(compute_dtype).view(1, num_kv_heads, group, 1)
    result = out if plan.order is None else q.new_empty((num_seqs, num_heads, head_dim))
    if plan.empty_rows is not None:
        out.index_fill_(0, plan.empty_rows, 0)
    for chunk in plan.chunks:
        k = _gather_blocks(k_cache, chunk, compute_dtype)
        v = _gather_blocks(v_cache, chunk, compute_dtype)
        chunk_queries = queries[chunk.start:chunk.end]
        if is_plain:
            chunk_out = F.scaled_dot_product_attention(chunk_queries, k, v, attn_mask=chunk.mask,
                                                       scale=scale)
        else:
            chunk_out = _softmax_attention(chunk_queries, k, v, chunk.mask, scale, logit_softcap,
                                           sink_logits)
        result[chunk.start:chunk.end] = chunk_out.reshape(chunk.end - chunk.start, num_heads, head_dim)
    if plan.order is not None:
        out.index_copy_(0, plan.order, result)


# The soft-cap / sink path of a prefill computes scores in row chunks of at most this many
# elements (all heads), so a long prompt never materialises [heads, queries, keys] at once.
_MAX_SCORE_ELEMENTS = 1 << 22


def _prefill_attention(q, k_flat, v_flat, prefill: PrefillSeq, num_kv_heads, scale, out,
                       sliding_window, logit_softcap, sinks):
    """Causal (windowed) attention for the last ``q.shape[0]`` positions of a sequence."""
    num_queries, num_heads, head_dim = q.shape
    compute_dtype = _compute_dtype(q.dtype)
    k = _gather_context(k_flat, prefill.slots, num_kv_heads, compute_dtype)
    v = _gather_context(v_flat, prefill.slots, num_kv_heads, compute_dtype)
    q = q.to(compute_dtype).transpose(0, 1).unsqueeze(0)
    if logit_softcap is None and sinks is None:
        enable_gqa = q.shape[1] != k.shape[1]
        if prefill.mask is None:
            result = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=scale, enable_gqa=enable_gqa
            )
        else:
            result = F.scaled_dot_product_attention(
                q, k, v, attn_mask=prefill.mask, scale=scale, enable_gqa=enable_gqa
            )
        out.copy_(result[0].transpose(0, 1))
        return
    group = num_heads // num_kv_heads
    num_keys = k.shape[2]
    # [kv_heads, group, queries, d] against [kv_heads, 1, keys, d].
    q = q[0].reshape(num_kv_heads, group, num_queries, head_dim)
    k, v = k[0].unsqueeze(1), v[0].unsqueeze(1)
    sink_logits = None if sinks is None else sinks.to(compute_dtype).view(num_kv_heads, group, 1, 1)
    first_query = prefill.first + num_keys - num_queries  # position of query 0
    key_positions = torch.arange(prefill.first, prefill.first + num_keys, device=q.device)
    rows = max(1, _MAX_SCORE_ELEMENTS // (num_heads * num_keys))
    result = torch.empty_like(q)
    for row_start in range(0, num_queries, rows):
        row_end = min(num_queries, row_start + rows)
        # Keys these rows see: up to the last row's position, from the first row's window.
        key_lo = _first_visible(first_query + row_start, sliding_window) - prefill.first
        key_hi = first_query + row_end - prefill.first
        query_positions = torch.arange(first_query + row_start, first_query + row_end, device=q.device)
        visible = key_positions[key_lo:key_hi].unsqueeze(0) <= query_positions.unsqueeze(1)
        if sliding_window is not None:
            visible &= key_positions[key_lo:key_hi].unsqueeze(0) > query_positions.unsqueeze(1) - sliding_window
        result[:, :, row_start:row_end] = _softmax_attention(
            q[:, :, row_start:row_end], k[:, :, key_lo:key_hi], v[:, :, key_lo:key_hi], visible,
            scale, logit_softcap, sink_logits)
    out.copy_(result.reshape(num_heads, num_queries, head_dim).transpose(0, 1))


def _check_seq_lens(lens: list[int], capacity: int) -> None:
    if lens and (min(lens) < 0 or max(lens) > capacity):
        raise ValueError(
            f"seq_lens must lie in [0, {capacity}] (block table width x block_size), "
            f"got min {min(lens)}, max {max(lens)}"
        )


def _is_native(k_cache) -> bool:
    return cpu_decode.supports_cache(k_cache)


def plan_decode_attention(k_cache, block_tables, seq_lens, sliding_window=None) -> AttentionPlan:
    """The plan of ``paged_decode_attention`` (one query per sequence), built for
    ``sliding_window`` now and for other windows on first use."""
    block_size = k_cache.shape[1]
    lens = seq_lens.tolist()
    _check_seq_lens(lens, block_tables.shape[1] * block_size)
    plan = AttentionPlan(len(lens), len(lens), block_tables, seq_lens, lens, None,
                         tuple(k_cache.shape), _is_native(k_cache))
    plan.for_window(sliding_window)
    return plan


def plan_attention(k_cache, block_tables, cu_seqlens_q, seq_lens, sliding_window=None) -> AttentionPlan:
    """The plan of ``paged_attention``: reads the lengths once and checks them; built for
    ``sliding_window`` now and for other windows on first use."""
    block_size = k_cache.shape[1]
    lens = seq_lens.tolist()
    starts = cu_seqlens_q.tolist()
    _check_seq_lens(lens, block_tables.shape[1] * block_size)
    if starts[0] != 0:
        raise ValueError(f"cu_seqlens_q must start at 0 and end at num_tokens, got {starts[0]}..")
    for seq, (start, end, seq_len) in enumerate(zip(starts, starts[1:], lens)):
        num_queries = end - start
        if num_queries < 0 or num_queries > seq_len:
            raise ValueError(
                f"sequence {seq}: {num_queries} queries but seq_len {seq_len} "
                "(need 0 <= queries <= seq_len and non-decreasing cu_seqlens_q)"
            )
    plan = AttentionPlan(starts[-1], len(lens), block_tables, seq_lens, lens, starts,
                         tuple(k_cache.shape), _is_native(k_cache))
    plan.for_window(sliding_window)
    return plan


def _plan_prefill(block_tables, seq, start, end, seq_len, block_size, sliding_window) -> PrefillSeq:
    num_queries = end - start
    first_query = seq_len - num_queries
    first = _first_visible(first_query, sliding_window)
    slots = _context_slots(block_tables[seq:seq + 1], first, seq_len, block_size)
    mask = None
    if sliding_window is not None or num_queries != seq_len:
        device = block_tables.device
        query_positions = torch.arange(first_query, seq_len, device=device).unsqueeze(1)
        key_positions = torch.arange(first, seq_len, device=device).unsqueeze(0)
        mask = key_positions <= query_positions
        if sliding_window is not None:
            mask &= key_positions > query_positions - sliding_window
    return PrefillSeq(start, end, first, slots, mask)


def _plan_window(plan: AttentionPlan, sliding_window: int | None) -> WindowPlan:
    """Decode chunks and prefills of ``plan``'s batch for one sliding window."""
    lens, starts, tables = plan.lens, plan.starts, plan.block_tables
    block_size = plan.cache_shape[1]
    if starts is None:  # decode only
        decode = plan_decode(tables, plan.seq_lens, lens, plan.cache_shape, plan.is_native,
                             sliding_window) if lens else None
        return WindowPlan(None, decode)
    decode_seqs = []
    prefills = []
    for seq, (start, end, seq_len) in enumerate(zip(starts, starts[1:], lens)):
        num_queries = end - start
        if num_queries == 1 and seq_len >= 1:
            decode_seqs.append(seq)
        elif num_queries != 0:
            prefills.append(_plan_prefill(tables, seq, start, end, seq_len, block_size, sliding_window))
    if len(decode_seqs) == len(lens):
        decode = plan_decode(tables, plan.seq_lens, lens, plan.cache_shape, plan.is_native,
                             sliding_window) if lens else None
        return WindowPlan(None, decode)
    decode_rows = decode = None
    if decode_seqs:
        device = tables.device
        seq_ids = layout.index_on(torch.tensor(decode_seqs), device)
        decode_rows = layout.index_on(torch.tensor([starts[seq] for seq in decode_seqs]), device)
        decode = plan_decode(tables.index_select(0, seq_ids), plan.seq_lens.index_select(0, seq_ids),
                             [lens[seq] for seq in decode_seqs], plan.cache_shape, plan.is_native,
                             sliding_window)
    return WindowPlan(decode_rows, decode, prefills)


def _check_plan(plan: AttentionPlan, q, block_tables) -> None:
    if plan.num_tokens != q.shape[0] or plan.num_seqs != block_tables.shape[0]:
        raise ValueError(
            f"cu_seqlens_q must start at 0 and end at num_tokens={q.shape[0]}, and the plan "
            f"match the batch: it covers {plan.num_tokens} tokens of {plan.num_seqs} sequences, "
            f"the batch has {block_tables.shape[0]} sequences"
        )


def run_attention(q, k_cache, v_cache, plan: AttentionPlan, scale, out, sliding_window=None,
                  logit_softcap=None, sinks=None) -> torch.Tensor:
    """Attention over the paged cache as ``plan`` lays it out; writes and returns ``out``.

    ``scale`` None means ``1 / sqrt(head_dim)``; the variants are as ``paged_attention``'s.
    """
    scale = layout.resolve_scale(scale, q.shape[-1])
    if logit_softcap is not None:
        logit_softcap = float(logit_softcap)
    window_plan = plan.for_window(sliding_window)
    if window_plan.decode is not None and window_plan.decode_rows is None:
        _decode_attention(q, k_cache, v_cache, window_plan.decode, scale, out, logit_softcap, sinks)
        return out
    if window_plan.decode is not None:
        rows = window_plan.decode_rows
        result = torch.empty((rows.shape[0], q.shape[1], q.shape[2]), dtype=q.dtype, device=q.device)
        _decode_attention(q.index_select(0, rows), k_cache, v_cache, window_plan.decode, scale, result,
                          logit_softcap, sinks)
        out.index_copy_(0, rows, result)
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    k_flat = k_cache.view(num_blocks * block_size, num_kv_heads * head_dim)
    v_flat = v_cache.view(num_blocks * block_size, num_kv_heads * head_dim)
    for prefill in window_plan.prefills:
        _prefill_attention(q[prefill.start:prefill.end], k_flat, v_flat, prefill, num_kv_heads, scale,
                           out[prefill.start:prefill.end], sliding_window, logit_softcap, sinks)
    return out


def paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, out=None, plan=None,
                           sliding_window=None, logit_softcap=None, sinks=None):
    """Attention of one query per sequence over its cached context (its window's part)."""
    if out is None:
        out = torch.empty_like(q)
    if plan is None:
        plan = plan_decode_attention(k_cache, block_tables, seq_lens, sliding_window)
    _check_plan(plan, q, block_tables)
    return run_attention(q, k_cache, v_cache, plan, scale, out, sliding_window, logit_softcap, sinks)


def paged_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale, out=None,
                    plan=None, sliding_window=None, logit_softcap=None, sinks=None):
    """Causal (windowed) attention for a flattened batch of decode tokens and prefill chunks."""
    if out is None:
        out = torch.empty_like(q)
    if plan is None:
        plan = plan_attention(k_cache, block_tables, cu_seqlens_q, seq_lens, sliding_window)
    _check_plan(plan, q, block_tables)
    return run_attention(q, k_cache, v_cache, plan, scale, out, sliding_window, logit_softcap, sinks)


def copy_blocks(k_caches, v_caches, block_pairs) -> None:
    """Copy block ``src`` to block ``dst`` for every (src, dst) pair, in every layer.

    Within a layer all sources are read before any destination is written.
    """
    if block_pairs.shape[0] == 0:
        return
    pairs_by_device = {}
    for cache in list(k_caches) + list(v_caches):
        pairs = pairs_by_device.get(cache.device)
        if pairs is None:
            pairs = layout.index_on(block_pairs, cache.device, torch.long)
            pairs_by_device[cache.device] = pairs
        src, dst = pairs[:, 0], pairs[:, 1]
        cache.index_copy_(0, dst, cache.index_select(0, src))


def swap_blocks(src_cache, dst_cache, block_pairs) -> None:
    """Copy ``src_cache[src]`` into ``dst_cache[dst]`` for every (src, dst) pair.

    The caches may be on different devices (device pool <-> host pool).
    """
    if block_pairs.shape[0] == 0:
        return
    pairs = block_pairs.long()
    src = layout.index_on(pairs[:, 0], src_cache.device)
    dst = layout.index_on(pairs[:, 1], dst_cache.device)
    blocks = src_cache.index_select(0, src)
    if blocks.device != dst_cache.device:
        # Host -> device can be asynchronous: the copy is ordered before index_copy_ on
        # the device stream. Device -> host must complete before the host reads it.
        blocks = blocks.to(dst_cache.device, non_blocking=dst_cache.device.type != "cpu")
    dst_cache.index_copy_(0, dst, blocks)
