"""PEFT's LoRA checkpoints, read and checked against the base model.

A PEFT LoRA directory (``lora_path``, or a hub id's files: ``adapter_source``) holds
``adapter_config.json`` (``r``, ``lora_alpha``, ``use_rslora``, ``target_modules``, ...)
and ``adapter_model.safetensors``, whose
tensors are ``base_model.model.<module>.lora_A.weight`` ``[r, in]`` and
``...lora_B.weight`` ``[out, r]``. The adapted module computes
``base(x) + scaling * B(A(x))``, scaling ``lora_alpha / r`` (rsLoRA:
``lora_alpha / sqrt(r)``).

What cannot be served exactly is refused with ``LoRAAdapterError`` naming the
adapter and the reason: DoRA and the other PEFT variants that change the
product, a rank above ``max_lora_rank``, target modules the model lacks or that
are not linear layers of its decoder, shapes of another base model, and missing
or malformed files.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import torch

from .adapter_source import CONFIG_FILE, AdapterSourceError, adapter_directory
from .lora_request import LoRARequest

WEIGHTS_FILE = "adapter_model.safetensors"
_KEY = re.compile(r"base_model\.model\.(?P<module>.+)\.lora_(?P<part>[AB])\.weight")

# adapter_config.json fields that change what the adapter computes, refused when set.
_REFUSED_FIELDS = {
    "use_dora": "DoRA (use_dora)",
    "lora_bias": "a bias on lora_B (lora_bias)",
    "modules_to_save": "fully trained modules (modules_to_save)",
    "trainable_token_indices": "trained token embeddings (trainable_token_indices)",
    "layer_replication": "replicated layers (layer_replication)",
    "target_parameters": "adapted parameters (target_parameters)",
    "use_qalora": "QA-LoRA (use_qalora)",
    "use_bdlora": "block-diagonal LoRA (use_bdlora)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "arrow_config": "Arrow routing (arrow_config)",
    "fan_in_fan_out": "transposed Conv1D weights (fan_in_fan_out)",
    "rank_pattern": "per-module ranks (rank_pattern)",
    "alpha_pattern": "per-module alphas (alpha_pattern)",
}


class LoRAAdapterError(ValueError):
    """An adapter that cannot be served; the message names the adapter and the reason."""


@dataclass
class LoRAAdapter:
    """One adapter read into host memory: per adapted module (its name in the causal LM),
    ``lora_a`` ``[rank, in]`` and ``lora_b`` ``[rank, out]`` (B transposed, the scaling
    folded in), in the model's dtype."""

    request: LoRARequest
    rank: int
    scaling: float
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]

    @property
    def num_bytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def read_peft_adapter(request: LoRARequest, linears: Mapping[str, tuple[int, int]], module_names: set[str],
                      max_rank: int, dtype: torch.dtype) -> LoRAAdapter:
    """Read and check ``request``'s adapter. ``linears`` maps each module the engine can adapt
    (a linear layer of the decoder) to its (in, out) features; ``module_names`` is every module
    of the model. Raises ``LoRAAdapterError`` naming what is wrong."""
    where = f"LoRA adapter {request.lora_name!r} (lora_int_id {request.lora_int_id}, {request.lora_path})"

    def refuse(reason: str) -> LoRAAdapterError:
        return LoRAAdapterError(f"{where}: {reason}")

    try:
        directory = adapter_directory(request.lora_path)
    except AdapterSourceError as exc:
        raise refuse(str(exc)) from None
    config = _read_config(directory / CONFIG_FILE, refuse)
    rank, scaling = _rank_and_scaling(config, max_rank, refuse)
    _check_targets(config.get("target_modules"), linears, module_names, refuse)
    base = config.get("base_model_name_or_path")
    tensors = _read_tensors(directory, refuse)
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.fullmatch(key)
        if match is None:
            raise refuse(f"{WEIGHTS_FILE} holds {key!r}, which is not a LoRA A or B weight "
                         "(DoRA magnitudes, biases, embedding adapters and saved modules are not served)")
        parts.setdefault(match["module"], {})[match["part"]] = tensor
    if not parts:
        raise refuse(f"{WEIGHTS_FILE} holds no LoRA weights")
    weights = {}
    for module, pair in sorted(parts.items()):
        if set(pair) != {"A", "B"}:
            raise refuse(f"{module} has lora_{''.join(pair)} but not lora_{'B' if 'A' in pair else 'A'}")
        if module not in linears:
            what = ("is not a linear layer of the decoder (only those are adapted)" if module in module_names
                    else f"is not in this model (the adapter's base model: {base})")
            raise refuse(f"it adapts {module}, which {what}")
        a, b = pair["A"], pair["B"]
        in_features, out_features = linears[module]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise refuse(f"{module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} are not of rank r={rank}")
        if a.shape[1] != in_features or b.shape[0] != out_features:
            raise refuse(f"base model mismatch: {module} maps {in_features} -> {out_features} features, "
                         f"the adapter's {a.shape[1]} -> {b.shape[0]} (the adapter's base model: {base})")
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise refuse(f"{module}: its weights hold NaN or infinite values")
        weights[module] = (a.to(dtype).contiguous(), (b.float() * scaling).t().to(dtype).contiguous())
    return LoRAAdapter(request, rank, scaling, weights)


def _read_config(path: Path, refuse) -> dict:
    if not path.is_file():
        raise refuse(f"no {CONFIG_FILE} in the adapter directory")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise refuse(f"malformed {CONFIG_FILE} ({exc})") from None
    if not isinstance(config, dict):
        raise refuse(f"malformed {CONFIG_FILE}: not a JSON object")
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise refuse(f"peft_type is {peft_type!r}; only LORA adapters are served")
    for field, feature in _REFUSED_FIELDS.items():
        if config.get(field):
            raise refuse(f"it uses {feature}, which pagedserve does not serve")
    if config.get("bias", "none") != "none":
        raise refuse(f"it trains biases of the base model (bias={config['bias']!r}), which pagedserve does not serve")
    return config


def _rank_and_scaling(config: dict, max_rank: int, refuse) -> tuple[int, float]:
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise refuse(f"malformed {CONFIG_FILE}: r must be a positive int, got {rank!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise refuse(f"malformed {CONFIG_FILE}: lora_alpha must be a number, got {alpha!r}")
    if rank > max_rank:
        raise refuse(f"its rank r={rank} exceeds max_lora_rank={max_rank}")
    return rank, alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def _check_targets(targets, linears: Mapping[str, tuple[int, int]], module_names: set[str], refuse) -> None:
    """PEFT's matching: a string is a regex over whole module names ("all-linear": every linear
    layer), a list holds names or name suffixes. Each must name something this model has."""
    if targets is None or targets == "all-linear":
        return
    if isinstance(targets, str):
        try:
            pattern = re.compile(targets)
        except re.error as exc:
            raise refuse(f"malformed {CONFIG_FILE}: target_modules is not a regex ({exc})") from None
        if not any(pattern.fullmatch(name) for name in module_names):
            raise refuse(f"target_modules {targets!r} matches no module of this model")
        return
    if not isinstance(targets, list) or not all(isinstance(t, str) and t for t in targets):
        raise refuse(f"malformed {CONFIG_FILE}: target_modules must be a list of names or a regex")
    lacking = [t for t in targets if not any(name == t or name.endswith("." + t) for name in module_names)]
    if lacking:
        raise refuse(f"target modules {lacking} are not in this model")


def _read_tensors(directory: Path, refuse) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = directory / WEIGHTS_FILE
    if not path.is_file():
        pickled = " (adapter_model.bin is not read: save it with safe_serialization)" if (
            directory / "adapter_model.bin").exists() else ""
        raise refuse(f"no {WEIGHTS_FILE} in the adapter directory{pickled}")
    try:
        return load_file(str(path), device="cpu")
    except (SafetensorError, OSError, ValueError) as exc:
        raise refuse(f"malformed {WEIGHTS_FILE} ({exc})") from None
