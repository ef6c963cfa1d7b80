"""Ray actor calls as the transport of a worker's ``KVPublisher`` (``kvmanager.publisher``).

``send`` is a fire-and-forget ``.remote()``; ``poll`` reads ended calls with
``ray.wait(timeout=0)``; only ``call`` (the rare preemption decision) blocks,
with its own timeout. Calls from one worker reach the actor in order.
"""

from __future__ import annotations


class RayTransport:
    """A ``KVTransport`` over the central ``KVManagerService`` actor handle."""

    def __init__(self, actor) -> None:
        self.actor = actor

    def send(self, method: str, packed: bytes, want_ack: bool = True):
        return getattr(self.actor, method).remote(packed)

    def poll(self, tokens: list) -> list:
        import ray

        if not tokens:
            return []
        ready, _ = ray.wait(tokens, num_returns=len(tokens), timeout=0)
        ended = []
        for ref in ready:
            try:
                ended.append((ref, ray.get(ref, timeout=0), None))
            except Exception as exc:  # the actor died (Ray restarts it) or the call raised
                ended.append((ref, None, exc))
        return ended

    def wait(self, tokens: list, timeout_s: float) -> None:
        import ray

        if tokens:
            ray.wait(tokens, num_returns=len(tokens), timeout=timeout_s)

    def ready(self, tokens: list) -> list:
        """The tokens whose calls have ended, without taking their replies."""
        import ray

        return ray.wait(tokens, num_returns=len(tokens), timeout=0)[0] if tokens else []

    def stats(self) -> dict:
        return {"kv_transport": "ray"}

    def call(self, method: str, packed: bytes, timeout_s: float) -> bytes:
        import ray

        return ray.get(getattr(self.actor, method).remote(packed), timeout=timeout_s)
