"""The worker: one model replica per GPU (or CPU slot), run as a Ray actor.

It owns the model, its device block pool and its host swap pool, and runs
the engine loop. Block accounting runs here, in-process (``LocalKVManager``):
a step makes no remote call. What changed reaches the central KV manager
actor as batched events, packed on the engine thread and sent by a sender thread
(``kvmanager.publisher.KVPublisher``);
only a step that cannot grow asks it, once, how to preempt (migrate, swap,
recompute), and decides locally when it does not answer in time. If the
central manager restarts, the worker's next publish is answered "resync"
and it sends a snapshot; meanwhile it keeps serving.

``heartbeat`` tells the cluster whether the engine loop still makes
progress. For fault-injection tests only, ``inject_stall`` freezes the
engine loop; it refuses unless ``PAGEDSERVE_ENABLE_FAULT_INJECTION=1`` is set
in the worker's environment (off by default).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from typing import TYPE_CHECKING, AsyncIterator

import numpy as np

from pagedserve.kvmanager import EventLog, KVPublisher, LocalKVManager, RemotePreemptionPolicy

from ..process.background_loop import BackgroundLoop
from ..process.gc_heap import prepare_serving_heap
from ..kv_events.wire import DEFAULT_TICK_S, ZmqTransport, connect_transport
from ..model.model_source import ModelSource
from .output_channel import CHANNEL_LEASE_S, ChannelMessage, OutputChannel
from .protocol import DeltaEncoder, GenerateRequest, OutputDelta, merge_deltas

if TYPE_CHECKING:
    from ..engine.engine import LLMEngine

# The engine (torch, the model) loads in ``Worker.__init__``: the processes that only create or
# call workers (the cluster controller, the handle in Serve's replicas) never load it.

logger = logging.getLogger(__name__)

ROLES = ("mixed", "prefill", "decode")
FAULT_INJECTION_ENV = "PAGEDSERVE_ENABLE_FAULT_INJECTION"
# A worker with work whose engine loop has not finished a step for this many
# step timeouts is stalled.
STALL_TIMEOUT_FACTOR = 2.0
# How long a step that cannot grow waits for the central preemption decision, and
# how long it then decides locally (migration paused) before asking again.
PREEMPTION_TIMEOUT_S = 1.0
PREEMPTION_BACKOFF_S = 5.0
IDLE_SENDER_WAKEUP_S = 0.025   # an idle engine's due flushes and acks: no need to wake more often
# Ids of channels closed here that are remembered, so a request that arrives after its
# channel closed is refused rather than run for nobody.
CLOSED_CHANNELS_KEPT = 4096
# A migrated sequence's KV export is kept alive here until the handle releases it
# (the target has fetched it) or, should the handle never do so, this long.
EXPORT_HOLD_S = 300.0


def stall_timeout_s(step_timeout_s: float) -> float:
    """Seconds without engine progress after which a busy worker counts as stalled."""
    return STALL_TIMEOUT_FACTOR * step_timeout_s


def _node_id() -> str | None:
    """The Ray node this process runs on (None outside Ray)."""
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None


def _actor_id() -> str | None:
    """This actor's id (None outside an actor), for Ray's state API."""
    import ray

    return ray.get_runtime_context().get_actor_id() if ray.is_initialized() else None


class Worker:
    """A model replica with its pools and engine loop. Wrapped by ``ray.remote``.

    ``kv_manager`` is the name of the central KV manager actor, in ``namespace``
    (None: this job's), looked up here: passed as a handle, the argument would
    live in the object store and Ray's restart of this actor would depend on its
    creator. No engine step waits for the KV manager except the rare preemption
    decision (``PREEMPTION_TIMEOUT_S``). ``kv_relay(kv_manager, namespace,
    kv_events) -> actor`` (passed in by the cluster: ``cluster.kv_relay.node_relay``)
    gets this node's KV event relay; with ``kv_events["relay"]`` the events go
    through it (``workers.kv_events.relay``).
    """

    def __init__(self, worker_id: str, engine_config: dict, kv_manager: str, role: str = "mixed",
                 step_timeout_s: float = 30.0, model_source: dict | None = None,
                 kv_events: dict | None = None, kv_relay=None, namespace: str | None = None) -> None:
        import ray

        from ..offline.async_engine import AsyncLLMEngine
        from ..engine.engine import EngineConfig, LLMEngine
        from ..model.model_runner import dtype_name

        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        if model_source is not None:
            # Resolved here, on this worker's node: a hub id is fetched into this node's cache.
            local_dir = ModelSource.from_dict(model_source).resolve(weights=True)
            engine_config = {**engine_config, "model": local_dir, "tokenizer": None}
        self.worker_id = worker_id
        self.role = role
        self.step_timeout_s = step_timeout_s
        self.last_progress = time.time()
        self.pending_stall_s = 0.0
        self.held_exports: dict[str, tuple[object, float]] = {}
        self.channels: dict[str, OutputChannel] = {}
        self.channel_lease_s = CHANNEL_LEASE_S
        self.closed_channels: dict[str, None] = {}   # insertion-ordered: the oldest go first
        kv_manager_name, kv_manager = kv_manager, ray.get_actor(kv_manager, namespace=namespace)
        self.preemption = RemotePreemptionPolicy(lambda request: self.kv_link.decide_preemption(request),
                                                 backoff_s=PREEMPTION_BACKOFF_S)
        self.local_kv = LocalKVManager(self.preemption, EventLog(worker_id))
        engine = LLMEngine(EngineConfig(**engine_config), worker_id, kv_manager=self.local_kv, role=role)
        engine.scheduler.allow_migration = True
        self.engine = engine
        kv_events = kv_events or {}
        transport = kv_events.get("transport", "zmq")
        relay = None
        if kv_relay is not None and transport == "zmq" and kv_events.get("relay", False):
            try:  # this node's relay actor (``cluster.kv_relay.node_relay``, passed in)
                relay = kv_relay(kv_manager_name, namespace, kv_events)
            except Exception as exc:
                logger.warning("worker %s: no KV event relay on this node (%r); publishing to the "
                               "central KV manager directly", worker_id, exc)
        # A new relay starts a process on this node: on a loaded node that takes seconds.
        self.kv_transport = connect_transport(kv_manager, transport, relay=relay, timeout_s=60.0,
                                              ack_timeout_s=kv_events.get("ack_timeout_s", 2.0))
        # The engine's thread only drains and packs; the sender thread below sends and reads acks.
        on_tick = isinstance(self.kv_transport, ZmqTransport) and kv_events.get("publish_on_tick", False)
        self.kv_link = KVPublisher(self.local_kv, self.kv_transport,
                                   max_batch_age_s=kv_events.get("max_batch_age_s", 0.02),
                                   preemption_timeout_s=PREEMPTION_TIMEOUT_S, background=True,
                                   tick_s=kv_events.get("relay_flush_s", DEFAULT_TICK_S) if on_tick else None)
        engine.step_hooks.append(self._after_step)
        logger.info("worker %s: %s on %s, dtype %s (%s)", worker_id, engine.config.model, engine.runner.device,
                       dtype_name(engine.runner.dtype), engine.runner.dtype_reason)
        self.kv_link.maybe_flush()  # the first snapshot: the central manager learns of this worker
        self.async_engine = AsyncLLMEngine(engine)
        self._kv_flush_at = self.kv_link.next_flush_at() if self.kv_link.tick_s is not None else None
        self._kv_flush_pending = None   # the due flush posted to the engine's thread, if any
        self._kv_sender = BackgroundLoop("pagedserve-kv-sender", self._send_kv_events, self._kv_sender_wait_s,
                                         wakeup=self.kv_link.wakeup)
        self._kv_sender.start()
        self.started_at = time.time()
        self.num_heartbeats = 0  # answered by this incarnation (one monitor asks about 4 a second)
        # Last: the engine, its model and threads are built; no request has come yet.
        self.gc_pauses = prepare_serving_heap(f"worker {worker_id}")

    # ---- the KV manager link ------------------------------------------------------------
    def _after_step(self) -> None:
        """After every engine step, on the engine thread: progress, events out (never waiting)."""
        self._note_progress()
        self.kv_link.maybe_flush()
        self._run_injected_stall()

    def _kv_sender_wait_s(self) -> float:
        """How long the sender thread may sleep: until the engine's thread posts work
        (``kv_link.wakeup``), a due flush or ack is likely, or the next tick's flush."""
        wait_s = max(self.kv_link.max_batch_age_s / 2, IDLE_SENDER_WAKEUP_S)
        if self._kv_flush_at is None:
            return wait_s
        return min(wait_s, max(0.0, self._kv_flush_at - time.time()))

    def _send_kv_events(self) -> None:
        """One round of the sender thread (``BackgroundLoop``): sends what the engine's thread
        packed and reads the acks (the Ray calls happen here, never on the step path); on a
        tick, it also drains and sends the events just before each tick
        (``KVPublisher.flush_on_tick``); an idle engine takes no steps, so due flushes are
        posted to its thread from here. Ends with the engine."""
        link = self.kv_link
        if not self.async_engine.is_running:
            self._kv_sender.stop()
            return
        try:
            if self._kv_flush_at is not None and time.time() >= self._kv_flush_at:
                self._kv_flush_at = link.next_flush_at()
                link.flush_on_tick()
            link.pump()
        except Exception:  # never let the sender stop: the next pump retries
            logger.exception("worker %s: sending KV events failed", self.worker_id)
        pending = self._kv_flush_pending
        if (pending is None or pending.done()) and link.is_due():
            try:
                self._kv_flush_pending = self.async_engine.submit(lambda engine: link.maybe_flush())
            except Exception:  # shutting down
                self._kv_sender.stop()

    def _note_progress(self) -> None:
        self.last_progress = time.time()

    def _note_arrival(self) -> None:
        """An idle engine has not stalled: its progress clock starts at the new request."""
        if not self.engine.requests:
            self._note_progress()

    def _run_injected_stall(self) -> None:
        seconds, self.pending_stall_s = self.pending_stall_s, 0.0
        if seconds > 0:
            logger.warning("worker %s: stalling the engine loop for %.1f s (fault injection)",
                           self.worker_id, seconds)
            time.sleep(seconds)

    # ---- requests -------------------------------------------------------------------
    # ---- channels: one stream per handle for all its requests -----------------------------
    async def submit(self, channel_id: str, request: GenerateRequest) -> bool:
        """Start ``request``: its ``OutputDelta``s go out on channel ``channel_id``
        (``channel_outputs``), ending with the finished one, or with ``Migrated`` when the KV
        manager moves it to another worker. Raises for a request the engine refuses. False if
        that channel has closed: the request was not started."""
        if channel_id in self.closed_channels:
            return False
        options = {"output_token_ids": request.output_token_ids} if request.output_token_ids else {}
        transfer_s = None
        if request.kv:
            # The transfer arrives as a nested ObjectRef so that fetching it is timed here.
            start = time.perf_counter()
            header, payload = await request.kv[0]
            fetch_s = time.perf_counter() - start
            transfer_s = (fetch_s, _time_local_copy(payload))
            from ..engine.kv_transfer import KVTransfer

            options["kv_transfer"] = KVTransfer(header, payload)
            if channel_id in self.closed_channels:  # closed while the KV came
                return False
        self._note_arrival()
        channel = self._channel(channel_id)
        channel.renew()
        channel.start(request, transfer_s, **options)
        return True

    def renew_channel(self, channel_id: str) -> bool:
        """The handle still reads channel ``channel_id`` (it calls this every few seconds; a
        channel not renewed for ``channel_lease_s`` closes). False if it is not open here."""
        channel = self.channels.get(channel_id)
        if channel is None:
            return False
        channel.renew()
        return True

    async def channel_outputs(self, channel_id: str) -> AsyncIterator[ChannelMessage]:
        """Stream channel ``channel_id``: one message whenever its requests made something
        since the last one. Ends when the channel is closed; the caller going away closes it,
        aborting its requests."""
        channel = self._channel(channel_id)
        try:
            while (message := await channel.take()) is not None:
                yield message
        finally:
            self.close_channel(channel_id)

    def close_channel(self, channel_id: str) -> int:
        """Close a channel: its running requests are aborted. Returns how many there were."""
        self.closed_channels[channel_id] = None
        while len(self.closed_channels) > CLOSED_CHANNELS_KEPT:
            del self.closed_channels[next(iter(self.closed_channels))]
        channel = self.channels.pop(channel_id, None)
        return 0 if channel is None else channel.close()

    def _channel(self, channel_id: str) -> OutputChannel:
        channel = self.channels.get(channel_id)
        if channel is None:
            channel = self.channels[channel_id] = OutputChannel(channel_id, self.async_engine, self._hold_export,
                                                                 self.channel_lease_s)
        return channel

    async def prefill(self, request: GenerateRequest) -> tuple[OutputDelta, tuple | None]:
        """Run a request's prompt and sample its first token here (a prefill worker).

        Returns the first token's delta and the prompt's KV transfer ``(header,
        payload)``; call it with ``num_returns=2`` and pass the second ref,
        nested in a list, to a decode worker's ``generate`` as ``request.kv``.
        The blocks stay in this worker's prefix cache.
        """
        params = dataclasses.replace(request.params, max_tokens=1)
        encoder = DeltaEncoder()
        deltas = []
        self._note_arrival()
        async for output in self.async_engine.generate(
                request.prompt, params, request.request_id, request.priority, request.prompt_token_ids,
                export_kv=True):
            deltas.append(encoder.encode(output))
        first = merge_deltas(deltas)  # everything the prompt's run made, in one delta
        transfer = self.async_engine.take_kv_export(request.request_id)
        if transfer is None:
            return first, None
        return first, (transfer.header, transfer.payload)

    def _hold_export(self, request_id: str, transfer) -> object:
        """Put a migration's KV in the object store and keep it alive until released.

        The ref travels nested in a streamed output, which Ray does not count
        as a borrow: without this hold the object is freed as soon as it is yielded.
        """
        import ray

        now = time.time()
        for stale in [r for r, (_, held_at) in self.held_exports.items() if now - held_at > EXPORT_HOLD_S]:
            del self.held_exports[stale]
        ref = ray.put(transfer)
        self.held_exports[request_id] = (ref, now)
        return ref

    def release_export(self, request_id: str) -> bool:
        """The migration target has fetched ``request_id``'s KV: let the object go."""
        return self.held_exports.pop(request_id, None) is not None

    def abort(self, request_id: str) -> bool:
        return self.async_engine.abort(request_id)

    # ---- leaving the cluster ----------------------------------------------------------
    async def drain(self) -> dict:
        """Start leaving: from the next step on, the KV manager migrates every running
        single-sample sequence that holds KV to a worker with room, and sends none here.
        Sequences that cannot migrate (several samples, prompt logprobs, no room anywhere)
        finish here. The cluster routes no new requests here; one that still arrives runs
        its prompt and then migrates like the rest. Returns ``drain_status``."""
        def start_draining(engine: LLMEngine) -> None:
            engine.scheduler.is_draining = True

        await asyncio.wrap_future(self.async_engine.submit(start_draining))
        logger.info("worker %s: draining (%d unfinished requests)", self.worker_id, len(self.engine.requests))
        return self.drain_status()

    def drain_status(self) -> dict:
        """What is left before a draining worker may go: requests, and migration exports a
        target has not fetched yet (they live in this worker's object store)."""
        return {"worker_id": self.worker_id, "is_draining": self.engine.scheduler.is_draining,
                "num_unfinished": len(self.engine.requests), "num_held_exports": len(self.held_exports),
                "num_drain_migrations": self.engine.scheduler.num_drain_migrations}

    # ---- introspection ----------------------------------------------------------------
    def info(self) -> dict:
        return {"worker_id": self.worker_id, "role": self.role, "model": self.engine.config.model,
                "max_model_len": self.engine.max_model_len, "eos_token_ids": list(self.engine.eos_token_ids),
                "block_size": self.engine.config.block_size,
                "num_device_blocks": self.engine.pool_config.num_device_blocks,
                "num_parameters": self.engine.runner.num_parameters,
                "device": str(self.engine.runner.device), "node_id": _node_id(), **self._dtype_info(),
                **self._parallel_info()}

    def _parallel_info(self) -> dict:
        """The ranks this worker spans (one for a single-device worker) and each rank's pool."""
        runner = self.engine.runner
        size = getattr(runner, "tensor_parallel_size", 1)
        return {"tensor_parallel_size": size, "ranks": runner.describe_ranks() if size > 1 else [],
                "kv_capacity_tokens": self.engine.pool_config.num_device_blocks * self.engine.config.block_size}

    def _dtype_info(self) -> dict:
        """The dtype this worker chose and why (an explicit engine.dtype, or auto for its device)."""
        from ..model.model_runner import dtype_name

        runner = self.engine.runner
        return {"dtype": dtype_name(runner.dtype), "dtype_reason": runner.dtype_reason}

    async def stats(self) -> dict:
        """Engine, KV pool, KV-link and health figures; answered between engine steps, never
        blocking the actor's event loop. ``kv_pool`` is this worker's pool statistics (the
        source of truth; the central manager holds a lagging summary)."""
        def gather(engine: LLMEngine) -> tuple[dict, dict, dict]:
            pool_stats = engine.kv_manager.stats(engine.worker_id)   # once: O(sequences) on the engine thread
            return (engine.stats(pool_stats), pool_stats,
                    {**self.kv_link.stats(), **self.kv_transport.stats()})

        engine_stats, pool_stats, link_stats = await asyncio.wrap_future(self.async_engine.submit(gather))
        return {"worker_id": self.worker_id, "role": self.role, **self._dtype_info(),
                "device": str(self.engine.runner.device),
                "num_waiting": engine_stats["num_waiting"], "num_running": engine_stats["num_running"],
                "num_steps": engine_stats["num_steps"],
                "num_generated_tokens": engine_stats["num_generated_tokens"],
                "mean_step_ms": engine_stats["mean_step_ms"],
                "num_decode_steps": engine_stats["num_decode_steps"],
                "mean_decode_step_ms": engine_stats["mean_decode_step_ms"],
                "decode_kv_seconds": engine_stats["decode_kv_seconds"],
                "step_hook_seconds": engine_stats["step_hook_seconds"],
                "num_step_calls": engine_stats["num_step_calls"],
                "num_preemptions_by_mode": engine_stats["num_preemptions_by_mode"],
                "swapped_out_bytes": engine_stats["swapped_out_bytes"],
                "swapped_in_bytes": engine_stats["swapped_in_bytes"],
                "kv_pool": pool_stats,
                **link_stats,
                "num_central_preemption_calls": self.preemption.num_calls,
                "num_central_preemption_failures": self.preemption.num_failures,
                "num_local_preemption_decisions": self.preemption.num_local,
                "num_held_exports": len(self.held_exports),
                "num_output_channels": len(self.channels),
                "is_draining": self.engine.scheduler.is_draining,
                "num_drain_migrations": self.engine.scheduler.num_drain_migrations,
                **self._parallel_info(),
                "gc": self.gc_pauses.snapshot(),
                "is_healthy": self.async_engine.is_running}

    async def block_map(self, max_cells: int = 4096) -> dict:
        """This worker's pools block by block, for the dashboard; asked on demand and
        answered between engine steps (``KVManager.block_map``)."""
        return await asyncio.wrap_future(self.async_engine.submit(lambda e: e.block_map(max_cells)))

    async def check_integrity(self) -> bool:
        """Raise ``IntegrityError`` unless this worker's pools are consistent."""
        await asyncio.wrap_future(self.async_engine.submit(lambda engine: engine.check_integrity()))
        return True

    async def num_used_blocks(self) -> int:
        """Device plus host blocks in use here now."""
        return await asyncio.wrap_future(self.async_engine.submit(lambda engine: engine.num_used_blocks()))

    async def kv_sync(self, timeout_s: float = 10.0) -> bytes | None:
        """Publish every pending KV event, wait for the acks, and return this worker's packed
        ``KVSnapshot`` (None if the central manager did not take it all in time). For
        consistency checks; it holds the engine thread while it waits."""
        def sync(engine: LLMEngine) -> bytes | None:
            if not self.kv_link.flush_and_wait(timeout_s):
                return None
            return self.local_kv.snapshot().pack()

        return await asyncio.wrap_future(self.async_engine.submit(sync))

    def num_unfinished(self) -> int:
        return len(self.engine.requests)

    def ping(self) -> str:
        return self.worker_id

    def heartbeat(self) -> dict:
        """Liveness: ``is_stalled`` when the engine loop died, or has work but has not
        made progress for ``stall_timeout_s(step_timeout_s)``."""
        self.num_heartbeats += 1
        num_unfinished = len(self.engine.requests)
        idle_s = time.time() - self.last_progress
        is_stalled = not self.async_engine.is_running or (
            num_unfinished > 0 and idle_s > stall_timeout_s(self.step_timeout_s))
        return {"worker_id": self.worker_id, "pid": os.getpid(), "actor_id": _actor_id(),
                "started_at": self.started_at, "num_heartbeats": self.num_heartbeats,
                "num_unfinished": num_unfinished, "num_steps": self.engine.num_steps,
                "num_generated_tokens": self.engine.num_generated_tokens,
                "seconds_since_progress": idle_s,
                "is_stalled": is_stalled}

    def inject_stall(self, seconds: float) -> None:
        """Fault injection for tests: the engine loop sleeps ``seconds`` at its next step.

        Refused unless ``PAGEDSERVE_ENABLE_FAULT_INJECTION=1`` is set in the worker's environment.
        """
        if os.environ.get(FAULT_INJECTION_ENV) != "1":
            raise PermissionError(f"fault injection is off; set {FAULT_INJECTION_ENV}=1 to enable it")
        self.pending_stall_s = float(seconds)

    def shutdown(self) -> None:
        self.async_engine.shutdown()
        stop_ranks = getattr(self.engine.runner, "shutdown", None)
        if stop_ranks is not None:   # a worker of several ranks
            stop_ranks()


def _time_local_copy(array: np.ndarray, repeats: int = 3) -> float:
    """Seconds for the best of a few copies of ``array`` into a warm buffer (the memcpy baseline)."""
    target = np.empty_like(array)
    target.fill(0)  # fault the pages in first: time the copy, not the page faults
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(target, array)
        best = min(best, time.perf_counter() - start)
    return best
