"""Property-based tests: random operation sequences against LoRA adapters in pages of the KV
pool (unified paging, ``workers/lora/adapter_pages.py``).

A hypothesis state machine swaps adapters of different ranks in and out of a small pool,
with some adapters protected (a running sequence uses them), lets other data (sequences'
KV) take and give back blocks, and asks for room (``relieve``). After every operation: the
pool's integrity check passes, its lent pages are exactly the adapters' pages, the page of
zeros and the other loans, no two adapters share a page, a protected adapter never left its
pages, and every resident adapter's weights read back through its piece tables exactly as
packed (nothing overwrote them), the page of zeros still zeros.
"""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedserve import LoRARequest
from pagedserve.kernels.lora_pages import PagedLoRAWeights
from pagedserve.kvmanager import BlockManager
from pagedserve.workers.lora.adapter_pages import AdapterPages
from pagedserve.workers.lora.peft_adapter import LoRAAdapter
from pagedserve.workers.model.kv_cache import CacheShape, KVCache

SHAPE = CacheShape(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float32)  # chunks of 64
FEATURES = {"layers.0.q": (24, 40), "layers.1.q": (24, 40), "layers.1.down": (40, 24)}
LAYER_OF = {"layers.0.q": 0, "layers.1.q": 1, "layers.1.down": 1}
# id -> (rank, targets): 1 to 8 pages each (any of them fits beside a sequence of 2 blocks).
ADAPTERS = {1: (1, ["layers.0.q"]), 2: (2, list(FEATURES)), 3: (4, ["layers.1.down"]), 4: (6, list(FEATURES)),
            5: (3, ["layers.0.q", "layers.1.q"])}


def random_adapter(adapter_id: int) -> LoRAAdapter:
    rank, targets = ADAPTERS[adapter_id]
    generator = torch.Generator().manual_seed(adapter_id)
    weights = {name: (torch.randn(rank, FEATURES[name][0], generator=generator) + 1,
                      torch.randn(rank, FEATURES[name][1], generator=generator) + 1) for name in targets}
    return LoRAAdapter(LoRARequest(f"a{adapter_id}", adapter_id, "/nowhere"), rank, 1.0, weights)


WEIGHTS = {adapter_id: random_adapter(adapter_id) for adapter_id in ADAPTERS}


class AdapterPagesMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loans: dict[str, list[int]] = {}

    @property
    def ready(self) -> bool:
        return hasattr(self, "pages")

    @precondition(lambda self: not self.ready)
    @rule(num_blocks=st.integers(11, 24))
    def configure(self, num_blocks) -> None:
        self.pool = BlockManager(num_blocks, block_size=4, watermark=0.0)
        self.cache = KVCache(SHAPE, num_blocks, 0, torch.device("cpu"))
        for k_cache, v_cache in self.cache.device_caches:   # what earlier sequences left there
            k_cache.fill_(float("nan"))
            v_cache.fill_(float("nan"))
        self.pages = AdapterPages(self.pool, self.cache, min_features=24, sequence_blocks=2)
        self.images = {adapter_id: self.pages.pack(adapter, LAYER_OF) for adapter_id, adapter in WEIGHTS.items()}
        self.evicted: list[int] = []
        self.pages.on_evict = self.evicted.append

    @precondition(lambda self: self.ready)
    @rule(adapter_id=st.sampled_from(sorted(ADAPTERS)), protect=st.sets(st.sampled_from(sorted(ADAPTERS))))
    def swap_in(self, adapter_id, protect) -> None:
        protected = protect & set(self.pages.resident) - {adapter_id}
        if adapter_id in self.pages.resident:
            assert self.pages.touch(adapter_id)
            return
        before = (list(self.pages.resident), self.pool.num_pages)
        self.evicted.clear()
        resident = self.pages.swap_in(adapter_id, self.images[adapter_id], protected)
        if resident is None:
            event("swap-in refused")
            assert (list(self.pages.resident), self.pool.num_pages) == before and not self.evicted
            return
        event("swap-in evicting" if self.evicted else "swap-in")
        assert not protected & set(self.evicted)
        assert list(self.pages.resident)[-1] == adapter_id and len(resident.pages) == self.images[adapter_id].num_pages

    @precondition(lambda self: self.ready)
    @rule(adapter_id=st.sampled_from(sorted(ADAPTERS)))
    def evict(self, adapter_id) -> None:
        was_resident = adapter_id in self.pages.resident
        assert self.pages.evict(adapter_id) == was_resident

    @precondition(lambda self: self.ready)
    @rule(num_pages=st.integers(1, 12), protect=st.sets(st.sampled_from(sorted(ADAPTERS))))
    def relieve(self, num_pages, protect) -> None:
        protected = protect & set(self.pages.resident)
        evicted = self.pages.relieve(num_pages, protected)
        assert not protected & set(evicted)
        if self.pool.num_lendable_pages < num_pages:
            assert set(self.pages.resident) <= protected   # every unprotected adapter gave its pages back
        if evicted:
            event("relieved")

    @precondition(lambda self: self.ready)
    @rule(owner=st.sampled_from(["kv:0", "kv:1"]), num_blocks=st.integers(1, 6))
    def other_data_takes_or_returns_blocks(self, owner, num_blocks) -> None:
        """Sequences' KV stands in as another borrower of the pool's blocks."""
        if owner in self.loans:
            self.pool.release_pages(owner)
            del self.loans[owner]
        elif num_blocks <= self.pool.num_lendable_pages:
            self.loans[owner] = self.pool.reserve_pages(owner, num_blocks)
            for k_cache, v_cache in self.cache.device_caches:   # the sequences write their KV there
                k_cache[self.loans[owner]] = 7.0
                v_cache[self.loans[owner]] = -7.0

    @invariant()
    def accounting_and_contents(self) -> None:
        if not self.ready:
            return
        self.pool.check_integrity()
        resident = self.pages.resident
        adapter_pages = [page for r in resident.values() for page in r.pages]
        assert len(adapter_pages) == len(set(adapter_pages)) == self.pages.num_pages
        loaned = {page for pages in self.loans.values() for page in pages}
        assert not loaned & set(adapter_pages) and self.pages.zero_page not in loaned | set(adapter_pages)
        assert self.pool.num_pages == self.pages.num_pages + 1 + len(loaned)
        for k_cache, v_cache in self.cache.device_caches:
            assert not k_cache[self.pages.zero_page].any() and not v_cache[self.pages.zero_page].any()
        piece = self.pages.geometry.piece
        for adapter_id, entry in resident.items():
            for name, (a, b_t) in WEIGHTS[adapter_id].weights.items():
                k_cache, v_cache = self.cache.device_caches[LAYER_OF[name]]
                a_pieces, b_pieces = entry.pieces[name]
                read_a = PagedLoRAWeights(k_cache.view(-1), a_pieces[None], piece, a.shape[1]).gather(None, 1)[0]
                read_b = PagedLoRAWeights(v_cache.view(-1), b_pieces[None], piece, b_t.shape[1]).gather(None, 1)[0]
                assert torch.equal(read_a, a) and torch.equal(read_b, b_t), (adapter_id, name)

    def teardown(self) -> None:
        if not self.ready:
            return
        for adapter_id in list(self.pages.resident):
            self.pages.evict(adapter_id)
        for owner in list(self.loans):
            self.pool.release_pages(owner)
        assert self.pool.num_pages == 1 and self.pool.device.num_used_blocks == 1   # the page of zeros
        self.pool.check_integrity()


AdapterPagesMachine.TestCase.settings = settings(
    max_examples=80, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestAdapterPagesStateful = AdapterPagesMachine.TestCase
