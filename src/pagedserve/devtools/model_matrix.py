"""Tiny random checkpoints of many transformers decoder architectures, variants switched on.

Each entry of ``MATRIX`` is a config class of transformers with the features
that make it differ from Llama turned on and made small enough to matter in a
short test: sliding windows of 16-32 tokens (alternating with full attention
where the architecture does), attention and final logit soft-caps that bite,
learned sinks, custom attention scaling, Llama 3 RoPE scaling, mixture-of-experts
layers. ``ensure_matrix_model(name)`` builds one into the model cache (next to
``make-model``'s checkpoints) with the same tokenizer and generation config as
``model_factory``, and returns its path.

Shapes: hidden 64, 2 layers (one sliding, one full where layers alternate),
4 query heads of 16 over 2 kv heads, vocab 1024, 512 positions.
"""

from __future__ import annotations

import json
from pathlib import Path

from .model_factory import IM_END_TOKEN, SPECIAL_TOKENS, build_once, build_tokenizer, default_cache_dir

MATRIX_VERSION = 1
_MARKER_FILE = "pagedserve_matrix_model.json"

_COMMON = dict(
    vocab_size=1024, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
    tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)
_SLIDING_THEN_FULL = ["sliding_attention", "full_attention"]

# name -> (transformers model_type, config overrides)
MATRIX: dict[str, tuple[str, dict]] = {
    "llama": ("llama", dict(rope_parameters={
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "mistral": ("mistral", dict(sliding_window=20)),
    "qwen2": ("qwen2", dict(use_sliding_window=True, sliding_window=24, max_window_layers=1)),
    "qwen3": ("qwen3", dict()),
    "gemma": ("gemma", dict()),
    "gemma2": ("gemma2", dict(sliding_window=16, attn_logit_softcapping=3.0,
                              final_logit_softcapping=5.0, query_pre_attn_scalar=24,
                              layer_types=_SLIDING_THEN_FULL)),
    "gemma3_text": ("gemma3_text", dict(sliding_window=28, query_pre_attn_scalar=24,
                                        layer_types=_SLIDING_THEN_FULL)),
    "cohere2": ("cohere2", dict(sliding_window=24, layer_types=_SLIDING_THEN_FULL)),
    "phi3": ("phi3", dict(sliding_window=20)),
    "granite": ("granite", dict(attention_multiplier=0.2, embedding_multiplier=2.0,
                                residual_multiplier=0.5, logits_scaling=2.0)),
    "mixtral": ("mixtral", dict(sliding_window=32, num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                    norm_topk_prob=True)),
    "gpt_oss": ("gpt_oss", dict(sliding_window=18, num_local_experts=4, num_experts_per_tok=2,
                                layer_types=_SLIDING_THEN_FULL, rope_parameters={
                                    "rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0,
                                    "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                    "original_max_position_embeddings": 64})),
}

# Init scales as in model_factory: random logits that vary across positions.
_EMBED_STD = 1.0
_LOGIT_STD = 3.0
_BIAS_STD = 0.02


def build_matrix_config(name: str, **overrides):
    """The transformers config of matrix entry ``name`` (no weights)."""
    from transformers import AutoConfig

    if name not in MATRIX:
        raise ValueError(f"unknown matrix model {name!r}; choose one of {', '.join(MATRIX)}")
    model_type, variant = MATRIX[name]
    return AutoConfig.for_model(model_type, **{**_COMMON, **variant, **overrides, "dtype": "float32"})


def make_matrix_model(name: str, out_dir, seed: int = 0, **overrides) -> Path:
    """Write the random-weight float32 checkpoint of ``name`` (weights, tokenizer, generation
    config) into ``out_dir``; the same ``(name, seed)`` gives the same weights. ``overrides``
    change config fields (for one-off variants; ``ensure_matrix_model`` caches none)."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = build_matrix_config(name, **overrides)
    with torch.random.fork_rng(devices=[]):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _init_weights(model, seed)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, pad_token_id=config.pad_token_id, do_sample=False,
        eos_token_id=[config.eos_token_id, SPECIAL_TOKENS.index(IM_END_TOKEN)])
    model.save_pretrained(out_dir)
    build_tokenizer(config.vocab_size, config.max_position_embeddings).save_pretrained(out_dir)
    marker = {"name": name, "seed": seed, "matrix_version": MATRIX_VERSION}
    (out_dir / _MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")
    return out_dir


def ensure_matrix_model(name: str, cache_dir=None, seed: int = 0) -> Path:
    """Path of the cached checkpoint of ``name``, built on first use (safe across processes)."""
    if name not in MATRIX:
        raise ValueError(f"unknown matrix model {name!r}; choose one of {', '.join(MATRIX)}")
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = root / f"matrix-{name}-v{MATRIX_VERSION}-seed{seed}"
    return build_once(final, _MARKER_FILE, lambda tmp: make_matrix_model(name, tmp, seed=seed))


def _init_weights(model, seed: int) -> None:
    """Every parameter from one seeded generator, in name order, by role."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    params = dict(model.named_parameters())
    for name in sorted(params):
        param = params[name]
        leaf = name.rsplit(".", 1)[-1]
        with torch.no_grad():
            if "norm" in name and param.dim() == 1:
                param.fill_(1.0)
            elif leaf == "bias" or leaf.endswith("_bias"):
                param.normal_(0.0, _BIAS_STD, generator=generator)
            elif leaf == "sinks":
                param.normal_(0.0, 1.0, generator=generator)
            elif name.endswith("embed_tokens.weight"):
                param.normal_(0.0, _EMBED_STD, generator=generator)
            elif name.endswith("lm_head.weight"):
                param.normal_(0.0, _LOGIT_STD * param.shape[1] ** -0.5, generator=generator)
                param[: len(SPECIAL_TOKENS)] = 0.0  # greedy never ends early
            elif param.dim() == 2:  # linear [out, in]
                param.normal_(0.0, param.shape[1] ** -0.5, generator=generator)
            elif param.dim() == 3:  # stacked experts; the smaller matrix side is the fan-in here
                param.normal_(0.0, min(param.shape[1:]) ** -0.5, generator=generator)
            else:
                raise RuntimeError(f"no init rule for parameter {name} of shape {tuple(param.shape)}")
