"""The ``pagedserve serve`` processes running on this machine: one record per server, keyed by
its HTTP port.

``serve`` claims its port's record before it starts anything (a second ``serve`` on that port
is refused), fills in its Ray address and endpoints once it serves, notes each stage while it
stops, and removes the record when it exits. ``stop`` and ``status`` read the records. A record
whose process is gone (or whose pid now belongs to another process) is stale, and whoever finds
it removes it. Records live in ``$PAGEDSERVE_CACHE_DIR/servers/`` (default
``~/.cache/pagedserve/servers/``), one ``<port>.json`` each.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from pagedserve.workers.process import processes

RECORDS_DIR_NAME = "servers"


class PortTaken(RuntimeError):
    """A live ``serve`` already holds the record of this port; ``record`` is its record."""

    def __init__(self, record: "ServerRecord") -> None:
        self.record = record
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.started_at))
        super().__init__(f"port {record.port} is taken by pagedserve (pid {record.pid}, {record.state}, started "
                         f"{started}); stop it with 'pagedserve stop --port {record.port}', or choose "
                         "another --port")


@dataclass
class ServerRecord:
    """One running ``serve``: its process, its port, where its Ray is, and what it is doing
    (``state``: "starting", "serving" or "stopping"; ``stage``: the step of its shutdown)."""

    port: int
    pid: int
    host: str
    state: str = "starting"
    started_at: float = field(default_factory=time.time)
    pid_started: float | None = None     # processes.started_at: a reused pid is not taken for this server
    is_private_ray: bool = True
    ray_address: str | None = None
    ray_auth_mode: str | None = None
    endpoints: dict = field(default_factory=dict)
    model: str | None = None
    stage: str | None = None
    ingress: str | None = None           # "haproxy" or "proxy" (``serving.ingress``)
    model_path: str | None = None        # the checkpoint, and the first worker group's engine options:
    engine: dict = field(default_factory=dict)   # what ``bench serve --offline-baseline`` runs offline

    @property
    def path(self) -> Path:
        # Port 0 (any free port) is no one's to claim: such records are per process.
        return records_dir() / (f"{self.port}.json" if self.port else f"0-{self.pid}.json")

    def describe(self) -> str:
        """E.g. "pagedserve on port 8000 (pid 123, 'pagedserve-llama-tiny', private Ray)"."""
        model = f", '{self.model}'" if self.model else ""
        ray = "private Ray" if self.is_private_ray else f"Ray cluster at {self.ray_address}"
        starting = ", starting" if self.state == "starting" else ""
        return f"pagedserve on port {self.port} (pid {self.pid}{model}, {ray}{starting})"

    def save(self, exclusive: bool = False) -> None:
        """Write the record whole (a reader never sees half of it); ``exclusive``: only if no
        record of this port exists (``FileExistsError`` otherwise)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        temporary = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        temporary.write_text(json.dumps(asdict(self), indent=2) + "\n")
        if not exclusive:
            os.replace(temporary, self.path)
            return
        try:
            os.link(temporary, self.path)
        finally:
            temporary.unlink()


def records_dir() -> Path:
    """Where running servers record themselves."""
    from pagedserve.devtools.model_factory import default_cache_dir

    return default_cache_dir().parent / RECORDS_DIR_NAME


def is_alive(record: ServerRecord) -> bool:
    """Whether the record's process still runs (and is the same process, not a reused pid)."""
    return processes.is_same_process(record.pid, record.pid_started)


def _read(path: Path) -> ServerRecord | None:
    try:
        data = json.loads(path.read_text())
        known = {f.name for f in fields(ServerRecord)}
        return ServerRecord(**{key: value for key, value in data.items() if key in known})
    except (OSError, ValueError, TypeError):
        return None


def reread(record: ServerRecord) -> ServerRecord | None:
    """``record`` as its server last wrote it; None once it is gone."""
    return _read(record.path)


def running() -> list[ServerRecord]:
    """The live servers' records, by port; stale and unreadable records are removed."""
    found = []
    for path in sorted(records_dir().glob("*.json")):
        record = _read(path)
        if record is not None and is_alive(record):
            found.append(record)
        else:
            path.unlink(missing_ok=True)
    return sorted(found, key=lambda record: record.port)


def claim(port: int, host: str) -> ServerRecord:
    """This process's record for ``port``, written now; ``PortTaken`` if a live server holds it."""
    record = ServerRecord(port=port, pid=os.getpid(), host=host, pid_started=processes.started_at(os.getpid()))
    for _ in range(3):
        try:
            record.save(exclusive=True)
            return record
        except FileExistsError:
            holder = _read(record.path)
            if holder is not None and is_alive(holder):
                raise PortTaken(holder) from None
            record.path.unlink(missing_ok=True)   # stale: its process is gone
    raise RuntimeError(f"could not write {record.path}")


def release(record: ServerRecord) -> None:
    """Remove ``record`` if it is still this process's own."""
    current = _read(record.path)
    if current is not None and current.pid == record.pid:
        record.path.unlink(missing_ok=True)
