"""Errors the KV manager raises. Every one leaves the manager's state untouched."""


class KVManagerError(Exception):
    """Base class for refused KV manager operations."""


class NoFreeBlocksError(KVManagerError):
    """The pool cannot supply the blocks an operation needs."""


class UnknownSequenceError(KVManagerError, KeyError):
    """An operation named a sequence the manager does not hold."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else "unknown sequence"


class UnknownWorkerError(KVManagerError, KeyError):
    """An operation named a worker the manager does not hold."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown worker"


class DoubleFreeError(KVManagerError):
    """A block was freed more times than it was allocated."""


class IntegrityError(KVManagerError):
    """``check_integrity()`` found the accounting inconsistent."""


class WireFormatError(KVManagerError, ValueError):
    """A message on the worker <-> central KV wire is truncated, malformed or of another version."""
