"""EAGLE heads in the layouts vLLM loads, attending through the paged cache.

- **EAGLE** (method "eagle", vLLM's ``EagleLlamaForCausalLM``): ``fc`` maps [embedding of
  token i + 1, the target's last hidden state at i] to Llama decoder layers, the first
  without its input norm; their output estimates the target's hidden state at i + 1, and
  the target's LM head reads it. Embeddings and LM head are the target's (a checkpoint's own
  ``embed_tokens`` is not read, as in vLLM).
- **EAGLE-3** (method "eagle3", vLLM's ``Eagle3LlamaForCausalLM``): the target's hidden
  states entering three of its layers (``eagle_aux_hidden_state_layer_ids``; vLLM's default
  for Llama is 2, L // 2 and L - 3) go through ``fc`` (3H -> H). One decoder layer
  (``midlayer``) attends over [input_layernorm(embedding), hidden_norm(hidden)] (2H wide);
  ``norm`` and the head's own ``lm_head`` over a draft vocabulary give its token, mapped to
  the target's by ``d2t`` (target id = draft id + d2t[draft id]). The next proposal reads the
  layer's output before ``norm``. Embeddings are the head's if the checkpoint has them, else
  the target's.

Each head answers the same calls: ``features`` (what it takes from the target's step),
``forward`` (an estimate to read a token from, and the state the next proposal reads),
``tokens`` (the greedy token of an estimate, in the target's vocabulary) and ``embed``.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..model.attention import PagedAttentionMetadata, register_paged_attention
from ..model.model_runner import ModelRunner
from .config import check_eagle_head_fits


class EagleHead(torch.nn.Module):
    """EAGLE's head (module docstring)."""

    aux_layer_ids: tuple[int, ...] | None = None

    def __init__(self, config, has_fc_bias: bool, target: ModelRunner) -> None:
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

        super().__init__()
        config._attn_implementation = register_paged_attention()
        hidden = config.hidden_size
        self.fc = torch.nn.Linear(2 * hidden, hidden, bias=has_fc_bias)
        self.layers = torch.nn.ModuleList([LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.layers[0].input_layernorm = torch.nn.Identity()
        self.rotary_emb = LlamaRotaryEmbedding(config)
        self._target = target

    def features(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self._target.model.get_input_embeddings()(token_ids)

    def forward(self, embeddings: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                meta: PagedAttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """The estimates of the target's next hidden states ([tokens, hidden]), twice: to read
        tokens from, and as the next proposal's ``hidden``."""
        states = self.fc(torch.cat([embeddings, hidden], dim=-1)).unsqueeze(0)
        position_ids = positions.unsqueeze(0)
        rotary = self.rotary_emb(states, position_ids)
        for layer in self.layers:
            states = layer(states, position_ids=position_ids, position_embeddings=rotary, paged_metadata=meta)
        return states[0], states[0]

    def tokens(self, estimates: torch.Tensor) -> torch.Tensor:
        return self._target.compute_logits(estimates).argmax(dim=-1)


class Eagle3Head(torch.nn.Module):
    """EAGLE-3's head (module docstring): one ``midlayer``."""

    def __init__(self, config, aux_layer_ids: tuple[int, ...], has_embeddings: bool, target: ModelRunner) -> None:
        from transformers.models.llama.modeling_llama import (LlamaAttention, LlamaMLP, LlamaRMSNorm,
                                                              LlamaRotaryEmbedding)

        super().__init__()
        config._attn_implementation = register_paged_attention()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        target_hidden = getattr(config, "target_hidden_size", None) or hidden
        self.aux_layer_ids = aux_layer_ids
        self.norm_before_residual = bool(getattr(config, "norm_before_residual", False))
        self.fc = torch.nn.Linear(len(aux_layer_ids) * target_hidden, hidden, bias=False)
        self.midlayer = torch.nn.Module()
        layer = self.midlayer
        layer.input_layernorm = LlamaRMSNorm(hidden, eps=eps)
        layer.hidden_norm = LlamaRMSNorm(hidden, eps=eps)
        layer.self_attn = LlamaAttention(config, 0)
        attention = layer.self_attn
        bias = bool(getattr(config, "attention_bias", False))
        for name in ("q_proj", "k_proj", "v_proj"):   # over [embedding, hidden]: 2H wide
            setattr(attention, name, torch.nn.Linear(2 * hidden, getattr(attention, name).out_features, bias=bias))
        layer.post_attention_layernorm = LlamaRMSNorm(hidden, eps=eps)
        layer.mlp = LlamaMLP(config)
        self.norm = LlamaRMSNorm(hidden, eps=eps)
        draft_vocab = getattr(config, "draft_vocab_size", None) or config.vocab_size
        self.lm_head = torch.nn.Linear(hidden, draft_vocab, bias=False)
        self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.int64))
        self.embed_tokens = torch.nn.Embedding(config.vocab_size, hidden) if has_embeddings else None
        self.rotary_emb = LlamaRotaryEmbedding(config)
        self._target = target

    def features(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """The target's hidden states entering the aux layers, side by side ([tokens, 3H]), through ``fc``."""
        return self.fc(aux_hidden)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is not None:
            return self.embed_tokens(token_ids)
        return self._target.model.get_input_embeddings()(token_ids)

    def forward(self, embeddings: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                meta: PagedAttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(the normed output, to read tokens from; the output before ``norm``, the next
        proposal's ``hidden``), each [tokens, hidden]."""
        layer = self.midlayer
        if self.norm_before_residual:
            hidden = layer.hidden_norm(hidden)
            residual = hidden
        else:
            residual = hidden
            hidden = layer.hidden_norm(hidden)
        states = torch.cat([layer.input_layernorm(embeddings), hidden], dim=-1).unsqueeze(0)
        position_ids = positions.unsqueeze(0)
        rotary = self.rotary_emb(residual.unsqueeze(0), position_ids)
        attended, _ = layer.self_attn(states, position_embeddings=rotary, attention_mask=None, paged_metadata=meta)
        residual = attended[0] + residual
        residual = layer.mlp(layer.post_attention_layernorm(residual)) + residual
        return self.norm(residual), residual

    def tokens(self, estimates: torch.Tensor) -> torch.Tensor:
        draft_ids = self.lm_head(estimates).argmax(dim=-1)
        return draft_ids + self.d2t.index_select(0, draft_ids)


def load_eagle_head(model: str, target: ModelRunner, method: str) -> tuple[torch.nn.Module, object]:
    """The head in ``model`` (a folder, or a hub id) for ``method`` ("eagle" or "eagle3"), on
    the target's device and dtype, and its config. Refuses a head of another width, family or
    layout, naming why."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(_resolve(model))
    aux = check_eagle_head_fits(model, config, target.config.get_text_config(), method)
    names = {name.removeprefix("model."): tensor for name, tensor in _read_weights(_resolve(model)).items()}
    if method == "eagle3":
        names = {name.replace("layers.0.", "midlayer."): tensor for name, tensor in names.items()}
        names.pop("t2d", None)                       # the reverse map, not needed
        head = Eagle3Head(config, aux, "embed_tokens.weight" in names, target)
        skipped = {"rotary_emb."}
    else:
        names.pop("embed_tokens.weight", None)       # the target's embeddings are used
        head = EagleHead(config, "fc.bias" in names, target)
        skipped = {"rotary_emb.", "layers.0.input_layernorm."}
    expected = {name for name in head.state_dict() if not any(name.startswith(s) for s in skipped)}
    unknown, missing = set(names) - expected, expected - set(names)
    if unknown or missing:
        layout = "EAGLE-3" if method == "eagle3" else "EAGLE"
        raise ValueError(f"speculative_config.model {model!r} is not an {layout} head in vLLM's layout: "
                         + "; ".join(part for part in (f"unexpected {sorted(unknown)[:5]}" if unknown else "",
                                                       f"missing {sorted(missing)[:5]}" if missing else "") if part))
    head.load_state_dict(names, strict=False)
    head = head.to(device=target.device, dtype=target.dtype).eval()
    if method == "eagle3":
        head.d2t = head.d2t.to(torch.int64)
    return head, config


def _resolve(model: str) -> str:
    if os.path.isdir(model):
        return model
    from huggingface_hub import snapshot_download

    return snapshot_download(model)


def _read_weights(path: str) -> dict[str, torch.Tensor]:
    folder = Path(path)
    tensors: dict[str, torch.Tensor] = {}
    files = sorted(folder.glob("*.safetensors"))
    if files:
        from safetensors.torch import load_file

        for file in files:
            tensors.update(load_file(str(file)))
        return tensors
    files = sorted(folder.glob("pytorch_model*.bin"))
    if not files:
        raise ValueError(f"speculative_config.model {path!r}: no *.safetensors or pytorch_model*.bin weights")
    for file in files:
        tensors.update(torch.load(file, map_location="cpu", weights_only=True))
    return tensors
