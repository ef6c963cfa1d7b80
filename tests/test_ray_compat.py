"""``cluster/ray_compat.py`` is the only door to Ray's private APIs, and its public paths work
against a real Ray (with the dashboard, which serves the state API)."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from pagedserve.cluster import ray_compat  # noqa: E402

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parent.parent
PRIVATE = re.compile(r"ray\._private|autoscaler\._private|__internal_head__|\._actor_id\b|ray\._raylet")


def test_no_module_but_ray_compat_touches_private_ray():
    offenders = []
    for folder in ("cluster", "workers", "kvmanager", "kernels", "src", "tests", "benchmarks"):
        for path in (ROOT / folder).rglob("*.py"):
            if path.name in ("ray_compat.py", "test_ray_compat.py"):
                continue
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if PRIVATE.search(line):
                    offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


@pytest.fixture(scope="module")
def ray_with_dashboard():
    if ray.is_initialized():
        ray.shutdown()
    ray.init(num_cpus=2, include_dashboard=True)
    yield
    ray.shutdown()


@ray.remote(num_cpus=0)
class _Probe:
    def where(self) -> tuple[int, str, str]:
        import os

        context = ray.get_runtime_context()
        return os.getpid(), context.get_actor_id(), context.get_node_id()


@ray.remote(num_cpus=0)
class _LoopProbe:
    async def loop(self) -> str:
        return ray_compat.running_event_loop()


@pytest.mark.parametrize("event_loop", ["asyncio", "uvloop"])
def test_event_loop_env_picks_an_async_actors_loop(ray_with_dashboard, event_loop):
    if event_loop == "uvloop":
        pytest.importorskip("uvloop")
    probe = _LoopProbe.options(runtime_env={"env_vars": ray_compat.event_loop_env(event_loop)}).remote()
    assert ray.get(probe.loop.remote(), timeout=120) == event_loop
    ray.kill(probe, no_restart=True)
    with pytest.raises(ValueError, match="event_loop"):
        ray_compat.event_loop_env("trio")


def test_actor_status_through_the_public_state_api(ray_with_dashboard, monkeypatch):
    probe = _Probe.options(max_restarts=0).remote()
    pid, actor_id, _ = ray.get(probe.where.remote(), timeout=120)
    assert ray_compat.actor_status(actor_id) == ray_compat.ActorStatus("ALIVE", pid)
    from ray._private import state as private_state

    def broken(*args, **kwargs):
        raise ConnectionError("no GCS table")

    monkeypatch.setattr(private_state, "actors", broken)  # the public path alone answers
    assert ray_compat.actor_status(actor_id) == ray_compat.ActorStatus("ALIVE", pid)
    monkeypatch.undo()

    # With the state API down, the GCS table answers the same.
    from ray.util import state as state_api

    monkeypatch.setattr(state_api, "get_actor", broken)
    assert ray_compat.actor_status(actor_id) == ray_compat.ActorStatus("ALIVE", pid)
    monkeypatch.undo()

    ray.kill(probe, no_restart=True)
    deadline = time.time() + 60
    while ray_compat.actor_status(actor_id).state != "DEAD":
        assert time.time() < deadline, "the killed actor never showed as DEAD"
        time.sleep(0.2)
    assert ray_compat.actor_status("ff" * 16) is None  # no such actor


def test_head_node_placement_pins_to_the_head(ray_with_dashboard):
    head = ray_compat.head_node_id()
    assert head == ray.get_runtime_context().get_node_id()  # this driver runs on the head
    options = ray_compat.head_node_placement()
    assert options == {"label_selector": {"ray.io/node-id": head}}
    probe = _Probe.options(**options).remote()
    assert ray.get(probe.where.remote(), timeout=120)[2] == head
    ray.kill(probe, no_restart=True)


def test_a_state_api_answering_for_another_cluster_is_not_believed(ray_with_dashboard, monkeypatch):
    """On a shared machine the state API can reach another cluster's dashboard (one started
    without a dashboard of its own; RAY_ADDRESS): its answers must not be taken for ours."""
    from dataclasses import dataclass

    from ray.util import state as state_api

    @dataclass
    class ForeignNode:
        node_id: str = "ab" * 28
        is_head_node: bool = True

    def never(*args, **kwargs):
        raise AssertionError("the foreign state API was asked about our actor")

    probe = _Probe.remote()
    pid, actor_id, _ = ray.get(probe.where.remote(), timeout=120)
    monkeypatch.setattr(state_api, "list_nodes", lambda *args, **kwargs: [ForeignNode()])
    monkeypatch.setattr(state_api, "get_actor", never)
    monkeypatch.setattr(ray_compat, "_state_api_verdicts", {})
    assert ray_compat.head_node_id() == ray.get_runtime_context().get_node_id()
    assert ray_compat.actor_status(actor_id) == ray_compat.ActorStatus("ALIVE", pid)  # the GCS table
    ray.kill(probe, no_restart=True)


def test_a_dashboard_still_starting_costs_no_wait(ray_with_dashboard, monkeypatch):
    """Until the dashboard has written its address, the state API's client polls for it for
    40 s a call; the head is found through the GCS tables instead, without asking it."""
    from ray._private import ray_constants
    from ray.experimental import internal_kv
    from ray.util import state as state_api

    asked = []

    def list_nodes(*args, **kwargs):   # Ray's own would poll for the missing address for 40 s
        asked.append(args)
        raise ConnectionError("no dashboard address")

    key, namespace = ray_constants.DASHBOARD_ADDRESS, ray_constants.KV_NAMESPACE_DASHBOARD
    address = internal_kv._internal_kv_get(key, namespace=namespace)
    assert address is not None, "assumed: the module's Ray has a dashboard, and it is up"
    monkeypatch.setattr(state_api, "list_nodes", list_nodes)
    monkeypatch.setattr(ray_compat, "_state_api_verdicts", {})
    internal_kv._internal_kv_del(key, namespace=namespace)
    try:
        assert ray_compat.head_node_id() == ray.get_runtime_context().get_node_id()
        assert not asked, "the state API was asked before the dashboard's address was known"
        assert ray_compat._state_api_verdicts == {}, "the verdict waits for the dashboard"
    finally:
        internal_kv._internal_kv_put(key, address, namespace=namespace)


def test_resource_state_shows_the_nodes_and_what_waits_for_them(ray_with_dashboard):
    state = ray_compat.resource_state()
    (node,) = state.nodes
    assert node.is_head and node.node_id == ray.get_runtime_context().get_node_id()
    assert node.total["CPU"] == 2 and 0 <= node.free["CPU"] <= 2
    waiting = _Probe.options(num_cpus=64).remote()   # more than the cluster has
    deadline = time.time() + 60
    while ({"CPU": 64.0}, 1) not in ray_compat.resource_state().waiting_bundles:
        assert time.time() < deadline, ray_compat.resource_state()
        time.sleep(0.5)
    ray.kill(waiting, no_restart=True)
    # A Ray started by ray.init runs its autoscaler read-only: it cannot add nodes.
    deadline = time.time() + 60
    while ray_compat.autoscaler_adds_nodes() is None:
        assert time.time() < deadline, "the autoscaler never reported"
        time.sleep(0.5)
    assert ray_compat.autoscaler_adds_nodes() is False


def test_serve_shuts_down_without_a_failed_task(ray_with_dashboard, capfd):
    """serve.shutdown() waits for a graceful_shutdown call that Ray then reports as failed
    ("killed by ray.kill"); shutdown_serve ends Serve without one."""
    from ray import serve

    serve.start(http_options={"port": 0})
    assert ray_compat.serve_controller() is not None
    assert ray_compat.shutdown_serve(60) is True
    assert ray_compat.serve_controller() is None
    time.sleep(2)   # Ray's log monitor forwards a worker's lines about a second late
    output = "".join(capfd.readouterr())
    # Ray's core worker says "Task ServeController.graceful_shutdown failed. ..."; the word alone
    # may come in other text (a logging error's call stack names this test).
    assert not re.search(r"\bTask \S+ failed\b", output), output
    assert ray_compat.shutdown_serve(5) is True   # nothing left to shut down


# A driver that imports Ray (through ray_compat, or plainly), holds SIGTERM with a handler of its
# own through ray.init, then reports which native handler SIGTERM has, whether the import's
# variable reached Ray's processes, and what its own SIGTERM did.
_SIGTERM_DRIVER = r"""
import ctypes, os, signal, sys
from pagedserve.cluster import ray_compat

class Sigaction(ctypes.Structure):
    _fields_ = [("handler", ctypes.c_void_p), ("mask", ctypes.c_ulong * 16), ("flags", ctypes.c_int),
                ("restorer", ctypes.c_void_p)]

def native_handler(sig):
    action = Sigaction()
    ctypes.CDLL(None).sigaction(sig, None, ctypes.byref(action))
    return action.handler

received = []
signal.signal(signal.SIGUSR2, lambda *_: None)   # its native handler is Python's, as SIGTERM's must stay
signal.signal(signal.SIGTERM, lambda signum, _: received.append(signum))
if sys.argv[1] == "compat":
    ray_compat.import_ray_for_a_signal_handling_driver()
import ray
with ray_compat.sigterm_handler_kept():
    ray.init(num_cpus=1, include_dashboard=False)
kept = native_handler(signal.SIGTERM) == native_handler(signal.SIGUSR2)
import psutil
started = psutil.Process().children(recursive=True)
assert any("raylet" in process.name() for process in started), [process.name() for process in started]
def environ(process):
    try:
        return process.environ()
    except psutil.NoSuchProcess:   # a short-lived helper of Ray's that has ended
        return {}
inherited = any(ray_compat.NO_NATIVE_FAILURE_HANDLER_ENV in environ(process) for process in started)
if kept:
    os.kill(os.getpid(), signal.SIGTERM)
ray.shutdown()
print("kept" if kept else "replaced", "inherited" if inherited else "not-inherited", received, flush=True)
"""


@pytest.mark.distributed
def test_a_driver_importing_ray_through_ray_compat_keeps_its_sigterm_handler():
    """Ray's core worker installs a native failure handler for SIGTERM as the driver connects, and
    a SIGTERM before the driver's own handler was back aborted it; imported through ray_compat,
    the handler stays the driver's through ``ray.init`` and its SIGTERM reaches it, while Ray's
    own processes start without the variable that turned the native one off."""
    runs = {mode: subprocess.Popen([sys.executable, "-c", _SIGTERM_DRIVER, mode], stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, cwd=ROOT)
            for mode in ("compat", "plain")}
    outputs = {mode: run.communicate(timeout=240)[0] for mode, run in runs.items()}
    assert runs["compat"].returncode == 0, outputs["compat"]
    assert "kept not-inherited [15]" in outputs["compat"], outputs["compat"]
    # What the import avoids: a plain import leaves SIGTERM to the native handler.
    assert runs["plain"].returncode == 0 and "replaced" in outputs["plain"], outputs["plain"]
