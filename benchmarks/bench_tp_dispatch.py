"""What sending each step's plan to the ranks of a tensor-parallel group costs, per step.

The issue's measure: the step time of a TP group minus that of its rank 0
alone, with the forward stubbed. Every configuration runs the same decode
workload (``--batch`` sequences of context about ``--context`` tokens, block
size 16, so that a step carries a table update for the sequences that cross a
block boundary) through ``ModelRunner.execute`` with the decoder and the LM
head replaced by stubs that return zeros: what is left is the step's host
work (flattening the batch, the attention plan) and, for a group, the
dispatch. Configurations, run one after the other in this process (rank 0)
and in spawned rank processes:

- ``single``: a plain ``ModelRunner`` (rank 0 alone);
- ``tp-pipe``: a ``TensorParallelRunner`` of ``--tp`` ranks on this node
  (named pipes, the channel a one-node group uses);
- ``tp-broadcast``: the same group sending over gloo broadcasts (the channel
  of a group spanning nodes; forced here by giving each rank a node name of
  its own).

``dispatch`` = step(tp) - step(single) at the median and at p99, in wall time
and in rank 0's CPU time; and ``send``: the time rank 0 spends packing the
command and writing it to the channel. A stubbed forward never waits for the other ranks, so
this is what rank 0 pays. How late the plan reaches the ranks shows up only
at the forward pass's first all-reduce; ``--delivery`` also measures that: the
stub then all-reduces one float on every rank, and the group's step is
compared with the same group doing that all-reduce with no dispatch at all.

Timings on a shared machine are noisy: compare the figures of one run, side
by side.

    python benchmarks/bench_tp_dispatch.py --tp 4 --steps 3000 --delivery
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import time

import torch


def decode_inputs(batch: int, context: int, num_steps: int, block_size: int = 16):
    """``num_steps`` decode-step ``ModelInput``s of ``batch`` sequences (rows 0..batch-1)."""
    from pagedserve.workers.model.model_input import ModelInput

    starts = [context + 7 * i for i in range(batch)]
    tables = [list(range(i * 256, i * 256 + -(-(s + 1) // block_size))) for i, s in enumerate(starts)]
    inputs = [ModelInput(list(range(batch)), list(starts), [5 + i for i in range(batch)],
                         [(row, table, 0) for row, table in enumerate(tables)])]
    for step in range(1, num_steps):
        updates = []
        for row in range(batch):
            starts[row] += 1
            if starts[row] % block_size == 0:
                tables[row].append(tables[row][-1] + 1)
                updates.append((row, list(tables[row]), len(tables[row]) - 1))
        inputs.append(ModelInput(list(range(batch)), list(starts), [5 + (step + row) % 900 for row in range(batch)],
                                 updates))
    return inputs


class StubDecoder:
    """The decoder's place: zeros of the right shape, after an optional one-float all-reduce."""

    def __init__(self, hidden_size: int, all_reduce=None) -> None:
        self.hidden_size = hidden_size
        self.all_reduce = all_reduce
        self.flag = torch.zeros(1)

    def __call__(self, input_ids, **kwargs):
        if self.all_reduce is not None:
            self.all_reduce(self.flag)
        hidden = torch.zeros((1, input_ids.shape[1], self.hidden_size))
        return type("Output", (), {"last_hidden_state": hidden})()


def stub_forward(runner, all_reduce=None) -> None:
    hidden_size = runner.config.hidden_size
    vocab_size = runner.vocab_size
    runner.decoder = StubDecoder(hidden_size, all_reduce)
    runner.compute_logits = lambda hidden: torch.zeros((hidden.shape[0], vocab_size))


def rank_main(spec: dict, rank: int, mode: str, num_steps: int) -> None:
    """A rank 1.. process: the usual rank, with its forward stubbed. Modes: "step" (stub),
    "delivery" (stub with a one-float all-reduce), "reduce-only" (that all-reduce
    ``num_steps`` times, no commands: the delivery baseline); "-broadcast" suffix: gloo channel."""
    from pagedserve.workers.tp.dispatch import open_channel
    from pagedserve.workers.tp.group import TensorParallelGroup
    from pagedserve.workers.tp.rank import (RankExecutor, RankSpec, load_rank_runner, publish_rank_info,
                                            rank_device, share_cpu)

    spec = RankSpec.from_dict(spec)
    share_cpu(spec.rendezvous.size)
    group = TensorParallelGroup(spec.rendezvous, rank, rank_device(spec.device, rank))
    publish_rank_info(group)
    runner, _ = load_rank_runner(spec, group)
    node = f"rank-{rank}" if mode.endswith("-broadcast") else "this-node"
    channel = open_channel(group, node)
    mode = mode.removesuffix("-broadcast")
    stub_forward(runner, group.all_reduce if mode in ("delivery", "reduce-only") else None)
    if mode == "reduce-only":
        for _ in range(num_steps):
            runner.decoder.all_reduce(runner.decoder.flag)
    RankExecutor(runner, group, channel).run()


class StubLauncher:
    def __init__(self, mode: str, num_steps: int) -> None:
        self.mode = mode
        self.num_steps = num_steps

    def launch(self, spec):
        from pagedserve.workers.tp.launch import ProcessRanks

        context = multiprocessing.get_context("spawn")
        processes = []
        for rank in range(1, spec.rendezvous.size):
            process = context.Process(target=rank_main, args=(spec.to_dict(), rank, self.mode, self.num_steps),
                                      daemon=True)
            process.start()
            processes.append(process)
        return ProcessRanks(processes)


def percentiles(samples: list[float]) -> dict:
    ordered = sorted(samples)
    return {"p50_us": 1e6 * statistics.median(ordered), "p99_us": 1e6 * ordered[int(0.99 * (len(ordered) - 1))],
            "mean_us": 1e6 * statistics.fmean(ordered)}


def time_steps(execute, inputs, num_warmup: int) -> dict:
    """Wall-time percentiles of the steps, and of the CPU time of this thread in them
    (``cpu``: what rank 0 itself spends, whether or not the shared machine deschedules it)."""
    times, cpu_times = [], []
    for i, model_input in enumerate(inputs):
        start, cpu_start = time.perf_counter(), time.thread_time()
        execute(model_input)
        elapsed, cpu_elapsed = time.perf_counter() - start, time.thread_time() - cpu_start
        if i >= num_warmup:
            times.append(elapsed)
            cpu_times.append(cpu_elapsed)
    return {**percentiles(times), "cpu": percentiles(cpu_times)}


def run_single(path: str, inputs, num_warmup: int, block_size: int) -> dict:
    from pagedserve.workers.model.model_runner import ModelRunner

    runner = ModelRunner(path, "float32", "cpu")
    runner.allocate_cache(block_size, 16384, 0)
    stub_forward(runner)
    for row in range(len(inputs[0].rows)):
        runner.block_tables.take_row(f"s{row}")
    return time_steps(runner.execute, inputs, num_warmup)


def run_group(path: str, size: int, mode: str, inputs, num_warmup: int, block_size: int) -> dict:
    import pagedserve.workers.tp.runner as tensor_parallel

    broadcast = mode.endswith("-broadcast")
    saved_node_key = tensor_parallel.node_key
    tensor_parallel.node_key = lambda: "rank-0" if broadcast else "this-node"
    try:
        runner = tensor_parallel.TensorParallelRunner(path, size, StubLauncher(mode, len(inputs)), "float32", "cpu")
    finally:
        tensor_parallel.node_key = saved_node_key
    try:
        runner.allocate_cache(block_size, 16384, 0)
        base_mode = mode.removesuffix("-broadcast")
        stub_forward(runner.local, runner.group.all_reduce if base_mode in ("delivery", "reduce-only") else None)
        for row in range(len(inputs[0].rows)):
            runner.local.block_tables.take_row(f"s{row}")
        send_times = []
        runner_send = runner.send

        def timed_send(command) -> None:   # packing the command and writing it to the channel
            start = time.perf_counter()
            runner_send(command)
            send_times.append(time.perf_counter() - start)

        runner.send = timed_send
        execute = runner.local.execute if base_mode == "reduce-only" else runner.execute
        result = time_steps(execute, inputs, num_warmup)
        if send_times:
            result["send"] = percentiles(send_times[num_warmup:])
        result["channel"] = runner.channel.name
        return result
    finally:
        runner.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--delivery", action="store_true", help="also measure delivery to the ranks")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()

    from pagedserve.devtools.model_factory import ensure_model

    torch.set_num_threads(max(1, (multiprocessing.cpu_count()) // args.tp))
    path = str(ensure_model("llama", "tiny-tp"))
    block_size = 16
    inputs = decode_inputs(args.batch, args.context, args.steps + args.warmup, block_size)
    results = {"single": run_single(path, inputs, args.warmup, block_size)}
    for mode in ("step", "step-broadcast"):
        results[f"tp{args.tp}-{mode}"] = run_group(path, args.tp, mode, inputs, args.warmup, block_size)
    if args.delivery:
        for mode in ("reduce-only", "delivery"):
            results[f"tp{args.tp}-{mode}"] = run_group(path, args.tp, mode, inputs, args.warmup, block_size)
    single = results["single"]
    print(f"workload: decode steps of {args.batch} sequences, context ~{args.context}, {args.steps} steps; "
          f"forward stubbed; TP={args.tp}; torch threads per process {torch.get_num_threads()}")
    print(f"{'configuration':<24}{'p50 us':>10}{'p99 us':>10}{'cpu p50':>10}{'cpu p99':>10}"
          f"{'send p50':>10}{'send p99':>10}")
    for name, result in results.items():
        send, cpu = result.get("send", {}), result["cpu"]
        print(f"{name:<24}{result['p50_us']:>10.1f}{result['p99_us']:>10.1f}{cpu['p50_us']:>10.1f}"
              f"{cpu['p99_us']:>10.1f}{send.get('p50_us', float('nan')):>10.1f}{send.get('p99_us', float('nan')):>10.1f}")
    summary = {}
    for mode in ("step", "step-broadcast"):
        group = results[f"tp{args.tp}-{mode}"]
        summary[mode] = {"dispatch_p50_us": group["p50_us"] - single["p50_us"],
                         "dispatch_p99_us": group["p99_us"] - single["p99_us"],
                         "dispatch_cpu_p50_us": group["cpu"]["p50_us"] - single["cpu"]["p50_us"],
                         "dispatch_cpu_p99_us": group["cpu"]["p99_us"] - single["cpu"]["p99_us"]}
        print(f"dispatch ({group['channel']}): step(tp{args.tp}) - step(single) = "
              f"{summary[mode]['dispatch_p50_us']:.1f} us at p50, {summary[mode]['dispatch_p99_us']:.1f} us at p99 "
              f"(rank 0's CPU time: {summary[mode]['dispatch_cpu_p50_us']:.1f} / "
              f"{summary[mode]['dispatch_cpu_p99_us']:.1f} us)")
    if args.delivery:
        reduce_only, delivery = results[f"tp{args.tp}-reduce-only"], results[f"tp{args.tp}-delivery"]
        summary["delivery"] = {"p50_us": delivery["p50_us"] - reduce_only["p50_us"],
                               "p99_us": delivery["p99_us"] - reduce_only["p99_us"]}
        print(f"delivery to the ranks (first all-reduce): {summary['delivery']['p50_us']:.1f} us at p50, "
              f"{summary['delivery']['p99_us']:.1f} us at p99 (with the ranks' own step preparation)")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"args": vars(args), "results": results, "summary": summary}, handle, indent=2)


if __name__ == "__main__":
    main()
