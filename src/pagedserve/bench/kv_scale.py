"""``bench kv-scale``: what one central KV manager costs per worker-step, with many workers.

N simulated workers (``kv_sim.SimulatedKVWorker``: the real worker-side KV
code, a ``LocalKVManager`` and its event log, driven like an engine with no
model) run against the real central KV manager actor (``KVManagerService``)
on a local Ray cluster, several per Ray actor process (``SimWorkerGroup``),
each paced at ``steps_per_s``. Each worker publishes its event batch every
``flush_interval_s`` of its own simulated time (every
``round(flush_interval_s * steps_per_s)`` steps, so a batch carries what it
would at full speed even when this machine cannot keep the pace), fire and
forget, off the step; it asks the central manager only when it cannot grow
(one blocking ``decide_preemption`` call).

Measured over ``seconds`` after a warm-up that fills every worker's batch:
- ``central_cpu_us_per_worker_step``: the central actor process's CPU time
  (``process_cpu_s``: Ray's own threads included) / all worker-steps;
- ``bytes_per_worker_step``: payload bytes both ways (event batches,
  snapshots, preemption requests and their answers, as counted by the
  central manager) / worker-steps; Ray's per-call framing is not included,
  ``central_calls_per_worker_step`` says how many calls it would add to;
- ``blocking_calls_per_step``: blocking calls a worker made / its steps;
- ``event_lag_p99_ms``: a batch's oldest event on the worker -> the batch
  applied to the central index, wall clock, as the central manager measures
  it (it includes the simulated workers' own slowness when they cannot keep
  the pace; ``publish_rtt_p99_ms``, publish -> ack seen by the worker, is the
  delivery part, and ``flush_interval_ms + publish_rtt_p99_ms`` bounds the
  lag of a worker that keeps the pace);
- ``workers_supported_at_50_steps_per_s`` = 1e6 / (50 * central_cpu_us_per_worker_step);
- ``preemptions_by_mode`` as carried out by the workers;
- ``integrity_ok``: every pool's integrity check holds and, after a final
  flush, the central index equals the union of the workers' snapshots; and
  again, with zero blocks in use, after every sequence is finished.

If the simulated workers cannot keep up with ``steps_per_s`` on this
machine, the achieved rate is reported and every figure stays per
worker-step.
"""

from __future__ import annotations

import json
import math
import threading
import time
from dataclasses import asdict, dataclass, field

from .kv_sim import Migration, SimulatedKVWorker, SimWorkload

WORKERS_SUPPORTED_FORMULA = "1e6 / (50 * central_cpu_us_per_worker_step)"
# Targets from the KV-scale issue (B = 256, L = 4,096 and 16,384, N = 32, R = 50).
TARGETS = {
    "blocking_calls_per_step": ("<=", 0.02),
    "central_cpu_us_per_worker_step": ("<=", 50.0),
    "bytes_per_worker_step": ("<=", 1024.0),
    "event_lag_p99_ms": ("<=", 100.0),
    "workers_supported_at_50_steps_per_s": (">=", 256.0),
}


@dataclass(frozen=True)
class KVScaleConfig:
    num_workers: int = 32
    batch: int = 256
    context: int = 4096
    steps_per_s: float = 50.0
    seconds: float = 20.0
    workers_per_process: int = 16
    flush_interval_s: float = 0.05
    warmup_timeout_s: float = 600.0
    pressure_per_s: float = 0.2
    num_prefixes: int = 8
    shared_prefix_frac: float = 0.5
    output_len: tuple[int, int] | None = None   # default: (context // 4, 3 * context // 4)
    prefill_per_step: int = 512
    seed: int = 0

    def workload(self) -> SimWorkload:
        return SimWorkload(batch=self.batch, context=self.context, num_prefixes=self.num_prefixes,
                           shared_prefix_frac=self.shared_prefix_frac, output_len=self.output_len,
                           pressure_per_s=self.pressure_per_s, steps_per_s=self.steps_per_s,
                           prefill_per_step=self.prefill_per_step, seed=self.seed)

    @property
    def worker_ids(self) -> list[str]:
        return [f"sim-{i}" for i in range(self.num_workers)]

    @property
    def num_processes(self) -> int:
        return -(-self.num_workers // self.workers_per_process)


@dataclass
class _Link:
    """One simulated worker's traffic with the central manager."""

    num_blocking_calls: int = 0
    blocking_seconds: float = 0.0
    num_publishes: int = 0
    num_resyncs: int = 0
    pending: list = field(default_factory=list)      # (ObjectRef of an ack not yet read, sent at)
    steps_since_flush: int = 0
    last_occupancy: object = None


class SimWorkerGroup:
    """Several simulated workers in one process, stepped by one thread at their pace.

    Run as a Ray actor (``ray.remote(SimWorkerGroup)``); its methods are called
    by the driver while the stepping thread runs, and by other groups to hand
    over migrated sequences.
    """

    def __init__(self, config: KVScaleConfig, worker_ids: list[str], central, groups_by_worker: dict) -> None:
        import ray

        from pagedserve.kvmanager.preemption import PreemptionDecision, RemotePreemptionPolicy

        self.config = config
        self.central = central
        self.groups_by_worker = groups_by_worker   # worker id -> group index
        self.groups: list = []                      # set by connect()
        workload = config.workload()
        prefixes = [workload.prefix(i) for i in range(workload.num_prefixes)]
        self.links = {w: _Link() for w in worker_ids}

        def remote_call(worker_id: str):
            link = self.links[worker_id]

            def call(request):
                start = time.perf_counter()
                link.num_blocking_calls += 1
                try:
                    packed = ray.get(central.decide_preemption.remote(request.pack()), timeout=30)
                finally:
                    link.blocking_seconds += time.perf_counter() - start
                return PreemptionDecision.unpack(packed)
            return call

        self.workers = {w: SimulatedKVWorker(w, workload, prefixes, RemotePreemptionPolicy(remote_call(w)))
                        for w in worker_ids}
        self.flush_every_steps = max(1, round(config.flush_interval_s * config.steps_per_s))
        self.publish_rtts: list[tuple[float, float]] = []   # (ack seen at, seconds since sent)
        self.inbox: list[Migration] = []
        self._inbox_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._paced = False
        self.error: str | None = None

    def connect(self, groups: list) -> bool:
        self.groups = groups
        return True

    # ---- setup -----------------------------------------------------------------------
    def register(self) -> bool:
        """Register every worker with the central manager and send its first snapshot."""
        import ray

        from pagedserve.kvmanager.events import PublishAck

        for worker_id, worker in self.workers.items():
            ray.get(self.central.register_worker.remote(worker_id, asdict(worker.pool_config)), timeout=60)
            ack = PublishAck.unpack(ray.get(self.central.resync.remote(worker.kv.snapshot().pack()), timeout=60))
            if ack.status != "ok":
                raise RuntimeError(f"{worker_id}: first snapshot answered {ack.status!r}")
        return True

    def start(self) -> bool:
        self._thread = threading.Thread(target=self._run, name="sim-workers", daemon=True)
        self._thread.start()
        return True

    def warm_status(self) -> dict:
        """How far each worker's batch is filled with decoding sequences."""
        if self.error:
            raise RuntimeError(self.error)
        return {w: worker.num_prefilled for w, worker in self.workers.items()}

    def set_paced(self) -> bool:
        """Warm-up over: step at ``steps_per_s``, new requests from scratch, pressure on."""
        for worker in self.workers.values():
            worker.set_warm()
        self._paced = True
        return True

    def counters(self) -> dict:
        if self.error:
            raise RuntimeError(self.error)
        return {w: {**worker.counters.as_dict(), "num_blocking_calls": self.links[w].num_blocking_calls,
                    "blocking_seconds": self.links[w].blocking_seconds,
                    "num_publishes": self.links[w].num_publishes, "num_resyncs": self.links[w].num_resyncs}
                for w, worker in self.workers.items()}

    def publish_rtts_between(self, start: float, stop: float) -> list[float]:
        """Publish round trips (seconds) whose ack was seen in [start, stop) (``time.time``)."""
        return [rtt for seen, rtt in self.publish_rtts if start <= seen < stop]

    def accept_migrations(self, migrations: list[Migration]) -> bool:
        with self._inbox_lock:
            self.inbox.extend(migrations)
        return True

    # ---- the stepping thread -----------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # reported to the driver by the next call
            import traceback
            self.error = f"{exc!r}\n{traceback.format_exc()}"

    def _loop(self) -> None:
        period = 1.0 / self.config.steps_per_s
        due = {w: time.perf_counter() for w in self.workers}
        while not self._stop.is_set():
            self._deliver_inbox()
            now = time.perf_counter()
            if self._paced:
                worker_id = min(due, key=due.__getitem__)
                if due[worker_id] > now:
                    self._read_all_acks()
                    time.sleep(min(due[worker_id] - now, 0.005))
                    continue
                # Behind schedule: do not build up a debt to repay in a burst.
                due[worker_id] = max(due[worker_id] + period, now - period)
            else:
                worker_id = min(due, key=due.__getitem__)
                due[worker_id] = now
            worker = self.workers[worker_id]
            worker.step()
            if worker.outbox:
                self._send_migrations(worker)
            link = self.links[worker_id]
            link.steps_since_flush += 1
            if link.steps_since_flush >= self.flush_every_steps:
                self.flush(worker_id)
            self._read_all_acks()

    def _deliver_inbox(self) -> None:
        if not self.inbox:
            return
        with self._inbox_lock:
            migrations, self.inbox = self.inbox, []
        for migration in migrations:
            self.workers[migration.target_worker].accept_migration(migration)

    def _send_migrations(self, worker: SimulatedKVWorker) -> None:
        by_group: dict[int, list[Migration]] = {}
        for migration in worker.outbox:
            by_group.setdefault(self.groups_by_worker[migration.target_worker], []).append(migration)
        worker.outbox = []
        for group_index, migrations in by_group.items():
            if all(m.target_worker in self.workers for m in migrations):
                self.accept_migrations(migrations)
            else:
                self.groups[group_index].accept_migrations.remote(migrations)

    def _read_all_acks(self) -> None:
        for worker_id, link in self.links.items():
            self._read_acks(worker_id, link)

    def flush(self, worker_id: str) -> None:
        """Publish what changed since the last flush (fire and forget)."""
        link = self.links[worker_id]
        worker = self.workers[worker_id]
        link.steps_since_flush = 0
        if worker.event_log.needs_snapshot:
            self._resync(worker_id)
            return
        occupancy = worker.kv.occupancy()
        if not worker.event_log.num_pending and occupancy == link.last_occupancy:
            return
        batch = worker.kv.drain_events()
        link.last_occupancy = occupancy
        link.pending.append((self.central.publish.remote(batch.pack()), time.perf_counter()))
        link.num_publishes += 1

    def _resync(self, worker_id: str) -> None:
        link = self.links[worker_id]
        link.pending.append((self.central.resync.remote(self.workers[worker_id].kv.snapshot().pack()),
                             time.perf_counter()))
        link.num_resyncs += 1

    def _read_acks(self, worker_id: str, link: _Link) -> None:
        import ray

        from pagedserve.kvmanager.events import PublishAck

        if not link.pending:
            return
        sent_at = dict(link.pending)
        ready, waiting = ray.wait(list(sent_at), num_returns=len(sent_at), timeout=0)
        if not ready:
            return
        link.pending = [(ref, sent_at[ref]) for ref in waiting]
        now, seen_at = time.perf_counter(), time.time()
        needs_resync = False
        for ref in ready:
            self.publish_rtts.append((seen_at, now - sent_at[ref]))
            needs_resync |= PublishAck.unpack(ray.get(ref)).needs_resync
        if needs_resync:
            self._resync(worker_id)

    # ---- the end -------------------------------------------------------------------------
    def stop(self) -> bool:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.error:
            raise RuntimeError(self.error)
        return True

    def final_flush(self) -> list[bytes]:
        """Deliver pending migrations, publish everything, wait for every ack; then check
        each pool and return the workers' packed snapshots."""
        import ray

        self._deliver_inbox()
        for worker_id, link in self.links.items():
            self.flush(worker_id)
            ray.get([ref for ref, _ in link.pending], timeout=120)
            self._read_acks(worker_id, link)
            ray.get([ref for ref, _ in link.pending], timeout=120)
            self._read_acks(worker_id, link)
            if link.pending:
                raise RuntimeError(f"{worker_id}: the central manager still asks for resyncs")
        snapshots = []
        for worker in self.workers.values():
            worker.check_integrity()
            snapshots.append(worker.kv.snapshot().pack())
        return snapshots

    def finish_all(self) -> dict[str, int]:
        """Finish every sequence; returns device + host blocks still in use per worker (must be 0)."""
        used = {}
        for worker_id, worker in self.workers.items():
            worker.finish_all()
            worker.check_integrity()
            occupancy = worker.kv.occupancy()
            used[worker_id] = occupancy["device"].num_used + occupancy["host"].num_used
        return used


def _check_consistency(service, packed_snapshots: list[bytes]) -> bool:
    """Run inside the central actor: its index equals the union of the snapshots."""
    from pagedserve.kvmanager.events import KVSnapshot

    service.index.check_consistency_with([KVSnapshot.unpack(s) for s in packed_snapshots])
    service.check_integrity()
    return True


def _clear_lags(service) -> bool:
    """Run inside the central actor at the start of the measured window."""
    service._lags_s.clear()
    return True


def _sum_counters(per_group: list[dict]) -> dict:
    total = {"num_steps": 0, "num_blocking_calls": 0, "blocking_seconds": 0.0, "num_publishes": 0,
             "num_resyncs": 0, "num_finished": 0, "num_admitted": 0, "num_pressure_requests": 0,
             "num_migrated_in": 0, "num_scheduled_tokens": 0,
             "preemptions_by_mode": {"migrate": 0, "swap": 0, "recompute": 0}}
    for group in per_group:
        for counters in group.values():
            for key, value in counters.items():
                if key == "preemptions_by_mode":
                    for mode, n in value.items():
                        total[key][mode] = total[key].get(mode, 0) + n
                else:
                    total[key] += value
    return total


def _delta(after: dict, before: dict) -> dict:
    out = {}
    for key, value in after.items():
        if isinstance(value, dict):
            out[key] = {k: v - before[key].get(k, 0) for k, v in value.items()}
        else:
            out[key] = value - before[key]
    return out


def run_kv_scale(config: KVScaleConfig, out: str | None = None, log=print) -> dict:
    """Run the benchmark (starting a local Ray cluster unless one is connected)."""
    import ray

    from pagedserve.kvmanager.service import KVManagerService

    owns_ray = not ray.is_initialized()
    if owns_ray:
        ray.init(address="local", include_dashboard=False, log_to_driver=False,
                 num_cpus=config.num_processes + 1)
    central = None
    groups = []
    try:
        central = ray.remote(KVManagerService).options(num_cpus=0, max_restarts=0).remote()
        ray.get(central.get_incarnation.remote(), timeout=120)
        worker_ids = config.worker_ids
        per = config.workers_per_process
        chunks = [worker_ids[i:i + per] for i in range(0, len(worker_ids), per)]
        groups_by_worker = {w: i for i, chunk in enumerate(chunks) for w in chunk}
        group_cls = ray.remote(SimWorkerGroup).options(num_cpus=0, max_concurrency=4)
        groups = [group_cls.remote(config, chunk, central, groups_by_worker) for chunk in chunks]
        ray.get([g.connect.remote(groups) for g in groups], timeout=600)
        ray.get([g.register.remote() for g in groups], timeout=600)
        log(f"kv-scale: {config.num_workers} simulated workers in {len(groups)} processes, batch {config.batch}, "
            f"context {config.context}; warming up (filling every batch)")
        warm_start = time.perf_counter()
        ray.get([g.start.remote() for g in groups], timeout=60)
        while True:
            filled = {}
            for status in ray.get([g.warm_status.remote() for g in groups], timeout=120):
                filled.update(status)
            if min(filled.values()) >= config.batch * 0.9:
                break
            if time.perf_counter() - warm_start > config.warmup_timeout_s:
                raise RuntimeError(f"warm-up did not fill the batches in {config.warmup_timeout_s} s: "
                                   f"{min(filled.values())} of {config.batch} decoding on the slowest worker")
            time.sleep(1.0)
        warmup_s = time.perf_counter() - warm_start
        ray.get([g.set_paced.remote() for g in groups], timeout=60)
        time.sleep(min(2.0, config.seconds / 4))  # settle into the pace
        log(f"kv-scale: warm after {warmup_s:.0f} s; measuring {config.seconds:.0f} s")

        central_before = ray.get(central.stats.remote(), timeout=60)
        ray.get(central.__ray_call__.remote(_clear_lags), timeout=60)
        counters_before = _sum_counters(ray.get([g.counters.remote() for g in groups], timeout=60))
        window_start, window_start_wall = time.perf_counter(), time.time()
        time.sleep(config.seconds)
        central_after = ray.get(central.stats.remote(), timeout=60)
        counters_after = _sum_counters(ray.get([g.counters.remote() for g in groups], timeout=60))
        window_s = time.perf_counter() - window_start
        rtts = sorted(rtt for chunk in ray.get([g.publish_rtts_between.remote(window_start_wall, time.time())
                                                 for g in groups], timeout=60) for rtt in chunk)

        ray.get([g.stop.remote() for g in groups], timeout=120)
        snapshots = [s for chunk in ray.get([g.final_flush.remote() for g in groups], timeout=600) for s in chunk]
        integrity_errors = []
        try:
            ray.get(central.__ray_call__.remote(_check_consistency, snapshots), timeout=600)
        except Exception as exc:
            integrity_errors.append(f"after the final flush: {exc}")
        del snapshots
        used = {}
        for group_used in ray.get([g.finish_all.remote() for g in groups], timeout=600):
            used.update(group_used)
        leaked = {w: n for w, n in used.items() if n}
        if leaked:
            integrity_errors.append(f"blocks still in use after finishing everything: {leaked}")
        snapshots = [s for chunk in ray.get([g.final_flush.remote() for g in groups], timeout=600) for s in chunk]
        try:
            ray.get(central.__ray_call__.remote(_check_consistency, snapshots), timeout=600)
        except Exception as exc:
            integrity_errors.append(f"after finishing everything: {exc}")
        del snapshots
    finally:
        for actor in groups + ([central] if central is not None else []):
            ray.kill(actor)
        if owns_ray:
            ray.shutdown()

    counters = _delta(counters_after, counters_before)
    num_steps = counters["num_steps"]
    if num_steps == 0:
        raise RuntimeError("no worker-steps in the measured window")
    cpu_s = central_after["process_cpu_s"] - central_before["process_cpu_s"]
    handler_cpu_s = central_after["handler_cpu_s"] - central_before["handler_cpu_s"]
    num_bytes = (central_after["bytes_in"] + central_after["bytes_out"]
                 - central_before["bytes_in"] - central_before["bytes_out"])
    num_calls = sum(central_after[k] - central_before[k]
                    for k in ("num_publishes", "num_snapshots", "num_preemption_calls"))
    cpu_us = 1e6 * cpu_s / num_steps
    result = {
        "config": asdict(config),
        "central_cpu_us_per_worker_step": cpu_us,
        "bytes_per_worker_step": num_bytes / num_steps,
        "blocking_calls_per_step": counters["num_blocking_calls"] / num_steps,
        "event_lag_p99_ms": central_after["event_lag_p99_ms"],
        "workers_supported_at_50_steps_per_s": 1e6 / (50 * cpu_us) if cpu_us > 0 else math.inf,
        "workers_supported_formula": WORKERS_SUPPORTED_FORMULA,
        "preemptions_by_mode": counters["preemptions_by_mode"],
        "integrity_ok": not integrity_errors,
        "integrity_errors": integrity_errors,
        # context for the figures above
        "achieved_steps_per_s_per_worker": num_steps / window_s / config.num_workers,
        "worker_steps": num_steps,
        "window_s": window_s,
        "warmup_s": warmup_s,
        "central_handler_cpu_us_per_worker_step": 1e6 * handler_cpu_s / num_steps,
        "central_calls_per_worker_step": num_calls / num_steps,
        "event_lag_p50_ms": central_after["event_lag_p50_ms"],
        "publish_rtt_p99_ms": 1e3 * rtts[min(len(rtts) - 1, int(0.99 * len(rtts)))] if rtts else 0.0,
        "flush_interval_ms": 1e3 * config.flush_interval_s,
        "flush_every_steps": max(1, round(config.flush_interval_s * config.steps_per_s)),
        "events_per_worker_step": (central_after["num_events"] - central_before["num_events"]) / num_steps,
        "mean_blocking_call_ms": (1e3 * counters["blocking_seconds"] / counters["num_blocking_calls"]
                                  if counters["num_blocking_calls"] else 0.0),
        "num_resyncs": counters["num_resyncs"],
        "num_finished": counters["num_finished"],
        "num_pressure_requests": counters["num_pressure_requests"],
        "num_migrated_in": counters["num_migrated_in"],
        "num_indexed_hashes": central_after["num_indexed_hashes"],
    }
    result["targets"] = {key: {"target": f"{op} {bound:g}", "ok": (result[key] <= bound if op == "<=" else
                                                                     result[key] >= bound)}
                         for key, (op, bound) in TARGETS.items()}
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=2, default=str)
    return result


def format_results(result: dict) -> str:
    config = result["config"]
    lines = [
        f"kv-scale: {config['num_workers']} workers x batch {config['batch']} x context {config['context']}, "
        f"target {config['steps_per_s']:g} steps/s per worker, achieved "
        f"{result['achieved_steps_per_s_per_worker']:.1f} ({result['worker_steps']} worker-steps in "
        f"{result['window_s']:.1f} s; figures are per worker-step)",
    ]
    for key, check in result["targets"].items():
        lines.append(f"  {key:<38} {result[key]:>12.3f}   target {check['target']:<8} "
                     f"{'ok' if check['ok'] else 'MISSED'}")
    lines.append(f"  workers_supported_at_50_steps_per_s = {result['workers_supported_formula']}")
    lines.append(f"  central handler CPU {result['central_handler_cpu_us_per_worker_step']:.1f} us/worker-step "
                 f"(of {result['central_cpu_us_per_worker_step']:.1f} process CPU), "
                 f"{result['central_calls_per_worker_step']:.3f} central calls and "
                 f"{result['events_per_worker_step']:.2f} events per worker-step, lag p50 "
                 f"{result['event_lag_p50_ms']:.1f} ms")
    lines.append(f"  publish -> ack p99 {result['publish_rtt_p99_ms']:.1f} ms; a worker at pace flushes every "
                 f"{result['flush_interval_ms']:.0f} ms ({result['flush_every_steps']} steps), so its lag is at most "
                 f"{result['flush_interval_ms'] + result['publish_rtt_p99_ms']:.1f} ms")
    lines.append(f"  preemptions by mode {result['preemptions_by_mode']} "
                 f"({result['num_pressure_requests']} pressure requests, mean blocking call "
                 f"{result['mean_blocking_call_ms']:.2f} ms), resyncs {result['num_resyncs']}")
    lines.append(f"  integrity {'ok' if result['integrity_ok'] else 'FAILED: ' + '; '.join(result['integrity_errors'])}")
    return "\n".join(lines)
