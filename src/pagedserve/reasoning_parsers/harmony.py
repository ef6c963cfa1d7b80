"""gpt-oss's harmony format: a reply is a sequence of messages, each a header and a body.

    <|channel|>analysis<|message|>the reasoning<|end|><|start|>assistant<|channel|>final<|message|>the answer

The generation prompt ends with ``<|start|>assistant``, so a reply begins in a header. A header
names the message's channel and, for a tool call, its recipient (``to=functions.NAME``, before or
after the channel), and may name its content type (``<|constrain|>json``). The markers are special
tokens: the reply's text must keep them (``reads_special_tokens``).

Messages are read as vLLM's ``openai_gptoss`` parser and its Responses API read them:

- ``analysis`` is reasoning; the bodies of several reasoning messages are joined by a line break,
  as are several answers';
- ``final``, ``commentary`` without a recipient (a preamble, which harmony means for the user) and
  a message without a channel are the answer (the content);
- a call to a function (recipient ``functions.NAME``) goes on to the content as
  ``<|channel|>commentary to=functions.NAME<|message|>ARGUMENTS<|call|>``, which the ``openai``
  tool-call parser reads (``tool_call_parser``); a call to a built-in tool (``browser.search``,
  ``python``) is reasoning;
- a header's own text is never content; a reply cut off inside a header loses that header, but text
  that reached no ``<|message|>`` and holds no marker (a model that does not write harmony) is the
  content.

Each delta also gives the same text message by message (``parts``), for the Responses API's item a
message; there no line break joins them.
"""

from __future__ import annotations

import re

from .base import ANSWER, FUNCTION_CALL, REASONING, ReasoningDelta, ReasoningParser, partial_tag_length

START = "<|start|>"
END = "<|end|>"
MESSAGE = "<|message|>"
CHANNEL = "<|channel|>"
CONSTRAIN = "<|constrain|>"
RETURN = "<|return|>"
CALL = "<|call|>"
MARKERS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)
# What ends a body: its end, the reply's end or a call (stop tokens, in the text only when asked
# for), or the next message's start where the model left out the end.
BODY_ENDS = (END, RETURN, CALL, START)
FUNCTIONS = "functions."

RECIPIENT = re.compile(r"to=([^\s<]+)")   # a header's recipient
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]+)")


def _delta() -> ReasoningDelta:
    return ReasoningDelta("", "", [])


def body_kind(header: str) -> tuple[str, str | None]:
    """What the body after ``header`` is, and the function's recipient for a call."""
    recipient = RECIPIENT.search(header)
    if recipient is not None:
        name = recipient.group(1)
        return (FUNCTION_CALL, name) if name.startswith(FUNCTIONS) else (REASONING, None)
    channel = _CHANNEL.search(header)
    if channel is not None and channel.group(1) == "analysis":
        return REASONING, None
    return ANSWER, None


def opened_header(prompt_text: str | None) -> str | None:
    """The header of a message ``prompt_text`` opened and left for the reply to write, if any."""
    if not prompt_text:
        return None
    body_start = prompt_text.rfind(MESSAGE)
    if body_start < 0 or body_start < max(prompt_text.rfind(marker) for marker in BODY_ENDS):
        return None
    return prompt_text[max(prompt_text.rfind(START), 0):body_start]


class HarmonyParser(ReasoningParser):
    """gpt-oss's channels (vLLM's ``openai_gptoss``)."""

    end_tag = CHANNEL + "final" + MESSAGE
    reads_special_tokens = True
    tool_call_parser = "openai"
    reads_messages = True

    def __init__(self, prompt_text: str | None = None) -> None:
        self._header = ""                 # the header read so far, while not in a body
        self._body: str | None = None     # what the current body is read as
        self._pending = ""                # body text held back: maybe the start of a marker
        self._is_new_body = False
        self._has_reasoning = self._has_answer = False
        self._carry = _delta()    # what opening a message the prompt opened wrote
        header = opened_header(prompt_text)
        if header is not None:
            self._open(header, self._carry)
        # A constrained answer's grammar starts at a header (workers.sample.grammar); here the reply
        # starts inside a message the prompt opened.
        self.constrains_after_end = header is None

    @classmethod
    def starts_in_reasoning(cls, prompt_text: str | None) -> bool:
        """Whether a reply to ``prompt_text`` is read as harmony's messages: unless the prompt opened
        the final message (``<|channel|>final<|message|>``), which is then the whole reply. (A
        preamble the prompt opened is content, but more messages follow it.)"""
        header = opened_header(prompt_text)
        if header is None or body_kind(header)[0] != ANSWER:
            return True
        channel = _CHANNEL.search(header)
        return channel is not None and channel.group(1) != "final"

    def feed(self, text: str) -> ReasoningDelta:
        delta, self._carry = self._carry, _delta()
        text, self._pending = self._pending + text, ""
        while text:
            if self._body is None:
                header = self._header + text
                start = header.find(MESSAGE, max(len(self._header) - len(MESSAGE) + 1, 0))
                if start < 0:
                    self._header = header
                    break
                self._open(header[:start], delta)
                text = header[start + len(MESSAGE):]
                continue
            if "<" not in text:   # no marker, nor the start of one: most of a body's pieces
                self._write(delta, text)
                break
            ends = [(index, marker) for marker in BODY_ENDS if (index := text.find(marker)) >= 0]
            if not ends:
                keep = partial_tag_length(text, BODY_ENDS)
                self._write(delta, text[:len(text) - keep])
                self._pending = text[len(text) - keep:]
                break
            index, marker = min(ends)
            self._write(delta, text[:index])
            self._close(delta)
            self._header = START if marker == START else ""
            text = text[index + len(marker):]
        return delta

    def finish(self) -> ReasoningDelta:
        delta, self._carry = self._carry, _delta()
        pending, self._pending = self._pending, ""
        if self._body is not None:
            self._write(delta, pending)
            self._close(delta)
        elif self._header and not any(marker in self._header for marker in MARKERS):
            delta.content += self._header
            delta.parts.append((ANSWER, True, self._header))
        self._header = ""
        return delta

    def _open(self, header: str, delta: ReasoningDelta) -> None:
        self._header = ""
        self._body, recipient = body_kind(header)
        self._is_new_body = True
        if self._body == FUNCTION_CALL:   # the call's start, in the form the tool-call parser reads
            self._write(delta, f"{CHANNEL}commentary to={recipient}{MESSAGE}")

    def _write(self, delta: ReasoningDelta, text: str) -> None:
        if not text:
            return
        if self._body == REASONING:
            delta.reasoning += "\n" + text if self._is_new_body and self._has_reasoning else text
            self._has_reasoning = True
        elif self._body == ANSWER:
            delta.content += "\n" + text if self._is_new_body and self._has_answer else text
            self._has_answer = True
        else:
            delta.content += text
        delta.parts.append((self._body, self._is_new_body, text))
        self._is_new_body = False

    def _close(self, delta: ReasoningDelta) -> None:
        if self._body == FUNCTION_CALL:
            self._write(delta, CALL)
        self._body = None
