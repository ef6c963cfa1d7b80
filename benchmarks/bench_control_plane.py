"""What watching workers costs the cluster controller, per worker: its heartbeat monitor
(``cluster.health.WorkerHealth``) and its worker pool (``cluster.worker_pool.WorkerPool``)
run in this process over N workers, and the process's CPU is read over a window.

A cluster of hundreds of GPUs has hundreds of workers, all watched by one controller
process, so its CPU per worker and second decides how far one controller goes. The
workers here are stand-ins (``R`` small Ray actors that answer ``heartbeat`` and
``drain_status`` as ``Worker`` does, each standing for N / R workers), so the figures are
the controller's side and the actors' side of the calls, not an engine's.

Two pool states, side by side in each round:
- ``ready``: the pool reads each worker's load from the heartbeats, and asks nothing;
- ``draining``: every worker draining, so the pool asks each its ``drain_status`` twice a
  second as well (what it asks of every worker where the load does not come with the
  heartbeats).

    python benchmarks/bench_control_plane.py [--workers 64,256] [--actors 4] [--window-s 10] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import psutil


def _stand_in_class():
    class StandInWorker:
        """Answers like ``Worker.heartbeat`` and ``Worker.drain_status``, from fixed figures."""

        def heartbeat(self) -> dict:
            return {"worker_id": "stand-in", "pid": os.getpid(), "actor_id": None, "engine_core_pid": None,
                    "started_at": 0.0, "num_heartbeats": 0, "num_unfinished": 3, "num_steps": 0,
                    "num_generated_tokens": 0, "seconds_since_progress": 0.0, "is_stalled": False}

        def drain(self) -> None:
            pass

        def drain_status(self) -> dict:
            return {"worker_id": "stand-in", "is_draining": True, "num_unfinished": 3,
                    "num_drain_migrations": 0, "num_held_exports": 0}

        def pid(self) -> int:
            return os.getpid()

    return StandInWorker


class _StandInKVManager:
    def remove_worker(self, worker_id: str) -> None:
        pass


def measure(num_workers: int, num_actors: int, draining: bool, window_s: float) -> dict:
    """The controller's and the stand-ins' CPU per second over ``window_s``, per worker."""
    import ray

    from pagedserve.cluster.health import WorkerHealth
    from pagedserve.cluster.worker_pool import WorkerPool

    actor_cls = ray.remote(_stand_in_class())
    actors = [actor_cls.remote() for _ in range(num_actors)]
    stand_ins = [psutil.Process(pid) for pid in ray.get([actor.pid.remote() for actor in actors])]
    workers = {f"worker-{i}": actors[i % len(actors)] for i in range(num_workers)}
    health = WorkerHealth(dict(workers), None, stall_timeout_s=60.0)
    health.start()
    pool = WorkerPool({}, "unused", {}, ray.remote(_StandInKVManager).remote(), "unused", None, dict(workers),
                      {w: 0 for w in workers}, read_liveness=health.snapshot)
    try:
        if draining:
            for worker_id in workers:
                pool.drain(worker_id)
        time.sleep(2.0)   # every probe on its way

        def cpu() -> tuple[float, float]:
            # This process's own clock counts in nanoseconds; other processes' in clock ticks
            # (10 ms), which a short window over few workers may not reach.
            return time.process_time(), sum(sum(p.cpu_times()[:2]) for p in stand_ins)

        before, start = cpu(), time.perf_counter()
        time.sleep(window_s)
        after, elapsed = cpu(), time.perf_counter() - start
    finally:
        health.stop()
        pool.shutdown()   # and the stand-ins
    controller_ms_s = 1e3 * (after[0] - before[0]) / elapsed
    stand_ins_ms_s = 1e3 * (after[1] - before[1]) / elapsed
    return {"workers": num_workers, "pool": "draining" if draining else "ready",
            "controller_ms_per_s": round(controller_ms_s, 1), "stand_ins_ms_per_s": round(stand_ins_ms_s, 1),
            "controller_us_per_worker_s": round(1e3 * controller_ms_s / num_workers, 1),
            "stand_ins_us_per_worker_s": round(1e3 * stand_ins_ms_s / num_workers, 1)}


def main() -> None:
    import ray

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", default="64,256", help="numbers of workers watched, comma-separated")
    parser.add_argument("--actors", type=int, default=4, help="stand-in actors the workers share")
    parser.add_argument("--window-s", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    ray.init(num_cpus=2, include_dashboard=False, logging_level="error")
    try:
        for round_index in range(args.rounds):
            for num_workers in (int(n) for n in args.workers.split(",")):
                for draining in (False, True):
                    row = measure(num_workers, args.actors, draining, args.window_s)
                    print(json.dumps({"round": round_index + 1, **row}), flush=True)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
