"""The central KV manager actor: ``KVManagerService`` plus its ZeroMQ event endpoint.

The service is pure Python (``kvmanager.service``); this class is what the
cluster wraps in ``ray.remote``. It binds the event socket
(``workers.kv_events.wire.EventEndpoint``), whose receiver thread applies workers'
``publish``/``resync`` messages while Ray runs the actor's methods on the
actor's own thread: every public service method, from either side, runs
under one lock, so the index sees one change at a time. Without pyzmq (or a
failed bind) ``event_endpoint()`` answers None and workers publish over Ray
actor calls.
"""

from __future__ import annotations

import functools
import logging
import threading

from pagedserve.kvmanager.service import KVManagerService
from pagedserve.workers.kv_events.wire import DEFAULT_TICK_S

from .thread_cpu import cpu_by_role

logger = logging.getLogger(__name__)


def _locked(method):
    @functools.wraps(method)
    def under_lock(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)
    return under_lock


class CentralKVManager(KVManagerService):
    """``KVManagerService`` with events taken over ZeroMQ as well as over Ray calls."""

    def __init__(self, event_transport: str = "zmq", event_tick_s: float = DEFAULT_TICK_S) -> None:
        """``event_tick_s``: the event receiver drains once per this period of wall time, just
        after the relays forward (the cluster's ``kv_events.relay_flush_s``: the same clock)."""
        self._lock = threading.RLock()
        super().__init__()
        self._endpoint = None
        if event_transport == "zmq":
            try:
                from pagedserve.workers.kv_events.wire import EventEndpoint

                self._endpoint = EventEndpoint(self.handle_events, gather_s=event_tick_s)   # locked per drain
            except Exception as exc:  # no pyzmq, no bind: workers fall back to Ray calls
                logger.warning("KV event endpoint unavailable, events go over Ray calls: %r", exc)

    def event_endpoint(self) -> str | None:
        """The tcp address workers' ``ZmqTransport`` connects to (None: use Ray calls)."""
        return self._endpoint.address if self._endpoint is not None else None

    def stats(self) -> dict:
        stats = super().stats()
        stats["event_endpoint"] = self.event_endpoint()
        stats["num_zmq_messages"] = self._endpoint.num_messages if self._endpoint is not None else 0
        stats["num_zmq_drains"] = self._endpoint.num_drains if self._endpoint is not None else 0
        # Wake-ups past a tick for a relay's late bundle.
        stats["num_zmq_late_wakeups"] = self._endpoint.num_late_wakeups if self._endpoint is not None else 0
        stats["num_zmq_replies"] = self._endpoint.num_replies if self._endpoint is not None else 0
        # Of the messages, relays' bundles, and the worker messages they carried.
        stats["num_zmq_bundles"] = self._endpoint.num_bundles if self._endpoint is not None else 0
        stats["num_zmq_bundled"] = self._endpoint.num_bundled if self._endpoint is not None else 0
        stats["receiver_cpu_s"] = self._endpoint.receiver_cpu_s if self._endpoint is not None else 0.0
        # This process's CPU per thread role: "receiver" (the event thread, the handler included),
        # "main" (Ray's task loop and the actor's methods), "zeromq", "other" (Ray's threads).
        roles = {self._endpoint.native_thread_id: "receiver"} if self._endpoint is not None else {}
        stats["cpu_by_thread_s"] = cpu_by_role(roles)
        return stats

    def close(self) -> None:
        if self._endpoint is not None:
            self._endpoint.close()
            self._endpoint = None


for _name, _method in list(vars(KVManagerService).items()):
    if callable(_method) and not _name.startswith("_"):
        setattr(CentralKVManager, _name, _locked(getattr(CentralKVManager, _name)))
