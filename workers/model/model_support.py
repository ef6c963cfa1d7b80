"""Which transformers models pagedserve serves: decided by capability, not by name.

A model loads when it is a decoder-only causal LM whose every layer attends once
per forward pass through transformers' attention interface, with a variant the
kernels implement (scaling, sliding window, logit soft-cap, sinks), and keeps no
state outside its KV cache. Everything else is refused at load with an
``UnsupportedModelError`` naming the feature and the model type: recurrent or
linear-attention layers (Mamba hybrids, Qwen3-Next), encoder-decoders,
multimodal wrappers, attention that bypasses the interface, layer types,
attention arguments or RoPE settings the engine cannot honour, and unknown
architectures.

The checks run in two stages: ``check_config`` and ``check_model_class`` before
the weights load (cheap, also used by ``serve`` before it starts workers), and
``probe_attention`` on the loaded model, which runs one tiny forward pass that
records what every layer's attention call asks for.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from pagedserve import kernels

from .attention import AttentionProbe, AttentionVariant, UnsupportedAttentionError

logger = logging.getLogger(__name__)

SERVED_LAYER_TYPES = ("full_attention", "sliding_attention")

# What the layer types of transformers' configs that pagedserve refuses are.
_LAYER_TYPE_FEATURES = {
    "linear_attention": "linear attention or Mamba state-space layers",
    "hybrid": "attention and Mamba run in parallel",
    "hybrid_sliding": "sliding-window attention and Mamba run in parallel",
    "chunked_attention": "chunked local attention",
    "indexed_attention": "sparse indexed attention",
    "compressed_sparse_attention": "compressed sparse attention",
    "heavily_compressed_attention": "compressed sparse attention",
    "conv": "short convolution layers",
}

# Config switches whose effect happens outside the attention call, so the probe
# cannot see them.
_UNSERVED_CONFIG_FEATURES = {
    "num_kv_shared_layers": "key/value states shared across layers",
    "attention_chunk_size": "chunked local attention",
}

# RoPE types whose frequencies depend on the longest position in the batch: exact
# (batch-independent) only up to the length where they switch.
_LENGTH_DEPENDENT_ROPE = ("longrope",)


class UnsupportedModelError(ValueError):
    """The model cannot be served exactly; the message names the feature and the model type."""


def load_config(model: str, trust_remote_code: bool = False):
    """``AutoConfig.from_pretrained``, with an unknown architecture as ``UnsupportedModelError``."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
    except ValueError as exc:
        if "does not recognize this architecture" in str(exc) or "Unrecognized model" in str(exc):
            raise UnsupportedModelError(f"{model}: unknown architecture ({str(exc).splitlines()[0]})") from None
        raise


def check_servable_config(model: str, trust_remote_code: bool = False, with_class: bool = True):
    """Every check that needs only the config (no weights); returns the config.

    ``LLM(...)`` runs it through the model runner, ``serve`` also before it
    starts any worker. ``with_class=False`` leaves out ``check_causal_lm_class``,
    the part that imports the model's code.
    """
    config = load_config(model, trust_remote_code)
    check_config(config)
    if with_class:
        check_causal_lm_class(config)
    return config


def check_causal_lm_class(config) -> None:
    """Refuse what the transformers class of ``config`` shows (``check_model_class``). It imports
    the model's modeling module, and torch's compiler and distributed packages with it: most
    of the checks' time."""
    model_class = causal_lm_class(config)
    if model_class is not None:
        check_model_class(model_class, config.model_type)


def check_config(config) -> None:
    """Refuse what the config alone shows we cannot serve."""
    model_type = getattr(config, "model_type", None) or type(config).__name__
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"model type {model_type!r} is an encoder-decoder; "
                                    "pagedserve serves decoder-only models")
    towers = [name for name in ("vision_config", "audio_config", "audio_encoder_config")
              if getattr(config, name, None) is not None]
    if towers:
        raise UnsupportedModelError(
            f"model type {model_type!r} is multimodal ({', '.join(towers)}); "
            "pagedserve serves text-only decoders")
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        unknown = sorted({t for t in layer_types if t not in SERVED_LAYER_TYPES})
        if unknown:
            layers = [i for i, t in enumerate(layer_types) if t in unknown]
            kinds = ", ".join(f"{t!r} ({_LAYER_TYPE_FEATURES[t]})" if t in _LAYER_TYPE_FEATURES else repr(t)
                              for t in unknown)
            raise UnsupportedModelError(
                f"model type {model_type!r} has {kinds} layers (layers {_ranges(layers)}); "
                f"pagedserve runs only {' and '.join(SERVED_LAYER_TYPES)} layers")
    for name, feature in _UNSERVED_CONFIG_FEATURES.items():
        if getattr(config, name, None):
            raise UnsupportedModelError(
                f"model type {model_type!r} uses {feature} ({name}={getattr(config, name)!r}), "
                "which pagedserve does not implement")


def causal_lm_class(config):
    """The transformers class ``AutoModelForCausalLM`` would build for ``config``, or None
    (remote code, resolved only when the model loads)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        pass
    if "AutoModelForCausalLM" in (getattr(config, "auto_map", None) or {}):
        return None
    model_type = getattr(config, "model_type", None) or type(config).__name__
    raise UnsupportedModelError(
        f"model type {model_type!r} ({', '.join(getattr(config, 'architectures', None) or []) or 'no architectures'}) "
        "is not a causal language model transformers knows: unknown architecture")


# Families whose layers carry recurrent state (SSM, RNN or hybrid). transformers marked their classes
# ``_is_stateful`` until 5.25, which dropped the flag; the list keeps the refusal naming the reason.
RECURRENT_MODEL_TYPES = frozenset({
    "mamba", "mamba2", "falcon_mamba", "rwkv", "xlstm", "recurrent_gemma", "jamba", "zamba", "zamba2", "bamba",
    "falcon_h1", "nemotron_h", "granitemoehybrid", "lfm2",
})


def check_model_class(model_class, model_type: str) -> None:
    """Refuse classes that keep recurrent state, bypass the attention interface, or are
    not plain text decoders."""
    name = model_class.__name__
    if getattr(model_class, "_is_stateful", False) or model_type in RECURRENT_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model type {model_type!r} ({name}) has recurrent state outside the KV cache "
            "(Mamba, linear-attention or RNN layers); pagedserve serves attention-only decoders")
    if name.endswith("ForConditionalGeneration"):
        raise UnsupportedModelError(
            f"model type {model_type!r} loads as {name}, a multimodal or encoder-decoder model; "
            "pagedserve serves text-only decoders")
    if not getattr(model_class, "_supports_attention_backend", False):
        raise UnsupportedModelError(
            f"model type {model_type!r} ({name}) computes attention without transformers' "
            "attention interface, so pagedserve cannot page its KV cache")


def context_limit(config) -> tuple[int, str]:
    """The longest context this model computes exactly in a batched engine, and why."""
    model_type = getattr(config, "model_type", "?")
    limit = getattr(config, "max_position_embeddings", None) or 2048
    reason = f"the model's max_position_embeddings is {limit}"
    rope = getattr(config, "rope_parameters", None) or {}
    per_layer_type = rope.values() if rope and all(isinstance(v, dict) for v in rope.values()) else [rope]
    for params in per_layer_type:
        if params.get("rope_type") in _LENGTH_DEPENDENT_ROPE:
            original = params.get("original_max_position_embeddings")
            if original and original < limit:
                limit = original
                reason = (f"model type {model_type!r} uses {params['rope_type']} RoPE, whose frequencies "
                          f"switch when the longest sequence of a batch passes {original} tokens; "
                          "transformers' result then depends on the batch")
    return limit, reason


def check_max_model_len(max_model_len: int | None, limit: int, reason: str) -> int:
    """``max_model_len``, or ``limit`` (``context_limit``'s) where it is unset; ValueError,
    with ``reason``, where it asks for a longer context than the model computes exactly."""
    max_len = max_model_len or limit
    if max_len > limit:
        raise ValueError(f"max_model_len {max_len} is longer than this model computes exactly: "
                         f"{reason}; use max_model_len <= {limit}")
    return max_len


@dataclass(frozen=True)
class ModelAttention:
    """How every layer of a loaded model attends, and the cache shape it needs."""

    model_type: str
    layers: tuple[AttentionVariant, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int

    @property
    def sliding_windows(self) -> list[int | None]:
        return [layer.sliding_window for layer in self.layers]

    @property
    def is_all_windowed(self) -> bool:
        return all(w is not None for w in self.sliding_windows)

    @property
    def has_windows(self) -> bool:
        return any(w is not None for w in self.sliding_windows)

    @property
    def max_sliding_window(self) -> int | None:
        """The widest window when every layer has one (blocks beyond it may be freed), else None."""
        return max(self.sliding_windows) if self.is_all_windowed else None

    def describe(self) -> str:
        """One line: the attention variants and the layers that use each."""
        by_variant: dict[AttentionVariant, list[int]] = {}
        for i, layer in enumerate(self.layers):
            by_variant.setdefault(layer, []).append(i)
        parts = []
        for variant, layers in by_variant.items():
            features = variant.features or ["full attention"]
            parts.append(f"layers {_ranges(layers)}: {', '.join(features)}")
        return f"{self.model_type}: " + "; ".join(parts)


def probe_forward(model, config, device: torch.device) -> AttentionProbe:
    """A 4-token forward pass of the decoder whose attention calls an ``AttentionProbe`` records
    (no cache is read or written); returns the probe."""
    probe = AttentionProbe()
    ids = torch.arange(1, 5, device=device).unsqueeze(0) % config.vocab_size
    positions = torch.arange(4, device=device).unsqueeze(0)
    with torch.inference_mode():
        model.get_decoder()(input_ids=ids, position_ids=positions, paged_metadata=probe, use_cache=False)
    return probe


def probe_attention(model, config, device: torch.device) -> ModelAttention:
    """Run a 4-token forward pass that records each layer's attention call, and check them.

    Every decoder layer must call the attention function exactly once, with one
    cache shape for all layers and keys and values of one head size.
    """
    model_type = getattr(config, "model_type", "?")
    try:
        probe = probe_forward(model, config, device)
    except UnsupportedAttentionError as exc:
        raise UnsupportedModelError(f"model type {model_type!r}: {exc}") from None
    num_layers = config.num_hidden_layers
    if None in probe.calls:
        raise UnsupportedModelError(
            f"model type {model_type!r}: {probe.calls[None][0].module_type} attends without a "
            "layer index, so pagedserve cannot give it a KV cache")
    missing = [i for i in range(num_layers) if i not in probe.calls]
    if missing:
        raise UnsupportedModelError(
            f"model type {model_type!r}: layers {_ranges(missing)} do not attend through "
            "transformers' attention interface (recurrent, convolutional or custom layers)")
    extra = sorted(i for i, calls in probe.calls.items() if i >= num_layers or len(calls) != 1)
    if extra:
        raise UnsupportedModelError(
            f"model type {model_type!r}: layers {_ranges(extra)} attend more or less than once "
            f"per forward pass, or beyond num_hidden_layers={num_layers}")
    calls = [probe.calls[i][0] for i in range(num_layers)]
    shapes = {(c.num_heads, c.num_kv_heads, c.head_dim) for c in calls}
    if len(shapes) != 1:
        raise UnsupportedModelError(
            f"model type {model_type!r}: layers differ in (heads, kv heads, head dim) {sorted(shapes)}; "
            "pagedserve's cache holds one shape for every layer")
    num_heads, num_kv_heads, head_dim = shapes.pop()
    if any(c.value_head_dim != head_dim for c in calls):
        raise UnsupportedModelError(
            f"model type {model_type!r}: keys and values have different head sizes "
            f"({head_dim} and {calls[0].value_head_dim}, as in multi-head latent attention)")
    if num_heads % num_kv_heads:
        raise UnsupportedModelError(f"model type {model_type!r}: {num_heads} query heads do not "
                                    f"share {num_kv_heads} kv heads evenly")
    return ModelAttention(model_type, tuple(c.variant for c in calls), num_heads, num_kv_heads, head_dim)


def check_kernel_support(attention: ModelAttention, device: torch.device, dtype: torch.dtype,
                         backend: str | None) -> None:
    """Run each distinct layer variant once through the kernels (prefill and decode, on a
    one-block cache); a variant a backend does not implement is refused here, at load."""
    block_size, num_tokens = 16, 3
    cache_shape = (1, block_size, attention.num_kv_heads, attention.head_dim)
    k_cache = torch.zeros(cache_shape, dtype=dtype, device=device)
    v_cache = torch.zeros(cache_shape, dtype=dtype, device=device)
    tables = torch.zeros((1, 1), dtype=torch.int32, device=device)
    seq_lens = torch.tensor([num_tokens], dtype=torch.int32, device=device)
    cu_seqlens = torch.tensor([0, num_tokens], dtype=torch.int32, device=device)
    q = torch.zeros((num_tokens, attention.num_heads, attention.head_dim), dtype=dtype, device=device)
    for variant in dict.fromkeys(attention.layers):
        kwargs = dict(sliding_window=variant.sliding_window, logit_softcap=variant.logit_softcap,
                      sinks=(torch.zeros(attention.num_heads, dtype=dtype, device=device)
                             if variant.has_sinks else None))
        try:
            kernels.paged_attention(q, k_cache, v_cache, tables, cu_seqlens, seq_lens, variant.scale,
                                    backend=backend, **kwargs)
            kernels.paged_decode_attention(q[-1:], k_cache, v_cache, tables, seq_lens, variant.scale,
                                           backend=backend, **kwargs)
        except NotImplementedError as exc:
            used = kernels.select_backend(device) if backend is None else backend
            raise UnsupportedModelError(
                f"model type {attention.model_type!r} needs {', '.join(variant.features)}, which the "
                f"{used!r} kernel backend does not implement ({exc})") from None


def _ranges(indices: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    parts, start = [], None
    for i, index in enumerate(indices):
        if start is None:
            start = index
        if i + 1 == len(indices) or indices[i + 1] != index + 1:
            parts.append(str(start) if start == index else f"{start}-{index}")
            start = None
    return ", ".join(parts)
