"""Per-request sampling options, named and defaulted like vLLM's ``SamplingParams``
(and ``BeamSearchParams``, which ``LLM.beam_search`` takes).

The object is plain data (ints, floats, bools, lists of str/int) so it pickles and
round-trips through msgpack via ``to_dict``/``from_dict``. Construction validates
every field and raises ``ValueError`` with a message naming the field, so the
ingress can turn a bad request into a clear client error.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from numbers import Integral, Real
from typing import Any

# Temperatures below this are treated as greedy decoding (vLLM uses the same cut-off).
GREEDY_TEMPERATURE_EPS = 1e-5
MAX_LOGPROBS = 20
# A request's samples fork in one step: n rows of logits at once (1024 rows of a 152k-token
# vocabulary are 0.6 GB in float32).
MAX_N = 1024
# The sampler holds temperatures in float32: a larger one cannot be written to the batch.
MAX_TEMPERATURE = 3.4028234663852886e38
# top_k as gRPC carries it (int32); anything above the vocabulary keeps every token anyway.
MAX_TOP_K = 2**31 - 1
MAX_ABS_PENALTY = 2.0
# Bounds that stay finite in float32 logits (1e-300 is 0 there and would divide by zero).
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 100.0
# A structured-output spec (schema, regex, grammar or choices, as compact JSON) may
# be at most this large: grammar compilation and matching grow with it.
MAX_STRUCTURED_OUTPUT_BYTES = 64 * 1024
STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object")
# Beam scores divide by (output length) ** length_penalty: beyond this the power
# overflows a float for long outputs (2**30 ** 10 is 2**300).
MAX_ABS_LENGTH_PENALTY = 10.0


@dataclass
class StructuredOutputsParams:
    """Constrain a request's output to a language (vLLM's ``StructuredOutputsParams``).

    Exactly one of the kinds is set:
      - ``json``: a JSON schema (a dict, or its JSON text); the output is one JSON
        value that validates against it;
      - ``json_object``: True for any JSON object;
      - ``regex``: the output matches the regular expression in full;
      - ``choice``: the output is exactly one of the strings;
      - ``grammar``: a context-free grammar in Lark or GBNF/EBNF syntax.
    ``disable_any_whitespace`` (JSON kinds) allows no whitespace at all between
    tokens (``{"a":1,"b":[2]}``); by default at most one space or one line break
    may stand between two tokens (bounded, so that a model cannot spend its
    budget on whitespace).
    ``reasoning_end`` (a reasoning model's ``</think>``): the output is free up to the
    first occurrence of this text, and the language holds from there, after at most
    two line breaks; the end of the sequence waits for the language's end as ever.
    Harmony's final header (``<|channel|>final<|message|>``, gpt-oss's) instead makes the
    output any number of free reasoning messages (analysis channel), then the final
    channel's message in the language; the start of a function call's header
    (``<|channel|>commentary to=functions.``) the same, preambles (commentary channel)
    allowed too, with the call's rest in the language.

    Only the shape is checked here (types, one kind, the size limit); whether the
    schema, regex or grammar compiles is checked when a request is added, with a
    ``ValueError`` naming ``structured_outputs.<kind>``.
    """

    json: dict | str | None = None  # text is parsed into a dict
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    reasoning_end: str | None = None

    def __post_init__(self) -> None:
        prefix = "structured_outputs"
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except ValueError as exc:
                raise ValueError(f"{prefix}.json is not valid JSON: {exc}") from None
        if self.json is not None and not isinstance(self.json, dict):
            raise ValueError(f"{prefix}.json must be a JSON schema (an object), "
                             f"got {type(self.json).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{prefix}.{name} must be a non-empty string, got {value!r}")
        if self.choice is not None:
            if (isinstance(self.choice, (str, bytes)) or not isinstance(self.choice, (list, tuple))
                    or not self.choice or not all(isinstance(c, str) for c in self.choice)):
                raise ValueError(f"{prefix}.choice must be a non-empty list of strings")
            self.choice = list(self.choice)
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise ValueError(f"{prefix}.json_object must be a bool, got {self.json_object!r}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError(f"{prefix}.disable_any_whitespace must be a bool")
        if self.reasoning_end is not None and (not isinstance(self.reasoning_end, str) or not self.reasoning_end):
            raise ValueError(f"{prefix}.reasoning_end must be a non-empty string, got {self.reasoning_end!r}")
        kinds = [kind for kind in STRUCTURED_OUTPUT_KINDS if self._is_set(kind)]
        if len(kinds) != 1:
            raise ValueError(f"{prefix} needs exactly one of {', '.join(STRUCTURED_OUTPUT_KINDS)}; "
                             f"got {', '.join(kinds) or 'none'}")
        size = len(self.key)
        if size > MAX_STRUCTURED_OUTPUT_BYTES:
            raise ValueError(f"{prefix}.{self.kind} is {size} bytes; the limit is "
                             f"{MAX_STRUCTURED_OUTPUT_BYTES} bytes")

    def _is_set(self, kind: str) -> bool:
        value = getattr(self, kind)
        return value is not None and value is not False

    @property
    def kind(self) -> str:
        """Which of ``STRUCTURED_OUTPUT_KINDS`` this spec uses."""
        return next(kind for kind in STRUCTURED_OUTPUT_KINDS if self._is_set(kind))

    @property
    def key(self) -> str:
        """Canonical text of the spec: equal specs have equal keys (the grammar cache's key)."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"), ensure_ascii=False)

    def to_dict(self) -> dict[str, Any]:
        """Plain data: the kind that is set, ``disable_any_whitespace`` when true and
        ``reasoning_end`` when set."""
        data: dict[str, Any] = {self.kind: _copy_plain(getattr(self, self.kind))}
        if self.disable_any_whitespace:
            data["disable_any_whitespace"] = True
        if self.reasoning_end is not None:
            data["reasoning_end"] = self.reasoning_end
        return data

    @classmethod
    def from_dict(cls, options: Mapping[str, Any]) -> StructuredOutputsParams:
        """Build from a mapping, raising ValueError that names any unknown key."""
        if not isinstance(options, Mapping):
            raise ValueError(f"structured_outputs must be a mapping, got {type(options).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(str(key) for key in options if key not in known)
        if unknown:
            raise ValueError(f"unknown structured_outputs option(s): {', '.join(unknown)}; "
                             f"known: {', '.join(sorted(known))}")
        return cls(**options)


@dataclass
class SamplingParams:
    """How to sample the output tokens of one request.

    Semantics follow vLLM:
      - ``temperature`` < 1e-5 means greedy (argmax); top-k/top-p/min-p are then ignored.
      - ``top_k`` of -1, 0 or None disables top-k (normalised to -1).
      - ``repetition_penalty`` scales logits of tokens seen in prompt or output
        (divide positive logits, multiply negative ones); ``presence_penalty`` and
        ``frequency_penalty`` subtract from logits of tokens seen in the output only.
      - ``stop`` (a string or list) is normalised to list[str], ``stop_token_ids``
        to list[int]. A stop string ends generation and by default is not part of
        the returned text (``include_stop_str_in_output``).
      - ``stop_token_ids`` and the model's EOS (unless ``ignore_eos``) end generation
        with finish reason "stop"; reaching ``max_tokens`` gives "length".
      - ``logprobs``: None for none, k >= 0 for the sampled token's logprob plus the
        k most likely alternatives (raw model logprobs, before any processing).
      - ``seed`` makes a request's samples reproducible whatever else is batched
        with it; sibling samples (``n`` > 1) get distinct, reproducible streams.
      - ``min_tokens``: EOS and ``stop_token_ids`` cannot be sampled, and stop
        strings do not end generation, before this many output tokens.
      - ``prompt_logprobs``: None for none, k >= 0 for each prompt token's logprob
        (the first token has none) plus the k most likely alternatives, computed
        in the prefill's forward pass. Such a request does not read the prefix
        cache (its cached blocks hold no logits); it still writes to it.
      - ``logit_bias`` (token id -> a value added to its logit) and
        ``allowed_token_ids`` (only these may be sampled) act before penalties,
        temperature and the rest; logprobs stay the raw model's. A token id must
        be in the model's vocabulary (checked when a request is added).
      - ``bad_words``: words that are never completed. Each is tokenized alone and
        after a space (the latter kept when it gives as many tokens and another
        first token); the last token of such a sequence is banned whenever the
        output so far ends with the tokens before it.
      - ``skip_special_tokens`` leaves special tokens out of the text;
        ``spaces_between_special_tokens`` (when they are kept) puts a space
        between a special token and its neighbours, as transformers' slow
        tokenizers do.
      - ``truncate_prompt_tokens``: keep only the last k prompt tokens (-1: as
        many as the model's context allows, leaving room for one output token).
      - ``detokenize`` (vLLM's): false leaves the output's text empty (its tokens
        are all there); stop strings, which are found in the text, need it. The
        cluster's handle turns it off on the requests it sends workers when it
        decodes their text itself.
      - ``cache_salt`` (vLLM's): the request shares prefix-cache blocks only with
        requests of the same salt (every block hash covers it), so that one
        tenant's requests cannot tell from their speed what another's prompts are.
      - ``structured_outputs``: see ``StructuredOutputsParams``; the output is
        constrained during decoding and ends ("stop") once the grammar is complete.
      - ``use_beam_search`` (vLLM's extension): beam search of width ``n``, as
        transformers' ``generate(num_beams=n, do_sample=False)``: ``n`` outputs,
        the best first, each scored by its summed log-probability over (output
        length) ** ``length_penalty``; ``early_stopping`` (True, False or
        "never") is transformers' stopping rule. EOS and ``stop_token_ids`` end
        a hypothesis. It is deterministic and scores raw log-probabilities, so
        ``temperature`` must be 0, and what would reshape the distribution or
        needs per-token sampling (top-k/p, min-p, penalties, stop strings,
        ``min_tokens``, logprobs, prompt logprobs, structured outputs, logit bias,
        allowed token ids, bad words) is refused.
    """

    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int | None = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    min_tokens: int = 0
    prompt_logprobs: int | None = None
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    cache_salt: str | None = None
    detokenize: bool = True

    def __post_init__(self) -> None:
        self.n = _as_int("n", self.n, minimum=1, maximum=MAX_N)
        self.max_tokens = _as_int("max_tokens", self.max_tokens, minimum=1)
        self.min_tokens = _as_int("min_tokens", self.min_tokens, minimum=0, maximum=self.max_tokens)
        self.temperature = _as_float("temperature", self.temperature, minimum=0.0, maximum=MAX_TEMPERATURE)
        if self.top_k is None:
            self.top_k = -1
        self.top_k = _as_int("top_k", self.top_k, minimum=-1, maximum=MAX_TOP_K)
        if self.top_k == 0:
            self.top_k = -1
        self.top_p = _as_float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        self.min_p = _as_float("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            self.seed = _as_int("seed", self.seed)
        for name in ("presence_penalty", "frequency_penalty"):
            value = _as_float(name, getattr(self, name))
            if not -MAX_ABS_PENALTY <= value <= MAX_ABS_PENALTY:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
            setattr(self, name, value)
        self.repetition_penalty = _as_float("repetition_penalty", self.repetition_penalty)
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ValueError(f"repetition_penalty must be in [{MIN_REPETITION_PENALTY}, "
                             f"{MAX_REPETITION_PENALTY}], got {self.repetition_penalty}")
        self.stop = _as_stop_strings(self.stop)
        self.stop_token_ids = _as_token_ids("stop_token_ids", self.stop_token_ids)
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output",
                     "spaces_between_special_tokens", "detokenize"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                setattr(self, name, _as_int(name, getattr(self, name), minimum=0, maximum=MAX_LOGPROBS))
        if self.truncate_prompt_tokens is not None:
            self.truncate_prompt_tokens = _as_int("truncate_prompt_tokens", self.truncate_prompt_tokens,
                                                  minimum=-1)
            if self.truncate_prompt_tokens == 0:
                raise ValueError("truncate_prompt_tokens must be -1 or >= 1, got 0")
        if isinstance(self.structured_outputs, Mapping):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs,
                                                                  StructuredOutputsParams):
            raise ValueError("structured_outputs must be StructuredOutputsParams or a mapping, "
                             f"got {type(self.structured_outputs).__name__}")
        self.logit_bias = _as_logit_bias(self.logit_bias)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _as_token_ids("allowed_token_ids", self.allowed_token_ids)
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty (leave it unset to allow every token)")
            if self.structured_outputs is not None:
                raise ValueError("allowed_token_ids cannot be combined with structured_outputs: "
                                 "express the allowed tokens in the grammar")
        if self.bad_words is not None:
            self.bad_words = [_as_word(word) for word in _as_list_of("bad_words", self.bad_words)] or None
        if self.cache_salt is not None and not (isinstance(self.cache_salt, str) and self.cache_salt):
            raise ValueError(f"cache_salt must be a non-empty string, got {self.cache_salt!r}")
        if not self.detokenize and self.stop:
            raise ValueError("stop strings are found in the output's text: they need detokenize")
        self._check_beam_search()

    def _check_beam_search(self) -> None:
        if not isinstance(self.use_beam_search, bool):
            raise ValueError(f"use_beam_search must be a bool, got {self.use_beam_search!r}")
        self.length_penalty = _as_float("length_penalty", self.length_penalty)
        if not -MAX_ABS_LENGTH_PENALTY <= self.length_penalty <= MAX_ABS_LENGTH_PENALTY:
            raise ValueError(f"length_penalty must be in [-{MAX_ABS_LENGTH_PENALTY:g}, {MAX_ABS_LENGTH_PENALTY:g}], "
                             f"got {self.length_penalty}")
        if not (isinstance(self.early_stopping, bool) or self.early_stopping == "never"):
            raise ValueError(f"early_stopping must be true, false or \"never\", got {self.early_stopping!r}")
        if not self.use_beam_search:
            if self.length_penalty != 1.0 or self.early_stopping is not False:
                name = "length_penalty" if self.length_penalty != 1.0 else "early_stopping"
                raise ValueError(f"{name} applies to beam search only: set use_beam_search")
            return
        unsupported = [name for name, is_set in (
            ("temperature", self.temperature != 0.0),
            ("top_p", self.top_p != 1.0),
            ("top_k", self.top_k != -1),
            ("min_p", self.min_p != 0.0),
            ("presence_penalty", self.presence_penalty != 0.0),
            ("frequency_penalty", self.frequency_penalty != 0.0),
            ("repetition_penalty", self.repetition_penalty != 1.0),
            ("stop", bool(self.stop)),
            ("min_tokens", self.min_tokens != 0),
            ("logprobs", self.logprobs is not None),
            ("prompt_logprobs", self.prompt_logprobs is not None),
            ("structured_outputs", self.structured_outputs is not None),
            ("logit_bias", self.logit_bias is not None),
            ("allowed_token_ids", self.allowed_token_ids is not None),
            ("bad_words", self.bad_words is not None),
            ("detokenize", not self.detokenize),
        ) if is_set]
        if unsupported:
            raise ValueError(f"{unsupported[0]} cannot be used with use_beam_search: beam search keeps the "
                             "n most likely continuations of the raw log-probabilities (temperature 0), "
                             f"so it does not honour {', '.join(unsupported)}")

    @property
    def is_greedy(self) -> bool:
        """True when sampling is a deterministic argmax."""
        return self.temperature < GREEDY_TEMPERATURE_EPS

    def check_token_ids(self, vocab_size: int) -> None:
        """ValueError naming the field if a ``logit_bias`` or ``allowed_token_ids`` id is
        outside a vocabulary of ``vocab_size`` tokens (not known when the params are built)."""
        for name, ids in (("logit_bias", self.logit_bias or ()), ("allowed_token_ids", self.allowed_token_ids or ())):
            outside = [t for t in ids if t >= vocab_size]
            if outside:
                raise ValueError(f"{name} token ids must be in [0, {vocab_size}); got {outside[:5]}")

    @property
    def biases_logits(self) -> bool:
        """True when ``logit_bias`` or ``allowed_token_ids`` changes the logits."""
        return self.logit_bias is not None or self.allowed_token_ids is not None

    @property
    def has_penalties(self) -> bool:
        """True when any of the repetition/presence/frequency penalties is active."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain-data view (msgpack/JSON friendly); ``from_dict`` inverts it."""
        data = {name: _copy_plain(getattr(self, name)) for name in _public_field_names()}
        if self.structured_outputs is not None:
            data["structured_outputs"] = self.structured_outputs.to_dict()
        return data

    @classmethod
    def from_dict(cls, options: Mapping[str, Any]) -> SamplingParams:
        """Build from a mapping, raising ValueError that names any unknown key."""
        if not isinstance(options, Mapping):
            raise ValueError(f"sampling options must be a mapping, got {type(options).__name__}")
        known = _public_field_names()
        unknown = sorted(str(key) for key in options if key not in known)
        if unknown:
            raise ValueError(
                f"unknown sampling option(s): {', '.join(unknown)}; "
                f"known options: {', '.join(known)}"
            )
        return cls(**options)


@dataclass
class BeamSearchParams:
    """vLLM's ``BeamSearchParams``: ``beam_width`` beams, up to ``max_tokens`` output tokens.

    ``temperature`` must be 0: beam search keeps the most likely continuations
    of the raw log-probabilities (transformers' ``do_sample=False``).
    ``early_stopping`` is transformers' stopping rule (True, False or "never").
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    early_stopping: bool | str = False

    def to_sampling_params(self) -> SamplingParams:
        """The engine's request options (``ValueError`` naming a bad field)."""
        return SamplingParams(n=self.beam_width, max_tokens=self.max_tokens, ignore_eos=self.ignore_eos,
                              temperature=self.temperature, length_penalty=self.length_penalty,
                              include_stop_str_in_output=self.include_stop_str_in_output,
                              early_stopping=self.early_stopping, use_beam_search=True)


def _public_field_names() -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(SamplingParams))


def _copy_plain(value: Any) -> Any:
    if isinstance(value, list):
        return [_copy_plain(item) for item in value]
    if isinstance(value, dict):
        return {key: _copy_plain(item) for key, item in value.items()}
    return value


def _as_int(name: str, value: Any, minimum: int | None = None, maximum: int | None = None) -> int:
    if type(value) is not int:   # the ABC check costs a request several microseconds a field
        if isinstance(value, bool) or not isinstance(value, Integral):
            raise ValueError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
        value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")
    return value


def _as_float(name: str, value: Any, minimum: float | None = None, maximum: float | None = None) -> float:
    if type(value) is not float:
        if isinstance(value, bool) or not isinstance(value, Real):
            raise ValueError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
        value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum:.4g}, got {value:g}")
    return value


def _as_list_of(name: str, value: Any) -> list:
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise ValueError(f"{name} must be a list, got {type(value).__name__}")
    return list(value)


def _as_word(word: Any) -> str:
    if not isinstance(word, str) or not word.strip():
        raise ValueError(f"bad_words must be non-blank strings, got {word!r}")
    return word


def _as_stop_strings(stop: Any) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (list, tuple)):
        raise ValueError(f"stop must be a string or a list of strings, got {type(stop).__name__}")
    for item in stop:
        if not isinstance(item, str):
            raise ValueError(f"stop must contain only strings, got {item!r}")
        if not item:
            raise ValueError("stop strings must be non-empty")
    return list(stop)


def _as_logit_bias(bias: Any) -> dict[int, float] | None:
    """Token id -> finite bias; keys may be ints or their decimal text (JSON's keys)."""
    if bias is None:
        return None
    if not isinstance(bias, Mapping):
        raise ValueError(f"logit_bias must be a mapping of token ids to floats, got {type(bias).__name__}")
    result: dict[int, float] = {}
    for key, value in bias.items():
        if isinstance(key, str) and key.strip().lstrip("-").isdigit():
            key = int(key)
        result[_as_int("logit_bias token id", key, minimum=0)] = _as_float("logit_bias value", value)
    return result or None


def _as_token_ids(name: str, token_ids: Any) -> list[int]:
    if token_ids is None:
        return []
    if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, (list, tuple)):
        raise ValueError(f"{name} must be a list of ints, got {type(token_ids).__name__}")
    return [_as_int(name, token_id, minimum=0) for token_id in token_ids]
