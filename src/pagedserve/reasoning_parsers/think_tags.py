"""A reasoning model's thinking, split from its answer by ``<think>`` ... ``</think>`` tags.

DeepSeek-R1 and Qwen3 write their reasoning before their answer and close it with
``</think>``. Whether the reply starts inside the reasoning is the prompt's to say: a chat
template that opens ``<think>`` in the generation prompt (DeepSeek-R1's, Qwen3.5's) leaves it
open, one that writes ``<think></think>`` (Qwen3's with ``enable_thinking: false``) has closed
it, and one that writes neither (Qwen3's earlier template) lets the model open it itself: the
reply then starts in the reasoning, and a ``<think>`` it writes first is dropped. Everything
up to ``</think>`` is reasoning and everything after it is content; a reply cut off before
``</think>`` is reasoning only, as vLLM reads it.
"""

from __future__ import annotations

from .base import ReasoningDelta, ReasoningParser, partial_tag_length


class ThinkTagParser(ReasoningParser):
    """``<think>``/``</think>`` reasoning (vLLM's ``deepseek_r1`` and ``qwen3`` parsers)."""

    start_tag = "<think>"
    end_tag = "</think>"

    def __init__(self, prompt_text: str | None = None) -> None:
        self._is_reasoning = self.starts_in_reasoning(prompt_text)
        self._at_start = self._is_reasoning   # a <think> the model writes first is dropped
        self._pending = ""                    # text held back: maybe the start of a tag

    @classmethod
    def starts_in_reasoning(cls, prompt_text: str | None) -> bool:
        """Whether a reply to ``prompt_text`` starts in the reasoning: unless the prompt's last
        tag closes it."""
        if not prompt_text:
            return True
        return prompt_text.rfind(cls.end_tag) <= prompt_text.rfind(cls.start_tag)

    def feed(self, text: str) -> ReasoningDelta:
        text = self._pending + text
        self._pending = ""
        reasoning = ""
        if self._at_start:
            stripped = text.lstrip()
            if stripped.startswith(self.start_tag):
                text = stripped[len(self.start_tag):]
            elif self.start_tag.startswith(stripped):   # maybe the model's own <think>: wait for more
                self._pending = text
                return ReasoningDelta()
            self._at_start = False
        if self._is_reasoning:
            end = text.find(self.end_tag)
            if end < 0:
                keep = partial_tag_length(text, (self.end_tag,))
                self._pending = text[len(text) - keep:] if keep else ""
                return ReasoningDelta(reasoning=text[:len(text) - keep])
            reasoning, text = text[:end], text[end + len(self.end_tag):]
            self._is_reasoning = False
        return ReasoningDelta(reasoning=reasoning, content=text)

    def finish(self) -> ReasoningDelta:
        pending, self._pending = self._pending, ""
        self._at_start = False
        if self._is_reasoning:
            return ReasoningDelta(reasoning=pending)
        return ReasoningDelta(content=pending)
