"""The central KV manager's CPU split into a fixed part and a part per worker-step.

``pagedserve bench kv-scale`` divides the central process's CPU by the
worker-steps of one run. Part of that CPU does not grow with the workers: the
process's idle CPU (Ray's threads) and the receiver's wake-ups (at most one
per 20 ms gathering, whatever the number of workers). On a small machine the
simulated workers cannot keep 50 steps/s, so that fixed part is spread over
few worker-steps and the quotient overstates what a worker costs.

This runs kv-scale at several N (same B, L, R) and fits, by least squares,

    central CPU us per second = fixed + marginal * worker-steps per second

then states both figures and what they give at the issue's operating point,
N workers at 50 steps/s each:

    central_cpu_us_per_worker_step at (N, 50) = fixed / (50 N) + marginal
    workers a central core supports at 50 steps/s = (1e6 - fixed) / (50 * marginal)

next to each run's own ``central_cpu_us_per_worker_step`` and the issue's
``workers_supported_at_50_steps_per_s`` = 1e6 / (50 * that). An
extrapolation, not a measurement at that scale: the fit's residuals are
printed, and a run whose workers fell far behind their pace weighs as much as
one that kept it.

    python benchmarks/bench_kv_scale_sweep.py --workers 8 16 32 --context 4096 --json sweep.json
"""

from __future__ import annotations

import argparse
import json
import os

from pagedserve.bench.kv_scale import KVScaleConfig, run_kv_scale

STEPS_PER_S_TARGET = 50.0


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of ys against xs."""
    n = len(xs)
    if n < 2 or len(set(xs)) < 2:
        raise ValueError("a line needs at least two different x values")
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    slope = (sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys))
             / sum((x - mean_x) ** 2 for x in xs))
    return mean_y - slope * mean_x, slope


def summarise(runs: list[dict], operating_workers: int) -> dict:
    """The fit over ``runs`` (kv-scale results) and what it gives at ``operating_workers`` x 50 steps/s."""
    rates = [r["worker_steps"] / r["window_s"] for r in runs]
    cpu_per_s = [r["central_cpu_us_per_worker_step"] * rate for r, rate in zip(runs, rates)]
    fixed, marginal = fit_line(rates, cpu_per_s)
    at_target = operating_workers * STEPS_PER_S_TARGET
    return {
        "fixed_central_cpu_us_per_s": fixed,
        "marginal_central_cpu_us_per_worker_step": marginal,
        "operating_point": {"workers": operating_workers, "steps_per_s": STEPS_PER_S_TARGET},
        "central_cpu_us_per_worker_step_at_operating_point": fixed / at_target + marginal,
        "workers_supported_at_50_steps_per_s_fitted": ((1e6 - fixed) / (STEPS_PER_S_TARGET * marginal)
                                                       if marginal > 0 else float("inf")),
        "formula": "central CPU us/s = fixed + marginal * worker-steps/s; at N workers x 50 steps/s: "
                   "fixed / (50 N) + marginal per worker-step; supported = (1e6 - fixed) / (50 * marginal)",
        "points": [{"workers": r["config"]["num_workers"], "worker_steps_per_s": rate,
                    "central_cpu_us_per_s": cpu, "fit_residual_us_per_s": cpu - (fixed + marginal * rate),
                    "central_cpu_us_per_worker_step": r["central_cpu_us_per_worker_step"],
                    "workers_supported_at_50_steps_per_s": r["workers_supported_at_50_steps_per_s"],
                    "achieved_steps_per_s_per_worker": r["achieved_steps_per_s_per_worker"],
                    "central_messages_per_worker_step": r["central_messages_per_worker_step"],
                    "event_lag_p99_ms": r["event_lag_p99_ms"], "integrity_ok": r["integrity_ok"]}
                   for r, rate, cpu in zip(runs, rates, cpu_per_s)],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--workers-per-node", type=int, default=8, help="0: no relays")
    parser.add_argument("--operating-workers", type=int, default=32,
                        help="N of the operating point the fit is read at (default: 32, the issue's)")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    runs = []
    for num_workers in args.workers:
        config = KVScaleConfig(num_workers=num_workers, batch=args.batch, context=args.context,
                               steps_per_s=STEPS_PER_S_TARGET, seconds=args.seconds,
                               workers_per_node=args.workers_per_node)
        runs.append(run_kv_scale(config, log=lambda *a: None))
        print(f"N={num_workers}: {runs[-1]['achieved_steps_per_s_per_worker']:.1f} steps/s per worker, "
              f"central {runs[-1]['central_cpu_us_per_worker_step']:.1f} us per worker-step, "
              f"load {os.getloadavg()[0]:.1f}", flush=True)
    summary = summarise(runs, args.operating_workers)
    print(f"fixed {summary['fixed_central_cpu_us_per_s'] / 1e3:.1f} ms of central CPU per second, marginal "
          f"{summary['marginal_central_cpu_us_per_worker_step']:.1f} us per worker-step")
    for point in summary["points"]:
        print(f"  N={point['workers']}: {point['worker_steps_per_s']:.0f} worker-steps/s, "
              f"{point['central_cpu_us_per_s'] / 1e3:.1f} ms/s (residual "
              f"{point['fit_residual_us_per_s'] / 1e3:+.1f}), {point['central_cpu_us_per_worker_step']:.1f} us "
              f"per worker-step, supported by the issue's formula {point['workers_supported_at_50_steps_per_s']:.0f}")
    print(f"at {args.operating_workers} workers x 50 steps/s: "
          f"{summary['central_cpu_us_per_worker_step_at_operating_point']:.1f} us per worker-step; "
          f"workers one central core supports at 50 steps/s: "
          f"{summary['workers_supported_at_50_steps_per_s_fitted']:.0f}  ({summary['formula']})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": runs, "summary": summary}, f, indent=1)


if __name__ == "__main__":
    main()
