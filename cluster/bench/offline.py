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

The timing functions for transformers and the matmul come from
``benchmarks/bench_engine.py`` (the standalone script with the fixed-length
workload), loaded from the source tree, so both measure the same way.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import platform
import random
import time
from dataclasses import dataclass
from pathlib import Path

from .plots import plot_bars
from .report import format_table, progress_bar, torch_threads, write_json
from .replay import model_vocab_size, resolve_model
from .workload import LengthDist, random_token_ids

BENCH_ENGINE_SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_engine.py"


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


@functools.cache
def bench_engine_module():
    """``benchmarks/bench_engine.py`` as a module (needs a source checkout)."""
    if not BENCH_ENGINE_SCRIPT.is_file():
        raise RuntimeError(f"bench offline reuses {BENCH_ENGINE_SCRIPT.name} from the source tree; "
                           f"it is not at {BENCH_ENGINE_SCRIPT}")
    spec = importlib.util.spec_from_file_location("pagedserve_bench_engine", BENCH_ENGINE_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
    results = llm.generate([prompt for prompt, _ in requests], params)
    return [list(r.outputs[0].token_ids) for r in results], time.perf_counter() - start


def run_static_batches(model, requests, batch_size: int, pad_id: int) -> tuple[list[list[int]], float]:
    """transformers ``generate`` per static batch, each to its longest requested output."""
    run_static_generate = bench_engine_module().run_static_generate
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
    from transformers import ContinuousBatchingConfig, GenerationConfig

    lengths = [n for _, n in requests]
    if len(set(lengths)) == 1:
        return bench_engine_module().run_generate_batch(model, [p for p, _ in requests], lengths[0],
                                                        max_batch_tokens, page_size)
    config = GenerationConfig(max_new_tokens=max(lengths), do_sample=False, eos_token_id=None, pad_token_id=0)
    num_blocks = sum(-(-(len(p) + n) // page_size) for p, n in requests) + 8
    batching = ContinuousBatchingConfig(page_size=page_size, num_blocks=num_blocks,
                                        max_batch_tokens=max_batch_tokens)
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

    bench = bench_engine_module()
    model_path = resolve_model(config.model, config.arch, config.size)
    num_contenders = 1 if config.skip_transformers else 3
    with progress_bar(num_contenders + 1, "offline", unit="stage", disable=not show_progress) as bar:
        bar.set_description("matmul rate")
        flops_rate = bench.matmul_flops_per_s()
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
        "results": results,
        "ratios": {name: ours / r["output_tok_per_s"] for name, r in results.items()
                   if name != "pagedserve LLM.generate"},
    }
    if "static" in outputs:
        data["greedy_agreement_vs_static"] = bench.agreement(outputs["ours"], outputs["static"])
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
             f"matmul {data['matmul_gflop_per_s']:.1f} GFLOP/s",
             format_table(["contender", "seconds", "out tok/s", "MFU", "pagedserve x"],
                          [[name, r["seconds"], r["output_tok_per_s"], f"{r['mfu']:.2%}",
                            f"{ours / r['output_tok_per_s']:.2f}"] for name, r in data["results"].items()])]
    if "greedy_agreement_vs_static" in data:
        agree = data["greedy_agreement_vs_static"]
        lines.append(f"greedy agreement with static generate: {agree['identical_requests']}/"
                     f"{agree['num_requests']} requests identical")
    return "\n".join(lines)
