"""The adapters of a tensor-parallel group's ranks 1 and up: rank 0's ``LoRAManager`` decides
(which adapter in which slot, which host copies to drop, each step's slots) and hands every
step's decisions over as a ``LoRAUpdate``; a ``LoRAFollower`` applies them to its rank's
layers, reading each adapter itself from its path (which must exist on every node, as the
model's does) into a host cache that mirrors rank 0's."""

from __future__ import annotations

import contextlib
import logging
import socket
from dataclasses import dataclass, field
from typing import Iterator, Sequence

from .adapted_layers import AdaptedLayers
from .lora_request import LoRARequest
from .peft_adapter import LoRAAdapter, LoRAAdapterError

logger = logging.getLogger(__name__)


@dataclass
class LoRAUpdate:
    """What changed in rank 0's adapters for one step, in the order to apply it: ``dropped``,
    the adapter ids whose host copies went (removed or evicted) since the last update; then
    ``loads``, the (slot, adapter) pairs written; then the step runs chunk ``i`` with the
    adapter in slot ``chunk_slots[i]`` (-1: the base model; None: no chunk uses an adapter)."""

    dropped: list[int] = field(default_factory=list)
    loads: list[tuple[int, LoRARequest]] = field(default_factory=list)
    chunk_slots: list[int] | None = None

    def then(self, later: "LoRAUpdate") -> "LoRAUpdate":
        """This update and ``later`` as one (``later``'s step)."""
        return LoRAUpdate(self.dropped + later.dropped, self.loads + later.loads, later.chunk_slots)


class LoRAFollower:
    """One rank's adapters, as rank 0's ``LoRAManager`` says: ``apply`` an update's drops and
    loads, then run the step's forward inside ``step``."""

    def __init__(self, layers: AdaptedLayers) -> None:
        self.layers = layers
        self._host: dict[int, LoRAAdapter] = {}    # rank 0's host copies this rank has read

    def apply(self, update: LoRAUpdate) -> None:
        for adapter_id in update.dropped:
            self._host.pop(adapter_id, None)
        for slot, request in update.loads:
            adapter = self._host.get(request.lora_int_id)
            if adapter is None:
                adapter = self._read(request)
                self._host[request.lora_int_id] = adapter
            self.layers.write(slot, adapter)

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
