"""A model's linear layers with adapter slots: what every rank of a model holds of its adapters.

On one device the layers are whole. On a rank of a tensor-parallel group each layer
is that rank's cut of it, and so is every adapter written into its slots. An
adapter's product ``B·A`` has its layer's weight shape ``[out, in]``, so it is cut as
the weight was (Megatron's and S-LoRA's split):

- a layer cut along its outputs (colwise: q/k/v, gate/up) keeps A whole and takes
  its slice of B's rows (both halves alike in a packed layer);
- a layer cut along its inputs (rowwise: o_proj, down_proj) takes its slice of A's
  columns and keeps B whole: each rank's ``x_shard·A_shardᵀ·Bᵀ`` is a partial
  delta, and the layer's all-reduce (a forward hook, which moves to the
  ``LoRALinear`` with the layer) sums them with the partial base outputs.

Adapters are checked against the whole model's shapes, then cut.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import TYPE_CHECKING, Iterator, Mapping, Protocol, Sequence

import torch

from ..model.host_lists import int64_tensor
from .layers import LoRAContext, LoRALinear, lora_ops_for
from .lora_request import LoRARequest
from .peft_adapter import LoRAAdapter, read_peft_adapter

if TYPE_CHECKING:
    from .adapter_pages import AdapterPages, ResidentAdapter

# A cut weight's dims: [out, in].
_OUTPUT_DIM, _INPUT_DIM = 0, 1


class WeightCut(Protocol):
    """How a rank's weight was cut from the whole one (``tp.plan.SliceSpec``): rank ``rank`` of
    ``size`` along ``dim``; ``cut`` takes a whole tensor to this rank's part of it."""

    dim: int
    size: int

    def cut(self, tensor: torch.Tensor) -> torch.Tensor: ...


class AdaptedLayers:
    """Every linear layer of ``model``'s decoder as a ``LoRALinear`` (``by_name``) with
    ``max_loras`` slots of rank ``max_lora_rank`` (allocated per layer when an adapter first
    targets it).

    ``weight_cuts`` (a tensor-parallel rank's: how each cut parameter, by its name in
    ``model``, was cut; None or empty: whole layers) makes ``read`` check an adapter against
    the whole model and keep this rank's cut of it. ``write`` puts an adapter into a slot of
    every layer; ``step`` sets a forward's token slots. The products run on Triton or torch
    as ``lora_ops_for(device, kernel_backend)`` says.
    """

    def __init__(self, model: torch.nn.Module, max_loras: int, max_lora_rank: int, kernel_backend: str | None = None,
                 weight_cuts: Mapping[str, WeightCut] | None = None) -> None:
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.context = LoRAContext(lora_ops_for(self.device, kernel_backend))
        self.by_name = wrap_linear_layers(model, self.context)
        weight_cuts = weight_cuts or {}
        self._cuts = {name: weight_cuts[f"{name}.weight"] for name in self.by_name if f"{name}.weight" in weight_cuts}
        self._whole_features = {name: _whole_features(layer, self._cuts.get(name))
                                for name, layer in self.by_name.items()}
        self._module_names = {name for name, _ in model.named_modules()} - {""}
        self.layer_of = _decoder_layer_of(model, self.by_name)

    def __len__(self) -> int:
        return len(self.by_name)

    @property
    def num_allocated(self) -> int:
        """Layers that hold slot weights (some adapter targeted them)."""
        return sum(layer.lora_a is not None for layer in self.by_name.values())

    @property
    def max_slot_bytes(self) -> int:
        """The slot weights' bytes once every layer holds them (the most adapters can take)."""
        element = torch.empty((), dtype=self.dtype).element_size()
        return sum(self.max_loras * self.max_lora_rank * (layer.in_features + layer.out_features) * element
                   for layer in self.by_name.values())

    @property
    def min_features(self) -> int:
        """The narrowest input or output of a layer: the shortest weight row."""
        return min(min(layer.in_features, layer.out_features) for layer in self.by_name.values())

    def enable_static_segments(self, max_tokens: int) -> None:
        """Prepare the layers for CUDA graphs of forwards of up to ``max_tokens`` tokens: every
        layer's slots allocated now (a graph captures the products of the layers that hold
        slots), and segments of fixed shapes. Needs the Triton ops."""
        if not self.context.has_static_shapes:
            raise ValueError("CUDA graphs with LoRA need the Triton LoRA kernels")
        for layer in self.by_name.values():
            if layer.lora_a is None:
                layer.allocate(self.max_loras, self.max_lora_rank)
        self.context.static = self.context.ops.StaticSegments(max_tokens, self.max_loras, self.device)

    def attach_pages(self, pages: "AdapterPages") -> None:
        """Unified paging: every layer reads its slots' weights through page tables into
        ``pages``' KV cache, its decoder layer's key (A) and value (B) cache."""
        if len(self.layer_of) != len(self.by_name):
            outside = sorted(set(self.by_name) - set(self.layer_of))[:3]
            raise ValueError(f"lora_paging \"unified\" keeps an adapter's weights in its decoder layer's KV pages; "
                             f"these linears are in no decoder layer: {outside}")
        for name, layer in self.by_name.items():
            lora_a, lora_b = pages.weights(self.layer_of[name], self.max_loras, self.max_lora_rank,
                                           layer.in_features, layer.out_features)
            layer.attach_pages(lora_a, lora_b, pages.zero_piece)

    def write_pieces(self, slot: int, resident: "ResidentAdapter") -> None:
        """Point ``slot`` of every layer at a paged adapter's pieces (zeros where it adapts none)."""
        for name, layer in self.by_name.items():
            layer.set_slot_pieces(slot, resident.pieces.get(name))

    def read(self, request: LoRARequest) -> LoRAAdapter:
        """``request``'s adapter checked against the whole model (``LoRAAdapterError`` says why it
        cannot be served), as this rank's cut of it."""
        adapter = read_peft_adapter(request, self._whole_features, self._module_names, self.max_lora_rank, self.dtype)
        if not self._cuts:
            return adapter
        return dataclasses.replace(adapter, weights={name: _cut_adapter(self._cuts.get(name), a, b_t)
                                                     for name, (a, b_t) in adapter.weights.items()})

    def write(self, slot: int, adapter: LoRAAdapter) -> None:
        """Write ``adapter`` into ``slot`` of every layer (zeros where it adapts none)."""
        for name, layer in self.by_name.items():
            weights = adapter.weights.get(name)
            if weights is not None and layer.lora_a is None:
                layer.allocate(self.max_loras, self.max_lora_rank)
            if layer.lora_a is not None:
                layer.set_slot(slot, weights)

    @contextlib.contextmanager
    def step(self, chunk_slots: Sequence[int], num_tokens: Sequence[int] | None) -> Iterator[None]:
        """Within it, the layers compute chunk ``i`` (``num_tokens[i]`` tokens; None: one each)
        with the adapter in slot ``chunk_slots[i]`` (-1: the base model)."""
        token_slots = int64_tensor(list(chunk_slots))
        if num_tokens is not None:
            token_slots = torch.repeat_interleave(token_slots, int64_tensor(list(num_tokens)))
        self.context.begin_step(token_slots, self.device)
        try:
            yield
        finally:
            self.context.end_step()


def wrap_linear_layers(model: torch.nn.Module, context: LoRAContext) -> dict[str, LoRALinear]:
    """Replace every ``Linear`` of ``model``'s decoder (pieces of merged projections included)
    by a ``LoRALinear`` over it; returns them by their module name in ``model``.

    The ``LoRALinear`` takes its layer's place with its forward hooks: a hook reading the
    layer's output (a tensor-parallel rank's all-reduce of a rowwise layer's partial outputs)
    must read it with the adapters' deltas added."""
    decoder = {id(module) for module in model.get_decoder().modules()}
    found = [(name, module) for name, module in model.named_modules()
             if isinstance(module, torch.nn.Linear) and id(module) in decoder]
    layers = {}
    for name, module in found:
        parent_name, _, child = name.rpartition(".")
        layer = LoRALinear(module, context)
        _move_forward_hooks(module, layer)
        setattr(model.get_submodule(parent_name), child, layer)
        layers[name] = layer
    return layers


def _move_forward_hooks(source: torch.nn.Module, target: torch.nn.Module) -> None:
    """Register ``source``'s forward (pre-)hooks on ``target``, in their order, and drop them from
    ``source``."""
    for hook_id, hook in list(source._forward_pre_hooks.items()):
        target.register_forward_pre_hook(hook, with_kwargs=hook_id in source._forward_pre_hooks_with_kwargs)
    for hook_id, hook in list(source._forward_hooks.items()):
        target.register_forward_hook(hook, with_kwargs=hook_id in source._forward_hooks_with_kwargs,
                                     always_call=hook_id in source._forward_hooks_always_called)
    for hooks in (source._forward_pre_hooks, source._forward_pre_hooks_with_kwargs, source._forward_hooks,
                  source._forward_hooks_with_kwargs, source._forward_hooks_always_called):
        hooks.clear()


def _decoder_layer_of(model: torch.nn.Module, layers: dict[str, LoRALinear]) -> dict[str, int]:
    """The index of the decoder layer (``model.get_decoder().layers``) each of ``layers`` is in."""
    decoder_layers = getattr(model.get_decoder(), "layers", None) or []
    index_of = {id(module): i for i, layer in enumerate(decoder_layers) for module in layer.modules()}
    return {name: index_of[id(layer)] for name, layer in layers.items() if id(layer) in index_of}


def _whole_features(layer: LoRALinear, cut: WeightCut | None) -> tuple[int, int]:
    """The (in, out) features of the whole layer whose cut (or whole self) ``layer`` is."""
    in_features, out_features = layer.in_features, layer.out_features
    if cut is None:
        return in_features, out_features
    if cut.dim == _OUTPUT_DIM:
        return in_features, out_features * cut.size
    return in_features * cut.size, out_features


def _cut_adapter(cut: WeightCut | None, a: torch.Tensor, b_t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's (A ``[r, in]``, Bᵀ ``[r, out]``) of a layer cut by ``cut`` (None: whole)."""
    if cut is None:
        return a, b_t
    if cut.dim == _OUTPUT_DIM:
        return a, cut.cut(b_t.t()).t().contiguous()     # B [out, r]: its rows, as the weight's
    return cut.cut(a), b_t                               # A [r, in]: its columns, as the weight's
