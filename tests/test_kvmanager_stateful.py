"""Property-based tests: random operation sequences against the KV manager.

A hypothesis state machine plays a tiny engine: it adds requests (many share
prefixes), forks, finishes and aborts them, and runs steps under random
token budgets on pools small enough that eviction, swapping and
recompute-preemption all happen; between steps it lends device blocks as pages
(a LoRA adapter's weights, unified paging) and takes them back. After every
operation the manager's integrity check must pass, a simulated worker checks
that every block table really holds its sequence's tokens, and no step's table
or copy touches a lent page.
"""

from __future__ import annotations

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedserve.kvmanager import KVManager, NewSequence, PoolConfig, SeqLocation, StepInput
from pagedserve.kvmanager.errors import NoFreeBlocksError

from kv_simulator import SimulatedWorker

MAX_MODEL_LEN = 48
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 50, 51], [70, 71, 72, 73, 74, 75, 76, 77]]


class KVManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.num_created = 0

    def setup(self, block_size: int, num_device: int, num_host: int, mode, allocation: str,
              window: int | None = None) -> None:
        self.manager = KVManager()
        self.max_model_len = MAX_MODEL_LEN
        config = PoolConfig(num_device_blocks=num_device, num_host_blocks=num_host,
                            block_size=block_size, max_model_len=self.max_model_len,
                            allocation=allocation, preemption_mode=mode, watermark=0.0,
                            sliding_window=window)
        self.manager.add_worker("w0", config)
        self.worker = SimulatedWorker(self.manager, "w0", sliding_window=window)
        self.running: list[str] = []
        self.waiting: list[str] = []
        self.computed: dict[str, int] = {}
        self.pending = StepInput("w0")
        self.allocation = allocation
        self.lent: dict[str, list[int]] = {}

    @property
    def ready(self) -> bool:
        return hasattr(self, "manager")

    @precondition(lambda self: not self.ready)
    @rule(block_size=st.sampled_from([2, 4, 8]), num_device=st.integers(6, 24),
          num_host=st.integers(0, 12), mode=st.sampled_from([None, "swap", "recompute"]),
          allocation=st.sampled_from(["paged", "paged", "contiguous"]),
          window=st.sampled_from([None, None, 5, 12]))
    def configure(self, block_size, num_device, num_host, mode, allocation, window) -> None:
        if allocation == "contiguous":
            num_device = max(num_device, -(-MAX_MODEL_LEN // block_size))
            window = None  # never with contiguous allocation
        self.setup(block_size, num_device, num_host, mode, allocation, window)

    @precondition(lambda self: self.ready)
    @rule(prefix=st.sampled_from(range(len(PREFIXES))), suffix=st.lists(st.integers(0, 99), max_size=20))
    def add_request(self, prefix, suffix) -> None:
        seq_id = f"s{self.num_created}"
        self.num_created += 1
        tokens = (PREFIXES[prefix] + suffix)[: self.max_model_len - 2]
        self.pending.new_sequences.append(NewSequence(seq_id, tokens))
        self.worker.tokens[seq_id] = list(tokens)
        self.waiting.append(seq_id)
        self.computed[seq_id] = 0

    @precondition(lambda self: self.ready and self.allocation == "paged")
    @rule(owner=st.integers(0, 2), num_pages=st.integers(1, 4))
    def lend_or_take_back_pages(self, owner, num_pages) -> None:
        manager = self.manager.block_manager("w0")
        name = f"adapter{owner}"
        if name in self.lent:
            assert manager.release_pages(name) == len(self.lent.pop(name))
            event("pages-returned")
            return
        lendable, used = manager.num_lendable_pages, manager.device.num_used_blocks
        try:
            self.lent[name] = manager.reserve_pages(name, num_pages)
        except NoFreeBlocksError:
            assert num_pages > lendable and manager.device.num_used_blocks == used   # refused, nothing changed
            return
        event("pages-lent")
        assert manager.num_pages == sum(len(pages) for pages in self.lent.values())

    def _sampling(self) -> list[str]:
        """Running sequences whose known tokens are all computed."""
        return [s for s in self.running if self.computed[s] == len(self.worker.tokens[s])]

    @precondition(lambda self: self.ready)
    @rule(data=st.data())
    def fork(self, data) -> None:
        candidates = [s for s in self._sampling() if s not in dict(self.pending.appended)]
        if not candidates:
            return
        parent = data.draw(st.sampled_from(candidates))
        child = f"s{self.num_created}"
        self.num_created += 1
        self.pending.forks.append((parent, child))
        self.worker.tokens[child] = list(self.worker.tokens[parent])
        self.running.insert(self.running.index(parent) + 1, child)
        self.computed[child] = self.computed[parent]

    @precondition(lambda self: self.ready)
    @rule(data=st.data())
    def finish(self, data) -> None:
        live = self.running + self.waiting
        if not live:
            return
        seq_id = data.draw(st.sampled_from(live))
        if any(seq_id in fork for fork in self.pending.forks) or seq_id in [
                n.seq_id for n in self.pending.new_sequences]:
            return  # keep the bookkeeping simple: not in the step that made it
        self._drop(seq_id)
        self.pending.finished.append(seq_id)
        self.pending.appended = [(s, t) for s, t in self.pending.appended if s != seq_id]

    def _drop(self, seq_id: str) -> None:
        (self.running if seq_id in self.running else self.waiting).remove(seq_id)
        del self.computed[seq_id]
        self.worker.tokens.pop(seq_id)

    @precondition(lambda self: self.ready)
    @rule(budget=st.integers(1, 40), data=st.data())
    def step(self, budget, data) -> None:
        # Sequences that computed everything last step sample one token now.
        appended = dict(self.pending.appended)
        for seq_id in self._sampling():
            if seq_id not in appended and len(self.worker.tokens[seq_id]) < self.max_model_len:
                appended[seq_id] = [data.draw(st.integers(0, 99))]
        step_input = self.pending
        step_input.appended = list(appended.items())
        step_input.running = list(self.running)
        step_input.waiting = list(self.waiting)
        step_input.token_budget = budget
        self.pending = StepInput("w0")
        for seq_id, tokens in step_input.appended:
            self.worker.tokens[seq_id].extend(tokens)
        output = self.manager.step(step_input)
        lent = {block for pages in self.lent.values() for block in pages}
        for sched in output.scheduled:
            assert not lent & set(sched.block_table), "a lent page in a block table"
        for _, target in output.swap_in + output.copy_on_write:
            assert target not in lent, "a copy onto a lent page"
        self.worker.execute(output)
        for preemption in output.preempted:
            event(f"preempt-{preemption.mode}")
        for name in ("swap_out", "swap_in", "copy_on_write"):
            if getattr(output, name):
                event(name)
        if any(s.num_cached_tokens for s in output.scheduled):
            event("prefix-hit")

        for preemption in output.preempted:
            self.running.remove(preemption.seq_id)
            self.waiting.insert(0, preemption.seq_id)
            if preemption.mode == "recompute":
                self.computed[preemption.seq_id] = 0
        for sched in output.scheduled:
            assert sched.start == self.computed[sched.seq_id] or sched.num_cached_tokens == sched.start
            self.computed[sched.seq_id] = sched.start + sched.num_tokens
            if sched.seq_id in self.waiting:
                self.waiting.remove(sched.seq_id)
                self.running.append(sched.seq_id)
        assert output.num_scheduled_tokens <= budget
        # Sequences at the length limit finish.
        for seq_id in list(self.running):
            if (len(self.worker.tokens[seq_id]) >= self.max_model_len
                    and self.computed[seq_id] == len(self.worker.tokens[seq_id])):
                self._drop(seq_id)
                self.pending.finished.append(seq_id)

    @invariant()
    def integrity(self) -> None:
        if self.ready:
            self.manager.check_integrity()
            bm = self.manager.block_manager("w0")
            for seq_id in self.running:
                if seq_id in bm.seqs:
                    assert bm.seqs[seq_id].location == SeqLocation.DEVICE

    def teardown(self) -> None:
        if not self.ready:
            return
        self.manager.step(StepInput("w0", new_sequences=self.pending.new_sequences,
                                    forks=self.pending.forks, finished=self.pending.finished))
        self.manager.step(StepInput("w0", finished=self.running + self.waiting))
        self.manager.check_integrity()
        assert self.manager.num_used_blocks() == 0, "blocks leaked after every sequence finished"
        manager = self.manager.block_manager("w0")
        assert manager.device.num_used_blocks == manager.num_pages   # only the lent pages
        for name in list(self.lent):
            manager.release_pages(name)
        assert manager.device.num_used_blocks == 0


KVManagerMachine.TestCase.settings = settings(
    max_examples=120, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestKVManagerStateful = KVManagerMachine.TestCase
