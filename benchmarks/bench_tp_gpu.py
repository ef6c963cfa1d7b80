"""Tensor parallelism on a machine with several GPUs: the greedy check with NCCL, and the
all-reduce time per step.

1. Greedy: ``LLM(..., tensor_parallel_size=N)`` (NCCL all-reduces, one local process per
   GPU) on the tiny-tp llama in float32 must give transformers' greedy tokens (float32, on
   the CPU), for every N in ``--sizes`` that the GPUs allow.
2. Timing: decode steps of ``--batch`` sequences on the ``--model-size`` llama (default
   1b, bfloat16) at TP = 1 and each N, side by side: the mean decode step, and the time
   rank 0 spends in the forward pass's all-reduces per step (each timed with a device
   synchronisation before and after, so it includes waiting for the slowest rank; the
   synchronisations slow the step a little, which is why the step time is taken in a
   separate run without them).

With fewer than two GPUs it says so and exits 0. ``--device cpu`` runs the same on gloo
(a check of the script, not a measurement).

    python benchmarks/bench_tp_gpu.py --json tp.json
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch


def prompts(lengths, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 1000) for _ in range(n)] for n in lengths]


def greedy_check(path: str, size: int, device: str, max_tokens: int) -> dict:
    from transformers import AutoModelForCausalLM

    from pagedserve import LLM, SamplingParams

    batch = prompts((5, 17, 33, 48, 64, 90, 120), seed=1)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    expected = []
    with torch.inference_mode():
        for prompt in batch:
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_tokens)
            expected.append(out[0, len(prompt):].tolist())
    llm = LLM(path, tensor_parallel_size=size, device=device, dtype="float32", num_device_blocks=512,
              distributed_executor_backend="mp")
    try:
        outputs = llm.generate(batch, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
        got = [list(o.outputs[0].token_ids) for o in outputs]
        backend = llm.engine.runner.group.backend
    finally:
        llm.engine.runner.shutdown()
    num_same = sum(g == e for g, e in zip(got, expected))
    return {"size": size, "backend": backend, "identical": num_same, "of": len(batch)}


class TimedAllReduce:
    """Stands in for a process group: times each allreduce with device syncs around it."""

    def __init__(self, group, device: torch.device) -> None:
        self.group = group
        self.device = device
        self.seconds = 0.0
        self.count = 0

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def allreduce(self, tensors):
        self._sync()
        start = time.perf_counter()
        self.group.allreduce(tensors).wait()
        self._sync()
        self.seconds += time.perf_counter() - start
        self.count += 1
        return _Done()


class _Done:
    def wait(self) -> None:
        pass


def decode_timing(path: str, size: int, device: str, dtype: str, batch: int, output_len: int,
                  time_all_reduces: bool) -> dict:
    from pagedserve import LLM, SamplingParams

    llm = LLM(path, tensor_parallel_size=size, device=device, dtype=dtype, max_num_seqs=batch,
              distributed_executor_backend="mp" if size > 1 else None)
    runner = llm.engine.runner
    timer = None
    try:
        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        llm.generate(prompts([32] * batch, seed=2), params, use_tqdm=False)          # warm-up
        before = llm.stats()
        if time_all_reduces and size > 1:
            timer = TimedAllReduce(runner.group.model, runner.group.device)
            runner.group.model = timer
        llm.generate(prompts([32] * batch, seed=3), params, use_tqdm=False)
        after = llm.stats()
    finally:
        if size > 1:
            if timer is not None:
                runner.group.model = timer.group
            runner.shutdown()
    num_decode = after["num_decode_steps"] - before["num_decode_steps"]
    total_ms = (after["mean_decode_step_ms"] * after["num_decode_steps"]
                - before["mean_decode_step_ms"] * before["num_decode_steps"])
    decode_ms = total_ms / max(num_decode, 1)
    num_steps = after["num_steps"] - before["num_steps"]
    result = {"size": size, "decode_step_ms": decode_ms, "num_decode_steps": num_decode}
    if timer is not None:
        result.update(all_reduce_ms_per_step=1e3 * timer.seconds / max(num_steps, 1),
                      all_reduces_per_step=timer.count / max(num_steps, 1))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model-size", default="1b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--json")
    args = parser.parse_args()

    from pagedserve.devtools.model_factory import ensure_model

    available = torch.cuda.device_count() if args.device == "cuda" else max(args.sizes)
    sizes = [n for n in args.sizes if n <= available]
    if not sizes:
        print(f"skipped: tensor parallelism needs at least 2 GPUs, this machine has {available}")
        return
    tiny = str(ensure_model("llama", "tiny-tp"))
    report = {"greedy": [], "timing": []}
    for size in sizes:
        check = greedy_check(tiny, size, args.device, max_tokens=24)
        report["greedy"].append(check)
        print(f"greedy TP={size} ({check['backend']}): {check['identical']}/{check['of']} identical to transformers")
    path = str(ensure_model("llama", args.model_size))
    for size in [1, *sizes]:
        plain = decode_timing(path, size, args.device, args.dtype, args.batch, args.output_len, False)
        timed = decode_timing(path, size, args.device, args.dtype, args.batch, args.output_len, True) \
            if size > 1 else {}
        row = {**plain, **{k: v for k, v in timed.items() if k.startswith("all_reduce")}}
        report["timing"].append(row)
        print(f"TP={size}: decode step {row['decode_step_ms']:.2f} ms at batch {args.batch}"
              + (f"; all-reduces {row['all_reduce_ms_per_step']:.2f} ms per step "
                 f"({row['all_reduces_per_step']:.0f} per step)" if "all_reduce_ms_per_step" in row else ""))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"args": vars(args), **report}, handle, indent=2)
    if any(c["identical"] != c["of"] for c in report["greedy"]):
        raise SystemExit("greedy outputs differ from transformers")


if __name__ == "__main__":
    main()
