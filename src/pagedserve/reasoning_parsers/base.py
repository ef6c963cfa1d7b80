"""What a reasoning parser produces, and the streaming interface every parser follows.

A parser reads one reply's text, in pieces as it streams, and separates the model's
reasoning from its answer (the content). ``feed`` returns what became certain; ``finish``
flushes what is left. ``parse`` runs a whole text through the same path, so streamed and
non-streamed results always agree: the streamed pieces concatenate to the parsed ones.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

# What a message of a reply is, where a parser reads a reply as several messages (``MessagePart``).
REASONING, ANSWER, FUNCTION_CALL = "reasoning", "answer", "function call"


# A piece of one message of the reply: its kind (``REASONING``, ``ANSWER`` or ``FUNCTION_CALL``),
# whether the message starts with it, and its text. (A plain tuple: one is made for each token.)
MessagePart = tuple[str, bool, str]


@dataclass(slots=True)
class ReasoningDelta:
    """What one ``feed`` made certain: reasoning text and content text. A parser that reads a reply
    as several messages (harmony's) also gives ``parts``: the same text in the reply's order, without
    the line breaks that join one kind's messages in ``reasoning`` and ``content`` (the Responses
    API makes an item of each message)."""

    reasoning: str = ""
    content: str = ""
    parts: list[MessagePart] | None = None


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
    # Whether a reply is read as several messages (``parts``, ``parse_messages``), not as one
    # reasoning, then one answer.
    reads_messages: bool = False

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

    def parse_messages(self, text: str) -> list[tuple[str, str]] | None:
        """A whole reply as its messages in order, (kind, text) each, where the parser reads a reply
        as several messages; None where it reads one reasoning, then one answer (``parse``)."""
        first, last = self.feed(text), self.finish()
        if first.parts is None:
            return None
        messages: list[tuple[str, str]] = []
        for kind, starts, piece in [*first.parts, *(last.parts or ())]:
            if starts or not messages or messages[-1][0] != kind:
                messages.append((kind, piece))
            else:
                messages[-1] = (kind, messages[-1][1] + piece)
        return messages
