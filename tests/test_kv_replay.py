"""``bench kv-scale --replay``: a recorded worker sends what its live KV code did, through the
real event log, and the central index stays exact."""

from __future__ import annotations

import pytest

from pagedserve.bench.kv_replay import ReplayedKVWorker
from pagedserve.bench.kv_scale import KVScaleConfig, format_results, run_kv_scale
from pagedserve.bench.kv_sim import SimulatedKVWorker, SimWorkload
from pagedserve.kvmanager.events import AllBlocksCleared, BlockStored, PublishAck
from pagedserve.kvmanager.preemption import LocalPreemptionPolicy
from pagedserve.kvmanager.service import KVManagerService

# Small pools under steady pressure: swaps, recomputes, evictions to the host tier.
WORKLOAD = SimWorkload(batch=16, context=256, pressure_per_s=5.0, steps_per_s=10.0, num_prefixes=2)


class _CountingPolicy:
    def __init__(self) -> None:
        self.requests = []

    def decide(self, request):
        self.requests.append(request)
        return LocalPreemptionPolicy().decide(request)


def _recorded(num_steps: int, worker_id: str = "w0") -> tuple[ReplayedKVWorker, _CountingPolicy]:
    prefixes = [WORKLOAD.prefix(i) for i in range(WORKLOAD.num_prefixes)]
    recorder = SimulatedKVWorker(worker_id, WORKLOAD, prefixes, ReplayedKVWorker.recording_policy())
    policy = _CountingPolicy()
    worker = ReplayedKVWorker(recorder, policy)
    worker.record(num_steps)
    return worker, policy


def _net(events) -> dict:
    """A batch's events as {(kind, tier): set of keys} (a clear as its own entry)."""
    out: dict = {}
    for event in events:
        if isinstance(event, AllBlocksCleared):
            out[("cleared", event.medium)] = set()
        else:
            kind = "stored" if isinstance(event, BlockStored) else "removed"
            out.setdefault((kind, event.medium), set()).update(event.block_hashes)
    return out


def test_a_replayed_step_drains_exactly_the_recorded_changes_and_its_preemption_requests_go_out():
    worker, policy = _recorded(200)
    assert len(worker.steps) == 200 and worker.blocks_in_use_after_finish == 0
    assert worker.num_prefilled == WORKLOAD.batch
    recorded_requests = [r for step in worker.steps for r in step.requests]
    assert recorded_requests, "the workload should preempt"
    for step in worker.steps:
        worker.step()
        batch = worker.kv.drain_events()
        expected: dict = {}
        for kind, tier, keys in step.changes:
            name = ("stored", "removed", "cleared")[kind]
            expected.setdefault((name, tier), set()).update(keys)
        assert _net(batch.events) == {k: v for k, v in expected.items() if v or k[0] == "cleared"}
        assert batch.occupancy == step.occupancy
    assert policy.requests == recorded_requests
    counters = worker.counters.as_dict()
    assert counters["num_steps"] == 200 and counters["num_scheduled_tokens"] > 0
    assert sum(counters["preemptions_by_mode"].values()) > 0 and counters["preemptions_by_mode"]["migrate"] == 0
    assert worker.is_exhausted and worker.step() == 0
    worker.check_integrity()   # the replayed keys are the recording's at its end


def test_replaying_into_the_central_manager_keeps_its_index_exact_and_a_divergence_is_caught():
    central = KVManagerService()
    workers = [_recorded(150, f"w{i}")[0] for i in range(2)]
    for worker in workers:
        assert PublishAck.unpack(central.resync(worker.kv.snapshot().pack())).status == "ok"
    for i in range(150):
        for worker in workers:
            worker.step()
            if i % 3 == 2:   # coalesced over several steps, as a publisher on a tick sends them
                assert PublishAck.unpack(central.publish(worker.kv.drain_events().pack())).status == "ok"
    for worker in workers:
        assert PublishAck.unpack(central.publish(worker.kv.drain_events().pack())).status == "ok"
        worker.check_integrity()
    central.index.check_consistency_with([w.kv.snapshot() for w in workers])
    central.index.check_integrity()
    # A replay that lost a change no longer matches its recording.
    workers[0].kv.keys["device"].pop()
    with pytest.raises(AssertionError, match="differ from the recording"):
        workers[0].check_integrity()


def test_a_recording_worker_needs_the_recording_policy():
    recorder = SimulatedKVWorker("w0", WORKLOAD, [WORKLOAD.prefix(i) for i in range(WORKLOAD.num_prefixes)])
    with pytest.raises(ValueError, match="recording_policy"):
        ReplayedKVWorker(recorder, LocalPreemptionPolicy())


@pytest.mark.timeout(600)
def test_kv_scale_replay_runs_end_to_end_on_ray_and_keeps_the_index_exact():
    config = KVScaleConfig(num_workers=4, batch=8, context=128, steps_per_s=20, seconds=2.0,
                           workers_per_process=2, pressure_per_s=2.0, num_prefixes=2, workers_per_node=2,
                           replay=True)
    result = run_kv_scale(config, log=lambda _: None)
    assert result["integrity_ok"] is True, result["integrity_errors"]
    assert result["worker_kv_code"].startswith("recorded")
    assert result["replay_steps_recorded"] == config.replay_steps == 20 * (2 + 15)
    assert result["replay_workers_exhausted"] == 0
    assert result["worker_steps"] > 0 and result["events_per_worker_step"] > 0
    assert result["preemptions_by_mode"]["migrate"] == 0 and result["num_resyncs"] == 0
    assert "replay a recording of their own KV code" in format_results(result)
