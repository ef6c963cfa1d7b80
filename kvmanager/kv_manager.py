"""The KV manager: block accounting of every worker, one batched call per step."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .block_manager import BlockManager, PrefixMatch
from .errors import KVManagerError, UnknownSequenceError, UnknownWorkerError
from .hashing import hash_prefix_blocks
from .preemption import (MigrationTarget, PreemptionCandidate, PreemptionChoice, PreemptionPolicy,
                         PreemptionRequest, decide_preemption)
from .sequence import SeqLocation, SequenceBlocks
from .step import Preemption, ScheduledSeq, StepInput, StepOutput

PREEMPTION_MODES = ("swap", "recompute")  # what a config may force; "migrate" is chosen, never forced
# At most this many victims-to-be are sent with one preemption request; later
# victims of the same step (rare) are swapped or recomputed locally.
MAX_PREEMPTION_CANDIDATES = 64


@dataclass(slots=True)
class PoolConfig:
    """How one worker's pools are sized and managed. Plain data."""

    num_device_blocks: int
    num_host_blocks: int = 0
    block_size: int = 16
    max_model_len: int = 2048
    allocation: str = "paged"
    enable_prefix_caching: bool = True
    watermark: float = 0.01
    preemption_mode: str | None = None  # None: migrate, else swap while host space is free, else recompute
    role: str = "mixed"                 # "prefill" workers never receive migrated sequences
    # Every attention layer windowed, the widest window: blocks wholly out of it are freed
    # as sequences grow (window.py). None (some layer global, or no window): keep them.
    # Not on "prefill" workers, whose prompts' KV is exported whole.
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.preemption_mode not in (None, *PREEMPTION_MODES):
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES} or None, "
                             f"got {self.preemption_mode!r}")
        if self.num_device_blocks < 1:
            raise ValueError(f"num_device_blocks must be >= 1, got {self.num_device_blocks}")
        if self.num_host_blocks < 0:
            raise ValueError(f"num_host_blocks must be >= 0, got {self.num_host_blocks}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {self.sliding_window}")


class KVManager:
    """Owns the block pools of one or more workers.

    Each worker's engine calls ``step`` once per engine step with a
    ``StepInput`` and executes the ``StepOutput`` it gets back. Inputs and
    outputs are plain data, so the same object serves in-process and behind
    a Ray actor. A refused step raises ``KVManagerError`` before changing
    anything.
    """

    def __init__(self, preemption: PreemptionPolicy | None = None) -> None:
        self.workers: dict[str, BlockManager] = {}
        self.configs: dict[str, PoolConfig] = {}
        # Workers whose last step said they are draining: never migration targets.
        self.draining: set[str] = set()
        # Default: decide with the workers held here (migrate between them).
        self.preemption = preemption or _HeldWorkersPreemption(self)

    # ---- workers ----------------------------------------------------------
    def add_worker(self, worker_id: str, config: PoolConfig) -> None:
        if worker_id in self.workers:
            raise KVManagerError(f"worker {worker_id!r} already registered")
        self.configs[worker_id] = config
        self.workers[worker_id] = self._new_block_manager(config)

    def _new_block_manager(self, config: PoolConfig) -> BlockManager:
        manager = BlockManager(
            config.num_device_blocks, config.num_host_blocks, config.block_size,
            config.max_model_len, config.allocation, config.enable_prefix_caching, config.watermark,
            sliding_window=config.sliding_window if config.role != "prefill" else None)
        return manager

    def restore_worker(self, worker_id: str, config: PoolConfig, sequences: list[dict]) -> None:
        """(Re-)register a worker together with the sequences it still holds.

        Used when the manager restarted and lost its state, or a worker
        rejoined: any accounting held for ``worker_id`` is replaced.
        """
        manager = self._new_block_manager(config)
        manager.restore_sequences(sequences)
        self.workers[worker_id] = manager
        self.configs[worker_id] = config

    def remove_worker(self, worker_id: str) -> None:
        """Drop a worker's accounting (it died, or left)."""
        self._worker(worker_id)
        del self.workers[worker_id]
        del self.configs[worker_id]
        self.draining.discard(worker_id)

    def _worker(self, worker_id: str) -> BlockManager:
        manager = self.workers.get(worker_id)
        if manager is None:
            raise UnknownWorkerError(f"unknown worker {worker_id!r}")
        return manager

    def block_manager(self, worker_id: str) -> BlockManager:
        return self._worker(worker_id)

    # ---- the step ---------------------------------------------------------
    def step(self, step_input: StepInput) -> StepOutput:
        """Plan one step for one worker. See ``StepInput`` and ``StepOutput``."""
        manager = self._worker(step_input.worker_id)
        self._validate(manager, step_input)
        if step_input.is_draining:
            self.draining.add(step_input.worker_id)
        else:
            self.draining.discard(step_input.worker_id)
        manager.begin_step()
        output = StepOutput()
        try:
            for new in step_input.new_sequences:
                manager.add_sequence(new.seq_id, new.token_ids, new.extra_key, new.num_imported_tokens,
                                     new.skip_prefix_cache)
            for parent_id, child_id in step_input.forks:
                manager.fork(parent_id, child_id)
                if (manager.seqs[child_id].location != SeqLocation.DEVICE
                        and child_id in step_input.running):
                    # The policy shares nothing: the child recomputes its KV.
                    output.preempted.append(Preemption(child_id, "recompute"))
            if step_input.resolved:
                manager.resolve_tokens_of(step_input.resolved)
            if step_input.accepted:
                manager.accept_tokens_of(step_input.accepted)
            manager.append_tokens_of(step_input.appended)
            for seq_id in step_input.finished:
                manager.free_sequence(seq_id)
            if step_input.proposed:
                manager.propose_tokens_of(step_input.proposed)
            if step_input.is_draining:
                self._drain(manager, step_input, output)
            budget = self._schedule_running(manager, step_input, output, step_input.token_budget)
            num_running_scheduled = len(output.scheduled)
            self._schedule_waiting(manager, step_input, output, budget)
        except BaseException:
            # The plan is lost: the worker never sees the tables it handed out.
            for sched in output.scheduled:
                seq = manager.seqs.get(sched.seq_id)
                if seq is not None:
                    seq.first_changed_block = 0
            raise
        finally:
            scratch = manager.end_step()
        output.swap_out = scratch.swap_out
        output.swap_in = scratch.swap_in
        output.copy_on_write = scratch.copy_on_write
        manager.last_swaps = scratch.swap_out + [(d, h) for h, d in scratch.swap_in]
        manager.last_imported = {b for s in output.scheduled[num_running_scheduled:] if s.num_imported_tokens
                                 for b in s.block_table[:-(-s.num_imported_tokens // manager.block_size)]
                                 if b >= 0}  # only admissions import KV
        return output

    def _validate(self, manager: BlockManager, step_input: StepInput) -> None:
        """Refuse a malformed step before any of it is applied. Costs O(what changed) plus
        one lookup per scheduled sequence."""
        known = manager.seqs
        added: set[str] = set()   # new sequences and fork children
        for new in step_input.new_sequences:
            if new.seq_id in known or new.seq_id in added:
                raise KVManagerError(f"sequence {new.seq_id!r} already exists")
            if not new.token_ids:
                raise KVManagerError(f"sequence {new.seq_id!r} has no tokens")
            if len(new.token_ids) > manager.max_model_len:
                raise KVManagerError(f"sequence {new.seq_id!r} has {len(new.token_ids)} tokens, "
                                     f"max_model_len is {manager.max_model_len}")
            if not 0 <= new.num_imported_tokens < len(new.token_ids):
                raise KVManagerError(f"sequence {new.seq_id!r}: {new.num_imported_tokens} imported "
                                     f"tokens of {len(new.token_ids)}")
            added.add(new.seq_id)
        children: dict[str, str] = {}
        for parent_id, child_id in step_input.forks:
            if parent_id not in known and parent_id not in added:
                raise UnknownSequenceError(f"fork parent {parent_id!r} is unknown")
            if child_id in known or child_id in added:
                raise KVManagerError(f"fork child {child_id!r} already exists")
            added.add(child_id)
            children[child_id] = parent_id
        for seq_id, _ in step_input.appended:
            if seq_id not in known and seq_id not in added:
                raise UnknownSequenceError(f"tokens appended to unknown sequence {seq_id!r}")
        still_pending: dict[str, int] = {}   # once this step's values are in (they go first)
        for seq_id, values in step_input.resolved:
            seq = known.get(seq_id)
            if seq is None:
                raise UnknownSequenceError(f"tokens resolved for unknown sequence {seq_id!r}")
            if len(values) > seq.num_pending:
                raise KVManagerError(f"sequence {seq_id!r}: {len(values)} values for its "
                                     f"{seq.num_pending} pending tokens")
            still_pending[seq_id] = seq.num_pending - len(values)
        for seq_id, num_accepted in step_input.accepted:
            seq = known.get(seq_id)
            if seq is None:
                raise UnknownSequenceError(f"proposals settled for unknown sequence {seq_id!r}")
            if not 0 <= num_accepted <= seq.num_speculative:
                raise KVManagerError(f"sequence {seq_id!r}: {num_accepted} accepted of its "
                                     f"{seq.num_speculative} proposed tokens")
        finished = set(step_input.finished)
        if len(finished) != len(step_input.finished):
            raise KVManagerError("a sequence is listed twice as finished")
        settled = {seq_id for seq_id, _ in step_input.accepted}
        for seq_id, _ in step_input.appended:
            seq = known.get(seq_id)
            if seq is not None and seq.num_speculative and seq_id not in settled:
                raise KVManagerError(f"sequence {seq_id!r}: tokens appended after unsettled proposals")
        for seq_id, _ in step_input.proposed:
            seq = known.get(seq_id)
            if (seq is None or seq_id in finished or seq.location != SeqLocation.DEVICE
                    or still_pending.get(seq_id, seq.num_pending)
                    or (seq.num_speculative and seq_id not in settled)):
                raise KVManagerError(f"sequence {seq_id!r}: proposals need a running sequence whose tokens "
                                     "are all known and settled")
        for seq_id in finished:
            if seq_id not in known and seq_id not in added:
                raise UnknownSequenceError(f"finished sequence {seq_id!r} is unknown")
        running = set(step_input.running)
        waiting = set(step_input.waiting)
        if (len(running) != len(step_input.running) or len(waiting) != len(step_input.waiting)
                or not running.isdisjoint(waiting)):
            raise KVManagerError("a sequence is listed twice for scheduling")
        # A known running sequence on the device, neither finished nor a fork child, is
        # fine; anything else takes the full check.
        unusual = finished.union(children)
        device = SeqLocation.DEVICE
        get = known.get
        for seq_id in step_input.running:
            seq = get(seq_id)
            if seq is None or seq.location is not device or seq_id in unusual:
                self._check_scheduled(seq_id, True, known, added, children, finished)
        for seq_id in step_input.waiting:
            self._check_scheduled(seq_id, False, known, added, children, finished)
        if step_input.token_budget < 0:
            raise KVManagerError("token_budget must be >= 0")

    @staticmethod
    def _check_scheduled(seq_id: str, must_be_on_device: bool, known: dict[str, SequenceBlocks],
                         added: set[str], children: dict[str, str], finished: set[str]) -> None:
        origin = seq_id
        while origin in children:
            origin = children[origin]
        if origin in finished or (origin not in known and origin not in added):
            raise UnknownSequenceError(f"scheduled sequence {seq_id!r} is unknown")
        seq = known.get(origin)
        on_device = seq is not None and origin not in finished and seq.location == SeqLocation.DEVICE
        if must_be_on_device and not on_device:
            raise KVManagerError(f"running sequence {seq_id!r} holds no device blocks")
        if not must_be_on_device and on_device:
            raise KVManagerError(f"waiting sequence {seq_id!r} already holds device blocks")

    def migration_targets(self) -> list[MigrationTarget]:
        """Workers held here that may receive migrated sequences, with their room now."""
        return [MigrationTarget(w, m.device.num_free_blocks - m.watermark_blocks, m.block_size)
                for w, m in self.workers.items()
                if self.configs[w].role != "prefill" and w not in self.draining]

    def _ask_preemption(self, manager: BlockManager, worker_id: str, queue: list[SequenceBlocks],
                        current: int, migratable_ids: list[str]) -> dict[str, PreemptionChoice]:
        """One policy call for every sequence that may become a victim this step."""
        migratable = set(migratable_ids)
        wanted = {seq.seq_id: manager.num_blocks_to_grow(seq, seq.num_tokens - seq.num_computed)
                  for seq in queue[current:]}
        candidates = [
            PreemptionCandidate(seq.seq_id, len(seq.block_table) - seq.num_freed_blocks, seq.num_computed,
                                seq.seq_id in migratable and not seq.num_freed_blocks, wanted[seq.seq_id])
            for seq in (queue[j] for j in range(len(queue) - 1, current - 1, -1))
            if not seq.is_protected][:MAX_PREEMPTION_CANDIDATES]
        num_short = sum(wanted.values()) - manager.device.num_free_blocks
        request = PreemptionRequest(worker_id, candidates, manager.host.num_free_blocks, manager.block_size,
                                    self.configs[worker_id].preemption_mode, max(num_short, 1))
        decision = self.preemption.decide(request)
        return {c.seq_id: c for c in decision.choices}

    def _drain(self, manager: BlockManager, step_input: StepInput, output: StepOutput) -> None:
        """Migrate every migratable running sequence that holds KV to a worker with room
        (one policy call, mode "migrate": migrate or keep). The rest (not migratable, no
        KV yet, no room anywhere) keep running here and are tried again at the next step."""
        worker_id = step_input.worker_id
        candidates = []
        for seq_id in step_input.migratable:
            seq = manager.seqs.get(seq_id)
            if seq is None or seq.location != SeqLocation.DEVICE or not seq.num_computed:
                continue
            if seq.num_freed_blocks:
                continue  # its out-of-window KV is gone: it cannot be exported whole
            candidates.append(PreemptionCandidate(seq_id, len(seq.block_table), seq.num_computed, True))
        if not candidates:
            return
        decision = self.preemption.decide(PreemptionRequest(
            worker_id, candidates, manager.host.num_free_blocks, manager.block_size, "migrate",
            sum(c.num_blocks for c in candidates)))
        for choice in decision.choices:
            seq = manager.seqs.get(choice.seq_id)
            if choice.mode != "migrate" or not choice.target_worker or seq is None:
                continue
            manager.migrate_out(seq)
            output.preempted.append(Preemption(choice.seq_id, "migrate", choice.target_worker))

    def _preempt(self, manager: BlockManager, worker_id: str, seq: SequenceBlocks,
                 choice: PreemptionChoice | None, output: StepOutput) -> None:
        """Carry out a choice; swap or recompute as room allows when there is none
        (a victim beyond the candidates asked about) or it cannot be honoured."""
        mode = choice.mode if choice is not None else (
            "recompute" if self.configs[worker_id].preemption_mode == "recompute" else "swap")
        if mode == "migrate" and choice.target_worker and seq.num_computed and not seq.num_freed_blocks:
            manager.migrate_out(seq)
            output.preempted.append(Preemption(seq.seq_id, "migrate", choice.target_worker))
            return
        if mode != "recompute" and manager.can_swap_out(seq):
            manager.swap_out(seq)
            output.preempted.append(Preemption(seq.seq_id, "swap"))
        else:
            manager.preempt_recompute(seq)
            output.preempted.append(Preemption(seq.seq_id, "recompute"))

    def _schedule_running(self, manager: BlockManager, step_input: StepInput,
                          output: StepOutput, budget: int) -> int:
        seqs = manager.seqs
        device = SeqLocation.DEVICE
        # A draining step may have migrated some away already.
        queue = [seq for seq in map(seqs.get, step_input.running) if seq is not None and seq.location is device]
        worker_id = step_input.worker_id
        try_grow = manager.try_grow
        scheduled = output.scheduled
        migratable = step_input.migratable
        choices: dict[str, PreemptionChoice] | None = None
        # The common decode step needs none of try_grow's work: its tokens fit the table's last
        # block, which the sequence holds alone, and fill no block to index. Then only
        # num_computed moves (what try_grow would do, without the call: ~1/4 of a step's plan).
        bs = manager.block_size
        ref_counts = manager.device.ref_counts
        fast = manager.window is None
        indexes = manager.enable_prefix_caching
        i = 0
        while i < len(queue):
            seq = queue[i]
            start = seq.num_computed
            num_tokens = len(seq.token_ids) - start
            if num_tokens > budget:
                num_tokens = budget
            if num_tokens <= 0:
                i += 1
                continue
            table = seq.block_table
            end = start + num_tokens
            fits = (fast and end <= len(table) * bs and (not indexes or end // bs <= seq.num_indexed_blocks)
                    and (start % bs == 0 or ref_counts[table[start // bs]] == 1))
            if fits:
                seq.num_computed = end
            while not fits and not try_grow(seq, num_tokens):
                victim_index = self._pick_victim(queue, i)
                if victim_index is None:
                    break
                if choices is None:
                    choices = self._ask_preemption(manager, worker_id, queue, i, migratable)
                victim = queue.pop(victim_index)
                self._preempt(manager, worker_id, victim, choices.get(victim.seq_id), output)
            else:
                table = seq.block_table
                scheduled.append(ScheduledSeq(seq.seq_id, start, num_tokens, table, 0, 0, seq.first_changed_block))
                seq.first_changed_block = len(table)
                budget -= num_tokens
                i += 1
                continue
            # Nothing left to preempt: preempt this sequence itself, unless it
            # was just resumed, in which case it waits for room.
            if not seq.is_protected:
                if choices is None:
                    choices = self._ask_preemption(manager, worker_id, queue, i, migratable)
                self._preempt(manager, worker_id, seq, choices.get(seq.seq_id), output)
            queue.pop(i)
        return budget

    @staticmethod
    def _pick_victim(queue: list[SequenceBlocks], current: int) -> int | None:
        """The lowest-priority unprotected sequence after ``current``."""
        for j in range(len(queue) - 1, current, -1):
            if not queue[j].is_protected:
                return j
        return None

    def _schedule_waiting(self, manager: BlockManager, step_input: StepInput,
                          output: StepOutput, budget: int) -> None:
        if output.preempted:
            return  # the pool is under pressure: admit nothing new this step
        seqs = manager.seqs
        for seq_id in step_input.waiting:
            if budget <= 0:
                return
            seq = seqs[seq_id]
            if seq.location == SeqLocation.SWAPPED:
                num_tokens = min(seq.num_uncomputed, budget)
                if not manager.can_swap_in(seq, num_tokens):
                    return
                manager.swap_in(seq)
                num_cached = 0
            elif seq.location == SeqLocation.WAITING and seq.num_imported_tokens:
                if not manager.can_admit(seq, PrefixMatch()):
                    return
                num_imported = manager.admit_imported(seq)
                num_tokens = min(seq.num_uncomputed, budget)
                manager.grow(seq, num_tokens, free_out_of_window=False)
                output.scheduled.append(ScheduledSeq(seq_id, num_imported, num_tokens, seq.block_table,
                                                     0, num_imported, seq.first_changed_block))
                seq.first_changed_block = len(seq.block_table)
                budget -= num_tokens
                continue
            elif seq.location == SeqLocation.WAITING:
                match = manager.match_prefix(seq)
                if not manager.can_admit(seq, match):
                    return  # first come, first served: no overtaking
                num_cached = manager.admit(seq, match)
                if seq.num_preemptions:
                    seq.is_protected = True
                num_tokens = min(seq.num_uncomputed, budget)
            else:
                continue  # a fork child of a running sequence; the next step runs it
            start = seq.num_computed
            # KV arriving this step (swap-in, host hits) is not in the blocks yet: free
            # nothing out of the window before the next step.
            manager.grow(seq, num_tokens, free_out_of_window=False)
            output.scheduled.append(ScheduledSeq(seq_id, start, num_tokens, seq.block_table, num_cached,
                                                 0, seq.first_changed_block))
            seq.first_changed_block = len(seq.block_table)
            budget -= num_tokens

    # ---- queries ----------------------------------------------------------
    def longest_prefix(self, token_ids: list[int], extra_key: str | None = None,
                       block_size: int | None = None) -> dict[str, int]:
        """Cached prefix length in tokens, per worker (device or host tier)."""
        result: dict[str, int] = {}
        hashes_by_size: dict[int, list[bytes]] = {}
        for worker_id, manager in self.workers.items():
            bs = manager.block_size
            if bs not in hashes_by_size:
                hashes_by_size[bs] = hash_prefix_blocks(token_ids, bs, extra_key,
                                                        (len(token_ids) - 1) // bs if token_ids else 0)
            num_blocks = 0
            for i, block_hash in enumerate(hashes_by_size[bs]):
                tokens = token_ids[i * bs:(i + 1) * bs]
                if (manager.device.lookup(block_hash, tokens) is None
                        and manager.host.lookup(block_hash, tokens) is None):
                    break
                num_blocks += 1
            result[worker_id] = num_blocks * bs if manager.enable_prefix_caching else 0
        return result

    def stats(self, worker_id: str) -> dict:
        """Plain-data pool statistics for one worker."""
        manager = self._worker(worker_id)
        counters = asdict(manager.counters)
        queries = counters["num_prefix_query_tokens"]
        seqs = manager.seqs.values()
        return {
            "worker_id": worker_id,
            "block_size": manager.block_size,
            "num_device_blocks": manager.device.num_blocks,
            "num_host_blocks": manager.host.num_blocks,
            "device_blocks_used": manager.device.num_used_blocks,
            "device_blocks_free": manager.device.num_free_blocks - manager.device.num_cached_free_blocks,
            "device_blocks_cached": manager.device.num_cached_free_blocks,
            # Of the used ones, lent as pages of LoRA adapters' weights (unified paging).
            "device_blocks_adapter_pages": manager.num_pages,
            "host_blocks_used": manager.host.num_used_blocks,
            "host_blocks_free": manager.host.num_free_blocks - manager.host.num_cached_free_blocks,
            "host_blocks_cached": manager.host.num_cached_free_blocks,
            "kv_utilization": manager.kv_utilization(),
            "prefix_cache_hit_rate": counters["num_prefix_hit_tokens"] / queries if queries else 0.0,
            "num_sequences": len(manager.seqs),
            "num_running": sum(1 for s in seqs if s.location == SeqLocation.DEVICE),
            "num_swapped": sum(1 for s in seqs if s.location == SeqLocation.SWAPPED),
            "num_device_evictions": manager.device.num_evictions,
            "is_draining": worker_id in self.draining,
            **counters,
        }

    def block_map(self, worker_id: str, max_cells: int = 4096) -> dict:
        """Per-block state of one worker's pools, for dashboards. Plain data.

        For each tier: ``states``, one character per block (``f`` free, ``u``
        in use, ``c`` cached-free, ``s`` shared: ref count > 1, ``w`` being
        swapped by the last step's copies, ``t`` imported by transfer last
        step, ``a`` lent as a page of a LoRA adapter's weights). Pools
        larger than ``max_cells`` are summarised as a density map:
        ``density`` lists, per cell of ``blocks_per_cell`` blocks, the
        fraction of blocks in use. ``owners`` maps a block to its sequences
        (a lent page to its owner) and ``hashes`` to a short hash prefix
        (in-use and cached blocks only, for pools small enough to draw block
        by block).
        """
        manager = self._worker(worker_id)
        owners: dict[str, dict[int, list[str]]] = {"device": {}, "host": {}}
        for seq in manager.seqs.values():
            for block in (manager.policy.held_blocks(seq) if seq.location == SeqLocation.DEVICE else []):
                owners["device"].setdefault(block, []).append(seq.seq_id)
            for block in (seq.host_table[seq.num_freed_blocks:] if seq.location == SeqLocation.SWAPPED else []):
                owners["host"].setdefault(block, []).append(seq.seq_id)
        lent = {block: owner for owner, pages in manager.pages.items() for block in pages}
        moving = {"device": set(), "host": set()}
        for device_block, host_block in manager.last_swaps:
            moving["device"].add(device_block)
            moving["host"].add(host_block)
        tiers = {}
        for tier, pool in (("device", manager.device), ("host", manager.host)):
            states = []
            for block in range(pool.num_blocks):
                refs = pool.ref_counts[block]
                if block in moving[tier]:
                    states.append("w")
                elif tier == "device" and block in manager.last_imported:
                    states.append("t")
                elif tier == "device" and block in lent:
                    states.append("a")
                elif refs > 1:
                    states.append("s")
                elif refs == 1:
                    states.append("u")
                else:
                    states.append("c" if pool.block_hashes[block] is not None else "f")
            entry = {"num_blocks": pool.num_blocks, "block_size": pool.block_size,
                     "counts": {k: states.count(k) for k in "fucswta"}}
            if pool.num_blocks <= max_cells:
                entry["states"] = "".join(states)
                entry["ref_counts"] = {b: r for b, r in enumerate(pool.ref_counts) if r > 1}
                entry["owners"] = {b: ids[:4] for b, ids in owners[tier].items()}
                if tier == "device":
                    entry["owners"].update({b: [owner] for b, owner in lent.items()})
                entry["hashes"] = {b: h.hex()[:12] for b, h in enumerate(pool.block_hashes) if h is not None}
            else:
                per_cell = -(-pool.num_blocks // max_cells)
                entry["blocks_per_cell"] = per_cell
                entry["density"] = [
                    round(sum(1 for st in states[i:i + per_cell] if st not in "fc") / len(states[i:i + per_cell]), 3)
                    for i in range(0, pool.num_blocks, per_cell)]
            tiers[tier] = entry
        return {"worker_id": worker_id, "tiers": tiers}

    def reset_prefix_cache(self, worker_id: str) -> bool:
        """Forget every cached prefix of an idle worker (both tiers).

        For when cached KV may be wrong, e.g. a step was interrupted after its
        plan registered blocks but before the forward pass wrote them. Returns
        False, changing nothing, while any sequence holds blocks there.
        """
        manager = self._worker(worker_id)
        if manager.seqs:
            return False
        manager.device.evict_all_cached()
        manager.host.evict_all_cached()
        return True

    def num_used_blocks(self) -> int:
        """Device plus host blocks in use by sequences across all workers (not pages lent to
        adapters' weights)."""
        return sum(m.device.num_used_blocks - m.num_pages + m.host.num_used_blocks for m in self.workers.values())

    def check_integrity(self) -> None:
        """Raise ``IntegrityError`` unless every worker's accounting is consistent."""
        for manager in self.workers.values():
            manager.check_integrity()


class _HeldWorkersPreemption:
    """The default policy of a ``KVManager``: ``decide_preemption`` over the workers it holds."""

    def __init__(self, manager: KVManager) -> None:
        self.manager = manager

    def decide(self, request: PreemptionRequest):
        return decide_preemption(request, self.manager.migration_targets(), decided_by="in_process")
