"""Torch backend of pagedserve.kernels against a float64 attention over contiguous tensors.

Each test draws a fresh seed (shown in failure messages) so runs cover different inputs.
Caches start filled with NaN, so reading any slot that was never written (padding,
the tail of a partly filled block, unused block table entries) shows up in the output.
"""

import math
import random
import sys
import types

import pytest
import torch

from pagedserve import kernels
from pagedserve.kernels import (
    copy_blocks,
    paged_attention,
    paged_decode_attention,
    cpu_decode,
    plan_attention,
    select_backend,
    swap_blocks,
    torch_ops,
    write_kv,
)

TOLERANCES = {
    torch.float64: dict(atol=1e-10, rtol=1e-10),
    torch.float32: dict(atol=2e-5, rtol=1e-4),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1.5e-2, rtol=1.5e-2),
}
GARBAGE_BLOCK_ID = 1_000_000


@pytest.fixture(params=["native", "torch"])
def decode_path(request, monkeypatch):
    """Run float32 CPU decode attention on the C kernel, or on the torch ops."""
    if request.param == "native":
        if cpu_decode.load() is None:
            pytest.skip("the native CPU decode kernel could not be built here")
    else:
        monkeypatch.setattr(cpu_decode, "supports_cache", lambda k_cache: False)
    return request.param


@pytest.fixture
def gen():
    """A torch generator with a fresh seed (``gen.initial_seed()`` reproduces a failure)."""
    return torch.Generator().manual_seed(random.SystemRandom().randrange(2**31))


def randn(gen, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=gen).to(dtype)


def randint(gen, low, high):
    """Uniform int in [low, high]."""
    return int(torch.randint(low, high + 1, (1,), generator=gen))


class PagedContext:
    """Random per-sequence K/V, stored in a NaN-filled paged cache through shuffled blocks."""

    def __init__(self, gen, seq_lens, num_kv_heads, head_dim, block_size, dtype):
        self.seq_lens = list(seq_lens)
        self.block_size = block_size
        num_blocks_per_seq = [math.ceil(n / block_size) for n in seq_lens]
        num_blocks = sum(num_blocks_per_seq) + 3
        width = max(num_blocks_per_seq, default=0) + 2
        block_ids = torch.randperm(num_blocks, generator=gen).tolist()
        # Unused table entries hold -1 or an id far out of range: reading them would fail.
        garbage = torch.where(
            torch.rand(len(seq_lens), width, generator=gen) < 0.5, -1, GARBAGE_BLOCK_ID
        )
        self.block_tables = garbage.to(torch.int32)
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k_cache = torch.full(shape, float("nan"), dtype=dtype)
        self.v_cache = torch.full(shape, float("nan"), dtype=dtype)
        self.keys, self.values = [], []
        for seq, seq_len in enumerate(seq_lens):
            blocks = [block_ids.pop() for _ in range(num_blocks_per_seq[seq])]
            self.block_tables[seq, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
            key = randn(gen, seq_len, num_kv_heads, head_dim, dtype=dtype)
            value = randn(gen, seq_len, num_kv_heads, head_dim, dtype=dtype)
            slots = self.slots(seq, range(seq_len))
            self.k_cache.view(-1, num_kv_heads, head_dim)[slots] = key
            self.v_cache.view(-1, num_kv_heads, head_dim)[slots] = value
            self.keys.append(key)
            self.values.append(value)

    def slots(self, seq, positions):
        table, size = self.block_tables[seq].tolist(), self.block_size
        return torch.tensor([table[p // size] * size + p % size for p in positions], dtype=torch.long)

    def seq_lens_tensor(self):
        return torch.tensor(self.seq_lens, dtype=torch.int32)


    def free_out_of_window(self, q_lens, sliding_window):
        """Poison what no query may read: blocks wholly before the window of a sequence's
        first query lose their table entry (-1, as an allocator that freed them early, or
        an id out of range) and are NaN-filled; earlier positions of its first window block
        become NaN."""
        size = self.block_size
        num_kv_heads, head_dim = self.k_cache.shape[2], self.k_cache.shape[3]
        for seq, (seq_len, num_queries) in enumerate(zip(self.seq_lens, q_lens)):
            first_query = seq_len - num_queries
            first = seq_len if num_queries == 0 else max(0, first_query - sliding_window + 1)
            for block in range(first // size):
                block_id = int(self.block_tables[seq, block])
                self.k_cache[block_id] = float("nan")
                self.v_cache[block_id] = float("nan")
                self.block_tables[seq, block] = -1 if (seq + block) % 2 else GARBAGE_BLOCK_ID
            slots = self.slots(seq, range(first // size * size, first))
            self.k_cache.view(-1, num_kv_heads, head_dim)[slots] = float("nan")
            self.v_cache.view(-1, num_kv_heads, head_dim)[slots] = float("nan")


def reference_attention(q, keys, values, q_lens, scale, sliding_window=None, logit_softcap=None,
                        sinks=None):
    """Float64 attention; queries of seq i are the last q_lens[i] of its tokens.

    Written as transformers' eager attention: scores scaled, soft-capped, masked (causal,
    and a query at p sees keys k > p - sliding_window), then a softmax over the scores
    with each head's sink logit appended as one more column, which is dropped after.
    """
    num_heads = q.shape[1]
    outputs = []
    start = 0
    for key, value, num_queries in zip(keys, values, q_lens):
        seq_len = key.shape[0]
        group = num_heads // key.shape[1]
        query = q[start : start + num_queries].double()
        key = key.double().repeat_interleave(group, dim=1)
        value = value.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", query, key) * scale
        if logit_softcap is not None:
            scores = torch.tanh(scores / logit_softcap) * logit_softcap
        query_positions = torch.arange(seq_len - num_queries, seq_len)
        mask = torch.arange(seq_len)[None, :] <= query_positions[:, None]
        if sliding_window is not None:
            mask &= torch.arange(seq_len)[None, :] > query_positions[:, None] - sliding_window
        scores = scores.masked_fill(~mask, float("-inf"))
        if sinks is None:
            probs = scores.softmax(dim=-1)
        else:
            sink_column = sinks.double().view(num_heads, 1, 1).expand(num_heads, num_queries, 1)
            probs = torch.cat([scores, sink_column], dim=-1).softmax(dim=-1)[..., :-1]
        outputs.append(torch.einsum("hqk,khd->qhd", probs, value))
        start += num_queries
    return torch.cat(outputs) if outputs else q.double()[:0]


def assert_close(actual, expected, dtype, gen):
    assert actual.dtype == dtype
    assert not torch.isnan(actual).any(), f"NaN in output (seed {gen.initial_seed()})"
    seed = gen.initial_seed()
    torch.testing.assert_close(
        actual.double(), expected, **TOLERANCES[dtype], msg=lambda m: f"seed {seed}: {m}"
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize("gqa", [1, 2, 4, 8])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_decode_matches_reference(gen, decode_path, block_size, gqa, head_dim, dtype):
    num_kv_heads = 2 if gqa < 8 else 1
    num_heads = num_kv_heads * gqa
    num_seqs = randint(gen, 1, 6)
    # Always include a single-token context and a length that is not a block multiple.
    seq_lens = [1, block_size * randint(gen, 1, 3) + randint(gen, 1, block_size - 1)]
    seq_lens += [randint(gen, 1, 90) for _ in range(num_seqs)]
    ctx = PagedContext(gen, seq_lens, num_kv_heads, head_dim, block_size, dtype)
    q = randn(gen, len(seq_lens), num_heads, head_dim, dtype=dtype)
    scale = head_dim**-0.5
    expected = reference_attention(q, ctx.keys, ctx.values, [1] * len(seq_lens), scale)

    out = paged_decode_attention(
        q, ctx.k_cache, ctx.v_cache, ctx.block_tables, ctx.seq_lens_tensor(), scale
    )
    assert_close(out, expected, dtype, gen)
    cu_seqlens_q = torch.arange(len(seq_lens) + 1, dtype=torch.int32)
    out = paged_attention(
        q, ctx.k_cache, ctx.v_cache, ctx.block_tables, cu_seqlens_q, ctx.seq_lens_tensor(), scale
    )
    assert_close(out, expected, dtype, gen)


@pytest.mark.parametrize(
    "block_size,gqa,head_dim,dtype",
    [
        (bs, gqa, hd, dtype)
        for bs, gqa, hd in [(8, 1, 64), (16, 2, 80), (32, 4, 128), (16, 8, 64), (8, 4, 80)]
        for dtype in (torch.float32, torch.float16)
    ]
    + [(16, 4, 64, torch.bfloat16), (16, 2, 64, torch.float64)],
)
def test_mixed_batch_matches_reference(gen, decode_path, block_size, gqa, head_dim, dtype):
    num_kv_heads = 8 // gqa if gqa < 8 else 1
    num_heads = num_kv_heads * gqa
    seqs = []  # (seq_len, num_queries)
    for _ in range(randint(gen, 1, 4)):
        seqs.append((randint(gen, 1, 120), 1))  # decode token
    prompt_len = randint(gen, 2, 70)
    seqs.append((prompt_len, prompt_len))  # whole prompt, no cached prefix
    for _ in range(randint(gen, 1, 3)):  # chunk after a cached prefix
        num_queries = randint(gen, 2, 40)
        seqs.append((num_queries + randint(gen, 1, 100), num_queries))
    seqs.append((1, 1))  # single-token context
    seqs.append((block_size + 3, 0))  # sequence with no queries this step
    order = torch.randperm(len(seqs), generator=gen).tolist()
    seqs = [seqs[i] for i in order]
    seq_lens = [n for n, _ in seqs]
    q_lens = [m for _, m in seqs]

    ctx = PagedContext(gen, seq_lens, num_kv_heads, head_dim, block_size, dtype)
    q = randn(gen, sum(q_lens), num_heads, head_dim, dtype=dtype)
    cu_seqlens_q = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    scale = 0.5 * head_dim**-0.5
    expected = reference_attention(q, ctx.keys, ctx.values, q_lens, scale)
    out = paged_attention(
        q, ctx.k_cache, ctx.v_cache, ctx.block_tables, cu_seqlens_q, ctx.seq_lens_tensor(), scale
    )
    assert_close(out, expected, dtype, gen)


VARIANTS = ["window", "softcap", "sinks", "scale", "all"]


def draw_variant(gen, variant, num_heads, head_dim, max_window):
    """Per-layer attention variant kwargs for ``variant`` (random values that matter:
    soft-caps near the scores' size, sinks comparable to the largest logits)."""
    kwargs = dict(scale=head_dim**-0.5, sliding_window=None, logit_softcap=None, sinks=None)
    if variant in ("window", "all"):
        kwargs["sliding_window"] = randint(gen, 1, max_window)
    if variant in ("softcap", "all"):
        kwargs["logit_softcap"] = 0.5 + 2.5 * float(torch.rand(1, generator=gen))
    if variant in ("sinks", "all"):
        kwargs["sinks"] = 2 * randn(gen, num_heads) + 1
    if variant in ("scale", "all"):
        kwargs["scale"] = 0.1 + 0.4 * float(torch.rand(1, generator=gen))
    return kwargs


def lengths_around(gen, window, block_size, num_random):
    """Context lengths below, at and above ``window``, block-aligned and not, and random."""
    lens = [1, block_size * randint(gen, 1, 3), block_size * 2 + randint(gen, 1, block_size - 1)]
    if window is not None:
        lens += [window, window + 1, window + block_size + randint(gen, 0, 2 * block_size)]
        lens += [window - 1] if window > 1 else []
    return lens + [randint(gen, 1, 90) for _ in range(num_random)]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("gqa,head_dim", [(1, 64), (4, 80), (8, 128)])
@pytest.mark.parametrize("block_size", [8, 16])
def test_decode_variants_match_reference(gen, decode_path, block_size, gqa, head_dim, dtype, variant):
    """Windows below, at and above each context, soft-caps, sinks and scales, on the C kernel
    and the torch ops; blocks wholly outside a window are freed (-1 or garbage) and every
    cache position no query sees is NaN."""
    num_kv_heads = 2 if gqa < 8 else 1
    num_heads = num_kv_heads * gqa
    variant_kwargs = draw_variant(gen, variant, num_heads, head_dim, max_window=3 * block_size + 5)
    window = variant_kwargs["sliding_window"]
    seq_lens = lengths_around(gen, window, block_size, randint(gen, 1, 5))
    ctx = PagedContext(gen, seq_lens, num_kv_heads, head_dim, block_size, dtype)
    q = randn(gen, len(seq_lens), num_heads, head_dim, dtype=dtype)
    expected = reference_attention(q, ctx.keys, ctx.values, [1] * len(seq_lens), **variant_kwargs)
    if window is not None:
        ctx.free_out_of_window([1] * len(seq_lens), window)

    out = paged_decode_attention(
        q, ctx.k_cache, ctx.v_cache, ctx.block_tables, ctx.seq_lens_tensor(), **variant_kwargs
    )
    assert_close(out, expected, dtype, gen)
    cu_seqlens_q = torch.arange(len(seq_lens) + 1, dtype=torch.int32)
    out = paged_attention(
        q, ctx.k_cache, ctx.v_cache, ctx.block_tables, cu_seqlens_q, ctx.seq_lens_tensor(),
        **variant_kwargs,
    )
    assert_close(out, expected, dtype, gen)


def mixed_batch(gen, block_size, window):
    """(seq_len, num_queries) pairs: decodes, a whole prompt, chunks over cached prefixes
    longer than the window, a one-token chunk on a long prefix, an idle sequence."""
    reach = 40 if window is None else window
    seqs = [(randint(gen, 1, 120), 1) for _ in range(randint(gen, 1, 3))]
    prompt_len = randint(gen, 2, 70)
    seqs.append((prompt_len, prompt_len))
    for _ in range(randint(gen, 1, 3)):
        num_queries = randint(gen, 2, 40)
        seqs.append((num_queries + randint(gen, 1, reach + 2 * block_size), num_queries))
    seqs.append((randint(gen, 2, 8) + reach + block_size, randint(gen, 2, 8)))
    seqs.append((1, 1))
    seqs.append((block_size + 3, 0))
    order = torch.randperm(len(seqs), generator=gen).tolist()
    return [seqs[i] for i in order]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(
    "block_size,gqa,head_dim,dtype",
    [(8, 1, 64, torch.float32), (16, 4, 80, torch.float16), (16, 8, 64, torch.float32),
     (8, 2, 128, torch.float16), (16, 2, 64, torch.bfloat16), (8, 4, 64, torch.float64)],
)
def test_mixed_batch_variants_match_reference(gen, decode_path, block_size, gqa, head_dim, dtype,
                                              variant):
    """Prefill chunks over cached prefixes, whole prompts and decode tokens in one batch, with
    each variant; what no query's window covers is freed and NaN."""
    num_kv_heads = 8 // gqa if gqa < 8 else 1
    num_heads = num_kv_heads * gqa
    variant_kwargs = draw_variant(gen, variant, num_heads, head_dim, max_window=2 * block_size + 9)
    window = variant_kwargs["sliding_window"]
    seqs = mixed_batch(gen, block_size, window)
    seq_lens, q_lens = [n for n, _ in seqs], [m for _, m in seqs]
    ctx = PagedContext(gen, seq_lens, num_kv_heads, head_dim, block_size, dtype)
    q = randn(gen, sum(q_lens), num_heads, head_dim, dtype=dtype)
    cu_seqlens_q = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    expected = reference_attention(q, ctx.keys, ctx.values, q_lens, **variant_kwargs)
    if window is not None:
        ctx.free_out_of_window(q_lens, window)
    out = paged_attention(
        q, ctx.k_cache, ctx.v_cache, ctx.block_tables, cu_seqlens_q, ctx.seq_lens_tensor(),
        **variant_kwargs,
    )
    assert_close(out, expected, dtype, gen)


def test_long_prefill_with_softcap_runs_in_row_chunks(gen, monkeypatch):
    """The soft-cap / sink path splits a long prefill's scores into row chunks (each with
    only the keys its rows' windows reach) and gets the same answer."""
    monkeypatch.setattr(torch_ops, "_MAX_SCORE_ELEMENTS", 4 * 300)
    seq_lens, q_lens = [300, 250], [300, 97]
    ctx = PagedContext(gen, seq_lens, 2, 64, 16, torch.float32)
    q = randn(gen, sum(q_lens), 4, 64)
    cu_seqlens_q = torch.tensor([0, 300, 397], dtype=torch.int32)
    for kwargs in (dict(sliding_window=37, logit_softcap=2.0, sinks=randn(gen, 4)),
                   dict(logit_softcap=1.5)):
        expected = reference_attention(q, ctx.keys, ctx.values, q_lens, 0.125, **kwargs)
        out = paged_attention(q, ctx.k_cache, ctx.v_cache, ctx.block_tables, cu_seqlens_q,
                              ctx.seq_lens_tensor(), 0.125, **kwargs)
        assert_close(out, expected, torch.float32, gen)


def test_decode_window_covering_every_context_changes_nothing(gen, decode_path):
    """A window at least as long as every context reads the same positions in the same
    order as no window: the result is bit-identical."""
    seq_lens = [1, 17, 64, 90, 33]
    ctx = PagedContext(gen, seq_lens, 2, 64, 16, torch.float32)
    q = randn(gen, len(seq_lens), 8, 64)
    args = (q, ctx.k_cache, ctx.v_cache, ctx.block_tables, ctx.seq_lens_tensor())
    plain = paged_decode_attention(*args)
    assert torch.equal(paged_decode_attention(*args, sliding_window=90), plain)
    assert torch.equal(paged_decode_attention(*args, scale=64**-0.5, sliding_window=10**9), plain)


@pytest.mark.parametrize("mixed", [False, True])
def test_one_plan_serves_alternating_windows(gen, decode_path, mixed):
    """Layers alternating between a window and none share one plan; each gives what
    planning inside the call gives."""
    seq_lens, q_lens = [37, 1, 90, 16, 45], [1, 1, 1, 1, 1]
    if mixed:
        q_lens = [1, 1, 30, 1, 5]
    ctx = PagedContext(gen, seq_lens, 2, 64, 8, torch.float32)
    tables, lens = ctx.block_tables, ctx.seq_lens_tensor()
    cu_seqlens_q = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    plan = plan_attention(ctx.k_cache, tables, cu_seqlens_q if mixed else None, lens,
                          sliding_window=12)
    sinks = randn(gen, 8)
    for window in (12, None, 12, 5, None):
        q = randn(gen, sum(q_lens), 8, 64)
        args = (q, ctx.k_cache, ctx.v_cache, tables)
        kwargs = dict(sliding_window=window, sinks=sinks)
        if mixed:
            expected = paged_attention(*args, cu_seqlens_q, lens, **kwargs)
            actual = paged_attention(*args, cu_seqlens_q, lens, plan=plan, **kwargs)
        else:
            expected = paged_decode_attention(*args, lens, **kwargs)
            actual = paged_decode_attention(*args, lens, plan=plan, **kwargs)
        assert not torch.isnan(actual).any()
        torch.testing.assert_close(actual, expected, atol=0, rtol=0)
        torch.testing.assert_close(
            actual.double(), reference_attention(q, ctx.keys, ctx.values, q_lens, 0.125, **kwargs),
            **TOLERANCES[torch.float32])
    assert set(plan.windows) == {12, None, 5}


@pytest.mark.parametrize("mixed", [False, True])
def test_freed_blocks_inside_a_window_are_an_error(gen, decode_path, mixed):
    """A table entry freed (-1) but inside some query's window, e.g. a global layer after
    the allocator freed blocks for windowed ones, is an error, never a read."""
    seq_lens, q_lens = [70, 50], [1, 6 if mixed else 1]
    ctx = PagedContext(gen, seq_lens, 2, 64, 8, torch.float32)
    ctx.free_out_of_window(q_lens, 16)
    q = randn(gen, sum(q_lens), 4, 64)
    lens = ctx.seq_lens_tensor()
    cu_seqlens_q = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32) if mixed else None
    plan = plan_attention(ctx.k_cache, ctx.block_tables, cu_seqlens_q, lens, sliding_window=16)
    args = (q, ctx.k_cache, ctx.v_cache, ctx.block_tables)
    for kwargs in (dict(sliding_window=16), dict(sliding_window=16, plan=plan)):
        if mixed:
            out = paged_attention(*args, cu_seqlens_q, lens, **kwargs)
        else:
            out = paged_decode_attention(*args, lens, **kwargs)
        assert not torch.isnan(out).any()
    # The native kernel's plan checks the entries it reads (ValueError); torch's gathers
    # refuse negative or out-of-range block ids (IndexError or RuntimeError).
    for window in (None, 24):
        with pytest.raises((ValueError, IndexError, RuntimeError)):
            if mixed:
                paged_attention(*args, cu_seqlens_q, lens, sliding_window=window, plan=plan)
            else:
                paged_decode_attention(*args, lens, sliding_window=window, plan=plan)


@pytest.mark.parametrize("max_gather_elements", [None, 4096])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_with_many_lengths_uses_chunks(gen, monkeypatch, dtype, max_gather_elements):
    """Widely spread context lengths, so decode runs in several chunks of similar length
    (with a small gather limit, in chunks of one sequence)."""
    monkeypatch.setattr(cpu_decode, "supports_cache", lambda k_cache: False)
    if max_gather_elements is not None:
        monkeypatch.setattr(torch_ops, "_MAX_GATHER_ELEMENTS", max_gather_elements)
    seq_lens = [randint(gen, 1, 20) for _ in range(20)]
    seq_lens += [randint(gen, 150, 400) for _ in range(12)]
    assert len(torch_ops._plan_decode_chunks(sorted(seq_lens, reverse=True), 2 * 64)) > 1
    seq_lens = [seq_lens[i] for i in torch.randperm(len(seq_lens), generator=gen).tolist()]
    ctx = PagedContext(gen, seq_lens, 2, 64, 16, dtype)
    q = randn(gen, len(seq_lens), 8, 64, dtype=dtype)
    expected = reference_attention(q, ctx.keys, ctx.values, [1] * len(seq_lens), 0.125)
    out = torch.empty_like(q)
    returned = paged_decode_attention(
        q, ctx.k_cache, ctx.v_cache, ctx.block_tables, ctx.seq_lens_tensor(), 0.125, out=out
    )
    assert returned is out
    assert_close(out, expected, dtype, gen)


def test_attention_writes_into_out_and_accepts_int64_metadata(gen):
    seq_lens = [5, 40, 17]
    q_lens = [1, 12, 17]
    ctx = PagedContext(gen, seq_lens, 2, 64, 16, torch.float32)
    q = randn(gen, sum(q_lens), 4, 64)
    out = torch.full_like(q, float("nan"))
    returned = paged_attention(
        q,
        ctx.k_cache,
        ctx.v_cache,
        ctx.block_tables.long(),
        torch.tensor([0, 1, 13, 30]),
        torch.tensor(seq_lens),
        0.125,
        out=out,
    )
    assert returned is out
    expected = reference_attention(q, ctx.keys, ctx.values, q_lens, 0.125)
    assert_close(out, expected, torch.float32, gen)


def test_attention_reads_non_contiguous_q(gen, decode_path):
    seq_lens = [33, 9]
    ctx = PagedContext(gen, seq_lens, 2, 64, 8, torch.float32)
    qkv = randn(gen, 2, 3 * 4, 64)
    q = qkv[:, :4]
    expected = reference_attention(q, ctx.keys, ctx.values, [1, 1], 0.125)
    out = paged_decode_attention(
        q, ctx.k_cache, ctx.v_cache, ctx.block_tables, ctx.seq_lens_tensor(), 0.125
    )
    assert_close(out, expected, torch.float32, gen)


def test_empty_batch_returns_empty_output():
    cache = torch.zeros(4, 8, 2, 64)
    q = torch.zeros(0, 4, 64)
    out = paged_attention(
        q,
        cache,
        cache.clone(),
        torch.zeros(0, 2, dtype=torch.int32),
        torch.zeros(1, dtype=torch.int32),
        torch.zeros(0, dtype=torch.int32),
        0.125,
    )
    assert out.shape == (0, 4, 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_write_kv_skips_padding_slots(gen, dtype):
    num_blocks, block_size, num_kv_heads, head_dim = 6, 8, 2, 16
    k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    num_tokens = 20
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    is_padding = torch.rand(num_tokens, generator=gen) < 0.3
    slot_mapping = torch.where(is_padding, -1, slots).to(torch.int32)
    key = randn(gen, num_tokens, num_kv_heads, head_dim)  # float32: cast to the cache dtype
    value = randn(gen, num_tokens, num_kv_heads, head_dim)

    write_kv(key, value, k_cache, v_cache, slot_mapping)

    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    is_real = ~is_padding
    assert torch.equal(k_flat[slots[is_real]], key[is_real].to(dtype))
    assert torch.equal(v_flat[slots[is_real]], value[is_real].to(dtype))
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots[is_real]] = False
    assert not k_flat[untouched].any() and not v_flat[untouched].any()


def test_write_kv_then_attention_round_trip(gen):
    """Prefill a prompt through write_kv, then decode one more token after it."""
    block_size, num_kv_heads, num_heads, head_dim = 16, 2, 4, 64
    k_cache = torch.full((8, block_size, num_kv_heads, head_dim), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    block_tables = torch.tensor([[5, 2, 7, -1]], dtype=torch.int32)
    prompt_len = 37
    key = randn(gen, prompt_len + 1, num_kv_heads, head_dim)
    value = randn(gen, prompt_len + 1, num_kv_heads, head_dim)
    slots = [int(block_tables[0, p // block_size]) * block_size + p % block_size for p in range(38)]
    slot_mapping = torch.tensor(slots[:prompt_len] + [-1, -1], dtype=torch.int32)  # 2 pad tokens
    padded = torch.zeros(2, num_kv_heads, head_dim)
    write_kv(torch.cat([key[:prompt_len], padded]), torch.cat([value[:prompt_len], padded]),
             k_cache, v_cache, slot_mapping)
    q = randn(gen, prompt_len, num_heads, head_dim)
    out = paged_attention(q, k_cache, v_cache, block_tables,
                          torch.tensor([0, prompt_len], dtype=torch.int32),
                          torch.tensor([prompt_len], dtype=torch.int32), 0.125)
    expected = reference_attention(q, [key[:prompt_len]], [value[:prompt_len]], [prompt_len], 0.125)
    assert_close(out, expected, torch.float32, gen)

    write_kv(key[prompt_len:], value[prompt_len:], k_cache, v_cache,
             torch.tensor(slots[prompt_len:], dtype=torch.int32))
    q = randn(gen, 1, num_heads, head_dim)
    out = paged_decode_attention(q, k_cache, v_cache, block_tables,
                                 torch.tensor([prompt_len + 1], dtype=torch.int32), 0.125)
    assert_close(out, reference_attention(q, [key], [value], [1], 0.125), torch.float32, gen)


def test_copy_blocks_all_layers(gen):
    num_layers, shape = 3, (10, 8, 2, 16)
    k_caches = [randn(gen, *shape) for _ in range(num_layers)]
    v_caches = [randn(gen, *shape) for _ in range(num_layers)]
    before_k = [c.clone() for c in k_caches]
    before_v = [c.clone() for c in v_caches]
    block_pairs = torch.tensor([[1, 4], [1, 7], [3, 9]], dtype=torch.int64)
    copy_blocks(k_caches, v_caches, block_pairs)
    for layer in range(num_layers):
        pairs = ((k_caches[layer], before_k[layer]), (v_caches[layer], before_v[layer]))
        for cache, before in pairs:
            expected = before.clone()
            expected[[4, 7, 9]] = before[[1, 1, 3]]
            assert torch.equal(cache, expected)
    copy_blocks(k_caches, v_caches, torch.zeros(0, 2, dtype=torch.int64))


def test_swap_blocks_between_pools(gen):
    device_pool = randn(gen, 6, 8, 2, 16)
    host_pool = torch.zeros(4, 8, 2, 16)
    swap_blocks(device_pool, host_pool, torch.tensor([[5, 0], [2, 3]]))
    assert torch.equal(host_pool[0], device_pool[5]) and torch.equal(host_pool[3], device_pool[2])
    assert not host_pool[[1, 2]].any()
    device_pool.zero_()
    swap_blocks(host_pool, device_pool, torch.tensor([[0, 1], [3, 4]], dtype=torch.int32))
    assert torch.equal(device_pool[1], host_pool[0]) and torch.equal(device_pool[4], host_pool[3])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_swap_blocks_across_devices(gen):
    device_pool = randn(gen, 6, 8, 2, 16).cuda()
    host_pool = torch.zeros(4, 8, 2, 16).pin_memory()
    swap_blocks(device_pool, host_pool, torch.tensor([[5, 0], [2, 3]]), backend="torch")
    assert torch.equal(host_pool[0], device_pool[5].cpu())
    device_pool.zero_()
    swap_blocks(host_pool, device_pool, torch.tensor([[0, 1]]), backend="torch")
    assert torch.equal(device_pool[1].cpu(), host_pool[0])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_torch_backend_runs_on_cuda(gen):
    seq_lens, q_lens = [1, 50, 30, 19], [1, 1, 9, 19]
    ctx = PagedContext(gen, seq_lens, 2, 64, 16, torch.float16)
    q = randn(gen, sum(q_lens), 8, 64, dtype=torch.float16)
    expected = reference_attention(q, ctx.keys, ctx.values, q_lens, 0.125)
    cu_seqlens_q = torch.tensor([0, 1, 2, 11, 30], dtype=torch.int32)
    out = paged_attention(
        q.cuda(), ctx.k_cache.cuda(), ctx.v_cache.cuda(), ctx.block_tables.cuda(),
        cu_seqlens_q.cuda(), ctx.seq_lens_tensor().cuda(), 0.125, backend="torch",
    )  # fmt: skip
    assert_close(out.cpu(), expected, torch.float16, gen)


def test_select_backend_and_dispatch(monkeypatch):
    assert select_backend("cpu") == "torch"
    assert select_backend(torch.device("cpu")) == "torch"
    calls = []
    fake = types.SimpleNamespace(
        write_kv=lambda *args, **kwargs: calls.append("write_kv"),
        copy_blocks=lambda *args, **kwargs: calls.append("copy_blocks"),
    )
    monkeypatch.setitem(sys.modules, "pagedserve.kernels.triton_ops", fake)
    monkeypatch.setattr(kernels, "triton_ops", fake, raising=False)
    cache = torch.zeros(2, 4, 1, 8)
    write_kv(torch.zeros(1, 1, 8), torch.zeros(1, 1, 8), cache, cache.clone(),
             torch.tensor([3]), backend="triton")
    copy_blocks([cache], [cache.clone()], torch.tensor([[0, 1]]), backend="triton")
    assert calls == ["write_kv", "copy_blocks"]
    assert not cache.any()  # the torch path did not run


def _attention_args(**overrides):
    args = dict(
        q=torch.zeros(3, 4, 64),
        k_cache=torch.zeros(4, 8, 2, 64),
        v_cache=torch.zeros(4, 8, 2, 64),
        block_tables=torch.zeros(2, 2, dtype=torch.int32),
        cu_seqlens_q=torch.tensor([0, 1, 3], dtype=torch.int32),
        seq_lens=torch.tensor([4, 5], dtype=torch.int32),
        scale=0.125,
    )
    args.update(overrides)
    return args


@pytest.mark.parametrize(
    "overrides,error,match",
    [
        (dict(q=torch.zeros(3, 3, 64)), ValueError, "multiple of num_kv_heads"),
        (dict(q=torch.zeros(3, 4, 32)), ValueError, "head_dim"),
        (dict(q=torch.zeros(3, 4, 64, dtype=torch.float16)), ValueError, "dtype"),
        (dict(q=torch.zeros(3, 256)), ValueError, "num_tokens, num_heads, head_dim"),
        (dict(v_cache=torch.zeros(4, 8, 2, 32)), ValueError, "v_cache shape"),
        (dict(k_cache=torch.zeros(4, 2, 8, 64).transpose(1, 2)), ValueError, "contiguous"),
        (dict(block_tables=torch.zeros(2, 2)), ValueError, "block_tables must be int32"),
        (dict(seq_lens=torch.tensor([4], dtype=torch.int32)), ValueError, "seq_lens has 1"),
        (dict(cu_seqlens_q=torch.tensor([0, 3], dtype=torch.int32)), ValueError, "num_seqs \\+ 1"),
        (dict(cu_seqlens_q=torch.tensor([0, 1, 2], dtype=torch.int32)), ValueError, "end at"),
        (dict(cu_seqlens_q=torch.tensor([0, 3, 3], dtype=torch.int32),
              seq_lens=torch.tensor([2, 5], dtype=torch.int32)), ValueError, "3 queries"),
        (dict(seq_lens=torch.tensor([4, 17], dtype=torch.int32)), ValueError, "seq_lens must lie"),
        (dict(scale="0.1"), TypeError, "scale"),
        (dict(scale=float("nan")), ValueError, "scale must be finite"),
        (dict(scale=-0.5), ValueError, "scale must be finite and > 0"),
        (dict(sliding_window=0), ValueError, "sliding_window must be >= 1"),
        (dict(sliding_window=True), TypeError, "sliding_window"),
        (dict(sliding_window=4.0), TypeError, "sliding_window"),
        (dict(logit_softcap=0.0), ValueError, "logit_softcap must be finite and > 0"),
        (dict(logit_softcap=float("inf")), ValueError, "logit_softcap"),
        (dict(sinks=torch.zeros(3)), ValueError, r"sinks must be \[num_heads=4\]"),
        (dict(sinks=torch.zeros(4, dtype=torch.int32)), ValueError, "sinks must be floating"),
        (dict(sinks=[0.0] * 4), TypeError, "sinks"),
        (dict(out=torch.zeros(3, 4, 32)), ValueError, "out must match"),
        (dict(backend="cuda"), ValueError, "unknown kernel backend"),
    ],
)
def test_paged_attention_rejects_bad_arguments(overrides, error, match):
    with pytest.raises(error, match=match):
        paged_attention(**_attention_args(**overrides))


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("sliding_window", [None, 5])
def test_decode_rows_of_length_zero_get_zeros_and_change_no_other_row(native, sliding_window, monkeypatch):
    """Padded rows (what a captured batch size adds to a smaller batch) read nothing."""
    from pagedserve.kernels import cpu_decode

    if not native:
        monkeypatch.setattr(cpu_decode, "supports_cache", lambda k_cache: False)
    generator = torch.Generator().manual_seed(5)
    k_cache = torch.randn(12, 4, 2, 16, generator=generator)
    v_cache = torch.randn(12, 4, 2, 16, generator=generator)
    tables = torch.randint(0, 12, (5, 3), generator=generator, dtype=torch.int32)
    lens = torch.tensor([9, 0, 3, 0, 12], dtype=torch.int32)
    q = torch.randn(5, 4, 16, generator=generator)
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.25, out=out, sliding_window=sliding_window)
    real = torch.tensor([0, 2, 4])
    alone = paged_decode_attention(q[real], k_cache, v_cache, tables[real], lens[real], 0.25,
                                   sliding_window=sliding_window)
    assert torch.equal(out[real], alone)
    assert torch.equal(out[torch.tensor([1, 3])], torch.zeros(2, 4, 16))


def test_decode_and_cache_ops_reject_bad_arguments():
    cache = torch.zeros(4, 8, 2, 64)
    tables = torch.zeros(2, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="one query per sequence"):
        paged_decode_attention(torch.zeros(3, 4, 64), cache, cache, tables,
                               torch.tensor([1, 2], dtype=torch.int32), 0.125)
    key = torch.zeros(3, 2, 64)
    with pytest.raises(ValueError, match="slot_mapping has 2 entries"):
        write_kv(key, key, cache, cache, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="slot_mapping must be int32 or int64"):
        write_kv(key, key, cache, cache, torch.tensor([0.0, 1.0, 2.0]))
    with pytest.raises(ValueError, match="do not match cache"):
        one_head = torch.zeros(3, 1, 64)
        write_kv(one_head, one_head, cache, cache, torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match=r"\[n, 2\]"):
        copy_blocks([cache], [cache], torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="2 k_caches but 1"):
        copy_blocks([cache, cache], [cache], torch.tensor([[1, 2]]))
    with pytest.raises(ValueError, match="per-block shape"):
        swap_blocks(cache, torch.zeros(4, 8, 2, 32), torch.tensor([[0, 1]]))
    with pytest.raises(ValueError, match="unknown kernel backend"):
        swap_blocks(cache, cache.clone(), torch.tensor([[0, 1]]), backend="cpu")


@pytest.mark.parametrize("mixed", [False, True])
def test_one_plan_serves_every_layer(gen, decode_path, mixed):
    """A plan made once from the metadata gives each layer's caches the same results as
    planning inside the call."""
    seq_lens, q_lens = [37, 1, 90, 16, 5], [1, 1, 1, 1, 1]
    if mixed:
        q_lens = [1, 1, 30, 1, 5]
    ctx = PagedContext(gen, seq_lens, 2, 64, 16, torch.float32)
    tables, lens = ctx.block_tables, ctx.seq_lens_tensor()
    # Same block tables, other contents (unwritten slots stay NaN).
    layers = [(ctx.k_cache * scale + 1, ctx.v_cache * scale - 1) for scale in (1.0, -2.0, 0.5)]
    cu_seqlens_q = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    plan = plan_attention(ctx.k_cache, tables, cu_seqlens_q if mixed else None, lens)
    for k_cache, v_cache in layers:
        q = randn(gen, sum(q_lens), 8, 64)
        args = (q, k_cache, v_cache, tables)
        if mixed:
            expected = paged_attention(*args, cu_seqlens_q, lens, 0.125)
            actual = paged_attention(*args, cu_seqlens_q, lens, 0.125, plan=plan)
        else:
            expected = paged_decode_attention(*args, lens, 0.125)
            actual = paged_decode_attention(*args, lens, 0.125, plan=plan)
        assert not torch.isnan(actual).any()
        torch.testing.assert_close(actual, expected, atol=0, rtol=0)


def test_plan_must_match_the_batch_and_backend(gen):
    ctx = PagedContext(gen, [20, 7], 2, 64, 8, torch.float32)
    lens = ctx.seq_lens_tensor()
    plan = plan_attention(ctx.k_cache, ctx.block_tables, None, lens)
    with pytest.raises(ValueError, match="covers 2 tokens"):
        paged_decode_attention(randn(gen, 1, 4, 64), ctx.k_cache, ctx.v_cache,
                               ctx.block_tables[:1], lens[:1], 0.125, plan=plan)
    with pytest.raises(ValueError, match="cannot run on backend 'triton'"):
        paged_decode_attention(randn(gen, 2, 4, 64), ctx.k_cache, ctx.v_cache,
                               ctx.block_tables, lens, 0.125, plan=plan, backend="triton")
    assert plan_attention(ctx.k_cache, ctx.block_tables, None, lens, backend="triton") is None
    with pytest.raises(ValueError, match="seq_lens must lie"):
        plan_attention(ctx.k_cache, ctx.block_tables, None, torch.tensor([20, 10_000]))


def test_native_decode_rejects_blocks_outside_the_cache(gen, decode_path):
    """A used table entry outside the cache is an error before any memory is read."""
    ctx = PagedContext(gen, [20, 7], 2, 64, 8, torch.float32)
    ctx.block_tables[1, 0] = ctx.k_cache.shape[0]
    error = ValueError if decode_path == "native" else IndexError
    with pytest.raises(error):
        paged_decode_attention(randn(gen, 2, 4, 64), ctx.k_cache, ctx.v_cache,
                               ctx.block_tables, ctx.seq_lens_tensor(), 0.125)


def test_native_kernel_builds_where_a_compiler_exists_and_can_be_switched_off(monkeypatch):
    import platform
    import shutil

    cpu_decode.load.cache_clear()
    try:
        if platform.system() == "Linux" and (shutil.which("cc") or shutil.which("gcc")):
            assert cpu_decode.load() is not None
        monkeypatch.setenv(cpu_decode.ENV_SWITCH, "0")
        cpu_decode.load.cache_clear()
        assert cpu_decode.load() is None
        assert not cpu_decode.supports_cache(torch.zeros(1, 8, 1, 8))
    finally:
        monkeypatch.delenv(cpu_decode.ENV_SWITCH)
        cpu_decode.load.cache_clear()
