"""What a reasoning parser produces, and the streaming interface every parser follows.

A parser reads one reply's text, in pieces as it streams, and separates the model's
reasoning from its answer (the content). ``feed`` returns what became certain; ``finish``
flushes what is left. ``parse`` runs a whole text through the same path, so streamed and
non-streamed results always agree: the streamed pieces concatenate to the parsed ones.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass


@dataclass
class ReasoningDelta:
    """What one ``feed`` made certain: reasoning text and content text."""

    reasoning: str = ""
    content: str = ""


def partial_tag_length(text: str, tags: tuple[str, ...]) -> int:
    """How many characters at the end of ``text`` could be the start of one of ``tags``."""
    longest = 0
    for tag in tags:
        for size in range(min(len(tag) - 1, len(text)), longest, -1):
            if tag.startswith(text[-size:]):
                longest = size
                break
    return longest


class ReasoningParser(ABC):
    """One reply's parser: made with the prompt's text, which may open or close the reasoning."""

    # The text that ends the reasoning: a constrained output's language holds after it, and the
    # Responses API counts the reasoning's tokens up to it.
    end_tag: str
    # Whether a constrained output's grammar can hold after ``end_tag`` in this reply.
    constrains_after_end: bool = True
    # Whether the reply's text must keep its special tokens (a format whose markers are special tokens).
    reads_special_tokens: bool = False
    # The tool-call parser that reads the calls this parser passes on in the content, where the format
    # needs its own (None: any).
    tool_call_parser: str | None = None

    @abstractmethod
    def __init__(self, prompt_text: str | None = None) -> None: ...

    @classmethod
    @abstractmethod
    def starts_in_reasoning(cls, prompt_text: str | None) -> bool:
        """Whether a reply to ``prompt_text`` starts in the reasoning."""

    @abstractmethod
    def feed(self, text: str) -> ReasoningDelta:
        """The next piece of the reply."""

    @abstractmethod
    def finish(self) -> ReasoningDelta:
        """The reply ended: what was held back."""

    def parse(self, text: str) -> tuple[str | None, str | None]:
        """A whole reply: its reasoning and its content, each None where there is none."""
        first, last = self.feed(text), self.finish()
        reasoning, content = first.reasoning + last.reasoning, first.content + last.content
        return reasoning or None, content or None
