"""GPU benchmark of the Triton paged decode attention.

Config (see kernels/README.md for the roofline): batch 64, context 2048, head dim 128,
32 query heads over 4 KV heads (GQA 8:1), block size 16, fp16 and bf16. Reports
  - decode attention time and achieved HBM bandwidth (bytes it must move / time), as a
    fraction of a device-to-device copy measured in the same run (the practical ceiling);
  - the same for each split-K setting, and for the mixed-batch kernel fed the same decode batch;
  - torch SDPA on the same data made contiguous (``[B, H, L, D]``, ``enable_gqa=True``).
``--prefill`` instead times the prefill (mixed-batch) kernel on whole prompts and on chunks
after a cached context, as FLOP rates against a bf16/fp16 matmul measured in the same run,
beside causal SDPA (flash) on the same data made contiguous, with other tiles than the
default's; ``--decode-tiles`` times the decode kernel's default launch against other tiles.
Without a CUDA device it says so and exits 0.

    python benchmarks/bench_kernels_gpu.py [--batch 64 --context 2048 ...] [--prefill | --decode-tiles]
"""

import argparse
import sys

import torch
import torch.nn.functional as F

from pagedserve.bench.offline import matmul_flops_per_s
from pagedserve.kernels.triton_attention_kernels import Tiles


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--num-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtypes", default="float16,bfloat16")
    parser.add_argument("--sweep", action="store_true",
                        help="instead: decode time for each split count over batches x contexts (first dtype), "
                             "against the heuristic's choice")
    parser.add_argument("--prefill", action="store_true",
                        help="instead: the prefill kernel's FLOP rate (8 prompts of 2,048 tokens, and 8 chunks "
                             "of 2,048 after 2,048 cached; 16/4 heads of 128, llama-1b's), its default launch and "
                             "other tiles, against SDPA and a matmul")
    parser.add_argument("--decode-tiles", action="store_true",
                        help="instead: the decode kernel's default launch against other tiles, at llama-1b's heads, "
                             "as fractions of the copy rate")
    return parser.parse_args(argv)


def bench_ms(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def copy_bandwidth(num_bytes: int) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting read + write."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    return 2 * num_bytes / (ms * 1e-3)


def run_config(args, dtype, copy_bytes_per_s):
    from pagedserve.kernels import triton_ops

    batch, context, head_dim = args.batch, args.context, args.head_dim
    num_heads, num_kv_heads, block_size = args.num_heads, args.num_kv_heads, args.block_size
    q, k_cache, v_cache, block_tables, seq_lens = paged_inputs(batch, context, num_heads, num_kv_heads, head_dim,
                                                               block_size, dtype)
    scale = head_dim ** -0.5
    out = torch.empty_like(q)

    element = k_cache.element_size()
    kv_bytes = 2 * batch * context * num_kv_heads * head_dim * element
    moved_bytes = kv_bytes + 2 * q.numel() * element + block_tables.numel() * 4

    k_dense, v_dense = dense_kv(k_cache, v_cache, block_tables, context)
    q_dense = q.unsqueeze(2)  # [B, H, 1, D]

    def sdpa():
        return F.scaled_dot_product_attention(q_dense, k_dense, v_dense, scale=scale, enable_gqa=True)

    reference = sdpa().squeeze(2)
    print(f"\n== {dtype}: batch {batch}, context {context}, heads {num_heads}/{num_kv_heads}, "
          f"head_dim {head_dim}, block_size {block_size}; decode moves {moved_bytes / 1e6:.1f} MB")
    rows = []
    for num_splits in (None, 1, 2, 4, 8):
        def decode(num_splits=num_splits):
            return triton_ops.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale,
                                                     out=out, num_splits=num_splits)
        error = (decode().float() - reference.float()).abs().max().item()
        rows.append((f"triton decode, splits={num_splits or 'auto'}", bench_ms(decode), error))

    cu_seqlens_q = torch.arange(batch + 1, dtype=torch.int32, device="cuda")

    def mixed():
        return triton_ops.paged_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale, out=out)

    error = (mixed().float() - reference.float()).abs().max().item()
    rows.append(("triton mixed-batch kernel", bench_ms(mixed), error))
    rows.append(("torch SDPA, contiguous, enable_gqa", bench_ms(sdpa), 0.0))

    sdpa_ms = rows[-1][1]
    print(f"{'kernel':40s} {'time us':>9s} {'GB/s':>8s} {'of copy':>8s} {'vs SDPA':>8s} {'max err':>9s}")
    for name, ms, error in rows:
        bandwidth = moved_bytes / (ms * 1e-3)
        print(f"{name:40s} {ms * 1e3:9.1f} {bandwidth / 1e9:8.0f} {bandwidth / copy_bytes_per_s:8.1%} "
              f"{sdpa_ms / ms:7.2f}x {error:9.2e}")


def dense_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor, context: int):
    """The first ``context`` positions of each table's K and V, contiguous ``[B, H, L, D]`` (for SDPA)."""
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    slots = block_tables.long().unsqueeze(2) * block_size + torch.arange(block_size, device=k_cache.device)
    slots = slots.view(block_tables.shape[0], -1)[:, :context]
    return tuple(cache.view(-1, num_kv_heads, head_dim)[slots].transpose(1, 2).contiguous()
                 for cache in (k_cache, v_cache))


def paged_inputs(batch: int, context: int, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                 dtype: torch.dtype):
    """Random q and a paged K/V cache with scattered pages, as after a while of serving."""
    blocks_per_seq = -(-context // block_size)
    generator = torch.Generator(device="cuda").manual_seed(0)
    k_cache = torch.randn(batch * blocks_per_seq, block_size, num_kv_heads, head_dim, device="cuda", dtype=dtype,
                          generator=generator)
    v_cache = torch.randn_like(k_cache)
    block_tables = torch.randperm(batch * blocks_per_seq, device="cuda", generator=generator)
    block_tables = block_tables.view(batch, blocks_per_seq).to(torch.int32)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, num_heads, head_dim, device="cuda", dtype=dtype, generator=generator)
    return q, k_cache, v_cache, block_tables, seq_lens


def split_sweep(args, dtype: torch.dtype, copy_bytes_per_s: float) -> None:
    """Decode time per split count, per (batch, context): the data the split heuristic is judged on."""
    from pagedserve.kernels import triton_ops

    choices = (1, 2, 4, 8, 16)
    print(f"\n== split sweep, {dtype}, heads {args.num_heads}/{args.num_kv_heads}, head_dim {args.head_dim}: "
          f"us per decode for splits {choices}, the heuristic's, and its share of the copy bandwidth")
    print(f"{'batch':>6s} {'context':>8s} " + " ".join(f"{c:>7d}" for c in choices) + f" {'auto':>7s} "
          f"{'auto/best':>9s} {'best of copy':>12s}")
    for context in (1024, 4096, 16384):
        for batch in (4, 16, 64, 256):
            q, k_cache, v_cache, block_tables, seq_lens = paged_inputs(
                batch, context, args.num_heads, args.num_kv_heads, args.head_dim, args.block_size, dtype)
            out = torch.empty_like(q)
            times = {}
            for num_splits in (*choices, None):
                times[num_splits] = bench_ms(lambda n=num_splits: triton_ops.paged_decode_attention(
                    q, k_cache, v_cache, block_tables, seq_lens, out=out, num_splits=n))
            best = min(times[c] for c in choices)
            moved = 2 * k_cache.numel() * k_cache.element_size()
            print(f"{batch:6d} {context:8d} " + " ".join(f"{times[c] * 1e3:7.1f}" for c in choices)
                  + f" {times[None] * 1e3:7.1f} {times[None] / best:9.2f} "
                  f"{moved / (best * 1e-3) / copy_bytes_per_s:12.1%}")
            del q, k_cache, v_cache, block_tables, seq_lens, out
            torch.cuda.empty_cache()


# Launches compared with the defaults (``triton_attention_kernels.prefill_tiles`` and
# ``decode_tiles``), for head dim 128 in half precision. On sm_90a (``launch_specialisation``):
# prefill 64x64/4 warps (the default) 187 registers, 82 KB shared; 128x64/8 179, 98 KB;
# 128x32/8 136, 66 KB; 64x32/4 144, 49 KB. Decode 64/4 warps (the default) 118 registers,
# 39 KB; 64/8 64; 32/4 72, 22 KB; 128/8 93, 74 KB. None spills.
PREFILL_CANDIDATES = [Tiles(block_m=128, block_n=64, num_warps=8), Tiles(block_m=128, block_n=32, num_warps=8),
                      Tiles(block_m=64, block_n=32, num_warps=4)]
DECODE_CANDIDATES = [Tiles(block_n=64, num_warps=8), Tiles(block_n=32, num_warps=4), Tiles(block_n=128, num_warps=8),
                     Tiles(block_n=64, num_warps=4, num_stages=2)]


def describe(tiles: "Tiles | None") -> str:
    if tiles is None:
        return "default"
    shape = f"{tiles.block_m}x{tiles.block_n}" if tiles.block_m else f"{tiles.block_n}"
    return f"{shape}/{tiles.num_warps}w" + (f"/{tiles.num_stages}s" if tiles.num_stages else "")


def prefill_rates(dtype: torch.dtype, num_seqs: int = 8, chunk: int = 2048, num_heads: int = 16,
                  num_kv_heads: int = 4, head_dim: int = 128, block_size: int = 16) -> None:
    """The prefill kernel on ``num_seqs`` chunks of ``chunk`` tokens, with no cached context
    and with ``chunk`` cached tokens before each, as causal attention FLOPs (4 x head_dim x
    heads per (query, key) pair) per second; causal SDPA on contiguous tensors beside it."""
    from pagedserve.kernels import triton_ops

    matmul = matmul_flops_per_s(8192, 8192, 8192, device="cuda", dtype=dtype)
    print(f"\n== prefill, {dtype}: {num_seqs} chunks of {chunk} tokens, heads {num_heads}/{num_kv_heads}, "
          f"head_dim {head_dim}, block_size {block_size}; matmul 8192^3 {matmul / 1e12:.0f} TFLOP/s")
    print(f"{'kernel':52s} {'time us':>9s} {'TFLOP/s':>8s} {'of matmul':>9s} {'vs SDPA':>8s} {'max err':>9s}")
    for cached in (0, chunk):
        context = cached + chunk
        _, k_cache, v_cache, block_tables, seq_lens = paged_inputs(num_seqs, context, num_heads, num_kv_heads,
                                                                   head_dim, block_size, dtype)
        generator = torch.Generator(device="cuda").manual_seed(1)
        q = torch.randn(num_seqs * chunk, num_heads, head_dim, device="cuda", dtype=dtype, generator=generator)
        cu_seqlens_q = torch.arange(0, num_seqs * chunk + 1, chunk, dtype=torch.int32, device="cuda")
        out = torch.empty_like(q)
        # The chunk's queries sit at positions cached..context-1.
        k_dense, v_dense = dense_kv(k_cache, v_cache, block_tables, context)
        q_dense = q.view(num_seqs, chunk, num_heads, head_dim).transpose(1, 2).contiguous()
        # Query i of the chunk sees keys 0..cached+i (a bottom-right aligned causal mask).
        mask = (torch.arange(context, device="cuda")[None, :]
                <= cached + torch.arange(chunk, device="cuda")[:, None])

        def sdpa():
            if cached == 0:
                return F.scaled_dot_product_attention(q_dense, k_dense, v_dense, is_causal=True, enable_gqa=True)
            return F.scaled_dot_product_attention(q_dense, k_dense, v_dense, attn_mask=mask, enable_gqa=True)

        def triton_prefill(tiles=None):
            return triton_ops.paged_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, out=out,
                                              tiles=tiles)

        reference = sdpa().transpose(1, 2).reshape_as(q)
        pairs = num_seqs * (chunk * cached + chunk * (chunk + 1) // 2)
        flops = 4 * num_heads * head_dim * pairs
        sdpa_ms = bench_ms(sdpa)
        label = "whole prompts" if cached == 0 else f"after {cached} cached"
        rows = []
        for tiles in (None, *PREFILL_CANDIDATES):
            error = (triton_prefill(tiles).float() - reference.float()).abs().max().item()
            rows.append((f"triton paged prefill {describe(tiles)}, {label}",
                         bench_ms(lambda tiles=tiles: triton_prefill(tiles)), error))
        rows.append((f"torch SDPA contiguous{' causal' if cached == 0 else ' masked'}, {label}", sdpa_ms, 0.0))
        for name, ms, err in rows:
            rate = flops / (ms * 1e-3)
            print(f"{name:52s} {ms * 1e3:9.1f} {rate / 1e12:8.0f} {rate / matmul:9.1%} {sdpa_ms / ms:7.2f}x "
                  f"{err:9.2e}")
        del q, k_cache, v_cache, k_dense, v_dense, q_dense, out
        torch.cuda.empty_cache()


def decode_tile_rates(dtype: torch.dtype, copy_bytes_per_s: float, num_heads: int = 16, num_kv_heads: int = 4,
                      head_dim: int = 128, block_size: int = 16) -> None:
    """The decode kernel's default launch against ``DECODE_CANDIDATES``, at llama-1b's heads:
    the K/V bytes it must read over its time, as a fraction of the copy rate; then what a
    table wider than the contexts (a CUDA graph's) costs."""
    from pagedserve.kernels import triton_ops

    print(f"\n== decode tiles, {dtype}, heads {num_heads}/{num_kv_heads}, head_dim {head_dim}: "
          f"us per call (of the copy rate), default first")
    candidates = (None, *DECODE_CANDIDATES)
    print(f"{'batch':>6s} {'context':>8s} " + " ".join(f"{describe(t):>18s}" for t in candidates) + f" {'max err':>9s}")
    for batch, context in ((256, 768), (256, 1536), (64, 2048), (4, 4096)):
        q, k_cache, v_cache, block_tables, seq_lens = paged_inputs(batch, context, num_heads, num_kv_heads,
                                                                   head_dim, block_size, dtype)
        out = torch.empty_like(q)
        moved = 2 * batch * context * num_kv_heads * head_dim * k_cache.element_size()
        reference = triton_ops.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens).float()
        cells, error = [], 0.0
        for tiles in candidates:
            def decode(tiles=tiles):
                return triton_ops.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, out=out,
                                                         tiles=tiles)
            error = max(error, (decode().float() - reference).abs().max().item())
            ms = bench_ms(decode)
            cells.append(f"{ms * 1e3:8.1f} ({moved / (ms * 1e-3) / copy_bytes_per_s:6.1%})")
        print(f"{batch:6d} {context:8d} " + " ".join(f"{c:>18s}" for c in cells) + f" {error:9.2e}")
        del q, k_cache, v_cache, block_tables, seq_lens, out
        torch.cuda.empty_cache()
    # A CUDA graph's table is as wide as the model's context: the same contexts in a table of
    # their own width and in one of 4,096 positions (llama-1b's), default tiles and splits.
    for batch, context in ((8, 1300), (2, 3000)):
        q, k_cache, v_cache, block_tables, seq_lens = paged_inputs(batch, context, num_heads, num_kv_heads,
                                                                   head_dim, block_size, dtype)
        wide = torch.zeros((block_tables.shape[0], 4096 // block_size), dtype=block_tables.dtype, device="cuda")
        wide[:, :block_tables.shape[1]] = block_tables
        times = [bench_ms(lambda table=table: triton_ops.paged_decode_attention(q, k_cache, v_cache, table, seq_lens))
                 for table in (block_tables, wide)]
        print(f"{batch} x {context} tokens: {times[0] * 1e3:.1f} us in a table of their width, "
              f"{times[1] * 1e3:.1f} us in one of 4,096 positions ({times[1] / times[0]:.2f}x)")


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_kernels_gpu: no CUDA device here; nothing to measure (exit 0).")
        return 0
    print(f"device: {torch.cuda.get_device_name()}")
    if args.prefill:
        for name in args.dtypes.split(","):
            prefill_rates(getattr(torch, name.strip()))
        return 0
    if args.decode_tiles:
        for name in args.dtypes.split(","):
            decode_tile_rates(getattr(torch, name.strip()), copy_bytes_per_s)
        return 0
    kv_bytes = 2 * args.batch * args.context * args.num_kv_heads * args.head_dim * 2
    copy_bytes_per_s = copy_bandwidth(kv_bytes)
    print(f"device-to-device copy of {kv_bytes / 1e6:.0f} MB: {copy_bytes_per_s / 1e9:.0f} GB/s (read + write)")
    if args.sweep:
        split_sweep(args, getattr(torch, args.dtypes.split(",")[0].strip()), copy_bytes_per_s)
        return 0
    for name in args.dtypes.split(","):
        run_config(args, getattr(torch, name.strip()), copy_bytes_per_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
