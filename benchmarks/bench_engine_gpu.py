"""Offline throughput on a CUDA GPU: pagedserve's ``LLM.generate`` against transformers.

One process, one checkpoint (by default the random-weight ``llama-1b``: hidden 2048,
16 layers, GQA 16:4, vocab 32000, ~852M parameters, built in the cache on first use),
one set of requests (random token ids from a fixed seed, prompts of
``--min-prompt``..``--max-prompt`` tokens, ``--output-len`` output tokens each, EOS
ignored), greedy throughout. Contenders, in this order, each after a warm-up, the device
synchronised around every timing:

- pagedserve ``LLM.generate`` (KV pool of ``--kv-cache-gb``), decode steps replaying CUDA
  graphs of the torch.compile'd forward (the default on CUDA);
- the same with ``torch_compile=False`` (graphs of the uncompiled forward);
- (only when asked for) the same with ``merge_projections=False`` (q/k/v and gate/up as
  separate matmuls);
- the same with ``enforce_eager=True`` (every step eager);
- the same with n-gram speculative decoding (``--spec-k`` proposed tokens, prompt lookup of 1
  to 3 tokens): its outputs against pagedserve's without it, and the mean acceptance length
  it got on the random model's own loops;
- transformers ``generate`` in static batches of ``--static-batch`` (left padding);
- transformers ``generate_batch`` (its continuous batching); a failure is reported, not fatal.

A contender that fails is reported and the rest still run; the results so far are written
to ``--json`` after every contender, and progress lines are flushed as they happen.

Reports output tok/s, pagedserve's ratio to each baseline, greedy agreement with static
``generate`` (identical requests and the mean matching-prefix length: in bf16, near-ties
make outputs diverge), MFU = ``2 x parameters x output tok/s`` over a bf16 [n x n] x [n x n]
matmul rate measured in the same run (``--matmul-size``, 8192 on CUDA), the FLOP
utilisation counting every token's forward FLOPs (prompts included), and for decode the
weight bytes read per step x steps/s against a device copy measured in the same run, and
for pagedserve the run's roofline (``pagedserve.bench.roofline``: the sum over its own steps
of max(FLOPs / matmul rate, bytes moved / copy rate), weights, K/V read and K/V written
counted) with the measured time as a fraction of it. On CUDA each pagedserve step is
bracketed by two CUDA events (``pagedserve.bench.step_device_time``): the device time of
decode steps and of steps with a prompt chunk, and how long the device idled between steps.

    python benchmarks/bench_engine_gpu.py [--quick] [--json out.json]
    python benchmarks/bench_engine_gpu.py --device cpu --dtype float32 --size tiny --quick  # smoke
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import os
import platform
import pstats
import random
import sys
import time
import traceback

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local checkpoints only; never wait on a network

from pagedserve.bench.offline import (agreement, copy_bytes_per_s, decoder_linear_parameters,  # noqa: E402
                                      forward_flops, matmul_flops_per_s, run_generate_batch_fixed_length,
                                      run_pagedserve, run_static_generate)
from pagedserve.bench.kernel_profile import format_kernel_summary, profile_kernels  # noqa: E402
from pagedserve.bench.report import format_table, write_json  # noqa: E402
from pagedserve.bench.roofline import record_steps, roofline_seconds  # noqa: E402
from pagedserve.bench.step_device_time import (format_step_device_times, record_step_device_times,  # noqa: E402
                                               summarize_step_device_times)
from pagedserve.bench.token_times import record_token_times  # noqa: E402
from pagedserve.bench.workload import random_token_ids  # noqa: E402

LABELS = {"pagedserve": "pagedserve LLM.generate", "uncompiled": "pagedserve LLM.generate (uncompiled)",
          "unmerged": "pagedserve LLM.generate (q/k/v, gate/up unmerged)",
          "eager": "pagedserve LLM.generate (eager)", "ngram": "pagedserve LLM.generate (ngram speculation)",
          "static": "transformers generate (static)", "batch": "transformers generate_batch"}
_START = time.perf_counter()


def log(message: str) -> None:
    print(f"[{time.perf_counter() - _START:7.1f}s] {message}", flush=True)


def synchronize(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def free_device_memory(device: str) -> None:
    import torch

    gc.collect()
    if device.startswith("cuda"):
        try:  # after a failed contender the device may be unusable: still report what ran
            torch.cuda.empty_cache()
            log(f"device memory after freeing: {torch.cuda.memory_allocated() / 2**30:.2f} GiB allocated, "
                f"{torch.cuda.memory_reserved() / 2**30:.2f} GiB reserved")
        except Exception as error:  # noqa: BLE001
            log(f"freeing device memory failed: {type(error).__name__}: {error}")


def environment(device: str) -> dict:
    import torch
    import transformers

    info = {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "cuda": torch.version.cuda, "device": device}
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception as error:  # noqa: BLE001 - report whatever stops it
        info["triton"] = f"unavailable ({type(error).__name__})"
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name()
        info["gpu_memory_gib"] = torch.cuda.get_device_properties(0).total_memory / 2**30
    else:
        info["cpu"] = platform.processor() or platform.machine()
        info["threads"] = torch.get_num_threads()
    return info


def model_counts(decoder, lm_head, config) -> dict:
    """Parameter counts for MFU, the FLOP count and the decode bytes per step."""
    import types

    num_linear = decoder_linear_parameters(types.SimpleNamespace(decoder=decoder))
    num_lm_head = lm_head.weight.numel()
    num_embedding = sum(p.numel() for p in decoder.parameters()) - num_linear
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return {"num_parameters": num_linear + num_lm_head + num_embedding,
            "num_decoder_linear_parameters": num_linear, "num_lm_head_parameters": num_lm_head,
            "num_layers": config.num_hidden_layers, "attention_width": config.num_attention_heads * head_dim,
            # A decode step reads every linear weight and the LM head (embeddings: a few rows).
            "decode_weight_bytes": (num_linear + num_lm_head) * lm_head.weight.element_size()}


# ---- the contenders ----------------------------------------------------------------------------
def dynamo_frames_compiled() -> int:
    """Frames torch.compile has compiled in this process so far (a recompile counts too)."""
    from torch._dynamo.utils import counters

    return counters["frames"]["total"]


def bench_pagedserve(args, path: str, prompts, warm_prompts, state: dict, enforce_eager: bool = False,
                     torch_compile: bool | None = None, merge_projections: bool | None = None,
                     speculative_config: dict | None = None) -> dict:
    from pagedserve import LLM
    from pagedserve.devtools.triton_variants import compiled_variants

    options = {"device": args.device, "dtype": args.dtype, "max_num_seqs": args.max_num_seqs,
               "max_num_batched_tokens": args.max_num_batched_tokens, "seed": args.seed,
               "enforce_eager": enforce_eager, "torch_compile": torch_compile,
               "merge_projections": merge_projections, "speculative_config": speculative_config}
    if args.kv_cache_gb:
        options["kv_cache_memory_gb"] = args.kv_cache_gb
    log(f"pagedserve: loading LLM({path!r}, {options})")
    llm = LLM(path, **options)
    engine, runner = llm.engine, llm.engine.runner
    state.setdefault("counts", model_counts(runner.decoder, runner.lm_head, runner.model.config))
    state["counts"].setdefault("kv_bytes_per_token", runner.cache_shape(1).bytes_per_block)
    log(f"pagedserve: {engine.pool_config.num_device_blocks} KV blocks of {engine.pool_config.block_size} "
        f"tokens, {runner.dtype}, triton kernels: {getattr(runner, 'uses_triton', '?')}, merged projections in "
        f"{len(getattr(runner, 'merged_projections', ()))} modules; warming up")
    # Prefills of the timed lengths, then a batch as large as the timed one (the Triton
    # kernels compile per shape class: few classes are left to compile in the timed run).
    run_pagedserve(llm, [(p, 16) for p in warm_prompts])
    run_pagedserve(llm, [(warm_prompts[i % len(warm_prompts)][:16 + i % 16], 4) for i in range(len(prompts))])
    llm.reset_prefix_cache()
    before = (engine.num_steps, engine.num_decode_steps, engine.decode_step_seconds, engine.step_seconds)
    spec_before = engine.stats()
    log(f"pagedserve: timing {len(prompts)} requests")
    shapes = record_steps(runner)
    step_times = record_step_device_times(engine)  # CUDA only: two events a step
    token_times = record_token_times(engine) if args.token_times else None
    compiled_before, frames_before = compiled_variants(), dynamo_frames_compiled()
    synchronize(args.device)
    profiler = cProfile.Profile() if args.profile else None
    if profiler:
        profiler.enable()
    requests = [(p, args.output_len) for p in prompts]
    kernels = None
    if args.kernel_profile:
        (outputs, seconds), kernels = profile_kernels(lambda: run_pagedserve(llm, requests),
                                                      lambda: synchronize(args.device))
        log(f"pagedserve: device kernels of the timed run (under torch.profiler)\n{format_kernel_summary(kernels)}")
    else:
        outputs, seconds = run_pagedserve(llm, requests)
    synchronize(args.device)
    device_steps = None
    if step_times is not None:  # the device synchronised above
        spans, gaps = step_times.spans_and_gaps()
        device_steps = summarize_step_device_times(step_times.kinds, spans, gaps, seconds)
        log(f"pagedserve: device time of the timed run's steps\n{format_step_device_times(device_steps)}")
    if profiler:
        profiler.disable()
        with open(args.profile, "w") as f:
            stats = pstats.Stats(profiler, stream=f)
            stats.sort_stats("tottime").print_stats(40)
            stats.sort_stats("cumulative").print_stats(40)
        log(f"pagedserve: profile of the timed run (host time by function) in {args.profile}")
    num_steps, num_decode_steps, decode_seconds, step_seconds = (after - first for after, first in zip(
        (engine.num_steps, engine.num_decode_steps, engine.decode_step_seconds, engine.step_seconds), before))
    stats = engine.stats()
    compiled_after, frames_after = compiled_variants(), dynamo_frames_compiled()
    result = {"seconds": seconds, "outputs": outputs, "num_steps": num_steps,
              # Triton kernel variants compiled inside the timed run (None: interpreted, or no Triton).
              "triton_compiles_in_run": None if compiled_before is None else compiled_after - compiled_before,
              # Frames torch.compile compiled (or recompiled) inside the timed run.
              "dynamo_compiles_in_run": frames_after - frames_before,
              "num_decode_steps": num_decode_steps, "decode_seconds": decode_seconds, "step_shapes": shapes,
              # The steps with a prompt chunk (prefill and mixed), and their time.
              "num_mixed_steps": num_steps - num_decode_steps, "mixed_seconds": step_seconds - decode_seconds,
              "num_cuda_graphs": stats.get("num_cuda_graphs", 0),
              "num_graph_replays": stats.get("num_graph_replays", 0), "kernel_profile": kernels,
              "step_device_times": device_steps}
    if token_times is not None:
        result["itl_ms"] = token_times.summary()
        log("pagedserve: the engine's inter-token latency (ms): "
            + ", ".join(f"{name} {value:.2f}" for name, value in result["itl_ms"].items()))
    if speculative_config is not None:
        drafts = stats["spec_decode_num_drafts"] - spec_before["spec_decode_num_drafts"]
        accepted = stats["spec_decode_num_accepted_tokens"] - spec_before["spec_decode_num_accepted_tokens"]
        # vLLM's mean acceptance length: tokens a verification step yields, the bonus one included.
        result["mean_acceptance_length"] = 1 + accepted / drafts if drafts else None
    del llm, engine, runner
    return result


def load_transformers_model(args, path: str):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype))
    return model.to(args.device).eval()


def bench_static(args, model, prompts, warm_prompts) -> dict:
    pad_id = model.generation_config.pad_token_id or 0
    log(f"static generate: warming up (attention {getattr(model.config, '_attn_implementation', '?')})")
    run_static_generate(model, warm_prompts, 4, args.static_batch, pad_id)
    log(f"static generate: timing {len(prompts)} requests in batches of {args.static_batch}")
    synchronize(args.device)
    outputs, seconds = run_static_generate(model, prompts, args.output_len, args.static_batch, pad_id)
    synchronize(args.device)
    num_batches = -(-len(prompts) // args.static_batch)
    # Every batch runs output_len steps; seconds include the prefills.
    return {"seconds": seconds, "outputs": outputs, "num_decode_steps": num_batches * args.output_len,
            "decode_seconds": seconds}


def generate_batch(model, prompts, output_len: int, max_batch_tokens: int):
    """``generate_batch`` through the shared helper; on a transformers without
    ``ContinuousBatchingConfig``, with its own defaults (results put back in input order)."""
    try:
        from transformers import ContinuousBatchingConfig  # noqa: F401
    except ImportError:
        import torch
        from transformers import GenerationConfig

        log("generate_batch: no ContinuousBatchingConfig in this transformers; using its defaults")
        config = GenerationConfig(max_new_tokens=output_len, do_sample=False, eos_token_id=None, pad_token_id=0)
        start = time.perf_counter()
        with torch.inference_mode():
            results = model.generate_batch(inputs=prompts, generation_config=config)
        seconds = time.perf_counter() - start
        ordered = sorted(results.items(), key=lambda item: int(item[0].rsplit("_", 1)[-1]))
        outputs = [list(result.generated_tokens) for _, result in ordered]
        if len(outputs) != len(prompts):
            raise RuntimeError(f"generate_batch returned {len(outputs)} of {len(prompts)} requests")
        return outputs, seconds
    return run_generate_batch_fixed_length(model, prompts, output_len, max_batch_tokens)


def bench_generate_batch(args, model, prompts, warm_prompts) -> dict:
    log("generate_batch: warming up")
    generate_batch(model, warm_prompts, 4, args.max_num_batched_tokens)
    log(f"generate_batch: timing {len(prompts)} requests")
    synchronize(args.device)
    outputs, seconds = generate_batch(model, prompts, args.output_len, args.max_num_batched_tokens)
    synchronize(args.device)
    return {"seconds": seconds, "outputs": outputs}


# ---- the report --------------------------------------------------------------------------------
def summarise(args, env: dict, prompts, runs: dict, errors: dict, rates: dict, state: dict) -> dict:
    """Everything measured so far, as JSON-ready data (outputs left out)."""
    num_output = len(prompts) * args.output_len
    counts = state.get("counts")
    flops = None
    if counts:
        flops = forward_flops([len(p) for p in prompts], [args.output_len] * len(prompts),
                              counts["num_decoder_linear_parameters"], counts["num_lm_head_parameters"],
                              counts["num_layers"], counts["attention_width"])
    matmul, copy = rates.get("matmul_flops_per_s"), rates.get("copy_bytes_per_s")
    results = {}
    for key, run in runs.items():
        tok_per_s = num_output / run["seconds"]
        row = {"seconds": run["seconds"], "output_tok_per_s": tok_per_s,
               **{k: run[k] for k in ("num_steps", "num_decode_steps", "decode_seconds", "mean_acceptance_length")
                  if k in run}}
        if counts and matmul:
            row["mfu"] = 2 * counts["num_parameters"] * tok_per_s / matmul
            row["all_token_flop_utilisation"] = flops["total"] / run["seconds"] / matmul
        if counts and copy and run.get("num_decode_steps") and run.get("decode_seconds"):
            steps_per_s = run["num_decode_steps"] / run["decode_seconds"]
            row["decode_steps_per_s"] = steps_per_s
            row["decode_step_ms"] = 1e3 / steps_per_s
            row["decode_weight_bandwidth_fraction"] = counts["decode_weight_bytes"] * steps_per_s / copy
        if counts and matmul and copy and run.get("step_shapes") is not None:
            roofline = roofline_seconds(
                run["step_shapes"], num_linear=counts["num_decoder_linear_parameters"],
                num_lm_head=counts["num_lm_head_parameters"], num_layers=counts["num_layers"],
                attention_width=counts["attention_width"], kv_bytes_per_token=counts["kv_bytes_per_token"],
                weight_bytes=counts["decode_weight_bytes"], matmul_flops_per_s=matmul, copy_bytes_per_s=copy)
            row["roofline_seconds"] = roofline["seconds"]
            row["roofline_fraction"] = roofline["seconds"] / run["seconds"]
            row["roofline_flop_bound_fraction"] = roofline["flop_bound_fraction"]
            row["serial_floor_seconds"] = roofline["serial_seconds"]
            row["serial_floor_fraction"] = roofline["serial_seconds"] / run["seconds"]
            if run.get("num_mixed_steps") is not None:
                # The run's time by where it went, each part against its own roofline.
                row["decode_roofline_fraction"] = (roofline["decode_seconds"] / run["decode_seconds"]
                                                   if run["decode_seconds"] else None)
                row["mixed_roofline_fraction"] = (roofline["mixed_seconds"] / run["mixed_seconds"]
                                                  if run["mixed_seconds"] else None)
                row["decode_serial_floor_fraction"] = (roofline["serial_decode_seconds"] / run["decode_seconds"]
                                                       if run["decode_seconds"] else None)
                row["mixed_serial_floor_fraction"] = (roofline["serial_mixed_seconds"] / run["mixed_seconds"]
                                                      if run["mixed_seconds"] else None)
                row["mixed_seconds"] = run["mixed_seconds"]
                row["outside_step_seconds"] = run["seconds"] - run["decode_seconds"] - run["mixed_seconds"]
                row["decode_mean_seqs"] = roofline["decode_mean_seqs"]
                row["decode_mean_kv_read"] = roofline["decode_mean_kv_read"]
        if run.get("num_mixed_steps"):
            row["num_mixed_steps"] = run["num_mixed_steps"]
            row["mixed_step_ms"] = run["mixed_seconds"] / run["num_mixed_steps"] * 1e3
        for name in ("num_cuda_graphs", "num_graph_replays", "triton_compiles_in_run", "dynamo_compiles_in_run",
                     "kernel_profile", "step_device_times", "itl_ms"):
            if name in run:
                row[name] = run[name]
        results[LABELS[key]] = row
    data = {"environment": env,
            "workload": {"model": args.model or f"{args.arch}-{args.size}", "num_requests": len(prompts),
                         "prompt_len": [args.min_prompt, args.max_prompt],
                         "num_prompt_tokens": sum(len(p) for p in prompts), "output_len": args.output_len,
                         "num_output_tokens": num_output, "static_batch": args.static_batch,
                         "dtype": args.dtype, "seed": args.seed, "kv_cache_gb": args.kv_cache_gb,
                         "max_num_seqs": args.max_num_seqs,
                         "max_num_batched_tokens": args.max_num_batched_tokens},
            "counts": counts, "results": results, "errors": errors,
            "matmul": {"size": args.matmul_size, "dtype": args.dtype,
                       "tflop_per_s": matmul / 1e12 if matmul else None},
            "copy_gb_per_s": copy / 1e9 if copy else None}
    if flops:
        data["forward_gflop"] = {"linear": flops["linear"] / 1e9, "attention": flops["attention"] / 1e9}
    ours = results.get(LABELS["pagedserve"])
    if ours:
        data["pagedserve_ratio"] = {name: ours["output_tok_per_s"] / row["output_tok_per_s"]
                                    for name, row in results.items() if name != LABELS["pagedserve"]}
    if "static" in runs:
        data["greedy_agreement_vs_static"] = {
            LABELS[key]: agreement(run["outputs"], runs["static"]["outputs"])
            for key, run in runs.items() if key != "static"}
    if "ngram" in runs and "pagedserve" in runs:
        # Greedy speculation is exact up to the numerics of a k + 1-token verification (in half
        # precision near-ties may fall the other way, as between batch shapes).
        data["speculation"] = {
            "mean_acceptance_length": runs["ngram"].get("mean_acceptance_length"),
            "speedup_over_pagedserve": runs["pagedserve"]["seconds"] / runs["ngram"]["seconds"],
            "agreement_with_pagedserve": agreement(runs["ngram"]["outputs"], runs["pagedserve"]["outputs"])}
    return data


def format_report(data: dict) -> str:
    env, w, counts = data["environment"], data["workload"], data["counts"] or {}
    where = env.get("gpu") or env.get("cpu")
    lines = [f"== bench_engine_gpu on {where} ({env['device']}): torch {env['torch']} (CUDA {env['cuda']}), "
             f"transformers {env['transformers']}, triton {env['triton']}, Python {env['python']}",
             f"model {w['model']} ({counts.get('num_parameters', 0) / 1e6:.1f}M params, {w['dtype']}); "
             f"{w['num_requests']} requests, prompts {w['prompt_len'][0]}-{w['prompt_len'][1]} "
             f"({w['num_prompt_tokens']} tokens), {w['output_len']} output tokens each (EOS ignored)",
             f"matmul {data['matmul']['size']}^3 {data['matmul']['dtype']}: "
             f"{(data['matmul']['tflop_per_s'] or 0):.1f} TFLOP/s; device copy "
             f"{(data['copy_gb_per_s'] or 0):.0f} GB/s (read + write)"]
    ratios = data.get("pagedserve_ratio", {})
    def percent(value, digits: int = 2) -> str:
        return "-" if value is None else f"{value:.{digits}%}"

    rows = [[name, f"{r['seconds']:.2f}", f"{r['output_tok_per_s']:.0f}", percent(r.get("mfu")),
             percent(r.get("all_token_flop_utilisation")),
             percent(r.get("decode_weight_bandwidth_fraction"), 1),
             "-" if r.get("decode_step_ms") is None else f"{r['decode_step_ms']:.2f}",
             percent(r.get("roofline_fraction"), 1),
             "-" if name not in ratios else f"{ratios[name]:.2f}x"]
            for name, r in data["results"].items()]
    lines.append(format_table(["contender", "seconds", "out tok/s", "MFU", "all-token FLOP util",
                               "decode weight B/W of copy", "decode step ms", "of roofline",
                               "pagedserve vs it"], rows))
    lines.append("  MFU: 2 x params x out tok/s / matmul rate. All-token: every forward FLOP (prompts "
                 "too) / seconds / matmul rate. Decode B/W: weight bytes x decode steps/s / copy rate "
                 "(static: steps over its whole time, prefills included; KV reads not counted). "
                 "Roofline: the sum over the run's own steps of max(FLOPs / matmul rate, bytes / copy "
                 "rate), weights and K/V read and written; 'of roofline' = roofline / measured time. "
                 "Serial floor: the same, with the linear layers (FLOPs or weight bytes) and the "
                 "attention (FLOPs or K/V bytes) bounded apart and added, as separate kernels run.")
    speculation = data.get("speculation")
    if speculation:
        acceptance, agree = speculation["mean_acceptance_length"], speculation["agreement_with_pagedserve"]
        lines.append(f"ngram speculation: {speculation['speedup_over_pagedserve']:.2f}x pagedserve without it, mean "
                     f"acceptance length {'-' if acceptance is None else f'{acceptance:.2f}'}; "
                     f"{agree['identical_requests']}/{agree['num_requests']} requests identical to it")
    for name, agree in data.get("greedy_agreement_vs_static", {}).items():
        lines.append(f"greedy agreement of {name} with static generate: {agree['identical_requests']}/"
                     f"{agree['num_requests']} requests identical, mean matching prefix "
                     f"{agree['mean_matching_prefix_len']:.1f} of {w['output_len']} tokens")
    for name, r in data["results"].items():
        if r.get("num_mixed_steps"):
            lines.append(f"steps with a prompt chunk in {name}: {r['num_mixed_steps']}, {r['mixed_step_ms']:.2f} ms "
                         f"each (mean; {w['num_prompt_tokens'] / r['num_mixed_steps']:.0f} prompt tokens per step)")
        if r.get("outside_step_seconds") is not None:
            lines.append(
                f"where {name}'s {r['seconds']:.2f} s went: {r['num_decode_steps']} decode steps "
                f"{r['decode_seconds']:.3f} s (each {r['decode_mean_seqs']:.0f} sequences reading "
                f"{r['decode_mean_kv_read']:.0f} cached tokens in all, mean; "
                f"{percent(r['decode_roofline_fraction'], 1)} of their roofline, "
                f"{percent(r['decode_serial_floor_fraction'], 1)} of their serial floor), "
                f"{r.get('num_mixed_steps', 0)} steps with a prompt chunk {r['mixed_seconds']:.3f} s "
                f"({percent(r['mixed_roofline_fraction'], 1)} and {percent(r['mixed_serial_floor_fraction'], 1)}), "
                f"outside the engine's steps {r['outside_step_seconds']:.3f} s (adding requests, output "
                f"processing, waits); the run's serial floor {r['serial_floor_seconds']:.3f} s "
                f"({percent(r['serial_floor_fraction'], 1)} of its time)")
        if r.get("step_device_times"):
            lines.append(f"the device in {name}'s steps (CUDA events around each): "
                         + format_step_device_times(r["step_device_times"]))
        if r.get("triton_compiles_in_run") is not None:
            lines.append(f"Triton kernel variants compiled inside the timed run of {name}: "
                         f"{r['triton_compiles_in_run']}")
        if r.get("dynamo_compiles_in_run") is not None:
            lines.append(f"frames torch.compile compiled inside the timed run of {name}: "
                         f"{r['dynamo_compiles_in_run']}")
    for name, error in data["errors"].items():
        lines.append(f"FAILED {name}: {error}")
    return "\n".join(lines)


# ---- the driver --------------------------------------------------------------------------------
def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint folder (default: the built --arch/--size model)")
    parser.add_argument("--arch", default="llama")
    parser.add_argument("--size", default="1b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--min-prompt", type=int, default=128)
    parser.add_argument("--max-prompt", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--static-batch", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kv-cache-gb", type=float, default=None,
                        help="pagedserve's KV pool (default: 16 on CUDA, the engine's default on CPU)")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=4096)
    parser.add_argument("--matmul-size", type=int, default=None, help="default: 8192 on CUDA, 512 on CPU")
    parser.add_argument("--contenders", default="pagedserve,uncompiled,eager,ngram,static,batch",
                        help="comma-separated, from: pagedserve, uncompiled (pagedserve with "
                             "torch_compile=False), unmerged (pagedserve with merge_projections=False), "
                             "eager (pagedserve with enforce_eager), ngram (pagedserve with n-gram "
                             "speculative decoding), static, batch")
    parser.add_argument("--spec-k", type=int, default=4, help="tokens the ngram contender proposes per step")
    parser.add_argument("--quick", action="store_true",
                        help="64 requests, prompts 128-512, 64 output tokens (a fallback run)")
    parser.add_argument("--profile", metavar="PATH",
                        help="profile pagedserve's timed run with cProfile; top functions by own time to PATH")
    parser.add_argument("--kernel-profile", action="store_true",
                        help="run pagedserve's timed run under torch.profiler: device time by kernel kind "
                             "against the wall time (in the log and the JSON; the profiler slows the host)")
    parser.add_argument("--token-times", action="store_true",
                        help="pagedserve's contenders: the engine's own inter-token latency (a timestamp per "
                             "sequence per step, as its output processor takes the step's tokens)")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON (after every contender too)")
    args = parser.parse_args(argv)
    if args.quick:
        args.num_requests, args.max_prompt = min(args.num_requests, 64), min(args.max_prompt, 512)
        args.output_len = min(args.output_len, 64)
    cuda = args.device.startswith("cuda")
    if args.kv_cache_gb is None and cuda:
        args.kv_cache_gb = 16.0
    if args.matmul_size is None:
        args.matmul_size = 8192 if cuda else 512
    keys = [k.strip() for k in args.contenders.split(",") if k.strip()]
    unknown = sorted(set(keys) - set(LABELS))
    if unknown:
        parser.error(f"unknown contender(s) {unknown}; choose from {sorted(LABELS)}")
    args.keys = keys
    return args


def make_prompts(args, vocab_size: int, max_positions: int) -> tuple[list[list[int]], list[list[int]]]:
    """The timed prompts and ``--static-batch`` warm-up prompts of the same lengths (another
    seed), clipped to fit the model."""
    max_prompt = min(args.max_prompt, max_positions - args.output_len - 1)
    if max_prompt < args.max_prompt:
        log(f"prompts clipped to {max_prompt} tokens: the model has {max_positions} positions")
        args.max_prompt, args.min_prompt = max_prompt, min(args.min_prompt, max_prompt)
    def sample(seed: int, count: int) -> list[list[int]]:
        rng = random.Random(seed)
        return [random_token_ids(rng, rng.randint(args.min_prompt, args.max_prompt), vocab_size)
                for _ in range(count)]

    return sample(args.seed, args.num_requests), sample(args.seed + 1, min(args.static_batch, args.num_requests))


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    from transformers import AutoConfig

    from pagedserve.bench.replay import resolve_model

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("bench_engine_gpu: no CUDA device here (use --device cpu for a smoke run).", flush=True)
        return 1
    env = environment(args.device)
    log(" | ".join(f"{k} {v}" for k, v in env.items()))
    log(f"checkpoint: {args.model or f'building/finding {args.arch}-{args.size}'}")
    path = resolve_model(args.model, args.arch, args.size)
    config = AutoConfig.from_pretrained(path)
    prompts, warm_prompts = make_prompts(args, config.vocab_size, getattr(config, "max_position_embeddings", 2048))
    log(f"checkpoint {path}; {len(prompts)} prompts, {sum(map(len, prompts))} tokens")

    rates: dict = {}
    dtype = getattr(torch, args.dtype)
    log(f"measuring a {args.matmul_size}^3 {args.dtype} matmul and a device copy")
    rates["matmul_flops_per_s"] = matmul_flops_per_s(args.matmul_size, args.matmul_size, args.matmul_size,
                                                     seconds=1.0, device=args.device, dtype=dtype)
    rates["copy_bytes_per_s"] = copy_bytes_per_s(1 << 30 if args.device.startswith("cuda") else 1 << 26,
                                                 seconds=1.0, device=args.device)
    log(f"matmul {rates['matmul_flops_per_s'] / 1e12:.2f} TFLOP/s, copy {rates['copy_bytes_per_s'] / 1e9:.0f} GB/s")

    runs: dict[str, dict] = {}
    errors: dict[str, str] = {}
    state: dict = {}

    def attempt(key: str, fn) -> None:
        try:
            runs[key] = fn()
            log(f"{LABELS[key]}: {runs[key]['seconds']:.2f} s, "
                f"{len(prompts) * args.output_len / runs[key]['seconds']:.0f} output tok/s")
        except Exception as error:  # noqa: BLE001 - reported, and the others still run
            traceback.print_exc()
            sys.stderr.flush()
            errors[LABELS[key]] = f"{type(error).__name__}: {error}"[:2000]
            log(f"{LABELS[key]} FAILED: {errors[LABELS[key]][:300]}")
        write_json(args.json, summarise(args, env, prompts, runs, errors, rates, state))

    if "pagedserve" in args.keys:
        attempt("pagedserve", lambda: bench_pagedserve(args, path, prompts, warm_prompts, state))
        free_device_memory(args.device)
    if "uncompiled" in args.keys:
        attempt("uncompiled", lambda: bench_pagedserve(args, path, prompts, warm_prompts, state, torch_compile=False))
    if "unmerged" in args.keys:
        attempt("unmerged", lambda: bench_pagedserve(args, path, prompts, warm_prompts, state,
                                                     merge_projections=False))
        free_device_memory(args.device)
    if "eager" in args.keys:
        attempt("eager", lambda: bench_pagedserve(args, path, prompts, warm_prompts, state, enforce_eager=True))
        free_device_memory(args.device)
    if "ngram" in args.keys:
        ngram = {"method": "ngram", "num_speculative_tokens": args.spec_k, "prompt_lookup_min": 1,
                 "prompt_lookup_max": 3}
        attempt("ngram", lambda: bench_pagedserve(args, path, prompts, warm_prompts, state, speculative_config=ngram))
        free_device_memory(args.device)
    hf_keys = [k for k in ("static", "batch") if k in args.keys]
    if hf_keys:
        try:
            log("transformers: loading the model")
            model = load_transformers_model(args, path)
            state.setdefault("counts", model_counts(model.get_decoder(), model.get_output_embeddings(),
                                                    model.config))
        except Exception as error:  # noqa: BLE001
            traceback.print_exc()
            for key in hf_keys:
                errors[LABELS[key]] = f"loading: {type(error).__name__}: {error}"[:2000]
            hf_keys, model = [], None
        if "static" in hf_keys:
            attempt("static", lambda: bench_static(args, model, prompts, warm_prompts))
        if "batch" in hf_keys:  # last: it may change the model's attention implementation
            attempt("batch", lambda: bench_generate_batch(args, model, prompts, warm_prompts))
        del model
        free_device_memory(args.device)

    data = summarise(args, env, prompts, runs, errors, rates, state)
    write_json(args.json, data)
    print("\n" + format_report(data), flush=True)
    return 0 if runs else 1


if __name__ == "__main__":
    sys.exit(main())
