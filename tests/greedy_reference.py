"""transformers' greedy tokens, the oracle of the engine's: ``generate(do_sample=False)`` in
float32 on CPU, one prompt at a time (no padding), stopping at EOS as the engine does (the
EOS token included)."""

from __future__ import annotations

from typing import Callable, Hashable

import torch


class GreedyReference:
    """``reference(model_key, prompt, max_tokens, **generate_kwargs) -> list[int]``, memoised
    per call and per model: ``load(model_key)`` gives the model the first time a key is asked.
    Extra keyword arguments (``repetition_penalty``, say) go to ``generate``."""

    def __init__(self, load: Callable[[Hashable], torch.nn.Module]) -> None:
        self._load = load
        self._models: dict[Hashable, torch.nn.Module] = {}
        self._tokens: dict[tuple, list[int]] = {}

    def __call__(self, model_key: Hashable, prompt, max_tokens: int, **generate_kwargs) -> list[int]:
        key = (model_key, tuple(prompt), max_tokens, tuple(sorted(generate_kwargs.items())))
        if key not in self._tokens:
            if model_key not in self._models:
                self._models[model_key] = self._load(model_key).eval()
            ids = torch.tensor([list(prompt)], dtype=torch.long)
            with torch.inference_mode():
                out = self._models[model_key].generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                                       max_new_tokens=max_tokens, **generate_kwargs)
            self._tokens[key] = out[0, ids.shape[1]:].tolist()
        return self._tokens[key]
