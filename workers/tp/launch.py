"""Starting ranks 1 and up of a tensor-parallel group, and watching that they live.

``distributed_executor_backend`` (vLLM's option) picks how:

* ``"mp"``: local processes (``multiprocessing`` spawn), for ``LLM(...)`` and
  tests: rank ``r`` takes GPU ``r`` of the node;
* ``"ray"``: one Ray actor per rank, each in its own bundle of the placement
  group rank 0 runs in (the cluster creates it: STRICT_PACK, or PACK where
  the config allows), with that bundle's resources. The actors belong to
  rank 0's actor and die with it. A cluster worker's rank 0 runs in its engine
  core process, which has no Ray: it asks its worker actor to start them
  (``ActorLauncher``), and the actor watches them (``RayRanks``).

A rank that ends while the group is in use breaks the group. ``RankSet``
watches the ranks from a thread: local processes make the next step fail
(``GroupBrokenError``); under Ray, rank 0's process exits, so that the
cluster sees one dead worker and Ray restarts it (with new ranks).
"""

from __future__ import annotations

import gc
import logging
import multiprocessing
import os
import threading
from typing import TYPE_CHECKING, Callable, Protocol

if TYPE_CHECKING:   # the rank's module loads torch; a worker actor starting Ray ranks does not need it
    from .rank import RankSpec

logger = logging.getLogger(__name__)

EXECUTOR_BACKENDS = ("mp", "ray")
STOP_TIMEOUT_S = 10.0


class RankSet(Protocol):
    """The running ranks 1..size-1 of one group."""

    def describe(self) -> str:
        """A few words: how the ranks run."""

    def is_broken(self) -> bool:
        """A rank ended while the group was in use."""

    def broken_reason(self) -> str | None:
        """Why the group is broken (which rank ended, how), or None while every rank runs."""

    def wait_broken(self, timeout_s: float) -> bool:
        """Whether a rank has ended, waiting up to ``timeout_s`` for one to."""

    def fail(self, reason: str) -> None:
        """The group cannot go on: under Ray this process exits; else the caller raises."""

    def stop(self) -> None:
        """End every rank (after rank 0 sent ``Stop``, or to clean up)."""


class RankLauncher(Protocol):
    def launch(self, spec: RankSpec) -> RankSet:
        """Start ranks 1..size-1; they join ``spec.rendezvous``. Does not wait for them."""


class ProcessRanks:
    """Ranks as spawned local processes."""

    def __init__(self, processes: list, on_broken: Callable[[str], None] | None = None) -> None:
        self.processes = processes
        self.is_stopping = False
        self._broken: str | None = None
        self._on_broken = on_broken
        self._watcher = threading.Thread(target=self._watch, name="pagedserve-tp-watch", daemon=True)
        self._watcher.start()

    def describe(self) -> str:
        return f"local processes {[p.pid for p in self.processes]}"

    def is_broken(self) -> bool:
        return self._broken is not None

    def broken_reason(self) -> str | None:
        return self._broken

    def wait_broken(self, timeout_s: float) -> bool:
        from multiprocessing.connection import wait

        if self._broken is None and wait([p.sentinel for p in self.processes], timeout=timeout_s):
            self._broken = "a rank process ended"
        return self._broken is not None

    def fail(self, reason: str) -> None:
        self._broken = self._broken or reason

    def _watch(self) -> None:
        from multiprocessing.connection import wait

        sentinels = {p.sentinel: p for p in self.processes}
        while sentinels and not self.is_stopping:
            for sentinel in wait(list(sentinels), timeout=1.0):
                process = sentinels.pop(sentinel)
                # The sentinel closes while the process exits, before it can be reaped:
                # join (a blocking wait, the exit is under way) to read its exit code.
                process.join(timeout=STOP_TIMEOUT_S)
                if not self.is_stopping:
                    self._broken = f"rank process {process.pid} ended (exit code {process.exitcode})"
                    logger.error("tensor-parallel group broken: %s", self._broken)
                    if self._on_broken is not None:
                        self._on_broken(self._broken)

    def stop(self) -> None:
        self.is_stopping = True
        for process in self.processes:
            process.join(timeout=STOP_TIMEOUT_S)
            if process.is_alive():
                process.kill()
                process.join(timeout=STOP_TIMEOUT_S)


def start_rank(spec: dict, rank: int, gpu_index: int) -> None:
    """A rank's process or actor: the cyclic collector off before torch is imported (until
    ``run_rank``'s ``prepare_serving_heap``), then ``rank.run_rank``. A rank actor whose start
    failed lives on until its group stops it: its collector is on again."""
    from ..process.gc_heap import pause_collection_for_startup

    pause_collection_for_startup()
    try:
        from .rank import run_rank

        run_rank(spec, rank, gpu_index)
    finally:
        gc.enable()


class ProcessLauncher:
    """``"mp"``: spawn one local process per rank."""

    def launch(self, spec: RankSpec) -> ProcessRanks:
        context = multiprocessing.get_context("spawn")
        processes = []
        for rank in range(1, spec.rendezvous.size):
            process = context.Process(target=start_rank, args=(spec.to_dict(), rank, rank),
                                      name=f"pagedserve-tp-rank{rank}", daemon=True)
            process.start()
            processes.append(process)
        return ProcessRanks(processes)


class RankActor:
    """A Ray actor holding one rank; ``run`` is its only task and lasts as long as the group."""

    def run(self, spec: dict, rank: int) -> None:
        start_rank(spec, rank, gpu_index=0)


class RayRanks:
    """Ranks as Ray actors; a rank that ends while in use ends rank 0's process."""

    def __init__(self, actors: list, runs: list) -> None:
        self.actors = actors
        self.runs = runs
        self.is_stopping = False
        self._broken: str | None = None
        self._watcher = threading.Thread(target=self._watch, name="pagedserve-tp-watch", daemon=True)
        self._watcher.start()

    def describe(self) -> str:
        return f"{len(self.actors)} Ray actors"

    def is_broken(self) -> bool:
        return self._broken is not None

    def broken_reason(self) -> str | None:
        return self._broken

    def wait_broken(self, timeout_s: float) -> bool:
        import ray

        done, _ = ray.wait(list(self.runs), num_returns=1, timeout=timeout_s)
        return bool(done) or self._broken is not None

    def fail(self, reason: str) -> None:
        self._broken = reason
        logger.error("tensor-parallel group broken: %s; this worker exits so that the cluster restarts "
                     "the whole group", reason)
        os._exit(1)

    def _watch(self) -> None:
        import ray

        pending = list(self.runs)
        while pending and not self.is_stopping:
            done, pending = ray.wait(pending, num_returns=1, timeout=1.0)
            if done and not self.is_stopping:
                try:
                    ray.get(done[0])
                    reason = "a rank left its command loop"
                except Exception as exc:
                    reason = f"a rank died ({type(exc).__name__})"
                self.fail(reason)

    def stop(self) -> None:
        import ray

        self.is_stopping = True
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:
                pass


class RayLauncher:
    """``"ray"``: one actor per rank in bundle ``rank`` of the current placement group."""

    def __init__(self, placement_group) -> None:
        self.placement_group = placement_group

    def launch(self, spec: RankSpec) -> RayRanks:
        return self.launch_dict(spec.to_dict(), spec.rendezvous.size)

    def launch_dict(self, spec: dict, size: int) -> RayRanks:
        """``launch`` of a spec as plain data (``RankSpec.to_dict``), for a group of ``size`` ranks."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundles = self.placement_group.bundle_specs
        actor_cls = ray.remote(RankActor)
        actors, runs = [], []
        for rank in range(1, size):
            bundle = dict(bundles[rank])
            actor = actor_cls.options(
                num_cpus=bundle.pop("CPU", 0), num_gpus=bundle.pop("GPU", 0),
                resources={k: v for k, v in bundle.items() if not k.startswith(("memory", "bundle_group"))}
                or None, max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.placement_group, placement_group_bundle_index=rank,
                    placement_group_capture_child_tasks=False),
            ).remote()
            actors.append(actor)
            runs.append(actor.run.remote(spec, rank))
        return RayRanks(actors, runs)


class ActorLauncher:
    """Ranks started by the worker actor (``RayLauncher`` in its process), asked over the engine
    core's ``link`` (``engine.core.ActorLink``): the core has no Ray of its own."""

    def __init__(self, link, timeout_s: float) -> None:
        self.link = link
        self.timeout_s = timeout_s

    def launch(self, spec: RankSpec) -> "ActorRanks":
        return ActorRanks(self.link, self.link.ask("launch_ranks", [spec.to_dict()], self.timeout_s))


class ActorRanks:
    """The ranks a worker actor started and watches for its engine core: a rank that ends
    ends the actor's process (``RayRanks.fail``), and the core with it."""

    def __init__(self, link, description: str) -> None:
        self.link = link
        self.description = description

    def describe(self) -> str:
        return self.description

    def is_broken(self) -> bool:
        return False   # the actor's watcher ends both processes first

    def broken_reason(self) -> str | None:
        return None

    def wait_broken(self, timeout_s: float) -> bool:
        return bool(self.link.ask("ranks_wait_broken", [timeout_s], timeout_s + STOP_TIMEOUT_S))

    def fail(self, reason: str) -> None:
        self.link.ask("ranks_fail", [reason], STOP_TIMEOUT_S)

    def stop(self) -> None:
        try:
            self.link.ask("ranks_stop", [], STOP_TIMEOUT_S)
        except Exception as exc:   # the actor is going: its ranks go with it
            logger.warning("tensor-parallel ranks: stop not confirmed by the worker actor (%r)", exc)


def current_placement_group(size: int):
    """The placement group this process runs in, if it has a bundle per rank; else None."""
    try:
        import ray

        if not ray.is_initialized():
            return None
        from ray.util import get_current_placement_group

        group = get_current_placement_group()
    except Exception:
        return None
    if group is None or len(group.bundle_specs) < size:
        return None
    return group


def choose_launcher(backend: str | None, size: int) -> RankLauncher:
    """The launcher for ``distributed_executor_backend`` (None: Ray inside a placement group
    with a bundle per rank, else local processes)."""
    if backend not in (None, *EXECUTOR_BACKENDS):
        raise ValueError(f"distributed_executor_backend must be one of {EXECUTOR_BACKENDS}, got {backend!r}")
    group = current_placement_group(size)
    if backend == "ray" or (backend is None and group is not None):
        if group is None:
            raise ValueError(f"distributed_executor_backend 'ray' needs this process to run in a Ray placement "
                             f"group with {size} bundles (one per rank)")
        return RayLauncher(group)
    return ProcessLauncher()
