"""Adapter weights read through a page table: LoRA's side of unified paging (S-LoRA).

An adapted layer's A (or B) weights of every slot may live in pages of a KV cache tensor
instead of a slot tensor of their own. Rank-row ``r`` of slot ``s`` is cut into pieces of
``piece`` elements; piece ``j`` of it lies at ``storage[table[s, r, j] * piece:][:piece]``.
A row's last piece may be partly used; rows past an adapter's rank, and every row of a slot
that does not adapt the layer, point at a piece of zeros.

Both LoRA backends (the torch path and the Triton kernels) read this form as they read a
slot tensor ``[slots, R, features]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# A piece is at most this many elements; a page's chunk of one layer is cut into whole pieces.
MAX_PIECE = 1024
# tl.dot's smallest K: a piece is at least one of the kernels' tiles.
MIN_PIECE = 16


def piece_size(chunk: int, min_features: int) -> int | None:
    """The largest power of two dividing ``chunk`` (elements of one page in one layer's key or
    value cache), at most ``MAX_PIECE`` and at most ``min_features`` (the narrowest weight
    row, so that a row wastes under half its pieces); None if it is under ``MIN_PIECE``."""
    piece = min(chunk & -chunk, MAX_PIECE, 1 << (max(min_features, 1).bit_length() - 1))
    return piece if piece >= MIN_PIECE else None


@dataclass(frozen=True)
class PagedLoRAWeights:
    """One layer's A (``features`` = its inputs) or B (its outputs) of every slot, in pages:
    ``storage`` is a 1-D view of a KV cache tensor, ``table`` int32 ``[slots, max_rank,
    ceil(features / piece)]`` on its device (piece indices of ``storage``)."""

    storage: torch.Tensor
    table: torch.Tensor
    piece: int
    features: int

    @property
    def shape(self) -> tuple[int, int, int]:
        """As a slot tensor's: ``[slots, max_rank, features]``."""
        return (self.table.shape[0], self.table.shape[1], self.features)

    @property
    def dtype(self) -> torch.dtype:
        return self.storage.dtype

    @property
    def device(self) -> torch.device:
        return self.storage.device

    def gather(self, slots: torch.Tensor | None, num_slots: int) -> torch.Tensor:
        """The dense ``[G, max_rank, features]`` weights of slots ``slots`` (int64 on the device;
        None: slots ``0..num_slots-1``): one gather from the pages."""
        table = self.table[:num_slots] if slots is None else self.table.index_select(0, slots)
        pieces = self.storage.view(-1, self.piece).index_select(0, table.reshape(-1).to(torch.int64))
        return pieces.view(*table.shape[:2], -1)[..., :self.features]   # [G, R, pieces * piece] cut
