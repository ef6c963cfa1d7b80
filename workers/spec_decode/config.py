"""``speculative_config``: vLLM's keys, checked once, torch-free (the cluster's schema loads it);
and the rules a draft model's or EAGLE head's config must meet against the target's, which the
engine checks when it loads one and ``serve`` before any worker starts."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# vLLM's method names. Only these are implemented; the others are refused by name.
SUPPORTED_METHODS = ("ngram", "draft_model", "eagle", "eagle3")
# Methods that read a checkpoint named by ``model``.
MODEL_METHODS = ("draft_model", "eagle", "eagle3")
SpeculativeMethod = Literal["ngram", "draft_model", "eagle", "eagle3", "mtp", "medusa", "mlp_speculator",
                            "suffix"]
# vLLM's spellings of "no model, prompt lookup" in ``model``.
NGRAM_MODEL_NAMES = ("ngram", "[ngram]")
# vLLM's prompt lookup window when neither bound is given.
DEFAULT_PROMPT_LOOKUP = 5


class SpeculativeConfig(BaseModel):
    """Speculative decoding (vLLM's ``speculative_config``): each decoding sequence proposes up
    to ``num_speculative_tokens`` tokens, which the target model verifies in one forward pass;
    output is exactly what decoding without speculation gives (token for token when greedy, the
    same distribution when sampled). Sequences that use per-token features the verifier cannot
    honour (several samples, KV exports) decode one token at a time; beam search is refused.
    Two rules switch proposals off: ``disable_by_batch_size`` for a step, and a back-off for a
    sequence whose drafts keep nothing (after r such drafts in a row it skips the next
    min(2^(r-1), 64) tokens' proposals; a draft that keeps a token resets it)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)

    method: SpeculativeMethod | None = None
    """How tokens are proposed. "ngram": prompt lookup over the request's own tokens (no model).
    "draft_model": a smaller model with the target's vocabulary, run by the same engine on KV
    in the target's blocks, proposes its greedy continuation. "eagle" and "eagle3": an EAGLE
    or EAGLE-3 head (vLLM's Eagle(3)LlamaForCausalLM layouts) proposes from the target's
    hidden states. vLLM's other methods (mtp, ...) are refused: not supported yet. Unset:
    "ngram" when ``model`` is "ngram" or "[ngram]", else "draft_model" when ``model`` is set."""
    model: str | None = None
    """The draft model or EAGLE head (vLLM's key): a checkpoint path or hub id, for
    "draft_model", "eagle" and "eagle3"; unset, "ngram" or "[ngram]" for "ngram"."""
    num_speculative_tokens: int = Field(ge=1, le=64)
    """Tokens proposed per sequence and step at most (k); a verification step computes k + 1."""
    prompt_lookup_min: int | None = Field(None, ge=1)
    """ngram: the shortest suffix of the request's tokens looked up earlier in them. Unset: as
    ``prompt_lookup_max``, or 5 when both are unset (vLLM's defaults)."""
    prompt_lookup_max: int | None = Field(None, ge=1)
    """ngram: the longest suffix looked up (tried first, then shorter ones down to
    ``prompt_lookup_min``). Unset: as ``prompt_lookup_min``, or 5 when both are unset."""
    disable_by_batch_size: int | None = Field(None, ge=2)
    """No sequence proposes in a step whose running batch holds at least this many sequences
    (verification then costs more compute than it saves). Unset: never disabled."""

    @model_validator(mode="after")
    def _resolve(self) -> "SpeculativeConfig":
        method = self.method
        if method is None:
            if self.model is None:
                raise ValueError("speculative_config: set method (\"ngram\" or \"draft_model\") or model "
                                 "(a draft model, or \"ngram\")")
            method = "ngram" if self.model in NGRAM_MODEL_NAMES else "draft_model"
            object.__setattr__(self, "method", method)
        elif method not in SUPPORTED_METHODS:
            raise ValueError(f"speculative_config.method {method!r} is not supported yet "
                             f"(supported: {', '.join(SUPPORTED_METHODS)})")
        if method == "ngram" and self.model is not None and self.model not in NGRAM_MODEL_NAMES:
            raise ValueError(f"speculative_config.model {self.model!r}: method \"ngram\" takes no model "
                             "(set method \"draft_model\" to propose with a draft model)")
        if method in MODEL_METHODS and self.model in (None, *NGRAM_MODEL_NAMES):
            raise ValueError(f"speculative_config.method \"{method}\" needs model: the checkpoint path or "
                             "hub id of the draft model or head")
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low is None and high is None:
            low = high = DEFAULT_PROMPT_LOOKUP
        low = high if low is None else low
        high = low if high is None else high
        if low > high:
            raise ValueError(f"speculative_config.prompt_lookup_min ({low}) is above "
                             f"speculative_config.prompt_lookup_max ({high})")
        object.__setattr__(self, "prompt_lookup_min", low)
        object.__setattr__(self, "prompt_lookup_max", high)
        return self


def check_draft_fits(model: str, vocab_size: int, target_vocab_size: int, max_context_len: int,
                     context_reason: str, max_model_len: int) -> None:
    """Refuse a draft model ("draft_model") that cannot propose for its target: another
    vocabulary, or a shorter exact context than ``max_model_len``. The engine checks the loaded
    draft with it, and ``serve`` the draft's config before any worker starts."""
    if vocab_size != target_vocab_size:
        raise ValueError(f"speculative_config.model {model!r}: its vocabulary has {vocab_size} tokens, the "
                         f"target's {target_vocab_size}; a draft model must share the target's vocabulary")
    if max_context_len < max_model_len:
        raise ValueError(f"speculative_config.model {model!r} computes at most {max_context_len} tokens of "
                         f"context ({context_reason}), less than max_model_len {max_model_len}; "
                         "lower max_model_len")


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """vLLM's Llama default for an EAGLE-3 head: the hidden states entering these layers of the
    target."""
    return (2, num_layers // 2, num_layers - 3)


def check_eagle_head_fits(model: str, config, target_config, method: str) -> tuple[int, ...] | None:
    """Refuse an EAGLE ("eagle") or EAGLE-3 ("eagle3") head whose config (transformers') does not
    fit the target's text config: another family, another width, or for EAGLE-3 more than one
    layer or aux hidden state layers the target lacks. Returns an EAGLE-3 head's aux layers.
    The engine checks a head with it when it loads one, and ``serve`` before any worker starts."""
    if config.model_type != "llama":
        raise ValueError(f"speculative_config.model {model!r}: an EAGLE head of model_type {config.model_type!r}; "
                         "only Llama-layer heads (vLLM's Eagle(3)LlamaForCausalLM layouts) are supported")
    target_hidden = getattr(config, "target_hidden_size", None) or config.hidden_size
    if target_hidden != target_config.hidden_size:
        raise ValueError(f"speculative_config.model {model!r}: an EAGLE head of width {target_hidden} for a "
                         f"target of width {target_config.hidden_size}")
    if method != "eagle3":
        return None
    if config.num_hidden_layers != 1:
        raise ValueError(f"speculative_config.model {model!r}: an EAGLE-3 head of {config.num_hidden_layers} "
                         "layers; only one-layer heads (midlayer) are supported")
    num_layers = target_config.num_hidden_layers
    aux = tuple(getattr(config, "eagle_aux_hidden_state_layer_ids", None) or default_aux_layers(num_layers))
    if len(aux) != 3 or not all(0 <= i < num_layers for i in aux):
        raise ValueError(f"speculative_config.model {model!r}: aux hidden state layers {list(aux)} for a "
                         f"target of {num_layers} layers (set eagle_aux_hidden_state_layer_ids)")
    return aux
