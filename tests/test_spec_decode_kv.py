"""The KV side of speculative decoding: proposed tokens get slots before verification, the
rejected ones are rolled back (the computed count cut back, blocks left empty freed in the same
step), and no block is indexed for the prefix cache until all its tokens are accepted. Every
step is followed by the KV manager's integrity check."""

from __future__ import annotations

import random

import pytest

from pagedserve.kvmanager import KVManager, KVManagerError, NewSequence, PoolConfig, StepInput, from_wire, to_wire

BS = 4


def make_manager(num_device: int = 32, num_host: int = 0, **kwargs) -> tuple[KVManager, object]:
    manager = KVManager()
    manager.add_worker("w", PoolConfig(num_device_blocks=num_device, num_host_blocks=num_host, block_size=BS,
                                       max_model_len=256, watermark=0.0, **kwargs))
    return manager, manager.block_manager("w")


def step(manager: KVManager, **kwargs):
    output = manager.step(StepInput("w", **kwargs))
    manager.check_integrity()
    return output


def start(manager: KVManager, seq_id: str, prompt: list[int]):
    """Admit and prefill a sequence, then give it its first sampled token (not computed yet)."""
    step(manager, new_sequences=[NewSequence(seq_id, prompt)], waiting=[seq_id])
    step(manager, appended=[(seq_id, [1000])])


def test_proposals_get_slots_and_rejected_ones_are_rolled_back():
    manager, bm = make_manager()
    prompt = list(range(10, 16))                      # 6 tokens: blocks [0..3], [4..5]
    step(manager, new_sequences=[NewSequence("s", prompt)], waiting=["s"])
    seq = bm.seqs["s"]
    assert seq.num_computed == 6
    used = bm.device.num_used_blocks
    # The first sample (position 6) and 5 proposals (positions 7..11): 6 tokens in one chunk.
    out = step(manager, appended=[("s", [16])], proposed=[("s", [17, 18, 19, 20, 21])], running=["s"])
    (sched,) = out.scheduled
    assert (sched.start, sched.num_tokens) == (6, 6)
    assert seq.num_computed == 12 and len(seq.block_table) == 3 and bm.device.num_used_blocks == used + 1
    # Blocks 1 and 2 are full but hold proposals: not indexed.
    assert seq.num_indexed_blocks == 1 and len(seq.block_hashes) == 1
    # Two accepted (17, 18), then the target's own token: the third block (positions 8..11) is empty again.
    step(manager, accepted=[("s", 2)], appended=[("s", [77])])
    assert seq.token_ids == prompt + [16, 17, 18, 77]
    assert seq.num_computed == 9 and seq.num_speculative == 0
    assert len(seq.block_table) == 3 and bm.device.num_used_blocks == used + 1
    # 9 computed tokens: the third block holds position 8, so it stays; block 1 (4..7) is now indexed.
    assert seq.num_indexed_blocks == 2
    step(manager, finished=["s"])
    assert bm.device.num_used_blocks == 0


def test_a_block_left_empty_returns_to_the_pool_in_the_same_step():
    manager, bm = make_manager()
    step(manager, new_sequences=[NewSequence("s", list(range(10, 18)))], waiting=["s"])  # 2 full blocks
    seq = bm.seqs["s"]
    step(manager, appended=[("s", [18])], proposed=[("s", [19, 20, 21, 22])], running=["s"])
    assert len(seq.block_table) == 4 and seq.num_computed == 13
    free_before = bm.device.num_free_blocks
    step(manager, accepted=[("s", 0)], appended=[("s", [50])])
    # 9 tokens computed (positions 0..8): 3 blocks; the fourth (proposals only) is free again, uncached.
    assert len(seq.block_table) == 3 and seq.num_computed == 9
    assert bm.device.num_free_blocks == free_before + 1 and bm.device.num_cached_free_blocks == 0
    step(manager, finished=["s"])


def test_unscheduled_proposals_are_dropped_without_touching_the_kv():
    manager, bm = make_manager()
    start(manager, "s", list(range(10, 17)))
    seq = bm.seqs["s"]
    table = list(seq.block_table)
    step(manager, proposed=[("s", [1, 2, 3])], running=["s"], token_budget=0)
    assert seq.num_computed == 7 and seq.num_speculative == 3
    step(manager, accepted=[("s", 0)], running=["s"])
    assert seq.token_ids[-1] == 1000 and seq.num_computed == 8 and seq.block_table == table
    step(manager, finished=["s"])


def test_a_budget_cut_verifies_part_of_the_proposals():
    manager, bm = make_manager()
    start(manager, "s", list(range(10, 17)))           # 8 known, 7 computed
    seq = bm.seqs["s"]
    out = step(manager, proposed=[("s", [6, 7, 8, 9])], running=["s"], token_budget=3)
    assert (out.scheduled[0].start, out.scheduled[0].num_tokens) == (7, 3)
    with pytest.raises(KVManagerError, match="never computed"):
        manager.step(StepInput("w", accepted=[("s", 3)]))
    assert seq.num_speculative == 4   # the refused step changed nothing
    step(manager, accepted=[("s", 2)], appended=[("s", [40])])
    assert seq.token_ids[7:] == [1000, 6, 7, 40] and seq.num_computed == 10
    step(manager, finished=["s"])


def test_a_shared_block_is_copied_before_a_proposal_writes_into_it():
    manager, bm = make_manager()
    start(manager, "p", list(range(10, 16)))           # 7 known, 6 computed; block 1 half full
    step(manager, forks=[("p", "c")])
    parent, child = bm.seqs["p"], bm.seqs["c"]
    shared = parent.block_table[1]
    assert child.block_table[1] == shared and bm.device.ref_counts[shared] == 2
    out = step(manager, appended=[("p", [1]), ("c", [2])], proposed=[("c", [3, 4, 5])], running=["c", "p"])
    assert child.block_table[1] != shared and (shared, child.block_table[1]) in out.copy_on_write
    assert parent.block_table[1] == shared and bm.device.ref_counts[shared] == 1
    step(manager, accepted=[("c", 1)], appended=[("c", [9])])
    step(manager, finished=["p", "c"])
    assert bm.device.num_used_blocks == 0


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_drops_the_proposals(mode):
    # Room for one sequence's growth only: the second is preempted when the first grows.
    manager, bm = make_manager(num_device=6, num_host=16, preemption_mode=mode)
    start(manager, "a", list(range(10, 17)))
    start(manager, "b", list(range(20, 27)))
    used = bm.device.num_used_blocks
    out = step(manager, proposed=[("a", [1, 2, 3, 4, 5, 6]), ("b", [7, 8])], running=["a", "b"])
    assert [p.seq_id for p in out.preempted] == ["b"] and bm.seqs["b"].num_speculative == 0
    assert bm.seqs["b"].token_ids == list(range(20, 27)) + [1000]
    step(manager, accepted=[("a", 6)], appended=[("a", [9])], running=["a"], waiting=["b"])
    step(manager, finished=["a", "b"])
    assert bm.device.num_used_blocks == 0 and bm.host.num_used_blocks == 0 and used


def test_accepted_blocks_are_found_by_the_prefix_cache_and_rejected_ones_never():
    manager, bm = make_manager()
    prompt = list(range(10, 18))                         # 2 full blocks
    step(manager, new_sequences=[NewSequence("s", prompt)], waiting=["s"])
    step(manager, appended=[("s", [18])], proposed=[("s", [19, 20, 21, 22, 23, 24, 25])], running=["s"])
    step(manager, accepted=[("s", 3)], appended=[("s", [99])])   # block 2 = 18 19 20 21: accepted, full
    step(manager, finished=["s"])
    # A prompt continuing the accepted tokens hits three blocks; one following the rejected ones two.
    for tokens, num_hit in ((prompt + [18, 19, 20, 21, 99, 1], 12), (prompt + [18, 19, 20, 21, 22, 23, 24, 25, 1], 12)):
        out = step(manager, new_sequences=[NewSequence("t", tokens)], waiting=["t"])
        assert out.scheduled[0].num_cached_tokens == num_hit
        step(manager, finished=["t"])


def test_malformed_proposals_are_refused_before_anything_changes():
    manager, bm = make_manager()
    start(manager, "s", list(range(10, 17)))
    with pytest.raises(KVManagerError):
        manager.step(StepInput("w", accepted=[("s", 1)]))      # nothing was proposed
    step(manager, proposed=[("s", [1, 2])], running=["s"])
    with pytest.raises(KVManagerError):
        manager.step(StepInput("w", proposed=[("s", [3])]))   # the last ones are not settled
    with pytest.raises(KVManagerError):
        manager.step(StepInput("w", accepted=[("s", 3)]))
    with pytest.raises(KVManagerError):
        manager.step(StepInput("w", appended=[("s", [5])], accepted=[]))   # a known token after proposals
    step(manager, accepted=[("s", 2)], appended=[("s", [5])], proposed=[("s", [6])], running=["s"])
    step(manager, accepted=[("s", 0)], finished=["s"])


def test_a_pending_token_resolved_in_the_same_step_may_be_followed_by_proposals():
    """Overlapped scheduling: a step whose ids were read at once resolves the step before it
    and appends its own token; proposals may follow in that step's input (values go first),
    but not while a token is still pending."""
    from pagedserve.kvmanager import PENDING_TOKEN

    manager, bm = make_manager()
    start(manager, "s", list(range(10, 17)))
    step(manager, appended=[("s", [PENDING_TOKEN])], running=["s"])      # launched: its id on the device
    with pytest.raises(KVManagerError, match="all known and settled"):
        manager.step(StepInput("w", proposed=[("s", [1, 2])], running=["s"]))
    step(manager, resolved=[("s", [42])], appended=[("s", [43])], proposed=[("s", [1, 2])], running=["s"])
    seq = bm.seqs["s"]
    assert seq.token_ids[-4:] == [42, 43, 1, 2] and seq.num_pending == 0 and seq.num_speculative == 2
    step(manager, accepted=[("s", 0)], finished=["s"])
    assert bm.device.num_used_blocks == 0


def test_the_step_round_trips_the_wire():
    step_input = StepInput("w", accepted=[("a", 2)], proposed=[("a", [1, 2, 3])])
    import msgpack

    assert from_wire(StepInput, msgpack.unpackb(msgpack.packb(to_wire(step_input)))) == step_input


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("allocation", ["paged", "contiguous"])
def test_random_proposals_and_rollbacks_leak_nothing(seed, allocation):
    """Sequences propose, verify what the budget lets them, accept a random prefix of it and
    append the target's token, under preemption (a small pool, swap and recompute), forks,
    finishes and prefix hits. The accounting holds after every step, every sequence's known
    tokens are exactly the ones it accepted, and nothing is held at the end."""
    rng = random.Random(seed)
    contiguous = allocation == "contiguous"
    manager, bm = make_manager(num_device=24 if not contiguous else 200, num_host=12, allocation=allocation,
                               enable_prefix_caching=not contiguous)
    truth: dict[str, list[int]] = {}    # each sequence's accepted tokens
    running: list[str] = []
    waiting: list[str] = []
    proposed: dict[str, int] = {}       # the last step's proposals, by sequence
    computed_to: dict[str, int] = {}    # where the last step's chunk of each sequence ended
    shared_prefix = [rng.randrange(5, 9) for _ in range(6)]
    counter = 0
    for _ in range(150):
        accepted, appended, finished, forks, proposals, new = [], [], [], [], [], []
        for seq_id, end in computed_to.items():
            known = len(truth[seq_id])
            if end < known:
                continue          # a prefill chunk short of the end: nothing sampled
            if seq_id in proposed:
                num = rng.randint(0, min(proposed[seq_id], end - known))
                accepted.append((seq_id, num))
                truth[seq_id] += bm.seqs[seq_id].token_ids[known:known + num]
            token = rng.randrange(5, 9)
            appended.append((seq_id, [token]))
            truth[seq_id].append(token)
        accepted += [(s, 0) for s in proposed if s not in computed_to and s in bm.seqs]
        settled = {s for s, _ in accepted} | {s for s, _ in appended}
        for seq_id in list(running):
            if len(truth[seq_id]) > 200 or rng.random() < 0.04:
                running.remove(seq_id)
                finished.append(seq_id)
                del truth[seq_id]
        if rng.random() < 0.3 and len(truth) < 8:
            seq_id, counter = f"s{counter}", counter + 1
            prompt = shared_prefix + [rng.randrange(5, 9) for _ in range(rng.randrange(1, 10))]
            new.append(NewSequence(seq_id, prompt))
            truth[seq_id] = list(prompt)
            waiting.append(seq_id)
        if running and not contiguous and rng.random() < 0.2 and len(truth) < 8:
            parent = rng.choice(running)
            if parent not in settled and not bm.seqs[parent].num_speculative:
                child, counter = f"s{counter}", counter + 1
                forks.append((parent, child))
                truth[child] = list(truth[parent])
                running.append(child)
        proposed = {}
        for seq_id in running:
            seq = bm.seqs.get(seq_id)
            known = len(truth[seq_id])
            if (seq is not None and seq.location.value == "device" and seq.num_computed == known - 1
                    and known + 8 < 256 and rng.random() < 0.7):
                proposed[seq_id] = rng.randint(1, 7)
                proposals.append((seq_id, [rng.randrange(5, 9) for _ in range(proposed[seq_id])]))
        out = step(manager, new_sequences=new, forks=forks, accepted=accepted, appended=appended,
                   finished=finished, proposed=proposals, running=list(running), waiting=list(waiting),
                   token_budget=rng.choice([4, 8, 64]))
        for preemption in out.preempted:
            running.remove(preemption.seq_id)
            waiting.append(preemption.seq_id)
            proposed.pop(preemption.seq_id, None)
        computed_to = {}
        for sched in out.scheduled:
            computed_to[sched.seq_id] = sched.start + sched.num_tokens
            if sched.seq_id in waiting:
                waiting.remove(sched.seq_id)
                running.append(sched.seq_id)
        for seq_id, tokens in truth.items():
            seq = bm.seqs[seq_id]
            assert seq.token_ids == tokens + (proposals and dict(proposals).get(seq_id, [])
                                              if seq.num_speculative else [])
    step(manager, accepted=[(s, 0) for s in proposed], finished=list(truth))
    assert bm.device.num_used_blocks == 0 and bm.host.num_used_blocks == 0


# ---- a hypothesis state machine ---------------------------------------------------------------

from hypothesis import HealthCheck, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule  # noqa: E402

SHARED = [5, 6, 7, 8, 5, 6]   # a prefix many prompts start with: prefix hits


class SpeculationMachine(RuleBasedStateMachine):
    """A tiny engine on a small pool (device and host tiers, swap or recompute preemption, prefix
    caching). Each step accepts a random number of the proposals the last step verified, appends
    the target's token, finishes, aborts and forks sequences, and proposes anew. After every step
    the manager's integrity check passes and each sequence's tokens are exactly what it accepted
    (plus the proposals in flight); at the end no block is held."""

    def __init__(self) -> None:
        super().__init__()
        self.manager: KVManager | None = None
        self.truth: dict[str, list[int]] = {}      # accepted tokens, by sequence
        self.running: list[str] = []
        self.waiting: list[str] = []
        self.proposed: dict[str, list[int]] = {}   # the proposals the last step got, by sequence
        self.computed_to: dict[str, int] = {}      # where the last step's chunk of each ended
        self.new: list[NewSequence] = []
        self.num_created = 0

    def _name(self) -> str:
        self.num_created += 1
        return f"s{self.num_created - 1}"

    @precondition(lambda self: self.manager is None)
    @rule(num_device=st.integers(10, 28), num_host=st.integers(0, 12),
          mode=st.sampled_from([None, "swap", "recompute"]))
    def configure(self, num_device, num_host, mode) -> None:
        self.manager = KVManager()
        self.manager.add_worker("w", PoolConfig(num_device_blocks=num_device, num_host_blocks=num_host, block_size=BS,
                                                max_model_len=256, watermark=0.0, preemption_mode=mode))
        self.bm = self.manager.block_manager("w")

    @precondition(lambda self: self.manager is not None and len(self.truth) < 8)
    @rule(suffix=st.lists(st.integers(5, 8), min_size=1, max_size=10), shared=st.booleans())
    def add(self, suffix, shared) -> None:
        seq_id = self._name()
        prompt = (SHARED if shared else []) + suffix
        self.new.append(NewSequence(seq_id, prompt))
        self.truth[seq_id] = list(prompt)
        self.waiting.append(seq_id)

    @precondition(lambda self: self.manager is not None)
    @rule(data=st.data(), budget=st.sampled_from([4, 8, 64]))
    def step(self, data, budget) -> None:
        accepted, appended, finished, forks, proposals = [], [], [], [], []
        for seq_id, end in self.computed_to.items():
            known = len(self.truth[seq_id])
            if end < known:
                continue       # a prefill chunk short of the end: nothing sampled
            if seq_id in self.proposed:
                num = data.draw(st.integers(0, min(len(self.proposed[seq_id]), end - known)), label="accepted")
                accepted.append((seq_id, num))
                self.truth[seq_id] += self.proposed[seq_id][:num]
            token = data.draw(st.integers(5, 8), label="target's token")
            appended.append((seq_id, [token]))
            self.truth[seq_id].append(token)
        # Proposals the last step did not verify (budget cut, preempted) are dropped: none kept.
        accepted += [(s, 0) for s in self.proposed if s not in self.computed_to and s in self.bm.seqs]
        settled = {s for s, _ in accepted} | {s for s, _ in appended}
        new_ids = {n.seq_id for n in self.new}
        for seq_id in list(self.running) + [s for s in self.waiting if s not in new_ids]:
            if len(self.truth[seq_id]) > 200 or data.draw(st.integers(0, 24), label="ends") == 0:
                (self.running if seq_id in self.running else self.waiting).remove(seq_id)
                finished.append(seq_id)    # a finish, or a waiting sequence's abort
                del self.truth[seq_id]
        for parent in list(self.running):
            if (len(self.truth) < 8 and parent not in settled and not self.bm.seqs[parent].num_speculative
                    and data.draw(st.integers(0, 9), label="forks") == 0):
                child = self._name()
                forks.append((parent, child))
                self.truth[child] = list(self.truth[parent])
                self.running.append(child)
        self.proposed = {}
        for seq_id in self.running:
            seq = self.bm.seqs.get(seq_id)
            known = len(self.truth[seq_id])
            if (seq is not None and seq.location.value == "device" and seq.num_computed == known - 1
                    and known + 8 < 256 and data.draw(st.booleans(), label="proposes")):
                tokens = data.draw(st.lists(st.integers(5, 8), min_size=1, max_size=7), label="proposal")
                self.proposed[seq_id] = tokens
                proposals.append((seq_id, tokens))
        out = self.manager.step(StepInput("w", new_sequences=self.new, forks=forks, accepted=accepted,
                                          appended=appended, finished=finished, proposed=proposals,
                                          running=list(self.running), waiting=list(self.waiting),
                                          token_budget=budget))
        self.new = []
        for preemption in out.preempted:
            self.running.remove(preemption.seq_id)
            self.waiting.append(preemption.seq_id)
            self.proposed.pop(preemption.seq_id, None)
        self.computed_to = {}
        for sched in out.scheduled:
            self.computed_to[sched.seq_id] = sched.start + sched.num_tokens
            if sched.seq_id in self.waiting:
                self.waiting.remove(sched.seq_id)
                self.running.append(sched.seq_id)

    @invariant()
    def accounting_holds_and_tokens_are_the_accepted_ones(self) -> None:
        if self.manager is None:
            return
        self.manager.check_integrity()
        new_ids = {n.seq_id for n in self.new}
        for seq_id, tokens in self.truth.items():
            if seq_id not in new_ids:
                seq = self.bm.seqs[seq_id]
                assert seq.token_ids == tokens + (self.proposed.get(seq_id, []) if seq.num_speculative else [])

    def teardown(self) -> None:
        if self.manager is None:
            return
        self.manager.step(StepInput("w", new_sequences=self.new,
                                    accepted=[(s, 0) for s in self.proposed if s in self.bm.seqs]))
        self.manager.step(StepInput("w", finished=list(self.truth)))
        self.manager.check_integrity()
        assert self.bm.device.num_used_blocks == 0 and self.bm.host.num_used_blocks == 0


SpeculationMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None,
                                                suppress_health_check=[HealthCheck.too_slow])
TestSpeculationStateful = SpeculationMachine.TestCase
