"""Every Ray API pagedserve uses that is private, or public but fragile, in one place.

Each function prefers Ray's public API and says why a private one is still
needed, where it is. Nothing else in pagedserve may import ``ray._private``,
``ray.autoscaler._private`` or read an underscored attribute of a Ray object;
``tests/test_ray_compat.py`` checks that. Tested against the ``ray[serve]``
range pinned in ``pyproject.toml``; on an upgrade, this module is what to
re-check.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

logger = logging.getLogger("pagedserve.cluster")

# Every Ray node carries this label (Ray's default labels); a label selector on
# it pins an actor or a Serve replica to one node. Public since Ray 2.49.
NODE_ID_LABEL = "ray.io/node-id"
# The resource Ray gives only the head node. Private (``ray_constants``); used
# only when the state API cannot say which node is the head.
_HEAD_NODE_RESOURCE = "node:__internal_head__"
STATE_API_TIMEOUT_S = 10


@dataclass(frozen=True)
class ActorStatus:
    """An actor as Ray's GCS sees it: ``ALIVE``, ``RESTARTING``, ``DEAD``, ... and its process id."""

    state: str
    pid: int | None


def gcs_address() -> str:
    """The connected cluster's address. Passed explicitly to the state API, whose
    default (``auto``) refuses to choose when several Ray instances run on one machine."""
    import ray

    return ray.get_runtime_context().gcs_address


_state_api_verdicts: dict[str, bool] = {}


def _dashboard_address_known() -> bool:
    """Whether the connected cluster's GCS holds its dashboard's address yet.

    Private: the dashboard's key in the GCS key-value store (``ray_constants``),
    read through ``ray.experimental.internal_kv``. The state API's client looks
    that key up itself, but polls for it 20 times, 2 s apart, so every state
    API call made while the dashboard is still starting (a new cluster on a
    busy head) would block 40 s before failing.
    """
    try:
        from ray._private import ray_constants
        from ray.experimental.internal_kv import _internal_kv_get

        return _internal_kv_get(ray_constants.DASHBOARD_ADDRESS,
                                namespace=ray_constants.KV_NAMESPACE_DASHBOARD) is not None
    except Exception as exc:
        logger.debug("dashboard address lookup failed: %r", exc)
        return False


def _state_api_is_ours() -> bool:
    """Whether the state API answers for the cluster this process is connected to.

    The state API finds its server through the dashboard address the GCS
    records, and ``RAY_ADDRESS`` overrides the address it is given: on a
    machine shared by several Ray clusters, one started without a dashboard
    can get another cluster's answers. It is ours if it lists this process's
    own node. Decided once per cluster address.
    """
    import ray

    address = gcs_address()
    if address not in _state_api_verdicts:
        if not _dashboard_address_known():
            return False  # not cached: the dashboard may still be starting
        try:
            from ray.util.state import list_nodes

            own = ray.get_runtime_context().get_node_id()
            nodes = list_nodes(address=address, filters=[("node_id", "=", own)], timeout=STATE_API_TIMEOUT_S)
            _state_api_verdicts[address] = any(node.node_id == own for node in nodes)
        except Exception as exc:
            logger.debug("state API unavailable: %r", exc)
            return False  # not cached: the dashboard may still be starting
        if not _state_api_verdicts[address]:
            logger.warning("Ray's state API at this machine answers for another cluster; "
                           "using the GCS tables of %s instead", address)
    return _state_api_verdicts[address]


def actor_status(actor_id: str) -> ActorStatus | None:
    """The actor's state and pid, or None when neither query below answers.

    Public: ``ray.util.state.get_actor``. It is served by the dashboard process,
    which a cluster started with ``--include-dashboard=false`` lacks, so the
    private GCS actor table (``ray._private.state.actors``, what ``ray list
    actors`` reads underneath) is the fallback.
    """
    try:
        from ray.util.state import get_actor

        if _state_api_is_ours():
            found = get_actor(actor_id, address=gcs_address(), timeout=STATE_API_TIMEOUT_S)
            if found is not None:
                return ActorStatus(found.state, found.pid)
    except Exception as exc:
        logger.debug("state API get_actor(%s) failed: %r", actor_id, exc)
    try:
        from ray._private import state as private_state

        info = private_state.actors(actor_id=actor_id)
        if info:
            return ActorStatus(info.get("State"), info.get("Pid"))
    except Exception as exc:
        logger.debug("GCS actor table lookup of %s failed: %r", actor_id, exc)
    return None


def head_node_id() -> str:
    """The head node's id.

    Public: ``ray.util.state.list_nodes`` (``is_head_node``), checked against the
    connected cluster's ``ray.nodes()``. Fallback when the dashboard is absent
    (or is another cluster's): the node holding the head's private resource in
    the public ``ray.nodes()`` table.
    """
    import ray

    alive = [node for node in ray.nodes() if node.get("Alive")]
    try:
        from ray.util.state import list_nodes

        if _state_api_is_ours():
            heads = list_nodes(address=gcs_address(), filters=[("is_head_node", "=", True),
                                                               ("state", "=", "ALIVE")],
                               timeout=STATE_API_TIMEOUT_S)
            ours = {node["NodeID"] for node in alive}
            for head in heads:
                if head.node_id in ours:
                    return head.node_id
    except Exception as exc:
        logger.debug("state API list_nodes failed: %r", exc)
    for node in alive:
        if _HEAD_NODE_RESOURCE in node.get("Resources", {}):
            return node["NodeID"]
    raise RuntimeError("the Ray cluster has no live head node")


def node_placement(node_id: str) -> dict:
    """Actor options (also valid Serve ``ray_actor_options``) that pin to ``node_id``.

    A label selector rather than ``NodeAffinitySchedulingStrategy``: Serve's
    ``ray_actor_options`` accept ``label_selector`` but no scheduling strategy,
    and Ray itself moved its node pinning to this label.
    """
    return {"label_selector": {NODE_ID_LABEL: node_id}}


def head_node_placement() -> dict:
    """``node_placement`` of the head node (the KV manager and the Serve ingress live there)."""
    return node_placement(head_node_id())


# Read by Ray's workers when they make an async actor's event loop (ray._private.async_compat):
# uvloop where it is installed, unless this is "0".
USE_UVLOOP_ENV = "RAY_USE_UVLOOP"


def event_loop_env(event_loop: str) -> dict[str, str]:
    """An actor's environment variables for its event loop: "asyncio" or "uvloop"."""
    if event_loop not in ("asyncio", "uvloop"):
        raise ValueError(f"event_loop must be 'asyncio' or 'uvloop', not {event_loop!r}")
    return {USE_UVLOOP_ENV: "1" if event_loop == "uvloop" else "0"}


def running_event_loop() -> str:
    """The event loop this coroutine runs on, as ``event_loop_env`` names it."""
    import asyncio

    return type(asyncio.get_running_loop()).__module__.partition(".")[0]


def validate_launcher_config(config: dict) -> dict:
    """Validate a ``ray up`` cluster file offline the way ``ray up`` does; returns the
    prepared config, raises on an invalid one.

    Private (``ray.autoscaler._private.util``): Ray has no public call that
    checks a launcher file without starting a cluster.
    """
    import copy

    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)
    return prepared


def validate_autoscaler_config(config: dict) -> None:
    """Check a cluster file the way the autoscaler of ``ray start --head
    --autoscaling-config=FILE`` reads it: Ray's schema only, no defaults filled
    in (the file must be complete), raises on an invalid one.

    Private (``ray.autoscaler._private.util``), as above. ``prepare_config``
    is not run: for the fake multi-node provider it loads a defaults file the
    wheel does not ship, and the running autoscaler never calls it either.
    """
    from ray.autoscaler._private.util import validate_config

    validate_config(config)


def session_logs_dir() -> Path:
    """The connected Ray session's log directory (on this machine).

    Private (``ray._private.worker``): Ray has no public accessor for it; the
    fuzz suite scans these logs for leaked prompts.
    """
    from ray._private import worker as private_worker

    return Path(private_worker._global_node.get_logs_dir_path())


def process_auth_mode() -> str:
    """"token" or "disabled": the token-auth mode Ray has fixed for this process (a first local
    ray.init turns it on). Private: Ray 2.60 has no public way to read it."""
    from ray._private.authentication.authentication_utils import is_token_auth_enabled

    return "token" if is_token_auth_enabled() else "disabled"


def enable_token_auth_for(address: str | None) -> None:
    """Token authentication for the cluster ``ray.init(address)`` is about to start or join,
    where ``RAY_AUTH_MODE`` is unset (an explicit one, e.g. "disabled", is respected):

    - a new private cluster (address None or "local"): on, as ``ray.init`` turns it on itself,
      without the warning Ray logs when it does ("Token authentication is enabled for this Ray
      cluster", on every start of ``pagedserve serve``);
    - a running cluster named by its address (``--address``, ``$RAY_ADDRESS``): on when a token
      is available (``~/.ray/auth_token``, ``$RAY_AUTH_TOKEN``, ``$RAY_AUTH_TOKEN_PATH``), as
      Ray 2.60 itself does only for a cluster it finds ("auto", left to Ray).

    Private (``ray._private.authentication``): Ray has no public call for either.
    """
    if address == "auto":
        return
    from ray._private.authentication import authentication_token_setup as token_setup

    if address in (None, "local"):
        if os.environ.get(token_setup.AUTH_MODE_ENV_VAR) is None:
            token_setup._enable_token_auth()   # what ray.init does, less the warning
        return
    token_setup.maybe_enable_token_auth_if_token_available(warn_if_disabled=False)


def set_process_title(title: str) -> None:
    """Rename this process the way Ray renames its workers and agents (``ray::...``): Ray's own
    ``setproctitle``, which writes over the command line and over the environment that
    ``/proc/PID/environ`` shows. Private (``ray._raylet``). The suite uses it to model Ray's
    renamed agents (``tests/test_ray_leftovers.py``)."""
    from ray import _raylet

    _raylet.setproctitle(title)


NO_NATIVE_FAILURE_HANDLER_ENV = "RAY_DISABLE_FAILURE_SIGNAL_HANDLER"


def import_ray_for_a_signal_handling_driver() -> None:
    """Import Ray so that this driver's core worker, once connected, installs no native failure
    handler. That handler takes SIGTERM among the crash signals: a SIGTERM that came in the last
    part of ``ray.init`` (before the driver installs its own handler again) printed a native
    stack, and the process aborted (134) as it exited, where it should end with 143. The
    driver's crashes are still reported: Ray turns Python's ``faulthandler`` on.

    Private: Ray reads ``$RAY_DISABLE_FAILURE_SIGNAL_HANDLER`` once, as its native module is
    loaded, so it is set for the import alone and no process Ray starts inherits it. A process
    that has imported Ray already, or that sets the variable itself, keeps what it has.
    """
    if "ray._raylet" in sys.modules or os.environ.get(NO_NATIVE_FAILURE_HANDLER_ENV) is not None:
        return
    os.environ[NO_NATIVE_FAILURE_HANDLER_ENV] = "1"
    try:
        importlib.import_module("ray")
    finally:
        del os.environ[NO_NATIVE_FAILURE_HANDLER_ENV]


@contextlib.contextmanager
def sigterm_handler_kept() -> Iterator[None]:
    """Within the block, ``ray.init`` leaves this process's SIGTERM handler as it is. As it
    begins, it installs one that calls ``sys.exit`` wherever the main thread is, which leaves a
    start-up half done; a driver that holds SIGTERM until Ray has started keeps its own.
    Private (``ray._private.utils.set_sigterm_handler``): ``ray.init`` has no option for it."""
    from ray._private import utils

    installs = utils.set_sigterm_handler
    utils.set_sigterm_handler = lambda handler: None
    try:
        yield
    finally:
        utils.set_sigterm_handler = installs


def serve_controller():
    """The connected cluster's Ray Serve controller actor; None when Serve does not run there.
    Private: its name and namespace (``ray.serve._private.constants``)."""
    import ray
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    try:
        return ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    except ValueError:
        return None


def shutdown_serve(timeout_s: float) -> bool:
    """Shut Ray Serve down on the connected cluster as ``serve.shutdown()`` does (every
    application deleted, its replicas drained, the proxies and the controller stopped), waiting
    at most ``timeout_s``; True once the controller is gone (or there was none).

    ``serve.shutdown()`` calls the controller's ``graceful_shutdown`` and waits for that call to
    fail: the controller ends by killing itself, and since Serve gives it infinite task retries,
    Ray logs every clean shutdown as "Task ServeController.graceful_shutdown failed ... killed by
    ray.kill". Here the same request goes with ``wait=False``, which the controller answers at
    once, and its end is awaited by its name. The process's own handles are shut first, as
    ``serve.shutdown()`` does, so that none is left listening to the controller.

    Private: the cached client (``ray.serve.context``), and ``serve_controller``.
    """
    import time

    import ray
    from ray.serve import context

    deadline = time.monotonic() + timeout_s
    controller = serve_controller()
    if controller is None:
        context._disconnect()
        return True
    client = context._global_client
    if client is not None:
        client.shutdown_cached_handles()
    try:
        ray.get(controller.graceful_shutdown.remote(False), timeout=max(0.1, deadline - time.monotonic()))
    except Exception as exc:  # gone meanwhile, or not answering: its end is awaited below all the same
        logger.debug("Serve controller's graceful_shutdown: %r", exc)
    is_gone = serve_controller() is None
    while not is_gone and time.monotonic() < deadline:
        time.sleep(0.2)
        is_gone = serve_controller() is None
    context._disconnect()
    return is_gone


@dataclass(frozen=True)
class NodeResources:
    """An alive node's resources (name -> amount): what it has in all, and what is free now."""

    node_id: str
    address: str
    is_head: bool
    total: dict
    free: dict


@dataclass(frozen=True)
class ResourceState:
    """The connected cluster's nodes and what waits for their resources, as Ray's GCS sees it:
    ``waiting_bundles`` holds the shapes (and counts) of tasks and actors waiting for a lease,
    ``pending_placement_groups`` the ids (hex) of placement groups not placed yet."""

    nodes: tuple
    waiting_bundles: tuple
    pending_placement_groups: frozenset


def resource_state() -> ResourceState:
    """What ``ray status`` shows: every alive node's total and free resources, and the demand
    that waits for them.

    Internal (``ray.autoscaler.v2.sdk.get_cluster_status``, a GCS call that works whichever
    autoscaler runs, or none): Ray's public calls sum resources over nodes
    (``ray.available_resources``) and say nothing of what waits.
    """
    from ray.autoscaler.v2.sdk import get_cluster_status

    status = get_cluster_status(gcs_address(), timeout=STATE_API_TIMEOUT_S)
    nodes = []
    for node in [*status.active_nodes, *status.idle_nodes]:
        usage = node.resource_usage.usage if node.resource_usage else []
        total = {u.resource_name: u.total for u in usage}
        free = {u.resource_name: u.total - u.used for u in usage}
        nodes.append(NodeResources(node.node_id or "", node.ip_address, _HEAD_NODE_RESOURCE in total, total, free))
    demands = status.resource_demands
    waiting = tuple((dict(request.bundle), request.count)
                    for demand in demands.ray_task_actor_demand for request in demand.bundles_by_count)
    pending = frozenset(demand.pg_id for demand in demands.placement_group_demand
                        if demand.pg_id and demand.state == "PENDING")
    return ResourceState(tuple(nodes), waiting, pending)


def autoscaler_adds_nodes() -> bool | None:
    """Whether the connected cluster's autoscaler can add nodes: True when it runs with node
    types to launch (``ray up``, ``ray start --autoscaling-config``, KubeRay), False when it
    only mirrors the nodes there are (a cluster started without an autoscaling config), None
    when it has not reported yet.

    Private: the autoscaler's status report in the GCS key-value store
    (``ray_constants.DEBUG_AUTOSCALING_STATUS``, what ``ray status`` reads), whose node types
    are ``node_<id>`` (``format_readonly_node_type``) for a cluster it cannot grow.
    """
    import json

    try:
        from ray._private import ray_constants
        from ray.autoscaler._private.util import format_readonly_node_type
        from ray.experimental.internal_kv import _internal_kv_get

        raw = _internal_kv_get(ray_constants.DEBUG_AUTOSCALING_STATUS)
        mapping = (json.loads(raw).get("autoscaler_report") or {}).get("node_type_mapping") if raw else None
    except Exception as exc:
        logger.debug("autoscaler status unavailable: %r", exc)
        return None
    if not mapping:
        return None
    return any(node_type != format_readonly_node_type(node_id) for node_id, node_type in mapping.items())


def local_node_resources() -> dict:
    """The CPUs and GPUs a Ray started on this machine would have (``ray.init`` without
    ``num_cpus``/``num_gpus``): container CPU limits counted, GPUs as Ray detects them.

    Private (``ray._private.utils.get_num_cpus``, ``ray._private.accelerators``): Ray has no
    public call that answers without starting Ray.
    """
    from ray._private.accelerators import get_accelerator_manager_for_resource
    from ray._private.utils import get_num_cpus

    num_gpus = 0
    try:
        manager = get_accelerator_manager_for_resource("GPU")
        visible = manager.get_current_process_visible_accelerator_ids() if manager else None
        num_gpus = len(visible) if visible is not None else manager.get_current_node_num_accelerators()
    except Exception as exc:
        logger.debug("GPU detection failed: %r", exc)
    return {"CPU": float(get_num_cpus()), "GPU": float(num_gpus)}

