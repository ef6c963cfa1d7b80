"""A simulated worker for KV manager tests.

It keeps a token id in every slot of a fake device and host cache, executes
each ``StepOutput`` the way a real worker must (swap out, swap in, copy on
write, then write the scheduled tokens), and checks that every scheduled
sequence's block table really holds that sequence's tokens. If the manager
hands out a wrong block, shares one it must not, or orders a copy wrongly,
the check fails. With a ``sliding_window`` only the positions the window
still reads are checked, and entries before it may be freed (``FREED``).
"""

from __future__ import annotations

from pagedserve.kvmanager import KVManager, ScheduledSeq, StepInput, StepOutput
from pagedserve.kvmanager.window import FREED


class SimulatedWorker:
    def __init__(self, manager: KVManager, worker_id: str, sliding_window: int | None = None) -> None:
        bm = manager.block_manager(worker_id)
        self.manager = manager
        self.worker_id = worker_id
        self.block_size = bm.block_size
        self.sliding_window = sliding_window
        self.device = [[None] * bm.block_size for _ in range(bm.device.num_blocks)]
        self.host = [[None] * bm.block_size for _ in range(bm.host.num_blocks)]
        # Engine-side view: all tokens of each live sequence.
        self.tokens: dict[str, list[int]] = {}
        # A persistent copy of each table, rewritten from ``first_changed_block`` on only.
        self.tables: dict[str, list[int]] = {}

    def execute(self, output: StepOutput) -> None:
        for pairs in (output.swap_out, output.swap_in, output.copy_on_write):
            assert all(a >= 0 and b >= 0 for a, b in pairs), f"a copy names a freed block: {pairs}"
        for device_block, host_block in output.swap_out:
            self.host[host_block] = list(self.device[device_block])
        for host_block, device_block in output.swap_in:
            self.device[device_block] = list(self.host[host_block])
        for src, dst in output.copy_on_write:
            self.device[dst] = list(self.device[src])
        for sched in output.scheduled:
            kept = self.tables.setdefault(sched.seq_id, [])
            first = sched.first_changed_block
            if first > len(kept):
                raise AssertionError(f"{sched.seq_id}: first changed block {first} is past the "
                                     f"{len(kept)} entries its table had")
            kept[first:] = sched.block_table[first:]
            if kept != sched.block_table:
                raise AssertionError(f"{sched.seq_id}: entries before {first} changed: "
                                     f"{kept} kept, {sched.block_table} planned")
        bs = self.block_size
        # A forward pass writes every scheduled token's KV (layer by layer)
        # before any token attends, so write all, then check all.
        for sched in output.scheduled:
            tokens = self.tokens[sched.seq_id]
            for pos in range(sched.start, sched.start + sched.num_tokens):
                self.device[sched.block_table[pos // bs]][pos % bs] = tokens[pos]
        for sched in output.scheduled:
            self.check_block_table(sched)

    def check_block_table(self, sched: ScheduledSeq) -> None:
        """Every position this step's queries read holds the sequence's token there: all of
        them, or with a sliding window those in the first query's window."""
        tokens = self.tokens[sched.seq_id]
        table = sched.block_table
        bs = self.block_size
        first_seen = 0 if self.sliding_window is None else max(0, sched.start - self.sliding_window + 1)
        assert all(b == FREED for b in table[:first_seen // bs]) or FREED not in table[first_seen // bs:], table
        for pos in range(first_seen, sched.start + sched.num_tokens):
            block = table[pos // bs]
            if block == FREED:
                raise AssertionError(f"{sched.seq_id}: position {pos} (in the window) was freed")
            got = self.device[block][pos % bs]
            if got != tokens[pos]:
                raise AssertionError(
                    f"{sched.seq_id}: position {pos} in block {block} holds {got}, "
                    f"expected {tokens[pos]}")

    def step(self, step_input: StepInput) -> StepOutput:
        for new in step_input.new_sequences:
            self.tokens[new.seq_id] = list(new.token_ids)
        for parent, child in step_input.forks:
            self.tokens[child] = list(self.tokens[parent])
        for seq_id, token_ids in step_input.appended:
            self.tokens[seq_id].extend(token_ids)
        output = self.manager.step(step_input)
        for seq_id in step_input.finished:
            self.tokens.pop(seq_id, None)
            self.tables.pop(seq_id, None)
        self.execute(output)
        return output
