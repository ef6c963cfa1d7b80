"""``KeySet``: the central index's set of 8-byte block-hash keys per worker and tier.

The native ``_keyset.KeySet`` (C, built by setup.py) stores keys inline in an
open-addressing table, 8 bytes a slot, and applies a batch straight from the
wire's packed little-endian keys (``add_packed``/``discard_packed``): no
Python int per key, about one cache miss per changed key. Where the
extension is missing, ``PyKeySet`` (a ``set`` of ints with the same methods)
takes its place, and that is logged once.

The interface, for ints in [0, 2**64): ``add``, ``discard``, ``update``,
``difference_update``, ``add_packed``, ``discard_packed``, ``clear``,
``intersection(iterable) -> set``, ``to_set()``, ``in``, ``len``,
iteration (ints, any order), equality with a set or another KeySet.
``keys_in(packed, container)``: the packed keys that are in ``container``,
as a list of ints.
"""

from __future__ import annotations

import logging

from .events import unpack_keys

logger = logging.getLogger(__name__)


class PyKeySet(set):
    """The pure-Python ``KeySet``: a set of ints plus the packed-key methods."""

    __slots__ = ()

    def add_packed(self, packed) -> None:
        self.update(unpack_keys(packed))

    def discard_packed(self, packed) -> None:
        self.difference_update(unpack_keys(packed))

    def to_set(self) -> set[int]:
        return set(self)


def py_keys_in(packed, container) -> list[int]:
    """The keys of ``packed`` (8-byte little-endian) that are in ``container``."""
    return [key for key in unpack_keys(packed) if key in container]


try:
    from ._keyset import KeySet, keys_in
    NATIVE = True
except ImportError as exc:   # not built (no compiler at install time): the Python set
    KeySet, keys_in, NATIVE = PyKeySet, py_keys_in, False
    logger.warning("pagedserve.kvmanager: the native key set is not built (%s); the central KV index "
                   "uses Python sets (3-4x the handler CPU per changed key). Reinstall with a C compiler to build it.",
                   exc)
