"""A worker's local KV plan per step, at a full decoding batch, against a baseline revision.

Drives ``bench.kv_sim.SimulatedKVWorker`` (the real worker-side KV code, no
model) at ``--batch`` running sequences of mean context L, after a warm-up
that fills the batch, and reports per step, as the mean CPU time of the
stepping thread (``time.thread_time``: a shared machine's descheduling does
not count, its cache pressure does):

- ``plan_us``: ``LocalKVManager.step``, the local plan (``plan_wall_median_us``:
  the median wall time);
- ``publish_us``: ``drain_events().pack()`` (the publisher's work on the
  engine's thread), amortised over ``--flush-every`` steps;
- ``sim_us``: the simulated engine around them (queues, sampled tokens),
  which a real engine replaces with its own;
- ``stats_us``: one ``LocalKVManager.stats`` call (what a /metrics or dashboard
  poll costs the engine's thread), taken every ``--stats-every`` steps and not
  counted in the step's figures (``stats_wall_median_us``: the median wall time).
  Its ``kv_utilization`` figures are compared between the runs too.

With ``--baseline REV`` the same measurement also runs on that git revision's
``kvmanager`` and ``kv_sim`` (extracted to a temporary directory that shadows
the installed package, in a subprocess), alternating runs, so that the ratio
is measured side by side on the same (shared, noisy) machine. Both must plan
the same workload: the counters of the two runs are compared and a difference
is reported.

    python benchmarks/bench_kv_local.py --baseline main --contexts 1024 4096 16384
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def measure(batch: int, context: int, num_steps: int, flush_every: int, stats_every: int) -> dict:
    """Per-step costs of one simulated worker, warm, in this process."""
    import pagedserve.kvmanager
    from pagedserve.bench.kv_sim import SimulatedKVWorker, SimWorkload

    workload = SimWorkload(batch=batch, context=context)
    prefixes = [workload.prefix(i) for i in range(workload.num_prefixes)]
    worker = SimulatedKVWorker("w0", workload, prefixes)
    warm_start = time.perf_counter()
    while worker.num_prefilled < batch:
        worker.step()
        worker.kv.drain_events()
    warmup_s = time.perf_counter() - warm_start
    worker.set_warm()
    for _ in range(10):
        worker.step()
    worker.kv.drain_events()

    plan = worker.kv.step
    plan_cpu: list[float] = []
    plan_wall: list[float] = []

    def timed_plan(step_input):
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            return plan(step_input)
        finally:
            plan_cpu.append(time.thread_time() - cpu)
            plan_wall.append(time.perf_counter() - wall)

    worker.kv.step = timed_plan
    step_cpu, publish_cpu = [], []
    stats_cpu: list[float] = []
    stats_wall: list[float] = []
    utilizations: list[float] = []
    for i in range(num_steps):
        cpu = time.thread_time()
        worker.step()
        step_cpu.append(time.thread_time() - cpu)
        if (i + 1) % flush_every == 0:
            cpu = time.thread_time()
            worker.kv.drain_events().pack()
            publish_cpu.append(time.thread_time() - cpu)
        if (i + 1) % stats_every == 0:
            wall, cpu = time.perf_counter(), time.thread_time()
            stats = worker.kv.stats(worker.worker_id)
            stats_cpu.append(time.thread_time() - cpu)
            stats_wall.append(time.perf_counter() - wall)
            utilizations.append(stats["kv_utilization"])
    worker.kv.step = plan
    worker.check_integrity()
    us = 1e6
    return {
        "batch": batch, "context": context, "num_steps": num_steps, "warmup_s": round(warmup_s, 2),
        "plan_us": round(us * statistics.fmean(plan_cpu), 1),
        "plan_wall_median_us": round(us * statistics.median(plan_wall), 1),
        "publish_us": round(us * sum(publish_cpu) / num_steps, 1),
        "sim_us": round(us * (sum(step_cpu) - sum(plan_cpu)) / num_steps, 1),
        "stats_us": round(us * statistics.fmean(stats_cpu), 1) if stats_cpu else None,
        "stats_wall_median_us": round(us * statistics.median(stats_wall), 1) if stats_wall else None,
        "kv_utilizations": utilizations,
        "counters": worker.counters.as_dict(),
        "kvmanager_from": str(Path(pagedserve.kvmanager.__file__).parent),
    }


def extract_revision(rev: str, into: Path) -> Path:
    """``kvmanager`` and ``pagedserve.bench.kv_sim`` of ``rev``, laid out as a package."""
    into.mkdir()
    archive = into / "rev.tar"
    subprocess.run(["git", "-C", str(REPO), "archive", "-o", str(archive), rev,
                    "kvmanager", "src/pagedserve/__init__.py", "src/pagedserve/bench/kv_sim.py"], check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(into / "tree", filter="data")
    tree = into / "tree"
    package = into / "path" / "pagedserve"
    (package / "bench").mkdir(parents=True)
    (tree / "src/pagedserve/__init__.py").rename(package / "__init__.py")
    (tree / "src/pagedserve/bench/kv_sim.py").rename(package / "bench" / "kv_sim.py")
    (package / "bench" / "__init__.py").write_text("")
    (tree / "kvmanager").rename(package / "kvmanager")
    return into / "path"


def run_in_subprocess(pythonpath: Path | None, args: argparse.Namespace, context: int) -> dict:
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = f"{pythonpath}{os.pathsep}{env.get('PYTHONPATH', '')}"
    out = subprocess.run([sys.executable, __file__, "--measure", "--batch", str(args.batch), "--contexts",
                          str(context), "--steps", str(args.steps), "--flush-every", str(args.flush_every),
                          "--stats-every", str(args.stats_every)],
                         env=env, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--flush-every", type=int, default=2, help="steps per publish (kv-scale: 2 at 50/s)")
    parser.add_argument("--stats-every", type=int, default=10, help="steps per timed stats() call")
    parser.add_argument("--baseline", help="a git revision to measure side by side (e.g. main)")
    parser.add_argument("--candidate", help="a git revision to measure instead of the working tree")
    parser.add_argument("--rounds", type=int, default=2, help="alternating runs per variant and context")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.batch, args.contexts[0], args.steps, args.flush_every, args.stats_every)))
        return

    load = os.getloadavg()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        baseline = extract_revision(args.baseline, Path(tmp) / "baseline") if args.baseline else None
        candidate = extract_revision(args.candidate, Path(tmp) / "candidate") if args.candidate else None
        variants = [("current", candidate)] + ([(f"baseline {args.baseline}", baseline)] if baseline else [])
        for context in args.contexts:
            runs: dict[str, list[dict]] = {name: [] for name, _ in variants}
            for round_index in range(args.rounds):
                order = variants if round_index % 2 == 0 else variants[::-1]
                for name, path in order:
                    runs[name].append(run_in_subprocess(path, args, context))
            row = {"context": context, "batch": args.batch}
            for name, measured in runs.items():
                row[name] = {key: statistics.median(m[key] for m in measured)
                             for key in ("plan_us", "plan_wall_median_us", "publish_us", "sim_us",
                                         "stats_us", "stats_wall_median_us")}
                row[name]["counters"] = measured[0]["counters"]
                row[name]["kv_utilizations"] = measured[0]["kv_utilizations"]
            if baseline is not None:
                base, cur = row[variants[1][0]], row["current"]
                row["plan_speedup"] = round(base["plan_us"] / cur["plan_us"], 2)
                row["stats_speedup"] = round(base["stats_us"] / cur["stats_us"], 1)
                row["same_workload"] = base["counters"] == cur["counters"]
                row["same_stats"] = base["kv_utilizations"] == cur["kv_utilizations"]
            results.append(row)
            print(format_row(row, [name for name, _ in variants]), flush=True)
    report = {"load_before": load, "load_after": os.getloadavg(), "results": results}
    print(f"load average before {load[0]:.2f}, after {report['load_after'][0]:.2f} (2-core machine)")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


def format_row(row: dict, names: list[str]) -> str:
    lines = [f"B={row['batch']} L={row['context']}:"]
    for name in names:
        r = row[name]
        lines.append(f"  {name:>16}: plan {r['plan_us']:6.0f} us/step (wall median {r['plan_wall_median_us']:.0f}), "
                     f"publish {r['publish_us']:4.0f} us/step, sim {r['sim_us']:5.0f} us/step (CPU); "
                     f"stats() {r['stats_us']:7.0f} us/call (wall median {r['stats_wall_median_us']:.0f})")
    if "plan_speedup" in row:
        lines.append(f"  plan speedup x{row['plan_speedup']}, stats() speedup x{row['stats_speedup']}, "
                     f"same workload: {row['same_workload']}, same kv_utilization: {row['same_stats']}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
