"""A model's adapters: which are known, which are read into host memory, which hold slots,
and the step's segments that its adapted layers read."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import OrderedDict
from typing import Callable, Iterator, Sequence

from .adapted_layers import AdaptedLayers
from .adapter_pages import AdapterImage, AdapterPages
from .follower import LoRAUpdate
from .lora_request import LoRARequest
from .peft_adapter import LoRAAdapter, LoRAAdapterError
from .slots import SlotTable

logger = logging.getLogger(__name__)


class LoRAManager:
    """Adapters of a model, whose linear layers ``layers`` are (``AdaptedLayers``: slots of
    ``max_loras`` adapters of rank up to ``max_lora_rank``).

    ``add`` checks a request's adapter and reads it into host memory (any thread);
    ``run_step`` (the engine's thread) puts the step's adapters into slots and sets the
    segments the layers read during the forward. At most ``max_cpu_loras`` adapters stay
    in host memory: past that, the least recently used ones that no unfinished request
    uses (``in_use()``, their ids) are dropped, read again if asked for again.

    On rank 0 of a tensor-parallel group ``publish`` hands each step's decisions (a
    ``LoRAUpdate``: host copies dropped, slots written, the chunks' slots) to the other
    ranks, whose ``LoRAFollower`` mirror them on their own cuts of the layers.

    With unified paging (``use_pages``) the slots' weights live in pages of the KV pool:
    the host copies are packed page images, the scheduler's ``admit`` brings a waiting
    sequence's adapter into pages (or keeps the sequence waiting), ``relieve`` gives idle
    adapters' pages back when the KV needs them, and a slot only points its layers' page
    tables at its adapter's pages.
    """

    def __init__(self, layers: AdaptedLayers, max_cpu_loras: int, in_use: Callable[[], set[int]],
                 publish: Callable[[LoRAUpdate], None] | None = None) -> None:
        self.layers = layers
        self.max_loras = layers.max_loras
        self.max_lora_rank = layers.max_lora_rank
        self.max_cpu_loras = max_cpu_loras
        self.context = layers.context
        self._in_use = in_use
        self._publish = publish
        self.slots = SlotTable(layers.max_loras)
        self._lock = threading.Lock()     # the registry and the host cache, shared with request threads
        self._known: dict[int, LoRARequest] = {}
        self._id_of_name: dict[str, int] = {}
        self._host: OrderedDict[int, LoRAAdapter] = OrderedDict()
        self._dropped: list[int] = []     # host copies dropped since the last update (with ``publish``)
        self._page_moves: list[tuple[int, LoRARequest | None, list[int]]] = []   # likewise, pages
        self.pages: AdapterPages | None = None
        self._paged: frozenset[int] = frozenset()   # ids in pages, for other threads to read
        self.num_reads = 0
        self.num_host_evictions = 0
        # Grows whenever the adapters held (in host memory or a slot) change: the worker reports them.
        self.residency_version = 0
        logger.info("LoRA: %d linear layers take adapters (max_loras %d, max_lora_rank %d, max_cpu_loras %d)",
                    len(layers), self.max_loras, self.max_lora_rank, max_cpu_loras)

    def use_pages(self, pages: AdapterPages) -> None:
        """Keep adapters in pages of the KV pool from now on (before any adapter is added)."""
        if self._known:
            raise RuntimeError("unified paging is set up before any adapter is added")
        self.layers.attach_pages(pages)
        pages.on_evict = self._left_pages
        pages.on_swap_in = self._entered_pages
        self.pages = pages

    # ---- requests ---------------------------------------------------------------------
    def add(self, request: LoRARequest) -> None:
        """Check ``request``'s adapter and have it in host memory; raises ``LoRAAdapterError``
        (a ValueError) naming the reason, changing nothing, if it cannot be served."""
        if not isinstance(request, LoRARequest):
            raise TypeError(f"lora_request must be a LoRARequest, got {type(request).__name__}")
        with self._lock:
            self._check_identity(request)
            if request.lora_int_id in self._host:
                self._host.move_to_end(request.lora_int_id)
                return
        adapter = self._read(request)
        with self._lock:
            self._check_identity(request)
            self._known[request.lora_int_id] = request
            self._id_of_name[request.lora_name] = request.lora_int_id
            self._host[request.lora_int_id] = adapter
            self.num_reads += 1
            self.residency_version += 1

    def _check_identity(self, request: LoRARequest) -> None:
        """One name and path per id for the engine's life (its slots and host copy are found by
        id); one id per name while that id is known (``remove`` forgets it)."""
        known = self._known.get(request.lora_int_id)
        if known is not None and known != request:
            raise LoRAAdapterError(f"lora_int_id {request.lora_int_id} is adapter {known.lora_name!r} at "
                                   f"{known.lora_path}; this request names {request.lora_name!r} at {request.lora_path}")
        known_id = self._id_of_name.get(request.lora_name)
        if known_id is not None and known_id != request.lora_int_id:
            raise LoRAAdapterError(f"lora_name {request.lora_name!r} is lora_int_id {known_id}; "
                                   f"this request gives lora_int_id {request.lora_int_id}")

    def remove(self, lora_int_id: int) -> bool:
        """Forget adapter ``lora_int_id`` (vLLM's ``remove_lora``): its host copy is dropped and
        its name may take another id, its slot is free. False if unknown, or while an unfinished
        request uses it (it stays, and the host cache's LRU drops it once unused). The engine's
        thread only: between steps."""
        if lora_int_id in self._in_use():
            return False
        with self._lock:
            request = self._known.pop(lora_int_id, None)
            if request is None:
                return False
            self._drop_host(lora_int_id)
            if self._id_of_name.get(request.lora_name) == lora_int_id:
                del self._id_of_name[request.lora_name]
            self.residency_version += 1
        self.slots.release(lora_int_id)
        if self.pages is not None:
            self.pages.evict(lora_int_id)
        return True

    def resident_keys(self) -> list[str]:
        """The ``cache_key`` of every adapter held, in host memory, a slot or pages."""
        with self._lock:
            ids = set(self._host) | set(self.slots.resident) | self._paged
            return sorted(self._known[i].cache_key for i in ids if i in self._known)

    def list(self) -> list[LoRARequest]:
        """The adapters known (added and not removed), in the order they were first added."""
        with self._lock:
            return list(self._known.values())

    def _read(self, request: LoRARequest) -> LoRAAdapter | AdapterImage:
        """The adapter's host copy: as read, or with unified paging packed as its pages hold it."""
        adapter = self.layers.read(request)
        logger.info("LoRA adapter %r read: rank %d, scaling %g, %d layers, %.1f MiB", request.lora_name,
                    adapter.rank, adapter.scaling, len(adapter.weights), adapter.num_bytes / 2**20)
        if self.pages is None:
            return adapter
        return self.pages.pack(adapter, self.layers.layer_of)

    def _host_copy(self, adapter_id: int) -> LoRAAdapter | AdapterImage:
        """The adapter's host copy, read again if it was dropped."""
        with self._lock:
            adapter = self._host.get(adapter_id)
            request = self._known[adapter_id]
        if adapter is None:
            adapter = self._read(request)
            with self._lock:
                self._host[adapter_id] = adapter
                self.num_reads += 1
        return adapter

    # ---- unified paging: the scheduler's side --------------------------------------------
    def admit(self, request: LoRARequest, protected: set[int]) -> bool:
        """Whether a waiting sequence of ``request``'s adapter may be admitted now: always with
        slots; with pages, once the adapter holds pages (brought in now if need be, evicting
        idle adapters, never those in ``protected``: the running and admitted sequences')."""
        if self.pages is None or self.pages.touch(request.lora_int_id):
            return True
        adapter_id = request.lora_int_id
        return self.pages.swap_in(adapter_id, self._host_copy(adapter_id), protected) is not None

    def relieve(self, num_pages: int, protected: set[int]) -> None:
        """Give idle adapters' pages back until the pool can lend ``num_pages`` (the KV of a
        sequence that could not be admitted or was preempted needs them)."""
        if self.pages is not None:
            self.pages.relieve(num_pages, protected)

    def _entered_pages(self, adapter_id: int, pages: list[int]) -> None:
        """An adapter came into pages: the other ranks and the worker's report follow."""
        if self._publish is not None:
            with self._lock:
                self._page_moves.append((adapter_id, self._known[adapter_id], pages))
        self._paged = frozenset(self.pages.resident)
        self.residency_version += 1

    def _left_pages(self, adapter_id: int) -> None:
        """An adapter left its pages: its slot's tables point at pages given back."""
        if self._publish is not None:
            with self._lock:
                self._page_moves.append((adapter_id, None, []))
        self.slots.release(adapter_id)
        self._paged = frozenset(self.pages.resident)
        self.residency_version += 1

    # ---- steps --------------------------------------------------------------------------
    @contextlib.contextmanager
    def run_step(self, adapters: Sequence[LoRARequest | None], num_tokens: Sequence[int] | None) -> Iterator[None]:
        """Within it, the model computes chunk ``i`` (``num_tokens[i]`` tokens; None: one each)
        with adapter ``adapters[i]`` (None: the base model). At most ``max_loras`` distinct
        adapters, each ``add``-ed first."""
        ids = [0 if lora is None else lora.lora_int_id for lora in adapters]
        distinct = set(ids) - {0}
        if not distinct:
            self._publish_step([], None)
            yield
            return
        slot_of, loads = self.slots.assign(distinct)
        written = [(slot, self._load(adapter_id, slot)) for adapter_id, slot in loads]
        if loads:
            self.residency_version += 1
        self._evict_host()
        slot_of[0] = -1
        chunk_slots = [slot_of[i] for i in ids]
        self._publish_step(written, chunk_slots)
        with self.layers.step(chunk_slots, num_tokens):
            yield

    def _load(self, adapter_id: int, slot: int) -> LoRARequest:
        """Write the adapter's weights into ``slot`` of every layer (with pages: point the slot at
        its pages); returns its request."""
        with self._lock:
            request = self._known[adapter_id]
        if self.pages is None:
            self.layers.write(slot, self._host_copy(adapter_id))
            return request
        resident = self.pages.resident.get(adapter_id)
        if resident is None:
            raise RuntimeError(f"LoRA adapter {request.lora_name!r} runs in a step but holds no pages: "
                               "its sequence was admitted without LoRAManager.admit")
        self.layers.write_pieces(slot, resident)
        return request

    def _evict_host(self) -> None:
        with self._lock:
            if len(self._host) <= self.max_cpu_loras:
                return
        in_use = self._in_use()
        with self._lock:
            for adapter_id in [a for a in self._host if a not in in_use]:
                if len(self._host) <= self.max_cpu_loras:
                    break
                self._drop_host(adapter_id)
                self.num_host_evictions += 1
                self.residency_version += 1

    def _drop_host(self, adapter_id: int) -> None:
        """Drop a host copy (under the lock); the followers drop theirs with the next update."""
        if self._host.pop(adapter_id, None) is not None and self._publish is not None:
            self._dropped.append(adapter_id)

    def _publish_step(self, loads: list[tuple[int, LoRARequest]], chunk_slots: list[int] | None) -> None:
        if self._publish is None:
            return
        with self._lock:
            dropped, self._dropped = self._dropped, []
            page_moves, self._page_moves = self._page_moves, []
        if dropped or loads or chunk_slots is not None or page_moves:
            self._publish(LoRAUpdate(dropped, loads, chunk_slots, page_moves))

    # ---- introspection -------------------------------------------------------------------
    def stats(self) -> dict:
        with self._lock:
            num_host = len(self._host)
            names = {adapter_id: request.lora_name for adapter_id, request in self._known.items()}
        by_slot = [None] * self.max_loras
        for adapter_id, slot in self.slots.resident.items():
            by_slot[slot] = names[adapter_id]
        paged = {}
        if self.pages is not None:
            # Other threads read this: the engine thread's snapshot of the adapters in pages, not the LRU itself.
            paged = {"adapter_pages": self.pages.num_pages,
                     "paged_adapters": sorted(names[a] for a in self._paged if a in names),
                     "num_page_swap_ins": self.pages.num_swap_ins, "num_page_evictions": self.pages.num_evictions,
                     "bytes_per_page": self.pages.geometry.bytes_per_page}
        return {"lora_paging": "unified" if self.pages is not None else "slots", **paged, "slot_adapters": by_slot,
                "num_host_adapters": num_host, "num_adapter_reads": self.num_reads,
                "num_slot_loads": self.slots.num_loads, "num_slot_evictions": self.slots.num_evictions,
                "num_host_evictions": self.num_host_evictions,
                "num_layers_allocated": self.layers.num_allocated}
