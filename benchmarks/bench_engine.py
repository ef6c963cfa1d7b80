"""Offline throughput: pagedserve's ``LLM.generate`` against transformers, side by side.

One run, one checkpoint, one set of requests (random token ids from a fixed seed,
prompts of ``--min-prompt``..``--max-prompt`` tokens, ``--output-len`` output tokens
each, EOS ignored), greedy decoding throughout:

- transformers ``generate`` in static batches of ``--static-batch`` (left padding);
- transformers ``generate_batch`` (its own continuous batching, transformers 5.x);
- pagedserve ``LLM.generate``;
- pagedserve ``LLM.generate`` with n-gram speculative decoding (``--spec-k`` proposed tokens,
  prompt lookup of 1 to 3 tokens; its outputs must equal pagedserve's without it; skip it
  with ``--skip-speculative``). Random models accept what their loops repeat: the report
  gives the mean acceptance length it got.

Each contender runs in a fresh process with the same torch thread count and the same
host allocator setting, after a short warm-up, so that none inherits another's threads,
caches or heap. Reports output tokens/s for each, pagedserve's ratio to each baseline,
and MFU: ``2 x parameters x output tokens/s`` over the FLOP rate of a float32
[256x512]x[512x1408] matmul measured in the same run (the best of the contenders'
processes). That numerator leaves out the prompt tokens' FLOPs, so the report also gives
the FLOP ceiling: the run's forward FLOPs counted from its actual token counts (linear
layers: 2 x weights per token through the decoder, the LM head only where a token is
sampled; causal attention: 4 x context x query heads x head_dim per layer), the output
tok/s and speedup over static ``generate`` if all of them ran at the matmul rate, and
the fraction of that ceiling pagedserve reached. Also checks that pagedserve's greedy
outputs equal static ``generate``'s, and measures the engine's host cost per decoding
sequence per step (``pagedserve.bench.host_cost``, tiny model, in its own process; skip
it with ``--skip-host-cost``).

    python benchmarks/bench_engine.py [--quick] [--json out.json] [--skip-transformers]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time

from pagedserve.bench.host_cost import format_host_cost
from pagedserve.bench.offline import (agreement, decoder_linear_parameters, forward_flops,
                                              matmul_flops_per_s, run_generate_batch_fixed_length,
                                              run_static_generate)

CONTENDERS = {
    # key: (label, OpenMP wait policy under --omp-wait-policy auto)
    "static": ("transformers generate (static)", "active"),
    # generate_batch runs the model on a background thread; with spinning waits the idle
    # OpenMP threads of the calling thread would take a core from it.
    "batch": ("transformers generate_batch", "passive"),
    "pagedserve": ("pagedserve LLM.generate", "active"),
    "pagedserve_ngram": ("pagedserve LLM.generate, ngram spec", "active"),
}


# ---- the contenders (each runs in its own process) -----------------------------------
def run_pagedserve(llm, prompts, output_len: int):
    """``LLM.generate`` with greedy params; returns (outputs, seconds)."""
    from pagedserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    results = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return [list(result.outputs[0].token_ids) for result in results], seconds


def run_contender(key: str, spec: dict) -> dict:
    """Warm up, then time one contender on ``spec``'s requests, in this process."""
    import torch

    from pagedserve.workers.model.host_memory import retain_freed_host_memory

    torch.set_num_threads(spec["threads"])
    retain_freed_host_memory()  # every contender alike (pagedserve's CPU runner sets it anyway)
    prompts, warm, output_len = spec["prompts"], spec["warm_prompt"], spec["output_len"]
    result: dict = {}
    if key.startswith("pagedserve"):
        from pagedserve import LLM

        speculative = ({"method": "ngram", "num_speculative_tokens": spec["spec_k"], "prompt_lookup_min": 1,
                        "prompt_lookup_max": 3} if key == "pagedserve_ngram" else None)
        llm = LLM(spec["model"], max_num_seqs=spec["max_num_seqs"],
                  max_num_batched_tokens=spec["max_num_batched_tokens"], speculative_config=speculative)
        run_pagedserve(llm, [warm, warm[:8]], 4)
        before = llm.engine.stats()
        outputs, seconds = run_pagedserve(llm, prompts, output_len)
        runner = llm.engine.runner
        result.update(num_steps=llm.engine.num_steps, num_parameters=runner.num_parameters,
                      num_lm_head_parameters=runner.lm_head.weight.numel(),
                      num_decoder_linear_parameters=decoder_linear_parameters(runner))
        if speculative is not None:
            after = llm.engine.stats()
            drafts = after["spec_decode_num_drafts"] - before["spec_decode_num_drafts"]
            accepted = after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
            # vLLM's mean acceptance length: tokens a verification step yields, the bonus one included.
            result["mean_acceptance_length"] = 1 + accepted / drafts if drafts else None
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32).eval()
        if key == "static":
            pad_id = model.generation_config.pad_token_id or 0
            run_static_generate(model, [warm], 4, 1, pad_id)
            outputs, seconds = run_static_generate(model, prompts, output_len, spec["static_batch"], pad_id)
        else:
            run_generate_batch_fixed_length(model, [warm], 4, spec["max_num_batched_tokens"])
            outputs, seconds = run_generate_batch_fixed_length(model, prompts, output_len,
                                                               spec["max_num_batched_tokens"])
    result.update(seconds=seconds, outputs=outputs, matmul_flops_per_s=matmul_flops_per_s())
    return result


# ---- the driver ---------------------------------------------------------------------------
def flop_ceiling(flops: dict, flops_rate: float, num_output: int, results: dict) -> dict:
    """Best output tok/s if ``flops`` ran at ``flops_rate``, against the measured tok/s."""
    ceiling = {}
    for name, num_flops in (("all_forward_flops", flops["total"]), ("linear_flops_only", flops["linear"])):
        best = num_output / (num_flops / flops_rate)
        ceiling[name] = {"gflop": num_flops / 1e9, "seconds": num_flops / flops_rate,
                         "output_tok_per_s": best,
                         "fraction_reached": {label: r["output_tok_per_s"] / best
                                              for label, r in results.items()}}
        static = results.get(CONTENDERS["static"][0])
        if static is not None:
            ceiling[name]["speedup_vs_static_generate"] = best / static["output_tok_per_s"]
    return ceiling


def make_prompts(num_requests: int, min_len: int, max_len: int, vocab_size: int,
                 first_id: int, seed: int) -> list[list[int]]:
    """Random token ids in ``[first_id, vocab_size)`` (no special tokens), fixed seed."""
    rng = random.Random(seed)
    return [[rng.randrange(first_id, vocab_size) for _ in range(rng.randint(min_len, max_len))]
            for _ in range(num_requests)]


def spawn_contender(key: str, spec_path: str, workdir: str, policy: str) -> dict:
    """Run ``key`` in a fresh interpreter with the given OpenMP wait policy."""
    out_path = os.path.join(workdir, f"{key}.json")
    env = dict(os.environ)
    if policy != "env":
        env["OMP_WAIT_POLICY"] = policy.upper()
    command = [sys.executable, os.path.abspath(__file__), "--run-contender", key,
               "--spec", spec_path, "--out", out_path]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{key} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    with open(out_path) as f:
        result = json.load(f)
    result["omp_wait_policy"] = env.get("OMP_WAIT_POLICY")
    return result


def format_flop_ceiling(summary: dict, flops: dict, num_prompt_tokens: int, num_output: int,
                        num_requests: int, num_linear: int, num_lm_head: int) -> str:
    """The FLOP ceiling lines of the report."""
    every, linear_only = (summary["flop_ceiling"][key] for key in ("all_forward_flops", "linear_flops_only"))
    ours = CONTENDERS["pagedserve"][0]

    def speedup(ceiling):
        value = ceiling.get("speedup_vs_static_generate")
        return "" if value is None else f" = {value:.2f}x static generate"

    return (
        f"FLOP ceiling: {flops['linear'] / 1e9:,.0f} GFLOP in linear layers ({num_prompt_tokens} prompt "
        f"tokens x {2 * num_linear / 1e6:.1f} MFLOP, {num_output - num_requests} fed-back output tokens "
        f"x {2 * num_linear / 1e6:.1f}, {num_output} LM head rows x {2 * num_lm_head / 1e6:.1f}) + "
        f"{flops['attention'] / 1e9:,.0f} GFLOP in attention = {every['gflop']:,.0f} GFLOP: "
        f"{every['seconds']:.1f} s at the matmul rate, at most {every['output_tok_per_s']:.0f} output tok/s"
        f"{speedup(every)}, MFU {summary['ceiling_mfu']:.1%}; pagedserve reached "
        f"{every['fraction_reached'][ours]:.1%} of it\n"
        f"  (linear layers only: {linear_only['seconds']:.1f} s, {linear_only['output_tok_per_s']:.0f} tok/s"
        f"{speedup(linear_only)}; pagedserve reached {linear_only['fraction_reached'][ours]:.1%})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="llama")
    parser.add_argument("--size", default="small")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--min-prompt", type=int, default=32)
    parser.add_argument("--max-prompt", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--static-batch", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads for every contender (default: one per CPU core)")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--quick", action="store_true", help="16 requests of 32 output tokens (smoke run)")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--skip-host-cost", action="store_true")
    parser.add_argument("--skip-speculative", action="store_true", help="no n-gram speculative contender")
    parser.add_argument("--spec-k", type=int, default=4, help="tokens the n-gram contender proposes per step")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument(
        "--omp-wait-policy", choices=("auto", "active", "passive", "env"), default="auto",
        help="OpenMP wait policy of the contenders' processes. 'active' (idle threads spin) is "
             "fastest on an otherwise idle machine; 'passive' on a machine shared with other busy "
             "processes, where a spinning thread stalls every parallel region; 'auto' (default) is "
             "active, except passive for generate_batch; 'env' keeps the environment's setting")
    parser.add_argument("--run-contender", choices=tuple(CONTENDERS), help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.run_contender:
        with open(args.spec) as f:
            spec = json.load(f)
        result = run_contender(args.run_contender, spec)
        with open(args.out, "w") as f:
            json.dump(result, f)
        return

    if args.quick:
        args.num_requests, args.output_len = min(args.num_requests, 16), min(args.output_len, 32)
    from pagedserve.devtools.model_factory import SPECIAL_TOKENS, ensure_model

    path = str(ensure_model(args.arch, args.size))
    with open(os.path.join(path, "config.json")) as f:
        vocab_size = json.load(f)["vocab_size"]
    threads = args.threads or os.cpu_count() or 1
    prompts = make_prompts(args.num_requests, args.min_prompt, args.max_prompt, vocab_size,
                           len(SPECIAL_TOKENS), args.seed)
    spec = {"model": path, "prompts": prompts, "output_len": args.output_len, "threads": threads,
            "warm_prompt": make_prompts(1, 16, 16, vocab_size, len(SPECIAL_TOKENS), args.seed + 1)[0],
            "static_batch": args.static_batch, "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens, "spec_k": args.spec_k}
    keys = ["pagedserve"] if args.skip_transformers else ["static", "batch", "pagedserve"]
    if not args.skip_speculative:
        keys.append("pagedserve_ngram")
    runs: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="bench_engine.") as workdir:
        spec_path = os.path.join(workdir, "spec.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        for key in keys:
            policy = CONTENDERS[key][1] if args.omp_wait_policy == "auto" else args.omp_wait_policy
            runs[key] = spawn_contender(key, spec_path, workdir, policy)

    ours_run = runs["pagedserve"]
    num_params = ours_run["num_parameters"]
    lm_head = ours_run["num_lm_head_parameters"]
    num_output = args.num_requests * args.output_len
    num_prompt_tokens = sum(len(p) for p in prompts)
    flops_rate = max(run["matmul_flops_per_s"] for run in runs.values())
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    flops = forward_flops([len(p) for p in prompts], [args.output_len] * len(prompts),
                          ours_run["num_decoder_linear_parameters"], lm_head,
                          config["num_hidden_layers"], config["num_attention_heads"] * head_dim)

    results = {}
    for key, run in runs.items():
        tok_per_s = num_output / run["seconds"]
        results[CONTENDERS[key][0]] = {
            "seconds": run["seconds"], "output_tok_per_s": tok_per_s,
            "mfu": 2 * num_params * tok_per_s / flops_rate,
            "omp_wait_policy": run["omp_wait_policy"],
            "matmul_gflop_per_s_in_process": run["matmul_flops_per_s"] / 1e9,
            **({"num_steps": run["num_steps"]} if "num_steps" in run else {}),
            **({"mean_acceptance_length": run["mean_acceptance_length"]} if "mean_acceptance_length" in run else {}),
        }
    ours = results[CONTENDERS["pagedserve"][0]]["output_tok_per_s"]
    summary = {
        "workload": {"model": f"{args.arch}-{args.size}", "num_parameters": num_params,
                     "num_requests": args.num_requests, "prompt_lens": [args.min_prompt, args.max_prompt],
                     "num_prompt_tokens": num_prompt_tokens, "output_len": args.output_len,
                     "threads": threads, "seed": args.seed,
                     "machine": platform.processor() or platform.machine(), "cpu_count": os.cpu_count()},
        "matmul_gflop_per_s": flops_rate / 1e9,
        "forward_gflop": {"linear": flops["linear"] / 1e9, "attention": flops["attention"] / 1e9,
                          "num_decoder_tokens": flops["num_decoder_tokens"]},
        "flop_ceiling": flop_ceiling(flops, flops_rate, num_output, results),
        "results": results,
    }
    ceiling = summary["flop_ceiling"]["all_forward_flops"]
    summary["ceiling_mfu"] = 2 * num_params * ceiling["output_tok_per_s"] / flops_rate
    if not args.skip_transformers:
        summary["ratio_vs_static_generate"] = ours / results[CONTENDERS["static"][0]]["output_tok_per_s"]
        summary["ratio_vs_generate_batch"] = ours / results[CONTENDERS["batch"][0]]["output_tok_per_s"]
        summary["greedy_agreement_vs_static"] = agreement(ours_run["outputs"], runs["static"]["outputs"])
        summary["greedy_agreement_batch_vs_static"] = agreement(runs["batch"]["outputs"],
                                                                runs["static"]["outputs"])
    if "pagedserve_ngram" in runs:
        summary["speculative_outputs_equal"] = runs["pagedserve_ngram"]["outputs"] == ours_run["outputs"]
        summary["speculative_speedup"] = results[CONTENDERS["pagedserve_ngram"][0]]["output_tok_per_s"] / ours

    print(f"\n{args.arch}-{args.size}: {num_params / 1e6:.1f}M params, {args.num_requests} requests, "
          f"prompts {args.min_prompt}-{args.max_prompt} ({num_prompt_tokens} tokens), "
          f"{args.output_len} output tokens each, {threads} threads")
    print(f"matmul [256x512]x[512x1408] float32: {flops_rate / 1e9:.1f} GFLOP/s")
    print(format_flop_ceiling(summary, flops, num_prompt_tokens, num_output, args.num_requests,
                              ours_run["num_decoder_linear_parameters"], lm_head) + "\n")
    print(f"{'contender':34s} {'seconds':>8s} {'out tok/s':>10s} {'MFU':>6s} {'pagedserve x':>13s}  OMP wait")
    for name, result in results.items():
        print(f"{name:34s} {result['seconds']:8.2f} {result['output_tok_per_s']:10.1f} "
              f"{result['mfu']:6.1%} {ours / result['output_tok_per_s']:13.2f}  {result['omp_wait_policy']}")
    if "pagedserve_ngram" in runs:
        acceptance = results[CONTENDERS["pagedserve_ngram"][0]]["mean_acceptance_length"]
        print(f"\nngram speculation (k = {args.spec_k}): {summary['speculative_speedup']:.2f}x pagedserve "
              f"without it, mean acceptance length {'n/a' if acceptance is None else f'{acceptance:.2f}'}; "
              f"outputs equal: {summary['speculative_outputs_equal']}")
    if not args.skip_transformers:
        print()
        for key, label in (("greedy_agreement_vs_static", "pagedserve"),
                           ("greedy_agreement_batch_vs_static", "generate_batch")):
            agree = summary[key]
            print(f"{label} vs static generate, greedy: {agree['identical_requests']}/{agree['num_requests']} "
                  f"requests identical, {agree['matching_prefix_token_fraction']:.1%} of tokens "
                  "before the first divergence")
    if not args.skip_host_cost:
        summary["host_cost"] = measure_host_cost(threads, args.omp_wait_policy)
        print()
        for result in summary["host_cost"]:
            print(format_host_cost(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)


def measure_host_cost(threads: int, policy: str) -> list[dict]:
    """``pagedserve.bench.host_cost`` in a fresh process (tiny model, greedy, EOS ignored)."""
    with tempfile.TemporaryDirectory(prefix="bench_engine.host.") as workdir:
        out_path = os.path.join(workdir, "host_cost.json")
        env = dict(os.environ)
        if policy not in ("env", "auto"):
            env["OMP_WAIT_POLICY"] = policy.upper()
        command = [sys.executable, "-m", "pagedserve.bench.host_cost", "--threads", str(threads),
                   "--json", out_path]
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"host cost failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
        with open(out_path) as f:
            return json.load(f)


if __name__ == "__main__":
    main()
