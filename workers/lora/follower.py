"""The adapters of a tensor-parallel group's ranks 1 and up: rank 0's ``LoRAManager`` decides
(which adapter in which slot, which host copies to drop, each step's slots; with unified
paging which adapter in which pages) and hands every step's decisions over as a
``LoRAUpdate``; a ``LoRAFollower`` applies them to its rank's layers, reading each adapter
itself from its path (which must exist on every node, as the model's does) into a host cache
that mirrors rank 0's."""

from __future__ import annotations

import contextlib
import logging
import socket
from dataclasses import dataclass, field
from typing import Iterator, Sequence

from .adapted_layers import AdaptedLayers
from .adapter_pages import PagesMirror
from .lora_request import LoRARequest
from .peft_adapter import LoRAAdapter, LoRAAdapterError

logger = logging.getLogger(__name__)


@dataclass
class LoRAUpdate:
    """What changed in rank 0's adapters for one step, in the order to apply it: ``dropped``,
    the adapter ids whose host copies went (removed or evicted) since the last update; then
    with unified paging ``pages``, in order, each adapter that came into pages (id, request,
    its page ids) or left them (id, None, []); then ``loads``, the (slot, adapter) pairs
    written; then the step runs chunk ``i`` with the adapter in slot ``chunk_slots[i]`` (-1:
    the base model; None: no chunk uses an adapter)."""

    dropped: list[int] = field(default_factory=list)
    loads: list[tuple[int, LoRARequest]] = field(default_factory=list)
    chunk_slots: list[int] | None = None
    pages: list[tuple[int, LoRARequest | None, list[int]]] = field(default_factory=list)

    def then(self, later: "LoRAUpdate") -> "LoRAUpdate":
        """This update and ``later`` as one (``later``'s step)."""
        return LoRAUpdate(self.dropped + later.dropped, self.loads + later.loads, later.chunk_slots,
                          self.pages + later.pages)


class LoRAFollower:
    """One rank's adapters, as rank 0's ``LoRAManager`` says: ``apply`` an update's drops and
    loads, then run the step's forward inside ``step``."""

    def __init__(self, layers: AdaptedLayers) -> None:
        self.layers = layers
        self._host: dict[int, LoRAAdapter] = {}    # rank 0's host copies this rank has read
        self.pages: PagesMirror | None = None

    def use_pages(self, pages: PagesMirror) -> None:
        """Unified paging: the slots read adapters from pages of this rank's KV cache."""
        self.layers.attach_pages(pages)
        self.pages = pages

    def apply(self, update: LoRAUpdate) -> None:
        for adapter_id in update.dropped:
            self._host.pop(adapter_id, None)
        for adapter_id, request, pages in update.pages:
            if request is None:
                self.pages.evict(adapter_id)
            else:
                self.pages.swap_in(adapter_id, self.pages.pack(self._adapter(request), self.layers.layer_of), pages)
        for slot, request in update.loads:
            if self.pages is not None:
                self.layers.write_pieces(slot, self.pages.resident[request.lora_int_id])
            else:
                self.layers.write(slot, self._adapter(request))

    def _adapter(self, request: LoRARequest) -> LoRAAdapter:
        """``request``'s adapter from this rank's host cache, read if it is not there."""
        adapter = self._host.get(request.lora_int_id)
        if adapter is None:
            adapter = self._read(request)
            self._host[request.lora_int_id] = adapter
        return adapter

    @contextlib.contextmanager
    def step(self, update: LoRAUpdate | None, num_tokens: Sequence[int] | None) -> Iterator[None]:
        """Within it, the forward of the step ``update`` came with (None: no adapter)."""
        if update is None or update.chunk_slots is None:
            yield
            return
        with self.layers.step(update.chunk_slots, num_tokens):
            yield

    def _read(self, request: LoRARequest) -> LoRAAdapter:
        try:
            return self.layers.read(request)
        except LoRAAdapterError as exc:   # rank 0 read it: this node's copy differs or is missing
            raise LoRAAdapterError(f"on {socket.gethostname()}, a tensor-parallel rank: {exc} (every rank reads "
                                   "the adapter at the same path; rank 0's node has it)") from exc
