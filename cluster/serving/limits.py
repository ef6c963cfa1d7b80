"""Admission limits of one replica: requests in flight, overall and per client.

Both answer a request over the limit with a 429 ``APIError`` carrying
``Retry-After``; a batch counts each of its prompts.
"""

from __future__ import annotations

from .errors import RETRY_AFTER_S, APIError


class RequestLimiter:
    """Admits at most ``max_in_flight`` unfinished requests (a batch counts each prompt);
    beyond that, a 429 with ``Retry-After``."""

    def __init__(self, max_in_flight: int) -> None:
        self.max_in_flight = max_in_flight
        self.num_in_flight = 0
        self.num_admitted = 0

    def acquire(self, num_requests: int = 1) -> None:
        if self.num_in_flight + num_requests > self.max_in_flight:
            raise APIError(429, f"the server is busy ({self.num_in_flight} requests queued or running, "
                                f"limit {self.max_in_flight}); retry later", "rate_limit_error",
                           code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)})
        self.num_in_flight += num_requests
        self.num_admitted += num_requests

    def release(self, num_requests: int = 1) -> None:
        self.num_in_flight = max(0, self.num_in_flight - num_requests)


class ClientLimiter:
    """Admits at most ``max_per_client`` unfinished requests per client key; beyond that, a 429."""

    def __init__(self, max_per_client: int) -> None:
        self.max_per_client = max_per_client
        self.num_in_flight: dict[str, int] = {}

    def acquire(self, client: str, num_requests: int = 1) -> None:
        current = self.num_in_flight.get(client, 0)
        if current + num_requests > self.max_per_client:
            raise APIError(429, f"too many concurrent requests from this client ({current} unfinished, "
                                f"limit {self.max_per_client}); retry later", "rate_limit_error",
                           code="client_limit", headers={"Retry-After": str(RETRY_AFTER_S)})
        self.num_in_flight[client] = current + num_requests

    def release(self, client: str, num_requests: int = 1) -> None:
        remaining = self.num_in_flight.get(client, 0) - num_requests
        if remaining > 0:
            self.num_in_flight[client] = remaining
        else:
            self.num_in_flight.pop(client, None)
