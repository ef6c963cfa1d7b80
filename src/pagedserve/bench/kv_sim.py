"""A model-free worker for ``bench kv-scale``: the real worker-side KV code, driven
like an engine would drive it.

``SimulatedKVWorker`` owns a ``LocalKVManager`` (its own pools and event
log) and plays the engine's scheduler around it: every ``step`` it sends the
changes since the last step (new requests, sampled tokens, finishes) with
the running and waiting queues, applies the plan it gets back (preempted
sequences back to waiting, or handed to another worker for migration) and
"samples" one token for every sequence whose known tokens are all computed.
No model runs, so a step costs only the KV bookkeeping.

The workload: requests whose prompts start with one of a few shared prefixes
(prefix-cache hits), decode for a random number of tokens (growth), finish,
and are replaced, keeping ``batch`` sequences running at a mean context of
about ``context`` tokens. Once warm, a step computes the batch's decode
tokens plus at most ``prefill_per_step`` prompt tokens (chunked prefill, as a
GPU engine mixes them), and output lengths scale with the context (uniform in
[L/4, 3L/4] by default), so the blocks that change per step do not grow with
the context. The pool holds the batch at its mean context plus
``pool_headroom``, so it runs near full; ``pressure_per_s`` adds, at
random, arrivals whose KV comes with them (disaggregated prefill) of up to
``context`` tokens, taking nearly all of the free room, so that the next
steps' growth must preempt (migrate, swap or recompute, decided by the
central manager).

Talking to the central manager is left to the caller through two hooks:
``preemption`` (the ``LocalKVManager``'s policy, in a cluster one blocking
call) and ``drain_events``/``snapshot`` (published off the step path).
Tokens are a pure function of (prefix, request seed, position), so a
sequence's tokens are never stored twice.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from pagedserve.kvmanager import NewSequence, PoolConfig, StepInput
from pagedserve.kvmanager.events import EventLog
from pagedserve.kvmanager.local_manager import LocalKVManager
from pagedserve.kvmanager.preemption import PreemptionPolicy

VOCAB_LOW, VOCAB_HIGH = 3, 250   # small ints: Python shares their objects, so long contexts stay small
TOKEN_MODULUS = 65521


@dataclass(frozen=True)
class SimWorkload:
    """What every simulated worker runs; see the module docstring."""

    batch: int = 256
    context: int = 4096
    block_size: int = 16
    num_prefixes: int = 8
    shared_prefix_frac: float = 0.5
    output_len: tuple[int, int] | None = None   # default: (context // 4, 3 * context // 4)
    pressure_per_s: float = 0.2
    steps_per_s: float = 50.0
    prefill_per_step: int = 512
    warmup_token_budget: int = 16384
    host_pool_frac: float = 0.25
    pool_headroom: float = 0.03
    seed: int = 0

    def __post_init__(self) -> None:
        if self.batch < 1 or self.context < 2 * self.block_size:
            raise ValueError(f"batch must be >= 1 and context >= 2 blocks, got {self.batch}, {self.context}")
        if not 0 <= self.shared_prefix_frac < 1:
            raise ValueError(f"shared_prefix_frac must be in [0, 1), got {self.shared_prefix_frac}")
        low, high = self.output_range
        if not 1 <= low <= high or high >= self.context:
            raise ValueError(f"output_len must be 1 <= low <= high < context, got {self.output_range}")
        if self.prefill_per_step < 1:
            raise ValueError(f"prefill_per_step must be >= 1, got {self.prefill_per_step}")

    @property
    def output_range(self) -> tuple[int, int]:
        return tuple(self.output_len) if self.output_len else (self.context // 4, 3 * self.context // 4)

    @property
    def shared_len(self) -> int:
        """Tokens of the shared prefix, whole blocks."""
        return int(self.context * self.shared_prefix_frac) // self.block_size * self.block_size

    @property
    def max_model_len(self) -> int:
        return 2 * self.context + self.output_range[1]

    def pool_config(self) -> PoolConfig:
        """Device blocks for ``batch`` sequences at the mean context (shared prefixes held
        once) plus ``pool_headroom``, so the pool runs near full and the batch's
        fluctuations press on it; a host tier of ``host_pool_frac`` of that."""
        bs = self.block_size
        per_seq = -(-(self.context - self.shared_len) // bs) + 1
        shared = self.num_prefixes * (self.shared_len // bs)
        num_device = int((self.batch * per_seq + shared) * (1 + self.pool_headroom))
        return PoolConfig(num_device_blocks=num_device, num_host_blocks=int(num_device * self.host_pool_frac),
                          block_size=bs, max_model_len=self.max_model_len, watermark=0.01)

    def prefix(self, index: int) -> list[int]:
        rng = random.Random(f"prefix-{self.seed}-{index}")
        return [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(self.shared_len)]

    def prefixes(self) -> list[list[int]]:
        """Every shared prefix, for the workload's ``SimulatedKVWorker``s (one list may serve
        many workers of a process)."""
        return [self.prefix(index) for index in range(self.num_prefixes)]


@dataclass(slots=True)
class SimRequest:
    """One sequence, as the engine knows it. Its tokens are ``tokens(n)``."""

    seq_id: str
    order: int
    prefix_index: int
    token_seed: int
    num_tokens: int           # prompt plus sampled so far
    num_output_left: int
    num_computed: int = 0
    is_running: bool = False
    is_pressure: bool = False   # beyond the batch: admitted whatever the number running
    token_base: int = field(init=False)   # the seed's term of every generated token, reduced

    def __post_init__(self) -> None:
        self.token_base = self.token_seed * 2654435761 % TOKEN_MODULUS


@dataclass
class SimCounters:
    num_steps: int = 0
    num_scheduled_tokens: int = 0
    num_finished: int = 0
    num_admitted: int = 0
    num_pressure_requests: int = 0
    num_migrated_in: int = 0
    preemptions_by_mode: dict[str, int] = field(default_factory=lambda: {"migrate": 0, "swap": 0, "recompute": 0})

    def as_dict(self) -> dict:
        return {"num_steps": self.num_steps, "num_scheduled_tokens": self.num_scheduled_tokens,
                "num_finished": self.num_finished, "num_admitted": self.num_admitted,
                "num_pressure_requests": self.num_pressure_requests, "num_migrated_in": self.num_migrated_in,
                "preemptions_by_mode": dict(self.preemptions_by_mode)}


@dataclass(frozen=True)
class Migration:
    """A sequence handed to ``target_worker`` with the KV of its first ``num_computed`` tokens."""

    target_worker: str
    seq_id: str
    prefix_index: int
    token_seed: int
    num_tokens: int
    num_output_left: int
    num_computed: int


class SimulatedKVWorker:
    """One simulated worker: a ``LocalKVManager`` with an ``EventLog``, and the queues."""

    def __init__(self, worker_id: str, workload: SimWorkload, prefixes: list[list[int]],
                 preemption: PreemptionPolicy | None = None) -> None:
        self.worker_id = worker_id
        self.workload = workload
        self.prefixes = prefixes
        self.rng = random.Random(f"{workload.seed}-{worker_id}")
        self.event_log = EventLog(worker_id)
        self.kv = LocalKVManager(preemption, self.event_log)
        self.pool_config = workload.pool_config()
        self.kv.add_worker(worker_id, self.pool_config)
        self.requests: dict[str, SimRequest] = {}      # every live request: running or waiting
        self.pressure: dict[str, SimRequest] = {}      # the live pressure requests among them (few)
        self.running: list[SimRequest] = []
        self.waiting: list[SimRequest] = []
        self.pending = StepInput(worker_id)
        self.outbox: list[Migration] = []
        self.counters = SimCounters()
        self._num_created = 0
        self._is_warm = False
        self._shared_len = workload.shared_len

    # ---- tokens -----------------------------------------------------------------------
    def tokens(self, request: SimRequest, start: int, stop: int) -> list[int]:
        """Tokens ``[start, stop)`` of a request: its prefix, then a stream fixed by its seed."""
        shared = self._shared_len
        prefix = self.prefixes[request.prefix_index]
        out = prefix[start:min(stop, shared)]
        base, span = request.token_base, VOCAB_HIGH - VOCAB_LOW
        out += [VOCAB_LOW + (base + i * 40503) % TOKEN_MODULUS % span for i in range(max(start, shared), stop)]
        return out

    def token(self, request: SimRequest, position: int) -> int:
        """``tokens(request, position, position + 1)[0]``, cheaply: a decode step's sampled token."""
        if position < self._shared_len:
            return self.prefixes[request.prefix_index][position]
        return VOCAB_LOW + (request.token_base + position * 40503) % TOKEN_MODULUS % (VOCAB_HIGH - VOCAB_LOW)

    # ---- requests ---------------------------------------------------------------------
    def _new_request(self, num_prompt: int, num_output: int, is_pressure: bool = False) -> SimRequest:
        self._num_created += 1
        request = SimRequest(f"{self.worker_id}-r{self._num_created}", self._num_created,
                             self.rng.randrange(self.workload.num_prefixes), self.rng.getrandbits(31),
                             num_prompt, num_output, is_pressure=is_pressure)
        num_imported = num_prompt - 1 if is_pressure else 0
        if is_pressure:
            request.order = -request.order  # ahead of the queue
            self.requests[request.seq_id] = request
            self.pressure[request.seq_id] = request
            self.waiting.insert(0, request)
            self.pending.new_sequences.append(NewSequence(request.seq_id, self.tokens(request, 0, num_prompt),
                                                          num_imported_tokens=num_imported))
        else:
            self._enqueue(request, NewSequence(request.seq_id, self.tokens(request, 0, num_prompt)))
        self.counters.num_admitted += 1
        return request

    def _enqueue(self, request: SimRequest, new: NewSequence) -> None:
        self.requests[request.seq_id] = request
        self.waiting.append(request)
        self.pending.new_sequences.append(new)

    def _top_up(self) -> None:
        """Keep ``batch`` sequences running or waiting: new requests replace finished ones.

        At the start, requests come with part of their output already "generated"
        (a longer prompt, fewer tokens left), so they do not all finish together.
        """
        w = self.workload
        num_regular = len(self.requests) - len(self.pressure)
        for _ in range(w.batch - num_regular):
            num_output = self.rng.randint(*w.output_range)
            num_done = 0 if self._is_warm else self.rng.randrange(num_output)
            num_prompt = max(w.shared_len + 1, w.context - num_output // 2) + num_done
            self._new_request(num_prompt, num_output - num_done)

    def _maybe_add_pressure(self) -> None:
        """An arrival with its KV (``num_imported_tokens``) of up to ``context`` tokens,
        taking nearly all of the free room when there is less."""
        w = self.workload
        if not self._is_warm or self.rng.random() >= w.pressure_per_s / w.steps_per_s:
            return
        device = self.kv.occupancy()["device"]
        watermark = int(self.pool_config.watermark * device.num_total) + 1
        room = (device.num_available - watermark) * w.block_size * 98 // 100
        num_prompt = min(room, w.context)
        if num_prompt > w.shared_len + 2 * w.block_size:
            self._new_request(num_prompt, self.rng.randint(*w.output_range), is_pressure=True)
            self.counters.num_pressure_requests += 1

    def accept_migration(self, migration: Migration) -> None:
        """Take over a sequence migrated from another worker (its KV arrives with it)."""
        request = SimRequest(migration.seq_id, -1, migration.prefix_index, migration.token_seed,
                             migration.num_tokens, migration.num_output_left)
        request.order = min((r.order for r in self.waiting), default=0) - 1
        num_imported = min(migration.num_computed, migration.num_tokens - 1)
        self.requests[request.seq_id] = request
        self.waiting.insert(0, request)
        self.pending.new_sequences.append(NewSequence(request.seq_id, self.tokens(request, 0, request.num_tokens),
                                                      num_imported_tokens=num_imported))
        self.counters.num_migrated_in += 1

    def set_warm(self) -> None:
        """From now on, new requests start from scratch and pressure may be injected."""
        self._is_warm = True

    # ---- the step ---------------------------------------------------------------------
    def step(self) -> int:
        """One engine step's KV work. Returns the tokens scheduled."""
        self._top_up()
        self._maybe_add_pressure()
        step_input, self.pending = self.pending, StepInput(self.worker_id)
        step_input.running = [r.seq_id for r in self.running]
        num_pressure_running = sum(1 for r in self.pressure.values() if r.is_running)
        num_free_slots = max(0, self.workload.batch - (len(self.running) - num_pressure_running))
        waiting = [r.seq_id for r in self.waiting if r.is_pressure]
        waiting += [r.seq_id for r in self.waiting if not r.is_pressure][:num_free_slots]
        step_input.waiting = waiting
        w = self.workload
        step_input.token_budget = w.batch + w.prefill_per_step if self._is_warm else w.warmup_token_budget
        step_input.migratable = step_input.running
        output = self.kv.step(step_input)
        counters = self.counters
        for preemption in output.preempted:
            request = self.requests[preemption.seq_id]
            counters.preemptions_by_mode[preemption.mode] += 1
            if request.is_running:
                self.running.remove(request)
                request.is_running = False
            if preemption.mode == "migrate":
                del self.requests[request.seq_id]
                self.pressure.pop(request.seq_id, None)
                if request in self.waiting:
                    self.waiting.remove(request)
                self.outbox.append(Migration(preemption.target_worker, request.seq_id, request.prefix_index,
                                             request.token_seed, request.num_tokens, request.num_output_left,
                                             request.num_computed))
                continue
            if request not in self.waiting:
                self.waiting.append(request)
            if preemption.mode == "recompute":
                request.num_computed = 0
        if output.preempted:
            self.waiting.sort(key=lambda r: r.order)
        admitted: set[str] = set()
        appended = self.pending.appended
        requests, token = self.requests, self.token
        shared_len, span = self._shared_len, VOCAB_HIGH - VOCAB_LOW
        num_scheduled = num_kept = 0
        for scheduled in output.scheduled:
            request = requests[scheduled.seq_id]
            num_tokens = scheduled.num_tokens
            num_scheduled += num_tokens
            num_computed = request.num_computed = scheduled.start + num_tokens
            if not request.is_running:
                request.is_running = True
                admitted.add(request.seq_id)
                self.running.append(request)
            if num_computed == request.num_tokens:
                if request.num_output_left <= 0:
                    self._finish(request)
                    continue
                request.num_output_left -= 1
                # ``token(request, num_computed)``, inlined past the shared prefix (every decode step)
                sampled = (VOCAB_LOW + (request.token_base + num_computed * 40503) % TOKEN_MODULUS % span
                           if num_computed >= shared_len else token(request, num_computed))
                appended.append((request.seq_id, [sampled]))
                request.num_tokens = num_computed + 1
            num_kept += num_tokens
        counters.num_scheduled_tokens += num_kept
        if admitted:  # (some may have finished in the same step)
            self.waiting = [r for r in self.waiting if r.seq_id not in admitted]
        counters.num_steps += 1
        return num_scheduled

    def _finish(self, request: SimRequest) -> None:
        self.running.remove(request)
        request.is_running = False
        del self.requests[request.seq_id]
        self.pressure.pop(request.seq_id, None)
        self.pending.finished.append(request.seq_id)
        self.counters.num_finished += 1

    def finish_all(self) -> None:
        """Finish (abort) every sequence and apply that with one more step; requests
        never registered with the manager are simply dropped."""
        registered = sorted(self.kv.block_manager_of_worker.seqs)
        self.requests.clear()
        self.pressure.clear()
        self.running.clear()
        self.waiting.clear()
        self.pending = StepInput(self.worker_id)
        self.kv.step(StepInput(self.worker_id, finished=registered))

    @property
    def num_prefilled(self) -> int:
        """Running sequences whose prompt is computed (decoding)."""
        return sum(1 for r in self.running if r.num_computed >= r.num_tokens - 1)

    def check_integrity(self) -> None:
        """The pool's own invariants, and the engine's and the manager's views agree."""
        self.kv.check_integrity()
        held = self.kv.block_manager_of_worker.seqs
        pending_new = {n.seq_id for n in self.pending.new_sequences}
        known = (set(self.requests) - pending_new) | set(self.pending.finished)
        if set(held) != known:
            raise AssertionError(f"{self.worker_id}: the manager holds {len(set(held) - known)} sequences the "
                                 f"engine does not and lacks {len(known - set(held))}")
