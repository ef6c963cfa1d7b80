"""Linear layers with adapter slots: ``base(x)`` plus, for the step's adapted tokens, their
adapters' ``scaling * B(A(x))``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import ModuleType

import torch

from pagedserve.kernels import select_backend
from pagedserve.kernels.lora_pages import PagedLoRAWeights

from . import punica


def lora_ops_for(device: torch.device, kernel_backend: str | None = None) -> ModuleType:
    """The batched LoRA products for a model on ``device``: Triton's SGMV kernels
    (``pagedserve.kernels.triton_lora_ops``) where its attention runs Triton (``kernel_backend``;
    None: on CUDA with triton installed), else the torch path (``punica``), which is also
    their oracle. Either module offers ``build_segments``, ``lora_shrink`` and ``lora_expand``."""
    if (kernel_backend or select_backend(device)) == "triton":
        from pagedserve.kernels import triton_lora_ops

        return triton_lora_ops
    return punica


_UNBUILT = object()   # ``LoRAContext``'s segments of a step not read yet


class LoRAContext:
    """What the adapted layers of one model read during a forward: the products ``ops``
    (``lora_ops_for``'s, chosen once per model) and the step's ``segments``, which those ops
    build from ``token_slots`` (each token's slot, -1: the base model; on the host) when a
    layer first reads them (None: no token uses an adapter). One per model (never a global:
    two engines may share a process), set by its ``LoRAManager``. ``static``: segments of
    fixed shapes (``StaticSegments`` of the Triton ops) that CUDA graphs of decode steps
    capture; a step replayed so runs on them (``using``) and builds no others."""

    def __init__(self, ops: ModuleType = punica) -> None:
        self.ops = ops
        self._segments = None
        self.token_slots: torch.Tensor | None = None
        self._device: torch.device | None = None
        self.static = None

    @property
    def segments(self):
        if self._segments is _UNBUILT:
            self._segments = self.ops.build_segments(self.token_slots, self._device)
        return self._segments

    @segments.setter
    def segments(self, segments) -> None:
        self._segments = segments

    def begin_step(self, token_slots: torch.Tensor, device: torch.device) -> None:
        """A forward whose token ``t`` uses slot ``token_slots[t]``; its segments are built when read."""
        self.token_slots, self._device, self._segments = token_slots, device, _UNBUILT

    def end_step(self) -> None:
        self.token_slots, self._segments = None, None

    @contextlib.contextmanager
    def using(self, segments) -> Iterator[None]:
        """Within it, the layers read ``segments`` (the static ones a CUDA graph captures)."""
        saved, self._segments = self._segments, segments
        try:
            yield
        finally:
            self._segments = saved

    @property
    def has_static_shapes(self) -> bool:
        """Whether ``ops`` can run on segments of fixed shapes (the Triton kernels can; the
        torch path's shapes follow each step's adapters)."""
        return hasattr(self.ops, "StaticSegments")


class LoRALinear(torch.nn.Module):
    """A linear layer (``base_layer``: a ``Linear``, or a piece of a merged projection) with
    ``num_slots`` adapter slots: ``lora_a`` ``[slots, max_rank, in]`` and ``lora_b``
    ``[slots, max_rank, out]``, allocated when an adapter first targets it, or, with unified
    paging, ``PagedLoRAWeights`` of that shape whose tables point into KV cache pages
    (``attach_pages``). ``slot_bits`` has bit ``s`` set while slot ``s`` holds weights for
    this layer; a step none of whose slots do computes the base layer only."""

    def __init__(self, base_layer: torch.nn.Linear, context: LoRAContext) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.context = context
        self.in_features = base_layer.in_features
        self.out_features = base_layer.out_features
        self.lora_a: torch.Tensor | None = None
        self.lora_b: torch.Tensor | None = None
        self.slot_bits = 0

    @property
    def weight(self) -> torch.Tensor:
        return self.base_layer.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.base_layer.bias

    def allocate(self, num_slots: int, max_rank: int) -> None:
        weight = self.base_layer.weight
        self.lora_a = torch.zeros((num_slots, max_rank, self.in_features), dtype=weight.dtype, device=weight.device)
        self.lora_b = torch.zeros((num_slots, max_rank, self.out_features), dtype=weight.dtype, device=weight.device)

    def attach_pages(self, lora_a: PagedLoRAWeights, lora_b: PagedLoRAWeights, zero_piece: int) -> None:
        """Read every slot's weights through page tables (every row on ``zero_piece`` now)."""
        self.lora_a, self.lora_b, self.zero_piece = lora_a, lora_b, zero_piece
        self.slot_bits = 0

    def set_slot_pieces(self, slot: int, pieces: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Point ``slot``'s rows at an adapter's (A, B) pieces in pages (int32 ``[rank, pieces]``
        each), the rest at the zero piece; None: the adapter leaves this layer as it is."""
        self._write_slot(slot, (self.lora_a.table, self.lora_b.table), pieces, self.zero_piece, non_blocking=False)

    def set_slot(self, slot: int, weights: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Write an adapter's (A ``[r, in]``, scaled Bᵀ ``[r, out]``) into ``slot``, or clear it
        (None: the adapter leaves this layer as it is)."""
        self._write_slot(slot, (self.lora_a, self.lora_b), weights, 0, non_blocking=True)

    def _write_slot(self, slot: int, targets: tuple[torch.Tensor, torch.Tensor],
                    rows: tuple[torch.Tensor, torch.Tensor] | None, fill: int, non_blocking: bool) -> None:
        """Copy ``rows`` (A's, B's ``[rank, ...]``) into ``slot`` of ``targets`` (slot tensors or
        page tables), ``fill`` past the rank; None: ``fill`` the slot if it holds this layer."""
        bit = 1 << slot
        if rows is None:
            if self.slot_bits & bit:
                for target in targets:
                    target[slot].fill_(fill)
                self.slot_bits &= ~bit
            return
        for target, row in zip(targets, rows):
            rank = row.shape[0]
            target[slot, rank:].fill_(fill)
            target[slot, :rank].copy_(row, non_blocking=non_blocking)
        self.slot_bits |= bit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base_layer(x)
        segments = self.context.segments
        if segments is None or self.lora_a is None:
            return y
        # Static segments (negative bits) run every layer that holds slots: a CUDA graph's kernels
        # must not depend on which adapters its capture saw.
        if segments.slot_bits >= 0 and not (segments.slot_bits & self.slot_bits):
            return y
        ops = self.context.ops
        shrunk = ops.lora_shrink(x.reshape(-1, self.in_features), self.lora_a, segments)
        ops.lora_expand(y.view(-1, self.out_features), shrunk, self.lora_b, segments)
        return y

    def extra_repr(self) -> str:
        if self.lora_a is None:
            return "unallocated"
        paged = ", in pages" if isinstance(self.lora_a, PagedLoRAWeights) else ""
        return f"slots={self.lora_a.shape[0]}, max_rank={self.lora_a.shape[1]}{paged}"
