"""Kernels launched per decode step and per decoder layer, from the torch profiler.

B sequences decode (greedy, EOS ignored); the profiler records ``--steps`` decode steps
of the engine. A decoder layer's share is what runs inside its forward (marked with a
profiler range by forward hooks). On CUDA the count is device kernels (with CUDA graphs
replayed, a replay counts as one launch, and so does each kernel outside it); on the CPU
it is the aten ops called from Python that compute (views and shape bookkeeping left out),
each of which would be about one kernel launch on a device.

With ``--torch-compile`` the decoder stack runs compiled (layer hooks would break its
graph, so none is set): a layer's share is then the compiled region's kernels over the
number of layers (the embedding and the final norm, one or two kernels, included). On the
CPU a fused kernel inductor generates (``cpp_fused_*``, profiled by name) counts as one.

    python benchmarks/bench_launches.py [--size tiny --device cpu --batch 4 --steps 4]
    python benchmarks/bench_launches.py --size 1b --device cuda --dtype bfloat16 [--enforce-eager]
    python benchmarks/bench_launches.py --torch-compile [--graph-sizes 4]
"""

from __future__ import annotations

import argparse
import json
import random
from collections import Counter

from torch.profiler import ProfilerActivity, profile, record_function

from pagedserve import LLM, SamplingParams
from pagedserve.devtools.model_factory import ensure_model

LAYER_RANGE = "pagedserve.decoder_layer"
# Ops that only make views or read metadata: no kernel.
NO_KERNEL = frozenset(f"aten::{name}" for name in (
    "view", "_unsafe_view", "as_strided", "reshape", "_reshape_alias", "expand", "t", "transpose",
    "permute", "slice", "select", "unsqueeze", "squeeze", "detach", "alias", "resolve_conj", "resolve_neg",
    "empty", "empty_strided", "result_type", "lift_fresh", "unbind", "split", "chunk", "contiguous",
    "_local_scalar_dense", "item", "size", "stride", "is_nonzero", "to", "_to_copy"))


def mark_layers(decoder) -> None:
    """Wrap every decoder layer's forward in a profiler range."""
    for layer in decoder.layers:
        ranges = []
        layer.register_forward_pre_hook(lambda *_: ranges.append(record_function(LAYER_RANGE).__enter__()))
        layer.register_forward_hook(lambda *_: ranges.pop().__exit__(None, None, None))


# The profiler range around a compiled graph's call ("## Call CompiledFxGraph <hash>").
COMPILED_RANGE = "CompiledFxGraph"


def within(event, is_range) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if is_range(parent.name):
            return True
        parent = parent.cpu_parent
    return False


def in_layer(event) -> bool:
    return within(event, lambda name: name == LAYER_RANGE)


def in_compiled_region(event) -> bool:
    return within(event, lambda name: COMPILED_RANGE in name)


def cpu_launches(event) -> int:
    """1 for a compute op called from Python or from a compiled graph, or a fused kernel."""
    if "cpp_fused" in event.name:
        return 1
    parent = event.cpu_parent
    is_top = parent is None or not parent.name.startswith("aten::")
    return 1 if event.name.startswith("aten::") and is_top and event.name not in NO_KERNEL else 0


def kernel_name(name: str) -> str:
    """An inductor kernel's name without its graph prefix and running number."""
    if "cpp_fused" not in name:
        return name
    return "cpp_fused" + name.split("cpp_fused", 1)[1].rstrip("_0123456789")


def count_launches(events, on_cuda: bool, compiled: bool = False) -> tuple[int, int, Counter]:
    """(launches in the step, launches inside decoder layers (``compiled``: inside the
    compiled region), those ops or kernels by name)."""
    inside_of = in_compiled_region if compiled else in_layer
    total = inside = 0
    names: Counter = Counter()
    for event in events:
        if event.name == LAYER_RANGE:
            continue
        if on_cuda:
            if event.name in ("cudaGraphLaunch", "cuGraphLaunch"):
                total += 1
                continue
            launches = len(event.kernels)
        else:
            launches = cpu_launches(event)
        if not launches:
            continue
        total += launches
        if inside_of(event):
            inside += launches
            names[kernel_name(event.name)] += launches
    return total, inside, names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="llama")
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--torch-compile", action="store_true", default=None,
                        help="compile the decode forward (on CUDA the default where graphs are)")
    parser.add_argument("--graph-sizes", type=int, nargs="+", default=None,
                        help="the padded decode batch sizes (cuda_graph_sizes)")
    parser.add_argument("--merge-projections", action=argparse.BooleanOptionalAction, default=None,
                        help="q/k/v and gate/up as one matmul each (default: on with CUDA, off on the CPU)")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    if args.torch_compile and args.device == "cpu":
        import torch._inductor.config

        torch._inductor.config.cpp.enable_kernel_profile = True   # each fused kernel named
    llm = LLM(str(ensure_model(args.arch, args.size)), device=args.device, dtype=args.dtype,
              enforce_eager=args.enforce_eager, max_num_seqs=max(args.batch, 1),
              torch_compile=args.torch_compile, cuda_graph_sizes=args.graph_sizes,
              merge_projections=args.merge_projections)
    engine, runner = llm.engine, llm.engine.runner
    compiled = runner.decode_graphs is not None and runner.decode_graphs.is_compiled
    if not compiled:
        mark_layers(runner.decoder)
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=args.steps + 8, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(f"r{i}", [rng.randrange(8, runner.vocab_size) for _ in range(16)], params,
                           output_kind="final")
    for _ in range(3):   # the prefill, then decode steps: every kernel compiled and warm
        engine.step()
    on_cuda = runner.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(args.steps):
            engine.step()
        if on_cuda:
            torch.cuda.synchronize()
    while engine.has_unfinished_requests():
        engine.step()
    total, inside, names = count_launches(prof.events(), on_cuda, compiled)
    num_layers = len(runner.decoder.layers)
    result = {"model": f"{args.arch}-{args.size}", "device": str(runner.device), "batch": args.batch,
              "decode_graphs": runner.decode_graphs is not None and bool(runner.decode_graphs.graphs),
              "torch_compile": compiled,
              "unit": "CUDA kernels" if on_cuda else "compute ops",
              "per_step": total / args.steps, "per_layer": inside / args.steps / num_layers,
              "outside_layers_per_step": (total - inside) / args.steps, "num_layers": num_layers,
              "per_layer_by_op": {name: count / args.steps / num_layers for name, count in names.most_common()}}
    print(f"{result['model']} on {result['device']}, {args.batch} sequences, graphs: {result['decode_graphs']}, "
          f"compiled: {compiled}: "
          f"{result['per_step']:.0f} {result['unit']} per decode step, {result['per_layer']:.1f} per layer "
          f"({num_layers} layers), {result['outside_layers_per_step']:.0f} outside the layers")
    for name, count in result["per_layer_by_op"].items():
        print(f"  {count:5.1f}  {name}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
