"""``bench offline``: output throughput of ``LLM.generate`` against transformers, in one run.

Contenders, on the same checkpoint and requests, greedy with EOS ignored:

* pagedserve ``LLM.generate`` (continuous batching on the paged cache);
* transformers ``generate`` in static batches (``static_batch`` requests
  each, left padded). A static batch runs until its longest request is done,
  which is the cost of static batching; only requested tokens count;
* transformers ``generate_batch`` (its own continuous batching).

The workload is ShareGPT-like by default: log-normal prompt and output
lengths with means of about 200 tokens, clipped to the model. MFU is
``2 x parameters x output tok/s`` over a float32 [256x512]x[512x1408] matmul
rate measured in the same run.

The timing functions here (transformers ``generate`` in static batches,
``generate_batch``, the matmul rate, greedy agreement, the FLOP count of a run)
are shared with ``benchmarks/bench_engine.py``, the standalone script with the
fixed-length workload, so both measure the same way.
"""

from __future__ import annotations

import dataclasses
import platform
import random
import time
from dataclasses import dataclass
from pathlib import Path

from .plots import plot_bars
from .report import format_table, progress_bar, torch_threads, write_json
from .replay import model_vocab_size, resolve_model
from .workload import LengthDist, random_token_ids

@dataclass(frozen=True)
class OfflineBenchConfig:
    model: str | None = None
    arch: str = "llama"
    size: str = "small"
    num_requests: int = 64
    prompt_len: LengthDist = LengthDist(mean=200, low=16, high=1024)
    output_len: LengthDist = LengthDist(mean=200, low=8, high=512)
    static_batch: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    skip_transformers: bool = False
    seed: int = 0
    num_threads: int = 1


DEFAULT_CONFIG = OfflineBenchConfig()
QUICK_CONFIG = dataclasses.replace(DEFAULT_CONFIG, size="tiny", num_requests=16,
                                   prompt_len=LengthDist(mean=100, low=8, high=300),
                                   output_len=LengthDist(mean=32, low=4, high=96))


# ---- timing shared with benchmarks/bench_engine.py ----------------------------------------
def matmul_flops_per_s(m: int = 256, k: int = 512, n: int = 1408, seconds: float = 1.0,
                       device: str = "cpu", dtype=None) -> float:
    """Best FLOP rate of a [m x k] x [k x n] matmul (float32 unless ``dtype``) on ``device``
    over repeated timings."""
    return _best_rate(lambda a, b: a @ b, 2 * m * k * n, seconds, device,
                      _random_operands((m, k), (k, n), device, dtype))


def copy_bytes_per_s(num_bytes: int = 1 << 30, seconds: float = 1.0, device: str = "cpu") -> float:
    """Best rate of a ``num_bytes`` tensor copy on ``device``, counting bytes read and written
    (the practical ceiling of a memory-bound kernel)."""
    import torch

    source = torch.empty(num_bytes, dtype=torch.uint8, device=device).fill_(1)
    return _best_rate(lambda src, dst: dst.copy_(src), 2 * num_bytes, seconds, device,
                      (source, torch.empty_like(source)))


def _random_operands(shape_a, shape_b, device: str, dtype):
    import torch

    gen = torch.Generator(device=device).manual_seed(0)
    return tuple(torch.randn(shape, generator=gen, device=device).to(dtype or torch.float32)
                 for shape in (shape_a, shape_b))


def _best_rate(op, amount: float, seconds: float, device: str, operands) -> float:
    """``amount`` over the best per-call time of ``op(*operands)``, timed in runs of 10
    (synchronised on CUDA) for about ``seconds``."""
    import torch

    def sync():
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(10):
        op(*operands)
    sync()
    best = float("inf")
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        for _ in range(10):
            op(*operands)
        sync()
        best = min(best, (time.perf_counter() - start) / 10)
    return amount / best


def run_static_generate(model, prompts, output_len: int, batch_size: int, pad_id: int):
    """``model.generate`` over static batches with left padding, on the model's device;
    returns (outputs, seconds)."""
    import torch

    outputs = []
    start = time.perf_counter()
    for first in range(0, len(prompts), batch_size):
        batch = prompts[first:first + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, prompt in enumerate(batch):
            ids[row, width - len(prompt):] = torch.tensor(prompt)
            mask[row, width - len(prompt):] = 1
        with torch.inference_mode():
            generated = model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device),
                                       do_sample=False,
                                       max_new_tokens=output_len, min_new_tokens=output_len,
                                       pad_token_id=pad_id)
        outputs.extend(generated[:, width:].tolist())
    return outputs, time.perf_counter() - start


def continuous_batching_config(page_size: int, num_blocks: int, max_batch_tokens: int):
    """transformers' ``ContinuousBatchingConfig``, whose block length is ``block_size`` in
    transformers 5.17 and ``page_size`` in 5.24."""
    from transformers import ContinuousBatchingConfig

    fields = getattr(ContinuousBatchingConfig, "__dataclass_fields__", {})
    size_name = "block_size" if "block_size" in fields and "page_size" not in fields else "page_size"
    return ContinuousBatchingConfig(**{size_name: page_size}, num_blocks=num_blocks,
                                    max_batch_tokens=max_batch_tokens)


def run_generate_batch_fixed_length(model, prompts, output_len: int, max_batch_tokens: int,
                                    page_size: int = 256):
    """``model.generate_batch`` (transformers' continuous batching), ``output_len`` tokens per
    prompt; returns (outputs, seconds)."""
    import torch
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=output_len, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
    num_blocks = sum(-(-(len(p) + output_len) // page_size) for p in prompts) + 8
    batching = continuous_batching_config(page_size, num_blocks, max_batch_tokens)
    start = time.perf_counter()
    with torch.inference_mode():
        results = model.generate_batch(inputs=prompts, generation_config=config,
                                       continuous_batching_config=batching, warmup=False)
    seconds = time.perf_counter() - start
    outputs = [list(result.generated_tokens) for result in results.values()]
    if len(outputs) != len(prompts):
        raise RuntimeError(f"generate_batch returned {len(outputs)} of {len(prompts)} requests")
    return outputs, seconds


def agreement(ours: list[list[int]], reference: list[list[int]]) -> dict:
    """Share of requests with identical outputs, and of tokens before the first divergence
    (also as the mean number of matching tokens per request)."""
    identical = sum(a == b for a, b in zip(ours, reference))
    prefix = 0
    for a, b in zip(ours, reference):
        for x, y in zip(a, b):
            if x != y:
                break
            prefix += 1
    total = sum(len(b) for b in reference)
    return {"identical_requests": identical, "num_requests": len(reference),
            "identical_fraction": identical / max(1, len(reference)),
            "matching_prefix_token_fraction": prefix / max(1, total),
            "mean_matching_prefix_len": prefix / max(1, len(reference))}


def forward_flops(prompt_lens: list[int], output_lens: list[int], num_decoder_linear_parameters: int,
                  num_lm_head_parameters: int, num_layers: int, attention_width: int) -> dict:
    """FLOPs of a run's forward passes, whoever runs them (no padding, no recomputation).

    Each request feeds its prompt and all but its last output token through the decoder,
    and samples each output token from one LM head row. Causal attention costs
    ``4 x context length x attention_width`` (query heads x head_dim) per token and layer.
    """
    num_decoder_tokens = sum(prompt_lens) + sum(n - 1 for n in output_lens)
    num_sampled = sum(output_lens)
    linear = 2 * (num_decoder_linear_parameters * num_decoder_tokens + num_lm_head_parameters * num_sampled)
    num_context_positions = sum((p + n - 1) * (p + n) // 2 for p, n in zip(prompt_lens, output_lens))
    attention = 4 * attention_width * num_layers * num_context_positions
    return {"linear": linear, "attention": attention, "total": linear + attention,
            "num_decoder_tokens": num_decoder_tokens}


def decoder_linear_parameters(runner) -> int:
    """Weights of the decoder's linear layers (the LM head is not part of the decoder)."""
    import torch

    return sum(module.weight.numel() for module in runner.decoder.modules()
               if isinstance(module, torch.nn.Linear))


# ---- the offline benchmark ---------------------------------------------------------------
def make_requests(config: OfflineBenchConfig, vocab_size: int, max_model_len: int) -> list[tuple[list[int], int]]:
    """``(prompt token ids, output length)`` per request; prompt plus output fits the model."""
    rng = random.Random(config.seed)
    requests = []
    for _ in range(config.num_requests):
        num_output = min(config.output_len.sample(rng), max_model_len // 2)
        num_prompt = min(config.prompt_len.sample(rng), max_model_len - num_output)
        requests.append((random_token_ids(rng, num_prompt, vocab_size), num_output))
    return requests


def run_pagedserve(llm, requests) -> tuple[list[list[int]], float]:
    """``LLM.generate`` with one greedy ``SamplingParams`` per request; (outputs, seconds)."""
    from pagedserve import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in requests]
    start = time.perf_counter()
    results = llm.generate([prompt for prompt, _ in requests], params, use_tqdm=False)
    return [list(r.outputs[0].token_ids) for r in results], time.perf_counter() - start


def run_static_batches(model, requests, batch_size: int, pad_id: int) -> tuple[list[list[int]], float]:
    """transformers ``generate`` per static batch, each to its longest requested output."""
    outputs, seconds = [], 0.0
    for first in range(0, len(requests), batch_size):
        batch = requests[first:first + batch_size]
        generated, elapsed = run_static_generate(model, [p for p, _ in batch], max(n for _, n in batch),
                                                 len(batch), pad_id)
        outputs += [row[:n] for row, (_, n) in zip(generated, batch)]
        seconds += elapsed
    return outputs, seconds


def run_generate_batch(model, requests, max_batch_tokens: int, page_size: int = 256):
    """transformers ``generate_batch``'s manager with each request's own output length."""
    import torch
    from transformers import GenerationConfig

    lengths = [n for _, n in requests]
    if len(set(lengths)) == 1:
        return run_generate_batch_fixed_length(model, [p for p, _ in requests], lengths[0],
                                               max_batch_tokens, page_size)
    config = GenerationConfig(max_new_tokens=max(lengths), do_sample=False, eos_token_id=None, pad_token_id=0)
    num_blocks = sum(-(-(len(p) + n) // page_size) for p, n in requests) + 8
    batching = continuous_batching_config(page_size, num_blocks, max_batch_tokens)
    start = time.perf_counter()
    with torch.inference_mode(), model.continuous_batching_context_manager(
            generation_config=config, continuous_batching_config=batching, block=True, timeout=5,
            warmup=False) as manager:
        ids = [manager.add_request(prompt, max_new_tokens=n) for prompt, n in requests]
        results: dict = {}
        while len(results) < len(ids):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                results[result.request_id] = result
            elif result is None and not manager.is_running():
                raise RuntimeError("transformers' continuous batching loop stopped early")
    seconds = time.perf_counter() - start
    return [list(results[i].generated_tokens) for i in ids], seconds


def run_benchmark(config: OfflineBenchConfig = DEFAULT_CONFIG, out: str | None = None,
                  plot_dir: str | None = None, show_progress: bool = True) -> dict:
    """Run every contender; returns (and writes) throughputs, ratios and MFU."""
    with torch_threads(config.num_threads) as threads:
        return _run_benchmark(config, out, plot_dir, show_progress, threads)


def _run_benchmark(config, out, plot_dir, show_progress, threads: int) -> dict:
    import torch

    from pagedserve import LLM

    model_path = resolve_model(config.model, config.arch, config.size)
    num_contenders = 1 if config.skip_transformers else 3
    with progress_bar(num_contenders + 1, "offline", unit="stage", disable=not show_progress) as bar:
        bar.set_description("matmul rate")
        flops_rate = matmul_flops_per_s()
        bar.update(1)
        llm = LLM(model_path, max_num_seqs=config.max_num_seqs,
                  max_num_batched_tokens=config.max_num_batched_tokens)
        runner = llm.engine.runner
        requests = make_requests(config, model_vocab_size(model_path), llm.engine.max_model_len)
        num_output = sum(n for _, n in requests)
        results: dict[str, dict] = {}
        outputs: dict[str, list[list[int]]] = {}
        warm = [(requests[0][0][:16], 4)]
        if not config.skip_transformers:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
            pad_id = model.generation_config.pad_token_id or 0
            run_static_batches(model, warm, 1, pad_id)
            bar.set_description("transformers generate")
            outputs["static"], seconds = run_static_batches(model, requests, config.static_batch, pad_id)
            results["transformers generate (static)"] = {"seconds": seconds}
            bar.update(1)
            bar.set_description("transformers generate_batch")
            outputs["batch"], seconds = run_generate_batch(model, requests, config.max_num_batched_tokens)
            results["transformers generate_batch"] = {"seconds": seconds}
            bar.update(1)
            del model
        run_pagedserve(llm, warm)
        bar.set_description("pagedserve")
        outputs["ours"], seconds = run_pagedserve(llm, requests)
        results["pagedserve LLM.generate"] = {"seconds": seconds, "num_steps": llm.engine.num_steps}
        bar.update(1)
    num_params = runner.num_parameters
    flops = forward_flops([len(p) for p, _ in requests], [n for _, n in requests],
                          decoder_linear_parameters(runner), runner.lm_head.weight.numel(),
                          runner.num_layers, runner.num_heads * runner.head_dim)
    for result in results.values():
        result["output_tok_per_s"] = num_output / result["seconds"]
        result["mfu"] = 2 * num_params * result["output_tok_per_s"] / flops_rate
    ours = results["pagedserve LLM.generate"]["output_tok_per_s"]
    data = {
        "workload": {"model": config.model or f"{config.arch}-{config.size}", "num_parameters": num_params,
                     "num_requests": len(requests), "num_prompt_tokens": sum(len(p) for p, _ in requests),
                     "num_output_tokens": num_output, "prompt_len": dataclasses.asdict(config.prompt_len),
                     "output_len": dataclasses.asdict(config.output_len), "static_batch": config.static_batch,
                     "threads": threads, "seed": config.seed,
                     "machine": platform.processor() or platform.machine()},
        "matmul_gflop_per_s": flops_rate / 1e9,
        "forward_gflop": {"linear": flops["linear"] / 1e9, "attention": flops["attention"] / 1e9},
        # Output tok/s if every forward FLOP ran at the matmul rate.
        "flop_ceiling_output_tok_per_s": num_output / (flops["total"] / flops_rate),
        "results": results,
        "ratios": {name: ours / r["output_tok_per_s"] for name, r in results.items()
                   if name != "pagedserve LLM.generate"},
    }
    if "static" in outputs:
        data["greedy_agreement_vs_static"] = agreement(outputs["ours"], outputs["static"])
    write_json(out, data)
    if plot_dir:
        plot_bars({"output tok/s": {n.replace("transformers ", "hf "): r["output_tok_per_s"] for n, r in results.items()},
                   "MFU": {n.replace("transformers ", "hf "): r["mfu"] for n, r in results.items()}},
                  Path(plot_dir) / "offline_throughput.png", "offline throughput, one workload")
    return data


def format_results(data: dict) -> str:
    w = data["workload"]
    ours = data["results"]["pagedserve LLM.generate"]["output_tok_per_s"]
    lines = [f"offline: {w['model']} ({w['num_parameters'] / 1e6:.1f}M params), {w['num_requests']} requests, "
             f"{w['num_prompt_tokens']} prompt / {w['num_output_tokens']} output tokens, {w['threads']} threads; "
             f"matmul {data['matmul_gflop_per_s']:.1f} GFLOP/s; FLOP ceiling "
             f"{data['flop_ceiling_output_tok_per_s']:.0f} output tok/s "
             f"({sum(data['forward_gflop'].values()):,.0f} GFLOP at the matmul rate)",
             format_table(["contender", "seconds", "out tok/s", "MFU", "pagedserve x"],
                          [[name, r["seconds"], r["output_tok_per_s"], f"{r['mfu']:.2%}",
                            f"{ours / r['output_tok_per_s']:.2f}"] for name, r in data["results"].items()])]
    if "greedy_agreement_vs_static" in data:
        agree = data["greedy_agreement_vs_static"]
        lines.append(f"greedy agreement with static generate: {agree['identical_requests']}/"
                     f"{agree['num_requests']} requests identical")
    return "\n".join(lines)
