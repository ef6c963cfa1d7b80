"""Ray clusters of a test's own on this machine, started by ``ray start --head``:
``LocalRayHead`` (a plain head) and ``FakeAutoscalingCluster`` (Ray's fake multi-node
provider: ``RAY_FAKE_CLUSTER=1 ray start --head --autoscaling-config=FILE``).

Each cluster gets its own ports and temp dir, so it never meets another Ray on the
machine, and ``stop`` ends only this cluster's processes, never ``ray stop``, which would
end every Ray here. A process is this cluster's when its command line names the temp dir
or the GCS port, or when it holds a file open under the temp dir: Ray's agents and Serve's
actors rename themselves (their command lines then name nothing), but keep their logs,
which Ray writes under the temp dir, open. They also ignore SIGTERM, so ``stop`` ends with
SIGKILL.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml
from served_cluster import free_port

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
PROVIDER_FILE = CONFIGS / "fake-autoscaling" / "cluster.yaml"
SERVE_FILE = CONFIGS / "fake-autoscaling" / "serve.yaml"


def _own_ports() -> list[str]:
    """``ray start`` options giving the head a free port for everything Ray would otherwise put
    on a fixed default port another cluster here may hold: the dashboard's (bound even with
    ``--include-dashboard=false``: 8265 taken made the head time out at start), the dashboard
    agent's (52365) and the rest. Workers take random ports (0)."""
    options = ("dashboard-port", "dashboard-agent-listen-port", "dashboard-agent-grpc-port",
               "runtime-env-agent-port", "metrics-export-port", "node-manager-port", "object-manager-port")
    return [f"--{option}={free_port()}" for option in options] + ["--min-worker-port=0", "--max-worker-port=0"]


def _process_auth_mode() -> str:
    """"token" or "disabled": the auth mode Ray has fixed for this process."""
    from pagedserve.cluster.ray_compat import process_auth_mode

    mode = process_auth_mode()
    if mode == "disabled":
        # Say so explicitly: a later ray.init(address=...) would otherwise turn token auth on for
        # this process when a token file exists, and no longer match the cluster.
        os.environ["RAY_AUTH_MODE"] = "disabled"
    return mode


def _temp_root() -> Path:
    return Path(os.environ.get("RAY_TMPDIR", "/tmp"))


def _node_ip() -> str:
    import ray.util

    return ray.util.get_node_ip_address()


class LocalRayHead:
    """``start()`` a plain Ray head (no GPU) with ``head_cpus`` CPUs, on ports and a temp dir of its own.

    ``env`` is the ``ray start`` environment on top of this process's; by default the
    cluster takes this test process's token-auth mode (Ray fixes a process's mode once, a
    first local ray.init turns token auth on, and a driver whose mode differs from the
    cluster's is refused: "Missing authorization header").
    """

    def __init__(self, workdir: Path, head_cpus: int = 4, env: dict[str, str] | None = None) -> None:
        self.workdir = Path(workdir)
        self.head_cpus = head_cpus
        self.port = free_port()
        self.ip = _node_ip()
        # Short: Ray's socket paths live under it (108 bytes at most). Under the suite's Ray root
        # (RAY_TMPDIR, tests/ray_leftovers.py), where the suite finds what it started.
        self.temp_dir = _temp_root() / f"psfake-{self.port}"
        env = env or {}
        mode = env["RAY_AUTH_MODE"] if "RAY_AUTH_MODE" in env else _process_auth_mode()
        self.env = {**os.environ, **env, "RAY_AUTH_MODE": mode}

    def _head_options(self) -> list[str]:
        """More ``ray start --head`` options (none for a plain head)."""
        return []

    @property
    def address(self) -> str:
        return f"{self.ip}:{self.port}"

    def start(self, timeout_s: float = 120.0, attempts: int = 3) -> "LocalRayHead":
        """Start the head; on a loaded machine the raylet may miss Ray's fixed 30 s start-up
        deadline, so a failed start is cleaned up and tried again on fresh ports."""
        for attempt in range(1, attempts + 1):
            try:
                return self._start_once(timeout_s)
            except (RuntimeError, subprocess.TimeoutExpired):
                if attempt == attempts:
                    raise
                self.port = free_port()
                self.temp_dir = _temp_root() / f"psfake-{self.port}"
        return self

    def _start_once(self, timeout_s: float) -> "LocalRayHead":
        self.workdir.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", f"--port={self.port}",
                   f"--num-cpus={self.head_cpus}", "--num-gpus=0", f"--temp-dir={self.temp_dir}",
                   "--include-dashboard=false", f"--ray-client-server-port={free_port()}", *_own_ports(),
                   *self._head_options(), "--disable-usage-stats"]
        try:
            result = subprocess.run(command, env=self.env, timeout=timeout_s, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        except subprocess.TimeoutExpired:
            self.stop()
            raise
        if result.returncode != 0:
            self.stop()  # whatever did start of it
            raise RuntimeError(f"ray start failed ({result.returncode}):\n{result.stdout[-3000:]}")
        return self

    def pids(self) -> list[int]:
        """This cluster's processes: their command lines name its temp dir or GCS address, or
        they hold a file open under its temp dir (renamed agents and actors: their logs)."""
        mark = re.compile(re.escape(str(self.temp_dir)).encode() + rb"|:" + str(self.port).encode() + rb"(?!\d)")
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if mark.search(cmdline) or self._holds_a_file_under_temp_dir(entry):
                found.append(int(entry.name))
        return found

    def _holds_a_file_under_temp_dir(self, entry: Path) -> bool:
        prefix = f"{self.temp_dir}/"
        try:
            return any(os.readlink(fd).startswith(prefix) for fd in (entry / "fd").iterdir())
        except OSError:  # gone, or not ours to read
            return False

    def stop(self, term_grace_s: float = 3.0, kill_timeout_s: float = 15.0) -> None:
        """SIGTERM this cluster's processes, then, after ``term_grace_s``, SIGKILL those still
        there; once none is left, remove its temp dir. The grace is short on purpose: Ray's
        agents ignore SIGTERM, so a longer one was always used up in full (teardowns of
        15.8-18.9 s with 15 s of grace, 2026-11-26)."""
        for sig, wait_s in ((signal.SIGTERM, term_grace_s), (signal.SIGKILL, kill_timeout_s)):
            for pid in self.pids():
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.time() + wait_s
            while self.pids() and time.time() < deadline:
                time.sleep(0.2)
            if not self.pids():
                shutil.rmtree(self.temp_dir, ignore_errors=True)
                return


class FakeAutoscalingCluster(LocalRayHead):
    """``start()`` a head (no GPU) whose autoscaler adds {CPU: 1, GPU: 1} nodes on demand."""

    def __init__(self, workdir: Path, provider_file: Path = PROVIDER_FILE, head_cpus: int = 4,
                 env: dict[str, str] | None = None, idle_timeout_minutes: float | None = None,
                 update_interval_s: int | None = None) -> None:
        super().__init__(workdir, head_cpus, env)
        self.provider_file = provider_file
        self.idle_timeout_minutes = idle_timeout_minutes   # None: the provider file's
        self.env["RAY_FAKE_CLUSTER"] = "1"
        if update_interval_s is not None:
            # The autoscaler's loop (monitor.py) runs every AUTOSCALER_UPDATE_INTERVAL_S, 5 s by
            # default: each node added or removed waits up to that long for its next pass.
            self.env["AUTOSCALER_UPDATE_INTERVAL_S"] = str(update_interval_s)

    def _head_options(self) -> list[str]:
        config = yaml.safe_load(self.provider_file.read_text())
        config["provider"]["gcs_address"] = self.address
        config["available_node_types"]["ray.head.default"]["resources"] = {"CPU": self.head_cpus}
        if self.idle_timeout_minutes is not None:
            config["idle_timeout_minutes"] = self.idle_timeout_minutes
        path = self.workdir / "fake-cluster.yaml"
        path.write_text(yaml.safe_dump(config))
        return [f"--autoscaling-config={path}"]
