"""The engine's host cost per decoding sequence per step.

B sequences decode together (prompts of ``prompt_len`` random tokens, greedy, EOS
ignored); each measured step is a decode step of all B. The figure is the median
step time at the large batch minus that at the small one, over the difference in
sequences: what one more decoding sequence costs a step.

The forward pass (the transformer stack, the LM head and the sampler's tensor
math) runs on the same CPU here, and its cost grows with the batch too; on a GPU
it is device work. So each step's time inside them is measured as well, and the
host cost is the rest: planning, the persistent batch's inputs, the finish checks,
and the output processing of the step. On CUDA, where the forward only queues work, two
CUDA events around each step also give the device's time per step and its idle time
before it (``pagedserve.bench.step_device_time``): whether a step is the device's or the
host's. Outputs are taken as ``LLM.generate``
takes them (``output_kind="final"``); ``stream`` adds what a server's output thread
pays per token (detokenizing and building each step's outputs), timed on its own;
``channel`` the same for a worker's output channel, whose requests' news are the
wire's rows, put into each channel's ``StreamBatch`` by the output processor and packed
once a step, as the engine core does; ``tokens`` a channel's
requests whose text the cluster's handle decodes (``detokenize`` off on the worker: what
a served request without stop strings is).
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Callable

from pagedserve.bench.step_device_time import StepDeviceTimes, record_step_device_times
from pagedserve.workers.engine.engine import EngineConfig, LLMEngine
from pagedserve.workers.outputs.stream_batch import StreamTarget
from pagedserve.workers.sample.sampling_params import SamplingParams


def _timed(function: Callable, counter: list[float]) -> Callable:
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            counter[0] += time.perf_counter() - start
    return wrapper


class HostCostProbe:
    """One engine whose forward and output processing are timed step by step (on CUDA the
    forward is asynchronous: only the step times, and the step events', mean anything there)."""

    def __init__(self, model: str, max_num_seqs: int, seed: int = 0, step_event: Callable | None = None,
                 **engine_options) -> None:
        self.engine = LLMEngine(EngineConfig.from_kwargs(
            model=model, max_num_seqs=max_num_seqs, max_num_batched_tokens=max(8192, 64 * max_num_seqs),
            num_device_blocks=64 * max_num_seqs, enable_prefix_caching=False, **engine_options))
        self.device_seconds = [0.0]
        self.output_seconds = [0.0]
        runner, sampler = self.engine.runner, self.engine.sampler
        graphs = runner.decode_graphs
        if graphs is not None and graphs.is_compiled:   # a wrapped decoder would break its graph
            graphs.decode_stack = _timed(graphs.decode_stack, self.device_seconds)
        else:
            runner.decoder = _timed(runner.decoder, self.device_seconds)
        runner.compute_logits = _timed(runner.compute_logits, self.device_seconds)
        sampler.greedy = _timed(sampler.greedy, self.device_seconds)
        sampler.sample_batch = _timed(sampler.sample_batch, self.device_seconds)
        processor = self.engine.output_processor
        processor.process = _timed(processor.process, self.output_seconds)
        # The events around each step: CUDA's by default (none elsewhere); ``step_event`` makes others.
        self.step_times = record_step_device_times(self.engine, step_event)
        self._rng = random.Random(seed)
        self._num_requests = 0

    def _step(self) -> None:
        """A step, and its channels' batches packed (what the engine core sends), timed as output."""
        self.engine.step()
        start = time.perf_counter()
        for batch in self.engine.output_processor.take_batches().values():
            batch.pack()
        self.output_seconds[0] += time.perf_counter() - start

    def run(self, batch: int, num_steps: int, prompt_len: int, output_kind: str) -> dict:
        """Medians over ``num_steps`` decode steps of ``batch`` sequences (seconds).
        ``output_kind``: "final", "stream", "channel" (an output channel's rows, packed once a
        step as the engine core packs them) or "tokens" (a channel's rows without text)."""
        engine, vocab = self.engine, self.engine.runner.vocab_size
        is_channel = output_kind in ("channel", "tokens")
        params = SamplingParams(temperature=0.0, max_tokens=num_steps + 2, ignore_eos=True,
                                detokenize=output_kind != "tokens")
        for _ in range(batch):
            self._num_requests += 1
            engine.add_request(f"probe-{self._num_requests}",
                               [self._rng.randrange(8, vocab) for _ in range(prompt_len)], params,
                               output_kind="stream" if is_channel else output_kind,
                               stream_target=StreamTarget("probe", self._num_requests) if is_channel else None)
        self._step()   # every prompt is prefilled in one step
        first_event = len(self.step_times.events) if self.step_times is not None else 0
        step, device, output = [], [], []
        for _ in range(num_steps):
            self.device_seconds[0] = self.output_seconds[0] = 0.0
            start = time.perf_counter()
            self._step()
            step.append(time.perf_counter() - start)
            device.append(self.device_seconds[0])
            output.append(self.output_seconds[0])
        while engine.has_unfinished_requests():
            self._step()
        result = {"step": statistics.median(step), "device": statistics.median(device),
                  "output": statistics.median(output)}
        if self.step_times is not None:
            if engine.runner.device.type == "cuda":
                import torch

                torch.cuda.synchronize(engine.runner.device)
            measured = self.step_times.events[first_event:first_event + num_steps]
            spans, gaps = StepDeviceTimes(events=measured).spans_and_gaps()
            result.update(device_busy=statistics.median(spans), device_idle=statistics.median(gaps[1:]))
        return result


def measure_host_cost(model: str, small: int = 4, large: int = 256, num_steps: int = 48,
                      prompt_len: int = 16, repeats: int = 3, output_kind: str = "final",
                      probe: HostCostProbe | None = None, **engine_options) -> dict:
    """Per-sequence step, device and host cost between ``small`` and ``large`` batches,
    the two measured alternately ``repeats`` times (medians of the repeats). ``probe``: an
    engine built for ``large`` sequences, to measure several output kinds on one engine
    (on CUDA its start-up, graphs and compilation, is the slow part)."""
    probe = probe or HostCostProbe(model, large, **engine_options)
    probe.run(small, 4, prompt_len, output_kind)   # warm-up
    probe.run(large, 4, prompt_len, output_kind)
    runs: dict[int, list[dict]] = {small: [], large: []}
    for _ in range(repeats):
        for batch in (small, large):
            runs[batch].append(probe.run(batch, num_steps, prompt_len, output_kind))
    median = {batch: {key: statistics.median(r[key] for r in results) for key in results[0]}
              for batch, results in runs.items()}
    num_more = large - small

    def per_seq_us(key: str) -> float:
        return (median[large][key] - median[small][key]) / num_more * 1e6

    host = {batch: m["step"] - m["device"] for batch, m in median.items()}
    device_times = {}
    if "device_busy" in median[small]:
        device_times = {"device_busy_ms": {str(b): m["device_busy"] * 1e3 for b, m in median.items()},
                        "device_idle_ms": {str(b): m["device_idle"] * 1e3 for b, m in median.items()}}
    probe.engine.check_integrity()
    return {
        "device": str(probe.engine.runner.device), "dtype": str(probe.engine.runner.dtype),
        "decode_graphs": probe.engine.runner.decode_graphs is not None,
        "torch_compile": getattr(probe.engine.runner.decode_graphs, "is_compiled", False),
        "output_kind": output_kind, "batches": [small, large], "num_steps": num_steps,
        "prompt_len": prompt_len, "repeats": repeats,
        "step_ms": {str(b): m["step"] * 1e3 for b, m in median.items()},
        "host_ms": {str(b): h * 1e3 for b, h in host.items()},
        "step_per_seq_us": per_seq_us("step"),
        "device_per_seq_us": per_seq_us("device"),
        "output_processing_per_seq_us": per_seq_us("output"),
        "host_per_seq_us": (host[large] - host[small]) / num_more * 1e6,
        **device_times,
    }


def format_host_cost(result: dict) -> str:
    small, large = result["batches"]
    return (f"host cost per decoding sequence per step ({result['output_kind']} outputs): "
            f"{result['host_per_seq_us']:.2f} us (step {result['step_ms'][str(small)]:.2f} ms at "
            f"{small} sequences, {result['step_ms'][str(large)]:.2f} ms at {large}: "
            f"{result['step_per_seq_us']:.2f} us per sequence, of which the forward and sampling "
            f"{result['device_per_seq_us']:.2f} us and output processing "
            f"{result['output_processing_per_seq_us']:.2f} us; host {result['host_ms'][str(small)]:.2f} ms "
            f"at {small})" + _device_times(result))


def _device_times(result: dict) -> str:
    """The device's time per step and its idle time before each, where measured (CUDA)."""
    if "device_busy_ms" not in result:
        return ""
    return "; the device per step: " + ", ".join(
        f"{result['device_busy_ms'][b]:.2f} ms busy and {result['device_idle_ms'][b]:.2f} ms idle at {b}"
        for b in result["device_busy_ms"])


def main(argv=None) -> None:
    import argparse
    import json
    import os

    import torch

    from pagedserve.devtools.model_factory import ensure_model

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="llama")
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: one per core)")
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--torch-compile", action="store_true", default=None,
                        help="compile the decode forward (on CUDA the default where graphs are)")
    parser.add_argument("--output-kinds", default="final,stream",
                        help="comma-separated: final (LLM.generate), stream (AsyncLLMEngine.generate), "
                             "channel (a worker's output channel), tokens (a channel whose text the "
                             "handle decodes)")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    model = str(ensure_model(args.arch, args.size))
    probe = HostCostProbe(model, 256, device=args.device, dtype=args.dtype, enforce_eager=args.enforce_eager,
                          torch_compile=args.torch_compile)
    results = []
    for kind in args.output_kinds.split(","):
        result = measure_host_cost(model, num_steps=args.steps, repeats=args.repeats, output_kind=kind,
                                   probe=probe)
        result.update(model=f"{args.arch}-{args.size}", threads=torch.get_num_threads())
        results.append(result)
        print(format_host_cost(result), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
