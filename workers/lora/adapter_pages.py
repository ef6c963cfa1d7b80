"""LoRA adapters in pages of the KV cache pool: S-LoRA's unified paging.

An adapter's weights take device blocks of the same pool as the sequences' KV: one page
is one block id, across every layer. In layer ``L``'s key cache the page holds A's
rank-rows of layer ``L``'s adapted linears, in its value cache B's, each row cut into
pieces of ``piece`` elements (``kernels.lora_pages``). An adapter takes as many pages as
its widest layer needs at its own rank, so a rank-8 adapter takes half the pages of a
rank-16 one.

``AdapterPages`` keeps adapters in pages, least recently used first. An adapter comes in
through the KV swap path (``kernels.swap_blocks`` from its packed host image, as swapped
KV blocks come back from the host pool) and leaves by giving its pages back to the pool:
its image stays in host memory, its weights never change, so nothing is copied out. An
adapter that a running sequence uses never leaves.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from pagedserve import kernels
from pagedserve.kernels.lora_pages import PagedLoRAWeights, piece_size

from ..model.host_lists import int64_tensor
from ..model.kv_cache import CacheShape, KVCache
from .peft_adapter import LoRAAdapter, LoRAAdapterError


class PagePool(Protocol):
    """The device pool's lending side (``kvmanager.BlockManager``)."""

    @property
    def max_lendable_pages(self) -> int: ...

    @property
    def num_lendable_pages(self) -> int: ...

    def reserve_pages(self, owner: str, num_pages: int) -> list[int]: ...

    def release_pages(self, owner: str) -> int: ...


@dataclass(frozen=True)
class PageGeometry:
    """How a page holds adapter weights: ``chunk`` elements in each layer's key and value
    cache, cut into pieces of ``piece``."""

    num_layers: int
    chunk: int
    piece: int
    element_size: int

    @property
    def pieces_per_page(self) -> int:
        return self.chunk // self.piece

    @property
    def bytes_per_page(self) -> int:
        return 2 * self.num_layers * self.chunk * self.element_size


def page_geometry(shape: CacheShape, min_features: int) -> PageGeometry:
    """The pages of a KV cache of ``shape`` for weight rows of at least ``min_features``
    elements; ValueError if its blocks cannot be cut in pieces."""
    chunk = shape.block_size * shape.num_kv_heads * shape.head_dim
    piece = piece_size(chunk, min_features)
    if piece is None:
        raise ValueError(f"lora_paging \"unified\" needs a block of one layer's keys (block_size {shape.block_size} "
                         f"x {shape.num_kv_heads} KV heads x head_dim {shape.head_dim} = {chunk} elements) to be "
                         "a multiple of 16 elements: raise block_size or use lora_paging \"slots\"")
    return PageGeometry(shape.num_layers, chunk, piece, torch.empty((), dtype=shape.dtype).element_size())


@dataclass
class AdapterImage:
    """An adapter packed as its pages will hold it, in host memory: per layer ``keys`` and
    ``values`` ``[num_pages, *block]``, and each adapted linear's (A's, B's) piece indices
    ``[rank, pieces]`` counted from the first page."""

    name: str
    rank: int
    num_pages: int
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    pieces: dict[str, tuple[torch.Tensor, torch.Tensor]]

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)


def pack_adapter(adapter: LoRAAdapter, layer_of: dict[str, int], geometry: PageGeometry, block: tuple[int, ...],
                 pin: bool) -> AdapterImage:
    """``adapter``'s weights (by linear name; ``layer_of``: each name's decoder layer) laid
    out in pages of ``geometry`` (blocks of shape ``block``), at the adapter's own rank."""
    piece = geometry.piece
    cursors = {}                       # layer -> (next A piece, next B piece)
    placed = {}                        # name -> (first A piece, first B piece)
    for name in sorted(adapter.weights):
        a, b_t = adapter.weights[name]
        layer = layer_of[name]
        next_a, next_b = cursors.get(layer, (0, 0))
        placed[name] = (next_a, next_b)
        cursors[layer] = (next_a + a.shape[0] * -(-a.shape[1] // piece),
                          next_b + b_t.shape[0] * -(-b_t.shape[1] // piece))
    widest = max((max(cursor) for cursor in cursors.values()), default=0)
    num_pages = max(1, -(-widest // geometry.pieces_per_page))
    dtype = next(iter(adapter.weights.values()))[0].dtype if adapter.weights else torch.float32
    flat = [(torch.zeros(num_pages * geometry.chunk, dtype=dtype), torch.zeros(num_pages * geometry.chunk, dtype=dtype))
            for _ in range(geometry.num_layers)]
    pieces = {}
    for name, (first_a, first_b) in placed.items():
        a, b_t = adapter.weights[name]
        keys, values = flat[layer_of[name]]
        pieces[name] = (_place(keys, a, first_a, piece), _place(values, b_t, first_b, piece))
    keys = [k.view(num_pages, *block) for k, _ in flat]
    values = [v.view(num_pages, *block) for _, v in flat]
    if pin:
        keys, values = [k.pin_memory() for k in keys], [v.pin_memory() for v in values]
    return AdapterImage(adapter.request.lora_name, adapter.rank, num_pages, keys, values, pieces)


def _place(flat: torch.Tensor, rows: torch.Tensor, first: int, piece: int) -> torch.Tensor:
    """Write ``rows`` ``[rank, features]`` into ``flat`` from piece ``first`` on, each row in
    ``ceil(features / piece)`` whole pieces; returns their piece indices ``[rank, pieces]``."""
    rank, features = rows.shape
    per_row = -(-features // piece)
    padded = torch.nn.functional.pad(rows, (0, per_row * piece - features))
    flat[first * piece:(first + rank * per_row) * piece] = padded.reshape(-1).to(flat.dtype)
    return torch.arange(first, first + rank * per_row, dtype=torch.int64).view(rank, per_row)


@dataclass
class ResidentAdapter:
    """An adapter in pages: its page ids and each linear's absolute (A, B) piece indices."""

    adapter_id: int
    pages: list[int]
    pieces: dict[str, tuple[torch.Tensor, torch.Tensor]]


class PagedAdapters:
    """Adapters in pages of ``cache`` (a KV cache; ``zero_page``: a block of it kept zero): how
    they are packed, written into given pages and read (``weights``). ``min_features``: the
    adapted linears' narrowest input or output. ``AdapterPages`` decides which pages; on a
    tensor-parallel group's other ranks ``PagesMirror`` follows rank 0's decisions."""

    def __init__(self, cache: KVCache, min_features: int, zero_page: int) -> None:
        self.cache = cache
        self.geometry = page_geometry(cache.shape, min_features)
        self.min_features = min_features
        self.block = (cache.shape.block_size, cache.shape.num_kv_heads, cache.shape.head_dim)
        self.zero_page = zero_page
        for k_cache, v_cache in cache.device_caches:
            k_cache[zero_page].zero_()
            v_cache[zero_page].zero_()
        self.resident: OrderedDict[int, ResidentAdapter] = OrderedDict()
        self.num_pages = 0            # pages the adapters hold (the zero page not counted)
        self.num_swap_ins = 0

    @property
    def zero_piece(self) -> int:
        return self.zero_page * self.geometry.pieces_per_page

    def pack(self, adapter: LoRAAdapter, layer_of: dict[str, int]) -> AdapterImage:
        """``adapter`` packed as its pages will hold it."""
        return pack_adapter(adapter, layer_of, self.geometry, self.block, pin=self.cache.device.type == "cuda")

    def _write(self, adapter_id: int, image: AdapterImage, pages: list[int]) -> ResidentAdapter:
        """Swap ``image`` into ``pages`` (the KV swap path) and hold it there."""
        pairs = torch.tensor([[i, page] for i, page in enumerate(pages)], dtype=torch.int64)
        for (k_cache, v_cache), keys, values in zip(self.cache.device_caches, image.keys, image.values):
            kernels.swap_blocks(keys, k_cache, pairs)
            kernels.swap_blocks(values, v_cache, pairs)
        per_page = self.geometry.pieces_per_page
        page_ids = int64_tensor(pages)

        def absolute(relative: torch.Tensor) -> torch.Tensor:
            return (page_ids[relative // per_page] * per_page + relative % per_page).to(torch.int32)

        resident = ResidentAdapter(adapter_id, pages, {name: (absolute(a), absolute(b))
                                                       for name, (a, b) in image.pieces.items()})
        self.resident[adapter_id] = resident
        self.num_pages += len(pages)
        self.num_swap_ins += 1
        self.cache.num_bytes_swapped_in += image.num_bytes
        return resident

    def _forget(self, adapter_id: int) -> ResidentAdapter | None:
        resident = self.resident.pop(adapter_id, None)
        if resident is not None:
            self.num_pages -= len(resident.pages)
        return resident

    def weights(self, storage_layer: int, num_slots: int, max_rank: int, in_features: int,
                out_features: int) -> tuple[PagedLoRAWeights, PagedLoRAWeights]:
        """A linear's (A, B) weights of ``num_slots`` slots in pages of layer ``storage_layer``:
        tables pointing every row at the zero piece."""
        k_cache, v_cache = self.cache.device_caches[storage_layer]
        piece = self.geometry.piece

        def table(features: int) -> torch.Tensor:
            return torch.full((num_slots, max_rank, -(-features // piece)), self.zero_piece, dtype=torch.int32,
                              device=k_cache.device)

        return (PagedLoRAWeights(k_cache.view(-1), table(in_features), piece, in_features),
                PagedLoRAWeights(v_cache.view(-1), table(out_features), piece, out_features))


class PagesMirror(PagedAdapters):
    """A tensor-parallel rank's adapters in pages: rank 0's ``AdapterPages`` picks the block ids
    and this rank writes its own cut of each adapter into the same blocks of its own KV cache
    (every rank's cut and cache have the same shapes, so the layouts agree)."""

    def swap_in(self, adapter_id: int, image: AdapterImage, pages: list[int]) -> ResidentAdapter:
        if image.num_pages != len(pages):
            raise RuntimeError(f"LoRA adapter {image.name!r}: this rank's cut takes {image.num_pages} pages, "
                               f"rank 0 gave it {len(pages)}")
        return self._write(adapter_id, image, pages)

    def evict(self, adapter_id: int) -> None:
        self._forget(adapter_id)


class AdapterPages(PagedAdapters):
    """Adapters held in pages of ``pool`` (the KV manager's device pool), whose memory is
    ``cache``'s (the runner's KV cache; rank 0's on a tensor-parallel group), least recently
    used first. One page of zeros is lent at creation: rows past an adapter's rank and
    linears it does not adapt read it. ``sequence_blocks``: the blocks of a sequence of the
    longest context, which must fit beside any adapter."""

    def __init__(self, pool: PagePool, cache: KVCache, min_features: int, sequence_blocks: int) -> None:
        super().__init__(cache, min_features, pool.reserve_pages("lora:zeros", 1)[0])
        self.pool = pool
        self.sequence_blocks = sequence_blocks
        # Called with an adapter's id when it leaves its pages (its slot's tables are stale).
        self.on_evict: Callable[[int], None] | None = None
        # Called with an adapter's id and pages when it comes into them.
        self.on_swap_in: Callable[[int, list[int]], None] | None = None
        self.num_evictions = 0

    def pack(self, adapter: LoRAAdapter, layer_of: dict[str, int]) -> AdapterImage:
        """``adapter`` packed as its pages will hold it; ``LoRAAdapterError`` if its pages and a
        sequence of the longest context could never fit in the pool together (its requests
        would wait for ever)."""
        image = super().pack(adapter, layer_of)
        room = self.pool.max_lendable_pages - 1 - self.sequence_blocks   # the zero page, a sequence
        if image.num_pages > room:
            raise LoRAAdapterError(
                f"LoRA adapter {image.name!r} (rank {image.rank}) needs {image.num_pages} pages of the KV pool "
                f"({image.num_pages * self.geometry.bytes_per_page / 2**20:.1f} MiB); beside a sequence of "
                f"max_model_len the pool lends at most {max(room, 0)}: raise the KV budget, lower max_model_len, "
                "or use lora_paging \"slots\"")
        return image

    def touch(self, adapter_id: int) -> bool:
        """Mark ``adapter_id`` most recently used; False if it holds no pages."""
        if adapter_id not in self.resident:
            return False
        self.resident.move_to_end(adapter_id)
        return True

    def swap_in(self, adapter_id: int, image: AdapterImage, protected: set[int]) -> ResidentAdapter | None:
        """Bring ``image`` into pages, evicting adapters not in ``protected`` (least recently used
        first) as needed; None, changing nothing, if the pool cannot lend its pages even then."""
        protected = protected | {adapter_id}
        evictable = sum(len(r.pages) for a, r in self.resident.items() if a not in protected)
        if self.pool.num_lendable_pages + evictable < image.num_pages:
            return None
        self.relieve(image.num_pages, protected)
        pages = self.pool.reserve_pages(_owner(adapter_id), image.num_pages)
        resident = self._write(adapter_id, image, pages)
        if self.on_swap_in is not None:
            self.on_swap_in(adapter_id, pages)
        return resident

    def evict(self, adapter_id: int) -> bool:
        """Give ``adapter_id``'s pages back to the pool; False if it holds none."""
        if self._forget(adapter_id) is None:
            return False
        self.pool.release_pages(_owner(adapter_id))
        self.num_evictions += 1
        if self.on_evict is not None:
            self.on_evict(adapter_id)
        return True

    def relieve(self, num_pages: int, protected: set[int]) -> list[int]:
        """Evict adapters not in ``protected``, least recently used first, until the pool can
        lend ``num_pages`` (or none is left to evict): for another adapter, or for the KV of a
        waiting or preempted sequence. Returns their ids."""
        free_pages = self.pool.num_lendable_pages
        evicted = []
        while free_pages < num_pages:
            victim = next((a for a in self.resident if a not in protected), None)
            if victim is None:
                break
            free_pages += len(self.resident[victim].pages)
            self.evict(victim)
            evicted.append(victim)
        return evicted


def _owner(adapter_id: int) -> str:
    return f"lora:{adapter_id}"
