"""Paged KV cache operations in plain torch: the CPU path and the reference for the GPU kernels.

Arguments are assumed to have passed the metadata checks in ``layout``; the checks that
need tensor contents (lengths against block table capacity, cu_seqlens_q bounds) are
done here, where the lengths are read on the host anyway.

Attention gathers each sequence's context from the cache through its block table (one
row ``index_select`` over the cache viewed as ``[num_slots, num_kv_heads * head_dim]``) and
runs ``scaled_dot_product_attention`` in float32 (float64 for float64 inputs). Decode
tokens are batched: sorted by context length and run in chunks of similar length, each
padded to its longest context and masked, and small enough that the gathered context is
still in cache when the attention reads it. Each prefill chunk runs on its own with a
causal mask offset by its cached prefix.
"""

import torch
import torch.nn.functional as F

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


def _context_slots(block_tables, max_len: int, block_size: int) -> torch.Tensor:
    """Slots of positions ``0..max_len-1`` for each row of ``block_tables``: ``[rows, max_len]``."""
    num_blocks = -(-max_len // block_size)
    blocks = block_tables[:, :num_blocks].long()
    offsets = torch.arange(block_size, device=blocks.device)
    slots = blocks.unsqueeze(2) * block_size + offsets
    return slots.view(blocks.shape[0], num_blocks * block_size)[:, :max_len]


def _gather_context(cache_flat, slots, num_kv_heads, compute_dtype):
    """``[rows, max_len]`` slots -> ``[rows, num_kv_heads, max_len, head_dim]`` in compute dtype.

    ``cache_flat`` is the cache viewed as ``[num_slots, num_kv_heads * head_dim]``: row
    gathers are several times faster than gathers over a 3-d view.
    """
    rows, max_len = slots.shape
    gathered = cache_flat.index_select(0, slots.reshape(-1))
    gathered = gathered.view(rows, max_len, num_kv_heads, cache_flat.shape[1] // num_kv_heads)
    return gathered.to(compute_dtype).transpose(1, 2)


def _plan_decode_chunks(sorted_lens: list[int], elements_per_position: int) -> list[tuple[int, int]]:
    """Split sequences sorted by context length (longest first) into ``(start, end)`` chunks
    whose gathered K (or V), padded to the chunk's longest context, holds at most
    ``_MAX_GATHER_ELEMENTS`` elements (one sequence at least)."""
    chunks = []
    start, num_seqs = 0, len(sorted_lens)
    while start < num_seqs:
        per_seq = sorted_lens[start] * elements_per_position
        end = min(num_seqs, start + max(1, _MAX_GATHER_ELEMENTS // per_seq))
        chunks.append((start, end))
        start = end
    return chunks


def _decode_attention(q, k_cache, v_cache, block_tables, seq_lens, lens, scale, out):
    """One query per sequence; writes ``[n, num_heads, head_dim]`` into ``out``.

    Sequences run longest first in chunks of similar context length, so padding is small
    and each chunk's gathered K/V stays in cache between the gather and the attention.
    """
    num_seqs, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    elements_per_position = num_kv_heads * head_dim
    k_flat = k_cache.view(num_blocks * block_size, elements_per_position)
    v_flat = v_cache.view(num_blocks * block_size, elements_per_position)
    compute_dtype = _compute_dtype(q.dtype)
    device = q.device
    order = sorted(range(num_seqs), key=lens.__getitem__, reverse=True)
    sorted_lens = [lens[seq] for seq in order]
    is_sorted = order == list(range(num_seqs))
    if is_sorted:
        tables, lens_tensor, queries = block_tables, seq_lens, q
    else:
        order_tensor = torch.tensor(order, device=device)
        tables = block_tables.index_select(0, order_tensor)
        lens_tensor = seq_lens.index_select(0, order_tensor)
        queries = q.index_select(0, order_tensor)
    # The query heads sharing a kv head become that head's query rows: [n, kv_heads, group, d].
    queries = queries.to(compute_dtype).reshape(
        num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim
    )
    result = out if is_sorted else torch.empty_like(q)
    # Slots of every sequence's context, padded to the longest: padded positions read the
    # sequence's first slot (always written, so finite) instead of whatever the table or a
    # partly filled block holds there, and are masked out.
    max_len = sorted_lens[0]
    num_table_blocks = -(-max_len // block_size)
    offsets = torch.arange(block_size, device=device)
    slots = tables[:, :num_table_blocks].long().unsqueeze(2) * block_size + offsets
    slots = slots.view(num_seqs, num_table_blocks * block_size)[:, :max_len]
    is_valid = torch.arange(max_len, device=device) < lens_tensor.unsqueeze(1)
    slots = torch.where(is_valid, slots, slots[:, :1])
    for start, end in _plan_decode_chunks(sorted_lens, elements_per_position):
        chunk_len = sorted_lens[start]
        chunk_slots = slots[start:end, :chunk_len]
        mask = None
        if sorted_lens[end - 1] != chunk_len:
            mask = is_valid[start:end, None, None, :chunk_len]
        k = _gather_context(k_flat, chunk_slots, num_kv_heads, compute_dtype)
        v = _gather_context(v_flat, chunk_slots, num_kv_heads, compute_dtype)
        chunk_out = F.scaled_dot_product_attention(
            queries[start:end], k, v, attn_mask=mask, scale=scale
        )
        result[start:end] = chunk_out.reshape(end - start, num_heads, head_dim)
    if not is_sorted:
        out.index_copy_(0, order_tensor, result)


def _prefill_attention(
    q, k_flat, v_flat, block_table, seq_len, block_size, num_kv_heads, scale, out
):
    """Causal attention for the last ``q.shape[0]`` of ``seq_len`` tokens of one sequence."""
    num_queries = q.shape[0]
    compute_dtype = _compute_dtype(q.dtype)
    slots = _context_slots(block_table.unsqueeze(0), seq_len, block_size)
    k = _gather_context(k_flat, slots, num_kv_heads, compute_dtype)
    v = _gather_context(v_flat, slots, num_kv_heads, compute_dtype)
    q = q.to(compute_dtype).transpose(0, 1).unsqueeze(0)
    enable_gqa = q.shape[1] != k.shape[1]
    if num_queries == seq_len:
        result = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scale, enable_gqa=enable_gqa
        )
    else:
        query_positions = torch.arange(seq_len - num_queries, seq_len, device=q.device)
        key_positions = torch.arange(seq_len, device=q.device)
        mask = key_positions.unsqueeze(0) <= query_positions.unsqueeze(1)
        result = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa
        )
    out.copy_(result[0].transpose(0, 1))


def _check_seq_lens(lens: list[int], capacity: int) -> None:
    if lens and (min(lens) < 0 or max(lens) > capacity):
        raise ValueError(
            f"seq_lens must lie in [0, {capacity}] (block table width x block_size), "
            f"got min {min(lens)}, max {max(lens)}"
        )


def paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, out=None):
    """Attention of one query per sequence over its whole cached context."""
    if out is None:
        out = torch.empty_like(q)
    lens = seq_lens.tolist()
    if not lens:
        return out
    _check_seq_lens(lens, block_tables.shape[1] * k_cache.shape[1])
    if min(lens) < 1:
        raise ValueError("paged_decode_attention needs seq_lens >= 1 (the query's own token)")
    _decode_attention(q, k_cache, v_cache, block_tables, seq_lens, lens, float(scale), out)
    return out


def paged_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale, out=None):
    """Causal attention for a flattened batch of decode tokens and prefill chunks."""
    if out is None:
        out = torch.empty_like(q)
    num_tokens = q.shape[0]
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    lens = seq_lens.tolist()
    starts = cu_seqlens_q.tolist()
    _check_seq_lens(lens, block_tables.shape[1] * block_size)
    if starts[0] != 0 or starts[-1] != num_tokens:
        raise ValueError(
            f"cu_seqlens_q must start at 0 and end at num_tokens={num_tokens}, "
            f"got {starts[0]}..{starts[-1]}"
        )
    scale = float(scale)
    decode_seqs = []
    prefill_seqs = []
    for seq, (start, end, seq_len) in enumerate(zip(starts, starts[1:], lens)):
        num_queries = end - start
        if num_queries == 1 and seq_len >= 1:
            decode_seqs.append(seq)
        elif num_queries != 0:
            if num_queries < 0 or num_queries > seq_len:
                raise ValueError(
                    f"sequence {seq}: {num_queries} queries but seq_len {seq_len} "
                    "(need 0 <= queries <= seq_len and non-decreasing cu_seqlens_q)"
                )
            prefill_seqs.append(seq)

    if len(decode_seqs) == len(lens):
        if lens:
            _decode_attention(q, k_cache, v_cache, block_tables, seq_lens, lens, scale, out)
        return out
    if decode_seqs:
        seq_ids = torch.tensor(decode_seqs, device=q.device)
        rows = torch.tensor([starts[seq] for seq in decode_seqs], device=q.device)
        result = torch.empty(
            (len(decode_seqs), q.shape[1], head_dim), dtype=q.dtype, device=q.device
        )
        _decode_attention(
            q.index_select(0, rows),
            k_cache,
            v_cache,
            block_tables.index_select(0, seq_ids),
            seq_lens.index_select(0, seq_ids),
            [lens[seq] for seq in decode_seqs],
            scale,
            result,
        )
        out.index_copy_(0, rows, result)
    k_flat = k_cache.view(num_blocks * block_size, num_kv_heads * head_dim)
    v_flat = v_cache.view(num_blocks * block_size, num_kv_heads * head_dim)
    for seq in prefill_seqs:
        start, end = starts[seq], starts[seq + 1]
        _prefill_attention(
            q[start:end],
            k_flat,
            v_flat,
            block_tables[seq],
            lens[seq],
            block_size,
            num_kv_heads,
            scale,
            out[start:end],
        )
    return out


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
            pairs = block_pairs.to(device=cache.device, dtype=torch.long)
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
    src = pairs[:, 0].to(src_cache.device)
    dst = pairs[:, 1].to(dst_cache.device)
    blocks = src_cache.index_select(0, src)
    if blocks.device != dst_cache.device:
        # Host -> device can be asynchronous: the copy is ordered before index_copy_ on
        # the device stream. Device -> host must complete before the host reads it.
        blocks = blocks.to(dst_cache.device, non_blocking=dst_cache.device.type != "cpu")
    dst_cache.index_copy_(0, dst, blocks)
