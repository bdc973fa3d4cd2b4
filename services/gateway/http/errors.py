"""The gateway's one error tree, rendered in the SDK's `{"error": ..., "category": ...}` shape.

Status and category are class attributes. Never 409 for a permanent error: the SDK retries 409
for minutes. Overload is 429 with Retry-After, which the SDK backs off and retries.
"""

from __future__ import annotations

import logging
from typing import ClassVar

import msgspec
import nats.errors
from litestar import Request, Response
from litestar.exceptions import HTTPException, NotFoundException, ValidationException

log = logging.getLogger("tinkerd.gateway")


class TinkerError(Exception):
    status: ClassVar[int] = 500
    category: ClassVar[str] = "server"

    def __init__(self, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.headers = headers or {}


class BadRequest(TinkerError):
    status = 400
    category = "user"


class Unauthorized(TinkerError):
    status = 401
    category = "user"


class Forbidden(TinkerError):
    status = 403
    category = "user"


class NotFound(TinkerError):
    """Unknown, or owned by another tenant: the two are indistinguishable on purpose."""

    status = 404
    category = "user"


class Gone(TinkerError):
    """A result past its retention: it is never executed again."""

    status = 410
    category = "user"


class PayloadTooLarge(TinkerError):
    status = 413
    category = "user"


class Conflict(TinkerError):
    """The same identity with different content (a permanent error, so 422 and never 409)."""

    status = 422
    category = "user"


class Overloaded(TinkerError):
    status = 429
    category = "server"

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message, {"Retry-After": str(retry_after_s)})


class NotOffered(TinkerError):
    """A known endpoint this server does not offer: 400, never 501 (the SDK retries any 5xx)."""

    status = 400
    category = "user"


class Unavailable(TinkerError):
    status = 503
    category = "server"


class ErrorBody(msgspec.Struct):
    error: str
    category: str


def _respond(
    status: int, message: str, category: str, headers: dict[str, str] | None = None
) -> Response[ErrorBody]:
    return Response(ErrorBody(error=message, category=category), status_code=status, headers=headers)


def handle_tinker_error(_: Request, exc: TinkerError) -> Response[ErrorBody]:
    return _respond(exc.status, exc.message, exc.category, exc.headers)


def handle_validation(_: Request, exc: ValidationException) -> Response[ErrorBody]:
    detail = exc.detail
    extra = exc.extra
    if isinstance(extra, list) and extra:
        parts = []
        for item in extra:
            if isinstance(item, dict):
                key = item.get("key") or item.get("source") or ""
                parts.append(f"{item.get('message', '')} ({key})" if key else str(item.get("message", "")))
        if parts:
            detail = "; ".join(parts)
    return _respond(400, f"invalid request body: {detail}", "user")


def handle_http(_: Request, exc: HTTPException) -> Response[ErrorBody]:
    category = "user" if exc.status_code < 500 else "server"
    return _respond(exc.status_code, str(exc.detail), category, dict(exc.headers or {}))


def handle_not_found(_: Request, exc: NotFoundException) -> Response[ErrorBody]:
    return _respond(404, str(exc.detail), "user")


def handle_decode(_: Request, exc: msgspec.ValidationError | msgspec.DecodeError) -> Response[ErrorBody]:
    return _respond(400, f"invalid request body: {exc}", "user")


def handle_bus_down(_: Request, exc: nats.errors.Error) -> Response[ErrorBody]:
    log.warning("event log unavailable: %s: %s", type(exc).__name__, exc)
    return _respond(503, f"the event log is unavailable ({type(exc).__name__}); retry shortly", "server")


def handle_unexpected(request: Request, exc: Exception) -> Response[ErrorBody]:
    """Anything unforeseen still answers in the SDK's error shape (and is logged with its trace)."""
    log.error("unhandled %s on %s %s", type(exc).__name__, request.method, request.url.path, exc_info=exc)
    return _respond(500, f"internal error ({type(exc).__name__}); see the gateway log", "server")


EXCEPTION_HANDLERS = {
    Exception: handle_unexpected,
    nats.errors.Error: handle_bus_down,
    TinkerError: handle_tinker_error,
    ValidationException: handle_validation,
    NotFoundException: handle_not_found,
    HTTPException: handle_http,
    msgspec.ValidationError: handle_decode,
    msgspec.DecodeError: handle_decode,
}
