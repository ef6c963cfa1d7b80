"""Where a worker's actors go: one actor, or one per tensor-parallel rank in a placement group.

A worker of one rank is one actor with its group's resources. A worker of N
ranks gets a placement group of N bundles, each with those resources
(STRICT_PACK: one node; PACK where the config allows: spread when one node
cannot hold them). The worker actor (rank 0) takes bundle 0; its runner
starts ranks 1..N-1 in the other bundles (``workers.tp.launch``). The
placement group is named after the worker actor, so that whoever removes the
worker for good also frees its bundles (``remove_worker_placement``); when
Ray restarts a worker, its placement group stays and the new incarnation
starts new ranks in it.
"""

from __future__ import annotations

import logging
from typing import Any

from .config import WorkerGroup

logger = logging.getLogger("pagedserve.cluster")


def placement_group_name(actor_name: str) -> str:
    return f"{actor_name}-ranks"


def rank_bundle(group: WorkerGroup) -> dict[str, float]:
    """One rank's resources, as a placement group bundle."""
    bundle = {"CPU": group.num_cpus, "GPU": group.num_gpus, **group.resources}
    return {name: amount for name, amount in bundle.items() if amount}


def worker_actor_options(group: WorkerGroup, tensor_parallel_size: int, actor_name: str,
                         namespace: str) -> dict[str, Any]:
    """``ray.remote(Worker).options(...)`` for worker actor ``actor_name`` of ``group``."""
    options: dict[str, Any] = dict(name=actor_name, namespace=namespace, max_restarts=-1, max_task_retries=0,
                                   max_concurrency=1000, num_cpus=group.num_cpus, num_gpus=group.num_gpus,
                                   resources=group.resources or None)
    if tensor_parallel_size == 1:
        return options
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    name = placement_group_name(actor_name)
    try:
        placement = ray.util.get_placement_group(name)   # a restarted controller's earlier one
    except ValueError:
        placement = ray.util.placement_group([rank_bundle(group)] * tensor_parallel_size,
                                             strategy=group.placement_strategy, name=name)
    options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
        placement, placement_group_bundle_index=0, placement_group_capture_child_tasks=False)
    return options


def remove_worker_placement(actor_name: str, namespace: str | None = None) -> None:
    """Free the bundles of worker ``actor_name``'s ranks, if it has any (never raises)."""
    try:
        import ray

        placement = ray.util.get_placement_group(placement_group_name(actor_name))
    except Exception:
        return
    try:
        ray.util.remove_placement_group(placement)
    except Exception as exc:
        logger.warning("could not remove the placement group of %s: %r", actor_name, exc)


def worker_placement_group_id(actor_name: str) -> str | None:
    """The id (hex) of worker ``actor_name``'s placement group; None if it has none."""
    try:
        import ray

        return ray.util.get_placement_group(placement_group_name(actor_name)).id.hex()
    except Exception:
        return None
