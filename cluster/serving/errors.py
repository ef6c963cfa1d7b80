"""The client-visible error model: ``APIError`` (HTTP status plus OpenAI's error
fields) and the mapping of every other failure onto it.

Both transports report these: HTTP as OpenAI's error body with the status,
gRPC as the status code of ``grpc_service.STATUS_CODES``.
"""

from __future__ import annotations

import logging

from pydantic import ValidationError

from ..handle import NoCapacityError
from ..request_flow import RepeatedEngineFailure, StreamNotResumable
from .protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger("pagedserve.server")

RETRY_AFTER_S = 1


class APIError(Exception):
    """A client-visible failure: HTTP status plus OpenAI's error fields."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def __reduce__(self):
        return APIError, (self.status, self.message, self.type, self.param, self.code, self.headers)

    def body(self) -> dict:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param,
                                             code=self.code)).model_dump()


def error_from_exception(exc: BaseException) -> APIError:
    """Map a failure of a generation to the error the client sees."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, NoCapacityError):
        return APIError(503, f"no worker can take the request: {exc}", "service_unavailable_error",
                        code="no_capacity", headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(exc, StreamNotResumable):
        return APIError(503, str(exc), "service_unavailable_error", code="worker_failed")
    if isinstance(exc, RepeatedEngineFailure):
        return APIError(500, str(exc), "internal_server_error", code="engine_failed")
    cause = getattr(exc, "cause", None)  # a RayTaskError carries the worker's exception
    if isinstance(cause, (ValueError, TypeError)):
        exc = cause
    if isinstance(exc, (ValueError, TypeError)):
        return APIError(400, str(exc))
    logger.error("request failed: %r", exc)
    return APIError(500, f"internal error: {type(exc).__name__}", "internal_server_error")


def timeout_error(message: str, code: str) -> APIError:
    return APIError(408, message, "timeout_error", code=code)


def _is_union_tag(part) -> bool:
    """pydantic names the union member an error came from in ``loc`` (``list[int]``, ``TextPart``)."""
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool")
                                      or part[:1].isupper() or part.startswith("function-"))


def validation_error(exc: ValidationError) -> APIError:
    """A 400 naming every invalid field (the first one as ``param``)."""
    problems: dict[str, list[str]] = {}
    for error in exc.errors():
        loc = ".".join(str(p) for p in error["loc"] if not _is_union_tag(p))
        message = "unknown field" if error["type"] == "extra_forbidden" else error["msg"]
        messages = problems.setdefault(loc, [])
        if message not in messages:
            messages.append(message)
    text = "; ".join(f"{loc}: {' or '.join(msgs)}" if loc else " or ".join(msgs)
                     for loc, msgs in problems.items())
    return APIError(400, f"invalid request: {text}", param=next(iter(problems), None) or None)
