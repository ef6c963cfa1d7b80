"""``bench kv-scale``: the simulated worker keeps its pool and the central index in step,
and the benchmark runs end to end on Ray, writing every key (not its speed)."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from pagedserve.bench.kv_scale import TARGETS, KVScaleConfig, format_results, run_kv_scale, warm_batch_fill
from pagedserve.bench.kv_sim import SimulatedKVWorker, SimWorkload
from pagedserve.kvmanager.events import PublishAck
from pagedserve.kvmanager.preemption import PreemptionDecision, RemotePreemptionPolicy
from pagedserve.kvmanager.service import KVManagerService

RESULT_KEYS = ("central_cpu_us_per_worker_step", "bytes_per_worker_step", "blocking_calls_per_step",
               "event_lag_p99_ms", "workers_supported_at_50_steps_per_s", "preemptions_by_mode", "integrity_ok")


def _in_process_cluster(num_workers: int, workload: SimWorkload):
    central = KVManagerService()
    prefixes = workload.prefixes()
    workers = []
    for i in range(num_workers):
        def call(request):
            return PreemptionDecision.unpack(central.decide_preemption(request.pack()))
        worker = SimulatedKVWorker(f"sim-{i}", workload, prefixes, RemotePreemptionPolicy(call))
        central.register_worker(worker.worker_id, asdict(worker.pool_config))
        assert PublishAck.unpack(central.resync(worker.kv.snapshot().pack())).status == "ok"
        workers.append(worker)
    return central, workers


def _publish(central: KVManagerService, worker: SimulatedKVWorker) -> None:
    ack = PublishAck.unpack(central.publish(worker.kv.drain_events().pack()))
    assert ack.status == "ok", ack


def test_simulated_workers_keep_the_central_index_exact_through_pressure_and_migration():
    workload = SimWorkload(batch=12, context=192, block_size=16, num_prefixes=3, pressure_per_s=10,
                           steps_per_s=50, prefill_per_step=64, seed=3)
    central, workers = _in_process_cluster(3, workload)
    by_id = {w.worker_id: w for w in workers}
    for _ in range(40):
        for worker in workers:
            worker.step()
    for worker in workers:
        worker.set_warm()
    num_migrated = 0
    for step in range(300):
        for worker in workers:
            worker.step()
            for migration in worker.outbox:
                by_id[migration.target_worker].accept_migration(migration)
                num_migrated += 1
            worker.outbox = []
            if step % 3 == 0:
                _publish(central, worker)
        if step % 25 == 0:
            for worker in workers:
                _publish(central, worker)
                worker.check_integrity()
            central.index.check_consistency_with([w.kv.snapshot() for w in workers])
    modes = {}
    for worker in workers:
        for mode, n in worker.counters.preemptions_by_mode.items():
            modes[mode] = modes.get(mode, 0) + n
    # Fixed seed: every run sees migrations and swaps/recomputes (3 / 56 / 8 when written).
    assert modes["migrate"] > 0 and modes["swap"] + modes["recompute"] > 0, modes
    assert modes["migrate"] == num_migrated
    assert sum(w.counters.num_pressure_requests for w in workers) > 0
    for worker in workers:
        worker.finish_all()
        worker.check_integrity()
        _publish(central, worker)
        occupancy = worker.kv.occupancy()
        assert occupancy["device"].num_used == 0 and occupancy["host"].num_used == 0
    central.index.check_consistency_with([w.kv.snapshot() for w in workers])


def test_publish_round_trips_are_timed_even_when_the_publisher_reads_the_ack_first():
    """``_TimedTransport`` (kv-scale's ack timing) over a real ``ZmqTransport`` to an in-process
    central endpoint: an ack the publisher's own poll takes is still timed, and an ended send is
    no longer watched (a token left behind was re-asked about by every ``observe`` of the
    stepping loop, and its round trip never counted)."""
    pytest.importorskip("zmq")
    from test_kv_events import Driver, make_local

    from pagedserve.bench.kv_scale import _TimedTransport
    from pagedserve.cluster.kv_central import CentralKVManager
    from pagedserve.kvmanager.publisher import KVPublisher
    from pagedserve.workers.kv_events.wire import ZmqTransport

    central = CentralKVManager()
    rtts: list = []
    inner = ZmqTransport(None, central.event_endpoint(), ack_timeout_s=10.0)
    transport = _TimedTransport(inner, rtts)
    local, worker = make_local()
    publisher = KVPublisher(local, transport, max_batch_age_s=0.0)
    driver = Driver(local, worker, seed=3)
    try:
        assert publisher.flush_and_wait(10.0)       # the snapshot: the publisher's poll reads its ack
        for _ in range(3):
            driver.step()
            assert publisher.flush_and_wait(10.0)   # batches that ask for an ack
        transport.observe()
    finally:
        inner.close()
        central.close()
    assert len(rtts) == 4 and all(rtt >= 0 for _, rtt in rtts)
    assert not transport._watch


def test_workload_is_validated():
    with pytest.raises(ValueError, match="context"):
        SimWorkload(context=8)
    with pytest.raises(ValueError, match="output_len"):
        SimWorkload(context=256, output_len=(10, 300))
    # Output lengths scale with the context by default, so per-step changes do not.
    assert SimWorkload(context=4096).output_range == (1024, 3072)


@pytest.mark.timeout(600)
def test_kv_scale_runs_end_to_end_on_ray_and_reports_every_key(tmp_path):
    out = tmp_path / "kv_scale.json"
    config = KVScaleConfig(num_workers=4, batch=8, context=128, steps_per_s=20, seconds=2.0,
                           workers_per_process=2, pressure_per_s=2.0, num_prefixes=2, workers_per_node=2)
    result = run_kv_scale(config, out=str(out), log=lambda _: None)
    written = json.loads(out.read_text())
    for key in RESULT_KEYS:
        assert key in written, key
    assert written["integrity_ok"] is True, written["integrity_errors"]
    assert set(written["preemptions_by_mode"]) == {"migrate", "swap", "recompute"}
    assert written["worker_steps"] > 0 and written["bytes_per_worker_step"] > 0
    assert written["central_cpu_us_per_worker_step"] > 0
    assert written["workers_supported_at_50_steps_per_s"] == pytest.approx(
        1e6 / (50 * written["central_cpu_us_per_worker_step"]))
    assert written["workers_supported_formula"] == "1e6 / (50 * central_cpu_us_per_worker_step)"
    assert set(written["targets"]) == set(TARGETS)
    # Two simulated nodes: every worker's messages reached central in its relay's bundles.
    assert written["num_relays"] == 2 and written["relay_cpu_us_per_worker_step"] > 0
    assert 0 < written["relay_thread_cpu_us_per_worker_step"] < written["relay_cpu_us_per_worker_step"]
    assert written["relay_messages_per_bundle"] >= 1
    assert 0 < written["central_messages_per_worker_step"] < written["central_calls_per_worker_step"]
    text = format_results(result)
    assert "integrity ok" in text and "1e6 / (50 * central_cpu_us_per_worker_step)" in text
    assert "2 relays" in text


@pytest.mark.timeout(600)
def test_kv_scale_publishing_on_a_tick_sends_a_batch_per_tick_and_keeps_the_index_exact():
    """The sender thread's drains race the stepping thread's pool changes: nothing is lost."""
    config = KVScaleConfig(num_workers=4, batch=8, context=128, steps_per_s=50, seconds=2.0,
                           workers_per_process=2, pressure_per_s=2.0, num_prefixes=2, workers_per_node=2,
                           publish_on_tick=True, relay_flush_s=0.2)
    result = run_kv_scale(config, log=lambda _: None)
    assert result["integrity_ok"] is True, result["integrity_errors"]
    assert result["publish_on_tick"] and result["num_resyncs"] == 0
    # Steps every 20 ms or more, a 200 ms tick: a batch per ~10 steps, where per-step publishing sends 1.
    assert 0 < result["worker_batches_per_worker_step"] < 0.3
    assert 0 < result["event_delivery_p50_ms"] <= result["event_delivery_p99_ms"]
    assert "before each 200 ms tick" in format_results(result)


def test_kv_scale_cli_parses():
    from pagedserve.cluster.cli import build_parser

    args = build_parser().parse_args(["bench", "kv-scale", "--workers", "64", "--batch", "256", "--context",
                                      "16384", "--steps-per-s", "50", "--seconds", "30", "--json", "x.json"])
    assert (args.workers, args.batch, args.context, args.steps_per_s, args.seconds, args.json) == (
        64, 256, 16384, 50.0, 30.0, "x.json")
    # The benchmark's defaults are the cluster's.
    from pagedserve.cluster.config import KVEventsConfig

    defaults = KVEventsConfig()
    assert args.workers_per_node == 8
    assert (args.flush_ms, args.relay_flush_ms) == (1e3 * defaults.max_batch_age_s, 1e3 * defaults.relay_flush_s)
    assert args.publish_on_tick == defaults.publish_on_tick
    assert build_parser().parse_args(["bench", "kv-scale", "--workers-per-node", "0"]).workers_per_node == 0
    assert not args.replay and build_parser().parse_args(["bench", "kv-scale", "--replay"]).replay
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "kv-scale", "--workers", "0"])


def _sweep_module():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_kv_scale_sweep.py"
    spec = importlib.util.spec_from_file_location("bench_kv_scale_sweep", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_sweep_splits_central_cpu_into_fixed_and_per_worker_step():
    """Runs whose central CPU is 20 ms/s + 30 us per worker-step give back those two figures,
    and at 32 workers x 50 steps/s: 20,000 / 1,600 + 30 us per worker-step."""
    sweep = _sweep_module()
    runs = []
    for num_workers, steps_per_s in ((8, 40.0), (16, 25.0), (32, 13.0)):
        rate = num_workers * steps_per_s
        runs.append({"config": {"num_workers": num_workers}, "worker_steps": int(rate * 20), "window_s": 20.0,
                     "central_cpu_us_per_worker_step": (20_000 + 30 * rate) / rate,
                     "workers_supported_at_50_steps_per_s": 0.0, "achieved_steps_per_s_per_worker": steps_per_s,
                     "central_messages_per_worker_step": 0.1, "event_lag_p99_ms": 0.0, "integrity_ok": True})
    summary = sweep.summarise(runs, operating_workers=32)
    assert summary["fixed_central_cpu_us_per_s"] == pytest.approx(20_000)
    assert summary["marginal_central_cpu_us_per_worker_step"] == pytest.approx(30)
    assert summary["central_cpu_us_per_worker_step_at_operating_point"] == pytest.approx(20_000 / 1_600 + 30)
    assert summary["workers_supported_at_50_steps_per_s_fitted"] == pytest.approx((1e6 - 20_000) / (50 * 30))
    assert all(abs(p["fit_residual_us_per_s"]) < 1e-6 for p in summary["points"])
    with pytest.raises(ValueError):
        sweep.fit_line([1.0, 1.0], [2.0, 3.0])


def test_a_warm_batch_is_ninety_percent_full_or_one_short_when_small():
    assert [warm_batch_fill(b) for b in (1, 2, 8, 10)] == [1, 1, 7, 9]
    assert warm_batch_fill(256) == pytest.approx(230.4)
