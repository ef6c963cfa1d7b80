"""What a configuration's workers ask of a Ray cluster, and whether nodes can hold it.

Each rank of a worker asks for its group's ``placement.rank_bundle``; a worker of N ranks
asks for N bundles, all on one node (STRICT_PACK) or spread where one node cannot hold them
(PACK). ``fits`` answers for nodes' totals (can it ever be placed) or their free resources
(can it be placed now); ``local_shortfall`` checks a whole configuration against the one
machine a private Ray has (``pagedserve config validate``). Plain data in, plain data out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .config import ClusterConfig
from .placement import rank_bundle
from .worker_pool import group_tensor_parallel_size

# Resources every description shows, whether asked for or not.
SHOWN_RESOURCES = ("CPU", "GPU")
_EPSILON = 1e-9


@dataclass(frozen=True)
class WorkerAsk:
    """What each worker of one group asks for: ``bundle`` per rank, ``num_ranks`` ranks placed
    by ``strategy``; ``num_workers`` of them start with the cluster."""

    group: int
    role: str
    bundle: dict
    num_ranks: int
    strategy: str
    num_workers: int

    @property
    def resource_names(self) -> list[str]:
        return [*SHOWN_RESOURCES, *sorted(name for name in self.bundle if name not in SHOWN_RESOURCES)]

    def describe(self) -> str:
        """E.g. "worker group 0 (mixed): each worker asks for CPU 1 x 2 ranks, all on one node (STRICT_PACK)"."""
        ask = format_resources(self.bundle, self.bundle) or "nothing"
        if self.num_ranks > 1:
            where = ("all on one node" if self.strategy == "STRICT_PACK"
                     else "on as few nodes as hold them")
            ask = f"{ask} x {self.num_ranks} ranks, {where} ({self.strategy})"
        return f"worker group {self.group} ({self.role}): each worker asks for {ask}"

    def total(self, num_workers: int | None = None) -> dict:
        """Resources of ``num_workers`` workers (default: the group's starting workers)."""
        count = self.num_workers if num_workers is None else num_workers
        return {name: amount * self.num_ranks * count for name, amount in self.bundle.items()}


def worker_asks(config: ClusterConfig) -> list[WorkerAsk]:
    """One ask per worker group of ``config``, in order."""
    return [WorkerAsk(index, group.role, rank_bundle(group), group_tensor_parallel_size(config, group),
                      group.placement_strategy, group.min_workers)
            for index, group in enumerate(config.workers)]


def num_bundles_in(bundle: dict, resources: dict) -> int:
    """How many copies of ``bundle`` one node's ``resources`` hold (any number for an empty one)."""
    counts = [math.floor(resources.get(name, 0.0) / amount + _EPSILON) for name, amount in bundle.items() if amount > 0]
    return min(counts) if counts else 1 << 30


def fits(ask: WorkerAsk, nodes: list[dict], num_workers: int = 1) -> bool:
    """Whether ``num_workers`` workers of ``ask`` fit on nodes with these resources (one dict
    per node: totals, or what is free)."""
    per_node = [num_bundles_in(ask.bundle, resources) for resources in nodes]
    if ask.strategy == "STRICT_PACK" or ask.num_ranks == 1:
        return sum(count // ask.num_ranks for count in per_node) >= num_workers
    return sum(per_node) >= ask.num_ranks * num_workers


def format_amount(amount: float) -> str:
    return f"{amount:g}" if amount < 1e6 else f"{amount:.3g}"


def format_resources(resources: dict, names) -> str:
    """``names`` of ``resources`` as "CPU 1, GPU 0" (absent ones as 0)."""
    return ", ".join(f"{name} {format_amount(resources.get(name, 0.0))}" for name in names)


def describe_free(nodes, names) -> str:
    """What each node (``ray_compat.NodeResources``) has free of ``names``, e.g.
    "192.0.2.2 (head): CPU 0.5 of 2 free, GPU 0 of 0 free"."""
    if not nodes:
        return "no alive node"
    lines = []
    for node in nodes:
        head = " (head)" if node.is_head else ""
        free = ", ".join(f"{name} {format_amount(node.free.get(name, 0.0))} of "
                         f"{format_amount(node.total.get(name, 0.0))}" for name in names)
        lines.append(f"{node.address}{head}: {free} free")
    return "; ".join(lines)


def config_demand(config: ClusterConfig) -> dict:
    """Everything a configuration reserves when it starts: its starting workers' ranks and the
    central KV manager (the ingress replicas and the controller reserve no CPU)."""
    demand: dict = {"CPU": config.kv_manager_num_cpus}
    for ask in worker_asks(config):
        for name, amount in ask.total().items():
            demand[name] = demand.get(name, 0.0) + amount
    return demand


def local_shortfall(config: ClusterConfig, machine: dict) -> list[str]:
    """Why one machine with ``machine``'s resources (a private Ray's node) cannot hold the
    configuration's starting workers: one line per group that no longer fits, then the sum;
    empty when it fits."""
    problems = []
    free = dict(machine)
    free["CPU"] = free.get("CPU", 0.0) - config.kv_manager_num_cpus
    for ask in worker_asks(config):
        if not fits(ask, [free], ask.num_workers):
            have = format_resources({name: max(0.0, amount) for name, amount in free.items()}, ask.resource_names)
            problems.append(f"{ask.describe()}; its {ask.num_workers} worker(s) need "
                            f"{format_resources(ask.total(), ask.resource_names)}; left for them: {have}")
        for name, amount in ask.total().items():
            free[name] = free.get(name, 0.0) - amount
    if problems:
        demand = config_demand(config)
        names = [*SHOWN_RESOURCES, *sorted(name for name in demand if name not in SHOWN_RESOURCES)]
        problems.append(f"in all (with the KV manager's {format_amount(config.kv_manager_num_cpus)} CPU): "
                        f"{format_resources(demand, names)}, against this machine's "
                        f"{format_resources(machine, names)}")
    return problems
