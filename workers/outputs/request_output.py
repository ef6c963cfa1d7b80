"""The outputs callers get (vLLM's shapes): ``RequestOutput`` with one ``CompletionOutput`` per
sample, ``SampleLogprobs`` and ``RequestMetrics``. Plain data: no engine, no torch, so the handle,
the API and the wire load them alone."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SampleLogprobs:
    """Logprob of the sampled token and the ``top`` most likely alternatives."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


class ListPrefix:
    """The first ``length`` items of an append-only list, copied only when read.

    Outputs hold these instead of copies of a sequence's growing lists, so
    building a step's outputs costs O(new items), not O(length); the list
    must only ever grow while a prefix of it is held.
    """

    __slots__ = ("_items", "_length")

    def __init__(self, items: list, length: int | None = None) -> None:
        self._items = items
        self._length = len(items) if length is None else length

    def __len__(self) -> int:
        return self._length

    def copy(self) -> list:
        return self._items[:self._length]


class TextPrefix(ListPrefix):
    """The text of the first ``length`` pieces of an append-only list of strings."""

    __slots__ = ()

    def copy(self) -> str:
        return "".join(self._items[:self._length])


class _CopiedOnRead:
    """A field that may hold a ``ListPrefix``/``TextPrefix``: its copy replaces it on first read."""

    def __set_name__(self, owner, name: str) -> None:
        self.slot = "_" + name

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        value = getattr(obj, self.slot)
        if isinstance(value, ListPrefix):
            value = value.copy()
            setattr(obj, self.slot, value)
        return value

    def __set__(self, obj, value) -> None:
        setattr(obj, self.slot, value)


@dataclass
class RequestMetrics:
    """Per-request timing and token counts (seconds, wall clock)."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    kv_transfer_bytes: int = 0
    kv_transfer_s: float = 0.0      # object-store fetch plus the write into the cache
    kv_memcpy_s: float = 0.0        # a local copy of the same bytes, timed in the same run

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


class CompletionOutput:
    """One of a request's ``n`` samples. ``text``/``token_ids``/``logprobs`` are cumulative;
    ``delta_text``/``delta_token_ids``/``delta_logprobs`` are what is new since the previous
    output, and ``is_newly_finished`` is true on the one output that first reports its finish.

    The cumulative fields may be given as ``TextPrefix``/``ListPrefix`` of the producer's
    growing lists: they are copied on first read (a consumer reading only deltas, and
    ``num_tokens``, never pays for them), and later outputs never change them.
    """

    text: str = _CopiedOnRead()
    token_ids: list[int] = _CopiedOnRead()
    logprobs: list[SampleLogprobs] | None = _CopiedOnRead()

    def __init__(self, index: int, text: str | TextPrefix, token_ids: list[int] | ListPrefix,
                 cumulative_logprob: float | None, logprobs: list[SampleLogprobs] | ListPrefix | None,
                 finish_reason: str | None = None, stop_reason: str | int | None = None,
                 delta_text: str = "", delta_token_ids: list[int] | None = None,
                 delta_logprobs: list[SampleLogprobs] | None = None, is_newly_finished: bool = False) -> None:
        self.index = index
        # The copied-on-read fields' slots, set directly (the descriptor's __set__ is a call each).
        self._text = text
        self._token_ids = token_ids
        self.cumulative_logprob = cumulative_logprob
        self._logprobs = logprobs
        self.finish_reason = finish_reason
        self.stop_reason = stop_reason
        self.delta_text = delta_text
        self.delta_token_ids = [] if delta_token_ids is None else delta_token_ids
        self.delta_logprobs = delta_logprobs
        self.is_newly_finished = is_newly_finished

    @property
    def num_tokens(self) -> int:
        """``len(token_ids)``, without copying them."""
        return len(self._token_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def _fields(self) -> dict:
        names = ("index", "text", "token_ids", "cumulative_logprob", "logprobs", "finish_reason",
                 "stop_reason", "delta_text", "delta_token_ids", "delta_logprobs", "is_newly_finished")
        return {name: getattr(self, name) for name in names}

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CompletionOutput):
            return NotImplemented
        return self._fields() == other._fields()

    __hash__ = None  # mutable, like the dataclass it replaces

    def __repr__(self) -> str:
        return "CompletionOutput(" + ", ".join(f"{k}={v!r}" for k, v in self._fields().items()) + ")"

    def __reduce__(self):
        return (_completion_output, (self._fields(),))


def _completion_output(fields: dict) -> CompletionOutput:
    return CompletionOutput(**fields)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    # With params.prompt_logprobs: one entry per prompt token (the first None), in
    # every output once all are computed (None before).
    prompt_logprobs: list[SampleLogprobs | None] | None = None
    # Set when the KV manager migrated the request away (finish_reason "migrated"):
    # its KV transfer and the worker that has room for it.
    kv_transfer: object | None = None
    migrate_to: str | None = None
