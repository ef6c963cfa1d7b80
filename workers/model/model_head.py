"""The causal LM's own head, applied to chosen rows of the decoder's output."""

from __future__ import annotations

import torch

from .attention import AttentionProbe
from .model_support import UnsupportedModelError


class ModelHead:
    """Logits exactly as the transformers causal LM computes them from decoder outputs.

    That is ``lm_head`` plus whatever the model's forward does after it (Gemma 2's
    final soft-cap, Cohere's logit scale, Granite's logit divisor). For a plain
    head it calls ``lm_head`` directly; otherwise it runs the causal LM's own
    forward with the decoder answering the given hidden states, so no model's
    post-processing has to be known by name. The constructor checks, on a short
    probe input, that this reproduces the model's forward pass.
    """

    def __init__(self, model, device: torch.device) -> None:
        self.model = model
        self.decoder = model.get_decoder()
        self.lm_head = model.get_output_embeddings()
        generator = torch.Generator().manual_seed(0)
        hidden = torch.randn((3, model.config.get_text_config().hidden_size), generator=generator)
        hidden = hidden.to(device=device, dtype=self.lm_head.weight.dtype)
        with torch.inference_mode():
            self.is_plain = torch.equal(self._through_model(hidden), self.lm_head(hidden).float())
            self._check(device)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden`` [n, hidden_size] -> float32 logits [n, vocab]."""
        if self.is_plain:
            return self.lm_head(hidden).float()
        return self._through_model(hidden)

    def _through_model(self, hidden: torch.Tensor) -> torch.Tensor:
        outputs = _DecoderOutput(hidden.unsqueeze(0))
        self.decoder.forward = lambda *args, **kwargs: outputs
        try:
            ids = torch.zeros((1, hidden.shape[0]), dtype=torch.int64, device=hidden.device)
            logits = self.model(input_ids=ids, use_cache=False).logits[0]
        finally:
            del self.decoder.forward
        return logits.float()

    def _check(self, device: torch.device) -> None:
        """Decoder then head must equal the causal LM's forward (attention stubbed out)."""
        ids = torch.arange(1, 5, device=device).unsqueeze(0) % self.model.config.get_text_config().vocab_size
        positions = torch.arange(4, device=device).unsqueeze(0)
        kwargs = dict(input_ids=ids, position_ids=positions, use_cache=False)
        expected = self.model(paged_metadata=AttentionProbe(), **kwargs).logits[0].float()
        hidden = self.decoder(paged_metadata=AttentionProbe(), **kwargs).last_hidden_state[0]
        if not torch.allclose(self(hidden), expected, rtol=1e-4, atol=1e-4):
            raise UnsupportedModelError(
                f"model type {self.model.config.model_type!r}: {type(self.model).__name__}'s forward "
                "computes its logits from more than the decoder's last hidden states")


class _DecoderOutput:
    """A decoder's output holding only the last hidden states; every other field
    (router logits, past key values, ...) reads as None."""

    def __init__(self, last_hidden_state: torch.Tensor) -> None:
        self.last_hidden_state = last_hidden_state

    def __getitem__(self, index):
        return (self.last_hidden_state,)[index]

    def __getattr__(self, name):
        return None
