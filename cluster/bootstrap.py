"""Bring a pagedserve cluster up on the current Ray cluster."""

from __future__ import annotations

import logging
import os
import re
import time
from pathlib import Path
from typing import Any

from pagedserve.workers.actor.worker import stall_timeout_s
from pagedserve.workers.model.model_source import is_hub_id
from pagedserve.workers.spec_decode.config import MODEL_METHODS, check_draft_fits, check_eagle_head_fits

from . import ray_compat
from .config import ClusterConfig, ModelConfig, load_config
from .controller import CONTROLLER_NAME, ClusterController
from .handle import ClusterHandle
from .capacity import worker_asks
from .kv_relay import node_relay
from .placement import remove_worker_placement, worker_actor_options, worker_placement_group_id
from .placement_watch import PendingWorker, PlacementWatch
from .worker_pool import group_engine_config, group_engine_options, group_tensor_parallel_size, worker_actor_name

logger = logging.getLogger("pagedserve.cluster")

NAMESPACE = "pagedserve"
# The files a checkpoint's tokenizer is commonly loaded from (a hint where none is there).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
RAY_ADDRESS_ENV = "RAY_ADDRESS"
KV_MANAGER_NAME = "pagedserve-kv-manager"


def worker_name(index: int) -> str:
    return worker_actor_name(index)


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

    from pagedserve.workers.actor.worker import Worker

    from .kv_central import CentralKVManager

    return ray.remote(CentralKVManager), ray.remote(Worker), ray.remote(ClusterController)


class WorkerStartError(RuntimeError):
    """A worker could not start (its model, its pools): the message names it and why."""


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _start_failure(worker_id: str, exc: Exception) -> WorkerStartError:
    """The reason a worker's constructor gave (the last line of Ray's report), with its id."""
    lines = [line.strip() for line in _ANSI.sub("", str(exc)).splitlines() if line.strip()]
    return WorkerStartError(f"{worker_id} could not start: {lines[-1] if lines else type(exc).__name__}")


# How often a start that waits for its workers looks at what Ray has not placed.
PLACEMENT_CHECK_INTERVAL_S = 1.0


def _abandon(actors: list, num_workers: int) -> None:
    """A start that failed: its actors killed (for good) and its first ``num_workers`` workers'
    placement groups removed."""
    import ray

    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:   # already gone
            pass
    for i in range(num_workers):
        remove_worker_placement(worker_name(i), NAMESPACE)


def _wait_ready(refs: dict[str, Any], timeout_s: float, show_progress: bool,
                watch: PlacementWatch | None = None) -> list:
    """Wait for every worker (id -> its ``info`` ref) to load its model and allocate its
    pools, with a progress bar. The first worker that fails ends the wait with its reason;
    ``watch`` names workers Ray has not placed, and ends a hopeless wait."""
    import ray
    from ray.exceptions import RayActorError, RayTaskError
    from tqdm import tqdm

    deadline = time.time() + timeout_s
    worker_of = {ref: worker_id for worker_id, ref in refs.items()}
    pending = list(refs.values())
    infos = {}
    with tqdm(total=len(refs), desc="workers ready (model loaded, KV pools allocated)",
              unit="worker", disable=not show_progress, leave=False) as bar:
        while pending:
            remaining = max(0.0, deadline - time.time())
            ready, pending = ray.wait(pending, num_returns=1, timeout=min(remaining, PLACEMENT_CHECK_INTERVAL_S))
            if not ready and remaining <= PLACEMENT_CHECK_INTERVAL_S:
                raise TimeoutError(f"{len(pending)} worker(s) not ready after {timeout_s:.0f} s: "
                                   f"{sorted(worker_of[ref] for ref in pending)}")
            if not ready:
                if watch is not None:
                    watch.check({worker_of[ref] for ref in pending})
                continue
            for ref in ready:
                try:
                    infos[worker_of[ref]] = ray.get(ref)
                except (RayActorError, RayTaskError) as exc:
                    raise _start_failure(worker_of[ref], exc) from None
            bar.update(len(ready))
    return [infos[worker_id] for worker_id in refs]


def check_model(config: ClusterConfig, model_path: str, with_class: bool = True):
    """Refuse, with the reason, a model the workers cannot serve exactly, or that does not
    fit a worker group (``check_model_fits``); return its transformers config. Reads the
    model's config only; ``with_class=False`` leaves out the check of its transformers class
    (``check_causal_lm_class``, which imports the model's code)."""
    model_config = servable_config(config.model, model_path, with_class)
    check_model_fits(config, model_config)
    return model_config


def servable_config(model: ModelConfig, model_path: str, with_class: bool = True):
    """``check_servable_config`` of the checkpoint at ``model_path``, running its own code only
    with ``model.trust_remote_code``; a checkpoint that needs it, while that is off, is refused
    naming the key and the flag (transformers' message names its own argument)."""
    # Imported here: the model checks load torch, which 'pagedserve status' (init_ray) never needs.
    from pagedserve.workers.model.model_support import check_servable_config

    try:
        return check_servable_config(model_path, model.trust_remote_code, with_class)
    except ValueError as exc:
        if model.trust_remote_code or "trust_remote_code" not in str(exc):
            raise
        raise ValueError(f"{model_path} holds code of its own (config.json's auto_map), which pagedserve runs "
                         "only with model.trust_remote_code: true (serve --trust-remote-code), for a checkpoint "
                         "you trust") from None


def check_model_fits(config: ClusterConfig, model_config) -> None:
    """Refuse, with the reason, a model (its transformers config) whose layers cannot be split
    across a worker group's ``tensor_parallel_size`` ranks (no tensor-parallel plan, head
    counts that do not divide), or that computes exactly a shorter context than a group's
    ``max_model_len``, and a draft model or EAGLE head (``speculative_config``) that cannot
    propose for it: the messages a worker's engine would give."""
    from pagedserve.workers.model.model_support import check_max_model_len, context_limit
    from pagedserve.workers.tp.plan import check_tensor_parallel

    for group in config.workers:
        options = group_engine_options(config, group)
        check_tensor_parallel(model_config, options.tensor_parallel_size)
        max_model_len = check_max_model_len(options.max_model_len, *context_limit(model_config))
        spec = options.speculative_config
        if spec is None or spec.method not in MODEL_METHODS:
            continue
        draft_config = draft_model_config(config.model, spec.model, spec.method)
        if draft_config is None:
            continue
        if spec.method == "draft_model":
            check_draft_fits(spec.model, draft_config.vocab_size, model_config.vocab_size,
                             *context_limit(draft_config), max_model_len)
        else:
            check_eagle_head_fits(spec.model, draft_config, model_config.get_text_config(), spec.method)


def check_tokenizer_loads(model_path: str, trust_remote_code: bool = False) -> None:
    """Refuse, naming the checkpoint, one whose tokenizer does not load as a worker's engine
    loads it (``AutoTokenizer``): a directory with no tokenizer files, say."""
    from pagedserve.workers.outputs.tokenizer_loading import load_tokenizer

    try:
        load_tokenizer(model_path, trust_remote_code)
    except Exception as exc:   # transformers raises OSError, ValueError, TypeError, KeyError...
        reason = " ".join(str(exc).split()) or type(exc).__name__
        directory = Path(model_path)
        if directory.is_dir() and not any((directory / name).exists() for name in TOKENIZER_FILES):
            reason = f"the directory holds none of {', '.join(TOKENIZER_FILES)}; {reason}"
        raise ValueError(f"the tokenizer of {model_path} cannot be loaded, as every worker would load it "
                         f"(AutoTokenizer): {reason}") from None


def draft_model_config(model: ModelConfig, draft: str, method: str):
    """The transformers config of speculative decoding's draft model or EAGLE head: a
    directory's, or a hub id's from this node's hub cache. A draft model's is checked as the
    target's is (its own code runs only with ``model.trust_remote_code``). None where this node
    has neither: the workers resolve the draft on their own nodes, and check it there."""
    if is_hub_id(draft):
        path = _hub_cache_folder(draft)
    else:
        path = draft if Path(draft).is_dir() else None
    if path is None:
        return None
    try:
        if method == "draft_model":
            return servable_config(model, path)
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"speculative_config.model {draft!r}: {exc}") from None


def cached_model_config(model: ModelConfig):
    """``model``'s transformers config, read without weights or the network, as
    ``check_servable_config`` checks it: a directory's, a hub id's from this node's hub cache
    (None where the cache lacks it), the random-weight model's without building it (its
    families are servable by construction)."""
    if not model.path:
        from pagedserve.devtools.model_factory import build_config

        return build_config(model.arch, model.size)
    source = model.source()
    if not source.is_hub_id:
        return servable_config(model, source.resolve(weights=False))
    folder = _hub_cache_folder(source.reference, source.download_dir, source.revision)
    return servable_config(model, folder) if folder is not None else None


def _hub_cache_folder(hub_id: str, cache_dir: str | None = None, revision: str | None = None) -> str | None:
    """The folder of ``hub_id``'s config in this node's hub cache; None where the cache lacks it."""
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(hub_id, "config.json", cache_dir=cache_dir, revision=revision)
    return str(Path(cached).parent) if isinstance(cached, str) else None


def init_ray(address: str | None = None, **ray_init_kwargs: Any) -> bool:
    """Connect this process to Ray in pagedserve's namespace; True if it started its own.

    ``address`` (else ``$RAY_ADDRESS``) names a running cluster to join, with its
    token authentication as for one Ray finds itself; without either, a new
    private Ray starts (``address="local"``) that ends with this process, never
    a cluster that happens to run on the machine.
    """
    import ray

    address = address or os.environ.get(RAY_ADDRESS_ENV) or None
    ray_compat.enable_token_auth_for(address)
    ray.init(address=address or "local", namespace=NAMESPACE, **ray_init_kwargs)
    return address is None or address == "local"


def start(config: ClusterConfig | dict | str | Path | None = None, address: str | None = None,
          ready_timeout_s: float | None = None, show_progress: bool = False, is_private_ray: bool = False,
          **ray_init_kwargs: Any) -> ClusterHandle:
    """Start the KV manager and the workers the config asks for; return a handle.

    Uses the Ray this process is connected to, else ``init_ray(address)``: the
    cluster at ``address`` (or ``$RAY_ADDRESS``), or a new private one. The KV manager is one
    named, restartable actor, placed on the head node; workers are
    restartable actors, one per worker slot (``num_gpus`` per group).

    Workers Ray cannot place are named on the log (``placement_watch``); ``PlacementError``
    ends a hopeless wait: at once when no node can hold them and no autoscaler can add one,
    or when the Ray is private (``is_private_ray``, or one this call starts), else after
    ``config.placement_timeout_s``.
    """
    import ray

    config = _coerce_config(config)
    ready_timeout_s = ready_timeout_s or config.worker_ready_timeout_s
    # Here (the head node): config and tokenizer only; every worker fetches the weights itself.
    model_path = config.model.resolve_path()
    model_source = config.model.source().to_dict()
    # A model we cannot serve exactly, or not split across a group's ranks, is refused here,
    # before Ray or any worker starts.
    check_model(config, model_path)
    owns_ray = False
    if not ray.is_initialized():
        owns_ray = init_ray(address, **ray_init_kwargs)
        is_private_ray = owns_ray
    kv_cls, worker_cls, controller_cls = _actor_classes()
    kv_manager = kv_cls.options(
        name=KV_MANAGER_NAME, namespace=NAMESPACE, max_restarts=-1, max_task_retries=0,
        num_cpus=config.kv_manager_num_cpus, **ray_compat.head_node_placement()).remote(
        config.kv_events.transport, config.kv_events.relay_flush_s)
    ray.get(kv_manager.get_incarnation.remote(), timeout=ready_timeout_s)

    workers, names, roles, groups, pending = {}, {}, {}, {}, {}
    asks = worker_asks(config)
    index = 0
    for group_index, group in enumerate(config.workers):
        engine_dict = group_engine_config(config, group, model_path)
        for _ in range(group.min_workers):
            worker_id = f"worker-{index}"
            handle = worker_cls.options(**worker_actor_options(
                group, group_tensor_parallel_size(config, group), worker_name(index), NAMESPACE),
            ).remote(worker_id, engine_dict, KV_MANAGER_NAME, group.role, config.step_timeout_s,
                     model_source=model_source, kv_events=config.kv_events.model_dump(),
                     kv_relay=node_relay, namespace=NAMESPACE)
            workers[worker_id] = handle
            names[worker_id] = worker_name(index)
            roles[worker_id] = group.role
            groups[worker_id] = group_index
            ask = asks[group_index]
            pending[worker_id] = PendingWorker(
                worker_id, ask, worker_placement_group_id(worker_name(index)) if ask.num_ranks > 1 else None)
            index += 1
    start_time = time.time()
    watch = PlacementWatch(pending, config.placement_timeout_s, ready_timeout_s, is_private_ray)
    try:
        infos = _wait_ready({w: actor.info.remote() for w, actor in workers.items()}, ready_timeout_s,
                            show_progress, watch)
    except BaseException:
        _abandon([*workers.values(), kv_manager], index)
        raise
    logger.info("pagedserve: %d workers ready in %.1f s", len(infos), time.time() - start_time)
    # The one health monitor of the cluster, whatever the number of ingress replicas; it also
    # owns the worker set from here on (elastic groups grow and shrink there).
    pool = {"config": config.model_dump(mode="json"), "model_path": model_path, "model_source": model_source,
            "kv_manager_name": KV_MANAGER_NAME, "groups": groups}
    controller = controller_cls.options(
        name=CONTROLLER_NAME, namespace=NAMESPACE, max_restarts=-1, max_task_retries=0, num_cpus=0,
        max_concurrency=16, **ray_compat.head_node_placement()).remote(
            names, roles, stall_timeout_s(config.step_timeout_s), probe_interval_s=config.health_check_period_s,
            pool=pool, namespace=NAMESPACE)
    try:
        ray.get(controller.ping.remote(), timeout=ready_timeout_s)
    except BaseException:
        _abandon([controller, *workers.values(), kv_manager], index)
        raise
    return ClusterHandle(config, model_path, kv_manager, workers, roles, infos[0], controller,
                         owns_ray=owns_ray, namespace=NAMESPACE)
