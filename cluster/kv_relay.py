"""The per-node KV event relay actor (``workers.kv_events.relay.EventRelay`` on Ray).

One relay per node, named ``pagedserve-kv-relay-<node id>`` in the cluster's
namespace and pinned to its node; the first worker on a node to ask
(``node_relay``, passed to the workers by the cluster) creates it, the
others get the same one. It is detached (a worker that dies must not take
its node's relay with it) and restartable. Its constructor takes the central
manager's name, not its handle: a handle argument lives in the object store,
owned by the worker that created the relay, and once that worker died Ray could
not restart the relay. After a restart it binds a new
port, and the workers, once their sends time out, resync and ask it for its
endpoint again (a relay gone for good: they send to the central manager
directly, ``workers.kv_events.wire.ZmqTransport``). ``kill_relays`` ends them when
the cluster shuts down.
"""

from __future__ import annotations

import logging
import time

from .thread_cpu import cpu_by_role

logger = logging.getLogger(__name__)

RELAY_NAME_PREFIX = "pagedserve-kv-relay-"
ENDPOINT_TIMEOUT_S = 60.0


class KVRelay:
    """An ``EventRelay`` between this node's workers and the central KV manager actor, named
    ``central_name`` in ``namespace``."""

    def __init__(self, central_name: str, namespace: str | None, flush_s: float, ack_timeout_s: float) -> None:
        import ray

        from pagedserve.workers.kv_events.relay import EventRelay
        from pagedserve.workers.kv_events.wire import ZmqTransport

        self._cpu_at_start = time.process_time()
        self._started_at = time.time()
        central = ray.get_actor(central_name, namespace=namespace)
        endpoint = ray.get(central.event_endpoint.remote(), timeout=ENDPOINT_TIMEOUT_S)
        if not endpoint:
            raise RuntimeError("the central KV manager has no event endpoint to relay to")
        self._relay = EventRelay(ZmqTransport(central, endpoint, ack_timeout_s=ack_timeout_s), flush_s=flush_s)

    def event_endpoint(self) -> str:
        """The tcp address this node's workers' ``ZmqTransport`` connects to."""
        return self._relay.address

    def stats(self) -> dict:
        """The relay's counters, plus this process's CPU (``process_cpu_s``, Ray's threads
        included) and its pid."""
        import os

        return {**self._relay.stats(), "process_cpu_s": time.process_time() - self._cpu_at_start,
                "uptime_s": time.time() - self._started_at, "pid": os.getpid(),
                "cpu_by_thread_s": cpu_by_role({self._relay.native_thread_id: "relay"})}

    def ping(self) -> bool:
        return True


def relay_name(node_id: str) -> str:
    return f"{RELAY_NAME_PREFIX}{node_id}"


def node_relay(central_name: str, namespace: str | None, kv_events: dict):
    """This node's relay actor (created if none runs yet) to the central KV manager actor
    named ``central_name`` in ``namespace``, for a worker on this node; the cluster passes this
    function to its workers (``Worker(kv_relay=...)``)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from pagedserve.workers.kv_events.wire import DEFAULT_TICK_S

    context = ray.get_runtime_context()
    node_id = context.get_node_id()
    return ray.remote(KVRelay).options(
        name=relay_name(node_id), namespace=context.namespace, get_if_exists=True, lifetime="detached",
        num_cpus=0, max_restarts=-1, max_task_retries=0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
    ).remote(central_name, namespace, kv_events.get("relay_flush_s", DEFAULT_TICK_S),
             kv_events.get("ack_timeout_s", 2.0))


def kill_relays(namespace: str) -> int:
    """End every relay of the cluster in ``namespace``; returns how many."""
    import ray

    killed = 0
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry.get("namespace") != namespace or not entry.get("name", "").startswith(RELAY_NAME_PREFIX):
            continue
        try:
            ray.kill(ray.get_actor(entry["name"], namespace=namespace), no_restart=True)
            killed += 1
        except Exception:  # already gone
            pass
    return killed
