"""The engine core's process: ``python -m pagedserve.workers.engine.core_process INBOX OUTBOX PROGRESS PARENT``.

The worker actor (``workers.actor.core_client``) starts it with ``subprocess`` (a fresh
interpreter, as ``spawn`` would, without re-importing the actor's ``__main__``); it binds the
IPC socket its inbox reads and connects to the one the actor reads. Its first message is the ``CoreSpec``: what to load. It builds the
worker's engine (its ``LocalKVManager``, the KV publisher and the preemption policy over the
actor: ``engine.core``), answers ``ready`` with the engine's description, and runs the loop.

It never outlives its actor: ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` on Linux (the kernel ends
it with the thread that started it, even after a SIGKILL of the actor), and the loop checks
its parent's pid between steps (``EngineCore``). Its GPU memory goes with the process.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import signal
import sys
import uuid
from dataclasses import asdict, dataclass, field

from ..process.gc_heap import pause_collection_for_startup
from ..process.progress_bars import hide_transformers_progress_bars
from .core_messages import CoreInfo, FromCore, pack, unpack

logger = logging.getLogger("pagedserve.core")

PR_SET_PDEATHSIG = 1
INIT = b"i"       # the spec: the first message to a new core
LAUNCH_RANKS_TIMEOUT_S = 300.0


@dataclass
class CoreSpec:
    """What a core loads: the worker's engine configuration and its KV event settings."""

    worker_id: str
    engine_config: dict
    role: str = "mixed"
    kv_events: dict = field(default_factory=dict)
    preemption_timeout_s: float = 1.0
    preemption_backoff_s: float = 5.0
    ranks_from_actor: bool = False   # a tensor-parallel group's ranks are Ray actors its worker starts
    node_id: str | None = None       # the worker actor's Ray node (the core has no Ray of its own)
    log_level: int = logging.INFO

    def body(self) -> bytes:
        return pack(asdict(self))

    @classmethod
    def from_body(cls, body) -> "CoreSpec":
        return cls(**unpack(body))


def die_with_parent(parent_pid: int, socket_dir: str) -> None:
    """Have the kernel end this process when its parent goes (Linux); exit now if it is gone,
    removing ``socket_dir``: the folder of the socket paths, which the parent removes only once
    this core has said ``STARTED`` (a parent killed while this interpreter started leaves it)."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):   # the parent's pid check in the loop still holds
            pass
    if os.getppid() != parent_pid:
        shutil.rmtree(socket_dir, ignore_errors=True)
        os._exit(1)


def build_core(spec: CoreSpec, link, progress, parent_pid: int | None):
    """The worker's engine and its loop (``EngineCore``), over ``link`` to the actor."""
    from pagedserve.kvmanager import EventLog, KVPublisher, LocalKVManager, RemotePreemptionPolicy

    from ..process.gc_heap import prepare_serving_heap
    from ..tp.rank import NODE_ID_ENV
    from .core import EngineCore
    from .engine import LLMEngine
    from .engine_options import EngineConfig

    hide_transformers_progress_bars()
    publisher: KVPublisher | None = None

    def decide(request):
        return publisher.decide_preemption(request)

    preemption = RemotePreemptionPolicy(decide, backoff_s=spec.preemption_backoff_s)
    local_kv = LocalKVManager(preemption, EventLog(spec.worker_id))
    launcher = None
    if spec.node_id is not None:
        os.environ[NODE_ID_ENV] = spec.node_id   # where its tensor-parallel ranks find it (``tp.rank.node_key``)
    if spec.ranks_from_actor:
        from ..tp.launch import ActorLauncher

        launcher = ActorLauncher(link, LAUNCH_RANKS_TIMEOUT_S)
    engine = LLMEngine(EngineConfig(**spec.engine_config), spec.worker_id, kv_manager=local_kv, role=spec.role,
                       rank_launcher=launcher)
    engine.scheduler.allow_migration = True
    kv = spec.kv_events
    publisher = KVPublisher(local_kv, link.kv_transport, max_batch_age_s=kv.get("max_batch_age_s", 0.02),
                            preemption_timeout_s=spec.preemption_timeout_s, background=False,
                            tick_s=kv.get("relay_flush_s") if kv.get("publish_on_tick") else None)
    core = EngineCore(engine, link, progress, uuid.uuid4().hex[:12], parent_pid)
    core.attach_publisher(publisher, preemption)
    publisher.maybe_flush()   # the first snapshot: the central manager learns of this worker
    core.gc_pauses = prepare_serving_heap(f"engine core of worker {spec.worker_id}")
    return core


def describe(core) -> CoreInfo:
    from ..model.model_runner import dtype_name
    from ..outputs.tokenizer_loading import tokenizer_class_path

    engine = core.engine
    runner = engine.runner
    size = getattr(runner, "tensor_parallel_size", 1)
    return CoreInfo(core.engine_id, engine.config.model, engine.max_model_len, list(engine.eos_token_ids),
                    engine.config.block_size, engine.pool_config.num_device_blocks, runner.num_parameters,
                    str(runner.device), dtype_name(runner.dtype), runner.dtype_reason, size,
                    runner.describe_ranks() if size > 1 else [], os.getpid(),
                    tokenizer_class_path(engine.tokenizer))


def main(argv: list[str]) -> int:
    inbox_address, outbox_address, progress_path, parent = argv
    parent_pid = int(parent)
    die_with_parent(parent_pid, os.path.dirname(progress_path))
    pause_collection_for_startup()   # until ``build_core``'s ``prepare_serving_heap``
    import zmq

    from .core import ActorLink
    from .core_progress import CoreProgress

    context = zmq.Context()
    inbox = context.socket(zmq.PULL)
    inbox.bind(inbox_address)
    outbox = context.socket(zmq.PUSH)
    outbox.setsockopt(zmq.LINGER, 5000)
    outbox.connect(outbox_address)
    link = ActorLink(inbox, outbox)
    kind, body = inbox.recv_multipart()
    if kind != INIT:
        raise SystemExit(f"engine core: expected its spec first, got {kind!r}")
    spec = CoreSpec.from_body(body)
    logging.basicConfig(level=spec.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    progress = CoreProgress(progress_path)
    link.send(FromCore.STARTED)   # before the model loads: an actor killed meanwhile leaves no paths behind
    try:
        return _build_and_run(spec, link, progress, parent_pid)
    finally:
        # The last messages (the engine's error, ``DEAD``) are still in ZeroMQ's I/O thread,
        # which the interpreter's exit would end without waiting: send them first (the
        # outbox's linger at most, if the actor is gone).
        inbox.close(linger=0)
        outbox.close()
        context.term()


def _build_and_run(spec: CoreSpec, link, progress, parent_pid: int) -> int:
    try:
        core = build_core(spec, link, progress, parent_pid)
    except Exception as exc:
        logger.exception("engine core of worker %s could not start", spec.worker_id)
        link.send(FromCore.DEAD, pack([None, f"the engine could not start: {exc!r}"]))
        return 1
    link.send(FromCore.READY, describe(core).body())
    try:
        core.run()
    except Exception:
        return 1
    finally:
        core.sockets.terminate()   # each socket channel's last message goes out
        shutdown = getattr(core.engine.runner, "shutdown", None)
        if shutdown is not None:   # a tensor-parallel group: its other ranks stop too
            shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
