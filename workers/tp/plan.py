"""Which models split across tensor-parallel ranks, and how: transformers' own plans.

A transformers config class names, in ``base_model_tp_plan``, how each layer of
its decoder splits (Megatron's column/row split): ``q/k/v_proj`` and the MLP's
up projections "colwise" (each rank computes its slice of the heads or of the
intermediate features), ``o_proj`` and ``down_proj`` "rowwise" (each rank holds
the matching input slice and the partial outputs are summed: the one
all-reduce after attention and the one after the MLP). Mixture-of-experts
layers split every expert the same way ("packed_colwise" for the fused
gate/up weights, "moe_tp_experts" for the sum after the experts).

``check_tensor_parallel`` refuses, with the reason, a model that has no plan,
whose plan uses a style pagedserve does not implement, or whose head counts
or split widths do not divide by the TP size. ``shard_decoder`` cuts a loaded
decoder down to one rank's shard in place (plain tensors, no DTensor) and
installs the all-reduces; the embeddings, norms, routers and the LM head stay
whole on every rank.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import torch

from ..model.model_support import UnsupportedModelError

# Styles pagedserve implements, and what they do to a module or parameter.
COLWISE = "colwise"                 # output features split: weight dim -2 (bias dim 0)
ROWWISE = "rowwise"                 # input features split (dim -1); a module's outputs summed
PACKED_COLWISE = "packed_colwise"   # colwise on a [gate; up] fused weight: each half split alike
PACKED_ROWWISE = "packed_rowwise"   # rowwise on a weight whose input is two fused halves
MOE_EXPERTS = "moe_tp_experts"      # every expert split: the experts' outputs summed
ALL_REDUCE = "all_reduce"           # a module's partial outputs summed
REPLICATED = ("replicate", "replicated_with_grad_allreduce", "local_params")  # whole on every rank
SUPPORTED_STYLES = (COLWISE, ROWWISE, PACKED_COLWISE, PACKED_ROWWISE, MOE_EXPERTS, ALL_REDUCE, *REPLICATED)

# Config fields whose width a colwise/rowwise pair splits, when the model has them.
_SPLIT_WIDTHS = ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size")
# Stacked expert weights go through a grouped matmul whose rows must be a multiple of 16 bytes:
# 8 elements in 16-bit dtypes.
_EXPERT_WIDTH_MULTIPLE = 8
_KEY_PROJECTIONS = ("k_proj",)

AllReduce = Callable[[torch.Tensor], None]   # sums a tensor across the ranks, in place


class TensorParallelError(UnsupportedModelError):
    """The model cannot be split across this many ranks; the message says why."""


@dataclass(frozen=True)
class SliceSpec:
    """How a parameter was cut: rank ``rank`` of ``size`` along ``dim``, each of its ``num_parts``
    fused parts alike (what a loader reads from the checkpoint for this rank). ``is_summed_bias``:
    the bias of a rowwise layer, whole on rank 0 and zero elsewhere, so that the sum of the
    ranks' outputs adds it once."""

    dim: int
    num_parts: int
    rank: int
    size: int
    is_summed_bias: bool = False

    def cut(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of the whole ``tensor``."""
        if self.is_summed_bias:
            return tensor if self.rank == 0 else torch.zeros_like(tensor)
        return shard_slice(tensor, self.dim, self.rank, self.size, self.num_parts)


def layer_pattern(name: str) -> str:
    """A module or parameter name with its layer numbers as ``*`` (the plans' keys):
    ``layers.3.mlp.up_proj`` -> ``layers.*.mlp.up_proj``."""
    return re.sub(r"\.\d+(\.|$)", lambda m: ".*" + m.group(1), name)


# transformers >= 5.25 lists stacked experts in an expert-parallel plan only; their tensor-parallel
# split is the one its earlier plans stated: gate/up packed colwise, down rowwise, outputs summed.
_EXPERT_DISPATCH = "ep_dispatch_experts"
_STACKED_EXPERT_SPLITS = {"gate_up_proj": PACKED_COLWISE, "down_proj": ROWWISE}


def tensor_parallel_plan(config) -> dict[str, str]:
    """The decoder's plan from the config (text config of a composite one), or {}."""
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    plan = dict(getattr(text_config, "base_model_tp_plan", None) or {})
    if plan:
        plan.update(_expert_splits(plan, getattr(text_config, "base_model_ep_plan", None) or {}))
    return plan


def _expert_splits(plan: dict[str, str], expert_plan: dict[str, str]) -> dict[str, str]:
    """The tensor-parallel split of experts that only the expert-parallel plan names."""
    splits = {}
    for experts, style in expert_plan.items():
        if style != _EXPERT_DISPATCH or any(key == experts or key.startswith(experts + ".") for key in plan):
            continue
        weights = {key[len(experts) + 1:] for key in expert_plan if key.startswith(experts + ".")}
        if weights and weights <= set(_STACKED_EXPERT_SPLITS):
            splits.update({f"{experts}.{weight}": _STACKED_EXPERT_SPLITS[weight] for weight in weights})
            splits[experts] = MOE_EXPERTS
    return splits


def check_tensor_parallel(config, tensor_parallel_size: int) -> None:
    """Refuse, naming the reason, a model that cannot run on ``tensor_parallel_size`` ranks.

    Runs on the config alone (at config validation, before any worker starts).
    """
    if tensor_parallel_size == 1:
        return
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    model_type = getattr(text_config, "model_type", None) or type(config).__name__
    where = f"tensor_parallel_size {tensor_parallel_size}: model type {model_type!r}"
    plan = tensor_parallel_plan(config)
    if not plan:
        raise TensorParallelError(
            f"{where} has no tensor-parallel plan in transformers (base_model_tp_plan), so pagedserve "
            "does not know how to split its layers; run it with tensor_parallel_size 1")
    unsupported = sorted({f"{style!r} ({key})" for key, style in plan.items() if style not in SUPPORTED_STYLES})
    if unsupported:
        raise TensorParallelError(
            f"{where}: its tensor-parallel plan uses {', '.join(unsupported)}, which pagedserve does not "
            f"implement (it implements {', '.join(SUPPORTED_STYLES)})")
    if not any(key.rsplit(".", 1)[-1] in _KEY_PROJECTIONS and style == COLWISE for key, style in plan.items()):
        raise TensorParallelError(
            f"{where}: its tensor-parallel plan does not split the attention heads (no colwise k_proj), "
            "so the ranks' KV caches could not each hold a share of the heads")
    num_heads = text_config.num_attention_heads
    num_kv_heads = getattr(text_config, "num_key_value_heads", None) or num_heads
    for what, count in (("attention heads", num_heads), ("key/value heads", num_kv_heads)):
        if count % tensor_parallel_size:
            raise TensorParallelError(
                f"{where} has {count} {what}, which do not divide by {tensor_parallel_size}: every rank "
                f"must hold the same number of whole heads (use a tensor_parallel_size that divides {count})")
    for name in _SPLIT_WIDTHS:
        width = getattr(text_config, name, None)
        if isinstance(width, int) and width % tensor_parallel_size:
            raise TensorParallelError(
                f"{where}: {name} {width} does not divide by {tensor_parallel_size}, so the ranks' slices "
                "of those layers would differ in width")
    expert_width = getattr(text_config, "moe_intermediate_size", None)
    if (isinstance(expert_width, int) and any(style == MOE_EXPERTS for style in plan.values())
            and (expert_width // tensor_parallel_size) % _EXPERT_WIDTH_MULTIPLE):
        raise TensorParallelError(
            f"{where}: moe_intermediate_size {expert_width} splits into experts {expert_width // tensor_parallel_size} "
            f"wide per rank; transformers' grouped expert matmul needs a multiple of {_EXPERT_WIDTH_MULTIPLE}")


def shard_slice(tensor: torch.Tensor, dim: int, rank: int, size: int, num_parts: int = 1) -> torch.Tensor:
    """This rank's slice of ``tensor`` along ``dim`` (a copy). With ``num_parts`` > 1 the dim holds that
    many fused parts (``[gate; up]``): each part is split alike and the rank's slices concatenated."""
    parts = tensor.chunk(num_parts, dim=dim) if num_parts > 1 else (tensor,)
    pieces = []
    for part in parts:
        width = part.shape[dim]
        if width % size:
            raise TensorParallelError(f"a tensor of shape {tuple(tensor.shape)} does not split in {size} "
                                      f"along dim {dim}")
        step = width // size
        pieces.append(part.narrow(dim, rank * step, step))
    return torch.cat(pieces, dim=dim).contiguous() if len(pieces) > 1 else pieces[0].contiguous()


def shard_decoder(decoder: torch.nn.Module, plan: dict[str, str], rank: int, size: int,
                  all_reduce: AllReduce) -> dict[str, SliceSpec]:
    """Cut ``decoder`` (a transformers base model) down to rank ``rank`` of ``size`` in place,
    following ``plan``, and install the all-reduces. Works on meta tensors too. Returns how
    each cut parameter (by its name in ``decoder``) was cut."""
    cuts: dict[str, SliceSpec] = {}
    if size == 1:
        return cuts
    for module_name, module in list(decoder.named_modules()):
        pattern = layer_pattern(module_name)
        prefix = f"{module_name}." if module_name else ""
        style = plan.get(pattern)
        if style is not None:
            for name, spec in _apply_module_style(module, style, rank, size, all_reduce).items():
                cuts[prefix + name] = spec
        for param_name, param in list(module.named_parameters(recurse=False)):
            param_style = plan.get(f"{pattern}.{param_name}" if pattern else param_name)
            if param_style is not None and f"{prefix}{param_name}" not in cuts:
                spec = _slice_spec(param, param_style, rank, size)
                if spec is not None:
                    _set(module, param_name, _cut(param, spec))
                    cuts[prefix + param_name] = spec
    return cuts


def _apply_module_style(module: torch.nn.Module, style: str, rank: int, size: int,
                        all_reduce: AllReduce) -> dict[str, SliceSpec]:
    cuts: dict[str, SliceSpec] = {}
    if style in REPLICATED:
        return cuts
    if style in (COLWISE, PACKED_COLWISE, ROWWISE, PACKED_ROWWISE):
        is_rowwise = style in (ROWWISE, PACKED_ROWWISE)
        for name, param in list(module.named_parameters(recurse=False)):
            if name == "bias" and is_rowwise:
                spec = SliceSpec(0, 1, rank, size, is_summed_bias=True)
            else:
                spec = _slice_spec(param, style, rank, size)
            if spec is not None:
                _set(module, name, _cut(param, spec))
                cuts[name] = spec
        _shrink_features(module, "in_features" if is_rowwise else "out_features", size)
        if is_rowwise:
            module.register_forward_hook(_summing_hook(all_reduce))
        return cuts
    if style in (MOE_EXPERTS, ALL_REDUCE):
        module.register_forward_hook(_summing_hook(all_reduce))
        return cuts
    raise TensorParallelError(f"tensor-parallel style {style!r} is not implemented")


def _slice_spec(param: torch.Tensor, style: str, rank: int, size: int) -> SliceSpec | None:
    """How ``style`` cuts ``param`` for this rank; None: it stays whole."""
    ndim = param.dim()
    if style in (COLWISE, PACKED_COLWISE):
        return SliceSpec(max(ndim - 2, 0), 2 if style == PACKED_COLWISE else 1, rank, size)
    if style in (ROWWISE, PACKED_ROWWISE):
        if ndim == 1:   # a bias on a rowwise parameter entry: added after the sum, whole
            return None
        return SliceSpec(ndim - 1, 2 if style == PACKED_ROWWISE else 1, rank, size)
    if style in REPLICATED or style in (MOE_EXPERTS, ALL_REDUCE):
        return None
    raise TensorParallelError(f"tensor-parallel style {style!r} is not implemented")


def _cut(param: torch.Tensor, spec: SliceSpec) -> torch.nn.Parameter:
    return torch.nn.Parameter(spec.cut(param.data).contiguous(), requires_grad=False)


def _set(module: torch.nn.Module, name: str, value: torch.nn.Parameter) -> None:
    if value is not getattr(module, name):
        setattr(module, name, value)


def _shrink_features(module: torch.nn.Module, attribute: str, size: int) -> None:
    """Keep ``nn.Linear``'s ``in/out_features`` true to the local weight (for its repr)."""
    if isinstance(getattr(module, attribute, None), int):
        setattr(module, attribute, getattr(module, attribute) // size)


def _summing_hook(all_reduce: AllReduce):
    def hook(module, args, output):
        all_reduce(output[0] if isinstance(output, tuple) else output)
        return output
    return hook
