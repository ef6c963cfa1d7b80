"""The batched LoRA products of a step, on torch: Punica's shrink and expand.

A step's adapted tokens are grouped by adapter slot into ``G`` groups of ``C`` rows
(``LoRASegments``, built once per step on the host and shared by every layer). Each
adapted linear then runs

- ``lora_shrink``: ``h[g] = x[rows of g] @ A[slot g]ᵀ``, one ``bmm`` ``[G, C, in] x [G, in, R]``;
- ``lora_expand``: ``y[token] += (h[g] @ B[slot g])[row]``, one ``bmm`` and one ``index_add_``,

with no loop over adapters. A slot's tokens fill groups of ``C = ceil(adapted tokens /
adapters in the step)`` rows, so padding stays under one group per adapter (at most as
many rows again as there are adapted tokens) however unevenly the adapters share the step.
When every slot of ``0..G-1`` has one group (a decode batch spread over the adapters),
the slot weights are read in place; otherwise each group's are gathered.

The weights are slot-indexed ``[slots, R, features]``: rank-rows of the layer's input
(A) or output (B) size, zero past an adapter's own rank, so padding the rank adds
exact zeros. Weights in pages of the KV cache (``PagedLoRAWeights``) are gathered from
their pages, one gather per product.

This is the path on the CPU and the oracle of the Triton kernels, which run the same
interface (``build_segments``, ``lora_shrink``, ``lora_expand``) on CUDA
(``pagedserve.kernels.triton_lora_ops``; ``layers.lora_ops_for`` picks one per model).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.kernels.lora_pages import PagedLoRAWeights

from ..model.host_lists import to_device


@dataclass
class LoRASegments:
    """A step's adapted tokens in groups of ``group_size`` rows, one slot per group.

    ``token_index[p]`` is the token padded row ``p`` reads (padding reads token 0 and is
    dropped); adapted token ``tokens[i]`` is padded row ``rows[i]``; group ``g`` is of slot
    ``group_slots[g]`` (None: slot ``g``). ``slot_bits`` has bit ``s`` set for each slot in
    the step. Index tensors are int64 on the model's device.
    """

    token_index: torch.Tensor
    rows: torch.Tensor
    tokens: torch.Tensor
    group_slots: torch.Tensor | None
    num_groups: int
    group_size: int
    slot_bits: int

    def weights(self, slot_weights: torch.Tensor | PagedLoRAWeights) -> torch.Tensor:
        """Each group's rows of ``slot_weights`` ``[slots, R, features]`` -> ``[G, R, features]``."""
        if isinstance(slot_weights, PagedLoRAWeights):
            return slot_weights.gather(self.group_slots, self.num_groups)
        if self.group_slots is None:
            return slot_weights[:self.num_groups]
        return slot_weights.index_select(0, self.group_slots)


def build_segments(token_slots: torch.Tensor, device: torch.device) -> LoRASegments | None:
    """The segments of a step whose token ``t`` uses slot ``token_slots[t]`` (int64, CPU;
    -1: the base model); None when no token uses an adapter. Tensor ops only."""
    adapted = (token_slots >= 0).nonzero().squeeze(1)
    num_adapted = adapted.numel()
    if num_adapted == 0:
        return None
    slots, order = torch.sort(token_slots.index_select(0, adapted), stable=True)
    tokens = adapted.index_select(0, order)
    counts = torch.bincount(slots)
    used = counts.nonzero().squeeze(1)
    group_size = -(-num_adapted // used.numel())
    groups_per_slot = (counts + group_size - 1) // group_size
    num_groups = int(groups_per_slot.sum())
    first_group = torch.cumsum(groups_per_slot, 0) - groups_per_slot
    first_token = torch.cumsum(counts, 0) - counts
    rank_in_slot = torch.arange(num_adapted) - first_token.index_select(0, slots)
    rows = (first_group.index_select(0, slots) + rank_in_slot // group_size) * group_size + rank_in_slot % group_size
    token_index = torch.zeros(num_groups * group_size, dtype=torch.int64)
    token_index[rows] = tokens
    group_slots = None
    if not bool((groups_per_slot == 1).all()):
        group_slots = to_device(torch.repeat_interleave(torch.arange(counts.numel()), groups_per_slot), device)
    return LoRASegments(to_device(token_index, device), to_device(rows, device), to_device(tokens, device),
                        group_slots, num_groups, group_size, sum(1 << s for s in used.tolist()))


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor | PagedLoRAWeights, segments: LoRASegments) -> torch.Tensor:
    """``x`` ``[tokens, in]`` through each group's A (``lora_a`` ``[slots, R, in]``):
    ``[G, C, R]``."""
    rows = x.index_select(0, segments.token_index).view(segments.num_groups, segments.group_size, -1)
    return torch.bmm(rows, segments.weights(lora_a).transpose(1, 2))


def lora_expand(y: torch.Tensor, h: torch.Tensor, lora_b: torch.Tensor | PagedLoRAWeights,
                segments: LoRASegments) -> None:
    """Add each adapted token's ``h @ B`` (``lora_b`` ``[slots, R, out]``, scaling folded
    in) to its row of ``y`` ``[tokens, out]``, in place."""
    delta = torch.bmm(h, segments.weights(lora_b)).view(-1, y.shape[-1])
    y.index_add_(0, segments.tokens, delta.index_select(0, segments.rows))
