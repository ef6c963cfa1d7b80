"""The handle ``pagedserve.cluster.start`` returns: generate, stream, abort, stats, shut down.

Requests are tokenized here, routed to a worker (cache-aware), and streamed
back. If the worker dies or stalls mid-stream, the request resumes on
another worker by re-prefilling its prompt plus the tokens already
generated, so the caller sees one uninterrupted stream. Liveness comes from
the cluster's one controller actor (``controller.ClusterController``, which
restarts stalled workers), read by a ``controller.HealthView`` started by the
first request: restarted workers rejoin the rotation.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import threading
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass
from typing import AsyncIterator

from pagedserve.kvmanager.hashing import prefix_extra_key
from pagedserve.workers.lora.lora_request import LoRARequest
from pagedserve.workers.outputs.detokenizer import DeltaTextDecoder
from pagedserve.workers.actor.protocol import EngineDeadError, Migrated, OutputDelta
from pagedserve.workers.outputs.request_output import CompletionOutput, RequestOutput
from pagedserve.workers.outputs.tokenizer_loading import load_tokenizer_of_class
from pagedserve.workers.sample.sampling_params import SamplingParams
from pagedserve.workers.actor.worker import stall_timeout_s

from .config import ClusterConfig, LoRAModule
from .controller import HealthView
from .kv_relay import kill_relays
from .response_store import ActorResponseStore, kill_response_store
from .lora_adapters import AdapterNameError, AdapterNotFound, LoRAAdapters, runtime_id
from .placement import remove_worker_placement
from .request_flow import (MIGRATE, Attempt, AttemptsExhausted, RepeatedEngineFailure, RequestFlow,
                           StreamNotResumable)
from .router import Router, kv_blocks_used_frac
from .worker_channels import ChannelClosed, WorkerChannels, release_export
from .worker_pool import actor_name_of
from .stats import gather_stats_sync, kv_manager_stats
from .turn_batch import TurnBatch

logger = logging.getLogger("pagedserve.cluster")

MEMBERSHIP_REFRESH_S = 0.5


class NoCapacityError(RuntimeError):
    """No live worker can take the request (retryable)."""


class _DisaggregationFailed(Exception):
    """A prefill or decode worker failed; what was streamed is in the request's accumulator."""


@dataclass
class _Run:
    """How one attempt went: where it ran, and the migration that ended it (if one did)."""

    worker_id: str | None = None
    migrated: Migrated | None = None


def _engine_id(error: BaseException) -> str | None:
    """The failed engine loop an ``EngineDeadError`` names (through Ray, the dual exception
    carries the worker's attributes; its ``cause`` is the original)."""
    engine_id = getattr(error, "engine_id", None)
    return engine_id if engine_id is not None else getattr(getattr(error, "cause", None), "engine_id", None)


def _cause(error: BaseException) -> BaseException:
    """The exception an actor raised, without Ray's wrapping (whose text adds a traceback)."""
    cause = getattr(error, "cause", None)
    return cause if isinstance(cause, BaseException) else error


# The central KV manager's answers are routing hints: wait this long at most, and after a
# failure route by load alone for a while.
HINT_TIMEOUT_S = 2.0
HINT_PAUSE_S = 2.0
# How long workers may take to read and check an adapter loaded at run time, and the controller to answer.
ADAPTER_LOAD_TIMEOUT_S = 120.0
CONTROLLER_TIMEOUT_S = 10.0


class ClusterHandle:
    """A running pagedserve cluster: the KV manager actor, the workers and a router.

    Picklable: a Ray Serve replica can hold one. Each process that holds a
    handle keeps its own router state (in-flight load per worker) and
    tokenizer.
    """

    def __init__(self, config: ClusterConfig, model_path: str, kv_manager, workers: dict,
                 roles: dict[str, str], info: dict, controller, owns_ray: bool = False,
                 namespace: str | None = None) -> None:
        self.config = config
        self.namespace = namespace   # the cluster's named actors' (None: this process's own)
        self.model_path = model_path
        self.kv_manager = kv_manager
        self.controller = controller
        self.workers = dict(workers)
        self.roles = dict(roles)
        self.info = info
        self.model_name = config.model.served_name
        self.max_model_len = info["max_model_len"]
        self.owns_ray = owns_ray
        # The actors ``start`` created, whose handles this process owns. Ray ends a (non-detached)
        # actor once its owner holds no handle to it and lends none out; the controller finds
        # the workers by name (no lent handle), and ``self.workers`` follows the controller's
        # membership, so the creator keeps its own handles here for the cluster's lifetime.
        self._created = [kv_manager, controller, *workers.values()]
        # The worker set as of the controller's membership version (-1: as ``start`` made it).
        self.states = {w: "ready" for w in self.workers}
        self._membership_version = -1
        self._init_local_state()

    def _init_local_state(self) -> None:
        engine = self.config.engine
        self.router = Router(self.config.router, list(self.workers),
                             adapters_per_worker=engine.max_cpu_loras or engine.max_loras)
        # The LoRA adapters requests may name: configured, found in the dynamic directory, and
        # loaded at run time (the controller's, which the health view brings).
        self.adapters = LoRAAdapters(self.config.model.lora_modules, self.config.model.dynamic_lora_loading_path)
        self.health = HealthView(self.controller, list(self.workers), self.router,
                                 stall_timeout_s(self.config.step_timeout_s), on_adapters=self.adapters.set_runtime)
        self._tokenizer = None
        self._ids = itertools.count()
        self._utilization_refreshed = 0.0
        self._hints_paused_until = 0.0
        self._hint_batch: TurnBatch | None = None   # of the event loop that asked last
        self._membership_refreshed = 0.0
        self._num_resumed = 0
        self._num_migrated = 0
        self._num_recomputed_tokens = 0
        self._num_no_capacity = 0
        self._num_not_resumable = 0
        self._num_repeated_engine_failures = 0
        self._lock = threading.Lock()
        self.channels = WorkerChannels(self.config.output_transport)

    def __getstate__(self):
        state = {k: v for k, v in self.__dict__.items()
                 if k not in ("router", "health", "adapters", "_tokenizer", "_ids", "_lock", "_created", "channels",
                              "_hint_batch")}
        state["owns_ray"] = False
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._init_local_state()

    def response_store(self, max_responses: int, max_bytes: int) -> ActorResponseStore:
        """The cluster's one store of the Responses API's stored responses (created, with room
        for ``max_responses`` and ``max_bytes``, by the first caller)."""
        return ActorResponseStore(self.namespace, max_responses, max_bytes)

    # ---- the worker set -------------------------------------------------------------
    def _apply_membership(self, membership: dict) -> None:
        """Take the controller's worker set: every member but the draining ones is routed to
        (liveness comes from the health view); draining ones finish or hand over what they
        hold; departed ones are forgotten."""
        entries = membership["workers"]
        self.workers = {w: e["actor"] for w, e in entries.items()}
        self.roles = {w: e["role"] for w, e in entries.items()}
        self.states = {w: e["state"] for w, e in entries.items()}
        self.router.set_workers([w for w, e in entries.items() if e["state"] != "draining"])
        self._membership_version = membership["version"]

    async def refresh_workers(self, force: bool = False) -> None:
        """Follow the worker set's changes (at most twice a second unless ``force``)."""
        now = time.time()
        if not force and now - self._membership_refreshed < MEMBERSHIP_REFRESH_S:
            return
        self._membership_refreshed = now
        try:
            membership = await asyncio.wait_for(self.controller.membership.remote(self._membership_version),
                                                timeout=self.config.step_timeout_s)
        except Exception as exc:  # keep routing over the last known set
            logger.warning("cluster controller did not answer (%r); keeping the last worker set", exc)
            return
        if membership is not None:
            self._apply_membership(membership)

    def refresh_workers_sync(self) -> None:
        import ray

        self._membership_refreshed = time.time()
        membership = ray.get(self.controller.membership.remote(self._membership_version),
                             timeout=self.config.step_timeout_s)
        if membership is not None:
            self._apply_membership(membership)

    def routable_workers(self) -> set[str]:
        """Workers that are not draining and whose heartbeat is good."""
        return self.health.alive_workers() & {w for w, state in self.states.items() if state != "draining"}

    def worker_states(self) -> dict:
        """Every worker the cluster has had (starting, ready, draining, dead) with its state."""
        import ray

        return ray.get(self.controller.worker_states.remote(), timeout=self.config.step_timeout_s)

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            # The class the workers' engines chose: no AutoTokenizer (and torch) in a replica.
            self._tokenizer = load_tokenizer_of_class(self.model_path, self.info.get("tokenizer_class"),
                                                      self.config.model.trust_remote_code)
        return self._tokenizer

    # ---- generation ---------------------------------------------------------------
    async def generate(self, prompt: str | list[int] | None, params: SamplingParams | None = None,
                       request_id: str | None = None, priority: int = 0,
                       prompt_token_ids: list[int] | None = None,
                       is_streamed: bool = False,
                       lora_request: LoRARequest | None = None,
                       token_by_token: bool = False) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs (cumulative text and token ids, plus deltas).

        Workers stream deltas (``workers.actor.protocol``); the request's one
        ``OutputAccumulator`` rebuilds the outputs. A run that ends unfinished
        (a worker failed, the KV manager migrated the request, the disaggregated
        path broke) is followed by the one ``request_flow.RequestFlow`` picks.
        ``is_streamed``: the caller passes each output's deltas on as they come;
        a request with several samples then ends with ``StreamNotResumable`` if
        its worker fails after tokens were streamed (see ``RequestFlow``).
        ``lora_request``: generate with that adapter (one of ``lora_modules``), on every
        attempt; such a request always runs colocated (its KV is not exported).
        ``token_by_token``: an output per new token, where a worker's delta brings several
        together (a step's accepted proposals, ``stream_interval``, steps a busy reader merged),
        each with its own text (decoded here, even for a request with stop strings, which its
        workers find); refused for a beam search, whose text is its engine's.
        """
        from ray.exceptions import ObjectLostError, RayActorError

        self.health.start()
        params = params or SamplingParams()
        request_id = request_id or f"cluster-{uuid.uuid4().hex[:12]}"
        text = prompt if isinstance(prompt, str) else None
        if prompt_token_ids is None:
            prompt_token_ids = (self.tokenizer.encode(prompt) if isinstance(prompt, str)
                                else list(prompt or []))
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        if token_by_token and params.use_beam_search:
            raise ValueError("a beam search does not stream token by token: its text is its engine's")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(prompt_token_ids)} tokens; this model's maximum "
                             f"context is {self.max_model_len} tokens, including at least one output token")
        await self.refresh_workers()
        await self._refresh_utilization()
        flow = RequestFlow(request_id, text, prompt_token_ids, params, priority,
                           max_attempts=2 * len(self.workers) + 3, is_streamed=is_streamed,
                           text_decoder=self._text_decoder(prompt_token_ids, params, token_by_token),
                           lora_request=lora_request,
                           token_by_token=token_by_token)
        if self.config.is_disaggregated and params.n == 1 and not params.use_beam_search:
            try:
                async with aclosing(self._generate_disaggregated(flow, flow.start(is_disaggregated=True))) as run:
                    async for output in run:
                        yield output
                return
            except _DisaggregationFailed as exc:
                logger.warning("request %s: disaggregated path failed (%r); serving colocated",
                               request_id, exc.__cause__)
                attempt = self._next_attempt(flow.fall_back, exc)
        else:
            attempt = flow.start()
        held_export = None  # (worker, sub-request id) holding a migration's KV until the target has it
        while True:
            run = _Run()
            try:
                async with aclosing(self._run_attempt(flow, attempt, run)) as outputs:
                    async for output in outputs:
                        held_export = self._release_export(held_export)
                        yield output
            except ObjectLostError as exc:
                # A migration's KV was lost with its source: recompute from the tokens instead.
                attempt = self._next_attempt(flow.after_failure, exc)
                logger.warning("request %s: transferred KV lost (%r); recomputing", request_id, exc)
                self._num_resumed += 1
                continue
            except (RayActorError, asyncio.TimeoutError, EngineDeadError, ChannelClosed) as exc:
                # EngineDeadError: the worker lives, its engine loop ended. Its other requests fail
                # too, and the controller restarts it. ChannelClosed: the worker's output channel
                # broke without a cause (treated as a failed worker).
                is_engine_failure = isinstance(exc, EngineDeadError)
                engine_id = _engine_id(exc)
                self.health.note_failure(run.worker_id, f"request {request_id}: {type(exc).__name__}")
                attempt = self._next_attempt(
                    (lambda: flow.after_engine_failure(run.worker_id, engine_id)) if is_engine_failure
                    else flow.after_failure, exc)
                logger.warning("request %s: %s %s failed (%r); resuming elsewhere", request_id,
                               "the engine of worker" if is_engine_failure else "worker", run.worker_id, exc)
                self._num_resumed += 1
                continue
            finally:
                if run.migrated is None:
                    held_export = self._release_export(held_export)
            if run.migrated is None:
                return
            self._release_export(held_export)  # the target ran, so it had that KV
            held_export = (self.workers[run.worker_id], run.migrated.request_id)
            self._num_migrated += 1
            attempt = self._next_attempt(lambda: flow.migrate(run.migrated), None)

    def _next_attempt(self, transition, cause: BaseException | None) -> Attempt:
        """Take ``transition``; a request out of attempts is a retryable ``NoCapacityError``; one
        that cannot go on without contradicting its stream ends with ``StreamNotResumable``."""
        try:
            return transition()
        except AttemptsExhausted as exc:
            self._num_no_capacity += 1
            raise NoCapacityError(str(exc)) from cause
        except StreamNotResumable as exc:
            self._num_not_resumable += 1
            logger.warning("%s (%r)", exc, cause)
            raise exc from cause
        except RepeatedEngineFailure as exc:
            self._num_repeated_engine_failures += 1
            logger.error("%s (%r)", exc, cause)
            raise exc from cause

    async def _run_attempt(self, flow: RequestFlow, attempt: Attempt, run: "_Run") -> AsyncIterator[RequestOutput]:
        """Route ``attempt`` to a worker and stream its outputs; a migration ends the run with
        ``run.migrated`` set. An unfinished run is aborted on its worker."""
        request = attempt.request
        # A continued run (resumed, migrated) has its first outputs already: they are context to
        # compute (or import), and count against max_tokens.
        tokens = request.prompt_token_ids + request.output_token_ids
        num_tokens, max_tokens = len(tokens), request.params.max_tokens - len(request.output_token_ids)
        if attempt.kind == MIGRATE:
            if attempt.target not in self.workers:  # a worker that joined since the last refresh
                await self.refresh_workers(force=True)
            # Where the KV manager made room; any routable worker if this handle does not know it.
            decision = self.router.choose(request.request_id, num_tokens, max_tokens, {},
                                          set(self.router.loads) - {attempt.target}
                                          if attempt.target in self.router.loads else set())
        else:
            if attempt.is_recompute:
                self._num_recomputed_tokens += num_tokens
            excluded = {w for w, role in self.roles.items() if role == "prefill"}
            await self._wait_for_capacity(flow.request_id, excluded)
            adapter = request.lora_request.cache_key if request.lora_request else None
            cached, holders = await self._route_hints(tokens, prefix_extra_key(request.params.cache_salt, adapter),
                                                      adapter)
            decision = self.router.choose(request.request_id, num_tokens, max_tokens, cached, excluded,
                                          adapter=adapter, holders=holders)
        run.worker_id = decision.worker_id
        worker = self.workers[decision.worker_id]
        finished = False
        items = self.channels.stream(decision.worker_id, worker, request,
                                     self.config.server.limits.request_timeout_s)
        try:
            async for item in items:
                if isinstance(item, Migrated):
                    run.migrated = item
                    finished = True  # nothing left to abort on this worker
                    return
                for output in flow.outputs(item):
                    finished = output.finished
                    yield output
                if finished:
                    return
        finally:
            await items.aclose()
            self.router.release(decision, max_tokens)
            if not finished:
                try:
                    worker.abort.remote(request.request_id)
                except Exception:
                    pass

    async def _generate_disaggregated(self, flow: RequestFlow, attempt: Attempt) -> AsyncIterator[RequestOutput]:
        """Prompt on a prefill worker, KV through the object store, the rest on a decode worker."""
        from ray.exceptions import RayActorError

        timeout = self.config.server.limits.request_timeout_s
        request, params, accumulator = attempt.request, flow.params, flow.accumulator
        prompt_ids, request_id = request.prompt_token_ids, request.request_id
        prefill_ids = {w for w, role in self.roles.items() if role == "prefill"}
        decode_ids = {w for w, role in self.roles.items() if role == "decode"}
        adapter = request.lora_request.cache_key if request.lora_request else None
        cached, holders = await self._route_hints(prompt_ids, prefix_extra_key(params.cache_salt, adapter), adapter)
        decision = self.router.choose(f"{request_id}/prefill", len(prompt_ids), 1, cached,
                                      exclude=set(self.workers) - prefill_ids, adapter=adapter, holders=holders)
        try:
            out_ref, kv_ref = self.workers[decision.worker_id].prefill.options(num_returns=2).remote(request)
            first: OutputDelta = await asyncio.wait_for(out_ref, timeout=timeout)
        except (RayActorError, asyncio.TimeoutError, EngineDeadError) as exc:
            self.health.note_failure(decision.worker_id, f"prefill of {request_id}: {type(exc).__name__}")
            if isinstance(exc, EngineDeadError):
                flow.note_failed_engine(decision.worker_id, _engine_id(exc))
            raise _DisaggregationFailed() from exc
        finally:
            self.router.release(decision, 1)
        sample = first.samples[0]
        is_done = sample.finish_reason == "stop" or params.max_tokens == 1
        if is_done or sample.finish_reason == "abort":
            first.finished = True
            for output in flow.outputs(first):
                yield output
            return
        # The prefill worker stopped at its one token ("length"); the request goes on.
        first.samples[0] = dataclasses.replace(sample, finish_reason=None, stop_reason=None)
        first.finished = False
        for output in flow.outputs(first):
            yield output
        decision = self.router.choose(f"{request_id}/decode", len(prompt_ids), params.max_tokens, {},
                                      exclude=set(self.workers) - decode_ids, adapter=adapter, holders=holders)
        worker = self.workers[decision.worker_id]
        request = dataclasses.replace(request, kv=[kv_ref], output_token_ids=accumulator.token_ids())
        finished = False
        deltas = self.channels.stream(decision.worker_id, worker, request, timeout)
        try:
            async for delta in deltas:
                finished = delta.finished
                for output in flow.outputs(delta):
                    yield output
                if finished:
                    return
        except (RayActorError, asyncio.TimeoutError, EngineDeadError, ChannelClosed) as exc:
            self.health.note_failure(decision.worker_id, f"decode of {request_id}: {type(exc).__name__}")
            if isinstance(exc, EngineDeadError):
                flow.note_failed_engine(decision.worker_id, _engine_id(exc))
            raise _DisaggregationFailed() from exc
        finally:
            await deltas.aclose()
            self.router.release(decision, params.max_tokens)
            if not finished:
                worker.abort.remote(request_id)

    @staticmethod
    def _release_export(export_source: tuple | None) -> None:
        """Tell a migration's source worker that its KV export is no longer needed."""
        if export_source is not None:
            release_export(*export_source)
        return None

    def _text_decoder(self, prompt_token_ids: list[int], params: SamplingParams, token_by_token: bool = False):
        """How this handle decodes a request's text itself, or None where its workers must: a
        request with stop strings (found in the worker's text; also decoded here when it streams
        token by token, for each token's own piece), a beam search (its outputs are the engine's),
        one that asks for no text, or workers that do not say their EOS ids."""
        eos_token_ids = self.info.get("eos_token_ids")
        if (params.stop and not token_by_token) or params.use_beam_search or not params.detokenize \
                or eos_token_ids is None:
            return None
        tokenizer, max_model_len = self.tokenizer, self.max_model_len
        return lambda: DeltaTextDecoder(tokenizer, prompt_token_ids, params, eos_token_ids, max_model_len,
                                        with_stop_strings=bool(params.stop))

    async def _route_hints(self, token_ids: list[int], extra_key: str | None, adapter: str | None
                           ) -> tuple[dict[str, int], set[str] | None]:
        """Cached prefix per worker from the central index (among blocks of ``extra_key``: the
        request's cache salt and adapter, ``prefix_extra_key``), and for a request with an
        adapter the workers that report holding it (``KVManagerService.route_hints``, in the
        same call; None: no report to go by): hints, never waited on for long. The requests
        routed together ask in one call (``route_hints_many``, ``turn_batch``). While the KV
        manager is down or slow, requests are routed by load alone (and it is not asked again
        for ``HINT_PAUSE_S``)."""
        is_cache_aware = self.config.router.policy == "cache_aware"
        if (len(self.workers) == 1 or (adapter is None and not is_cache_aware)
                or time.monotonic() < self._hints_paused_until):
            return {}, None
        try:
            loop = asyncio.get_running_loop()
            if self._hint_batch is None or self._hint_batch.loop is not loop:
                # The requests routed together ask in one call.
                self._hint_batch = TurnBatch(loop, lambda queries: self.kv_manager.route_hints_many.remote(queries))
            cached, reported = await asyncio.wait_for(self._hint_batch.ask((token_ids, extra_key, adapter)),
                                                      timeout=HINT_TIMEOUT_S)
            holders = None if reported is None else set(reported)
        except Exception as exc:  # the KV manager is restarting or overloaded: route by load alone
            self._hints_paused_until = time.monotonic() + HINT_PAUSE_S
            logger.warning("prefix lookup failed (%r); routing by load for %.0f s", exc, HINT_PAUSE_S)
            return {}, None
        return (cached if is_cache_aware else {}), holders

    async def _refresh_utilization(self) -> None:
        now = time.time()
        if now - self._utilization_refreshed < 0.5 or len(self.workers) == 1:
            return
        self._utilization_refreshed = now
        try:
            # The same occupancy source as the stats snapshot (``stats.kv_manager_stats``).
            stats = await asyncio.wait_for(kv_manager_stats(self), timeout=HINT_TIMEOUT_S)
        except Exception:
            return
        workers = stats.get("workers", {})
        self.router.update_occupancy({w: kv_blocks_used_frac(s) for w, s in workers.items()})

    async def _wait_for_capacity(self, request_id: str, excluded: set[str]) -> None:
        """Return once a worker outside ``excluded`` is alive; wait up to the stall
        timeout for a restart, then raise ``NoCapacityError`` (a retryable 503)."""
        deadline = time.time() + self.health.stall_timeout_s
        while not (self.routable_workers() - excluded):
            if time.time() > deadline:
                self._num_no_capacity += 1
                raise NoCapacityError(f"no live worker can take request {request_id}")
            await asyncio.sleep(0.1)
            await self.refresh_workers()

    async def abort(self, request_id: str) -> None:
        for worker in self.workers.values():
            worker.abort.remote(request_id)

    # ---- LoRA adapters loaded at run time (vLLM's /v1/load_lora_adapter) -------------------
    async def load_lora_adapter(self, name: str, path: str) -> LoRARequest:
        """Serve adapter ``name`` from ``path``: every routable worker checks it against its
        model and reads it into host memory, then the controller registers it for every
        replica (this one at once, the others at their next health report). ValueError names
        why it cannot be (``AdapterNameError`` for the name, in vLLM's wording when it is
        taken); nothing is kept then."""
        if not self.config.engine.enable_lora:
            raise ValueError("loading a LoRA adapter needs engine.enable_lora: true (--enable-lora)")
        if name == self.config.model.served_name:
            raise AdapterNameError(f"lora_name {name!r} is the base model's name")
        try:
            LoRAModule(name=name, path=path)
        except ValueError as exc:   # the rules of a configured adapter's name
            raise AdapterNameError(f"lora_name {name!r}: an adapter name has no ':', NUL or surrounding "
                                   "spaces") from exc
        if self.adapters.get(name) is not None:
            raise AdapterNameError(f"The lora adapter '{name}' has already been loaded.")
        request = LoRARequest(name, runtime_id(), path)
        workers = [self.workers[w] for w in sorted(self.routable_workers()) if w in self.workers]
        if not workers:
            raise NoCapacityError("no worker is ready to check the adapter")
        checks = await asyncio.gather(*(
            asyncio.wait_for(w.add_lora.remote(name, request.lora_int_id, path), ADAPTER_LOAD_TIMEOUT_S)
            for w in workers), return_exceptions=True)
        failures = [_cause(result) for result in checks if isinstance(result, BaseException)]
        registered = None
        if not failures:
            registered = await asyncio.wait_for(self.controller.load_lora.remote(name, request.lora_int_id, path),
                                                CONTROLLER_TIMEOUT_S)
        if registered is None:
            self._forget_adapter(request.lora_int_id)
            if not failures:
                raise AdapterNameError(f"The lora adapter '{name}' has already been loaded.")
            if isinstance(failures[0], ValueError):
                raise ValueError(str(failures[0]))
            raise failures[0]
        self.adapters.set_runtime(*registered)
        logger.info("LoRA adapter %r loaded from %s (lora_int_id %d)", name, path, request.lora_int_id)
        return request

    async def unload_lora_adapter(self, name: str) -> int:
        """Stop serving run-time adapter ``name`` (vLLM's /v1/unload_lora_adapter); its id.
        Requests already running with it finish; workers drop it once none uses it.
        ``AdapterNotFound`` if there is no such adapter, ValueError for a configured one."""
        source = self.adapters.source(name)
        if source not in (None, "runtime"):
            raise ValueError(f"The lora adapter '{name}' comes from model.{source}: only adapters "
                             "loaded at run time can be unloaded")
        removed = await asyncio.wait_for(self.controller.unload_lora.remote(name), CONTROLLER_TIMEOUT_S)
        if removed is None:
            raise AdapterNotFound(f"The lora adapter '{name}' cannot be found.")
        version, adapters, lora_int_id = removed
        self.adapters.set_runtime(version, adapters)
        self._forget_adapter(lora_int_id)
        logger.info("LoRA adapter %r unloaded (lora_int_id %d)", name, lora_int_id)
        return lora_int_id

    def _forget_adapter(self, lora_int_id: int) -> None:
        """Ask every worker to drop an adapter (not waited for: one in use stays until its LRU
        turn, and no request can name it any more)."""
        for worker in self.workers.values():
            worker.remove_lora.remote(lora_int_id)

    # ---- synchronous conveniences ------------------------------------------------------
    def generate_sync(self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams]
                      | None = None) -> list[RequestOutput]:
        """Generate for several prompts concurrently and wait; outputs in input order."""
        if isinstance(params, SamplingParams) or params is None:
            params = [params or SamplingParams()] * len(prompts)

        async def run_one(prompt, param):
            last = None
            async for output in self.generate(prompt, param):
                last = output
            return last

        async def run_all():
            return await asyncio.gather(*(run_one(p, sp) for p, sp in zip(prompts, params)))

        return asyncio.run(run_all())

    # ---- introspection --------------------------------------------------------------
    def stats(self) -> dict:
        """The cluster's stats snapshot (``stats.gather_stats``), for synchronous callers."""
        return gather_stats_sync(self, timeout_s=self.config.step_timeout_s)

    def request_counters(self) -> dict[str, int]:
        """Requests this handle resumed, migrated, could not place, ended because their stream could
        not go on or because a second engine failed under them, and tokens it recomputed."""
        return {"num_resumed": self._num_resumed, "num_migrated": self._num_migrated,
                "num_recomputed_tokens": self._num_recomputed_tokens, "num_no_capacity": self._num_no_capacity,
                "num_not_resumable": self._num_not_resumable,
                "num_repeated_engine_failures": self._num_repeated_engine_failures}

    def check_integrity(self) -> None:
        """Every worker's pools are consistent, and the central index holds exactly what the
        workers cache (after each has published everything). Raises otherwise."""
        import ray

        from pagedserve.kvmanager import IntegrityError

        timeout = self.config.step_timeout_s
        ray.get([w.check_integrity.remote() for w in self.workers.values()], timeout=timeout)
        snapshots = ray.get([w.kv_sync.remote(timeout) for w in self.workers.values()], timeout=2 * timeout)
        missing = [w for w, snapshot in zip(self.workers, snapshots) if snapshot is None]
        if missing:
            raise IntegrityError(f"workers {missing} could not publish to the central KV manager")
        ray.get(self.kv_manager.check_consistency.remote(snapshots), timeout=timeout)

    def num_used_blocks(self) -> int:
        """Device plus host blocks in use on every worker, asked of the workers."""
        import ray

        return sum(ray.get([w.num_used_blocks.remote() for w in self.workers.values()],
                           timeout=self.config.step_timeout_s))

    def wait_healthy(self, timeout: float = 120.0) -> float:
        """Wait until every worker answers its heartbeat, unstalled; returns the seconds waited."""
        start = time.time()
        self.health.start()
        while self.health.alive_workers() != set(self.workers):
            if time.time() - start > timeout:
                raise TimeoutError(f"workers still down after {timeout} s: "
                                   f"{sorted(set(self.workers) - self.health.alive_workers())}")
            time.sleep(0.05)
        return time.time() - start

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Wait until every worker has finished its requests and returned its blocks."""
        import ray

        deadline = time.time() + timeout
        while time.time() < deadline:
            self.refresh_workers_sync()
            busy = sum(ray.get([w.num_unfinished.remote() for w in self.workers.values()], timeout=timeout))
            if busy == 0 and self.num_used_blocks() == 0:
                return
            time.sleep(0.1)
        raise TimeoutError(f"cluster still busy after {timeout} s")

    def shutdown(self) -> None:
        """Stop the workers, the KV manager and the nodes' KV event relays (and Ray, if
        ``start`` started it)."""
        import ray

        self.health.stop()
        self.channels.close()
        try:  # the controller first: it restarts nothing more, and stops the workers it started
            ray.get(self.controller.shutdown.remote(), timeout=30)
        except Exception:
            pass
        for actor in [self.controller, *self.workers.values()]:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:
                pass
        for worker_id in self.workers:   # the bundles of workers of several ranks
            remove_worker_placement(actor_name_of(worker_id))
        try:
            ray.kill(self.kv_manager, no_restart=True)
        except Exception:
            pass
        try:  # the nodes' KV event relays (detached: they outlive the workers that made them)
            kill_relays(ray.get_runtime_context().namespace)
        except Exception:
            pass
        try:  # the stored responses (detached: they outlive the replicas that made them)
            kill_response_store(self.namespace)
        except Exception:
            pass
        if self.owns_ray:
            ray.shutdown()


__all__ = ["ClusterHandle", "CompletionOutput", "NoCapacityError"]
