"""Bring a pagedserve cluster up on the current Ray cluster."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from dataclasses import asdict

from . import ray_compat
from .config import ClusterConfig, EngineOptions, load_config
from .handle import ClusterHandle

logger = logging.getLogger("pagedserve.cluster")

NAMESPACE = "pagedserve"
KV_MANAGER_NAME = "pagedserve-kv-manager"


def worker_name(index: int) -> str:
    return f"pagedserve-worker-{index}"


def _coerce_config(config: ClusterConfig | dict | str | Path | None) -> ClusterConfig:
    if config is None:
        return ClusterConfig()
    if isinstance(config, ClusterConfig):
        return config
    if isinstance(config, dict):
        return ClusterConfig.model_validate(config)
    return load_config(config)


def _actor_classes():
    import ray

    from pagedserve.kvmanager.service import KVManagerService
    from pagedserve.workers.worker import Worker

    return ray.remote(KVManagerService), ray.remote(Worker)


def _wait_ready(refs: list, timeout_s: float, show_progress: bool) -> list:
    """Wait for every worker to load its model and allocate its pools, with a progress bar."""
    import ray
    from tqdm import tqdm

    deadline = time.time() + timeout_s
    pending = list(refs)
    with tqdm(total=len(refs), desc="workers ready (model loaded, KV pools allocated)",
              unit="worker", disable=not show_progress, leave=False) as bar:
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.time()))
            if not ready:
                raise TimeoutError(f"{len(pending)} worker(s) not ready after {timeout_s:.0f} s")
            bar.update(len(ready))
    return ray.get(refs)


def start(config: ClusterConfig | dict | str | Path | None = None, address: str | None = None,
          ready_timeout_s: float = 600.0, show_progress: bool = False,
          **ray_init_kwargs: Any) -> ClusterHandle:
    """Start the KV manager and the workers the config asks for; return a handle.

    Joins the Ray cluster at ``address`` (or the one this process is already
    connected to), starting a local one otherwise. The KV manager is one
    named, restartable actor, placed on the head node; workers are
    restartable actors, one per worker slot (``num_gpus`` per group).
    """
    import ray

    config = _coerce_config(config)
    owns_ray = False
    if not ray.is_initialized():
        ray.init(address=address, namespace=NAMESPACE, **ray_init_kwargs)
        owns_ray = address is None
    model_path = config.model.resolve_path()
    kv_cls, worker_cls = _actor_classes()
    kv_manager = kv_cls.options(
        name=KV_MANAGER_NAME, namespace=NAMESPACE, max_restarts=-1, max_task_retries=0,
        num_cpus=config.kv_manager_num_cpus, **ray_compat.head_node_placement()).remote()
    ray.get(kv_manager.get_incarnation.remote(), timeout=ready_timeout_s)

    workers, roles = {}, {}
    index = 0
    for group in config.workers:
        options = config.engine.model_copy(update=EngineOptions.model_validate(
            {**config.engine.model_dump(), **group.engine}).model_dump())
        engine_dict = asdict(options.to_engine_config(model_path))
        for _ in range(group.count):
            worker_id = f"worker-{index}"
            handle = worker_cls.options(
                name=worker_name(index), namespace=NAMESPACE, max_restarts=-1, max_task_retries=0,
                max_concurrency=1000, num_cpus=group.num_cpus, num_gpus=group.num_gpus,
                resources=group.resources or None,
            ).remote(worker_id, engine_dict, kv_manager, group.role, config.step_timeout_s)
            workers[worker_id] = handle
            roles[worker_id] = group.role
            index += 1
    start_time = time.time()
    infos = _wait_ready([w.info.remote() for w in workers.values()], ready_timeout_s, show_progress)
    logger.info("pagedserve: %d workers ready in %.1f s", len(infos), time.time() - start_time)
    return ClusterHandle(config, model_path, kv_manager, workers, roles, infos[0], owns_ray=owns_ray)
