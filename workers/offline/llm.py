"""The offline API, following vLLM's: ``LLM(model=...).generate(prompts, params)`` and
``LLM.chat(messages, params)``."""

from __future__ import annotations

import time
from typing import Sequence

from ..engine.engine import EngineConfig, LLMEngine
from ..lora.lora_request import LoRARequest
from ..outputs.request_output import RequestOutput
from ..sample.beam_search import BeamSearchOutput, BeamSearchSequence
from ..sample.generation_defaults import sampling_defaults
from ..sample.sampling_params import BeamSearchParams, SamplingParams
from .chat_template import load_chat_template, render_conversation, template_message


class LLM:
    """Generate for a batch of prompts with continuous batching on a paged KV cache.

    Keyword arguments are ``EngineConfig`` fields (``dtype``, ``device``,
    ``block_size``, ``num_device_blocks``, ``kv_cache_memory_gb``,
    ``swap_space_gb``, ``enable_prefix_caching``, ``preemption_mode``,
    ``max_num_seqs``, ``max_num_batched_tokens``, ``max_model_len``, ``enable_lora``,
    ``max_loras``, ``max_lora_rank``, ...). An unknown keyword raises TypeError.
    """

    def __init__(self, model: str, **kwargs) -> None:
        self.engine = LLMEngine(EngineConfig.from_kwargs(model=model, **kwargs))
        self._next_id = 0
        self._sampling_defaults: dict | None = None   # read from the checkpoint once, when first asked

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: the sampling the model's generation_config.json recommends (its temperature,
        top_p, top_k, min_p, repetition_penalty, max_new_tokens), else ``SamplingParams()``'s;
        what ``generate`` and ``chat`` use when given no sampling params."""
        if self._sampling_defaults is None:
            self._sampling_defaults = sampling_defaults(self.engine.config.model)
        return SamplingParams(**self._sampling_defaults)

    def generate(self, prompts: str | Sequence[int] | dict | Sequence[str | Sequence[int] | dict],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 priority: Sequence[int] | None = None, *, use_tqdm: bool = True,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Outputs in input order. A prompt is a string, a list of token ids, or vLLM's
        ``{"prompt": ...}`` / ``{"prompt_token_ids": [...]}``. ``use_tqdm``: a progress bar
        of the requests finished, with the token rates so far (vLLM's), on stderr.
        ``lora_request``: the LoRA adapter of every prompt, or one per prompt (None: the base
        model); the engine needs ``enable_lora=True``.

        Every request is validated before any runs: a bad one raises
        ValueError and nothing is queued.
        """
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = [_prompt_of(p) for p in prompts]
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = ([sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams)
                  else list(sampling_params))
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        adapters = (list(lora_request) if isinstance(lora_request, (list, tuple))
                    else [lora_request] * len(prompts))
        if len(adapters) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(adapters)} lora requests")
        ids = []
        try:
            for prompt, param, prio, adapter in zip(prompts, params, priorities, adapters):
                request_id = f"offline-{self._next_id}"
                self._next_id += 1
                self.engine.add_request(request_id, prompt, param, prio, output_kind="final",
                                        lora_request=adapter)
                ids.append(request_id)
        except Exception:
            if ids:
                for request_id in ids:
                    self.engine.abort_request(request_id)
                self.engine.step()  # collect the abort outputs
            raise
        wanted = set(ids)
        finished: dict[str, RequestOutput] = {}
        progress = _Progress(len(ids)) if use_tqdm else None
        try:
            while len(finished) < len(ids):
                for output in self.engine.step():
                    if output.finished and output.request_id in wanted:
                        finished[output.request_id] = output
                        if progress is not None:
                            progress.finished(output)
        except BaseException:
            # Interrupted (Ctrl-C, a failed step): drop this call's requests, and the
            # prefix cache, whose newest blocks may have been planned but never written.
            for request_id in ids:
                self.engine.abort_request(request_id)
            self.engine.reset_prefix_cache()
            raise
        finally:
            if progress is not None:
                progress.close()
        return [finished[request_id] for request_id in ids]

    def chat(self, messages: Sequence[dict] | Sequence[Sequence[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *, use_tqdm: bool = True,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             tools: Sequence[dict] | None = None, chat_template_kwargs: dict | None = None,
             chat_template: str | None = None,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """vLLM's ``LLM.chat``: one conversation (OpenAI-style message dicts: ``role``, text
        ``content`` or text parts, assistant ``tool_calls``) or a list of them, rendered by the
        tokenizer's chat template (which writes the special tokens) with ``tools`` and
        ``chat_template_kwargs``, then generated as ``generate`` does (``lora_request`` too). A conversation the
        template cannot render as asked raises ValueError naming why. ``chat_template``: a template (or
        its file) in place of the tokenizer's."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        template = None if chat_template is None else load_chat_template(chat_template)
        tokenizer = self.engine.tokenizer
        prompts = []
        for conversation in conversations:
            text = render_conversation(tokenizer, [template_message(m) for m in conversation],
                                       add_generation_prompt=add_generation_prompt,
                                       continue_final_message=continue_final_message, tools=tools,
                                       chat_template_kwargs=chat_template_kwargs, chat_template=template)
            prompts.append(tokenizer.encode(text, add_special_tokens=False))
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def beam_search(self, prompts: Sequence[str | Sequence[int] | dict], params: BeamSearchParams,
                    lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
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
        outputs = self.generate(prompts, params.to_sampling_params(), use_tqdm=False, lora_request=lora_request)
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


class _Progress:
    """vLLM's progress bar for ``generate``: requests finished, and the input and output token
    rates since the call began."""

    def __init__(self, total: int) -> None:
        from tqdm.auto import tqdm

        self._bar = tqdm(total=total, desc="Processed prompts", dynamic_ncols=True,
                         postfix="est. speed input: 0.00 toks/s, output: 0.00 toks/s")
        self._start = time.perf_counter()
        self._num_input = self._num_output = 0

    def finished(self, output: RequestOutput) -> None:
        self._num_input += len(output.prompt_token_ids)
        self._num_output += sum(c.num_tokens for c in output.outputs)
        elapsed = max(time.perf_counter() - self._start, 1e-9)
        self._bar.postfix = (f"est. speed input: {self._num_input / elapsed:.2f} toks/s, "
                             f"output: {self._num_output / elapsed:.2f} toks/s")
        self._bar.update(1)

    def close(self) -> None:
        self._bar.close()
