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

Everything derived from the metadata alone (lengths read to the host, sort order, chunks,
block ids, masks) is an ``AttentionPlan``: ``plan_attention`` builds it once per step and
every layer's ``paged_attention(..., plan=plan)`` reuses it.
"""

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from . import cpu_decode

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


@dataclass
class DecodeChunk:
    """Rows ``start:end`` of the sorted decode batch, gathered ``num_positions`` wide.

    ``block_ids`` holds each row's first ``num_positions // block_size`` blocks (entries
    past a sequence's own blocks repeat its first block); ``padding_rows`` are the
    gathered positions past a sequence's length, zeroed after the gather so that stale
    cache contents never reach the attention, and ``mask`` hides them from it.
    """

    start: int
    end: int
    num_positions: int
    block_ids: torch.Tensor
    padding_rows: torch.Tensor | None
    mask: torch.Tensor | None


@dataclass
class DecodePlan:
    """Decode sequences sorted longest first (``order``: None when already sorted).

    With ``is_native`` the C kernel runs them (``chunks`` is empty): it reads the int32
    ``block_tables`` and ``seq_lens`` directly and takes sequences in ``order``.
    """

    order: torch.Tensor | None
    chunks: list[DecodeChunk]
    is_native: bool = False
    block_tables: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None


@dataclass
class PrefillSeq:
    """One sequence with several queries: q rows ``start:end``, context ``slots``."""

    start: int
    end: int
    slots: torch.Tensor


@dataclass
class AttentionPlan:
    """What ``paged_attention`` derives from the metadata alone, shared by every layer.

    ``decode_rows`` are the q rows of the one-query sequences (None when every sequence
    has one query, in order); ``prefills`` the sequences with more.
    """

    num_tokens: int
    num_seqs: int
    decode_rows: torch.Tensor | None
    decode: DecodePlan | None
    prefills: list[PrefillSeq] = field(default_factory=list)
    backend: str = "torch"


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


def _plan_decode_chunk(tables, lens_tensor, sorted_lens, start, end, block_size) -> DecodeChunk:
    num_blocks = -(-sorted_lens[start] // block_size)
    num_positions = num_blocks * block_size
    device = tables.device
    blocks = tables[start:end, :num_blocks].long()
    chunk_lens = lens_tensor[start:end].long()
    num_own_blocks = (chunk_lens + block_size - 1) // block_size
    is_own_block = torch.arange(num_blocks, device=device) < num_own_blocks.unsqueeze(1)
    blocks = torch.where(is_own_block, blocks, blocks[:, :1])
    is_padding = torch.arange(num_positions, device=device) >= chunk_lens.unsqueeze(1)
    padding_rows = mask = None
    if any(length != num_positions for length in sorted_lens[start:end]):
        padding_rows = is_padding.reshape(-1).nonzero().squeeze(1)
        mask = ~is_padding[:, None, None, :]
    return DecodeChunk(start, end, num_positions, blocks.reshape(-1), padding_rows, mask)


def _check_used_blocks(block_tables, seq_lens, block_size: int, num_blocks: int) -> None:
    """The table entries a sequence's length covers must address blocks of the cache."""
    num_own_blocks = (seq_lens.long() + block_size - 1) // block_size
    is_used = torch.arange(block_tables.shape[1], device=block_tables.device) < num_own_blocks.unsqueeze(1)
    used = block_tables[is_used]
    if used.numel() and (int(used.min()) < 0 or int(used.max()) >= num_blocks):
        raise ValueError(f"block_tables address blocks outside the cache's {num_blocks} blocks")


def _plan_native_decode(block_tables, seq_lens, order: list[int], num_blocks: int,
                        block_size: int) -> DecodePlan:
    tables = block_tables.to(torch.int32).contiguous()
    lens_tensor = seq_lens.to(torch.int32).contiguous()
    _check_used_blocks(tables, lens_tensor, block_size, num_blocks)
    order_tensor = torch.tensor(order, dtype=torch.int64)
    return DecodePlan(order_tensor, [], True, tables, lens_tensor)


def plan_decode(block_tables, seq_lens, lens: list[int], k_cache) -> DecodePlan:
    """Sort one-query sequences longest first; for the torch path, cut them into chunks
    of similar length."""
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    num_seqs = len(lens)
    order = sorted(range(num_seqs), key=lens.__getitem__, reverse=True)
    if cpu_decode.supports_cache(k_cache):
        return _plan_native_decode(block_tables, seq_lens, order, num_blocks, block_size)
    elements_per_position = num_kv_heads * head_dim
    sorted_lens = [lens[seq] for seq in order]
    if order == list(range(num_seqs)):
        order_tensor, tables, lens_tensor = None, block_tables, seq_lens
    else:
        order_tensor = torch.tensor(order, device=block_tables.device)
        tables = block_tables.index_select(0, order_tensor)
        lens_tensor = seq_lens.index_select(0, order_tensor)
    chunks = [
        _plan_decode_chunk(tables, lens_tensor, sorted_lens, start, end, block_size)
        for start, end in _plan_decode_chunks(sorted_lens, elements_per_position)
    ]
    return DecodePlan(order_tensor, chunks)


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


def _decode_attention(q, k_cache, v_cache, plan: DecodePlan, scale, out):
    """One query per sequence; writes ``[n, num_heads, head_dim]`` into ``out``.

    Sequences run longest first in chunks of similar context length, so padding is small
    and each chunk's gathered K/V stays in cache between the gather and the attention.
    Each chunk gathers whole blocks, which copies far fewer, larger pieces than a gather
    of single positions.
    """
    if plan.is_native:
        if q.stride(-1) != 1:
            q = q.contiguous()
        cpu_decode.decode_attention(q, k_cache, v_cache, plan.block_tables, plan.seq_lens, scale,
                                    out, plan.order)
        return
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    compute_dtype = _compute_dtype(q.dtype)
    queries = q if plan.order is None else q.index_select(0, plan.order)
    # The query heads sharing a kv head become that head's query rows: [n, kv_heads, group, d].
    queries = queries.to(compute_dtype).reshape(
        num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim
    )
    result = out if plan.order is None else torch.empty_like(q)
    for chunk in plan.chunks:
        k = _gather_blocks(k_cache, chunk, compute_dtype)
        v = _gather_blocks(v_cache, chunk, compute_dtype)
        chunk_out = F.scaled_dot_product_attention(
            queries[chunk.start:chunk.end], k, v, attn_mask=chunk.mask, scale=scale
        )
        result[chunk.start:chunk.end] = chunk_out.reshape(chunk.end - chunk.start, num_heads, head_dim)
    if plan.order is not None:
        out.index_copy_(0, plan.order, result)


def _prefill_attention(q, k_flat, v_flat, slots, num_kv_heads, scale, out):
    """Causal attention for the last ``q.shape[0]`` of a sequence's context ``slots``."""
    num_queries, seq_len = q.shape[0], slots.shape[1]
    compute_dtype = _compute_dtype(q.dtype)
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


def plan_decode_attention(k_cache, block_tables, seq_lens) -> AttentionPlan:
    """The plan of ``paged_decode_attention`` (one query per sequence)."""
    block_size = k_cache.shape[1]
    lens = seq_lens.tolist()
    _check_seq_lens(lens, block_tables.shape[1] * block_size)
    if lens and min(lens) < 1:
        raise ValueError("paged_decode_attention needs seq_lens >= 1 (the query's own token)")
    decode = plan_decode(block_tables, seq_lens, lens, k_cache) if lens else None
    return AttentionPlan(len(lens), len(lens), None, decode)


def plan_attention(k_cache, block_tables, cu_seqlens_q, seq_lens) -> AttentionPlan:
    """The plan of ``paged_attention``: reads the lengths once, checks them, and sorts the
    sequences into decode chunks and prefills."""
    block_size = k_cache.shape[1]
    lens = seq_lens.tolist()
    starts = cu_seqlens_q.tolist()
    num_tokens = starts[-1]
    _check_seq_lens(lens, block_tables.shape[1] * block_size)
    if starts[0] != 0:
        raise ValueError(f"cu_seqlens_q must start at 0 and end at num_tokens, got {starts[0]}..")
    decode_seqs = []
    prefills = []
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
            slots = _context_slots(block_tables[seq:seq + 1], seq_len, block_size)
            prefills.append(PrefillSeq(start, end, slots))
    if len(decode_seqs) == len(lens):
        decode = plan_decode(block_tables, seq_lens, lens, k_cache) if lens else None
        return AttentionPlan(num_tokens, len(lens), None, decode)
    decode_rows = decode = None
    if decode_seqs:
        device = block_tables.device
        seq_ids = torch.tensor(decode_seqs, device=device)
        decode_rows = torch.tensor([starts[seq] for seq in decode_seqs], device=device)
        decode = plan_decode(block_tables.index_select(0, seq_ids), seq_lens.index_select(0, seq_ids),
                             [lens[seq] for seq in decode_seqs], k_cache)
    return AttentionPlan(num_tokens, len(lens), decode_rows, decode, prefills)


def _check_plan(plan: AttentionPlan, q, block_tables) -> None:
    if plan.num_tokens != q.shape[0] or plan.num_seqs != block_tables.shape[0]:
        raise ValueError(
            f"cu_seqlens_q must start at 0 and end at num_tokens={q.shape[0]}, and the plan "
            f"match the batch: it covers {plan.num_tokens} tokens of {plan.num_seqs} sequences, "
            f"the batch has {block_tables.shape[0]} sequences"
        )


def run_attention(q, k_cache, v_cache, plan: AttentionPlan, scale, out) -> torch.Tensor:
    """Attention over the paged cache as ``plan`` lays it out; writes and returns ``out``."""
    scale = float(scale)
    if plan.decode is not None and plan.decode_rows is None:
        _decode_attention(q, k_cache, v_cache, plan.decode, scale, out)
        return out
    if plan.decode is not None:
        rows = plan.decode_rows
        result = torch.empty((rows.shape[0], q.shape[1], q.shape[2]), dtype=q.dtype, device=q.device)
        _decode_attention(q.index_select(0, rows), k_cache, v_cache, plan.decode, scale, result)
        out.index_copy_(0, rows, result)
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    k_flat = k_cache.view(num_blocks * block_size, num_kv_heads * head_dim)
    v_flat = v_cache.view(num_blocks * block_size, num_kv_heads * head_dim)
    for prefill in plan.prefills:
        _prefill_attention(q[prefill.start:prefill.end], k_flat, v_flat, prefill.slots,
                           num_kv_heads, scale, out[prefill.start:prefill.end])
    return out


def paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, out=None, plan=None):
    """Attention of one query per sequence over its whole cached context."""
    if out is None:
        out = torch.empty_like(q)
    if plan is None:
        plan = plan_decode_attention(k_cache, block_tables, seq_lens)
    _check_plan(plan, q, block_tables)
    return run_attention(q, k_cache, v_cache, plan, scale, out)


def paged_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale, out=None,
                    plan=None):
    """Causal attention for a flattened batch of decode tokens and prefill chunks."""
    if out is None:
        out = torch.empty_like(q)
    if plan is None:
        plan = plan_attention(k_cache, block_tables, cu_seqlens_q, seq_lens)
    _check_plan(plan, q, block_tables)
    return run_attention(q, k_cache, v_cache, plan, scale, out)


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
