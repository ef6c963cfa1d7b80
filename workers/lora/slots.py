"""Which adapter holds which slot of the layers' slot tensors: least recently used first out."""

from __future__ import annotations

from collections import OrderedDict


class SlotTable:
    """``num_slots`` adapter slots. ``assign`` gives every adapter of a step a slot: those
    already in one keep it; the others take the lowest free slot, else the slot of the
    least recently used adapter the step does not use."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, least recent first
        self.num_loads = 0
        self.num_evictions = 0

    def assign(self, adapter_ids: set[int]) -> tuple[dict[int, int], list[tuple[int, int]]]:
        """Slots for ``adapter_ids`` (at most ``num_slots``): (adapter id -> slot, the
        (adapter id, slot) pairs whose weights must be written now)."""
        if len(adapter_ids) > self.num_slots:
            raise ValueError(f"{len(adapter_ids)} adapters in one step; there are {self.num_slots} slots (max_loras)")
        slot_of = self._slot_of
        loads = []
        for adapter_id in sorted(adapter_ids - slot_of.keys()):
            taken = set(slot_of.values())
            free = next((slot for slot in range(self.num_slots) if slot not in taken), None)
            if free is None:
                victim = next(a for a in slot_of if a not in adapter_ids)
                free = slot_of.pop(victim)
                self.num_evictions += 1
            slot_of[adapter_id] = free
            loads.append((adapter_id, free))
        for adapter_id in adapter_ids:
            slot_of.move_to_end(adapter_id)
        self.num_loads += len(loads)
        return {adapter_id: slot_of[adapter_id] for adapter_id in adapter_ids}, loads

    def release(self, adapter_id: int) -> None:
        """Free ``adapter_id``'s slot, if it has one (the adapter was removed)."""
        self._slot_of.pop(adapter_id, None)

    @property
    def resident(self) -> dict[int, int]:
        """Adapter id -> slot, least recently used first."""
        return dict(self._slot_of)
