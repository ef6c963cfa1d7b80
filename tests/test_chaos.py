"""Chaos: faults injected one at a time into a two-worker cluster under a steady
streaming load, with recovery in between.

Faults: ``ray.kill`` of each worker in turn (two kills; ten under ``--long-form``), a
kill of the KV manager, removal of a worker's node followed by a replacement
node (what an autoscaler does; nothing in pagedserve is called), and a worker
stalled past its stall timeout (``Worker.inject_stall``, enabled for this
module only through ``PAGEDSERVE_ENABLE_FAULT_INJECTION``); last, a kill of
every worker at once. The whole schedule runs three times under ``--long-form``.

Pass: every request completes with exactly the single-process engine's
greedy output, or gets a retryable ``NoCapacityError`` (the server's 503)
only while no worker is alive: between killing every worker and the first
one being back; after each fault the cluster is back at full strength
without intervention; nothing leaks. Per fault the test prints recovery time (fault
until every worker answers its heartbeat, is registered with the KV manager
and the restarted one has run a step), requests completed and failed, and
tokens recomputed (prompt + generated tokens re-prefilled by resumed requests).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import threading
import time
from dataclasses import asdict, dataclass, field

import pytest

ray = pytest.importorskip("ray")

from pagedserve.cluster.handle import NoCapacityError  # noqa: E402
from pagedserve.cluster.serving.errors import error_from_exception  # noqa: E402
from pagedserve.workers.sample.sampling_params import SamplingParams  # noqa: E402
from pagedserve.workers.actor.worker import FAULT_INJECTION_ENV, stall_timeout_s  # noqa: E402

pytestmark = [pytest.mark.chaos, pytest.mark.distributed, pytest.mark.timeout(1800)]

RAY_WORKER_NODES = 2
RAY_ENV_VARS = {FAULT_INJECTION_ENV: "1"}
ENGINE = {"num_device_blocks": 192, "swap_space_gb": 0.001}
STEP_TIMEOUT_S = 4.0
NUM_CLIENTS = 8
NUM_PROMPTS = 24
SETTLE_S = 1.0               # load keeps running this long after each recovery
RETRY_AFTER_S = 0.5          # a client's pause after a 503
ALL_WORKERS_FAULT = "ray.kill every worker"   # the one fault that leaves no capacity
REPORT_PATH = os.environ.get("PAGEDSERVE_CHAOS_REPORT")


@dataclass
class LoadCounters:
    num_completed: int = 0
    num_failed: int = 0          # an exception other than NoCapacityError, or a wrong output
    num_no_capacity: int = 0     # NoCapacityError: the server's retryable 503
    failures: list[str] = field(default_factory=list)
    no_capacity_times: list[float] = field(default_factory=list)


@dataclass
class FaultReport:
    fault: str
    fault_time: float
    recovery_s: float
    first_back_s: float | None   # until a restarted worker was routable again
    restart_s: float | None      # until the last restarted actor finished its __init__
    num_completed: int
    num_failed: int
    num_no_capacity: int
    num_recomputed_tokens: int
    num_resumed: int


# ---- fixtures -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def workload(tiny_model):
    """Greedy prompts with their references from the single-process ``LLM``."""
    from pagedserve.workers.offline.llm import LLM

    rng = random.Random(8)
    shared = [rng.randrange(3, 1000) for _ in range(48)]
    prompts, max_tokens = [], []
    for i in range(NUM_PROMPTS):
        own = [rng.randrange(3, 1000) for _ in range(rng.randrange(4, 100))]
        prompts.append(shared + own if i % 3 == 0 else own)
        max_tokens.append(rng.randrange(16, 49))
    llm = LLM(tiny_model("llama"), **ENGINE)
    outputs = llm.generate(prompts, [_greedy(n) for n in max_tokens])
    llm.check_integrity()
    references = [list(o.outputs[0].token_ids) for o in outputs]
    return list(zip(prompts, max_tokens, references))


@pytest.fixture(scope="module")
def handle(ray_cluster, tiny_model):
    from pagedserve.cluster.bootstrap import start

    config = {"model": {"path": tiny_model("llama")}, "engine": ENGINE,
              "workers": [{"count": RAY_WORKER_NODES, "num_gpus": 1, "num_cpus": 1}],
              "step_timeout_s": STEP_TIMEOUT_S}
    handle = start(config, ready_timeout_s=180.0)
    yield handle
    handle.shutdown()


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


# ---- the load -----------------------------------------------------------------------------
class SteadyLoad:
    """``NUM_CLIENTS`` closed-loop streaming clients in a background thread."""

    def __init__(self, handle, workload) -> None:
        self.handle = handle
        self.workload = workload
        self.counters = LoadCounters()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def start(self) -> "SteadyLoad":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=300)
        assert not self._thread.is_alive(), "the load did not stop"

    def snapshot(self) -> LoadCounters:
        with self._lock:
            return LoadCounters(self.counters.num_completed, self.counters.num_failed,
                                self.counters.num_no_capacity)

    async def _run(self) -> None:
        await asyncio.gather(*(self._client(i) for i in range(NUM_CLIENTS)))

    async def _client(self, index: int) -> None:
        rng = random.Random(index)
        num = 0
        while not self._stop.is_set():
            prompt, max_tokens, reference = rng.choice(self.workload)
            outcome = await self._one(prompt, max_tokens, reference, f"chaos-{index}-{num}")
            answered_at = time.time()  # stamped before the client's pause below
            num += 1
            with self._lock:
                if outcome == "ok":
                    self.counters.num_completed += 1
                elif outcome == "no_capacity":
                    self.counters.num_no_capacity += 1
                    self.counters.no_capacity_times.append(answered_at)
                else:
                    self.counters.num_failed += 1
                    self.counters.failures.append(outcome)
            if outcome == "no_capacity":
                await asyncio.sleep(RETRY_AFTER_S)

    async def _one(self, prompt, max_tokens, reference, request_id) -> str:
        last = None
        try:
            async for output in self.handle.generate(prompt, _greedy(max_tokens), request_id=request_id):
                last = output
        except NoCapacityError as exc:
            error = error_from_exception(exc)
            if error.status != 503 or "Retry-After" not in (error.headers or {}):
                return f"{request_id}: NoCapacityError maps to {error.status} {error.headers}"
            return "no_capacity"
        except Exception as exc:
            return f"{request_id}: {exc!r}"
        if last is None or not last.finished:
            return f"{request_id}: unfinished"
        if list(last.outputs[0].token_ids) != reference:
            return f"{request_id}: output differs from the reference"
        return "ok"


# ---- recovery -----------------------------------------------------------------------------
@dataclass
class Recovery:
    recovery_s: float               # until full strength
    first_back_s: float | None      # until a restarted worker was routable again
    restart_s: float | None         # until the last restarted actor finished its __init__


def _heartbeats(handle, timeout: float = 1.0) -> dict[str, dict | None]:
    """Each worker's heartbeat, or None if it did not answer within ``timeout``."""
    refs = {w: actor.heartbeat.remote() for w, actor in handle.workers.items()}
    ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout)
    beats: dict[str, dict | None] = {}
    for worker_id, ref in refs.items():
        try:
            beats[worker_id] = ray.get(ref) if ref in ready else None
        except Exception:
            beats[worker_id] = None
    return beats


def _full_strength(handle, beats: dict, restarted: dict[str, int], kv_incarnation: str | None) -> bool:
    """Every worker answers unstalled and is routable and registered; each worker in
    ``restarted`` (id -> old pid) runs a new process that has taken a step; the KV
    manager is not ``kv_incarnation`` (when given)."""
    if any(beat is None or beat["is_stalled"] for beat in beats.values()):
        return False
    try:
        registered = set(ray.get(handle.kv_manager.worker_ids.remote(), timeout=STEP_TIMEOUT_S))
        incarnation = ray.get(handle.kv_manager.get_incarnation.remote(), timeout=STEP_TIMEOUT_S)
    except Exception:
        return False
    if handle.health.alive_workers() != set(handle.workers) or registered != set(handle.workers):
        return False
    if kv_incarnation is not None and incarnation == kv_incarnation:
        return False
    return all(beats[w]["pid"] != pid and beats[w]["num_steps"] > 0 for w, pid in restarted.items())


def _wait_recovered(handle, fault_time: float, restarted: dict[str, int],
                    kv_incarnation: str | None = None, timeout: float = 180.0) -> Recovery:
    first_back = None
    while True:
        now = time.time()
        beats = _heartbeats(handle)
        reborn = {w: b for w, b in beats.items() if w in restarted and b and b["pid"] != restarted[w]}
        if first_back is None and set(reborn) & handle.health.alive_workers():
            first_back = now - fault_time
        if _full_strength(handle, beats, restarted, kv_incarnation):
            restart_s = max((b["started_at"] - fault_time for b in reborn.values()), default=None)
            return Recovery(now - fault_time, first_back, restart_s)
        if now - fault_time > timeout:
            raise AssertionError(f"not back at full strength {timeout:.0f} s after the fault: "
                                 f"{handle.stats()['health']}")
        time.sleep(0.1)


def _pids(handle) -> dict[str, int]:
    beats = _heartbeats(handle, timeout=STEP_TIMEOUT_S)
    assert all(beats.values()), f"a worker is down before the fault: {beats}"
    return {w: beat["pid"] for w, beat in beats.items()}


def _node_of(handle, worker_id: str, ray_cluster):
    node_id = ray.get(handle.workers[worker_id].info.remote(), timeout=30)["node_id"]
    return next(node for node in ray_cluster.worker_nodes if node.node_id == node_id)


# ---- faults: each returns (fault time, restarted workers {id: old pid}, old KV incarnation)
def kill_worker(handle, ray_cluster, worker_id: str):
    old_pid = _pids(handle)[worker_id]
    ray.kill(handle.workers[worker_id], no_restart=False)
    return time.time(), {worker_id: old_pid}, None


def kill_kv_manager(handle, ray_cluster):
    incarnation = ray.get(handle.kv_manager.get_incarnation.remote(), timeout=30)
    ray.kill(handle.kv_manager, no_restart=False)
    return time.time(), {}, incarnation


def replace_node(handle, ray_cluster, worker_id: str):
    old_pid = _pids(handle)[worker_id]
    node = _node_of(handle, worker_id, ray_cluster)
    fault_time = time.time()
    ray_cluster.remove_node(node)
    time.sleep(1.0)  # the autoscaler notices, then brings up a replacement
    ray_cluster.add_node(num_cpus=2, num_gpus=1)
    return fault_time, {worker_id: old_pid}, None


def kill_every_worker(handle, ray_cluster):
    old_pids = _pids(handle)
    for worker in handle.workers.values():
        ray.kill(worker, no_restart=False)
    return time.time(), old_pids, None


def stall_worker(handle, ray_cluster, worker_id: str):
    old_pid = _pids(handle)[worker_id]
    ray.get(handle.workers[worker_id].inject_stall.remote(3 * stall_timeout_s(STEP_TIMEOUT_S)), timeout=30)
    return time.time(), {worker_id: old_pid}, None


def _schedule(handle, long_form: bool) -> list[tuple[str, object, tuple]]:
    worker_ids = sorted(handle.workers)
    num_kills = 10 if long_form else 2   # each worker once
    schedule = [(f"ray.kill {worker_ids[i % 2]}", kill_worker, (worker_ids[i % 2],))
                for i in range(num_kills)]
    schedule += [("kill KV manager", kill_kv_manager, ()),
                 (f"remove node of {worker_ids[1]}, add a replacement", replace_node, (worker_ids[1],)),
                 (f"stall {worker_ids[0]} past its timeout", stall_worker, (worker_ids[0],)),
                 (ALL_WORKERS_FAULT, kill_every_worker, ())]
    return schedule * (3 if long_form else 1)


# ---- the test -----------------------------------------------------------------------------
def _run_fault(handle, ray_cluster, load: SteadyLoad, name: str, inject, args) -> FaultReport:
    handle.wait_healthy(timeout=60)
    time.sleep(1.0)  # streams under way on both workers
    before, stats_before = load.snapshot(), handle.stats()
    fault_time, restarted, kv_incarnation = inject(handle, ray_cluster, *args)
    recovery = _wait_recovered(handle, fault_time, restarted, kv_incarnation)
    time.sleep(SETTLE_S)
    after, stats_after = load.snapshot(), handle.stats()
    return FaultReport(
        name, fault_time, recovery.recovery_s, recovery.first_back_s, recovery.restart_s,
        after.num_completed - before.num_completed, after.num_failed - before.num_failed,
        after.num_no_capacity - before.num_no_capacity,
        stats_after["num_recomputed_tokens"] - stats_before["num_recomputed_tokens"],
        stats_after["num_resumed"] - stats_before["num_resumed"])


def _fmt(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.1f}"


def _print_reports(reports: list[FaultReport], total: LoadCounters) -> None:
    print("\nfault | recovery s | restarted actor up s | completed | failed | 503 | resumed | tokens recomputed")
    for r in reports:
        print(f"{r.fault} | {r.recovery_s:.1f} | {_fmt(r.restart_s)} | {r.num_completed} | "
              f"{r.num_failed} | {r.num_no_capacity} | {r.num_resumed} | {r.num_recomputed_tokens}")
    print(f"total: {total.num_completed} completed, {total.num_failed} failed, "
          f"{total.num_no_capacity} 503")
    if REPORT_PATH:
        with open(REPORT_PATH, "w") as f:
            json.dump({"faults": [asdict(r) for r in reports],
                       "total": {k: v for k, v in asdict(total).items() if k != "no_capacity_times"}},
                      f, indent=1)


def _no_capacity_windows(reports: list[FaultReport]) -> list[tuple[float, float]]:
    """When no worker could take a request: from killing every worker until one was back
    (plus a second for the monitor's poll)."""
    return [(r.fault_time, r.fault_time + r.first_back_s + 1.0)
            for r in reports if r.fault == ALL_WORKERS_FAULT]


def test_faults_under_load_lose_nothing_and_the_cluster_heals(handle, ray_cluster, workload, long_form):
    handle.wait_healthy(timeout=60)
    load = SteadyLoad(handle, workload).start()
    reports = []
    try:
        for name, inject, args in _schedule(handle, long_form):
            reports.append(_run_fault(handle, ray_cluster, load, name, inject, args))
    finally:
        load.stop()
    total = load.counters
    _print_reports(reports, total)

    assert total.num_failed == 0, total.failures[:10]
    windows = _no_capacity_windows(reports)
    stray = [t for t in total.no_capacity_times if not any(lo <= t <= hi for lo, hi in windows)]
    assert not stray, f"503s while a worker could take requests: {stray} (windows {windows})"
    assert total.num_completed >= 10 * len(reports)
    kills = [r for r in reports if r.fault.startswith("ray.kill")]
    assert sum(r.num_resumed for r in kills) >= 1, "the kills should land on running requests"
    assert sum(r.num_recomputed_tokens for r in reports) > 0
    stats = handle.stats()
    stall_restarts = sum(h["num_restarts_requested"] for h in stats["health"].values())
    assert stall_restarts == (3 if long_form else 1), stats["health"]

    handle.wait_idle(timeout=120.0)
    handle.check_integrity()
    assert handle.num_used_blocks() == 0
    assert handle.wait_healthy(timeout=60) < 60


def test_worker_drained_mid_stream_under_load_loses_nothing(handle, workload):
    """The scale-down fault: a worker drained while streams run on it. Its running sequences
    move to the other worker through KV migration (none resumes by recompute), none fails,
    every output equals the reference, and it leaves the KV manager's accounting empty."""
    handle.wait_healthy(timeout=60)
    victim = sorted(handle.workers)[-1]
    load = SteadyLoad(handle, workload).start()
    try:
        _wait_busy = time.time() + 60
        while ray.get(handle.workers[victim].num_unfinished.remote(), timeout=30) < 2:
            assert time.time() < _wait_busy, "the load should reach the victim"
            time.sleep(0.05)
        # The pool drains only a worker it holds ready; after the faults of the test before,
        # its control loop may still hold the restarted victim dead until its next status probe.
        while handle.worker_states()["workers"][victim]["state"] != "ready":
            assert time.time() < _wait_busy, handle.worker_states()["workers"][victim]
            time.sleep(0.05)
        stats_before = handle.stats()
        assert ray.get(handle.controller.drain_worker.remote(victim), timeout=30)
        deadline = time.time() + 120
        while (record := handle.worker_states()["workers"][victim])["state"] != "dead":
            assert record["state"] == "draining", record
            assert time.time() < deadline, f"{victim} still draining: {record}"
            time.sleep(0.2)
        time.sleep(SETTLE_S)  # the load goes on over the remaining worker
    finally:
        load.stop()
    stats_after = handle.stats()
    total = load.counters
    assert total.num_failed == 0 and total.num_no_capacity == 0, total.failures[:10]
    assert record["reason"] == "drained" and record["num_drain_migrations"] >= 1, record
    assert stats_after["num_resumed"] == stats_before["num_resumed"], "nothing restarts from scratch"
    assert stats_after["num_recomputed_tokens"] == stats_before["num_recomputed_tokens"]
    assert victim not in handle.workers
    assert victim not in ray.get(handle.kv_manager.worker_ids.remote(), timeout=30)
    print(f"\ndrain {victim} under load: {record['num_drain_migrations']} sequences migrated, "
          f"{total.num_completed} requests completed, 0 failed")
    handle.wait_idle(timeout=120.0)
    handle.check_integrity()
    assert handle.num_used_blocks() == 0
