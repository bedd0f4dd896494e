"""HTTP errors in OpenAI's JSON shape, and the one place runtime errors become statuses.

Every error a client can see leaves through ``ApiError.to_body()``::

    {"error": {"message": "...", "type": "invalid_request_error", "param": "n", "code": null}}

``api_error_for(exc)`` maps the runtime's error family (``actors.errors``) to an
``ApiError``; routes never pick a status for a runtime error themselves (house style:
errors in families, translated at the boundary in one place).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from actors import AdmissionError, ContextTooLong, InvalidRequest, QueueFull, RuntimeShutDown


@dataclass(slots=True)
class ApiError(Exception):
    """An error answered to the client with ``status`` and OpenAI's error body."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        return self.message

    def to_body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def bad_request(message: str, *, param: str | None = None, code: str | None = None) -> ApiError:
    """A 400 ``invalid_request_error``: the request can never be served as sent."""
    return ApiError(400, message, param=param, code=code)


CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


def context_too_long(message: str, *, param: str = "messages") -> ApiError:
    """A 400 for a prompt the context cannot hold; ``param`` is ``prompt`` on
    ``/v1/completions``."""
    return ApiError(400, message, param=param, code=CONTEXT_LENGTH_EXCEEDED)


def model_not_found(model: str) -> ApiError:
    return ApiError(
        404,
        f"The model '{model}' does not exist on this server.",
        type="invalid_request_error",
        param="model",
        code="model_not_found",
    )


def unauthorized(message: str) -> ApiError:
    return ApiError(
        401,
        message,
        type="authentication_error",
        code="invalid_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )


def unsupported_media_type(content_type: str) -> ApiError:
    """A 415: the body of a POST is not declared as UTF-8 JSON."""
    sent = f"'{content_type}'" if content_type else "no Content-Type header"
    return ApiError(415, f"Unsupported media type ({sent}): send the request body with the "
                         "header 'Content-Type: application/json'.",
                    param="Content-Type", code="unsupported_media_type")


def shutting_down() -> ApiError:
    return ApiError(
        503,
        "The server is shutting down and admits no new request.",
        type="service_unavailable",
        code="shutting_down",
    )


def api_error_for(exc: AdmissionError) -> ApiError:
    """Map one runtime admission error to its HTTP answer (the only such mapping)."""
    if isinstance(exc, QueueFull):
        retry = max(1, int(exc.retry_after_s))
        return ApiError(
            429,
            str(exc) or "The admission queue is full; retry later.",
            type="rate_limit_error",
            code="queue_full",
            headers={"Retry-After": str(retry)},
        )
    if isinstance(exc, ContextTooLong):
        return context_too_long(str(exc))
    if isinstance(exc, RuntimeShutDown):
        return shutting_down()
    if isinstance(exc, InvalidRequest):
        return bad_request(str(exc))
    # An AdmissionError subclass added later without a mapping is still the client's
    # request being refused, never a server fault.
    return bad_request(str(exc) or type(exc).__name__)


def too_many_preparing(limit: int) -> ApiError:
    """429 for a client with ``limit`` large requests already being parsed or tokenized."""
    return ApiError(429, f"This client already has {limit} large requests being prepared; "
                    "retry when one of them is answered.", type="rate_limit_error",
                    code="too_many_requests", headers={"Retry-After": "1"})


def internal_error(message: str = "The server failed to process the request.") -> ApiError:
    return ApiError(500, message, type="server_error", code="internal_error")
