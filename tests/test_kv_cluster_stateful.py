"""Property-based tests of two-level KV management: workers' local pools and the central index.

A hypothesis state machine plays a small cluster, in one process: two or three
workers, each a ``LocalKVManager`` with an ``EventLog`` and its engine-side
queues, and one central ``KVManagerService``. Messages between them sit in a
per-worker queue until delivered, so the machine can lose a batch, take the
central manager down and restart it empty, kill a worker or start a new one,
while requests are admitted (many share prefixes), forked, grown, finished,
aborted and preempted by swap, recompute or migration (decided centrally
while the central manager is up, locally while it is down).

After every flush of every worker (the central manager brought back if
down, resyncs answered), the central index and occupancy must equal the
workers' pools exactly. After every operation each pool's integrity check
holds, and a simulated device checks that every block table really holds its
sequence's tokens (imported KV included).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition, rule,
                                 run_state_machine_as_test)

from pagedserve.kvmanager import NewSequence, PoolConfig, StepInput, StepOutput
from pagedserve.kvmanager.events import EventLog, PublishAck
from pagedserve.kvmanager.local_manager import LocalKVManager
from pagedserve.kvmanager.preemption import PreemptionDecision, RemotePreemptionPolicy
from pagedserve.kvmanager.service import KVManagerService

from kv_simulator import SimulatedWorker

MAX_MODEL_LEN = 40
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 50, 51], [70, 71, 72, 73, 74, 75, 76, 77]]
NUM_EXAMPLES = 60
LONG_FORM_FACTOR = 10


class CentralDown(Exception):
    """The central manager cannot be reached (its actor is dead)."""


@dataclass
class SimWorker:
    """One worker: its local KV manager, a simulated device, its queues and its outbox."""

    worker_id: str
    kv: LocalKVManager
    device: SimulatedWorker
    running: list[str] = field(default_factory=list)
    waiting: list[str] = field(default_factory=list)
    computed: dict[str, int] = field(default_factory=dict)
    forked: set[str] = field(default_factory=set)          # never migrated (like n > 1 requests)
    pending: StepInput | None = None
    in_transit: list[tuple[str, bytes]] = field(default_factory=list)  # ("batch" | "snapshot", packed)

    @property
    def tokens(self) -> dict[str, list[int]]:
        return self.device.tokens


class KVClusterMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.workers: dict[str, SimWorker] = {}
        self.central = KVManagerService()
        self.central_up = True
        self.num_created = 0
        self.num_workers_created = 0
        self.config: PoolConfig | None = None

    @property
    def ready(self) -> bool:
        return self.config is not None

    # ---- the central manager, as workers reach it ----------------------------------------
    def _call_central(self, method: str, packed: bytes) -> bytes:
        if not self.central_up:
            raise CentralDown(method)
        return getattr(self.central, method)(packed)

    def _new_worker(self, mode) -> None:
        worker_id = f"w{self.num_workers_created}"
        self.num_workers_created += 1

        def decide(request):
            return PreemptionDecision.unpack(self._call_central("decide_preemption", request.pack()))

        kv = LocalKVManager(RemotePreemptionPolicy(decide, backoff_s=0.0), EventLog(worker_id))
        config = PoolConfig(**{**asdict(self.config), "preemption_mode": mode})
        kv.add_worker(worker_id, config)
        worker = SimWorker(worker_id, kv, SimulatedWorker(kv, worker_id), pending=StepInput(worker_id))
        self.workers[worker_id] = worker
        worker.in_transit.append(("snapshot", kv.snapshot().pack()))
        if self.central_up:
            self.central.register_worker(worker_id, asdict(config))
            self._deliver(worker)

    @initialize(block_size=st.sampled_from([2, 4]), num_device=st.integers(6, 16), num_host=st.integers(0, 10),
                modes=st.lists(st.sampled_from([None, "swap", "recompute"]), min_size=1, max_size=2))
    def configure(self, block_size, num_device, num_host, modes) -> None:
        """Two or three workers; the first may migrate (its preemption mode is the policy's choice)."""
        modes = [None] + modes
        self.config = PoolConfig(num_device_blocks=num_device, num_host_blocks=num_host, block_size=block_size,
                                 max_model_len=MAX_MODEL_LEN, watermark=0.0)
        for mode in modes:
            self._new_worker(mode)

    def _worker(self, data) -> SimWorker:
        return self.workers[data.draw(st.sampled_from(sorted(self.workers)))]

    # ---- requests --------------------------------------------------------------------------
    @precondition(lambda self: self.ready)
    @rule(data=st.data(), prompts=st.lists(st.tuples(st.sampled_from(range(len(PREFIXES))),
                                                     st.lists(st.integers(0, 99), max_size=16)),
                                           min_size=1, max_size=3))
    def admit(self, data, prompts) -> None:
        worker = self._worker(data)
        for prefix, suffix in prompts:
            seq_id = f"s{self.num_created}"
            self.num_created += 1
            tokens = (PREFIXES[prefix] + suffix)[:MAX_MODEL_LEN - 2]
            worker.pending.new_sequences.append(NewSequence(seq_id, tokens))
            worker.tokens[seq_id] = list(tokens)
            worker.waiting.append(seq_id)
            worker.computed[seq_id] = 0

    @staticmethod
    def _sampling(worker: SimWorker) -> list[str]:
        return [s for s in worker.running if worker.computed[s] == len(worker.tokens[s])]

    @precondition(lambda self: self.ready)
    @rule(data=st.data())
    def fork(self, data) -> None:
        worker = self._worker(data)
        candidates = [s for s in self._sampling(worker) if s not in dict(worker.pending.appended)]
        if not candidates:
            return
        parent = data.draw(st.sampled_from(candidates))
        child = f"s{self.num_created}"
        self.num_created += 1
        worker.pending.forks.append((parent, child))
        worker.tokens[child] = list(worker.tokens[parent])
        worker.running.insert(worker.running.index(parent) + 1, child)
        worker.computed[child] = worker.computed[parent]
        worker.forked |= {parent, child}

    @precondition(lambda self: self.ready)
    @rule(data=st.data())
    def finish_or_abort(self, data) -> None:
        worker = self._worker(data)
        live = worker.running + worker.waiting
        if not live:
            return
        seq_id = data.draw(st.sampled_from(live))
        if any(seq_id in fork for fork in worker.pending.forks) or seq_id in [
                n.seq_id for n in worker.pending.new_sequences]:
            return  # not in the step that made it
        self._drop(worker, seq_id)
        worker.pending.finished.append(seq_id)
        worker.pending.appended = [(s, t) for s, t in worker.pending.appended if s != seq_id]

    @staticmethod
    def _drop(worker: SimWorker, seq_id: str) -> None:
        (worker.running if seq_id in worker.running else worker.waiting).remove(seq_id)
        del worker.computed[seq_id]
        worker.tokens.pop(seq_id)
        worker.forked.discard(seq_id)

    # ---- the step ----------------------------------------------------------------------------
    @precondition(lambda self: self.ready)
    @rule(data=st.data(), budget=st.integers(1, 40))
    def step(self, data, budget) -> None:
        self._step(self._worker(data), budget, data)

    @precondition(lambda self: self.ready)
    @rule(data=st.data(), budgets=st.lists(st.integers(1, 40), min_size=1, max_size=4))
    def step_every_worker(self, data, budgets) -> None:
        for budget in budgets:
            for worker in list(self.workers.values()):
                self._step(worker, budget, data)

    def _step(self, worker: SimWorker, budget: int, data) -> None:
        appended = dict(worker.pending.appended)
        for seq_id in self._sampling(worker):
            if seq_id not in appended and len(worker.tokens[seq_id]) < MAX_MODEL_LEN:
                appended[seq_id] = [data.draw(st.integers(0, 99))]
        step_input = worker.pending
        step_input.appended = list(appended.items())
        step_input.running = list(worker.running)
        step_input.waiting = list(worker.waiting)
        step_input.token_budget = budget
        step_input.migratable = [s for s in worker.running if s not in worker.forked]
        worker.pending = StepInput(worker.worker_id)
        for seq_id, tokens in step_input.appended:
            worker.tokens[seq_id].extend(tokens)
        output = worker.kv.step(step_input)
        self._execute(worker, output)
        for preemption in output.preempted:
            event(f"preempt-{preemption.mode}")
            seq_id = preemption.seq_id
            if preemption.mode == "migrate":
                self._migrate(worker, seq_id, preemption.target_worker)
                continue
            worker.running.remove(seq_id)
            worker.waiting.insert(0, seq_id)
            if preemption.mode == "recompute":
                worker.computed[seq_id] = 0
        for sched in output.scheduled:
            worker.computed[sched.seq_id] = sched.start + sched.num_tokens
            if sched.seq_id in worker.waiting:
                worker.waiting.remove(sched.seq_id)
                worker.running.append(sched.seq_id)
        assert output.num_scheduled_tokens <= budget
        for seq_id in list(worker.running):
            if (len(worker.tokens[seq_id]) >= MAX_MODEL_LEN
                    and worker.computed[seq_id] == len(worker.tokens[seq_id])):
                self._drop(worker, seq_id)
                worker.pending.finished.append(seq_id)

    @staticmethod
    def _execute(worker: SimWorker, output: StepOutput) -> None:
        """Copies first, then the KV of imported (migrated) tokens, then the forward pass."""
        device = worker.device
        for device_block, host_block in output.swap_out:
            device.host[host_block] = list(device.device[device_block])
        for host_block, device_block in output.swap_in:
            device.device[device_block] = list(device.host[host_block])
        for src, dst in output.copy_on_write:
            device.device[dst] = list(device.device[src])
        bs = device.block_size
        for sched in output.scheduled:
            tokens = worker.tokens[sched.seq_id]
            for pos in range(sched.num_imported_tokens):
                device.device[sched.block_table[pos // bs]][pos % bs] = tokens[pos]
        device.execute(StepOutput(scheduled=output.scheduled))

    def _migrate(self, source: SimWorker, seq_id: str, target_id: str) -> None:
        """The source forgot ``seq_id``; its tokens and computed KV move to ``target_id``."""
        tokens = source.tokens[seq_id]
        num_computed = source.computed[seq_id]
        self._drop(source, seq_id)
        target = self.workers.get(target_id)
        assert target_id != source.worker_id
        if target is None:
            event("migrated to a dead worker (request fails over)")
            return
        num_imported = min(num_computed, len(tokens) - 1)
        target.pending.new_sequences.append(NewSequence(seq_id, list(tokens), num_imported_tokens=num_imported))
        target.tokens[seq_id] = list(tokens)
        target.waiting.insert(0, seq_id)
        target.computed[seq_id] = num_imported

    # ---- the event wire --------------------------------------------------------------------
    @precondition(lambda self: self.ready)
    @rule(data=st.data())
    def flush(self, data) -> None:
        self._flush(self._worker(data))

    @staticmethod
    def _flush(worker: SimWorker) -> None:
        if worker.kv.event_log.needs_snapshot:
            worker.in_transit.append(("snapshot", worker.kv.snapshot().pack()))
        else:
            worker.in_transit.append(("batch", worker.kv.drain_events().pack()))

    @precondition(lambda self: self.ready)
    @rule(data=st.data())
    def deliver(self, data) -> None:
        self._deliver(self._worker(data))

    def _deliver(self, worker: SimWorker) -> bool:
        """Deliver the worker's messages in order; True when every one was applied."""
        all_ok = True
        while worker.in_transit:
            kind, packed = worker.in_transit.pop(0)
            try:
                ack = PublishAck.unpack(self._call_central("publish" if kind == "batch" else "resync", packed))
            except CentralDown:
                event("message lost: central down")
                all_ok = False
                continue
            if ack.needs_resync:
                event("resync")
                worker.in_transit.append(("snapshot", worker.kv.snapshot().pack()))
                all_ok = False
            elif ack.status != "ok":
                event(f"ack {ack.status}")
        return all_ok

    @precondition(lambda self: self.ready)
    @rule(data=st.data())
    def lose_a_message(self, data) -> None:
        worker = self._worker(data)
        if worker.in_transit:
            worker.in_transit.pop(data.draw(st.integers(0, len(worker.in_transit) - 1)))
            event("message lost")

    # ---- faults -----------------------------------------------------------------------------
    @precondition(lambda self: self.ready and self.central_up)
    @rule()
    def central_dies(self) -> None:
        self.central_up = False

    @precondition(lambda self: self.ready)
    @rule()
    def central_restarts(self) -> None:
        """A new, empty incarnation: workers' next messages are answered "resync"."""
        self.central = KVManagerService()
        self.central_up = True

    @precondition(lambda self: self.ready and len(self.workers) > 1)
    @rule(data=st.data())
    def worker_dies(self, data) -> None:
        worker = self._worker(data)
        del self.workers[worker.worker_id]
        if self.central_up:
            late = worker.kv.snapshot().pack()   # still queued on the central's socket
            view = self.central.index.workers.get(worker.worker_id)
            was_indexed = view is not None and view.incarnation == worker.kv.event_log.incarnation
            self.central.remove_worker(worker.worker_id)   # the health monitor tells it
            if was_indexed and data.draw(st.booleans(), label="its snapshot arrives after it was removed"):
                assert PublishAck.unpack(self.central.resync(late)).needs_resync
                assert worker.worker_id not in self.central.index.workers

    @precondition(lambda self: self.ready and len(self.workers) < 3)
    @rule(mode=st.sampled_from([None, "swap", "recompute"]))
    def worker_starts(self, mode) -> None:
        self._new_worker(mode)

    # ---- routing -----------------------------------------------------------------------------
    @precondition(lambda self: self.ready and self.central_up)
    @rule(prefix=st.sampled_from(range(len(PREFIXES))), suffix=st.lists(st.integers(0, 99), max_size=8))
    def route(self, prefix, suffix) -> None:
        """A router's lookup between batches: the index memoises its answers, and the batches
        applied after it must keep them exact (``check_integrity`` compares)."""
        self.central.longest_prefix(PREFIXES[prefix] + suffix)

    # ---- checks ------------------------------------------------------------------------------
    @precondition(lambda self: self.ready)
    @rule()
    def flush_all_and_compare(self) -> None:
        self._flush_all_and_compare()

    def _flush_all_and_compare(self) -> None:
        """Flush every worker until every message is applied, then compare exactly."""
        if not self.central_up:
            self.central_restarts()
        for worker in self.workers.values():
            self._flush(worker)
        for _ in range(3):
            if all([self._deliver(w) for w in self.workers.values()]):
                break
        else:
            raise AssertionError("messages still refused after three rounds of resyncs")
        # A worker that died while the central manager was down is unknown to it after its
        # restart, or still known to the old one: either way the index must list exactly the live ones.
        for worker_id in set(self.central.index.workers) - set(self.workers):
            self.central.remove_worker(worker_id)
        snapshots = [w.kv.snapshot() for w in self.workers.values()]
        self.central.index.check_consistency_with(snapshots)
        for prefix in PREFIXES:   # the index's answers are the pools' own (which compare tokens too)
            tokens = prefix + [98, 99]
            expected = {}
            for worker in self.workers.values():
                expected.update(worker.kv.longest_prefix(tokens))
            assert self.central.longest_prefix(tokens) == expected, (tokens, expected)
        occupancy = self.central.occupancy()
        for worker in self.workers.values():
            expected = {tier: asdict(o) for tier, o in worker.kv.occupancy().items()}
            assert occupancy[worker.worker_id] == expected, (worker.worker_id, occupancy[worker.worker_id], expected)

    @invariant()
    def pools_hold(self) -> None:
        for worker in self.workers.values():
            worker.kv.check_integrity()
            held = worker.kv.block_manager_of_worker.seqs
            for seq_id in worker.running:
                if seq_id in held:
                    assert held[seq_id].location.value == "device"
        self.central.index.check_integrity()

    def teardown(self) -> None:
        if not self.ready:
            return
        for worker in self.workers.values():
            pending = worker.pending
            worker.kv.step(StepInput(worker.worker_id, new_sequences=pending.new_sequences, forks=pending.forks,
                                     finished=pending.finished))
            worker.kv.step(StepInput(worker.worker_id, finished=worker.running + worker.waiting))
            worker.running, worker.waiting = [], []
            worker.kv.check_integrity()
            assert worker.kv.num_used_blocks() == 0, f"{worker.worker_id}: blocks leaked"
        self._flush_all_and_compare()


def test_central_index_matches_the_workers_pools(long_form, keyset_impl):
    run_state_machine_as_test(KVClusterMachine, settings=settings(
        max_examples=NUM_EXAMPLES * (LONG_FORM_FACTOR if long_form else 1), stateful_step_count=80,
        deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]))
