"""The KV wire per worker-step, before and after the two-level design, without Ray.

For ``--seqs`` decoding sequences at each ``--contexts`` length, one worker's
pool is driven through ``--steps`` decode steps two ways, side by side:

- *per-step* (the previous design): every step's ``StepInput`` is packed, the
  central manager unpacks it, plans it and packs the ``StepOutput`` (every
  scheduled sequence's full block table), and the worker unpacks the reply;
- *events* (now): the worker plans the step in-process (``LocalKVManager``),
  its ``EventLog`` is drained and packed every ``--flush-every`` steps, and
  the central ``KVManagerService.publish`` applies it to the cluster index.

Reports per worker-step: central CPU (µs; thread time of the central side),
bytes on the wire (both directions), and the worker's own planning time. The
per-step design's central CPU and bytes grow with context; the events' must not.
Ray's own messaging cost comes on top of both (one actor call per step vs one
per flush); ``pagedserve bench kv-scale`` measures that part.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import msgpack

from pagedserve.kvmanager import (EventLog, InProcessTransport, KVManager, KVPublisher, LocalKVManager,
                                  NewSequence, PoolConfig, StepInput, StepOutput, from_wire, to_wire)
from pagedserve.kvmanager.service import KVManagerService

BLOCK_SIZE = 16


def _config(num_seqs: int, context: int, num_steps: int) -> PoolConfig:
    return PoolConfig(num_device_blocks=num_seqs * ((context + num_steps) // BLOCK_SIZE + 2),
                      block_size=BLOCK_SIZE, max_model_len=context + num_steps + BLOCK_SIZE, watermark=0.0)


def _admit(manager: KVManager, ids: list[str], context: int) -> None:
    manager.step(StepInput("w", waiting=ids, token_budget=len(ids) * context, new_sequences=[
        NewSequence(seq_id, [i] * 3 + list(range(context - 3))) for i, seq_id in enumerate(ids)]))


def per_step(num_seqs: int, context: int, num_steps: int) -> dict:
    central = KVManager()
    central.add_worker("w", _config(num_seqs, context, num_steps))
    ids = [f"seq{i}" for i in range(num_seqs)]
    _admit(central, ids, context)
    cpu, nbytes = [], []
    for step in range(num_steps):
        request = msgpack.packb(to_wire(StepInput("w", running=ids, appended=[(s, [step]) for s in ids])))
        start = time.thread_time()
        output = central.step(from_wire(StepInput, msgpack.unpackb(request)))
        reply = msgpack.packb(to_wire(output))
        cpu.append(time.thread_time() - start)
        from_wire(StepOutput, msgpack.unpackb(reply))
        nbytes.append(len(request) + len(reply))
    return {"central_cpu_us_per_worker_step": 1e6 * statistics.mean(cpu),
            "bytes_per_worker_step": statistics.mean(nbytes)}


def events(num_seqs: int, context: int, num_steps: int, flush_every: int) -> dict:
    service = KVManagerService()
    local = LocalKVManager(event_log=EventLog("w"))
    local.add_worker("w", _config(num_seqs, context, num_steps))
    publisher = KVPublisher(local, InProcessTransport(service))
    ids = [f"seq{i}" for i in range(num_seqs)]
    _admit(local, ids, context)
    assert publisher.flush_and_wait(60.0)
    cpu_before, bytes_before = service.handler_cpu_s, publisher.num_bytes_out + publisher.num_bytes_in
    plan = []
    for step in range(num_steps):
        start = time.perf_counter()
        local.step(StepInput("w", running=ids, appended=[(s, [step]) for s in ids]))
        plan.append(time.perf_counter() - start)
        if (step + 1) % flush_every == 0:
            assert publisher.flush_and_wait(60.0)
    cpu = service.handler_cpu_s - cpu_before
    nbytes = publisher.num_bytes_out + publisher.num_bytes_in - bytes_before
    assert publisher.num_snapshots_sent == 1, "a resync inside the window would skew the figures"
    assert publisher.flush_and_wait(60.0)
    service.index.check_consistency_with([local.snapshot()])
    return {"central_cpu_us_per_worker_step": 1e6 * cpu / num_steps, "bytes_per_worker_step": nbytes / num_steps,
            "worker_plan_us_per_step": 1e6 * statistics.median(plan)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, default=256)
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--flush-every", type=int, default=3, help="steps per event batch (50 ms at 60 steps/s)")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    rows = []
    print(f"{'context':>8} | {'per-step: central us':>20} {'bytes':>10} | {'events: central us':>18} "
          f"{'bytes':>7} {'worker plan us':>14} | {'CPU ratio':>9} {'bytes ratio':>11}")
    for context in args.contexts:
        before = per_step(args.seqs, context, args.steps)
        after = events(args.seqs, context, args.steps, args.flush_every)
        row = {"context": context, "num_seqs": args.seqs, "per_step": before, "events": after,
               "central_cpu_ratio": before["central_cpu_us_per_worker_step"] / after["central_cpu_us_per_worker_step"],
               "bytes_ratio": before["bytes_per_worker_step"] / after["bytes_per_worker_step"]}
        rows.append(row)
        print(f"{context:>8} | {before['central_cpu_us_per_worker_step']:>20.0f} {before['bytes_per_worker_step']:>10.0f} | "
              f"{after['central_cpu_us_per_worker_step']:>18.1f} {after['bytes_per_worker_step']:>7.0f} "
              f"{after['worker_plan_us_per_step']:>14.0f} | {row['central_cpu_ratio']:>8.0f}x {row['bytes_ratio']:>10.0f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
