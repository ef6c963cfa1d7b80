"""Ray actor calls as the transport of a worker's ``KVPublisher`` (``kvmanager.publisher``).

``send`` is a fire-and-forget ``.remote()``; ``poll`` reads ended calls without
waiting; only ``call`` (the rare preemption decision) blocks, with its own
timeout. Calls from one worker reach the actor in order.

A worker is an async actor, and Ray warns at any ``ray.get`` in such a process
(it would block the event loop there). None of these calls runs on the event
loop (the sender thread, the engine thread), and none uses ``ray.get``: each call
is followed through the future Ray completes when its reply arrives
(``ObjectRef.future()``), so reading a reply never asks Ray for it again.
"""

from __future__ import annotations

import concurrent.futures


class RayCall:
    """A call in flight: its object ref (kept alive until the reply is read) and its future."""

    __slots__ = ("ref", "future")

    def __init__(self, ref) -> None:
        self.ref = ref
        self.future = ref.future()


def call_result(ref, timeout_s: float):
    """The reply of the call ``ref``, waiting at most ``timeout_s`` (``TimeoutError`` after
    that; the call's own error, as ``ray.get`` would raise it, if it failed). For threads of
    an async actor other than its event loop."""
    return ref.future().result(timeout=timeout_s)


class RayTransport:
    """A ``KVTransport`` over the central ``KVManagerService`` actor handle."""

    def __init__(self, actor) -> None:
        self.actor = actor

    def send(self, method: str, packed: bytes, want_ack: bool = True) -> RayCall:
        return RayCall(getattr(self.actor, method).remote(packed))

    def poll(self, tokens: list) -> list:
        ended = []
        for token in tokens:
            if not token.future.done():
                continue
            error = token.future.exception()  # the actor died (Ray restarts it) or the call raised
            ended.append((token, None if error is not None else token.future.result(), error))
        return ended

    def wait(self, tokens: list, timeout_s: float) -> None:
        if tokens:
            concurrent.futures.wait([token.future for token in tokens], timeout=timeout_s)

    def ready(self, tokens: list) -> list:
        """The tokens whose calls have ended, without taking their replies."""
        return [token for token in tokens if token.future.done()]

    def stats(self) -> dict:
        return {"kv_transport": "ray"}

    def call(self, method: str, packed: bytes, timeout_s: float) -> bytes:
        return call_result(getattr(self.actor, method).remote(packed), timeout_s)
