"""Grammar-constrained decoding: structured-output specs compiled once, matched per sequence.

The grammar engine is llguidance (a maintained Rust library; see
docs/benchmarks.md, "Structured outputs", for why it was chosen over xgrammar). Three pieces:
  - ``grammar_source`` turns a ``StructuredOutputsParams`` into llguidance's
    grammar text, and ``check_structured_outputs`` validates it without a
    tokenizer (what an ingress can do before a request reaches a worker);
  - ``GrammarCompiler`` binds grammars to one tokenizer, keeps the compiled
    grammars in a bounded LRU cache keyed by the spec, and fills the token
    bitmasks of a batch of matchers;
  - ``GrammarMatcher`` follows one sequence's output through its grammar.

Every failure to compile is a ``ValueError`` whose message starts with the
spec's field (``structured_outputs.json: ...``).
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .sampling_params import StructuredOutputsParams

if TYPE_CHECKING:  # the bitmask is the engine's; the API's checks load without torch
    import torch

# Compiled grammars kept per tokenizer; the least recently used is dropped first.
MAX_CACHED_GRAMMARS = 256
# Characters of an engine's error message kept in a ValueError.
MAX_ERROR_CHARS = 600
# JSON whitespace between two tokens: at most one space or one line break, so that a model
# cannot spend its budget on whitespace (benchmarks/bench_json_whitespace.py: a random-weight
# model under bounded schemas finished inside a compact answer's budget every time with this
# rule, about half the time with a line break plus 24 spaces or tabs per gap).
JSON_WHITESPACE_PATTERN = r"[\x20\n]?"
# The name a reasoned output's language goes by inside its grammar (``reasoning_end``).
REASONED_ANSWER = "reasoned_answer"
# gpt-oss's harmony: the answer is the final channel's message (``reasoning_end`` this header), or a
# function call, whose language is the rest of its header and its arguments (``reasoning_end`` the
# header's start).
HARMONY_FINAL = "<|channel|>final<|message|>"
HARMONY_CALL = "<|channel|>commentary to=functions."
HARMONY_HEADERS = (HARMONY_FINAL, HARMONY_CALL)
_SPECIAL_TOKEN = re.compile(r"(<\|[a-z_]+\|>)")


def _llguidance():
    import llguidance

    return llguidance


def grammar_source(spec: StructuredOutputsParams) -> str:
    """llguidance's grammar text for ``spec`` (not yet checked)."""
    source = _language_source(spec)
    if spec.reasoning_end is None:
        return source
    if spec.reasoning_end in HARMONY_HEADERS:
        return _after_harmony_reasoning(source, spec.reasoning_end)
    return _after_reasoning(source, spec.reasoning_end)


def _with_answer(wrapper: str, source: str) -> str:
    """A top-level Lark ``wrapper`` whose rules refer to ``source``'s start grammar by name."""
    if source.lstrip().startswith("{"):
        grammars = json.loads(source)["grammars"]
    else:   # Lark text
        grammars = [{"lark_grammar": source}]
    answer = {**grammars[0], "name": REASONED_ANSWER}
    return json.dumps({"grammars": [{"lark_grammar": wrapper}, answer, *grammars[1:]]})


def _after_reasoning(source: str, end: str) -> str:
    """``source``'s language after free text that ends at the first ``end``, then at most two
    line breaks (a reasoning model's ``</think>\\n\\n``): a top-level grammar whose start rule
    refers to ``source``'s own start grammar by name.

    The free part is a lazy lexeme, so it ends where ``end`` first appears, as the reasoning
    parser reads the reply. Special tokens (an end of sequence among them) are no text: the
    reasoning cannot end the sequence before the language has had its say.
    """
    end_pattern = "".join(c if c.isalnum() else f"\\x{{{ord(c):x}}}" for c in end)
    # Byte-level tokens may spell invalid UTF-8 on their own (a random-weight model's do): the
    # free part takes any bytes, as an unconstrained reply would.
    wrapper = ('%llguidance {"allow_invalid_utf8": true}\n'
               f"start: reasoning separator? @{REASONED_ANSWER}\n"
               f"reasoning[lazy]: /(?s:.*){end_pattern}/\n"
               "separator: /\\n\\n?/\n")
    return _with_answer(wrapper, source)


def _after_harmony_reasoning(source: str, header: str) -> str:
    """``source``'s language after ``header`` (the final message's, or a function call's start),
    after any number of free messages, each ended by ``<|end|>`` and the next message's
    ``<|start|>assistant``: reasoning (the analysis channel) and, before a call, preambles (the
    commentary channel; content, which a final message's language must be alone). A reply starts
    in a header (the prompt ends with ``<|start|>assistant``). The markers are special tokens, which
    a grammar names in rules; the free text's lexeme ends where one comes. (Unlike the text-tag
    wrapper, this one does not take invalid UTF-8: llguidance then never accepts the answer's end.)"""
    channels = '"analysis" | "commentary"' if header == HARMONY_CALL else '"analysis"'
    wrapper = (f"start: free_message* {lark_text(header)} @{REASONED_ANSWER}\n"
               'free_message: <|channel|> FREE_CHANNEL <|message|> FREE_TEXT <|end|> <|start|> "assistant"\n'
               f"FREE_CHANNEL: {channels}\n"
               "FREE_TEXT: /(?s:.*)/\n")
    return _with_answer(wrapper, source)


def lark_text(text: str) -> str:
    """A Lark rule body that spells ``text``: its special tokens (``<|name|>``) as tokens, the rest
    as string literals."""
    return " ".join(part if _SPECIAL_TOKEN.fullmatch(part) else json.dumps(part, ensure_ascii=False)
                    for part in _SPECIAL_TOKEN.split(text) if part)


def _language_source(spec: StructuredOutputsParams) -> str:
    llg = _llguidance()
    matcher = llg.LLMatcher
    kind = spec.kind
    if kind in ("json", "json_object"):
        schema = spec.json if kind == "json" else {"type": "object"}
        # "lenient" would skip unsupported keywords silently; a schema may not turn it on.
        options: dict[str, Any] = {"whitespace_flexible": not spec.disable_any_whitespace}
        if not spec.disable_any_whitespace:
            options["whitespace_pattern"] = JSON_WHITESPACE_PATTERN
        return matcher.grammar_from_json_schema(schema, defaults=options, overrides={"lenient": False})
    if kind == "regex":
        return matcher.grammar_from_regex(spec.regex)
    if kind == "choice":
        # A JSON string literal is a Lark string literal (escapes included).
        alternatives = [json.dumps(choice, ensure_ascii=False) for choice in spec.choice]
        return matcher.grammar_from_lark("start: " + " | ".join(alternatives))
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        lark = any_to_lark(spec.grammar)
    except Exception as exc:  # the converter raises its own error types
        raise ValueError(f"structured_outputs.grammar: {_shorten(str(exc))}") from None
    return matcher.grammar_from_lark(lark)


def check_structured_outputs(spec: StructuredOutputsParams) -> None:
    """Raise ValueError naming ``structured_outputs.<kind>`` unless ``spec`` compiles.

    Needs no tokenizer; a worker checks again against its own (see ``GrammarCompiler``).
    """
    source = _source_or_error(spec)
    error = _llguidance().LLMatcher.validate_grammar(source, None)
    if error:
        raise ValueError(f"structured_outputs.{spec.kind}: {_shorten(error)}")


def _source_or_error(spec: StructuredOutputsParams) -> str:
    try:
        return grammar_source(spec)
    except ValueError as exc:
        message = str(exc)
        if message.startswith("structured_outputs."):
            raise
        raise ValueError(f"structured_outputs.{spec.kind}: {_shorten(message)}") from None


def _shorten(message: str) -> str:
    message = message.strip()
    return message if len(message) <= MAX_ERROR_CHARS else message[:MAX_ERROR_CHARS] + "..."


class GrammarMatcher:
    """One sequence's position in its grammar.

    ``accept`` advances by a sampled token (False: the token is not allowed,
    and the matcher is then in an error state); ``is_finished`` is true once the
    grammar is complete and only an end-of-sequence token could follow.
    """

    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher
        self.num_accepted = 0

    def accept(self, token_id: int) -> bool:
        is_ok = self._matcher.consume_token(token_id)
        if is_ok:
            self.num_accepted += 1
        return is_ok

    def accept_all(self, token_ids: Sequence[int]) -> bool:
        """Replay tokens already generated (a resumed or migrated sequence)."""
        return all(self.accept(token_id) for token_id in token_ids)

    def num_valid(self, token_ids: Sequence[int]) -> int:
        """How many of ``token_ids``, from the start, the grammar would accept in a row (it does
        not move)."""
        if self._matcher.is_stopped() or not token_ids:
            return 0
        return self._matcher.validate_tokens(list(token_ids))

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens."""
        if not 0 <= num_tokens <= self.num_accepted:
            raise ValueError(f"cannot roll back {num_tokens} of {self.num_accepted} tokens")
        if num_tokens and not self._matcher.rollback(num_tokens):
            raise RuntimeError(f"grammar rollback failed: {self._matcher.get_error()}")
        self.num_accepted -= num_tokens

    @property
    def is_finished(self) -> bool:
        return self._matcher.is_stopped() and not self._matcher.is_error()

    @property
    def error(self) -> str | None:
        return self._matcher.get_error() or None if self._matcher.is_error() else None

    @property
    def engine_matcher(self) -> Any:
        """The llguidance matcher (for batched bitmask filling)."""
        return self._matcher


class CompiledGrammar:
    """A spec compiled for one tokenizer; ``matcher()`` starts a sequence in it."""

    def __init__(self, spec: StructuredOutputsParams, template: Any) -> None:
        self.spec = spec
        self._template = template

    def matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self._template.deep_copy())


class GrammarCompiler:
    """Compiles structured-output specs for one tokenizer and fills token bitmasks.

    ``vocab_size`` is the model's (logits width); tokens the tokenizer does not
    know are never allowed. ``eos_token_ids`` end a sequence once its grammar
    is complete. Compiled grammars are cached by ``spec.key``, at most
    ``max_cached`` of them. Building the tokenizer's tables takes a moment for
    large vocabularies, so the engine creates this on its first structured request.
    ``compile`` may run on any thread; ``fill_bitmask`` on one at a time.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int],
                 max_cached: int = MAX_CACHED_GRAMMARS, num_threads: int = 1) -> None:
        llg = _llguidance()
        import llguidance.hf

        try:
            self._tokenizer = llguidance.hf.from_tokenizer(
                tokenizer, n_vocab=vocab_size, eos_token=list(eos_token_ids) or None)
        except ValueError as exc:
            raise ValueError(f"structured outputs need a fast tokenizer: {exc}") from None
        self._executor = llg.LLExecutor(num_threads=num_threads)
        self.vocab_size = vocab_size
        self.num_words = (vocab_size + 31) // 32
        self.max_cached = max_cached
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0
        self.num_cache_hits = 0

    def compile(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        """The compiled grammar of ``spec`` (cached); ValueError naming the field if bad."""
        key = spec.key
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                self.num_cache_hits += 1
                return compiled
        source = _source_or_error(spec)
        template = _llguidance().LLMatcher(self._tokenizer, source, log_level=0)
        if template.is_error():
            raise ValueError(f"structured_outputs.{spec.kind}: {_shorten(template.get_error())}")
        compiled = CompiledGrammar(spec, template)
        with self._lock:
            self._cache[key] = compiled
            self.num_compiled += 1
            while len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
        return compiled

    @property
    def num_cached(self) -> int:
        return len(self._cache)

    def allocate_bitmask(self, num_rows: int) -> torch.Tensor:
        """A CPU int32 ``[num_rows, ceil(vocab / 32)]`` bitmask, every token allowed."""
        import torch

        return torch.full((num_rows, self.num_words), -1, dtype=torch.int32)

    def fill_bitmask(self, matchers: Sequence[GrammarMatcher], bitmask: torch.Tensor) -> None:
        """Row i of ``bitmask`` gets the tokens ``matchers[i]`` allows next (bit t of
        word t // 32 set: token t allowed)."""
        import torch

        if len(matchers) > bitmask.shape[0] or bitmask.shape[1] != self.num_words:
            raise ValueError(f"bitmask of shape {tuple(bitmask.shape)} for {len(matchers)} "
                             f"matchers of {self.num_words} words")
        if bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or not bitmask.is_contiguous():
            raise ValueError("the bitmask must be a contiguous CPU int32 tensor")
        if not matchers:
            return
        pairs = [(m.engine_matcher, row) for row, m in enumerate(matchers)]
        self._executor.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), self.num_words * 4,
                                               bitmask.shape[0])
