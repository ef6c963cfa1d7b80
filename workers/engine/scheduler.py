"""The engine-side scheduler: queues and policy, one KV plan per step.

The scheduler decides the order (FCFS or priority) and the limits (token
budget, ``max_num_seqs``); the engine's own (in-process) KV manager decides
what fits, which prefix blocks are reused and whom to preempt. Everything
that changed since the last step (new sequences, forks, sampled tokens,
finished sequences) rides along in that one call.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

from pagedserve.kvmanager import NewSequence, ScheduledSeq, StepInput, StepOutput

from .engine_options import SCHEDULING_POLICIES
from .request import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    """The sequences to run this step, and the copies to perform first."""

    scheduled: list[tuple[Sequence, ScheduledSeq]] = field(default_factory=list)
    kv: StepOutput = field(default_factory=StepOutput)
    # Sequences the KV manager moved to another worker: (sequence, target worker).
    migrated: list[tuple[Sequence, str]] = field(default_factory=list)
    # Every sequence preempted this step (migrated ones too): they left the running batch.
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled and not self.migrated


class AdapterPages(Protocol):
    """LoRA adapters in pages of the KV pool (``LoRAManager`` with unified paging)."""

    def admit(self, request, protected: set[int]) -> bool: ...

    def relieve(self, num_pages: int, protected: set[int]) -> None: ...


class Scheduler:
    def __init__(self, kv_step: Callable[[StepInput], StepOutput], worker_id: str,
                 max_num_seqs: int, max_num_batched_tokens: int, policy: str = "fcfs",
                 max_loras: int | None = None, adapter_pages: AdapterPages | None = None,
                 block_size: int = 16) -> None:
        if policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {policy!r}")
        self.kv_step = kv_step
        self.worker_id = worker_id
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.policy = policy
        # With LoRA: at most this many distinct adapters among the running sequences.
        self.max_loras = max_loras
        # With unified paging: a waiting sequence is admitted once its adapter holds pages.
        self.adapter_pages = adapter_pages
        self.block_size = block_size
        # Both queues are kept in scheduling order (``_order``) as sequences enter them,
        # so a step never sorts them; ``_queued`` finds either queue's sequences by id.
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self._queued: dict[str, Sequence] = {}
        self._pending = StepInput(worker_id)
        self._registered: set[str] = set()
        # In a cluster, preempted single-sample sequences may move to another worker.
        self.allow_migration = False
        # The worker is leaving: the KV manager migrates its running sequences away.
        self.is_draining = False
        self.num_preemptions = {"swap": 0, "recompute": 0, "migrate": 0}
        # Time inside the KV manager's step (the local plan; in a cluster, any blocking
        # preemption call too): the last step's and the total.
        self.last_kv_seconds = 0.0
        self.kv_seconds = 0.0
        self.num_drain_migrations = 0

    # ---- changes since the last step ------------------------------------------
    def add(self, seq: Sequence, num_imported_tokens: int = 0) -> None:
        """Queue a new sequence; it registers with the KV manager at the next step."""
        self._enqueue(self.waiting, seq)
        params = seq.request.params
        self._pending.new_sequences.append(
            NewSequence(seq.seq_id, list(seq.token_ids), seq.request.prefix_cache_key, num_imported_tokens=num_imported_tokens,
                        skip_prefix_cache=params.prompt_logprobs is not None))
        self._registered.add(seq.seq_id)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Add ``child``, sharing ``parent``'s blocks, right after it in the running queue."""
        self._pending.forks.append((parent.seq_id, child.seq_id))
        self._registered.add(child.seq_id)
        child.status = SequenceStatus.RUNNING
        child.num_computed = parent.num_computed
        child.block_table = list(parent.block_table)
        self._enqueue(self.running, child)

    def append_token(self, seq: Sequence, token_id: int) -> None:
        self._pending.appended.append((seq.seq_id, [token_id]))

    def resolve_tokens(self, seqs: list[Sequence], token_ids: list[int]) -> None:
        """The values of the sequences' oldest pending tokens (one each)."""
        self._pending.resolved.extend([(seq.seq_id, [token_id]) for seq, token_id in zip(seqs, token_ids)])

    def append_tokens(self, seqs: list[Sequence], token_ids: list[int]) -> None:
        """``append_token`` for each sequence and its token (a step's samples)."""
        self._pending.appended.extend([(seq.seq_id, [token_id]) for seq, token_id in zip(seqs, token_ids)])

    def propose(self, seq: Sequence, token_ids: list[int]) -> None:
        """Tokens proposed to follow ``seq``'s known ones, to be computed by the next step."""
        self._pending.proposed.append((seq.seq_id, token_ids))

    def accept(self, seq: Sequence, num_accepted: int) -> None:
        """How many of ``seq``'s proposed tokens were accepted: the rest lose their KV."""
        self._pending.accepted.append((seq.seq_id, num_accepted))

    def finish(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence; its blocks are freed at the next step."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._queued.pop(seq.seq_id, None)
        seq.status = SequenceStatus.FINISHED
        if seq.seq_id in self._registered:
            self._registered.discard(seq.seq_id)
            self._pending.finished.append(seq.seq_id)

    @property
    def has_pending_changes(self) -> bool:
        p = self._pending
        return bool(p.new_sequences or p.forks or p.resolved or p.appended or p.finished)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # ---- the step -----------------------------------------------------------------
    def _order(self, seq: Sequence):
        request = seq.request
        if self.policy == "priority":
            return (request.priority, request.arrival_time, request.order, seq.sample_index)
        return (request.arrival_time, request.order, seq.sample_index)

    def _enqueue(self, queue: list[Sequence], seq: Sequence) -> None:
        bisect.insort(queue, seq, key=self._order)
        self._queued[seq.seq_id] = seq

    def _admissible_by_adapter(self, limit: int) -> list[str]:
        """Up to ``limit`` waiting sequences, in order, skipping those whose adapter would make
        the running ones use more than ``max_loras`` adapters, and with unified paging those
        whose adapter cannot get pages now."""
        adapters = self._running_adapters()
        picked = []
        for seq in self.waiting:
            if len(picked) == limit:
                break
            lora = seq.request.lora_request
            if lora is not None and lora.lora_int_id not in adapters:
                if len(adapters) == self.max_loras:
                    continue
                if self.adapter_pages is not None and not self.adapter_pages.admit(lora, adapters):
                    continue   # no pages for its adapter now: the pool's KV comes first
                adapters.add(lora.lora_int_id)
            picked.append(seq.seq_id)
        return picked

    def _running_adapters(self) -> set[int]:
        return {s.request.lora_request.lora_int_id for s in self.running if s.request.lora_request}

    def _relieve_adapter_pages(self, step_input: StepInput, output: SchedulerOutput) -> None:
        """When a sequence was preempted, or the first one picked from the waiting queue was not
        admitted, idle adapters give back pages for its KV (unified paging)."""
        short = [seq for seq in output.preempted if seq.status == SequenceStatus.WAITING][:1]
        if not short and step_input.waiting:
            first = self._queued.get(step_input.waiting[0])
            short = [first] if first is not None and first.status == SequenceStatus.WAITING else []
        if not short:
            return
        seq = short[0]
        protected = self._running_adapters()
        if seq.request.lora_request is not None:
            protected.add(seq.request.lora_request.lora_int_id)
        self.adapter_pages.relieve(-(-len(seq.token_ids) // self.block_size), protected)

    def schedule(self) -> SchedulerOutput:
        """Ask the KV manager for this step's plan and update the queues from it."""
        step_input = self._pending
        self._pending = StepInput(self.worker_id)
        step_input.running = [s.seq_id for s in self.running]
        num_free_slots = max(0, self.max_num_seqs - len(self.running))
        step_input.waiting = (self._admissible_by_adapter(num_free_slots) if self.max_loras is not None
                              else [s.seq_id for s in self.waiting[:num_free_slots]])
        step_input.token_budget = self.max_num_batched_tokens
        if self.allow_migration:
            step_input.migratable = [s.seq_id for s in self.running
                                     if s.request.is_migratable and not s.request.needs_prompt_logprobs]
            step_input.is_draining = self.is_draining
        kv_start = time.perf_counter()
        try:
            kv_output = self.kv_step(step_input)
        except BaseException:
            # A refused step changed nothing: keep its changes for the next try.
            self._pending = step_input
            raise
        finally:
            self.last_kv_seconds = time.perf_counter() - kv_start
            self.kv_seconds += self.last_kv_seconds

        by_id = self._queued
        output = SchedulerOutput(kv=kv_output)
        for preemption in kv_output.preempted:
            seq = by_id[preemption.seq_id]
            output.preempted.append(seq)
            if preemption.mode == "migrate":
                self.num_preemptions["migrate"] += 1
                self.num_drain_migrations += step_input.is_draining
                # The manager forgot it; this worker only exports its KV.
                self.running.remove(seq)
                self._registered.discard(seq.seq_id)
                del self._queued[seq.seq_id]
                seq.status = SequenceStatus.FINISHED
                output.migrated.append((seq, preemption.target_worker))
                continue
            if seq in self.running:
                self.running.remove(seq)
                self._enqueue(self.waiting, seq)
            seq.status = SequenceStatus.WAITING
            seq.is_swapped = preemption.mode == "swap"
            if not seq.is_swapped:
                seq.num_computed = 0
                seq.block_table = []
            seq.request.metrics.num_preemptions += 1
            self.num_preemptions[preemption.mode] += 1
        admitted = []
        for sched in kv_output.scheduled:
            seq = by_id[sched.seq_id]
            seq.num_computed = sched.start + sched.num_tokens
            seq.block_table = sched.block_table   # the manager's live table: read it, never change it
            seq.is_swapped = False
            if seq.status == SequenceStatus.WAITING:
                admitted.append(seq)
                seq.status = SequenceStatus.RUNNING
            output.scheduled.append((seq, sched))
        if admitted:
            admitted_ids = {id(s) for s in admitted}
            self.waiting = [s for s in self.waiting if id(s) not in admitted_ids]
            for seq in admitted:
                self._enqueue(self.running, seq)
        if self.adapter_pages is not None:
            self._relieve_adapter_pages(step_input, output)
        return output
