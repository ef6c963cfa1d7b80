"""CPU time of a pagedserve server's processes, by role, over a window of load.

**Which processes** (``server_processes``; psutil reads this machine's processes only, so
on a multi-node cluster the other nodes' processes are not counted):

* the server's root: the ``pagedserve serve`` process, whose pid and Ray GCS address its
  record names (``cluster.server_records``), or a pid given;
* the local processes of its Ray cluster: those whose command line names the GCS address
  (``--gcs-address=HOST:PORT``: the raylet, the dashboard, the autoscaler's monitor, the log
  monitor), then those whose command line names the same Ray session (``session_<date>_<pid>``,
  unique per cluster: the GCS server);
* every descendant of those: the actors the raylet starts, the dashboard's subprocesses,
  HAProxy (a child of Serve's ``HAProxyManager`` actor) and a worker's engine-core process.

With a private Ray (``pagedserve serve`` without ``--address``) all of them descend from
the root; on a joined cluster the GCS address finds them. Another Ray cluster on the same
machine has another address and session, so none of its processes is counted. One scan of
the process table gives every process's parent, so a snapshot's tree is consistent.

**Which role** (``group_of``): Ray names an actor's process ``ray::<Class>`` (and
``ray::<Class>.<method>`` while a method runs), which gives the groups: Serve's replicas of
the pagedserve application, its proxy actor, HAProxy (the ``haproxy`` binary and its
manager actor), each worker actor, each worker's descendants (its engine core), the Serve
controller, the cluster controller, the KV manager and its relays, tensor-parallel ranks,
the ``pagedserve serve`` driver, and everything else (raylet, GCS, dashboard, agents, the
log monitor, idle Ray workers).

**What is counted** (``cpu_by_group``): user plus system CPU seconds between two snapshots,
per process (a process is its pid and start time, so a reused pid is a new process). A
process that started in the window counts all of its CPU; one that ended in it loses what
it spent after the first snapshot, and is listed as ended.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

APP_NAME = "pagedserve"   # cluster.serving.deployment.APP_NAME (not imported: it loads the HTTP app)
WORKER_CLASS = "Worker"   # the worker actor (workers/actor/worker.py)
# Ray actor classes (the part of the process title between "ray::" and the first ".") by group.
ACTOR_GROUPS = {
    "ProxyActor": "serve proxy actor",
    "HAProxyManager": "haproxy",
    "ServeController": "serve controller",
    "ClusterController": "cluster controller",
    "CentralKVManager": "kv manager and relays",
    "KVRelay": "kv manager and relays",
    "RankActor": "tensor-parallel ranks",
}
REPLICA_GROUP = "serve replica"
HAPROXY_GROUP = "haproxy"
DRIVER_GROUP = "pagedserve serve (driver)"
OTHER_GROUP = "everything else"
# The order groups are reported in; "worker N" and "engine core N" go where "worker" stands.
GROUP_ORDER = (REPLICA_GROUP, "serve proxy actor", HAPROXY_GROUP, "worker", "tensor-parallel ranks",
               "serve controller", "cluster controller", "kv manager and relays", DRIVER_GROUP, OTHER_GROUP)
_SESSION = re.compile(r"session_\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d_\d+_\d+")
_ACTOR_TITLE = re.compile(r"^ray::([^.\s]+)")


@dataclass(frozen=True)
class ProcessSample:
    """One process at one moment: who it is and the CPU it has used so far."""

    pid: int
    ppid: int
    create_time: float
    name: str
    cmdline: str          # arguments joined by spaces; a Ray actor's is its title
    cpu_s: float          # user + system

    @property
    def key(self) -> tuple[int, float]:
        return self.pid, self.create_time


@dataclass(frozen=True)
class ServerRoot:
    """Where a server's processes are found from: its root pid and its Ray GCS address."""

    pid: int
    gcs_address: str | None = None
    ingress: str | None = None    # what its record says the server's ingress is


def read_processes(process_iter: Callable | None = None) -> list[ProcessSample]:
    """Every readable process on this machine (one pass of ``psutil.process_iter``)."""
    if process_iter is None:
        process_iter = _psutil().process_iter
    samples = []
    for proc in process_iter(["pid", "ppid", "name", "cmdline", "create_time", "cpu_times"]):
        info = proc.info
        times = info.get("cpu_times")
        if times is None or info.get("create_time") is None:   # not ours to read, or a zombie
            continue
        samples.append(ProcessSample(pid=info["pid"], ppid=info.get("ppid") or 0, create_time=info["create_time"],
                                     name=info.get("name") or "", cmdline=" ".join(info.get("cmdline") or ()).strip(),
                                     cpu_s=times.user + times.system))
    return samples


def _children(samples: Iterable[ProcessSample]) -> dict[int, list[ProcessSample]]:
    children: dict[int, list[ProcessSample]] = {}
    for sample in samples:
        children.setdefault(sample.ppid, []).append(sample)
    return children


def server_processes(samples: list[ProcessSample], root: ServerRoot) -> list[ProcessSample]:
    """The processes of the server ``root`` names, among ``samples`` (see the module's doc)."""
    seeds = [s for s in samples if s.pid == root.pid]
    if root.gcs_address:
        flag = f"--gcs-address={root.gcs_address}"
        named = [s for s in samples if flag in s.cmdline]
        sessions = {m for s in named for m in _SESSION.findall(s.cmdline)}
        seeds += [s for s in samples if s in named or any(name in s.cmdline for name in sessions)]
    children = _children(samples)
    found: dict[int, ProcessSample] = {}
    todo = list(seeds)
    while todo:
        sample = todo.pop()
        if sample.pid not in found:
            found[sample.pid] = sample
            todo.extend(children.get(sample.pid, ()))
    return list(found.values())


def actor_class(sample: ProcessSample) -> str | None:
    """The Ray actor class a process runs (from its title ``ray::<Class>[.<method>]``), if any."""
    match = _ACTOR_TITLE.match(sample.cmdline or sample.name)
    return match.group(1) if match else None


def group_of(sample: ProcessSample, processes: dict[int, ProcessSample], root_pid: int,
             worker_index: dict[int, int], app_name: str = APP_NAME) -> str:
    """``sample``'s group; ``processes`` (pid -> sample) gives its ancestors, ``worker_index``
    (worker actor pid -> its number) names workers and their engine cores."""
    if sample.pid == root_pid:
        return DRIVER_GROUP
    if sample.pid in worker_index:
        return f"worker {worker_index[sample.pid]}"
    ancestor, seen = processes.get(sample.ppid), set()
    while ancestor is not None and ancestor.pid not in seen:
        if ancestor.pid in worker_index:
            return f"engine core {worker_index[ancestor.pid]}"
        seen.add(ancestor.pid)
        ancestor = processes.get(ancestor.ppid)
    if sample.name == "haproxy":
        return HAPROXY_GROUP
    cls = actor_class(sample)
    if cls is None:
        return OTHER_GROUP
    if cls.startswith(f"ServeReplica:{app_name}:"):
        return REPLICA_GROUP
    return ACTOR_GROUPS.get(cls, OTHER_GROUP)


@dataclass
class GroupCpu:
    """One group's CPU seconds over a window, and the processes that made it."""

    cpu_s: float = 0.0
    pids: list[int] = field(default_factory=list)
    titles: list[str] = field(default_factory=list)


@dataclass
class WindowCpu:
    """``cpu_by_group``'s answer: CPU seconds per group, and the processes that ended in the window."""

    groups: dict[str, GroupCpu]
    ended: list[ProcessSample]

    @property
    def total_s(self) -> float:
        return sum(group.cpu_s for group in self.groups.values())


def _order(label: str) -> tuple[int, int, str]:
    """``GROUP_ORDER``'s position, workers and their engine cores by number."""
    base, _, number = label.rpartition(" ")
    if number.isdigit() and base in ("worker", "engine core"):
        return GROUP_ORDER.index("worker"), 2 * int(number) + (base == "engine core"), ""
    return (GROUP_ORDER.index(label) if label in GROUP_ORDER else len(GROUP_ORDER)), 0, label


def cpu_by_group(before: list[ProcessSample], after: list[ProcessSample], root_pid: int,
                 app_name: str = APP_NAME) -> WindowCpu:
    """CPU seconds each group of the server's processes used between the two snapshots
    (each the server's processes, ``server_processes``)."""
    first = {s.key: s for s in before}
    last = {s.key: s for s in after}
    ended = [s for key, s in first.items() if key not in last]
    union = {s.pid: s for s in (*ended, *last.values())}
    workers = sorted((s for s in union.values() if actor_class(s) == WORKER_CLASS),
                     key=lambda s: (s.create_time, s.pid))
    worker_index = {s.pid: i for i, s in enumerate(workers)}
    groups: dict[str, GroupCpu] = {}
    for key, sample in last.items():
        label = group_of(sample, union, root_pid, worker_index, app_name)
        group = groups.setdefault(label, GroupCpu())
        group.cpu_s += sample.cpu_s - (first[key].cpu_s if key in first else 0.0)
        group.pids.append(sample.pid)
        cls = actor_class(sample)
        title = f"ray::{cls}" if cls else sample.name
        if title not in group.titles:
            group.titles.append(title)
    for sample in ended:
        groups.setdefault(group_of(sample, union, root_pid, worker_index, app_name), GroupCpu())
    return WindowCpu(groups=dict(sorted(groups.items(), key=lambda item: _order(item[0]))), ended=ended)


def per_token(window: WindowCpu, num_tokens: int, client_cpu_s: float) -> dict:
    """The window's CPU per streamed token (µs), per group, for the whole server and for
    the load client, as plain data for the benchmark's JSON."""
    def us(seconds: float) -> float:
        return seconds / num_tokens * 1e6 if num_tokens else float("nan")

    return {
        "num_output_tokens": num_tokens,
        "groups": {label: {"cpu_s": g.cpu_s, "us_per_token": us(g.cpu_s), "pids": sorted(g.pids),
                           "titles": g.titles} for label, g in window.groups.items()},
        "server_total": {"cpu_s": window.total_s, "us_per_token": us(window.total_s)},
        "client": {"cpu_s": client_cpu_s, "us_per_token": us(client_cpu_s)},
        "ended_processes": [{"pid": s.pid, "name": s.cmdline.split(" ")[0] or s.name} for s in window.ended],
    }


class ServerCpuProbe:
    """Snapshots of one server's processes; ``measure()`` around a window of load.

    ``with probe.measure() as window: ...`` then ``window.result(num_tokens)``."""

    def __init__(self, root: ServerRoot, app_name: str = APP_NAME,
                 read: Callable[[], list[ProcessSample]] = read_processes) -> None:
        self.root = root
        self.app_name = app_name
        self._read = read

    def snapshot(self) -> list[ProcessSample]:
        processes = server_processes(self._read(), self.root)
        if not any(s.pid == self.root.pid for s in processes):
            raise RuntimeError(f"the server's process (pid {self.root.pid}) is not running on this machine")
        return processes

    def measure(self) -> "_Window":
        return _Window(self)


class _Window:
    def __init__(self, probe: ServerCpuProbe) -> None:
        self.probe = probe
        self.before: list[ProcessSample] = []
        self.after: list[ProcessSample] = []
        self.client_cpu_s = 0.0

    def __enter__(self) -> "_Window":
        self.before = self.probe.snapshot()
        self._client_start = _own_cpu_s()
        return self

    def __exit__(self, *exc) -> None:
        self.client_cpu_s = _own_cpu_s() - self._client_start
        self.after = self.probe.snapshot()

    def result(self, num_tokens: int) -> dict:
        window = cpu_by_group(self.before, self.after, self.probe.root.pid, self.probe.app_name)
        return {"ingress": self.probe.root.ingress, **per_token(window, num_tokens, self.client_cpu_s)}


def _psutil():
    try:
        import psutil
    except ImportError as exc:
        raise RuntimeError("`bench serve --cpu-per-token` needs psutil: pip install 'pagedserve[bench]'") from exc
    return psutil


def _own_cpu_s() -> float:
    times = _psutil().Process().cpu_times()
    return times.user + times.system


def find_server_root(url: str, server_pid: int | None = None) -> ServerRoot:
    """The root of the server at ``url``: ``server_pid`` (with its Ray address and ingress when
    its record has them), else the ``pagedserve serve`` whose record holds ``url``'s port
    (``cluster.server_records``). ValueError naming what is missing."""
    from urllib.parse import urlsplit

    from pagedserve.cluster import server_records

    records = server_records.running()
    if server_pid is not None:
        record = next((r for r in records if r.pid == server_pid), None)
        return ServerRoot(server_pid) if record is None else ServerRoot(server_pid, record.ray_address, record.ingress)
    port = urlsplit(url).port
    record = next((r for r in records if r.port == port), None)
    if record is None:
        others = ", ".join(str(r.port) for r in records) or "none"
        raise ValueError(f"no running 'pagedserve serve' on port {port} is recorded in "
                         f"{server_records.records_dir()} (running on ports: {others}): pass --server-pid")
    return ServerRoot(record.pid, record.ray_address, record.ingress)
