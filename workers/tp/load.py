"""Loading one tensor-parallel rank's shard of a checkpoint.

The model is built with its parameters on the meta device (its buffers, such
as RoPE frequencies, computed for real), cut down to the rank's shard
(``tp_plan.shard_decoder``), given storage, and filled from the safetensors
files, each cut parameter read as the rank's slice only (safetensors reads
the bytes of a slice, not the whole tensor), so a rank never holds more than
its shard plus the parameters every rank keeps whole.

That reading needs the checkpoint's tensors to be the model's parameters,
name for name, as transformers saves dense decoders. Checkpoints that
transformers converts while loading (mixture-of-experts layers stored one
expert at a time and fused on load, renamed keys, ``.bin`` files) load whole
through ``from_pretrained`` and are cut afterwards; the log says which way a
rank loaded.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import torch

from .plan import AllReduce, SliceSpec, shard_decoder, tensor_parallel_plan

logger = logging.getLogger(__name__)

# ``parameters_on_meta`` swaps a method of torch.nn.Module while a model is built: one build at a
# time, and only the building thread's parameters go to the meta device.
_META_BUILD_LOCK = threading.Lock()
_building = threading.local()

_INDEX_FILE = "model.safetensors.index.json"
_SINGLE_FILE = "model.safetensors"


def checkpoint_files(path: str) -> dict[str, str] | None:
    """Tensor name -> the safetensors file holding it; None without safetensors."""
    index = os.path.join(path, _INDEX_FILE)
    if os.path.isfile(index):
        with open(index) as handle:
            weight_map = json.load(handle)["weight_map"]
        return {name: os.path.join(path, file) for name, file in weight_map.items()}
    single = os.path.join(path, _SINGLE_FILE)
    if os.path.isfile(single):
        from safetensors import safe_open

        with safe_open(single, "pt") as handle:
            return {name: single for name in handle.keys()}
    return None


class ShardLoader:
    """A ``ModelRunner`` loader: ``load(path, dtype, attn_implementation, trust_remote_code)`` returns
    the model as rank ``rank``'s shard of ``size``, on the CPU, its all-reduces installed. After
    a load, ``cuts`` says how each cut parameter (by its name in the causal LM) was cut."""

    def __init__(self, rank: int, size: int, all_reduce: AllReduce) -> None:
        self.rank = rank
        self.size = size
        self.all_reduce = all_reduce
        self.cuts: dict[str, SliceSpec] = {}

    def __call__(self, path: str, dtype: torch.dtype, attn_implementation: str,
                 trust_remote_code: bool) -> torch.nn.Module:
        rank, size = self.rank, self.size
        loaded = load_sliced(path, dtype, attn_implementation, trust_remote_code, rank, size, self.all_reduce)
        if loaded is not None:
            logger.info("tensor-parallel rank %d of %d: read its slices of %s", rank, size, path)
            model, self.cuts = loaded
            return model
        from transformers import AutoModelForCausalLM

        logger.info("tensor-parallel rank %d of %d: %s's tensors are not the model's parameters name for "
                    "name (converted on load); loading it whole, then cutting", rank, size, path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation,
                                                     trust_remote_code=trust_remote_code)
        self.cuts = shard_model(model, rank, size, self.all_reduce)
        return model


def shard_model(model: torch.nn.Module, rank: int, size: int, all_reduce: AllReduce) -> dict[str, SliceSpec]:
    """``shard_decoder`` on a causal LM's decoder; the cuts by parameter name in the causal LM."""
    decoder = model.get_decoder()
    decoder_prefix = next(name for name, module in model.named_modules() if module is decoder)
    cuts = shard_decoder(decoder, tensor_parallel_plan(model.config), rank, size, all_reduce)
    return {f"{decoder_prefix}.{name}" if decoder_prefix else name: spec for name, spec in cuts.items()}


def load_sliced(path: str, dtype: torch.dtype, attn_implementation: str, trust_remote_code: bool,
                rank: int, size: int, all_reduce: AllReduce) -> tuple[torch.nn.Module, dict[str, SliceSpec]] | None:
    """The rank's shard read slice by slice, with its cuts (as ``shard_model``'s), or None if the
    checkpoint does not allow it."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    files = checkpoint_files(path)
    if files is None:
        return None
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    with parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation,
                                                 trust_remote_code=trust_remote_code)
    cuts = shard_model(model, rank, size, all_reduce)
    tied = set(getattr(model, "all_tied_weights_keys", None) or {})
    tensors = dict(model.named_parameters())
    tensors.update((name, buffer) for name, buffer in model.named_buffers() if _is_persistent(model, name))
    missing = set(tensors) - set(files) - tied
    if missing or not set(files) <= set(tensors):
        return None
    _materialize_parameters(model)
    tensors = dict(model.named_parameters())
    tensors.update((name, buffer) for name, buffer in model.named_buffers() if _is_persistent(model, name))
    by_file: dict[str, list[str]] = {}
    for name in files:
        by_file.setdefault(files[name], []).append(name)
    with torch.no_grad():
        for file, names in by_file.items():
            with safe_open(file, "pt") as handle:
                for name in names:
                    tensors[name].copy_(_read(handle, name, cuts.get(name)))
        model.tie_weights()
    return model.eval(), cuts


def _read(handle, name: str, spec: SliceSpec | None) -> torch.Tensor:
    """A tensor of the checkpoint, or only this rank's slice of it."""
    if spec is None or spec.is_summed_bias:
        whole = handle.get_tensor(name)
        return whole if spec is None else spec.cut(whole)
    slices = handle.get_slice(name)
    shape = slices.get_shape()
    dim = spec.dim % len(shape)
    part = shape[dim] // spec.num_parts
    step = part // spec.size
    pieces = []
    for index in range(spec.num_parts):
        start = index * part + spec.rank * step
        selector = tuple(slice(start, start + step) if d == dim else slice(None) for d in range(len(shape)))
        pieces.append(slices[selector])
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)


def _is_persistent(model: torch.nn.Module, buffer_name: str) -> bool:
    module_name, _, leaf = buffer_name.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    return leaf not in module._non_persistent_buffers_set


@contextlib.contextmanager
def parameters_on_meta():
    """Every parameter registered inside goes to the meta device as it is registered (no
    storage, no initialisation); buffers stay real. ``torch.nn.Module.register_parameter`` is
    swapped for the duration, under a lock; other threads' parameters are left alone."""
    with _META_BUILD_LOCK:
        register = torch.nn.Module.register_parameter

        def register_on_meta(module, name, param):
            register(module, name, param)
            if getattr(_building, "active", False) and param is not None and param.device.type != "meta":
                module._parameters[name] = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

        torch.nn.Module.register_parameter = register_on_meta
        _building.active = True
        try:
            yield
        finally:
            _building.active = False
            torch.nn.Module.register_parameter = register


def _materialize_parameters(model: torch.nn.Module) -> None:
    """Give every meta parameter uninitialised CPU storage (filled from the checkpoint next)."""
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None and param.device.type == "meta":
                module._parameters[name] = torch.nn.Parameter(torch.empty_like(param, device="cpu"),
                                                              requires_grad=False)
