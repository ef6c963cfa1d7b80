"""Reasoning parsing, chosen by name like vLLM's ``--reasoning-parser``.

``get_reasoning_parser(name)`` returns the parser class for a model family's format; each
reply gets a fresh instance, made with its prompt's text (``feed`` pieces while streaming,
``finish`` at the end, or ``parse`` a whole text).
"""

from __future__ import annotations

from .base import ReasoningDelta, ReasoningParser
from .harmony import HarmonyParser
from .think_tags import ThinkTagParser

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": ThinkTagParser,   # DeepSeek-R1 and its distills, QwQ
    "qwen3": ThinkTagParser,         # Qwen3, Qwen3.5 (enable_thinking in chat_template_kwargs)
    "openai_gptoss": HarmonyParser,  # gpt-oss: harmony's channels (with tool_call_parser "openai")
}


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    """The parser class registered as ``name``; ValueError listing the known ones."""
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(sorted(REASONING_PARSERS))}") \
            from None


__all__ = ["REASONING_PARSERS", "HarmonyParser", "ReasoningDelta", "ReasoningParser", "ThinkTagParser",
           "get_reasoning_parser"]
