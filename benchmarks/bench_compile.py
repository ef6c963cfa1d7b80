"""Decode step time with the decode forward compiled (torch.compile) against without.

One process, one checkpoint, one engine per mode, their runs interleaved (so that a
loaded machine slows every mode alike): B sequences decode together (greedy, EOS
ignored) and the median step time over ``--steps`` decode steps is taken, per batch
size, best of ``--repeats`` rounds. Modes:

- ``eager``: every step eager (``enforce_eager``, ``torch_compile=False``);
- ``graphs``: CUDA graphs of the uncompiled forward (on the CPU: the same as eager);
- ``compiled``: the compiled forward (on CUDA inside CUDA graphs: the CUDA default).

Also reports each engine's load time, whose difference is the compile time.

    python benchmarks/bench_compile.py [--size tiny --device cpu --batches 4 64 256]
    python benchmarks/bench_compile.py --size 1b --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from pagedserve.bench.host_cost import HostCostProbe
from pagedserve.devtools.model_factory import ensure_model

MODES = {"eager": {"enforce_eager": True, "torch_compile": False},
         "graphs": {"torch_compile": False},
         "compiled": {"torch_compile": True}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="llama")
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--threads", type=int, default=1, help="torch threads on the CPU")
    parser.add_argument("--batches", type=int, nargs="+", default=[4, 64, 256])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", default=None, help="comma-separated; default: all on CUDA, eager,compiled on CPU")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    torch.set_num_threads(args.threads if args.device == "cpu" else os.cpu_count() or 1)
    modes = (args.modes or ("eager,graphs,compiled" if args.device == "cuda" else "eager,compiled")).split(",")
    model = str(ensure_model(args.arch, args.size))
    probes, load_seconds = {}, {}
    for mode in modes:
        start = time.perf_counter()
        probes[mode] = HostCostProbe(model, max(args.batches), device=args.device, dtype=args.dtype,
                                     cuda_graph_sizes=sorted(set(args.batches)), **MODES[mode])
        load_seconds[mode] = time.perf_counter() - start
        graphs = probes[mode].engine.runner.decode_graphs
        print(f"{mode}: loaded in {load_seconds[mode]:.1f} s (padded path: {graphs is not None}, "
              f"compiled: {getattr(graphs, 'is_compiled', False)}, "
              f"CUDA graphs: {len(graphs.graphs) if graphs is not None else 0})", flush=True)
    step_ms: dict[str, dict[int, float]] = {mode: {} for mode in modes}
    for batch in args.batches:
        for mode in modes:   # warm-up
            probes[mode].run(batch, 2, 16, "final")
        for _ in range(args.repeats):
            for mode in modes:
                ms = probes[mode].run(batch, args.steps, 16, "final")["step"] * 1e3
                step_ms[mode][batch] = min(step_ms[mode].get(batch, float("inf")), ms)
    for probe in probes.values():
        probe.engine.check_integrity()
    print(f"{args.arch}-{args.size} on {args.device}, decode step ms (ratio to eager):")
    print("  batch  " + "  ".join(f"{mode:>18}" for mode in modes))
    for batch in args.batches:
        cells = [f"{step_ms[m][batch]:8.2f} ({step_ms[m][batch] / step_ms['eager'][batch]:5.2f}x)"
                 if "eager" in modes else f"{step_ms[m][batch]:8.2f}" for m in modes]
        print(f"  {batch:5d}  " + "  ".join(f"{c:>18}" for c in cells))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": f"{args.arch}-{args.size}", "device": args.device, "modes": modes,
                       "load_seconds": load_seconds, "step_ms": step_ms, "steps": args.steps,
                       "repeats": args.repeats}, f, indent=2)


if __name__ == "__main__":
    main()
