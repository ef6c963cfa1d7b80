"""One handle's news from an engine step, column by column: ``StreamBatch``.

The engine core makes one ``StreamBatch`` per output channel (per handle) per step and
sends it packed (``pack``: msgpack, a few lists of ints for the common case); the worker
actor forwards the bytes unopened; the handle unpacks it and reads the rows. Nothing in it
is a Python object per request: a step of 256 one-token streams packs into four lists.

A row is one sample's news: ``keys[i]`` names the stream (the handle's key for the
request, ``GenerateRequest.key``), ``indexes[i]`` the sample (None: every row is sample 0),
``token_ids[starts[i]:starts[i + 1]]`` its new tokens (``counts`` None: one token per row).
Everything rarer is sparse, keyed by row or by stream key: a sample's finish, its text
(only where the worker decodes it: stop strings), its logprobs, a request's metrics (when
a milestone moved, and at its end), its prompt logprobs (once), its end (``ends``: the
stream's last row is in this batch) and its error.

Sparse columns are lists of pairs, empty lists packed as None, so that a batch of plain
decoding rows packs to ``[keys, None, None, token_ids, None, ...]``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack

from .request_output import RequestMetrics, SampleLogprobs

# Positions in the packed list.
_FIELDS = ("keys", "indexes", "counts", "token_ids", "finishes", "texts", "logprobs", "ends", "metrics",
           "prompt_logprobs", "errors")
_METRIC_FIELDS = tuple(f.name for f in dataclasses.fields(RequestMetrics))


def pack_logprobs(logprobs: list[SampleLogprobs]) -> list:
    return [(lp.token_id, lp.logprob, lp.top) for lp in logprobs]


def unpack_logprobs(packed: list) -> list[SampleLogprobs]:
    return [SampleLogprobs(token_id, logprob, [tuple(t) for t in top]) for token_id, logprob, top in packed]


def pack_metrics(metrics: RequestMetrics) -> list:
    return [getattr(metrics, name) for name in _METRIC_FIELDS]


def unpack_metrics(packed: list) -> RequestMetrics:
    return RequestMetrics(*packed)


def milestones(metrics: RequestMetrics) -> tuple:
    """What of a request's metrics the handle needs as soon as it changes."""
    return (metrics.first_scheduled_time, metrics.first_token_time, metrics.num_cached_tokens,
            metrics.num_preemptions, metrics.kv_transfer_bytes, metrics.kv_transfer_s, metrics.kv_memcpy_s)


class StreamTarget:
    """Where a request's outputs go in the engine core (``Request.stream_target``): channel
    ``channel_id``'s batches, under the handle's ``key``; and what of its figures went out.

    Metrics go out on the first output, when a milestone moves (scheduled, first token,
    cached tokens, preemptions, KV transfer) and on the last: pickled or packed, they were
    half of a one-token output's bytes.
    """

    __slots__ = ("channel_id", "key", "sent_prompt_logprobs", "_sent_milestones")

    def __init__(self, channel_id: str, key: int) -> None:
        self.channel_id = channel_id
        self.key = key
        self.sent_prompt_logprobs = False
        self._sent_milestones: tuple | None = None

    def milestones_moved(self, metrics: RequestMetrics, is_finished: bool) -> bool:
        """Whether ``metrics`` go out now (and, if so, remember what they said)."""
        now = milestones(metrics)
        if now == self._sent_milestones and not is_finished:
            return False
        self._sent_milestones = now
        return True


class StreamBatch:
    """A step's rows for one channel (see the module docstring). Built by the engine core's
    output processor (``add``, ``end``, ...), read by the handle (``unpack`` and the columns)."""

    __slots__ = _FIELDS

    def __init__(self) -> None:
        self.keys: list[int] = []
        self.indexes: list[int] | None = None
        self.counts: list[int] | None = None
        self.token_ids: list[int] = []
        self.finishes: list[tuple[int, str, Any]] = []          # (row, finish_reason, stop_reason)
        self.texts: list[tuple[int, str]] = []                  # (row, text)
        self.logprobs: list[tuple[int, list, float]] = []       # (row, packed logprobs, cumulative)
        self.ends: list[tuple[int, int]] = []                   # (key, generated tokens in all)
        self.metrics: list[tuple[int, list]] = []               # (key, packed RequestMetrics)
        self.prompt_logprobs: list[tuple[int, list]] = []       # (key, [None or packed entry, ...])
        self.errors: list[tuple[int, str, str, str | None]] = []  # (key, kind, message, engine id)

    def __len__(self) -> int:
        return len(self.keys)

    def __bool__(self) -> bool:
        return bool(self.keys or self.ends or self.errors)

    # ---- building (the engine core) ------------------------------------------------------------
    def add(self, key: int, index: int, token_ids: list[int]) -> int:
        """A row: sample ``index`` of stream ``key`` made ``token_ids`` (maybe none: a finish or
        text alone). Returns the row, for the sparse columns."""
        row = len(self.keys)
        self.keys.append(key)
        if index:
            if self.indexes is None:
                self.indexes = [0] * row
        if self.indexes is not None:
            self.indexes.append(index)
        num = len(token_ids)
        if num != 1 and self.counts is None:
            self.counts = [1] * row
        if self.counts is not None:
            self.counts.append(num)
        self.token_ids += token_ids
        return row

    def end(self, key: int, num_generated_tokens: int) -> None:
        """Stream ``key`` ends with this batch (finished or aborted)."""
        self.ends.append((key, num_generated_tokens))

    def add_error(self, key: int, error: BaseException, engine_id: str | None = None) -> None:
        """Stream ``key`` ends with ``error`` (refused by the engine, or its engine died). A
        refusal (any ValueError or TypeError: a bad adapter, a transfer that does not fit) goes
        as its builtin base, which the handle rebuilds as a client error."""
        kind = ("ValueError" if isinstance(error, ValueError) else "TypeError" if isinstance(error, TypeError)
                else type(error).__name__)
        self.errors.append((key, kind, str(error), engine_id))

    def pack(self) -> bytes:
        return msgpack.packb([getattr(self, name) or None for name in _FIELDS])

    # ---- reading (the handle) --------------------------------------------------------------------
    @classmethod
    def unpack(cls, data: bytes | memoryview) -> "StreamBatch":
        batch = cls.__new__(cls)
        for name, value in zip(_FIELDS, msgpack.unpackb(data)):
            setattr(batch, name, value if value is not None or name in ("indexes", "counts") else [])
        return batch

    def starts(self) -> list[int]:
        """Where each row's tokens start in ``token_ids``, and the end (len(rows) + 1 entries)."""
        if self.counts is None:
            return list(range(len(self.keys) + 1))
        starts, at = [0], 0
        for count in self.counts:
            at += count
            starts.append(at)
        return starts

    def merge(self, later: "StreamBatch") -> None:
        """Append ``later``'s rows after these (a handle behind the engine gets several steps
        in one message)."""
        offset = len(self.keys)
        if later.indexes is not None and self.indexes is None:
            self.indexes = [0] * offset
        if self.indexes is not None:
            self.indexes += later.indexes if later.indexes is not None else [0] * len(later.keys)
        if later.counts is not None and self.counts is None:
            self.counts = [1] * offset
        if self.counts is not None:
            self.counts += later.counts if later.counts is not None else [1] * len(later.keys)
        self.keys += later.keys
        self.token_ids += later.token_ids
        self.finishes += [(row + offset, *rest) for row, *rest in later.finishes]
        self.texts += [(row + offset, text) for row, text in later.texts]
        self.logprobs += [(row + offset, *rest) for row, *rest in later.logprobs]
        for name in ("ends", "metrics", "prompt_logprobs", "errors"):
            getattr(self, name).extend(getattr(later, name))


__all__ = ["StreamBatch", "StreamTarget", "milestones", "pack_logprobs", "pack_metrics", "unpack_logprobs", "unpack_metrics"]
