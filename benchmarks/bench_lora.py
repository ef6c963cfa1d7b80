"""Decode step cost with LoRA adapters spread over the batch, against the base model's step.

One small random-weight llama (hidden 512, 8 layers) serves ``--batch`` greedy sequences
(prompts of ``--prompt`` tokens, EOS ignored) in decode steps; sequence i uses adapter
i mod N. Each configuration runs on an engine of its own: without ``enable_lora`` (the
plain base step), with it but no adapter in the step (the baseline of the ratios), and
N adapters of rank ``--rank`` for each N of ``--adapters`` (``max_loras`` the largest N),
their weights in slot tensors and, with ``--lora-paging unified`` or ``both`` (the
default), in pages of the KV pool (``lora_paging="unified"``: the products read them
through page tables; the pool holds the adapters' pages besides the batch's KV).
The adapters are random PEFT-layout checkpoints (A and B non-zero) adapting
``--targets``. The engines take decode steps in turns (``LLMEngine.step``, whole:
schedule, forward, sampling), so each step's ratio to the baseline's compares steps run
under the same load; each configuration reports its median step and the median of its
ratios.

Then an adapter's load: the time to the first token of one request (its prompt of
``--prompt`` tokens, prefix caching off) with the base model, with an adapter never seen
(read from disk, checked, copied into a slot), one in host memory but not in a slot (the
engine has one slot: another adapter took it), and one already in its slot; each
``--load-rounds`` times with fresh adapters, medians and their ratio to the base model's.
With unified paging the same four, where "in host memory" is an adapter whose pages another
took (the pool holds one adapter beside a sequence), swapped back in from its packed image.
``--steps 0`` skips the step comparison.

    python benchmarks/bench_lora.py [--batch 64 --adapters 1,8,32 --rank 16 --steps 40 --lora-paging both]
    python benchmarks/bench_lora.py --targets q_proj,v_proj
    python benchmarks/bench_lora.py --size 1b --device cuda --dtype bfloat16

With ``--device cuda`` it first times one layer's LoRA products on their own: the Triton
SGMV kernels (``kernels/triton_lora_ops.py``) on slot tensors and on weights in pages,
against a torch loop over the adapters and the torch path's batched matmuls
(``workers/lora/punica.py``) on a decode batch (``--kernel-tokens`` tokens, token i on
adapter i mod ``--kernel-adapters``, rank ``--rank``, ``--kernel-hidden`` features in and
out), and reports each one's time over Triton's. ``--kernels-only`` stops there.

    python benchmarks/bench_lora.py --device cuda --dtype bfloat16 --kernels-only
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from pagedserve import LLM, LoRARequest, SamplingParams
from pagedserve.devtools.model_factory import ensure_model
from pagedserve.kernels.lora_pages import PagedLoRAWeights

ALL_LINEAR = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"


def write_adapter(directory: Path, model, rank: int, targets: list[str], seed: int) -> str:
    """A PEFT-layout LoRA checkpoint of ``model`` with random A and B on every ``targets`` linear."""
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in targets:
            prefix = f"base_model.model.{name}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, module.in_features, generator=generator) * 0.02
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(module.out_features, rank, generator=generator) * 0.02
    directory.mkdir(parents=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    (directory / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": targets}))
    return str(directory)


class Decoding:
    """``batch`` sequences decoding on one engine, each with its adapter (None: the base model)."""

    def __init__(self, llm: LLM, prompts, loras, max_tokens: int) -> None:
        self.llm = llm
        engine = llm.engine
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        self.ids = [f"bench-{i}" for i in range(len(prompts))]
        for request_id, prompt, lora in zip(self.ids, prompts, loras):
            engine.add_request(request_id, None, params, prompt_token_ids=prompt, output_kind="final",
                               lora_request=lora)
        while any(not engine.requests[i].seqs[0].output_token_ids for i in self.ids):
            engine.step()
        engine.step()  # warm

    def step(self) -> float:
        start = time.perf_counter()
        self.llm.engine.step()
        return time.perf_counter() - start

    def finish(self) -> None:
        engine = self.llm.engine
        for request_id in self.ids:
            engine.abort_request(request_id)
        engine.step()
        self.llm.check_integrity()
        assert engine.num_used_blocks() == 0


def adapter_pages(llm: LLM, lora: LoRARequest) -> int:
    """The pages of the KV pool ``lora``'s adapter takes with unified paging, on ``llm``'s model
    and pool layout (``llm``: an engine with LoRA)."""
    from pagedserve.workers.lora.adapter_pages import pack_adapter, page_geometry

    layers = llm.engine.lora.layers
    shape = llm.engine.runner.kv_cache.shape
    geometry = page_geometry(shape, layers.min_features)
    block = (shape.block_size, shape.num_kv_heads, shape.head_dim)
    return pack_adapter(layers.read(lora), layers.layer_of, geometry, block, pin=False).num_pages


def time_to_first_token(llm: LLM, prompt: list[int], lora: LoRARequest | None) -> float:
    """Seconds from adding one request to its first token, stepping the engine alone."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    start = time.perf_counter()
    engine.add_request("ttft", None, params, prompt_token_ids=prompt, output_kind="final", lora_request=lora)
    while not engine.requests["ttft"].seqs[0].output_token_ids:
        engine.step()
    elapsed = time.perf_counter() - start
    engine.abort_request("ttft")
    engine.step()
    return elapsed


def adapter_load(path: str, model, prompt: list[int], rank: int, targets: list[str], rounds: int, root: Path,
                 device: dict, paging: str) -> None:
    """Time to first token: base, cold adapter, adapter in host memory only, adapter in its slot
    (with unified paging: in its pages; the pool holds one adapter's pages beside a sequence)."""
    options = dict(**device, swap_space_gb=0.01, block_size=16, enable_prefix_caching=False, enable_lora=True,
                   max_loras=1, max_lora_rank=rank, max_cpu_loras=2, max_model_len=len(prompt) + 16,
                   lora_paging=paging)
    blocks = -(-(len(prompt) + 16) // 16)
    if paging == "unified":
        probe = LLM(path, **{**options, "lora_paging": "slots", "num_device_blocks": 64})
        pages = adapter_pages(probe, LoRARequest("probe", 999, write_adapter(root / "probe", model, rank, targets, 99)))
        del probe
        blocks += 1 + pages + pages // 2   # the zero page and one adapter, not two
    llm = LLM(path, **options, num_device_blocks=max(blocks, 64) if paging == "slots" else blocks)
    time_to_first_token(llm, prompt, None)   # warm
    times: dict[str, list[float]] = {"base model": [], "cold (from disk)": [], "in host memory": [],
                                     "in its slot": []}
    for i in range(rounds):
        first, other = (LoRARequest(f"load-{i}-{j}", 1000 + 2 * i + j,
                                    write_adapter(root / f"load-{i}-{j}", model, rank, targets, 100 + 2 * i + j))
                        for j in range(2))
        times["base model"].append(time_to_first_token(llm, prompt, None))
        times["cold (from disk)"].append(time_to_first_token(llm, prompt, first))
        times["in its slot"].append(time_to_first_token(llm, prompt, first))
        time_to_first_token(llm, prompt, other)   # takes the only slot; first stays in host memory
        times["in host memory"].append(time_to_first_token(llm, prompt, first))
    llm.check_integrity()
    if paging == "unified":
        stats = llm.stats()["lora"]
        assert stats["num_page_evictions"] >= rounds, stats   # "in host memory" was swapped back in
    base = statistics.median(times["base model"])
    print(f"\nadapter load ({paging}): time to first token, prompt of {len(prompt)} tokens, rank {rank}, "
          f"median of {rounds} fresh adapters")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:>18} {1e3 * median:9.2f} ms {median / base:6.2f}x")


def in_pages(weights: torch.Tensor, piece: int) -> PagedLoRAWeights:
    """``weights`` ``[slots, R, features]`` moved into pieces of one flat storage in reverse order (as
    pages of a KV cache are in no order), read through a table."""
    num_slots, rank, features = weights.shape
    per_row = -(-features // piece)
    padded = torch.nn.functional.pad(weights, (0, per_row * piece - features)).reshape(-1, piece)
    order = torch.arange(padded.shape[0] - 1, -1, -1, device=weights.device)
    storage = torch.empty_like(padded)
    storage[order] = padded
    table = order.to(torch.int32).view(num_slots, rank, per_row).contiguous()
    return PagedLoRAWeights(storage.view(-1), table, piece, features)


def lora_products(device: torch.device, dtype: torch.dtype, num_tokens: int, num_adapters: int, rank: int,
                  hidden: int) -> dict[str, dict]:
    """Per path (a torch loop over the adapters, the torch path's batched matmuls, the Triton
    kernels on slot tensors and on weights in pages of 256 elements): its shrink, its expand and
    both, as callables on one layer's decode batch, and the output of both (each path from the
    same y)."""
    from pagedserve.kernels import triton_lora_ops
    from pagedserve.workers.lora import punica

    generator = torch.Generator().manual_seed(0)
    lora_a = (torch.randn(num_adapters, rank, hidden, generator=generator) / hidden ** 0.5).to(device, dtype)
    lora_b = (torch.randn(num_adapters, rank, hidden, generator=generator) / rank ** 0.5).to(device, dtype)
    x = torch.randn(num_tokens, hidden, generator=generator).to(device, dtype)
    token_slots = torch.arange(num_tokens) % num_adapters
    rows = [(token_slots == slot).nonzero().squeeze(1).to(device) for slot in range(num_adapters)]

    def loop_shrink():
        return [x.index_select(0, index) @ lora_a[slot].T for slot, index in enumerate(rows)]

    def loop_expand(y, h):
        for slot, index in enumerate(rows):
            y.index_add_(0, index, h[slot] @ lora_b[slot])

    y = torch.zeros(num_tokens, hidden, device=device, dtype=dtype)
    h = loop_shrink()
    loop_expand(y, h)
    paths = {"torch loop": {"output": y.clone(), "shrink": loop_shrink,
                            "expand": lambda y=y, h=h: loop_expand(y, h),
                            "both": lambda y=y: loop_expand(y, loop_shrink())}}
    contenders = (("torch bmm", punica, lora_a, lora_b), ("triton sgmv", triton_lora_ops, lora_a, lora_b),
                  ("triton sgmv, paged", triton_lora_ops, in_pages(lora_a, 256), in_pages(lora_b, 256)))
    for name, ops, a, b in contenders:
        segments = ops.build_segments(token_slots, device)
        y = torch.zeros(num_tokens, hidden, device=device, dtype=dtype)
        h = ops.lora_shrink(x, a, segments)
        ops.lora_expand(y, h, b, segments)
        paths[name] = {
            "output": y.clone(),
            "shrink": lambda ops=ops, segments=segments, a=a: ops.lora_shrink(x, a, segments),
            "expand": lambda ops=ops, segments=segments, y=y, h=h, b=b: ops.lora_expand(y, h, b, segments),
            "both": lambda ops=ops, segments=segments, y=y, a=a, b=b: ops.lora_expand(
                y, ops.lora_shrink(x, a, segments), b, segments),
        }
    return paths


def compare_kernels(args) -> None:
    """Time ``lora_products`` on CUDA (``triton.testing.do_bench``, median ms) and print the
    torch path's time over the Triton kernels'."""
    import triton.testing

    dtype = getattr(torch, args.dtype)
    paths = lora_products(torch.device(args.device), dtype, args.kernel_tokens, args.kernel_adapters, args.rank,
                          args.kernel_hidden)
    triton_path = paths["triton sgmv"]
    for name, path in paths.items():
        torch.testing.assert_close(path["output"], triton_path["output"], atol=5e-2, rtol=5e-2, msg=name)
    print(f"LoRA products of one layer on {torch.cuda.get_device_name()} ({args.dtype}): {args.kernel_tokens} "
          f"decoding tokens over {args.kernel_adapters} adapters, rank {args.rank}, {args.kernel_hidden} -> "
          f"{args.kernel_hidden} features; each path's median ms and its time over the Triton kernels'")
    print(f"{'product':>8} " + " ".join(f"{name:>22}" for name in paths))
    for product in ("shrink", "expand", "both"):
        times = {name: triton.testing.do_bench(path[product], warmup=25, rep=200, return_mode="median")
                 for name, path in paths.items()}
        base = times["triton sgmv"]
        print(f"{product:>8} " + " ".join(f"{ms:12.4f} ({ms / base:5.2f}x)" for ms in times.values()))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="small")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--adapters", default="1,8,32")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--targets", default=ALL_LINEAR)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--load-rounds", type=int, default=5, help="adapter-load rounds (0: skip)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--kernel-tokens", type=int, default=256, help="kernel comparison (CUDA): decoding tokens")
    parser.add_argument("--kernel-adapters", type=int, default=8, help="kernel comparison (CUDA): adapters")
    parser.add_argument("--kernel-hidden", type=int, default=2048, help="kernel comparison (CUDA): features")
    parser.add_argument("--kernels-only", action="store_true", help="only the kernel comparison (CUDA)")
    parser.add_argument("--lora-paging", choices=("slots", "unified", "both"), default="both",
                        help="where the adapters' weights live (default: both, side by side)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if torch.device(args.device).type == "cuda":
        compare_kernels(args)
    elif args.kernels_only:
        print("bench_lora: the kernel comparison needs --device cuda; nothing to measure (exit 0).")
    if args.kernels_only:
        return
    counts = [int(n) for n in args.adapters.split(",")]
    targets = args.targets.split(",")
    path = str(ensure_model("llama", args.size))
    rng = random.Random(0)
    prompts = [[rng.randrange(5, 1024) for _ in range(args.prompt)] for _ in range(args.batch)]
    max_tokens = args.steps + 4
    blocks = args.batch * -(-(args.prompt + max_tokens) // 16) + 16
    device = dict(device=args.device, dtype=args.dtype)
    max_model_len = args.prompt + max_tokens + 16
    common = dict(**device, swap_space_gb=0.01, max_num_seqs=args.batch, block_size=16,
                  num_device_blocks=blocks, enable_prefix_caching=False, max_model_len=max_model_len)
    lora = dict(enable_lora=True, max_loras=max(counts), max_lora_rank=args.rank)
    pagings = ("slots", "unified") if args.lora_paging == "both" else (args.lora_paging,)
    configs = {"base, LoRA off": (LLM(path, **common), 0), "base, LoRA on": (LLM(path, **common, **lora), 0)}
    with tempfile.TemporaryDirectory() as root:
        model = configs["base, LoRA off"][0].engine.runner.model
        adapters = [LoRARequest(f"adapter-{i}", i + 1, write_adapter(Path(root) / str(i), model, args.rank, targets, i))
                    for i in range(max(counts))]
        # With unified paging the pool takes the adapters' pages too (and a page of zeros, and room
        # for a sequence of max_model_len beside any adapter).
        pages = adapter_pages(configs["base, LoRA on"][0], adapters[0])
        for paging in pagings:
            extra = 0 if paging == "slots" else max(counts) * pages + 1 + -(-max_model_len // 16)
            options = {**common, **lora, "lora_paging": paging, "num_device_blocks": blocks + extra}
            for n in counts:
                label = f"{n} adapter{'s' if n > 1 else ''}" + (", in pages" if paging == "unified" else "")
                configs[label] = (LLM(path, **options), n)
        runs = {name: Decoding(llm, prompts, [adapters[i % n] if n else None for i in range(args.batch)], max_tokens)
                for name, (llm, n) in configs.items()}
    # Steps taken in turns, one per configuration, so that each ratio compares steps run under the same load.
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.steps):
        for name, run in runs.items():
            times[name].append(run.step())
    for run in runs.values():
        run.finish()
    print(f"llama-{args.size} on {args.device} ({args.dtype}), {args.batch} decoding sequences, rank {args.rank}, "
          f"targets {args.targets}, "
          f"torch threads {torch.get_num_threads()}, {args.steps} steps each, in turns")
    slot_engine = configs["base, LoRA on"][0].engine
    bytes_per_page = slot_engine.runner.kv_cache.shape.bytes_per_block
    print(f"in slots, max_loras {max(counts)} at max_lora_rank {args.rank} keep "
          f"{slot_engine.lora.layers.max_slot_bytes / 2**20:.1f} MiB out of the KV budget whatever is served")
    if "unified" in pagings:
        print(f"with unified paging each adapter takes {pages} pages of the KV pool "
              f"({pages * bytes_per_page / 2**20:.1f} MiB) while it holds pages, none otherwise")
    if args.steps:
        base = times["base, LoRA on"]
        print(f"{'configuration':>26} {'median step ms':>15} {'vs base (median of paired ratios)':>34}")
        for name, values in times.items():
            ratio = statistics.median(t / b for t, b in zip(values, base))
            print(f"{name:>26} {1e3 * statistics.median(values):15.2f} {ratio:33.2f}x")
    if args.load_rounds:
        for paging in pagings:
            with tempfile.TemporaryDirectory() as root:
                adapter_load(path, model, prompts[0], args.rank, targets, args.load_rounds, Path(root), device, paging)


if __name__ == "__main__":
    main()
