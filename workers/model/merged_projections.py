"""One matmul for the projections that read the same input: an attention's q/k/v, an MLP's gate/up.

transformers' decoders call ``q_proj``, ``k_proj`` and ``v_proj`` (and ``gate_proj``
and ``up_proj``) one after the other on the same hidden states: three matmuls
where one wider matmul would do, and on a GPU the k and v projections of a GQA
model are small ones (N = 512 on a 1B Llama) that reach a fraction of the
device's bandwidth. vLLM's model code merges them (``QKVParallelLinear``,
``MergedColumnParallelLinear``); pagedserve runs transformers' own modules, so
it merges them around those modules instead:

- the group's weights are concatenated once, at load, into a buffer of the
  parent module, and each projection becomes a ``MergedPiece`` whose weight is a
  view of its rows (no second copy of the weights);
- the parent's forward computes the merged projection of its input, hands the
  slices to its pieces, runs transformers' forward, and clears the slices;
- a piece called on that same input returns its slice; on any other input it
  computes its own projection, so a forward that does not follow the pattern
  is still exact, only unmerged.

``merge_same_input_projections`` then runs a probe forward and takes the merge back from
every group whose pieces did not all use their slices, so no forward computes
a merged matmul it then ignores. Under ``torch.compile`` the slices are set and
cleared inside the traced forward: no graph break, and no guard that changes
between steps.

The merged matmul gives the same values as the separate ones. Elementwise work
on its slices (SiLU on the gate) reads strided memory, which on the CPU takes
torch's unvectorised path and can round differently in the last bit; the
engine merges by default on CUDA only, where that does not happen and where
the wider matmuls pay.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

# Children of one module that project the same input, in the order transformers calls them.
GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class _Slices:
    """A group's merged output while its parent's forward runs: the input it projected and one
    slice per piece (a plain object: cheaper to write than module attributes)."""

    def __init__(self) -> None:
        self.input: torch.Tensor | None = None
        self.outputs: tuple[torch.Tensor, ...] = ()
        self.counts: list[list[int]] | None = None  # per piece [served, computed], in probes only


class MergedPiece(torch.nn.Linear):
    """One projection of a merged group: a ``Linear`` whose weight (and bias) are rows of the
    group's merged ones. Returns its slice of the merged output for the input the group
    projected; computes its own projection for any other input."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, slices: _Slices, index: int) -> None:
        torch.nn.Module.__init__(self)  # no weight of its own to allocate
        self.out_features, self.in_features = weight.shape
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)
        self.slices = slices
        self.index = index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        slices = self.slices
        served = x is slices.input
        if slices.counts is not None:
            slices.counts[self.index][0 if served else 1] += 1
        if served:
            return slices.outputs[self.index]
        return F.linear(x, self.weight, self.bias)


@dataclass
class MergedGroup:
    """A module whose projections ``names`` were merged, and how to take the merge back."""

    module: torch.nn.Module
    names: tuple[str, ...]
    original_forward: Callable
    slices: _Slices = field(default_factory=_Slices)

    @property
    def buffer_name(self) -> str:
        return "merged_" + "_".join(name.removesuffix("_proj") for name in self.names)

    def unmerge(self) -> None:
        """Plain ``Linear``s again, over the same rows (the old weights were freed at merge)."""
        for name in self.names:
            piece = getattr(self.module, name)
            linear = torch.nn.Linear(piece.in_features, piece.out_features, bias=piece.bias is not None,
                                     device="meta", dtype=piece.weight.dtype)
            linear.weight, linear.bias = piece.weight, piece.bias
            setattr(self.module, name, linear)
        for suffix in ("weight", "bias"):
            if hasattr(self.module, f"{self.buffer_name}_{suffix}"):
                delattr(self.module, f"{self.buffer_name}_{suffix}")
        if self.original_forward == type(self.module).forward.__get__(self.module):
            del self.module.forward  # the instance attribute: the class's forward again
        else:
            self.module.forward = self.original_forward


def merge_same_input_projections(model: torch.nn.Module, probe: Callable[[], object]) -> list[str]:
    """Merge every group of ``GROUPS`` in ``model`` whose projections are plain ``Linear``s of
    one input size, dtype and device, with no hooks; ``probe()`` then runs a forward, and
    each group whose pieces did not all use their slices is taken back (every group, with a
    warning, if the probe raises). Call it after the
    model is on its device: moving it afterwards copies the pieces apart from the merged
    weights (still exact, but the memory is no longer shared). Returns the merged groups'
    names, as ``"<module path>: q_proj+k_proj+v_proj"``."""
    paths = {id(module): name for name, module in model.named_modules()}
    # Only the parents are held while merging, so each group's old weights are freed as soon as
    # it is merged: the load's peak grows by one group's weights, not by all of them.
    parents = [module for module in model.modules() if any(hasattr(module, names[0]) for names in GROUPS)]
    groups = [group for module in parents for names in GROUPS if (group := _merge(module, names)) is not None]
    for group in groups:
        group.slices.counts = [[0, 0] for _ in group.names]
    try:
        if groups:
            probe()
    except Exception as exc:  # the forward fails merged: run it as it was, and say why
        for group in groups:
            group.unmerge()
        logger.warning("projections left unmerged: the forward failed with them merged (%s: %s)",
                       type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        return []
    finally:
        counts = [group.slices.counts for group in groups]
        for group in groups:
            group.slices.counts = None
    kept, dropped = [], []
    for group, group_counts in zip(groups, counts):
        label = f"{paths.get(id(group.module), '?')}: {'+'.join(group.names)}"
        if all(served and not computed for served, computed in group_counts):
            kept.append(label)
        else:
            group.unmerge()
            dropped.append(label)
    if dropped:
        logger.info("projections left unmerged (the forward does not project one input with them): %s",
                    ", ".join(dropped[:4]) + (f" and {len(dropped) - 4} more" if len(dropped) > 4 else ""))
    return kept


def _merge(module: torch.nn.Module, names: tuple[str, ...]) -> MergedGroup | None:
    projections = [getattr(module, name, None) for name in names]
    if not all(type(p) is torch.nn.Linear for p in projections):
        return None
    first = projections[0]
    if any(p.in_features != first.in_features or p.weight.dtype != first.weight.dtype
           or p.weight.device != first.weight.device or _has_hooks(p) for p in projections):
        return None
    has_bias = {p.bias is not None for p in projections}
    if len(has_bias) != 1:
        return None
    group = MergedGroup(module, names, module.forward)
    sizes = [p.out_features for p in projections]
    with torch.no_grad():
        weight = torch.cat([p.weight for p in projections])
        bias = torch.cat([p.bias for p in projections]) if has_bias == {True} else None
    del projections, first  # the old Linears go when the pieces replace them
    module.register_buffer(f"{group.buffer_name}_weight", weight, persistent=False)
    if bias is not None:
        module.register_buffer(f"{group.buffer_name}_bias", bias, persistent=False)
    biases = bias.split(sizes) if bias is not None else [None] * len(sizes)
    for index, (name, w, b) in enumerate(zip(names, weight.split(sizes), biases)):
        setattr(module, name, MergedPiece(w, b, group.slices, index))
    module.forward = _merged_forward(group, sizes)
    return group


def _merged_forward(group: MergedGroup, sizes: list[int]) -> Callable:
    """The parent's forward: the merged projection of its input, then transformers' forward."""
    original = group.original_forward
    input_name = next(iter(inspect.signature(original).parameters))
    module, slices = group.module, group.slices
    weight_name, bias_name = f"{group.buffer_name}_weight", f"{group.buffer_name}_bias"

    def forward(*args, **kwargs):
        x = args[0] if args else kwargs[input_name]
        merged = F.linear(x, getattr(module, weight_name), getattr(module, bias_name, None))
        slices.input, slices.outputs = x, merged.split(sizes, dim=-1)
        try:
            return original(*args, **kwargs)
        finally:
            slices.input, slices.outputs = None, ()

    return forward


def _has_hooks(module: torch.nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks)
