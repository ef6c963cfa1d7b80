"""Paged KV cache operations in plain torch: the CPU path and the reference for the GPU kernels.

Arguments are assumed to have passed the metadata checks in ``layout``; the checks that
need tensor contents (lengths against block table capacity, cu_seqlens_q bounds) are
done here, where the lengths are read on the host anyway.

Attention gathers each sequence's context from the cache through its block table (one
row ``index_select`` over the cache viewed as ``[num_slots, num_kv_heads * head_dim]``) and
runs ``scaled_dot_product_attention`` in float32 (float64 for float64 inputs). Decode
tokens are batched: grouped into a few buckets of similar context length, padded to the
bucket's longest context and masked, and run in chunks of bounded size. Each prefill chunk
runs on its own with a causal mask offset by its cached prefix.
"""

import torch
import torch.nn.functional as F

# Decode sequences are bucketed by context length, each bucket spanning at most a factor
# of two, so padding stays under half of a bucket's work. A bucket costs a fixed overhead of
# about this many gathered kv elements (positions x kv heads x head_dim); a bucket whose
# padding to the next longer bucket would cost less than that is merged into it.
_BUCKET_OVERHEAD_ELEMENTS = 131072
# Buckets run in chunks of sequences whose gathered K (or V) holds at most this many
# elements: small temporaries stay in cache and avoid fresh page-faulted allocations,
# which made one big gather about three times slower per element on the test machine.
_MAX_GATHER_ELEMENTS = 1 << 20


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


def _decode_bucket(
    q, k_flat, v_flat, block_tables, seq_lens, max_len, is_padded, block_size, num_kv_heads, scale
):
    """Attention for one query per sequence, with contexts padded to ``max_len``.

    ``q`` is ``[n, num_heads, head_dim]`` in the compute dtype. Returns the same shape.
    """
    num_seqs, num_heads, head_dim = q.shape
    slots = _context_slots(block_tables, max_len, block_size)
    mask = None
    if is_padded:
        # Padded positions read the sequence's first slot (always written, so finite)
        # instead of whatever the table or a partly filled block holds there.
        positions = torch.arange(max_len, device=slots.device)
        is_valid = positions < seq_lens.unsqueeze(1)
        slots = torch.where(is_valid, slots, slots[:, :1])
        mask = is_valid[:, None, None, :]
    k = _gather_context(k_flat, slots, num_kv_heads, q.dtype)
    v = _gather_context(v_flat, slots, num_kv_heads, q.dtype)
    # The query heads sharing a kv head become that head's query rows: [n, kv_heads, group, d].
    q = q.reshape(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out.reshape(num_seqs, num_heads, head_dim)


def _plan_buckets(lens: list[int], elements_per_position: int) -> list[tuple[list[int], int, bool]]:
    """Group sequence indices into ``(indices, max_len, is_padded)`` buckets of similar
    context length, longest first. A single bucket lists all sequences in order."""
    num_seqs = len(lens)
    max_len = max(lens)
    total = sum(lens)
    if (num_seqs * max_len - total) * elements_per_position <= _BUCKET_OVERHEAD_ELEMENTS:
        return [(list(range(num_seqs)), max_len, num_seqs * max_len != total)]
    # Bucket k holds lengths in (max_len / 2**(k+1), max_len / 2**k].
    groups = {}
    for seq, length in enumerate(lens):
        groups.setdefault((max_len // length).bit_length() - 1, []).append(seq)
    buckets = []  # [indices, bucket max_len, sum of lengths], longest first
    for key in sorted(groups):
        indices = groups[key]
        lengths = [lens[seq] for seq in indices]
        buckets.append([indices, max(lengths), sum(lengths)])
    merged = [buckets[0]]
    for indices, bucket_max, bucket_total in buckets[1:]:
        longer = merged[-1]
        extra = len(indices) * (longer[1] - bucket_max) * elements_per_position
        if extra <= _BUCKET_OVERHEAD_ELEMENTS:
            longer[0] = longer[0] + indices
            longer[2] += bucket_total
        else:
            merged.append([indices, bucket_max, bucket_total])
    return [
        (indices, bucket_max, bucket_total != bucket_max * len(indices))
        for indices, bucket_max, bucket_total in merged
    ]


def _decode_attention(q, k_cache, v_cache, block_tables, seq_lens, lens, scale, out):
    """One query per sequence; writes ``[n, num_heads, head_dim]`` into ``out``."""
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    elements_per_position = num_kv_heads * head_dim
    k_flat = k_cache.view(num_blocks * block_size, elements_per_position)
    v_flat = v_cache.view(num_blocks * block_size, elements_per_position)
    q = q.to(_compute_dtype(q.dtype))
    buckets = _plan_buckets(lens, elements_per_position)
    is_single_bucket = len(buckets) == 1
    for indices, max_len, is_padded in buckets:
        max_rows = max(1, _MAX_GATHER_ELEMENTS // (max_len * elements_per_position))
        for first in range(0, len(indices), max_rows):
            if is_single_bucket:  # rows in their original order: slice instead of gather
                rows = slice(first, first + max_rows)
                out[rows] = _decode_bucket(
                    q[rows], k_flat, v_flat, block_tables[rows], seq_lens[rows],
                    max_len, is_padded, block_size, num_kv_heads, scale,
                )  # fmt: skip
                continue
            rows = torch.tensor(indices[first : first + max_rows], device=q.device)
            result = _decode_bucket(
                q.index_select(0, rows), k_flat, v_flat, block_tables.index_select(0, rows),
                seq_lens.index_select(0, rows), max_len, is_padded, block_size, num_kv_heads,
                scale,
            )  # fmt: skip
            out.index_copy_(0, rows, result.to(out.dtype))


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
