"""The worker: one model replica per GPU (or CPU slot), run as a Ray actor.

The actor is the worker's face to the cluster: Ray calls, the output channels to
handles, KV events to the central manager, health, drain, migration and the
dashboard's block map. The model, its device block pool and its host swap pool
live in the worker's engine core, a process of its own that this actor starts
and feeds (``core_client``; ``workers.engine.core``): the engine's loop shares
its GIL with nothing, and this process never loads torch.

Block accounting runs in the core, in-process (``LocalKVManager``): a step makes
no remote call. What changed reaches the central KV manager as batched events,
packed by the core and sent from here on the actor's transport
(``core_client.KVForwarder``); only a step that cannot grow asks it, once, how to
preempt (migrate, swap, recompute), through this actor, and decides locally when
it does not answer in time. If the central manager restarts, the core's next
publish is answered "resync" and it sends a snapshot; meanwhile it keeps serving.

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
import uuid
from typing import AsyncIterator

import numpy as np

from ..engine.core_messages import AddRequest
from ..engine.core_process import CoreSpec
from ..kv_events.wire import ZmqTransport, connect_transport, node_ip
from ..model.model_source import ModelSource
from ..outputs.stream_batch import StreamBatch
from ..process.fault_injection import FAULT_INJECTION_ENV, check_fault_injection
from ..process.gc_heap import prepare_serving_heap
from .core_client import CoreDead, EngineCoreClient
from .output_channel import CHANNEL_LEASE_S, OutputChannel
from .protocol import (ChannelMessage, EngineDeadError, GenerateRequest, Migrated, OutputDelta, deltas_from_batch,
                       merge_deltas)

logger = logging.getLogger(__name__)

ROLES = ("mixed", "prefill", "decode")
# A worker with work whose engine loop has not finished a step for this many
# step timeouts is stalled.
STALL_TIMEOUT_FACTOR = 2.0
# How long a step that cannot grow waits for the central preemption decision, and
# how long it then decides locally (migration paused) before asking again.
PREEMPTION_TIMEOUT_S = 1.0
PREEMPTION_BACKOFF_S = 5.0
# Ids of channels closed here that are remembered, so a request that arrives after its
# channel closed is refused rather than run for nobody.
CLOSED_CHANNELS_KEPT = 4096
# A migrated sequence's KV export is kept alive here until the handle releases it
# (the target has fetched it) or, should the handle never do so, this long.
EXPORT_HOLD_S = 300.0
# How long ``export_ref`` waits for a migration's hold that the core has announced to the handle.
EXPORT_WAIT_S = 10.0


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


@dataclasses.dataclass
class _KVExport:
    """A prefill request's prompt KV, after its last outputs (``Worker.prefill``)."""

    header: bytes | None
    payload: np.ndarray | None


class Worker:
    """A model replica: its engine core process, its output channels and its cluster calls.
    Wrapped by ``ray.remote``.

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

        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        if model_source is not None:
            # Resolved here, on this worker's node: a hub id is fetched into this node's cache.
            local_dir = ModelSource.from_dict(model_source).resolve(weights=True)
            engine_config = {**engine_config, "model": local_dir, "tokenizer": None}
        self.worker_id = worker_id
        self.role = role
        self.step_timeout_s = step_timeout_s
        self.held_exports: dict[str, tuple[object, float]] = {}
        self._exports_held = asyncio.Event()   # set by each new hold (``export_ref`` waits on it)
        self.channels: dict[str, OutputChannel] = {}
        self.channel_lease_s = CHANNEL_LEASE_S
        self.closed_channels: dict[str, None] = {}   # insertion-ordered: the oldest go first
        self._prefills: dict[str, asyncio.Future] = {}   # prefill channel -> its KV export, once out
        self._ranks = None   # a tensor-parallel group's Ray ranks, started for the core
        kv_manager_name, kv_manager = kv_manager, ray.get_actor(kv_manager, namespace=namespace)
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
        on_tick = isinstance(self.kv_transport, ZmqTransport) and kv_events.get("publish_on_tick", False)
        size = engine_config.get("tensor_parallel_size", 1)
        spec = CoreSpec(worker_id, engine_config, role,
                        kv_events={**kv_events, "publish_on_tick": on_tick},
                        preemption_timeout_s=PREEMPTION_TIMEOUT_S, preemption_backoff_s=PREEMPTION_BACKOFF_S,
                        ranks_from_actor=size > 1 and _ranks_are_actors(engine_config, size), node_id=_node_id(),
                        log_level=logging.getLogger().getEffectiveLevel() or logging.INFO)
        self.core = EngineCoreClient(spec, self.kv_transport, self._on_items, self._on_dead, self._on_ask)
        try:
            self.core_info = self.core.start()
        except CoreDead as exc:
            raise RuntimeError(f"worker {worker_id}: {exc}") from None
        self.engine_id = self.core_info.engine_id
        logger.info("worker %s: %s on %s, dtype %s (%s); engine core pid %d", worker_id, self.core_info.model,
                    self.core_info.device, self.core_info.dtype, self.core_info.dtype_reason, self.core_info.pid)
        self.started_at = time.time()
        self.num_heartbeats = 0  # answered by this incarnation (one monitor asks about 4 a second)
        # Last: the core and the threads are up; no request has come yet.
        self.gc_pauses = prepare_serving_heap(f"worker {worker_id}")

    # ---- the engine core's news, on the event loop ----------------------------------------------
    def _on_items(self, items: list) -> None:
        """What the core sent since the reader's last wake-up, in order: each channel's batches
        queued unopened, a migration's KV held in the object store (a direct channel's handle
        hears of it from the core), a prefill's KV export, a direct channel whose reader left."""
        channels = self.channels
        for item in items:
            kind, channel_id = item[0], item[1]
            channel = channels.get(channel_id)
            if channel is None:
                continue   # a closed channel: its requests were aborted
            if kind == "outputs":
                channel.put(item[2])
            elif kind == "migrated":
                _, _, _, request_id, target, header, payload = item
                ref = self._hold_export(request_id, (header, payload))
                if not channel.is_direct:
                    channel.put(Migrated(request_id, target, ref))
            elif kind == "gone":
                # The engine core warned if requests were aborted with it.
                logger.info("the reader of output channel %s disconnected; closing the channel", channel_id)
                self.close_channel(channel_id)
            elif kind == "export":
                _, _, _, _, header, payload = item
                channel.put(_KVExport(header, payload))

    def _on_dead(self, message: str, engine_id: str | None) -> None:
        """The engine core died: every channel ends with ``EngineDeadError``."""
        error = EngineDeadError(message, engine_id or self.engine_id)
        for channel in self.channels.values():
            channel.fail(error)

    def _on_ask(self, method: str, args: list):
        """The core's asks that need Ray: a tensor-parallel group's rank actors (on the reader thread)."""
        if method == "launch_ranks":
            from ..tp.launch import RayLauncher, current_placement_group

            [spec] = args
            size = spec["rendezvous"]["size"]
            self._ranks = RayLauncher(current_placement_group(size)).launch_dict(spec, size)
            return self._ranks.describe()
        if method == "ranks_wait_broken":
            return self._ranks.wait_broken(args[0])
        if method == "ranks_fail":
            self._ranks.fail(args[0])   # this process exits: the cluster restarts the whole group
            return None
        if method == "ranks_stop":
            if self._ranks is not None:
                self._ranks.stop()
            return None
        raise ValueError(f"unknown ask {method!r}")

    def _check_core(self) -> None:
        dead = self.core.dead
        if dead is not None:
            raise EngineDeadError(str(dead), dead.engine_id or self.engine_id)

    # ---- channels: one stream per handle for all its requests -----------------------------
    async def submit(self, channel_id: str, requests: list[GenerateRequest]) -> list[bool | BaseException]:
        """Start ``requests``: what a handle sent this worker together (``cluster.turn_batch``),
        in one call. Each one's outputs go out on channel ``channel_id`` (``channel_outputs``) under its
        ``key``, ending with its last rows, or its error (a request the engine refuses), or
        ``Migrated`` when the KV manager moves it to another worker. An answer per request: True
        once started, False if that channel has closed (not started), or the error of a KV
        transfer that could not be read. ``EngineDeadError`` for all if the engine died."""
        if channel_id in self.closed_channels:
            return [False] * len(requests)
        self._check_core()
        self.core.bind_loop(asyncio.get_running_loop())
        channel = self._channel(channel_id)
        if not channel.is_started and not await channel.wait_started():   # its stream's call comes first
            return [False] * len(requests)
        answers: list[bool | BaseException] = []
        for request in requests:
            if not request.kv:
                answers.append(self._start(channel_id, request))
                continue
            try:  # a handle sends such a request alone (it is answered once its KV is read)
                answers.append(await self._start_with_kv(channel_id, request))
            except Exception as exc:  # its transfer could not be read, or the engine died meanwhile
                answers.append(exc)
        return answers

    async def _start_with_kv(self, channel_id: str, request: GenerateRequest) -> bool:
        # The transfer arrives as a nested ObjectRef so that fetching it is timed here.
        start = time.perf_counter()
        header, payload = await request.kv[0]
        transfer_s = (time.perf_counter() - start, _time_local_copy(payload))
        if channel_id in self.closed_channels:  # closed while the KV came
            return False
        self._check_core()
        return self._start(channel_id, request, header, payload, transfer_s)

    def _start(self, channel_id: str, request: GenerateRequest, header=None, payload=None, transfer_s=None) -> bool:
        channel = self._channel(channel_id)
        channel.renew()
        self.core.add(AddRequest(channel_id, request.key, request.request_id, request.prompt_token_ids,
                                 request.params, request.priority, request.prompt, request.output_token_ids,
                                 kv_header=header, transfer_s=transfer_s, lora_request=request.lora_request),
                      payload)
        return True

    def renew_channel(self, channel_id: str) -> bool:
        """The handle still reads channel ``channel_id`` (it calls this every few seconds; a
        channel not renewed for ``channel_lease_s`` closes). False if it is not open here."""
        channel = self.channels.get(channel_id)
        if channel is None:
            return False
        channel.renew()
        return True

    async def channel_outputs(self, channel_id: str, transport: str = "ray",
                              messages_ahead: int = 2) -> AsyncIterator[ChannelMessage | str]:
        """Stream channel ``channel_id``: one message whenever its requests made something
        since the last one. Ends when the channel is closed, or with ``EngineDeadError`` when
        the engine died; the caller going away closes it, aborting its requests.

        With ``transport`` "zmq" the engine core sends the messages to a socket of its own
        (``workers.engine.output_sockets``): this call yields the socket's address, then
        nothing until the channel ends; the core sends at most ``messages_ahead`` messages past
        the reader's credits."""
        self.core.bind_loop(asyncio.get_running_loop())
        channel = self._channel(channel_id)
        try:
            if transport == "zmq":
                self._check_core()
                # Sent to the core before any request of the channel (``submit`` waits for
                # ``start``), so their rows all go to the socket.
                opening = self.core.call("open_output_socket", channel_id, messages_ahead, node_ip())
                channel.start(is_direct=True)
                yield await asyncio.wrap_future(opening)
                await channel.wait_ended()
            elif transport == "ray":
                channel.start()
                while (message := await channel.take()) is not None:
                    yield message
            else:
                raise ValueError(f"unknown output transport {transport!r}; known: ray, zmq")
        except CoreDead as exc:
            raise EngineDeadError(str(exc), exc.engine_id or self.engine_id) from None
        finally:
            self.close_channel(channel_id)

    def close_channel(self, channel_id: str) -> None:
        """Close a channel: the engine core aborts the requests still running on it."""
        self.closed_channels[channel_id] = None
        while len(self.closed_channels) > CLOSED_CHANNELS_KEPT:
            del self.closed_channels[next(iter(self.closed_channels))]
        channel = self.channels.pop(channel_id, None)
        if channel is not None:
            channel.close()

    def _abort_channel(self, channel_id: str) -> None:
        if self.core.dead is None:
            self.core.call("close_channel", channel_id)

    def _channel(self, channel_id: str) -> OutputChannel:
        channel = self.channels.get(channel_id)
        if channel is None:
            channel = self.channels[channel_id] = OutputChannel(channel_id, self._abort_channel, self.channel_lease_s)
            if self.core.dead is not None:
                channel.fail(EngineDeadError(str(self.core.dead), self.core.dead.engine_id or self.engine_id))
        return channel

    async def prefill(self, request: GenerateRequest) -> tuple[OutputDelta, tuple | None]:
        """Run a request's prompt and sample its first token here (a prefill worker).

        Returns the first token's delta and the prompt's KV transfer ``(header,
        payload)``; call it with ``num_returns=2`` and pass the second ref,
        nested in a list, to a decode worker's ``generate`` as ``request.kv``.
        The blocks stay in this worker's prefix cache.
        """
        self._check_core()
        self.core.bind_loop(asyncio.get_running_loop())
        channel_id = f"prefill/{uuid.uuid4().hex}"
        channel = self._channel(channel_id)
        channel.start()
        params = dataclasses.replace(request.params, max_tokens=1)
        self.core.add(AddRequest(channel_id, 0, request.request_id, request.prompt_token_ids, params,
                                 request.priority, request.prompt, export_kv=True, lora_request=request.lora_request))
        deltas, export = [], None
        try:
            while export is None:
                message = await channel.take()
                if message is None:
                    raise EngineDeadError("the worker closed the prefill", self.engine_id)
                for item in message:
                    if isinstance(item, _KVExport):
                        export = item
                        continue
                    for _, delta in deltas_from_batch(StreamBatch.unpack(item)):
                        if isinstance(delta, BaseException):
                            raise delta
                        delta.request_id = request.request_id
                        deltas.append(delta)
        finally:
            self.channels.pop(channel_id, None)
            channel.is_closed = True
        first = merge_deltas(deltas)  # everything the prompt's run made, in one delta
        if export.header is None:
            return first, None
        return first, (export.header, export.payload)

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
        self._exports_held.set()
        return ref

    async def export_ref(self, request_id: str) -> list | None:
        """The ObjectRef of a migration's KV held for ``request_id`` (nested in a list, so that the
        caller gets the ref, not the object), or None once released or expired: a handle that
        reads its channel over a socket asks for it here. The core tells the handle and this
        actor at once, so the hold may come a moment after the question: it is waited for up
        to ``EXPORT_WAIT_S``."""
        deadline = time.monotonic() + EXPORT_WAIT_S
        while (held := self.held_exports.get(request_id)) is None and (left := deadline - time.monotonic()) > 0:
            self._exports_held.clear()
            try:
                await asyncio.wait_for(self._exports_held.wait(), left)
            except asyncio.TimeoutError:
                break
        return None if held is None else [held[0]]

    def release_export(self, request_id: str) -> bool:
        """The migration target has fetched ``request_id``'s KV: let the object go."""
        return self.held_exports.pop(request_id, None) is not None

    def abort(self, request_id: str) -> None:
        """Abort a request: its stream ends with its last rows (finish "abort")."""
        if self.core.dead is None:
            self.core.abort([request_id])

    # ---- leaving the cluster ----------------------------------------------------------
    async def drain(self) -> dict:
        """Start leaving: from the next step on, the KV manager migrates every running
        single-sample sequence that holds KV to a worker with room, and sends none here.
        Sequences that cannot migrate (several samples, prompt logprobs, no room anywhere)
        finish here. The cluster routes no new requests here; one that still arrives runs
        its prompt and then migrates like the rest. Returns ``drain_status``."""
        num_unfinished = await self.core.call_async("start_draining")
        logger.info("worker %s: draining (%d unfinished requests)", self.worker_id, num_unfinished)
        return await self.drain_status()

    async def drain_status(self) -> dict:
        """What is left before a draining worker may go: requests, and migration exports a
        target has not fetched yet (they live in this worker's object store)."""
        status = await self.core.call_async("drain_status")
        return {"worker_id": self.worker_id, **status, "num_held_exports": len(self.held_exports)}

    # ---- introspection ----------------------------------------------------------------
    def info(self) -> dict:
        core = self.core_info
        return {"worker_id": self.worker_id, "role": self.role, "model": core.model,
                "max_model_len": core.max_model_len, "eos_token_ids": list(core.eos_token_ids),
                "block_size": core.block_size, "num_device_blocks": core.num_device_blocks,
                "num_parameters": core.num_parameters, "device": core.device, "node_id": _node_id(),
                **self._dtype_info(), **self._parallel_info(), "engine_core_pid": core.pid,
                "tokenizer_class": core.tokenizer_class}

    def _parallel_info(self) -> dict:
        """The ranks this worker spans (one for a single-device worker) and each rank's pool."""
        core = self.core_info
        return {"tensor_parallel_size": core.tensor_parallel_size, "ranks": core.ranks,
                "kv_capacity_tokens": core.num_device_blocks * core.block_size}

    def _dtype_info(self) -> dict:
        """The dtype this worker chose and why (an explicit engine.dtype, or auto for its device)."""
        return {"dtype": self.core_info.dtype, "dtype_reason": self.core_info.dtype_reason}

    async def stats(self) -> dict:
        """Engine, KV pool, KV-link and health figures; answered by the engine core between
        steps, never blocking this actor's event loop. ``kv_pool`` is this worker's pool
        statistics (the source of truth; the central manager holds a lagging summary)."""
        figures = await self.core.call_async("stats")
        engine_stats = figures["engine"]
        return {"worker_id": self.worker_id, "role": self.role, **self._dtype_info(),
                "device": self.core_info.device,
                **{name: engine_stats[name] for name in (
                    "num_waiting", "num_running", "num_steps", "num_generated_tokens", "mean_step_ms",
                    "num_decode_steps", "mean_decode_step_ms", "decode_kv_seconds", "step_hook_seconds",
                    "num_step_calls", "num_preemptions_by_mode", "swapped_out_bytes", "swapped_in_bytes",
                    "num_scheduled_requests", "queue_seconds", "num_first_tokens", "first_token_seconds")},
                "kv_pool": figures["kv_pool"],
                **figures["kv_link"], **self.core.kv.stats(),
                **figures["preemption"],
                "num_held_exports": len(self.held_exports),
                "num_output_channels": len(self.channels),
                "is_draining": figures["is_draining"],
                "num_drain_migrations": figures["num_drain_migrations"],
                **self._parallel_info(),
                "gc": self.gc_pauses.snapshot(), "engine_core_gc": figures["gc"],
                # The core's CPU by phase of its loop: its inbox, steps, output processing, sends, KV events.
                "engine_core_cpu_seconds": figures["cpu_seconds"],
                # Speculative decoding's counters (vLLM's names), with speculative_config only.
                **{name: value for name, value in engine_stats.items() if name.startswith("spec_decode_")},
                # LoRA adapters: slots, host memory, reads, and the running and waiting requests' (enable_lora only).
                **({"lora": engine_stats["lora"]} if "lora" in engine_stats else {}),
                "is_healthy": self.core.is_running}

    async def block_map(self, max_cells: int = 4096) -> dict:
        """This worker's pools block by block, for the dashboard; asked on demand and
        answered between engine steps (``KVManager.block_map``)."""
        return await self.core.call_async("block_map", max_cells)

    async def add_lora(self, lora_name: str, lora_int_id: int, lora_path: str) -> bool:
        """Check a LoRA adapter against this worker's model and read it into host memory;
        ``LoRAAdapterError`` (a ValueError) names why it cannot be served."""
        return await self.core.call_async("add_lora", lora_name, lora_int_id, lora_path)

    async def remove_lora(self, lora_int_id: int) -> bool:
        """Forget a LoRA adapter (False: unknown here, or still in use; the LRU drops it later)."""
        return await self.core.call_async("remove_lora", lora_int_id)

    async def check_integrity(self) -> bool:
        """Raise ``IntegrityError`` unless this worker's pools are consistent."""
        await self.core.call_async("check_integrity")
        return True

    async def num_used_blocks(self) -> int:
        """Device plus host blocks in use here now."""
        return await self.core.call_async("num_used_blocks")

    async def kv_sync(self, timeout_s: float = 10.0) -> bytes | None:
        """Publish every pending KV event, wait for the acks, and return this worker's packed
        ``KVSnapshot`` (None if the central manager did not take it all in time). For
        consistency checks; it holds the engine core while it waits."""
        return await self.core.call_async("kv_sync", timeout_s)

    def num_unfinished(self) -> int:
        return self.core.progress_figures()[1]

    def ping(self) -> str:
        return self.worker_id

    def heartbeat(self) -> dict:
        """Liveness: ``is_stalled`` when the engine core died, or has work but has not made
        progress for ``stall_timeout_s(step_timeout_s)``."""
        self.num_heartbeats += 1
        last_progress, num_unfinished, num_steps, num_generated_tokens = self.core.progress_figures()
        idle_s = time.time() - last_progress
        is_stalled = not self.core.is_running or (
            num_unfinished > 0 and idle_s > stall_timeout_s(self.step_timeout_s))
        return {"worker_id": self.worker_id, "pid": os.getpid(), "actor_id": _actor_id(),
                "engine_core_pid": self.core.pid, "started_at": self.started_at,
                "num_heartbeats": self.num_heartbeats, "num_unfinished": num_unfinished, "num_steps": num_steps,
                "num_generated_tokens": num_generated_tokens, "seconds_since_progress": idle_s,
                "is_stalled": is_stalled}

    def inject_stall(self, seconds: float) -> None:
        """Fault injection for tests: the engine core sleeps ``seconds`` before its next step.

        Refused unless ``PAGEDSERVE_ENABLE_FAULT_INJECTION=1`` is set in the worker's environment.
        """
        check_fault_injection()
        self.core.call("inject_stall", float(seconds))

    def inject_failure(self, message: str = "the engine step failed") -> None:
        """Fault injection for tests: the engine core's next step raises, as a bug or a device
        error would: its engine is dead (``EngineDeadError``), this actor lives on, stalled.

        Refused unless ``PAGEDSERVE_ENABLE_FAULT_INJECTION=1`` is set in the worker's environment.
        """
        check_fault_injection()
        self.core.call("inject_failure", message)

    def shutdown(self) -> None:
        self.core.shutdown()


def _ranks_are_actors(engine_config: dict, size: int) -> bool:
    """Whether a tensor-parallel group's other ranks are Ray actors (started by this actor for
    its core): backend "ray", or unset inside a placement group with a bundle per rank."""
    backend = engine_config.get("distributed_executor_backend")
    if backend == "mp":
        return False
    if backend == "ray":
        return True
    from ..tp.launch import current_placement_group

    return current_placement_group(size) is not None


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


__all__ = ["FAULT_INJECTION_ENV", "ROLES", "Worker", "stall_timeout_s"]
