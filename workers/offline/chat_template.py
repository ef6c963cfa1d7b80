"""Conversations through a tokenizer's chat template: what the offline ``LLM.chat`` and the
server's chat completions both render.

``render_conversation`` takes messages already in the template's form (dicts with
``role`` and text ``content``; assistant ``tool_calls`` with parsed arguments) and
refuses, with ``ChatTemplateError`` naming the request field at fault, what would
render wrong: no chat template, ``continue_final_message`` without an assistant
message to continue (or with a generation prompt after it), template variables the
caller may not set, a template that fails on the conversation or renders no text.
``template_message`` turns an OpenAI-style message dict into that form.
``load_chat_template`` reads a template given in place of the tokenizer's (vLLM's
``--chat-template``: a file, or the template itself) and checks its syntax;
``template_reads`` says whether a template reads a variable (``reasoning_effort``, say).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

# Template variables set by the renderer or by a request's own fields, never by
# ``chat_template_kwargs``.
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "conversation", "tools", "tokenize", "return_dict",
                                      "chat_template", "documents"})


class ChatTemplateError(ValueError):
    """A conversation the chat template cannot render as asked; ``param`` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def render_conversation(tokenizer, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
                        continue_final_message: bool = False, tools: Sequence[Mapping] | None = None,
                        chat_template_kwargs: Mapping[str, Any] | None = None, chat_template: str | None = None,
                        documents: Sequence[Mapping[str, str]] | None = None) -> str:
    """The conversation's text as the chat template writes it (special tokens included):
    ``chat_template`` (``load_chat_template``'s) if given, else the tokenizer's. ``documents``:
    a retrieval template's (transformers' ``documents``)."""
    if not (chat_template or getattr(tokenizer, "chat_template", None)):
        raise ChatTemplateError("the model has no chat template; send a prompt instead", "messages")
    if not messages:
        raise ChatTemplateError("a conversation needs at least one message", "messages")
    if continue_final_message and add_generation_prompt:
        raise ChatTemplateError("continue_final_message continues the last message; it needs "
                                "add_generation_prompt: false", "continue_final_message")
    if continue_final_message and messages[-1].get("role") != "assistant":
        raise ChatTemplateError("continue_final_message needs an assistant message last", "messages")
    kwargs: dict[str, Any] = {"add_generation_prompt": add_generation_prompt,
                              "continue_final_message": continue_final_message}
    if tools:
        kwargs["tools"] = list(tools)
    if documents:
        kwargs["documents"] = [dict(document) for document in documents]
    extra = dict(chat_template_kwargs or {})
    reserved = sorted(set(extra) & RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise ChatTemplateError(f"chat_template_kwargs may not set {', '.join(reserved)} (set by the server "
                                "or by the request's own fields)", "chat_template_kwargs")
    kwargs.update(extra)
    if chat_template:
        kwargs["chat_template"] = chat_template
    try:
        text = tokenizer.apply_chat_template(list(messages), tokenize=False, **kwargs)
    except Exception as exc:  # the template rejects the conversation (e.g. role order)
        raise ChatTemplateError(f"the chat template could not render these messages: {exc}", "messages") from None
    if not isinstance(text, str):
        raise ChatTemplateError("the chat template did not render text with these chat_template_kwargs",
                                "chat_template_kwargs")
    return text


def load_chat_template(template: str) -> str:
    """A chat template given as vLLM's ``--chat-template`` takes it: the path of a file (a value
    without ``{``, ``}`` or a line break) or the template itself; ValueError if the file cannot
    be read or the template is not valid Jinja (as transformers renders it)."""
    if not any(char in template for char in "{}\n"):
        try:
            template = Path(template).expanduser().read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"{template!r} looks like a chat template's file, which cannot be read: {exc}") from None
    import jinja2

    try:
        _jinja_environment().parse(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"the chat template is not valid Jinja (line {exc.lineno}): {exc.message}") from None
    return template


def template_reads(template: str | Mapping[str, str] | None, variable: str, with_tools: bool = False) -> bool:
    """Whether the chat template ``apply_chat_template`` would render (a tokenizer's named
    templates: ``tool_use`` with tools where it has one, else ``default``) reads ``variable``
    from its context."""
    if isinstance(template, Mapping):
        template = template.get("tool_use") if with_tools and "tool_use" in template else template.get("default")
    return bool(template) and variable in _variables_read(template)


@functools.lru_cache(maxsize=16)
def _variables_read(template: str) -> frozenset[str]:
    """The variables ``template`` reads from its context (none if it does not parse)."""
    import jinja2
    from jinja2 import meta

    try:
        return frozenset(meta.find_undeclared_variables(_jinja_environment().parse(template)))
    except jinja2.TemplateSyntaxError:
        return frozenset()


def _jinja_environment():
    """A Jinja environment that parses what transformers' chat templates may hold."""
    import jinja2
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):   # transformers' {% generation %} block: its syntax only
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(lineno)

    return ImmutableSandboxedEnvironment(extensions=[Generation, "jinja2.ext.loopcontrols"])


def template_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """An OpenAI-style message dict in the template's form: text parts joined, tool calls'
    JSON arguments parsed (templates render them as objects, as vLLM passes them), an assistant's
    reasoning (``reasoning_content``) also as ``thinking``, the name gpt-oss's template reads it by."""
    if not isinstance(message, Mapping) or "role" not in message:
        raise ChatTemplateError(f"a message is a dict with a 'role', got {message!r:.80}", "messages")
    entry = {key: value for key, value in message.items() if key not in ("content", "tool_calls")}
    entry["content"] = _text_of(message.get("content"))
    calls = []
    for call in message.get("tool_calls") or ():
        function = call.get("function", {})
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                raise ChatTemplateError(f"the arguments of tool call {call.get('id')!r} are not valid JSON",
                                        "messages") from None
        calls.append({"id": call.get("id"), "type": "function",
                      "function": {"name": function.get("name"), "arguments": arguments}})
    if calls:
        entry["tool_calls"] = calls
    if entry.get("reasoning_content") is not None:
        entry.setdefault("thinking", entry["reasoning_content"])
    return entry


def _text_of(content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence) and all(isinstance(part, Mapping) for part in content):
        kinds = {part.get("type") for part in content}
        if kinds <= {"text"}:
            return "".join(part.get("text", "") for part in content)
        raise ChatTemplateError(f"this model reads text only; a message has {sorted(kinds - {'text'})} parts",
                                "messages")
    raise ChatTemplateError(f"a message's content is text or a list of text parts, got {content!r:.80}", "messages")
