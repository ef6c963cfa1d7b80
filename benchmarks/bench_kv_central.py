"""The central KV manager's handler CPU per worker-step, on recorded real event batches.

No Ray and no sockets: this isolates what the central process does per
message (unpack, apply to the cluster index, ack) from Ray's and ZeroMQ's
costs, which ``pagedserve bench kv-scale`` includes.

``record``: one ``SimulatedKVWorker`` (kv-scale's model-free worker: the real
worker-side KV code) at ``--batch`` sequences and each ``--contexts`` length
fills its batch, then steps ``--steps`` times (decode growth, finishes, new
admits with shared prefixes, evictions); its event log is drained every 2 or
3 steps alternately (~50 ms at 50 steps/s). The starting snapshot and every
batch go to a JSON file as plain data, so checkouts with different wire
formats replay the same work.

``replay``: each checkout packs the recorded batches with its own format and
feeds them, as ``--workers`` workers (keys salted per worker), to
``KVManagerService.publish``: thread CPU per worker-step, per batch and per
changed key, and bytes per worker-step. Then ``longest_prefix`` with
``--query-workers`` workers, each caching a few thousand keys plus one shared
prefix (half the context), one of them the whole prompt: time of the first
call and of the next ones (hashing the prompt included), and the same for a
prompt nobody caches.

    python benchmarks/bench_kv_central.py record --out /tmp/kv_batches.json
    python benchmarks/bench_kv_central.py replay /tmp/kv_batches.json
    (run replay under two checkouts' interpreters, alternating, for a before/after)
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from pagedserve.kvmanager.events import (AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, KVSnapshot,
                                         TierOccupancy)
from pagedserve.kvmanager.hashing import block_hash_key, hash_prefix_blocks
from pagedserve.kvmanager.service import KVManagerService

TIERS = ("device", "host")
_MASK = (1 << 64) - 1


def _events_to_plain(events) -> list:
    plain = []
    for event in events:
        if isinstance(event, AllBlocksCleared):
            plain.append(["cleared", event.medium, []])
        else:
            plain.append(["stored" if isinstance(event, BlockStored) else "removed", event.medium,
                          list(event.block_hashes)])
    return plain


def _occupancy_to_plain(occupancy) -> dict:
    return {tier: [o.num_used, o.num_cached_free, o.num_free, o.num_total] for tier, o in occupancy.items()}


def record(args) -> None:
    from pagedserve.bench.kv_sim import SimulatedKVWorker, SimWorkload

    runs = []
    for context in args.contexts:
        workload = SimWorkload(batch=args.batch, context=context, seed=args.seed)
        prefixes = [workload.prefix(i) for i in range(workload.num_prefixes)]
        worker = SimulatedKVWorker("w", workload, prefixes)
        start = time.perf_counter()
        while worker.num_prefilled < 0.9 * args.batch:
            worker.step()
        worker.set_warm()
        for _ in range(args.settle_steps):
            worker.step()
        snapshot = worker.kv.snapshot()
        batches, num_steps = [], 0
        while num_steps < args.steps:
            every = 2 + len(batches) % 2
            for _ in range(every):
                worker.step()
            num_steps += every
            batch = worker.kv.drain_events()
            batches.append({"first_seq": batch.first_seq, "events": _events_to_plain(batch.events),
                            "occupancy": _occupancy_to_plain(batch.occupancy), "num_steps": every})
        runs.append({"context": context, "batch": args.batch, "num_steps": num_steps,
                     "snapshot": {"next_seq": snapshot.next_seq, "pool_config": snapshot.pool_config,
                                  "block_hashes": snapshot.block_hashes,
                                  "occupancy": _occupancy_to_plain(snapshot.occupancy)},
                     "batches": batches, "counters": worker.counters.as_dict()})
        num_keys = sum(len(e[2]) for b in batches for e in b["events"])
        print(f"recorded L={context}: {len(batches)} batches over {num_steps} steps, "
              f"{num_keys / num_steps:.1f} changed keys per step ({time.perf_counter() - start:.0f} s)")
    with open(args.out, "w") as f:
        json.dump(runs, f)


def _occupancy(plain: dict) -> dict:
    return {tier: TierOccupancy(*values) for tier, values in plain.items()}


def _event(kind: str, tier: str | None, keys: list[int]):
    if kind == "cleared":
        return AllBlocksCleared(tier)
    return (BlockStored if kind == "stored" else BlockRemoved)(keys, tier)


def _salted(keys: list[int], salt: int) -> list[int]:
    return [(k ^ salt) & _MASK for k in keys]


def _replay_publish(run: dict, num_workers: int, repeats: int) -> dict:
    """Thread CPU of ``publish`` over every worker's recorded batches (best of ``repeats``)."""
    snap = run["snapshot"]
    salts = [random.Random(i).getrandbits(64) for i in range(num_workers)]
    snapshots, packed = [], []
    for i, salt in enumerate(salts):
        worker_id = f"w{i}"
        snapshots.append(KVSnapshot(worker_id, "inc", snap["next_seq"], snap["pool_config"],
                                    {t: _salted(k, salt) for t, k in snap["block_hashes"].items()},
                                    _occupancy(snap["occupancy"])).pack())
        packed.append([KVEventBatch(worker_id, "inc", b["first_seq"],
                                    [_event(kind, tier, _salted(keys, salt)) for kind, tier, keys in b["events"]],
                                    _occupancy(b["occupancy"]), 1.0, 1.0).pack()
                       for b in run["batches"]])
    best = float("inf")
    for _ in range(repeats):
        service = KVManagerService()
        for s in snapshots:
            service.resync(s)
        order = [p for batches in zip(*packed) for p in batches]   # interleaved, as they arrive
        start = time.thread_time()
        for p in order:
            service.publish(p)
        best = min(best, time.thread_time() - start)
        assert service.stats()["num_refused_batches"] == 0
    num_steps = run["num_steps"] * num_workers
    num_batches = len(run["batches"]) * num_workers
    num_keys = sum(len(e[2]) for b in run["batches"] for e in b["events"]) * num_workers
    num_bytes = sum(len(p) for batches in packed for p in batches)
    return {"context": run["context"], "num_workers": num_workers,
            "handler_us_per_worker_step": 1e6 * best / num_steps,
            "handler_us_per_batch": 1e6 * best / num_batches,
            "handler_ns_per_changed_key": 1e9 * best / num_keys,
            "changed_keys_per_worker_step": num_keys / num_steps,
            "bytes_in_per_worker_step": num_bytes / num_steps}


def _replay_query(run: dict, num_workers: int, num_background_keys: int, repeats: int) -> dict:
    """``longest_prefix`` with ``num_workers`` workers sharing a cached prefix of half the context."""
    context, config = run["context"], run["snapshot"]["pool_config"]
    bs = config["block_size"]
    rng = random.Random(0)
    prompt = [rng.randrange(3, 250) for _ in range(context)]
    chain = [block_hash_key(h) for h in hash_prefix_blocks(prompt, bs, None, (context - 1) // bs)]
    shared = chain[:len(chain) // 2]
    service = KVManagerService()
    for i in range(num_workers):
        keys = [rng.getrandbits(64) for _ in range(num_background_keys)] + (chain if i == 0 else shared)
        service.resync(KVSnapshot(f"w{i}", "inc", 0, config, {"device": keys}, {}).pack())
    timings = {}
    for name, tokens in (("shared_prefix", prompt), ("miss", [t + 1 for t in prompt])):
        samples = []
        for _ in range(repeats + 1):
            start = time.thread_time()
            result = service.longest_prefix(tokens)
            samples.append(time.thread_time() - start)
        expected = (len(chain) * bs, len(shared) * bs) if name == "shared_prefix" else (0, 0)
        assert (result["w0"], result["w1"]) == expected, (name, result["w0"], result["w1"], expected)
        timings[f"longest_prefix_ms_{name}_first"] = 1e3 * samples[0]
        timings[f"longest_prefix_ms_{name}"] = 1e3 * statistics.median(samples[1:])
    start = time.thread_time()
    for _ in range(repeats):
        hash_prefix_blocks(prompt, bs, None, (context - 1) // bs)
    timings["of_it_hashing_ms"] = 1e3 * (time.thread_time() - start) / repeats
    return {"context": context, "num_query_workers": num_workers, **timings}


def replay(args) -> None:
    with open(args.file) as f:
        runs = json.load(f)
    rows = []
    for run in runs:
        row = _replay_publish(run, args.workers, args.repeats)
        row.update(_replay_query(run, args.query_workers, args.background_keys, args.repeats))
        rows.append(row)
        print(f"{args.label:>8} L={row['context']:>6}: handler {row['handler_us_per_worker_step']:6.2f} us/worker-step "
              f"({row['handler_us_per_batch']:6.1f} us/batch, {row['handler_ns_per_changed_key']:5.0f} ns/changed key, "
              f"{row['changed_keys_per_worker_step']:.0f} keys and {row['bytes_in_per_worker_step']:.0f} B "
              f"per worker-step); longest_prefix at {args.query_workers} workers: "
              f"shared prefix {row['longest_prefix_ms_shared_prefix_first']:.2f} ms first, "
              f"{row['longest_prefix_ms_shared_prefix']:.2f} ms again; miss "
              f"{row['longest_prefix_ms_miss_first']:.2f} / {row['longest_prefix_ms_miss']:.2f} ms "
              f"({row['of_it_hashing_ms']:.2f} ms of each is hashing)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"label": args.label, "rows": rows}, f, indent=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="record a simulated worker's batches")
    rec.add_argument("--out", required=True)
    rec.add_argument("--batch", type=int, default=256)
    rec.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384])
    rec.add_argument("--steps", type=int, default=150)
    rec.add_argument("--settle-steps", type=int, default=20)
    rec.add_argument("--seed", type=int, default=0)
    rep = sub.add_parser("replay", help="time this checkout's central handler on recorded batches")
    rep.add_argument("file")
    rep.add_argument("--workers", type=int, default=32)
    rep.add_argument("--query-workers", type=int, default=256)
    rep.add_argument("--background-keys", type=int, default=1000)
    rep.add_argument("--repeats", type=int, default=5)
    rep.add_argument("--label", default="")
    rep.add_argument("--json")
    args = parser.parse_args()
    record(args) if args.command == "record" else replay(args)


if __name__ == "__main__":
    main()
