"""``bench kv-scale``: what one central KV manager costs per worker-step, with many workers.

N simulated workers (``kv_sim.SimulatedKVWorker``: the real worker-side KV
code, a ``LocalKVManager`` and its event log, driven like an engine with no
model) run against the real central KV manager actor (``KVManagerService``)
on a local Ray cluster, several per Ray actor process (``SimWorkerGroup``),
each paced at ``steps_per_s``. Each worker publishes through its own
``KVPublisher`` (the worker's code, over the transport the cluster uses),
fire and forget, off the step; it asks the central manager only when it
cannot grow (one blocking ``decide_preemption`` call). With
``publish_on_tick`` (the cluster's option, ZeroMQ only) the publisher is the
cluster's: a sender thread per process, as each worker runs one, drains
and sends every worker's events just before each ``relay_flush_s`` tick of
wall time (``KVPublisher.flush_on_tick``), so a worker slower than
``steps_per_s`` (this machine) sends more batches per step than one at pace
would (at 20 steps/s and a 60 ms tick about one per step; at 50 steps/s,
one per 3). Without it, a worker sends every
``flush_interval_s`` of its own simulated time (every
``round(flush_interval_s * steps_per_s)`` steps), so a batch carries what it
would at full speed whatever this machine's pace: ``flush_interval_s`` = the
tick gives the message rate of tick publishing at pace (and a lag inflated
by the slow steps). With ``workers_per_node`` K > 0 (and
the ZeroMQ transport) every K consecutive workers are one simulated node
whose messages go through that node's relay actor (``cluster.kv_relay``, the
cluster's, N / K of them on this machine), which forwards them to central as
one bundle at every multiple of ``relay_flush_s`` of wall time; central
drains every relay's bundle just after (``workers.kv_events.wire.next_tick``). The
workers' flushes are in simulated time and the relays' in wall time: when
the simulated workers run slower than ``steps_per_s`` (a small machine), a
bundle holds fewer worker messages than it would at pace (a node's 8 workers
at 50 steps/s and 20 ms flushes send 400 messages/s: ~24 per 60 ms bundle;
at 20 steps/s, ~10), so ``central_messages_per_worker_step`` is higher here
than on a node at pace. A batch's lag counts from its oldest event: with a
flush after every step (the default) that is the step's own time, not the
pause between steps; a flush every k steps adds k - 1 of those pauses (50 ms
each at 20 steps/s here, 20 ms at pace).

Measured over ``seconds`` after a warm-up that fills every worker's batch:
- ``central_cpu_us_per_worker_step``: the central actor process's CPU time
  (``process_cpu_s``: Ray's own threads included) / all worker-steps;
- ``bytes_per_worker_step``: payload bytes both ways (event batches,
  snapshots, preemption requests and their answers, as counted by the
  central manager) / worker-steps; Ray's per-call framing is not included,
  ``central_calls_per_worker_step`` says how many calls it would add to
  (``central_zmq_replies_per_worker_step``: how many ZeroMQ replies the central side sent);
- ``blocking_calls_per_step``: blocking calls a worker made / its steps;
- ``event_lag_p99_ms``: a batch's oldest event on the worker -> the batch
  applied to the central index, wall clock, as the central manager measures
  it (it includes the simulated workers' own slowness when they cannot keep
  the pace; ``publish_rtt_p99_ms``, publish -> ack seen by the worker, is the
  delivery part, and ``flush_interval_ms + publish_rtt_p99_ms`` bounds the
  lag of a worker that keeps the pace);
- ``workers_supported_at_50_steps_per_s`` = 1e6 / (50 * central_cpu_us_per_worker_step);
  ``central_receiver_cpu_us_per_worker_step``: the event receiver thread's share
  (its wake-ups, socket reads and the handlers; the rest is ZeroMQ's I/O thread
  and Ray's threads);
- ``central_messages_per_worker_step``: messages the central socket received
  (bundles, with relays) / worker-steps; ``relay_cpu_us_per_worker_step``:
  the relay processes' CPU (``process_cpu_s``, Ray's threads included) / all
  worker-steps (``relay_thread_cpu_us_per_worker_step``: the relay threads'
  share, without ZeroMQ's I/O threads and Ray's), and ``relay_messages_per_bundle``;
- ``preemptions_by_mode`` as carried out by the workers;
- ``integrity_ok``: every pool's integrity check holds and, after a final
  flush, the central index equals the union of the workers' snapshots; and
  again, with zero blocks in use, after every sequence is finished.

If the simulated workers cannot keep up with ``steps_per_s`` on this
machine, the achieved rate is reported and every figure stays per
worker-step. With ``replay`` (``kv_replay``) each worker records its KV
code's steps before the window and replays their pool changes in it through
the real event log and publisher, which keeps the pace on a small machine
(``worker_kv_code`` says which ran). ``central_cpus`` pins the central process to those CPUs and
every other process of the run to the rest (Linux), as when the central
manager has a host of its own: on a small machine the simulated workers
otherwise take the central's CPU and caches between its wake-ups.
"""

from __future__ import annotations

import gc
import json
import math
import os
import sys
import threading
import time
from dataclasses import asdict, dataclass, fields

from .cpu_pinning import pin_threads
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
class KVScaleConfig(SimWorkload):
    """Every simulated worker's ``SimWorkload``, and how many workers run it on Ray for how long."""

    num_workers: int = 32
    seconds: float = 20.0
    workers_per_process: int = 16
    flush_interval_s: float = 0.02   # the cluster's kv_events.max_batch_age_s
    publish_on_tick: bool = False    # the cluster's kv_events.publish_on_tick (zmq only)
    warmup_timeout_s: float = 600.0
    transport: str = "zmq"   # the event stream: "zmq" (the cluster's default) or "ray" (actor calls)
    central_cpus: tuple[int, ...] = ()   # pin the central process here, everything else elsewhere
    workers_per_node: int = 8   # "zmq": workers per simulated node, each node's through one relay; 0: none
    relay_flush_s: float = 0.06   # relays' and central's tick, wall time (the cluster's kv_events.relay_flush_s)
    replay: bool = False   # workers record their KV code before the window and replay it at the pace (kv_replay)

    def workload(self) -> SimWorkload:
        return SimWorkload(**{f.name: getattr(self, f.name) for f in fields(SimWorkload)})

    @property
    def worker_ids(self) -> list[str]:
        return [f"sim-{i}" for i in range(self.num_workers)]

    @property
    def on_tick(self) -> bool:
        return self.publish_on_tick and self.transport == "zmq"

    @property
    def flush_every_steps(self) -> int:
        """Steps between ``maybe_flush`` calls (1 on a tick: the publisher decides)."""
        return 1 if self.on_tick else max(1, round(self.flush_interval_s * self.steps_per_s))

    @property
    def num_processes(self) -> int:
        return -(-self.num_workers // self.workers_per_process)

    @property
    def num_relays(self) -> int:
        if self.transport != "zmq" or self.workers_per_node <= 0:
            return 0
        return -(-self.num_workers // self.workers_per_node)

    @property
    def replay_steps(self) -> int:
        """Steps each worker records with ``replay``: the window at pace, plus its settling and
        the driver's calls around it, with room to spare."""
        return math.ceil(self.steps_per_s * (self.seconds + 15.0))

    def relay_index(self, worker_id: str) -> int:
        """The simulated node (and so the relay) of a worker."""
        return int(worker_id.rsplit("-", 1)[1]) // self.workers_per_node


class _TimedTransport:
    """A worker's ``KVTransport`` that also notes when each publish that asked for an ack
    gets it (``observe``, polled by the stepping thread between steps), for ``publish_rtt``."""

    def __init__(self, inner, rtts: list) -> None:
        self.inner = inner
        self.rtts = rtts                 # (ack seen at, seconds since sent), shared by the group
        self._watch: dict = {}           # token -> sent at

    def send(self, method: str, packed: bytes, want_ack: bool = True):
        token = self.inner.send(method, packed, want_ack)
        if want_ack:   # a quiet publish's ack is the next reply, whenever a later send asks for one
            self._watch[token] = time.perf_counter()
        return token

    def poll(self, tokens: list) -> list:
        # The publisher takes the replies here: time what came first, and stop watching what
        # ended (a watched token left behind would be asked about at every ``observe``).
        self.observe()
        ended = self.inner.poll(tokens)
        for token, _, _ in ended:
            self._watch.pop(token, None)
        return ended

    def wait(self, tokens: list, timeout_s: float) -> None:
        self.inner.wait(tokens, timeout_s)

    def call(self, method: str, packed: bytes, timeout_s: float) -> bytes:
        return self.inner.call(method, packed, timeout_s)

    @property
    def is_watching(self) -> bool:
        """Whether a publish that asked for an ack waits for it."""
        return bool(self._watch)

    def observe(self) -> None:
        if not self._watch:
            return
        ready = self.inner.ready(list(self._watch))
        now, seen_at = time.perf_counter(), time.time()
        for token in ready:
            self.rtts.append((seen_at, now - self._watch.pop(token)))


def warm_batch_fill(batch: int) -> float:
    """Decoding sequences per worker that count as a filled batch: 90 %, or one short of full
    for batches under 10. Sequences finish and are replaced all the time, so a small batch is
    rarely full on every worker at the same instant: batch 8 at 90 % asked for 8 of 8 on each
    of 4 workers, and the warm-up took 2 to 91 s."""
    return max(1.0, min(0.9 * batch, batch - 1))


class SimWorkerGroup:
    """Several simulated workers in one process, stepped by one thread at their pace.

    Each worker publishes through its own ``KVPublisher`` (the worker's code)
    over the Ray transport the cluster uses. Run as a Ray actor
    (``ray.remote(SimWorkerGroup)``); its methods are called by the driver
    while the stepping thread runs, and by other groups to hand over migrated
    sequences.
    """

    def __init__(self, config: KVScaleConfig, worker_ids: list[str], central, groups_by_worker: dict,
                 relays: list | None = None) -> None:
        from pagedserve.kvmanager.preemption import RemotePreemptionPolicy
        from pagedserve.kvmanager.publisher import KVPublisher
        from pagedserve.workers.kv_events.wire import ZmqTransport, connect_transport

        from .kv_replay import ReplayedKVWorker

        self.config = config
        self.central = central
        self.groups_by_worker = groups_by_worker   # worker id -> group index
        self.groups: list = []                      # set by connect()
        workload = config.workload()
        prefixes = workload.prefixes()
        self.publish_rtts: list[tuple[float, float]] = []
        self.workers: dict = {}   # worker id -> SimulatedKVWorker, or ReplayedKVWorker with ``replay``
        self.publishers: dict = {}
        self.transports: dict[str, _TimedTransport] = {}
        for worker_id in worker_ids:
            holder: dict = {}
            policy = RemotePreemptionPolicy(lambda request, h=holder: h["publisher"].decide_preemption(request))
            if config.replay:
                recorder = SimulatedKVWorker(worker_id, workload, prefixes, ReplayedKVWorker.recording_policy())
                worker = ReplayedKVWorker(recorder, policy)
            else:
                worker = SimulatedKVWorker(worker_id, workload, prefixes, policy)
            relay = relays[config.relay_index(worker_id)] if relays else None
            inner = connect_transport(central, config.transport, timeout_s=120.0, ack_timeout_s=10.0, relay=relay)
            if config.transport == "zmq" and not isinstance(inner, ZmqTransport):
                raise RuntimeError("--transport zmq asked, but the ZeroMQ transport is unavailable")
            if relay is not None and inner.endpoint_source is not relay:
                raise RuntimeError(f"{worker_id}: its node's KV event relay is unavailable")
            transport = _TimedTransport(inner, self.publish_rtts)
            if config.on_tick:   # the cluster's publisher: the group's sender thread sends on the tick
                holder["publisher"] = KVPublisher(worker.kv, transport, max_batch_age_s=config.flush_interval_s,
                                                  preemption_timeout_s=30.0, tick_s=config.relay_flush_s,
                                                  background=True)
            else:   # age 0: sends whatever is pending, called every ``flush_every_steps`` steps
                holder["publisher"] = KVPublisher(worker.kv, transport, max_batch_age_s=0.0,
                                                  preemption_timeout_s=30.0)
            self.workers[worker_id] = worker
            self.publishers[worker_id] = holder["publisher"]
            self.transports[worker_id] = transport
        self.flush_every_steps = config.flush_every_steps
        self.steps_since_flush = {w: 0 for w in worker_ids}
        self.inbox: list[Migration] = []
        self._inbox_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._sender: threading.Thread | None = None
        self._stop = threading.Event()
        self._paced = False
        self.error: str | None = None

    def connect(self, groups: list) -> bool:
        self.groups = groups
        return True

    def pid(self) -> int:
        return os.getpid()

    # ---- setup -----------------------------------------------------------------------
    def register(self) -> bool:
        """Every worker's first snapshot, which registers it with the central manager."""
        for worker_id, publisher in self.publishers.items():
            if not publisher.flush_and_wait(60.0):
                raise RuntimeError(f"{worker_id}: the central manager did not take the first snapshot")
        return True

    def start(self) -> bool:
        self._thread = threading.Thread(target=self._run, name="sim-workers", daemon=True)
        self._thread.start()
        if self.config.on_tick:
            # The sender thread serves every worker of the group: each of its sends lets the stepping
            # thread take the GIL, for up to a switch interval (5 ms) of CPU-bound steps, so that 16
            # sends would take ~80 ms. A worker's process has one publisher; here the sends of a
            # tick must all go before it.
            sys.setswitchinterval(0.0005)
            self._sender = threading.Thread(target=self._send, name="sim-workers-kv-sender", daemon=True)
            self._sender.start()
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
        # The warm heap (pools, queues, the batch's token lists) is long-lived: kept out of the
        # cyclic collector's full passes, as a worker would after start-up. With 16 workers in
        # one process those passes walk 16 workers' tokens (~0.4 s each here, ~10x what one
        # worker's process pays per step).
        gc.freeze()
        self._paced = True
        return True

    def counters(self) -> dict:
        if self.error:
            raise RuntimeError(self.error)
        out = {}
        for worker_id, worker in self.workers.items():
            publisher = self.publishers[worker_id]
            out[worker_id] = {**worker.counters.as_dict(), "num_blocking_calls": publisher.num_blocking_calls,
                              "blocking_seconds": publisher.blocking_seconds,
                              "num_publishes": publisher.num_batches, "num_resyncs": publisher.num_snapshots_sent}
        return out

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
            if self.config.replay:
                self._record()
            self._loop()
        except BaseException as exc:  # reported to the driver by the next call
            import traceback
            self.error = f"{exc!r}\n{traceback.format_exc()}"

    def _record(self) -> None:
        """``replay``: every worker records its steps (unpaced, before the window), then
        publishes its recording's starting state as a snapshot."""
        for worker_id, worker in self.workers.items():
            worker.record(self.config.replay_steps)
            publisher = self.publishers[worker_id]
            publisher.needs_snapshot = True
            publisher.maybe_flush()
        gc.collect()

    def _loop(self) -> None:
        period = 1.0 / self.config.steps_per_s
        due = {w: time.perf_counter() for w in self.workers}
        on_tick = self.config.on_tick   # the sender thread has the transports
        while not self._stop.is_set():
            self._deliver_inbox()
            now = time.perf_counter()
            worker_id = min(due, key=due.__getitem__)
            if self._paced:
                if due[worker_id] > now:
                    if not on_tick:
                        self._observe()
                    time.sleep(min(due[worker_id] - now, 0.005))
                    continue
                # Behind schedule: do not build up a debt to repay in a burst.
                due[worker_id] = max(due[worker_id] + period, now - period)
            else:
                due[worker_id] = now
            worker = self.workers[worker_id]
            if self.config.replay and not self._paced:
                time.sleep(0.005)   # recorded: replay at the pace only
                continue
            try:
                worker.step()
            except Exception as exc:
                if self.config.replay:
                    raise
                raise RuntimeError(f"{worker_id}: {exc!r}; " + "; ".join(
                    f"{w}: running {[r.seq_id for r in x.running]} waiting {[r.seq_id for r in x.waiting]} "
                    f"held {sorted(x.kv.block_manager_of_worker.seqs)}" for w, x in self.workers.items())) from exc
            if worker.outbox:
                self._send_migrations(worker)
            self.steps_since_flush[worker_id] += 1
            if self.steps_since_flush[worker_id] >= self.flush_every_steps:
                self.steps_since_flush[worker_id] = 0
                self.publishers[worker_id].maybe_flush()
            if not on_tick:
                self._observe()

    def _send(self) -> None:
        """On a tick: every worker's sender thread, as a worker runs one (``workers.actor.worker``):
        just before each tick it drains and sends each worker's events, and in between sends
        what the stepping thread queued (snapshots) and reads acks."""
        try:
            publishers = list(self.publishers.values())
            flush_at = publishers[0].next_flush_at()
            while not self._stop.is_set():
                time.sleep(max(0.0, min(flush_at - time.time(), 0.03)))
                if time.time() >= flush_at:
                    flush_at = publishers[0].next_flush_at()
                    for publisher in publishers:   # every batch packed first: a send yields the GIL
                        publisher.flush_on_tick()
                for publisher in publishers:
                    publisher.pump()
        except BaseException as exc:  # reported to the driver by the next call
            import traceback
            self.error = f"{exc!r}\n{traceback.format_exc()}"

    def _observe(self) -> None:
        """Note the acks that came, asking only the transports with something to read: one
        ``zmq_poll`` over the group's sockets (~20 us for 16) instead of a receive that fails
        on each (~10 us apiece, once per step: a fifth of this process's CPU)."""
        watching = [t for t in self.transports.values() if t.is_watching]
        sockets = [getattr(t.inner, "socket", None) for t in watching]
        if not watching or None in sockets:   # a Ray transport: no socket to poll
            for transport in watching:
                transport.observe()
            return
        import zmq

        readable = {id(socket) for socket, _ in zmq.zmq_poll([(s, zmq.POLLIN) for s in sockets], 0)}
        for transport, socket in zip(watching, sockets):
            if id(socket) in readable or transport.inner.has_read_replies:
                transport.observe()

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

    # ---- the end -------------------------------------------------------------------------
    def stop(self) -> bool:
        self._stop.set()
        for thread in (self._thread, self._sender):
            if thread is not None:
                thread.join()
        if self.error:
            raise RuntimeError(self.error)
        return True

    def final_flush(self) -> list[bytes]:
        """Deliver pending migrations, publish everything and wait for every ack; then check
        each pool and return the workers' packed snapshots."""
        self._deliver_inbox()
        for worker_id, publisher in self.publishers.items():
            if not publisher.flush_and_wait(120.0):
                raise RuntimeError(f"{worker_id}: the central manager did not take the final flush")
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
            if self.config.replay:   # the recording worker finished everything after recording
                used[worker_id] = worker.blocks_in_use_after_finish
                continue
            occupancy = worker.kv.occupancy()
            used[worker_id] = occupancy["device"].num_used + occupancy["host"].num_used
        return used

    def replay_status(self) -> dict:
        """``replay``: steps recorded per worker, and the workers whose recording ran out."""
        if not self.config.replay:
            return {}
        return {"steps_recorded": min(len(w.steps) for w in self.workers.values()),
                "exhausted": [w for w, worker in self.workers.items() if worker.is_exhausted]}


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


def _flush_and_check_central(central, groups: list) -> str | None:
    """Every worker flushes (and checks its pool); then the central index must equal the union
    of their snapshots and pass its own integrity check. Returns what failed centrally, or None."""
    import ray

    snapshots = [s for chunk in ray.get([g.final_flush.remote() for g in groups], timeout=600) for s in chunk]
    try:
        ray.get(central.check_consistency.remote(snapshots), timeout=600)
        ray.get(central.check_integrity.remote(), timeout=600)
    except Exception as exc:
        return str(exc)
    return None


def _split_cpus(central_cpus: tuple[int, ...]) -> tuple[set[int], set[int]]:
    """(the central's CPUs, everything else's), or ValueError naming what is wrong."""
    if not hasattr(os, "sched_setaffinity"):
        raise ValueError("--central-cpus needs Linux (os.sched_setaffinity)")
    available = os.sched_getaffinity(0)
    central = set(central_cpus)
    if not central <= available or not available - central:
        raise ValueError(f"--central-cpus {sorted(central)}: this process may run on CPUs {sorted(available)}; "
                         f"the central's must be among them and leave at least one for the rest")
    return central, available - central


def run_kv_scale(config: KVScaleConfig, out: str | None = None, log=print) -> dict:
    """Run the benchmark (starting a local Ray cluster unless one is connected)."""
    import ray

    from pagedserve.cluster.kv_central import CentralKVManager
    from pagedserve.cluster.kv_relay import KVRelay

    pinned = _split_cpus(config.central_cpus) if config.central_cpus else None
    driver_cpus = os.sched_getaffinity(0) if pinned else None
    if pinned:
        os.sched_setaffinity(0, pinned[1])   # Ray's processes started below inherit it
    owns_ray = not ray.is_initialized()
    if owns_ray:
        ray.init(address="local", include_dashboard=False, log_to_driver=False,
                 num_cpus=config.num_processes + 1)
    central = None
    groups, relays = [], []
    try:
        central_name = f"kv-scale-central-{os.getpid()}"   # the relays look it up by name
        central = ray.remote(CentralKVManager).options(num_cpus=0, max_restarts=0, name=central_name).remote(
            config.transport, config.relay_flush_s)
        ray.get(central.get_incarnation.remote(), timeout=120)
        if pinned:
            pin_threads(ray.get(central.stats.remote(), timeout=60)["pid"], pinned[0])
        worker_ids = config.worker_ids
        per = config.workers_per_process
        chunks = [worker_ids[i:i + per] for i in range(0, len(worker_ids), per)]
        groups_by_worker = {w: i for i, chunk in enumerate(chunks) for w in chunk}
        # One relay per simulated node (the cluster starts one per Ray node; here they share this one).
        relay_cls = ray.remote(KVRelay).options(num_cpus=0, max_restarts=0)
        namespace = ray.get_runtime_context().namespace
        relays = [relay_cls.remote(central_name, namespace, config.relay_flush_s, 10.0)
                  for _ in range(config.num_relays)]
        relay_pids = [s["pid"] for s in ray.get([r.stats.remote() for r in relays], timeout=120)]
        if pinned:
            for pid in relay_pids:
                pin_threads(pid, pinned[1])
        group_cls = ray.remote(SimWorkerGroup).options(num_cpus=0, max_concurrency=4)
        groups = [group_cls.remote(config, chunk, central, groups_by_worker, relays) for chunk in chunks]
        ray.get([g.connect.remote(groups) for g in groups], timeout=600)
        if pinned:
            for pid in ray.get([g.pid.remote() for g in groups], timeout=60):
                pin_threads(pid, pinned[1])
        ray.get([g.register.remote() for g in groups], timeout=600)
        # The central process's CPU with nobody calling (Ray's own threads): amortised over
        # few worker-steps when the simulated workers are slow, so reported apart.
        ray.get(central.reset_window.remote(), timeout=60)
        time.sleep(3.0)
        idle = ray.get(central.stats.remote(), timeout=60)
        idle_cpu_frac = idle["process_cpu_s"] / idle["uptime_s"]
        log(f"kv-scale: {config.num_workers} simulated workers in {len(groups)} processes, batch {config.batch}, "
            f"context {config.context}; warming up (filling every batch)")
        warm_start = time.perf_counter()
        ray.get([g.start.remote() for g in groups], timeout=60)
        num_warm = warm_batch_fill(config.batch)
        while True:
            filled = {}
            for status in ray.get([g.warm_status.remote() for g in groups], timeout=120):
                filled.update(status)
            if min(filled.values()) >= num_warm:
                break
            if time.perf_counter() - warm_start > config.warmup_timeout_s:
                raise RuntimeError(f"warm-up did not fill the batches in {config.warmup_timeout_s} s: "
                                   f"{min(filled.values())} of {config.batch} decoding on the slowest worker")
            time.sleep(1.0)
        warmup_s = time.perf_counter() - warm_start
        ray.get([g.set_paced.remote() for g in groups], timeout=60)
        time.sleep(min(2.0, config.seconds / 4))  # settle into the pace
        log(f"kv-scale: warm after {warmup_s:.0f} s; measuring {config.seconds:.0f} s")

        ray.get(central.reset_window.remote(), timeout=60)
        central_before = ray.get(central.stats.remote(), timeout=60)
        relays_before = ray.get([r.stats.remote() for r in relays], timeout=60)
        counters_before = _sum_counters(ray.get([g.counters.remote() for g in groups], timeout=60))
        window_start, window_start_wall = time.perf_counter(), time.time()
        time.sleep(config.seconds)
        central_after = ray.get(central.stats.remote(), timeout=60)
        relays_after = ray.get([r.stats.remote() for r in relays], timeout=60)
        counters_after = _sum_counters(ray.get([g.counters.remote() for g in groups], timeout=60))
        window_s = time.perf_counter() - window_start
        rtts = sorted(rtt for chunk in ray.get([g.publish_rtts_between.remote(window_start_wall, time.time())
                                                 for g in groups], timeout=60) for rtt in chunk)

        ray.get([g.stop.remote() for g in groups], timeout=120)
        replay = ray.get([g.replay_status.remote() for g in groups], timeout=60) if config.replay else []
        integrity_errors = []
        central_error = _flush_and_check_central(central, groups)
        if central_error:
            integrity_errors.append(f"after the final flush: {central_error}")
        used = {}
        for group_used in ray.get([g.finish_all.remote() for g in groups], timeout=600):
            used.update(group_used)
        leaked = {w: n for w, n in used.items() if n}
        if leaked:
            integrity_errors.append(f"blocks still in use after finishing everything: {leaked}")
        central_error = _flush_and_check_central(central, groups)
        if central_error:
            integrity_errors.append(f"after finishing everything: {central_error}")
    finally:
        for actor in groups + relays + ([central] if central is not None else []):
            ray.kill(actor)
        if owns_ray:
            ray.shutdown()
        if driver_cpus:
            os.sched_setaffinity(0, driver_cpus)

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
    relay_cpu_s = sum(a["process_cpu_s"] - b["process_cpu_s"] for a, b in zip(relays_after, relays_before))
    relay_thread_cpu_s = sum(a["thread_cpu_s"] - b["thread_cpu_s"] for a, b in zip(relays_after, relays_before))
    relay_messages = sum(a["num_messages"] - b["num_messages"] for a, b in zip(relays_after, relays_before))
    relay_bundles = sum(a["num_bundles"] - b["num_bundles"] for a, b in zip(relays_after, relays_before))
    central_messages = central_after["num_zmq_messages"] - central_before["num_zmq_messages"]
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
        "worker_kv_code": "recorded, replayed at the pace" if config.replay else "live",
        "replay_steps_recorded": min((r["steps_recorded"] for r in replay), default=0),
        "replay_workers_exhausted": sum(len(r["exhausted"]) for r in replay),
        # context for the figures above
        "achieved_steps_per_s_per_worker": num_steps / window_s / config.num_workers,
        "worker_steps": num_steps,
        "window_s": window_s,
        "warmup_s": warmup_s,
        "central_handler_cpu_us_per_worker_step": 1e6 * handler_cpu_s / num_steps,
        "central_idle_cpu_frac": idle_cpu_frac,
        "central_cpu_us_per_worker_step_less_idle": 1e6 * max(0.0, cpu_s - idle_cpu_frac * window_s) / num_steps,
        "central_calls_per_worker_step": num_calls / num_steps,
        "central_receiver_cpu_us_per_worker_step": 1e6 * (central_after["receiver_cpu_s"]
                                                          - central_before["receiver_cpu_s"]) / num_steps,
        "central_zmq_replies_per_worker_step": (central_after["num_zmq_replies"]
                                            - central_before["num_zmq_replies"]) / num_steps,
        "central_messages_per_worker_step": central_messages / num_steps,
        "central_drains_per_s": (central_after["num_zmq_drains"] - central_before["num_zmq_drains"]) / window_s,
        "num_relays": len(relays),
        "relay_cpu_us_per_worker_step": 1e6 * relay_cpu_s / num_steps,
        "relay_thread_cpu_us_per_worker_step": 1e6 * relay_thread_cpu_s / num_steps,
        "relay_messages_per_bundle": relay_messages / relay_bundles if relay_bundles else 0.0,
        "relay_flush_ms": 1e3 * config.relay_flush_s if relays else 0.0,
        "event_lag_p50_ms": central_after["event_lag_p50_ms"],
        "event_delivery_p50_ms": central_after["event_delivery_p50_ms"],
        "event_delivery_p99_ms": central_after["event_delivery_p99_ms"],
        "publish_rtt_p99_ms": 1e3 * rtts[min(len(rtts) - 1, int(0.99 * len(rtts)))] if rtts else 0.0,
        "publish_on_tick": config.on_tick,
        "flush_interval_ms": 1e3 * config.flush_interval_s,
        "flush_every_steps": config.flush_every_steps,
        "worker_batches_per_worker_step": counters["num_publishes"] / num_steps,
        "events_per_worker_step": (central_after["num_events"] - central_before["num_events"]) / num_steps,
        "mean_blocking_call_ms": (1e3 * counters["blocking_seconds"] / counters["num_blocking_calls"]
                                  if counters["num_blocking_calls"] else 0.0),
        "num_resyncs": counters["num_resyncs"],
        "num_finished": counters["num_finished"],
        "num_pressure_requests": counters["num_pressure_requests"],
        "num_migrated_in": counters["num_migrated_in"],
        "num_indexed_hashes": central_after["num_indexed_hashes"],
        # per thread role (Linux): receiver (its handler included), main (Ray's task loop), zeromq, other
        "central_cpu_us_per_worker_step_by_thread": _per_step(central_after.get("cpu_by_thread_s", {}),
                                                              central_before.get("cpu_by_thread_s", {}), num_steps),
        "relay_cpu_us_per_worker_step_by_thread": _per_step(
            _sum_roles(r.get("cpu_by_thread_s", {}) for r in relays_after),
            _sum_roles(r.get("cpu_by_thread_s", {}) for r in relays_before), num_steps),
    }
    result["targets"] = {key: {"target": f"{op} {bound:g}", "ok": (result[key] <= bound if op == "<=" else
                                                                     result[key] >= bound)}
                         for key, (op, bound) in TARGETS.items()}
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=2, default=str)
    return result


def _sum_roles(per_process) -> dict[str, float]:
    totals: dict[str, float] = {}
    for roles in per_process:
        for role, seconds in roles.items():
            totals[role] = totals.get(role, 0.0) + seconds
    return totals


def _per_step(after: dict[str, float], before: dict[str, float], num_steps: int) -> dict[str, float]:
    """CPU us per worker-step per thread role, over the window."""
    return {role: 1e6 * (seconds - before.get(role, 0.0)) / num_steps for role, seconds in sorted(after.items())}


def _roles_line(per_role: dict[str, float]) -> str:
    return ", ".join(f"{role} {us:.1f}" for role, us in per_role.items())


def format_results(result: dict) -> str:
    config = result["config"]
    lines = [
        f"kv-scale: {config['num_workers']} workers x batch {config['batch']} x context {config['context']}, "
        f"events over {config.get('transport', 'ray')}, "
        f"target {config['steps_per_s']:g} steps/s per worker, achieved "
        f"{result['achieved_steps_per_s_per_worker']:.1f} ({result['worker_steps']} worker-steps in "
        f"{result['window_s']:.1f} s; figures are per worker-step)"
        + (f"; central pinned to CPUs {list(config['central_cpus'])}, the rest elsewhere"
           if config.get("central_cpus") else ""),
    ]
    if config.get("replay"):
        lines.append(f"  workers replay a recording of their own KV code ({result['replay_steps_recorded']} steps "
                     f"each, made before the window; {result['replay_workers_exhausted']} ran out)")
    for key, check in result["targets"].items():
        lines.append(f"  {key:<38} {result[key]:>12.3f}   target {check['target']:<8} "
                     f"{'ok' if check['ok'] else 'MISSED'}")
    lines.append(f"  workers_supported_at_50_steps_per_s = {result['workers_supported_formula']}")
    lines.append(f"  central handler CPU {result['central_handler_cpu_us_per_worker_step']:.1f} us/worker-step "
                 f"(receiver thread {result['central_receiver_cpu_us_per_worker_step']:.1f}, "
                 f"of {result['central_cpu_us_per_worker_step']:.1f} process CPU; "
                 f"{result['central_cpu_us_per_worker_step_less_idle']:.1f} less the process's idle "
                 f"{100 * result['central_idle_cpu_frac']:.1f}% of a core), "
                 f"{result['central_calls_per_worker_step']:.3f} central calls and "
                 f"{result['events_per_worker_step']:.2f} events per worker-step, lag p50 "
                 f"{result['event_lag_p50_ms']:.1f} ms (from the worker's drain: p50 "
                 f"{result['event_delivery_p50_ms']:.1f}, p99 {result['event_delivery_p99_ms']:.1f} ms)")
    if result.get("central_cpu_us_per_worker_step_by_thread"):
        lines.append("  central CPU us/worker-step by thread: "
                     + _roles_line(result["central_cpu_us_per_worker_step_by_thread"]))
    if result.get("relay_cpu_us_per_worker_step_by_thread"):
        lines.append("  relays' CPU us/worker-step by thread: "
                     + _roles_line(result["relay_cpu_us_per_worker_step_by_thread"]))
    if result.get("num_relays"):
        lines.append(f"  {result['num_relays']} relays ({config['workers_per_node']} workers each, bundles every "
                     f"{result['relay_flush_ms']:.0f} ms of wall time, {result['relay_messages_per_bundle']:.1f} "
                     f"messages per bundle): relay CPU {result['relay_cpu_us_per_worker_step']:.1f} us/worker-step "
                     f"(processes, all relays; their relay threads "
                     f"{result['relay_thread_cpu_us_per_worker_step']:.1f}), central messages "
                     f"{result['central_messages_per_worker_step']:.3f} per worker-step")
    else:
        lines.append(f"  no relays: central messages {result['central_messages_per_worker_step']:.3f} "
                     f"per worker-step")
    if result["publish_on_tick"]:
        lines.append(f"  publish -> ack p99 {result['publish_rtt_p99_ms']:.1f} ms; workers publish just before "
                     f"each {1e3 * result['config']['relay_flush_s']:.0f} ms tick: "
                     f"{result['worker_batches_per_worker_step']:.3f} batches per worker-step")
    else:
        lines.append(f"  publish -> ack p99 {result['publish_rtt_p99_ms']:.1f} ms; a worker at pace flushes every "
                     f"{result['flush_interval_ms']:.0f} ms ({result['flush_every_steps']} steps), so its lag is at "
                     f"most {result['flush_interval_ms'] + result['publish_rtt_p99_ms']:.1f} ms")
    lines.append(f"  preemptions by mode {result['preemptions_by_mode']} "
                 f"({result['num_pressure_requests']} pressure requests, mean blocking call "
                 f"{result['mean_blocking_call_ms']:.2f} ms), resyncs {result['num_resyncs']}")
    lines.append(f"  integrity {'ok' if result['integrity_ok'] else 'FAILED: ' + '; '.join(result['integrity_errors'])}")
    return "\n".join(lines)
