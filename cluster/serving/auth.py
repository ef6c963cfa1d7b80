"""API keys and client identity, shared by HTTP and gRPC.

With a key configured (``server.api_key``, else ``$PAGEDSERVE_API_KEY``),
every route but ``OPEN_PATHS`` needs ``Authorization: Bearer <key>``; the
dashboard checks it itself (it has a login form), and ``/metrics`` is open
when ``server.metrics_require_api_key`` is off.
"""

from __future__ import annotations

import hashlib
import hmac

from .errors import APIError

API_KEY_ENV = "PAGEDSERVE_API_KEY"
OPEN_PATHS = ("/health", "/ping")
SELF_AUTHENTICATED_PREFIXES = ("/dashboard",)  # the dashboard checks the key itself (login form)


def check_api_key(expected: str | None, authorization: str | None) -> None:
    """Raise a 401 ``APIError`` unless no key is configured or ``authorization`` is ``Bearer <key>``."""
    if not expected:
        return
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), expected.encode()):
        raise APIError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                       "authentication_error", code="invalid_api_key")


def client_key(authorization: str | None, address: str | None) -> str:
    """Who a request counts against: its bearer token (hashed), else its address."""
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return "key:" + hashlib.sha256(token.strip().encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return f"addr:{address or 'unknown'}"


def is_open_path(path: str, metrics_require_api_key: bool) -> bool:
    """True for the routes that answer without the API key."""
    if path in OPEN_PATHS or path.startswith(SELF_AUTHENTICATED_PREFIXES):
        return True
    return path == "/metrics" and not metrics_require_api_key
