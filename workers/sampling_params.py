"""Per-request sampling options, named and defaulted like vLLM's ``SamplingParams``.

The object is plain data (ints, floats, bools, lists of str/int) so it pickles and
round-trips through msgpack via ``to_dict``/``from_dict``. Construction validates
every field and raises ``ValueError`` with a message naming the field, so the
ingress can turn a bad request into a clear client error.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from numbers import Integral, Real
from typing import Any

# Temperatures below this are treated as greedy decoding (vLLM uses the same cut-off).
GREEDY_TEMPERATURE_EPS = 1e-5
MAX_LOGPROBS = 20
MAX_ABS_PENALTY = 2.0
# Bounds that stay finite in float32 logits (1e-300 is 0 there and would divide by zero).
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 100.0


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

    def __post_init__(self) -> None:
        self.n = _as_int("n", self.n, minimum=1)
        self.max_tokens = _as_int("max_tokens", self.max_tokens, minimum=1)
        self.temperature = _as_float("temperature", self.temperature, minimum=0.0)
        if self.top_k is None:
            self.top_k = -1
        self.top_k = _as_int("top_k", self.top_k, minimum=-1)
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
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.logprobs is not None:
            self.logprobs = _as_int("logprobs", self.logprobs, minimum=0, maximum=MAX_LOGPROBS)

    @property
    def is_greedy(self) -> bool:
        """True when sampling is a deterministic argmax."""
        return self.temperature < GREEDY_TEMPERATURE_EPS

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
        return {name: _copy_plain(getattr(self, name)) for name in _public_field_names()}

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


def _public_field_names() -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(SamplingParams) )


def _copy_plain(value: Any) -> Any:
    return list(value) if isinstance(value, list) else value


def _as_int(name: str, value: Any, minimum: int | None = None, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise ValueError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")
    return value


def _as_float(name: str, value: Any, minimum: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, Real):
        raise ValueError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


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


def _as_token_ids(name: str, token_ids: Any) -> list[int]:
    if token_ids is None:
        return []
    if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, (list, tuple)):
        raise ValueError(f"{name} must be a list of ints, got {type(token_ids).__name__}")
    return [_as_int(name, token_id, minimum=0) for token_id in token_ids]
