"""Workers Ray cannot place: ``capacity`` (what a configuration asks, what nodes hold),
``placement_watch`` (named within seconds, a hopeless wait ended) and ``config validate``'s
warning. The rules run on plain data first; then ``start`` on a real local Ray, and
``pagedserve serve`` on a private one, meet workers that cannot be placed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import yaml

from pagedserve.cluster import ray_compat
from pagedserve.cluster.capacity import WorkerAsk, fits, local_shortfall, worker_asks
from pagedserve.cluster.cli import main
from pagedserve.cluster.config import ClusterConfig
from pagedserve.cluster.placement_watch import (GRACE_S, REMIND_S, PendingWorker, PlacementError,
                                                PlacementWatch, unplaced)

pytestmark = pytest.mark.timeout(600)


def _node(total: dict, free: dict | None = None, address: str = "10.0.0.1", is_head: bool = True):
    return ray_compat.NodeResources("n-" + address, address, is_head, total, free if free is not None else total)


def _ask(bundle: dict, num_ranks: int = 1, strategy: str = "STRICT_PACK", group: int = 0) -> WorkerAsk:
    return WorkerAsk(group, "mixed", bundle, num_ranks, strategy, 1)


# ---- capacity: what fits where --------------------------------------------------------------------
def test_fits_follows_rays_placement_rules():
    two_cpus = [{"CPU": 2}]
    assert fits(_ask({"CPU": 1}, 2), two_cpus) and not fits(_ask({"CPU": 1}, 2), [{"CPU": 1.5}])
    # STRICT_PACK: all ranks on one node; PACK may spread them.
    split = [{"CPU": 1, "GPU": 1}, {"CPU": 1, "GPU": 1}]
    assert not fits(_ask({"CPU": 1, "GPU": 1}, 2), split)
    assert fits(_ask({"CPU": 1, "GPU": 1}, 2, "PACK"), split)
    assert not fits(_ask({"GPU": 1}), [{"CPU": 64}]) and fits(_ask({}), [{}])
    assert fits(_ask({"CPU": 0.5}), [{"CPU": 2}], num_workers=4) and not fits(_ask({"CPU": 0.5}), [{"CPU": 2}], 5)
    assert fits(_ask({"CPU": 1, "A100": 1}), [{"CPU": 8}, {"CPU": 8, "A100": 1}])


def test_worker_asks_are_per_rank_with_the_groups_strategy():
    config = ClusterConfig.model_validate({"engine": {"tensor_parallel_size": 2}, "workers": [
        {"num_cpus": 1, "count": 2}, {"num_cpus": 0, "num_gpus": 1, "tensor_parallel_size": 1, "resources": {"x": 1}}]})
    first, second = worker_asks(config)
    assert (first.bundle, first.num_ranks, first.num_workers, first.strategy) == ({"CPU": 1}, 2, 2, "STRICT_PACK")
    assert (second.bundle, second.num_ranks) == ({"GPU": 1, "x": 1}, 1)
    assert "CPU 1 x 2 ranks, all on one node (STRICT_PACK)" in first.describe()


def test_local_shortfall_names_the_groups_a_machine_cannot_hold():
    fitting = ClusterConfig.model_validate({"workers": [{"num_cpus": 1}]})
    assert local_shortfall(fitting, {"CPU": 2, "GPU": 0}) == []
    # The case: two ranks of one CPU on two CPUs, half a CPU of which the KV manager holds.
    tp2 = ClusterConfig.model_validate({"engine": {"tensor_parallel_size": 2}, "workers": [{"num_cpus": 1}]})
    problems = local_shortfall(tp2, {"CPU": 2, "GPU": 0})
    assert "worker group 0" in problems[0] and "left for them: CPU 1.5, GPU 0" in problems[0]
    assert "CPU 2.5" in problems[-1]
    gpus = ClusterConfig.model_validate({"workers": [{"num_cpus": 1}, {"num_cpus": 0, "num_gpus": 1, "count": 2}]})
    problems = local_shortfall(gpus, {"CPU": 8, "GPU": 1})
    assert len(problems) == 2 and problems[0].startswith("worker group 1") and "GPU 2" in problems[0]


# ---- the watch, on plain data ---------------------------------------------------------------------
class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _state(nodes, waiting=(), pending_groups=()) -> ray_compat.ResourceState:
    return ray_compat.ResourceState(tuple(nodes), tuple(waiting), frozenset(pending_groups))


def _watch(workers, state, can_autoscale, is_private=False, timeout_s=60.0):
    clock, notes = _Clock(), []
    watch = PlacementWatch({w.worker_id: w for w in workers}, timeout_s, 600.0, is_private, notify=notes.append,
                           resource_state=lambda: state, autoscaler_adds_nodes=lambda: can_autoscale, clock=clock)
    return watch, clock, notes


def test_unplaced_workers_are_those_ray_has_not_granted():
    one = PendingWorker("worker-0", _ask({"CPU": 1}))
    other = PendingWorker("worker-1", _ask({"CPU": 1}))
    gpu = PendingWorker("worker-2", _ask({"CPU": 1, "GPU": 1}, group=1))
    ranks = PendingWorker("worker-3", _ask({"CPU": 1}, 2, group=2), placement_group_id="ab01")
    state = _state([_node({"CPU": 2})], waiting=[({"CPU": 1.0}, 1), ({"GPU": 1.0, "CPU": 1.0}, 1)],
                   pending_groups=["ab01"])
    assert [w.worker_id for w in unplaced([one, other, gpu, ranks], state)] == ["worker-3", "worker-0", "worker-2"]
    assert unplaced([one, ranks], _state([_node({"CPU": 2})])) == []


def test_a_worker_no_node_can_hold_ends_the_start_at_once_without_an_autoscaler():
    worker = PendingWorker("worker-0", _ask({"CPU": 1, "GPU": 1}))
    state = _state([_node({"CPU": 4, "GPU": 0}, {"CPU": 3.5})], waiting=[({"CPU": 1, "GPU": 1}, 1)])
    watch, clock, notes = _watch([worker], state, can_autoscale=False)
    watch.check({"worker-0"})  # within the grace: nothing yet
    clock.now = GRACE_S
    with pytest.raises(PlacementError) as raised:
        watch.check({"worker-0"})
    message = str(raised.value)
    for part in ("worker group 0 (mixed)", "asks for CPU 1, GPU 1", "10.0.0.1 (head): CPU 3.5 of 4, GPU 0 of 0 free",
                 "No node of this cluster has that much"):
        assert part in message, message


def test_with_an_autoscaler_the_wait_goes_on_and_says_so():
    worker = PendingWorker("worker-0", _ask({"CPU": 1, "GPU": 1}))
    state = _state([_node({"CPU": 4})], waiting=[({"CPU": 1, "GPU": 1}, 1)])
    watch, clock, notes = _watch([worker], state, can_autoscale=True)
    for clock.now in (GRACE_S, GRACE_S + 1, GRACE_S + REMIND_S, GRACE_S + 1000):
        watch.check({"worker-0"})
    assert len(notes) == 3 and all("waiting for Ray's autoscaler to add a node" in note for note in notes), notes
    assert "worker group 0" in notes[0]


def test_a_wait_for_the_autoscaler_is_named_at_once_and_free_resources_get_the_grace():
    gpu = PendingWorker("worker-0", _ask({"CPU": 1, "GPU": 1}))
    cpu = PendingWorker("worker-1", _ask({"CPU": 2}, group=1))
    state = _state([_node({"CPU": 4}, {"CPU": 2})], waiting=[({"CPU": 1, "GPU": 1}, 1), ({"CPU": 2}, 1)])
    watch, clock, notes = _watch([gpu, cpu], state, can_autoscale=True)
    clock.now = 0.5
    watch.check({"worker-0", "worker-1"})
    assert len(notes) == 1 and "worker group 0" in notes[0], notes   # no node has a GPU free: named now
    assert "waiting for Ray's autoscaler to add a node" in notes[0]
    clock.now = GRACE_S
    watch.check({"worker-0", "worker-1"})
    assert len(notes) == 2 and "worker group 1" in notes[1], notes   # it fits what is free: after the grace


def test_a_busy_fixed_cluster_is_waited_for_up_to_placement_timeout_s():
    worker = PendingWorker("worker-0", _ask({"CPU": 2}))
    state = _state([_node({"CPU": 4}, {"CPU": 1})], waiting=[({"CPU": 2}, 1)])
    watch, clock, notes = _watch([worker], state, can_autoscale=False, timeout_s=20)
    clock.now = GRACE_S
    watch.check({"worker-0"})
    assert len(notes) == 1 and "waiting up to placement_timeout_s (20 s)" in notes[0]
    clock.now = GRACE_S + 19
    watch.check({"worker-0"})
    clock.now = GRACE_S + 20
    with pytest.raises(PlacementError, match="Still not placed after placement_timeout_s"):
        watch.check({"worker-0"})


def test_until_the_autoscaler_says_whether_it_can_add_nodes_the_wait_goes_on():
    worker = PendingWorker("worker-0", _ask({"CPU": 1, "GPU": 1}))
    state = _state([_node({"CPU": 4})], waiting=[({"CPU": 1, "GPU": 1}, 1)])
    answers = iter([None, None, False])
    clock, notes = _Clock(), []
    watch = PlacementWatch({"worker-0": worker}, 20, 600, False, notify=notes.append, resource_state=lambda: state,
                           autoscaler_adds_nodes=lambda: next(answers), clock=clock)
    for clock.now in (GRACE_S, GRACE_S + 100):
        watch.check({"worker-0"})   # past placement_timeout_s, but an autoscaler may still come
    assert len(notes) == 2 and all("has not said whether it can add nodes" in note for note in notes)
    clock.now = GRACE_S + 101
    with pytest.raises(PlacementError, match="No node of this cluster has that much"):
        watch.check({"worker-0"})   # now known: a fixed cluster, and no node has a GPU


def test_a_worker_placed_meanwhile_is_forgotten():
    worker = PendingWorker("worker-0", _ask({"CPU": 2}))
    waiting = _state([_node({"CPU": 4}, {"CPU": 1})], waiting=[({"CPU": 2}, 1)])
    placed = _state([_node({"CPU": 4}, {"CPU": 1})])
    states = iter([waiting, placed, waiting])
    clock, notes = _Clock(), []
    watch = PlacementWatch({"worker-0": worker}, 20, 600, False, notify=notes.append,
                           resource_state=lambda: next(states), autoscaler_adds_nodes=lambda: False, clock=clock)
    for clock.now in (GRACE_S, GRACE_S + 15, GRACE_S + 30):
        watch.check({"worker-0"})   # the last wait counts from 18 s: no error yet
    assert len(notes) == 2


def test_on_a_private_ray_an_unplaced_worker_ends_the_start():
    worker = PendingWorker("worker-0", _ask({"CPU": 1}, 2), placement_group_id="ab01")
    state = _state([_node({"CPU": 2}, {"CPU": 1.5})], pending_groups=["ab01"])
    watch, clock, _ = _watch([worker], state, can_autoscale=None, is_private=True)
    clock.now = GRACE_S
    with pytest.raises(PlacementError, match="This private Ray has this machine's resources only"):
        watch.check({"worker-0"})


# ---- config validate --------------------------------------------------------------------------------
def test_config_validate_warns_when_this_machine_cannot_hold_the_workers(tmp_path, capsys):
    machine = ray_compat.local_node_resources()
    assert machine["CPU"] >= 1 and machine["GPU"] >= 0
    path = tmp_path / "big.yaml"
    path.write_text(yaml.safe_dump({"workers": [{"num_cpus": machine["CPU"] + 1}]}))
    assert main(["config", "validate", str(path)]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip().endswith("valid")
    assert "warning: a private Ray on this machine" in captured.err and "worker group 0" in captured.err
    small = tmp_path / "small.yaml"
    small.write_text(yaml.safe_dump({"workers": [{"num_cpus": 0}], "kv_manager_num_cpus": 0}))
    assert main(["config", "validate", str(small)]) == 0
    assert capsys.readouterr().err == ""


# ---- real Ray ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def local_ray():
    import ray

    from pagedserve.cluster.bootstrap import NAMESPACE
    from served_cluster import start_local_ray

    if ray.is_initialized():
        ray.shutdown()
    start_local_ray(num_cpus=2, namespace=NAMESPACE, include_dashboard=False)
    # A fixed cluster, as its autoscaler (read-only under ray.init) reports within its 5 s pass.
    deadline = time.monotonic() + 60
    while ray_compat.autoscaler_adds_nodes() is None:
        assert time.monotonic() < deadline, "Ray's autoscaler never reported"
        time.sleep(0.5)
    assert ray_compat.autoscaler_adds_nodes() is False
    yield
    ray.shutdown()


def _config(tiny_model, **extra) -> ClusterConfig:
    return ClusterConfig.model_validate({"model": {"path": tiny_model("llama")},
                                         "engine": {"num_device_blocks": 32, "swap_space_gb": 0.001}, **extra})


@pytest.mark.distributed
def test_start_ends_at_once_for_a_worker_no_node_can_hold(local_ray, tiny_model, caplog):
    from pagedserve.cluster.bootstrap import start

    config = _config(tiny_model, workers=[{"num_cpus": 0.5, "num_gpus": 1}], placement_timeout_s=120)
    began = time.monotonic()
    with pytest.raises(PlacementError) as raised:
        start(config, ready_timeout_s=120)
    elapsed = time.monotonic() - began
    message = str(raised.value)
    assert "worker group 0 (mixed): each worker asks for CPU 0.5, GPU 1" in message, message
    assert "No node of this cluster has that much" in message and "GPU 0 of 0 free" in message
    # Ray's monitor reports the cluster as fixed within its update interval (5 s).
    assert elapsed < 30, elapsed


@pytest.mark.distributed
def test_start_waits_placement_timeout_s_for_resources_another_job_holds(local_ray, tiny_model, caplog):
    import ray

    from pagedserve.cluster.bootstrap import start

    @ray.remote(num_cpus=1)
    class Holder:
        def ping(self) -> bool:
            return True

    holder = Holder.remote()   # another job's actor: one of the two CPUs, until it ends
    ray.get(holder.ping.remote(), timeout=120)
    config = _config(tiny_model, workers=[{"num_cpus": 1.5}], placement_timeout_s=8)
    began = time.monotonic()
    with caplog.at_level("WARNING", logger="pagedserve.cluster"), pytest.raises(PlacementError) as raised:
        start(config, ready_timeout_s=120)
    elapsed = time.monotonic() - began
    ray.kill(holder)
    notes = [record.getMessage() for record in caplog.records if "not placed" in record.getMessage()]
    assert notes and "waiting up to placement_timeout_s (8 s)" in notes[0], notes
    assert "asks for CPU 1.5" in notes[0] and "CPU 0.5 of 2" in notes[0]
    assert "Still not placed after placement_timeout_s (8 s)" in str(raised.value)
    assert 8 <= elapsed < 60, elapsed


@pytest.mark.distributed
def test_serve_on_a_private_ray_names_the_group_it_cannot_place_and_stops(tmp_path, tiny_model):
    """The issue's case: ranks of one CPU each that the machine's CPUs hold in all, but not
    beside the KV manager's half CPU; ``serve`` said nothing and waited for ever."""
    cpus = ray_compat.local_node_resources()["CPU"]
    path = tmp_path / "tp2.yaml"
    path.write_text(yaml.safe_dump({"engine": {"tensor_parallel_size": 2}, "workers": [{"num_cpus": cpus / 2}]}))
    from served_cluster import free_port

    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    env["PAGEDSERVE_CACHE_DIR"] = str(tmp_path / "cache")
    began = time.monotonic()
    serve = subprocess.run([sys.executable, "-m", "pagedserve", "serve", tiny_model("llama"), "--config", str(path),
                            "--port", str(free_port())], env=env, capture_output=True, text=True, timeout=300)
    output = serve.stdout + serve.stderr
    assert serve.returncode == 1, output
    assert "worker group 0 (mixed): each worker asks for CPU" in output and "x 2 ranks" in output, output
    assert "This private Ray has this machine's resources only" in output, output
    assert ("starting the KV manager and 1 worker(s): loading the model, allocating KV pools (Ray Serve starts "
            "meanwhile): failed after") in output
    assert time.monotonic() - began < 240
    assert not list((tmp_path / "cache" / "servers").glob("*.json"))   # its record went with it
