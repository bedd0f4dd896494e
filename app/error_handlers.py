"""Every error the server answers is OpenAI's JSON error body (``ApiError.to_body()``).

``register_error_handlers(app, service)`` formats the app's own errors: ``ApiError``,
werkzeug's HTTP errors (404, 405 with its ``Allow`` header, 408, 413, 415...) and any
unexpected exception (500, logged with its traceback, never its locals). Errors hypercorn
answers itself, before the app sees a request (400 for a malformed request, 431 for
header fields over ``h11_max_incomplete_size``), get the same body through
``install_protocol_error_bodies``.
"""

from __future__ import annotations

import json
from http import HTTPStatus
from itertools import chain
from time import time

import h11
import structlog
from hypercorn.protocol.events import Body, EndBody
from hypercorn.protocol.events import Response as StreamResponse
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.protocol.http_stream import ASGIHTTPState, HTTPStream
from quart import Quart, Response, request
from werkzeug.exceptions import HTTPException

from app.errors import ApiError, internal_error
from app.service import FlareService

log = structlog.get_logger("flare.app")

_HTTP_ERROR_TYPES = {
    400: ("invalid_request_error", "bad_request"),
    404: ("not_found_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    408: ("invalid_request_error", "request_timeout"),
    413: ("invalid_request_error", "request_too_large"),
    415: ("invalid_request_error", "unsupported_media_type"),
    431: ("invalid_request_error", "request_header_fields_too_large"),
}
# Headers of werkzeug's answer worth keeping (405 must say which methods are allowed).
_KEPT_HEADERS = ("Allow", "Retry-After", "WWW-Authenticate")


def _error_response(error: ApiError, service: FlareService) -> Response:
    service.metrics.http_errors.labels(str(error.status)).inc()
    return Response(json.dumps(error.to_body()), status=error.status,
                    headers=error.headers, mimetype="application/json")


def http_status_error(status: int, message: str | None = None) -> ApiError:
    """The ``ApiError`` for a plain HTTP status (no parameter to blame)."""
    kind, code = _HTTP_ERROR_TYPES.get(
        status, ("server_error", "internal_error") if status >= 500
        else ("invalid_request_error", None))
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        phrase = f"HTTP {status}"
    return ApiError(status, message or phrase, type=kind, code=code)


def register_error_handlers(app: Quart, service: FlareService) -> None:
    install_protocol_error_bodies()

    @app.errorhandler(ApiError)
    async def _api_error(error: ApiError) -> Response:
        if error.status == HTTPStatus.SERVICE_UNAVAILABLE:  # draining: expected, not a fault
            log.info("http.refused", status=error.status, code=error.code, path=request.path)
        elif error.status >= 500:
            log.error("http.error", status=error.status, message=error.message,
                      path=request.path)
        return _error_response(error, service)

    @app.errorhandler(HTTPException)
    async def _http_error(error: HTTPException) -> Response:
        status = error.code or 500
        message = error.description or error.name
        if status == 413:
            message = (f"The request body exceeds the limit of "
                       f"{service.settings.max_request_bytes} bytes.")
        api_error = http_status_error(status, message)
        kept = dict(error.get_headers())
        api_error.headers.update({k: v for k, v in kept.items() if k in _KEPT_HEADERS})
        response = _error_response(api_error, service)
        if status == 413:
            # The rest of an oversized (e.g. chunked) body is never read, so this
            # connection cannot carry another request: tell the client to reconnect
            # instead of letting its next request wait behind unread body bytes.
            response.headers["Connection"] = "close"
        return response

    @app.errorhandler(Exception)
    async def _unexpected(error: Exception) -> Response:
        log.exception("http.unhandled_exception", path=request.path)
        return _error_response(internal_error(), service)


def _json_error_body(status: int) -> bytes:
    message = {400: "The HTTP request is malformed.",
               431: "The request's header fields are too large."}.get(status)
    return json.dumps(http_status_error(status, message).to_body()).encode()


async def _h11_error_response(self: H11Protocol, status_code: int) -> None:
    body = _json_error_body(status_code)
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode()), (b"connection", b"close")]
    await self._send_h11_event(h11.Response(
        status_code=status_code,
        headers=list(chain(headers, self.config.response_headers("h11")))))
    await self._send_h11_event(h11.Data(data=body))
    await self._send_h11_event(h11.EndOfMessage())


async def _http_stream_error_response(self: HTTPStream, status_code: int) -> None:
    # hypercorn's own version, with the body (a 500 when the app ended without answering).
    body = _json_error_body(status_code)
    await self.send(StreamResponse(
        stream_id=self.stream_id, status_code=status_code,
        headers=[(b"content-type", b"application/json"),
                 (b"content-length", str(len(body)).encode()), (b"connection", b"close")]))
    await self.send(Body(stream_id=self.stream_id, data=body))
    await self.send(EndBody(stream_id=self.stream_id))
    self.state = ASGIHTTPState.CLOSED
    await self.config.log.access(self.scope, {"status": status_code, "headers": []},
                                 time() - self.start_time)


def install_protocol_error_bodies() -> None:
    """Give hypercorn's own error answers (pinned hypercorn 0.18) a JSON body; they are
    otherwise empty. Idempotent."""
    H11Protocol._send_error_response = _h11_error_response  # type: ignore[method-assign]
    HTTPStream._send_error_response = _http_stream_error_response  # type: ignore[method-assign]
