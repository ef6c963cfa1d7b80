"""Triton paged-KV kernels against a float64 reference and the torch backend.

Without CUDA the kernels run in Triton's interpreter. Triton picks interpreter or compiler
when it is first imported, so TRITON_INTERPRET=1 is set here before importing it; if another
module imported triton earlier in this process (transformers does), the tests are re-run in a
fresh interpreter process instead. The interpreter is slow, so shapes stay small, and bf16
runs only on CUDA because the interpreter's bf16 arithmetic is wrong.
"""

import math
import os
import subprocess
import sys
import zlib

import pytest
import torch

IS_CUDA = torch.cuda.is_available()
if not IS_CUDA and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

import triton  # noqa: E402

import pagedserve.kernels as kernels  # noqa: E402
from pagedserve.kernels import triton_attention_kernels as attention_kernels  # noqa: E402
from pagedserve.kernels import triton_ops  # noqa: E402
from triton_interpreter import interpreter_guard  # noqa: E402



def _can_run_kernels_here() -> bool:
    try:
        return IS_CUDA or triton_ops._interpreting()
    except RuntimeError:  # TRITON_INTERPRET set between importing triton and triton_ops
        return False


IS_RUNNABLE_HERE = _can_run_kernels_here()
DEVICE = torch.device("cuda" if IS_CUDA else "cpu")
CUDA_ONLY_BF16 = pytest.mark.skipif(not IS_CUDA, reason="Triton interpreter computes bf16 wrongly")
TOLERANCES = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


kernels_runnable, test_in_fresh_interpreter_process = interpreter_guard(__file__, IS_RUNNABLE_HERE)


def make_generator(*case) -> torch.Generator:
    """A fresh generator per test case, seeded from its parameters (reproducible, distinct)."""
    return torch.Generator().manual_seed(zlib.crc32(repr(case).encode()))


def randn(generator, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=generator).to(dtype=dtype, device=DEVICE)


def torch_backend(name):
    """The torch backend's op through the dispatcher when it is there, else straight from torch_ops."""
    dispatched = getattr(kernels, name, None)
    if dispatched is not None:
        return lambda *args, **kwargs: dispatched(*args, backend="torch", **kwargs)
    torch_ops = pytest.importorskip("pagedserve.kernels.torch_ops")
    return getattr(torch_ops, name)


class PagedBatch:
    """Random caches and block tables for sequences of the given lengths (blocks scattered)."""

    def __init__(self, generator, seq_lens, block_size, num_kv_heads, head_dim, dtype, num_spare_blocks=3,
                 index_dtype=torch.int32):
        blocks_per_seq = [math.ceil(n / block_size) for n in seq_lens]
        num_blocks = sum(blocks_per_seq) + num_spare_blocks
        max_blocks = max(max(blocks_per_seq), 1) + 1  # one unused column, like a real table
        self.k_cache = randn(generator, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
        self.v_cache = randn(generator, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
        order = torch.randperm(num_blocks, generator=generator)
        # Unused entries point at a spare block full of huge values: reading one would show.
        spare = int(order[-1])
        self.k_cache[spare] = 1e4
        self.v_cache[spare] = 1e4
        table = torch.full((len(seq_lens), max_blocks), spare, dtype=torch.int32)
        taken = 0
        for i, n in enumerate(blocks_per_seq):
            table[i, :n] = order[taken:taken + n].to(torch.int32)
            taken += n
        self.block_tables = table.to(device=DEVICE, dtype=index_dtype)
        self.seq_lens = torch.tensor(seq_lens, dtype=index_dtype, device=DEVICE)
        self.block_size = block_size


def reference_attention(q, batch, cu_seqlens_q, scale, sliding_window=None, logit_softcap=None, sinks=None):
    """Float64 plain-softmax attention; row j of sequence i sits at position p = seq_len - q_len + j
    and sees keys k with p - sliding_window < k <= p (k <= p without a window). Scores are
    soft-capped before the mask; a sink joins each head's denominator. Only table entries of
    blocks some row sees are read (others may be -1)."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    num_heads, num_kv_heads = q.shape[1], batch.k_cache.shape[2]
    group = num_heads // num_kv_heads
    k_cache, v_cache = batch.k_cache.cpu().double(), batch.v_cache.cpu().double()
    tables = batch.block_tables.cpu().long()
    for i, seq_len in enumerate(batch.seq_lens.tolist()):
        first, last = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
        query_pos = torch.arange(seq_len - (last - first), seq_len)
        lowest = 0 if sliding_window is None else max(0, int(query_pos[0]) - sliding_window + 1)
        positions = torch.arange(lowest, seq_len)
        blocks = tables[i, positions // batch.block_size]
        offsets = positions % batch.block_size
        k = k_cache[blocks, offsets].repeat_interleave(group, dim=1)
        v = v_cache[blocks, offsets].repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[first:last].cpu().double(), k) * scale
        if logit_softcap is not None:
            scores = logit_softcap * torch.tanh(scores / logit_softcap)
        hidden = positions[None, None, :] > query_pos[None, :, None]
        if sliding_window is not None:
            hidden |= positions[None, None, :] <= query_pos[None, :, None] - sliding_window
        scores = scores.masked_fill(hidden, float("-inf"))
        if sinks is not None:
            sink_column = sinks.cpu().double().view(num_heads, 1, 1).expand(-1, scores.shape[1], 1)
            scores = torch.cat([scores, sink_column], dim=-1)
        probs = scores.softmax(-1)[..., :len(positions)]
        out[first:last] = torch.einsum("hqk,khd->qhd", probs, v)
    return out


def free_blocks_out_of_window(batch, q_lens, sliding_window):
    """Set to -1 the table entries of blocks wholly before every query's window, as an
    allocator freeing them early would; a kernel dereferencing one reads out of bounds."""
    for i, (seq_len, q_len) in enumerate(zip(batch.seq_lens.tolist(), q_lens)):
        lowest = max(0, seq_len - q_len - sliding_window + 1)
        batch.block_tables[i, :lowest // batch.block_size] = -1
    return batch


def assert_close(actual, expected, dtype, what):
    tolerance = TOLERANCES[dtype]
    torch.testing.assert_close(actual.cpu().double(), expected.cpu().double(), atol=tolerance,
                               rtol=tolerance, msg=lambda m: f"{what}: {m}")


# (head_dim, block_size, query heads per KV head, dtype): every head dim, block size and GQA
# ratio appears, without the full product (the interpreter is slow).
ATTENTION_CASES = [
    (64, 16, 1, torch.float32),
    (80, 8, 2, torch.float16),
    (96, 32, 4, torch.float32),
    (128, 64, 8, torch.float16),
    (256, 16, 2, torch.float32),
    (128, 8, 1, torch.float32),
    (64, 64, 4, torch.float16),
    (80, 32, 8, torch.float32),
    (256, 8, 8, torch.float16),
    pytest.param(128, 16, 4, torch.bfloat16, marks=CUDA_ONLY_BF16),
]


def mixed_batch_lengths(generator):
    """(seq_len, q_len) pairs: decodes, a one-token sequence, fresh and chunked prefills."""
    def rand(lo, hi):
        return int(torch.randint(lo, hi + 1, (1,), generator=generator))

    long_len = rand(120, 170)
    pairs = [
        (rand(2, 60), 1),             # decode
        (1, 1),                       # single token sequence
        (rand(20, 50), None),         # fresh prefill, q_len == seq_len
        (long_len, rand(30, 70)),     # chunked prefill on top of a cached prefix
        (rand(70, 110), 1),           # decode, longer context
        (rand(3, 9), rand(2, 3)),     # short chunk
    ]
    pairs = [(n, n if q is None else q) for n, q in pairs]
    order = torch.randperm(len(pairs), generator=generator).tolist()
    return [pairs[i] for i in order]


@pytest.mark.parametrize("head_dim,block_size,group,dtype", ATTENTION_CASES)
def test_paged_attention_mixed_batch(head_dim, block_size, group, dtype):
    check_mixed_batch(head_dim, block_size, group, dtype, torch.int32)


def test_paged_attention_int64_metadata():
    check_mixed_batch(64, 16, 2, torch.float32, torch.int64)


# Launches other than the defaults, as the GPU benchmarks compare them (bench_kernels_gpu.py
# --tiles): tile shapes change which positions each program reads, never the answer.
@pytest.mark.parametrize("tiles", [attention_kernels.Tiles(block_n=32, block_m=128, num_warps=8, num_stages=2),
                                   attention_kernels.Tiles(block_n=128, block_m=64, num_warps=4, num_stages=4)])
def test_paged_attention_with_other_tiles(tiles):
    check_mixed_batch(128, 16, 4, torch.float16, torch.int32, tiles)


@pytest.mark.parametrize("tiles", [attention_kernels.Tiles(block_n=32, num_warps=8),
                                   attention_kernels.Tiles(block_n=128, num_warps=4, num_stages=4)])
def test_paged_decode_attention_with_other_tiles(tiles):
    generator = make_generator("decode-tiles", tiles.block_n)
    batch = PagedBatch(generator, [1, 37, 300, 128], 16, 2, 128, torch.float16)
    q = randn(generator, 4, 8, 128, dtype=torch.float16)
    for num_splits in (1, 3):
        out = triton_ops.paged_decode_attention(q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens,
                                                0.1, num_splits=num_splits, tiles=tiles)
        assert_close(out, reference_attention(q, batch, torch.arange(5), 0.1), torch.float16,
                     f"{num_splits} splits vs float64 reference")


def check_mixed_batch(head_dim, block_size, group, dtype, index_dtype, tiles=None):
    generator = make_generator("prefill", head_dim, block_size, group, dtype, index_dtype)
    num_kv_heads = 2 if group <= 4 else 1
    num_heads = num_kv_heads * group
    pairs = mixed_batch_lengths(generator)
    batch = PagedBatch(generator, [n for n, _ in pairs], block_size, num_kv_heads, head_dim, dtype,
                       index_dtype=index_dtype)
    q_lens = [q for _, q in pairs]
    cu_seqlens_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=index_dtype, device=DEVICE)
    num_tokens = sum(q_lens)
    num_padding = 3  # trailing rows that belong to no sequence must be left alone
    # q is a view into a fused qkv-like buffer, so its strides are not the contiguous ones.
    fused = randn(generator, num_tokens + num_padding, num_heads + 2 * num_kv_heads, head_dim, dtype=dtype)
    q = fused[:, :num_heads]
    out = torch.full(q.shape, float("nan"), dtype=dtype, device=DEVICE)
    scale = head_dim ** -0.5

    result = triton_ops.paged_attention(q, batch.k_cache, batch.v_cache, batch.block_tables, cu_seqlens_q,
                                        batch.seq_lens, scale, out=out, tiles=tiles)

    assert result is out
    assert not out[:num_tokens].isnan().any(), "rows of real tokens were not all written"
    assert out[num_tokens:].isnan().all(), "padding rows were overwritten"
    expected = reference_attention(q[:num_tokens], batch, cu_seqlens_q.cpu(), scale)
    assert_close(out[:num_tokens], expected, dtype, "vs float64 reference")
    by_torch = torch_backend("paged_attention")(q[:num_tokens].contiguous(), batch.k_cache, batch.v_cache,
                                                batch.block_tables, cu_seqlens_q, batch.seq_lens, scale)
    assert_close(out[:num_tokens], by_torch, dtype, "vs torch backend")


@pytest.mark.parametrize("num_splits", [None, 4])
@pytest.mark.parametrize("head_dim,block_size,group,dtype", ATTENTION_CASES)
def test_paged_decode_attention(head_dim, block_size, group, dtype, num_splits):
    generator = make_generator("decode", head_dim, block_size, group, dtype, num_splits)
    num_kv_heads = 2 if group <= 4 else 1
    num_heads = num_kv_heads * group
    # Very different lengths: one token, short, and long enough to span several splits.
    seq_lens = [1, int(torch.randint(2, 40, (1,), generator=generator)),
                int(torch.randint(200, 330, (1,), generator=generator)), block_size * 3]
    batch = PagedBatch(generator, seq_lens, block_size, num_kv_heads, head_dim, dtype)
    q = randn(generator, len(seq_lens), num_heads, head_dim, dtype=dtype)
    out = torch.full_like(q, float("nan"))
    scale = head_dim ** -0.5

    triton_ops.paged_decode_attention(q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens,
                                      scale, out=out, num_splits=num_splits)

    assert not out.isnan().any()
    cu_seqlens_q = torch.arange(len(seq_lens) + 1)
    assert_close(out, reference_attention(q, batch, cu_seqlens_q, scale), dtype, "vs float64 reference")
    by_torch = torch_backend("paged_decode_attention")(q, batch.k_cache, batch.v_cache, batch.block_tables,
                                                       batch.seq_lens, scale)
    assert_close(out, by_torch, dtype, "vs torch backend")


def test_decode_merges_more_splits_than_the_reduce_kernel_reads_at_once():
    """21 splits of 64 tokens: the reduce kernel merges them in chunks of 16."""
    generator = make_generator("many-splits")
    batch = PagedBatch(generator, [1300, 70, 0], 16, 2, 64, torch.float16)
    q = randn(generator, 3, 4, 64, dtype=torch.float16)
    out = triton_ops.paged_decode_attention(q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens,
                                            0.125, num_splits=64)
    assert triton.cdiv(batch.block_tables.shape[1] * 16, 64) == 21 > attention_kernels.REDUCE_BLOCK_SPLITS
    assert_close(out, reference_attention(q, batch, torch.arange(4), 0.125), torch.float16, "vs float64 reference")
    assert torch.equal(out[2], torch.zeros_like(out[2]))


def test_decode_splits_each_context_however_wide_the_table():
    """A CUDA graph's block table is as wide as the model's context, and fixes the split
    count for it. Each sequence's own context is cut into those splits, in whole K/V tiles
    of 64: a 256-token context in a 4,096-wide table works in all 4 splits (before, split 0
    alone did: the splits were 1,024 tokens each), a 130-token one in 3, a 1-token one in 1."""
    generator = make_generator("wide-table")
    batch = PagedBatch(generator, [256, 1, 130], 16, 2, 64, torch.float16)
    width = 4096 // 16
    tables = torch.full((3, width), -1, dtype=batch.block_tables.dtype, device=DEVICE)
    tables[:, :batch.block_tables.shape[1]] = batch.block_tables
    q = randn(generator, 3, 4, 64, dtype=torch.float16)
    merged = []
    hook = lambda out, part_acc, part_max, part_sum, num_splits, *rest, **kwargs: merged.append(part_sum.clone())
    attention_kernels.paged_decode_reduce_kernel.add_pre_run_hook(hook)
    try:
        out = triton_ops.paged_decode_attention(q, batch.k_cache, batch.v_cache, tables, batch.seq_lens, 0.125,
                                                num_splits=4)
    finally:
        attention_kernels.paged_decode_reduce_kernel.pre_run_hooks.remove(hook)
    working = (merged[0] > 0).all(dim=1).tolist()   # [seq, split]: every head's softmax sum > 0
    assert working == [[True] * 4, [True, False, False, False], [True, True, True, False]]
    assert_close(out, reference_attention(q, batch, torch.arange(4), 0.125), torch.float16, "vs float64 reference")


def test_decode_matches_prefill_kernel_and_handles_empty_context():
    generator = make_generator("decode-vs-prefill")
    batch = PagedBatch(generator, [5, 0, 77], 16, 2, 64, torch.float32)
    q = randn(generator, 3, 4, 64)
    decode = triton_ops.paged_decode_attention(q, batch.k_cache, batch.v_cache, batch.block_tables,
                                               batch.seq_lens, 0.125, num_splits=2)
    assert decode.dtype == q.dtype and decode.shape == q.shape
    assert torch.equal(decode[1], torch.zeros_like(decode[1])), "an empty context must give zeros"
    keep = torch.tensor([0, 2], device=DEVICE)
    cu_seqlens_q = torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE)
    prefill = triton_ops.paged_attention(q[keep], batch.k_cache, batch.v_cache, batch.block_tables[keep],
                                         cu_seqlens_q, batch.seq_lens[keep], 0.125)
    assert_close(decode[keep], prefill, torch.float32, "decode vs prefill kernel")


# (head_dim, block_size, group, dtype, window, soft-cap, sinks, scale): windows shorter and
# longer than a block and a KV tile, with and without soft-cap and sinks, custom scales.
VARIANT_CASES = [
    (64, 16, 2, torch.float32, 20, 2.0, True, 0.3),
    (80, 8, 4, torch.float16, 37, None, True, None),
    (64, 8, 1, torch.float32, 9, 1.5, False, 0.2),
    (128, 16, 8, torch.float16, None, 3.0, True, 0.1),
    (96, 32, 2, torch.float32, 40, None, None, None),
]


def _variant_kwargs(generator, num_heads, window, softcap, has_sinks, dtype):
    sinks = 2 * randn(generator, num_heads, dtype=dtype) if has_sinks else None
    return dict(sliding_window=window, logit_softcap=softcap, sinks=sinks)


def _check_variant_matters(q, batch, cu_seqlens_q, scale, expected, kwargs):
    """The case must be one a plain kernel would get wrong (else the test could not fail)."""
    plain = reference_attention(q, batch, cu_seqlens_q, scale) if kwargs["sliding_window"] is None else None
    if plain is not None:
        assert (plain - expected).abs().max() > 0.05, "variants do not change this case's output"


@pytest.mark.parametrize("head_dim,block_size,group,dtype,window,softcap,has_sinks,scale", VARIANT_CASES)
def test_paged_attention_variants(head_dim, block_size, group, dtype, window, softcap, has_sinks, scale):
    generator = make_generator("prefill-variants", head_dim, block_size, group, dtype, window, softcap, has_sinks)
    num_kv_heads = 2 if group <= 4 else 1
    num_heads = num_kv_heads * group
    pairs = mixed_batch_lengths(generator)
    batch = PagedBatch(generator, [n for n, _ in pairs], block_size, num_kv_heads, head_dim, dtype)
    q_lens = [q for _, q in pairs]
    if window is not None:
        free_blocks_out_of_window(batch, q_lens, window)
        assert (batch.block_tables == -1).any(), "no block is out of the window: the case tests nothing"
    cu_seqlens_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    q = randn(generator, sum(q_lens), num_heads, head_dim, dtype=dtype)
    kwargs = _variant_kwargs(generator, num_heads, window, softcap, has_sinks, dtype)
    resolved = head_dim ** -0.5 if scale is None else scale

    out = triton_ops.paged_attention(q, batch.k_cache, batch.v_cache, batch.block_tables, cu_seqlens_q,
                                     batch.seq_lens, scale, **kwargs)

    expected = reference_attention(q, batch, cu_seqlens_q.cpu(), resolved, **kwargs)
    assert_close(out, expected, dtype, "vs float64 reference")
    _check_variant_matters(q, batch, cu_seqlens_q.cpu(), resolved, expected, kwargs)
    by_torch = torch_backend("paged_attention")(q, batch.k_cache, batch.v_cache, batch.block_tables,
                                                cu_seqlens_q, batch.seq_lens, scale, **kwargs)
    assert_close(out, by_torch, dtype, "vs torch backend")


@pytest.mark.parametrize("num_splits", [None, 3])
@pytest.mark.parametrize("head_dim,block_size,group,dtype,window,softcap,has_sinks,scale", VARIANT_CASES)
def test_paged_decode_attention_variants(head_dim, block_size, group, dtype, window, softcap, has_sinks, scale,
                                         num_splits):
    generator = make_generator("decode-variants", head_dim, block_size, group, dtype, window, softcap, has_sinks,
                               num_splits)
    num_kv_heads = 2 if group <= 4 else 1
    num_heads = num_kv_heads * group
    # Shorter than the window, one token, and long enough for several splits over the window.
    seq_lens = [1, int(torch.randint(2, 12, (1,), generator=generator)),
                int(torch.randint(200, 330, (1,), generator=generator)), block_size * 5 + 3]
    batch = PagedBatch(generator, seq_lens, block_size, num_kv_heads, head_dim, dtype)
    if window is not None:
        free_blocks_out_of_window(batch, [1] * len(seq_lens), window)
    q = randn(generator, len(seq_lens), num_heads, head_dim, dtype=dtype)
    kwargs = _variant_kwargs(generator, num_heads, window, softcap, has_sinks, dtype)
    resolved = head_dim ** -0.5 if scale is None else scale
    out = torch.full_like(q, float("nan"))

    triton_ops.paged_decode_attention(q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens,
                                      scale, out=out, num_splits=num_splits, **kwargs)

    cu_seqlens_q = torch.arange(len(seq_lens) + 1)
    expected = reference_attention(q, batch, cu_seqlens_q, resolved, **kwargs)
    assert_close(out, expected, dtype, "vs float64 reference")
    _check_variant_matters(q, batch, cu_seqlens_q, resolved, expected, kwargs)
    by_torch = torch_backend("paged_decode_attention")(q, batch.k_cache, batch.v_cache, batch.block_tables,
                                                       batch.seq_lens, scale, **kwargs)
    assert_close(out, by_torch, dtype, "vs torch backend")


def test_window_reads_no_table_entry_before_it():
    """Out-of-window entries pointing past the cache (not just -1) are never dereferenced:
    the result equals the one with the blocks in place."""
    generator = make_generator("window-entries")
    batch = PagedBatch(generator, [150, 97], 8, 2, 64, torch.float32)
    q_lens = [40, 1]
    cu_seqlens_q = torch.tensor([0, 40, 41], dtype=torch.int32, device=DEVICE)
    q = randn(generator, 41, 4, 64)
    kept = triton_ops.paged_attention(q, batch.k_cache, batch.v_cache, batch.block_tables, cu_seqlens_q,
                                      batch.seq_lens, None, sliding_window=16)
    free_blocks_out_of_window(batch, q_lens, 16)
    batch.block_tables[batch.block_tables == -1] = 2**30  # far past the cache: a read would fault
    freed = triton_ops.paged_attention(q, batch.k_cache, batch.v_cache, batch.block_tables, cu_seqlens_q,
                                       batch.seq_lens, None, sliding_window=16)
    assert torch.equal(kept, freed)
    decode = triton_ops.paged_decode_attention(q[[39, 40]], batch.k_cache, batch.v_cache, batch.block_tables,
                                               batch.seq_lens, None, sliding_window=16, num_splits=2)
    assert_close(decode, kept[[39, 40]], torch.float32, "decode vs prefill kernel")


@pytest.mark.parametrize("head_dim,block_size,num_kv_heads,dtype", [
    (64, 8, 2, torch.float32),
    (80, 16, 1, torch.float16),
    (96, 32, 4, torch.float32),
    (128, 64, 2, torch.float16),
    (256, 16, 3, torch.float32),
    pytest.param(128, 16, 2, torch.bfloat16, marks=CUDA_ONLY_BF16),
])
def test_write_kv_skips_padding_slots(head_dim, block_size, num_kv_heads, dtype):
    generator = make_generator("write_kv", head_dim, block_size, num_kv_heads, dtype)
    num_blocks, num_tokens = 6, 13
    k_cache = randn(generator, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    v_cache = randn(generator, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:num_tokens]
    slots[torch.randperm(num_tokens, generator=generator)[:4]] = -1
    # key/value are views of one fused buffer (non-contiguous), and fp32 while fp16 caches cast.
    fused = randn(generator, num_tokens, 2, num_kv_heads, head_dim)
    key, value = fused[:, 0], fused[:, 1]
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected_k[slot // block_size, slot % block_size] = key[t].to(dtype)
            expected_v[slot // block_size, slot % block_size] = value[t].to(dtype)
    by_torch_k, by_torch_v = k_cache.clone(), v_cache.clone()
    slot_mapping = slots.to(DEVICE)

    triton_ops.write_kv(key, value, k_cache, v_cache, slot_mapping)

    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    torch_backend("write_kv")(key.to(dtype), value.to(dtype), by_torch_k, by_torch_v, slot_mapping)
    assert torch.equal(k_cache, by_torch_k) and torch.equal(v_cache, by_torch_v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_copy_blocks_all_layers(dtype):
    generator = make_generator("copy", dtype)
    shape = (9, 8, 2, 80)  # block numel 1280: more than one 1024-element chunk, with a tail
    k_caches = [randn(generator, *shape, dtype=dtype) for _ in range(3)]
    v_caches = [randn(generator, *shape, dtype=dtype) for _ in range(3)]
    pairs = torch.tensor([[0, 5], [3, 7], [0, 8]], dtype=torch.int64)
    expected = [c.clone() for c in (*k_caches, *v_caches)]
    for cache in expected:
        cache[pairs[:, 1].to(DEVICE)] = cache[pairs[:, 0].to(DEVICE)]
    by_torch = [c.clone() for c in expected]

    triton_ops.copy_blocks(k_caches, v_caches, pairs.to(DEVICE))

    for actual, wanted in zip((*k_caches, *v_caches), expected):
        assert torch.equal(actual, wanted)
    torch_backend("copy_blocks")(by_torch[:3], by_torch[3:], pairs.to(DEVICE))
    for actual, wanted in zip((*k_caches, *v_caches), by_torch):
        assert torch.equal(actual, wanted)


def test_swap_blocks_same_device_kernel_path():
    generator = make_generator("swap")
    src = randn(generator, 7, 16, 2, 64, dtype=torch.float16)
    dst = randn(generator, 5, 16, 2, 64, dtype=torch.float16)
    pairs = torch.tensor([[6, 0], [2, 4], [3, 1]])
    expected = dst.clone()
    expected[pairs[:, 1].to(DEVICE)] = src[pairs[:, 0].to(DEVICE)]

    triton_ops.swap_blocks(src, dst, pairs)

    assert torch.equal(dst, expected)


def test_swap_blocks_across_devices_uses_index_copies():
    generator = make_generator("swap-host")
    host = torch.randn(6, 8, 2, 64, generator=generator).half()
    if IS_CUDA:
        device_cache = torch.zeros(4, 8, 2, 64, dtype=torch.float16, device="cuda")
        triton_ops.swap_blocks(host.pin_memory(), device_cache, torch.tensor([[5, 0], [1, 3]]))
        torch.cuda.synchronize()
        assert torch.equal(device_cache[0].cpu(), host[5]) and torch.equal(device_cache[3].cpu(), host[1])
        back = torch.zeros_like(host)
        triton_ops.swap_blocks(device_cache, back, torch.tensor([[3, 2]]))
        assert torch.equal(back[2], host[1])
    else:
        # No second device here: run the cross-device helper itself on host tensors.
        dst = torch.zeros(4, 8, 2, 64, dtype=torch.float16)
        triton_ops._swap_blocks_across_devices(host, dst, torch.tensor([[5, 0], [1, 3]]))
        assert torch.equal(dst[0], host[5]) and torch.equal(dst[3], host[1]) and not dst[1].any()


def test_cpu_tensors_without_interpreter_raise(monkeypatch):
    monkeypatch.setattr(triton_ops, "_interpreting", lambda: False)  # mode is fixed at triton import
    cache = torch.zeros(2, 8, 1, 64)
    key = torch.zeros(1, 1, 64)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        triton_ops.write_kv(key, key, cache, cache.clone(), torch.zeros(1, dtype=torch.int64))
    q = torch.zeros(1, 1, 64)
    table = torch.zeros(1, 1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="CUDA"):
        triton_ops.paged_decode_attention(q, cache, cache, table, torch.ones(1, dtype=torch.int32), 1.0)


def test_rejects_bad_shapes():
    cache = torch.zeros(2, 8, 2, 64, device=DEVICE)
    table = torch.zeros(1, 1, dtype=torch.int32, device=DEVICE)
    lens = torch.ones(1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        triton_ops.paged_decode_attention(torch.zeros(1, 3, 64, device=DEVICE), cache, cache, table, lens, 1.0)
    with pytest.raises(ValueError, match="head_dim"):
        triton_ops.paged_decode_attention(torch.zeros(1, 2, 32, device=DEVICE), cache, cache, table, lens, 1.0)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        triton_ops.paged_attention(torch.zeros(1, 2, 64, device=DEVICE), cache, cache, table,
                                   torch.zeros(1, dtype=torch.int32, device=DEVICE), lens, 1.0)


@pytest.mark.slow
def test_kernels_compile_for_every_target():
    """The interpreter skips Triton's compiler; this compiles the kernels (attention, cache and
    LoRA) to cubins for sm_75, sm_80, sm_86, sm_89 and sm_90 (no GPU needed), and lists what
    a target must refuse."""
    environment = {**os.environ, "TRITON_INTERPRET": "0"}
    command = [sys.executable, "-m", "pagedserve.kernels.triton_compile_check", "--quick"]
    result = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    for arch in (75, 80, 86, 89, 90):
        assert f"ok      sm_{arch} torch.float16 head_dim=128" in result.stdout, arch
        assert f"ok      sm_{arch} torch.float16 head_dim=128 group=8 block=16 paged_prefill_kernel+variants" \
            in result.stdout, arch
        for kernel in ("lora_shrink_kernel", "lora_expand_kernel"):
            assert f"ok      sm_{arch} torch.float16 lora rank=16 in=2048 out=5632 {kernel}" in result.stdout, arch
    refused = [line for line in result.stdout.splitlines() if line.startswith("refused")]
    # The prefill kernel, plain and with the variants (window, soft-cap, sinks), over sm_86's shared memory.
    assert len(refused) == 2 and all("sm_86 torch.float32 head_dim=256" in line for line in refused), refused
    assert [line.split(":")[0].endswith("+variants") for line in refused] == [False, True], refused
