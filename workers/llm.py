"""The offline API, following vLLM's: ``LLM(model=...).generate(prompts, params)``."""

from __future__ import annotations

from typing import Sequence

from .beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from .engine import EngineConfig, LLMEngine
from .request import RequestOutput
from .sampling_params import SamplingParams


class LLM:
    """Generate for a batch of prompts with continuous batching on a paged KV cache.

    Keyword arguments are ``EngineConfig`` fields (``dtype``, ``device``,
    ``block_size``, ``num_device_blocks``, ``kv_cache_memory_gb``,
    ``swap_space_gb``, ``enable_prefix_caching``, ``preemption_mode``,
    ``max_num_seqs``, ``max_num_batched_tokens``, ``max_model_len``, ...).
    An unknown keyword raises TypeError.
    """

    def __init__(self, model: str, **kwargs) -> None:
        self.engine = LLMEngine(EngineConfig.from_kwargs(model=model, **kwargs))
        self._next_id = 0

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Outputs in input order. A prompt is a string or a list of token ids.

        Every request is validated before any runs: a bad one raises
        ValueError and nothing is queued.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = ([sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams)
                  else list(sampling_params))
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        ids = []
        try:
            for prompt, param, prio in zip(prompts, params, priorities):
                request_id = f"offline-{self._next_id}"
                self._next_id += 1
                self.engine.add_request(request_id, prompt, param, prio, output_kind="final")
                ids.append(request_id)
        except Exception:
            if ids:
                for request_id in ids:
                    self.engine.abort_request(request_id)
                self.engine.step()  # collect the abort outputs
            raise
        wanted = set(ids)
        finished: dict[str, RequestOutput] = {}
        try:
            while len(finished) < len(ids):
                for output in self.engine.step():
                    if output.finished and output.request_id in wanted:
                        finished[output.request_id] = output
        except BaseException:
            # Interrupted (Ctrl-C, a failed step): drop this call's requests, and the
            # prefix cache, whose newest blocks may have been planned but never written.
            for request_id in ids:
                self.engine.abort_request(request_id)
            self.engine.reset_prefix_cache()
            raise
        return [finished[request_id] for request_id in ids]

    def beam_search(self, prompts: Sequence[str | Sequence[int] | dict], params: BeamSearchParams
                    ) -> list[BeamSearchOutput]:
        """vLLM's ``LLM.beam_search``: the ``params.beam_width`` best beams of each prompt,
        best first, in input order. A prompt is a string, a list of token ids, or vLLM's
        ``{"prompt": ...}`` / ``{"prompt_token_ids": [...]}``. The beams share their
        prefix's KV blocks (see ``beam_groups.py``); the search is transformers'
        ``generate(num_beams=beam_width, do_sample=False)``.
        """
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = [_prompt_of(p) for p in prompts]
        outputs = self.generate(prompts, params.to_sampling_params())
        return [BeamSearchOutput([BeamSearchSequence(output.prompt_token_ids + completion.token_ids,
                                                     completion.cumulative_logprob, completion.text,
                                                     completion.finish_reason, completion.stop_reason)
                                  for completion in output.outputs])
                for output in outputs]

    def reset_prefix_cache(self) -> bool:
        """Forget all cached prefixes (only while idle); True if done."""
        return self.engine.reset_prefix_cache()

    def stats(self) -> dict:
        return self.engine.stats()

    def check_integrity(self) -> None:
        self.engine.check_integrity()


def _prompt_of(prompt: str | Sequence[int] | dict) -> str | list[int]:
    """A prompt as ``generate`` takes it (vLLM's dict forms unwrapped)."""
    if not isinstance(prompt, dict):
        return prompt
    if set(prompt) == {"prompt"}:
        return prompt["prompt"]
    if set(prompt) == {"prompt_token_ids"}:
        return list(prompt["prompt_token_ids"])
    raise ValueError(f"a prompt dict has either 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}")
