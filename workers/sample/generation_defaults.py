"""A model's recommended sampling defaults, as vLLM applies them (``--generation-config``).

Model makers put the sampling they recommend in the checkpoint's ``generation_config.json``
(Qwen: temperature 0.7, top_p 0.8, top_k 20, repetition_penalty 1.05; Llama 3 instruct:
temperature 0.6, top_p 0.9). vLLM serves a request that leaves a sampling field out with the
model's value for it, not OpenAI's neutral default; so does pagedserve's server.

``sampling_defaults`` reads the fields vLLM takes from such a file: ``temperature``,
``top_p``, ``top_k``, ``min_p``, ``repetition_penalty`` and ``max_new_tokens`` (as
``max_tokens``), those the file sets (transformers' ``to_diff_dict``).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

# The generation config's keys vLLM takes as sampling defaults.
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")
GENERATION_CONFIG_FILE = "generation_config.json"


def check_generation_config_source(source: str) -> str:
    """``source`` as ``server.generation_config`` takes it: "auto", "vllm", or a folder holding
    a generation_config.json; ValueError naming what is missing."""
    if source not in ("auto", "vllm") and not (Path(source).expanduser() / GENERATION_CONFIG_FILE).is_file():
        raise ValueError(f"{source!r} is neither 'auto', 'vllm' nor a folder holding a {GENERATION_CONFIG_FILE}")
    return source


def check_sampling_overrides(overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Overrides of the sampling defaults: only ``SAMPLING_KEYS``, each a number."""
    unknown = sorted(set(overrides) - set(SAMPLING_KEYS))
    if unknown:
        raise ValueError(f"{', '.join(unknown)}: not a sampling default; the keys are {', '.join(SAMPLING_KEYS)}")
    for key, value in overrides.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{key} must be a number, got {value!r}")
    return dict(overrides)


def sampling_defaults(model_path: str, source: str = "auto", overrides: Mapping[str, Any] | None = None) -> dict:
    """The sampling defaults of the model at ``model_path``: ``source`` "auto" reads its
    generation_config.json (none: no defaults), "vllm" reads nothing (OpenAI's defaults stand),
    a folder reads that folder's; ``overrides`` win. ``max_new_tokens`` comes back as ``max_tokens``."""
    values: dict[str, Any] = {}
    if source != "vllm":
        values = _set_fields(Path(model_path if source == "auto" else source).expanduser())
    values.update(overrides or {})
    defaults = {key: values[key] for key in SAMPLING_KEYS if values.get(key) is not None}
    if "max_new_tokens" in defaults:
        defaults["max_tokens"] = defaults.pop("max_new_tokens")
    return defaults


def _set_fields(model: Path) -> dict[str, Any]:
    """What the generation config of ``model`` (a folder, or a hub id as transformers finds it)
    sets (transformers' ``to_diff_dict``); nothing when it has none."""
    if model.is_dir() and not (model / GENERATION_CONFIG_FILE).is_file():
        return {}
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(str(model)).to_diff_dict()
    except OSError:   # a hub id without one (or out of reach): transformers' defaults
        return {}


__all__ = ["SAMPLING_KEYS", "check_generation_config_source", "check_sampling_overrides", "sampling_defaults"]
